"""Build script: the C extensions (the allocation core, the trace scanner), where a C
compiler is at hand.

Everything else is in pyproject.toml. The C files of ``gpubudget/_core`` (one per concept,
named after the Python module each mirrors; ``native.h`` says which) are the hot path of
every allocation written in C against CPython's API, and ``gpubudget/tracefile/_scan.c``
reads (and replays) the common lines of trace files; they need nothing but a C compiler and
Python's headers. Where they are missing (the build fails: a warning), or
``GPUBUDGET_PURE=1`` is set, the package installs as pure Python with the same behaviour
(``gpubudget.compiled`` tells which runs; ``gpubudget/_core/__init__.py`` says when a development install runs its Python
core instead).
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup


def pure_asked() -> bool:
    return os.environ.get("GPUBUDGET_PURE", "").strip() not in ("", "0")


CORE = "gpubudget/_core"


def sources() -> list[str]:
    """The C core's files: every ``.c`` of ``gpubudget/_core`` (one per concept, beside the
    Python module it mirrors; ``_native.c`` makes the module)."""
    return sorted(f"{CORE}/{name}" for name in os.listdir(CORE) if name.endswith(".c"))


def extensions() -> list[Extension]:
    if pure_asked():
        return []
    flags = [] if sys.platform == "win32" else [
        "-O2", "-std=c11", "-Wall", "-Wno-missing-field-initializers", "-fvisibility=hidden"]
    return [Extension("gpubudget._core._native", sources(), depends=[f"{CORE}/native.h"],
                      extra_compile_args=flags, optional=True),
            Extension("gpubudget.tracefile._scan", ["gpubudget/tracefile/_scan.c"],
                      extra_compile_args=flags, optional=True)]


setup(ext_modules=extensions())
