"""NVIDIA's own TensorRT bindings the tests run against, each under a test id naming it.

- ``rtx-1.7``: TensorRT-RTX 1.7 (``tensorrt_rtx_bindings``), installed by the ``dev`` extra;
- ``lean-10.16``, ``lean-11.4``: the lean runtime of TensorRT 10.16 and 11.4
  (``tensorrt_lean_bindings`` with its ``libnvinfer_lean``). Both versions have one module name,
  so neither goes into the virtual environment: each is installed into a directory of its own
  under ``$GPUBUDGET_TRT_BINDINGS`` (default ``.trt/`` in the checkout) by
  ``python -m tests.bindings install``, which ``.ci/run`` runs.

In the test process each lean version is loaded from its directory under a name of its own
(``tensorrt_lean_bindings_10_16``): the same files, NVIDIA's code unchanged, only the Python
module's name differs, so that both versions and TensorRT-RTX live in one process. A test that
needs the binding under its real name (a program of its own) runs a subprocess with
:func:`path_of` on ``PYTHONPATH``.

A binding that is not installed skips its tests, saying how to install it, unless
``GPUBUDGET_REQUIRE_TRT=1`` (CI), where it fails them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Final

import pytest

LEAN: Final = {"lean-10.16": "10.16.1.11", "lean-11.4": "11.4.0.106"}
"""The lean runtimes' test ids and the versions installed for them."""
RTX: Final = "rtx-1.7"
IDS: Final = (*LEAN, RTX)
"""Every real binding, by test id."""
STREAM_INDEX: Final = {"lean-10.16": 2, "lean-11.4": 3, RTX: 3}
"""Where each binding puts ``allocate_async``'s stream (10.x: third; from 11.2: fourth)."""
_REPO: Final = Path(__file__).resolve().parent.parent
_loaded: dict[str, ModuleType] = {}


def root() -> Path:
    """The directory holding one directory per lean version."""
    return Path(os.environ.get("GPUBUDGET_TRT_BINDINGS") or _REPO / ".trt")


def path_of(binding: str) -> Path:
    """The directory to put on ``sys.path`` for the lean ``binding``."""
    return root() / f"lean-{LEAN[binding]}"


def _missing(binding: str, why: str) -> ModuleType:
    message = f"{binding}: {why}"
    if os.environ.get("GPUBUDGET_REQUIRE_TRT") == "1":
        pytest.fail(message)
    pytest.skip(message)


def load(binding: str) -> ModuleType:
    """The module of ``binding`` (a test id of :data:`IDS`); skips (or fails, in CI) where it
    is not installed."""
    if binding in _loaded:
        return _loaded[binding]
    if binding == RTX:
        try:
            module = importlib.import_module("tensorrt_rtx_bindings")
        except ImportError as exc:
            return _missing(binding, f"tensorrt_rtx_bindings cannot be imported ({exc}); "
                            "pip install -e '.[dev]'")
    else:
        module = _load_lean(binding)
    _loaded[binding] = module
    return module


def _load_lean(binding: str) -> ModuleType:
    directory = path_of(binding)
    package = directory / "tensorrt_lean_bindings"
    if not (package / "__init__.py").is_file():
        return _missing(binding, f"not installed in {directory}; python -m tests.bindings install")
    name = "tensorrt_lean_bindings_" + binding.split("-", 1)[1].replace(".", "_")
    spec = importlib.util.spec_from_file_location(
        name, package / "__init__.py", submodule_search_locations=[str(package)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # its __init__ imports tensorrt_lean_libs (which loads libnvinfer_lean) by that name: the
    # one of this directory, then forgotten so that the other version finds its own
    sys.path.insert(0, str(directory))
    sys.modules.pop("tensorrt_lean_libs", None)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop("tensorrt_lean_libs", None)
    assert module.__version__ == LEAN[binding], (module.__version__, LEAN[binding])
    return module


@pytest.fixture(params=IDS, scope="module")
def binding(request: pytest.FixtureRequest) -> str:
    """Each real binding's test id in turn (the module is :func:`load`'s)."""
    name: str = request.param
    load(name)
    return name


def install() -> None:
    """Install every lean version missing from :func:`root` (pip's cache makes it quick)."""
    for binding, version in LEAN.items():
        directory = path_of(binding)
        if (directory / "tensorrt_lean_bindings" / "__init__.py").is_file():
            continue
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(directory), f"tensorrt-lean-cu12-libs=={version}",
                        f"tensorrt-lean-cu12-bindings=={version}"], check=True)
        print(f"{binding}: installed in {directory}")


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m tests.bindings install")
    install()
