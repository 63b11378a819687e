"""The allocation core (private: the budget layer uses it, through this module alone; users
and the rest of the package do not, and tests may reach inside).

Its modules: :mod:`.arena` (placement), :mod:`.ledger` (limits and charges), :mod:`.streams`
(stream-ordered frees), :mod:`.recorder` (statistics, event log, trace), :mod:`.memory` (a
root's memory), :mod:`.registry` (the live blocks), :mod:`.locks` (a tree's lock),
:mod:`.recovery` (a tree put right after a fault), :mod:`.tree` and :mod:`.node` (a root's
tree and its budgets). This module is the core's one door: the names at its end are what the
budget layer uses (``tests/test_layers.py`` checks that nothing imports the modules behind it).

The hot path has two implementations with one behaviour: these modules in Python, and the C
extension ``_native``, built by ``setup.py`` where a C compiler is at hand from the ``.c``
files here (one per concept, named after the Python module it mirrors; ``native.h`` declares
what they share, ``_native.c`` makes the module).
:data:`native` is the extension when it runs, else ``None``; ``gpubudget.compiled`` says the
same. The pure-Python core runs when:

- ``GPUBUDGET_PURE`` is set (not ``0``) when the program runs, or was at install (nothing is
  built);
- the extension was not built (no C compiler), or does not import;
- in a source checkout (``setup.py`` beside the package: an editable install), a C source
  of it (a ``.c`` or ``.h`` file here) is newer than the extension built from them: one
  ``RuntimeWarning`` names it and says how to rebuild.

A source checkout that holds no built extension, imported while another copy of gpubudget
that has one is further down ``sys.path`` (``pip install .`` and then Python started in the
checkout, whose directory comes first), runs the pure-Python core too, and one
``RuntimeWarning`` names both copies and says how to run the built one.

Both are tested side by side: ``tests/test_native.py`` runs the same random and adversarial
operations through each and compares every answer and every number.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
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


def _sources(directory: str) -> list[str]:
    """The C core's source files in ``directory`` (its ``.c`` files and its header), by name."""
    return [os.path.join(directory, name) for name in sorted(os.listdir(directory))
            if name.endswith((".c", ".h"))]


def _stale(directory: str) -> str | None:
    """Why the extension of a source checkout must not run, or ``None``."""
    if not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(directory)), "setup.py")):
        return None  # installed from a wheel: what was built is what runs
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = os.path.join(directory, "_native" + suffix)
        if not os.path.exists(built):
            continue
        when = os.path.getmtime(built)
        edited = [source for source in _sources(directory) if os.path.getmtime(source) > when]
        if edited:
            also = ", ".join(os.path.basename(source) for source in edited[1:])
            return (f"{edited[0]} is newer than its extension {os.path.basename(built)} "
                    f"(edited since the build{'; so are ' + also if also else ''})")
    return None


def _built(directory: str) -> str | None:
    """The extension built in ``directory``, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = os.path.join(directory, "_native" + suffix)
        if os.path.exists(built):
            return built
    return None


def _shadowed(directory: str) -> str | None:
    """Where another copy of gpubudget on ``sys.path`` has the extension that this source
    checkout lacks (the checkout shadows it), or ``None``."""
    root = os.path.dirname(os.path.dirname(directory))
    if not os.path.exists(os.path.join(root, "setup.py")) or _built(directory) is not None:
        return None
    for entry in sys.path:
        other = os.path.join(os.path.abspath(entry or os.curdir), "gpubudget", "_core")
        if os.path.realpath(other) == os.path.realpath(directory):
            continue
        built = _built(other)
        if built is not None:
            return built
    return None


def load_native(directory: str = _HERE) -> ModuleType | None:
    """The C extension, or ``None`` where the pure-Python core runs (see the module docstring)."""
    if pure_asked():
        return None
    why = _stale(directory)
    root = os.path.dirname(os.path.dirname(directory))
    if why is not None:
        warnings.warn(f"gpubudget: {why}: the pure-Python core runs instead (slower). Rebuild "
                      f"it with `pip install -e .` (or `python setup.py build_ext --inplace`) "
                      f"in {root}; or set {PURE_ENV}=1 to run it without this warning",
                      RuntimeWarning, stacklevel=3)
        return None
    try:
        return importlib.import_module(__name__ + "._native")
    except ImportError:
        pass
    elsewhere = _shadowed(directory)
    if elsewhere is not None:
        warnings.warn(f"gpubudget: imported from the source tree {root}, which is first on "
                      f"sys.path (Python started there?) and has no built C core, so the "
                      f"pure-Python core runs (slower); the gpubudget it hides, "
                      f"{os.path.dirname(os.path.dirname(os.path.dirname(elsewhere)))}, has it "
                      f"built. Run from another directory to use that one, or build here with "
                      f"`python setup.py build_ext --inplace`; or set {PURE_ENV}=1 to run the "
                      f"pure-Python core without this warning", RuntimeWarning, stacklevel=3)
    return None


native: Final[ModuleType | None] = load_native()
"""The C extension when it runs, else ``None``."""


# The door: the names the budget layer uses. Imported after ``native``, which they read.
from .ledger import available  # noqa: E402
from .locks import let_in  # noqa: E402
from .memory import Mapping  # noqa: E402
from .node import Node, Probe, State, install_fast_path  # noqa: E402
from .recorder import EVENT_LOG_LIMIT  # noqa: E402
from .registry import LiveEntry  # noqa: E402
from .tree import Denied, Tree, unreleased  # noqa: E402

__all__ += ["EVENT_LOG_LIMIT", "Denied", "LiveEntry", "Mapping", "Node", "Probe", "State", "Tree",
            "available", "install_fast_path", "let_in", "unreleased"]
