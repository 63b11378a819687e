"""Build and load the stand-in TensorRT bindings of ``tests/trt_standin.c`` (tests only).

Each variant is a real extension module whose allocator classes have the layout of NVIDIA's
pybind11 trampolines, so gpubudget's probe inspects and drives them as it does the real ones:

- ``stream_third``: ``allocate_async(size, alignment, stream, flags)``, the order of
  TensorRT 10's bindings (the CPU tests use NVIDIA's own lean runtime 10.16 for it,
  tests/bindings.py; the GPU tests, where no lean runtime is installed, this stand-in);
- ``drops_stream``: ``allocate_async(size, alignment, flags, 0)`` and a
  ``reallocate_output_async`` without its stream: orders that cannot be established;
- ``drops_free_stream``: TensorRT-RTX's ``allocate_async`` order, but ``deallocate_async``
  without its stream;
- ``trt8``: TensorRT 8.5/8.6's layout (no ``IVersionedInterface``: fewer virtual methods, the
  destructors where TensorRT 10 has its allocator's methods); ``deletions()`` counts the calls
  of its deleting destructors.
"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Final

import pytest

SOURCE: Final = Path(__file__).with_name("trt_standin.c")
VARIANTS: Final = {"stream_third": "STREAM_THIRD", "drops_stream": "DROPS_STREAM",
                   "drops_free_stream": "DROPS_FREE_STREAM", "trt8": "TRT8"}


def build(variant: str, directory: Path) -> ModuleType:
    """Compile and import the stand-in ``variant`` as module ``trt_standin_<variant>``;
    skip the test if this machine has no C compiler, fail it if the compiler does."""
    name = f"trt_standin_{variant}"
    if name in sys.modules:
        return sys.modules[name]
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(compiler[0]) is None:
        pytest.skip(f"no C compiler ({compiler[0]}) to build the stand-in binding")
    target = directory / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    command = [*compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror",
               f"-I{sysconfig.get_paths()['include']}", f"-DSTANDIN_NAME={name}",
               f"-D{VARIANTS[variant]}", str(SOURCE), "-o", str(target)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"building the stand-in failed: {' '.join(command)}\n{done.stderr}")
    spec = importlib.util.spec_from_file_location(name, target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
