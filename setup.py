"""Build script: the allocation core compiled with mypyc where a C compiler is at hand.

Everything else is in pyproject.toml. The modules in ``COMPILED`` are the hot path of every
allocation; mypyc turns them into C extensions from the same, fully typed source. Where
mypyc or a C compiler is missing, or ``GPUBUDGET_PURE=1`` is set, the package installs as
pure Python with the same behaviour (``gpubudget.compiled`` tells which one runs).
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup

COMPILED = [
    "gpubudget/units.py",
    "gpubudget/ledger.py",
    "gpubudget/arena.py",
    "gpubudget/streams.py",
    "gpubudget/recorder.py",
    "gpubudget/tree.py",
    "gpubudget/node.py",
]


def extensions() -> list[Any]:
    if os.environ.get("GPUBUDGET_PURE", "").strip() not in ("", "0"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []
    built: list[Any] = mypycify(COMPILED, opt_level="3")
    for extension in built:
        extension.optional = True  # no C compiler: a warning, and the pure-Python package
    return built


setup(ext_modules=extensions())
