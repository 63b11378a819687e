"""The allocation core (private: the rest of the package and its tests use it, users do not).

Its modules: :mod:`.arena` (placement), :mod:`.ledger` (limits and charges), :mod:`.streams`
(stream-ordered frees), :mod:`.recorder` (statistics, event log, trace), :mod:`.memory` (a
root's memory), :mod:`.tree` and :mod:`.node` (a root's tree and its budgets).

The hot path has two implementations with one behaviour: these modules in Python, and the C
extension ``_native`` (``_native.c``), built by ``setup.py`` where a C compiler is at hand.
:data:`native` is the extension when it runs, else ``None``; ``gpubudget.compiled`` says the
same. The pure-Python core runs when:

- ``GPUBUDGET_PURE`` is set (not ``0``) when the program runs, or was at install (nothing is
  built);
- the extension was not built (no C compiler), or does not import;
- in a source checkout (``setup.py`` beside the package: an editable install), ``_native.c``
  is newer than the extension built from it: one ``RuntimeWarning`` says how to rebuild.

Both are tested side by side: ``tests/test_native.py`` runs the same random and adversarial
operations through each and compares every answer and every number.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import warnings
from types import ModuleType
from typing import Final

__all__ = ["PURE_ENV", "load_native", "native", "pure_asked"]

PURE_ENV: Final = "GPUBUDGET_PURE"
"""Set (not ``0``) at install: build no extension; at run time: run the pure-Python core."""
_HERE: Final = os.path.dirname(os.path.abspath(__file__))


def pure_asked() -> bool:
    """Whether :data:`PURE_ENV` asks for the pure-Python core."""
    return os.environ.get(PURE_ENV, "").strip() not in ("", "0")


def _stale(directory: str) -> str | None:
    """Why the extension of a source checkout must not run, or ``None``."""
    if not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(directory)), "setup.py")):
        return None  # installed from a wheel: what was built is what runs
    source = os.path.join(directory, "_native.c")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = os.path.join(directory, "_native" + suffix)
        if os.path.exists(built) and os.path.exists(source) and (
                os.path.getmtime(source) > os.path.getmtime(built)):
            return (f"{source} is newer than its extension {os.path.basename(built)} "
                    f"(edited since the build)")
    return None


def load_native(directory: str = _HERE) -> ModuleType | None:
    """The C extension, or ``None`` where the pure-Python core runs (see the module docstring)."""
    if pure_asked():
        return None
    why = _stale(directory)
    if why is not None:
        warnings.warn(f"gpubudget: {why}: the pure-Python core runs instead (slower). Rebuild "
                      f"it with `pip install -e .` (or `python setup.py build_ext --inplace`) "
                      f"in {os.path.dirname(os.path.dirname(directory))}; or set {PURE_ENV}=1 "
                      f"to run it without this warning", RuntimeWarning, stacklevel=3)
        return None
    try:
        return importlib.import_module(__name__ + "._native")
    except ImportError:
        return None


native: Final = load_native()
"""The C extension when it runs, else ``None``."""
