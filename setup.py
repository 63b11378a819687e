"""Build script: the allocation core compiled with mypyc where a C compiler is at hand.

Everything else is in pyproject.toml. The modules of the allocation core (``CORE`` in
``gpubudget/core.py``, the one list) are the hot path of every allocation; mypyc turns them
into C extensions from the same, fully typed source. Where mypyc or a C compiler is missing,
or ``GPUBUDGET_PURE=1`` is set, the package installs as pure Python with the same behaviour
(``gpubudget.compiled`` tells which one runs; ``gpubudget/core.py`` says when a development
install runs its sources instead).
"""

from __future__ import annotations

import importlib.machinery
import os
import runpy
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

_PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpubudget")
_CORE = runpy.run_path(os.path.join(_PACKAGE, "core.py"))
COMPILED = [f"gpubudget/{name}.py" for name in _CORE["CORE"]]


class BuildExt(build_ext):
    """``build_ext`` that gives the extensions it puts beside the sources (an editable
    install) the time of this build: it copies them keeping their old times when nothing
    needed compiling again, and ``gpubudget/core.py`` would take them as older than sources
    edited since, though they were just built from those sources."""

    def copy_extensions_to_source(self) -> None:
        super().copy_extensions_to_source()
        for name in _CORE["CORE"]:
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                built = os.path.join(_PACKAGE, name + suffix)
                if os.path.exists(built):
                    os.utime(built)


def extensions() -> list[Any]:
    if _CORE["pure_asked"]():
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []
    built: list[Any] = mypycify(COMPILED, opt_level="3")
    for extension in built:
        extension.optional = True  # no C compiler: a warning, and the pure-Python package
    return built


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
