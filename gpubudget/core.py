"""Which allocation core runs: compiled (mypyc) or from source, never a mix.

:data:`CORE` lists the modules of the allocation core; ``setup.py`` compiles them with mypyc
(one list, read by both). Compiled modules of one group call each other natively, so they
run all compiled or all from source. :func:`choose`, called by the package's ``__init__``
before any of them is imported, loads them all from their ``.py`` files (a finder put first
on ``sys.meta_path``) when:

- ``GPUBUDGET_PURE`` is set (not ``0``) when the program runs;
- in a source checkout (``setup.py`` beside the package: an editable install), a core
  module's ``.py`` is newer than its compiled extension (edited since the build), or some
  have an extension and others not: one ``RuntimeWarning`` says which and how to rebuild.

Installed from a wheel, the extensions run whenever they are there.
``gpubudget.compiled`` tells which core runs.

This module imports nothing from the package: ``setup.py`` runs it from its file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Final

__all__ = ["CORE", "PURE_ENV", "SourceFinder", "choose", "pure_asked"]

CORE: Final = ("ledger", "arena", "streams", "recorder", "memory", "tree", "node")
"""The modules of the allocation core (``gpubudget.<name>``), compiled by ``setup.py``."""
PURE_ENV: Final = "GPUBUDGET_PURE"
"""Set (not ``0``) at install: build no extension; at run time: run the core from source."""


def pure_asked() -> bool:
    """Whether :data:`PURE_ENV` asks for the pure-Python core."""
    return os.environ.get(PURE_ENV, "").strip() not in ("", "0")


class SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the core modules of ``package`` (in ``directory``) as their ``.py`` files."""

    def __init__(self, package: str, directory: str, names: Sequence[str] = CORE) -> None:
        self.package = package
        self.directory = directory
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != self.package or name not in self.names:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(self.directory, name + ".py"))


def _extension(directory: str, name: str) -> str | None:
    """The compiled extension of module ``name`` in ``directory``, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(directory, name + suffix)
        if os.path.exists(path):
            return path
    return None


def _mismatch(directory: str) -> str | None:
    """Why the compiled core of a source checkout must not run, or ``None``: a source newer
    than its extension, or extensions for some core modules only."""
    built = {name: _extension(directory, name) for name in CORE}
    found = {name: path for name, path in built.items() if path is not None}
    if not found:
        return None  # a pure-Python install
    for name, path in found.items():
        source = os.path.join(directory, name + ".py")
        if os.path.exists(source) and os.path.getmtime(source) > os.path.getmtime(path):
            return (f"{source} is newer than its compiled extension "
                    f"{os.path.basename(path)} (edited since the build)")
    missing = [name for name in CORE if name not in found]
    if missing:
        return (f"the compiled core in {directory} is incomplete (no extension for "
                f"{', '.join(missing)})")
    return None


def choose(package: str, directory: str) -> None:
    """Make the core modules of ``package`` (in ``directory``) load from source where the
    module docstring says; call before any of them is imported."""
    checkout = os.path.exists(os.path.join(os.path.dirname(directory), "setup.py"))
    why = None if pure_asked() or not checkout else _mismatch(directory)
    if not pure_asked() and why is None:
        return
    if not any(isinstance(f, SourceFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, SourceFinder(package, directory))
    if why is not None:
        warnings.warn(
            f"gpubudget: {why}: the whole allocation core runs from source (pure Python, "
            f"slower) instead. Rebuild it with `pip install -e .` (or `python setup.py "
            f"build_ext --inplace`) in {os.path.dirname(directory)}; or set {PURE_ENV}=1 to "
            f"run from source without this warning", RuntimeWarning, stacklevel=3)
