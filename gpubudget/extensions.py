"""Which of gpubudget's C extensions run: the allocation core's (``_core/_native``) and the
trace scanner (``tracefile/_scan``). Each has a Python twin with the same behaviour, which
runs instead when:

- ``GPUBUDGET_PURE`` is set (not ``0``) when the program runs, or was at install (nothing is
  built);
- the extension was not built (no C compiler), or does not import;
- in a source checkout (``setup.py`` beside the package: an editable install), one of its C
  sources (a ``.c`` or ``.h`` file beside it) is newer than the extension built from them:
  one ``RuntimeWarning`` names it and says how to rebuild.

A source checkout that holds no built allocation core, imported while another copy of
gpubudget that has one is further down ``sys.path`` (``pip install .`` and then Python
started in the checkout, whose directory comes first), runs the pure-Python core too, and one
``RuntimeWarning`` names both copies and says how to run the built one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import os
import sys
import warnings
from types import ModuleType
from typing import Final

__all__ = ["PURE_ENV", "extension", "load", "pure_asked"]

PURE_ENV: Final = "GPUBUDGET_PURE"
"""Set (not ``0``) at install: build no extension; at run time: run the Python twins."""
PACKAGE: Final = os.path.dirname(os.path.abspath(__file__))
_WHAT: Final = {"_native": "the pure-Python core runs instead",
                "_scan": "traces are read without the C scanner"}


def pure_asked() -> bool:
    """Whether :data:`PURE_ENV` asks for the Python twins."""
    return os.environ.get(PURE_ENV, "").strip() not in ("", "0")


@functools.cache
def extension(folder: str, name: str) -> ModuleType | None:
    """The C extension ``gpubudget.<folder>.<name>`` of this copy of gpubudget, or ``None``
    where its Python twin runs (see the module docstring); asked once per process."""
    return load(os.path.join(PACKAGE, folder), name, f"{__package__}.{folder}.{name}")


def load(directory: str, name: str, module: str) -> ModuleType | None:
    """The extension ``name`` built in ``directory``, imported as ``module``, or ``None``."""
    if pure_asked():
        return None
    root = os.path.dirname(os.path.dirname(directory))
    why = _stale(directory, name)
    instead = _WHAT.get(name, "its Python twin runs instead")
    if why is not None:
        warnings.warn(f"gpubudget: {why}: {instead} (slower). Rebuild it with `pip install "
                      f"-e .` (or `python setup.py build_ext --inplace`) in {root}; or set "
                      f"{PURE_ENV}=1 to run without it and without this warning",
                      RuntimeWarning, stacklevel=4)
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    elsewhere = _shadowed(directory, name)
    if elsewhere is not None:
        warnings.warn(f"gpubudget: imported from the source tree {root}, which is first on "
                      f"sys.path (Python started there?) and has no built {name} extension, "
                      f"so {instead} (slower); the gpubudget it hides, "
                      f"{os.path.dirname(os.path.dirname(os.path.dirname(elsewhere)))}, has it "
                      f"built. Run from another directory to use that one, or build here with "
                      f"`python setup.py build_ext --inplace`; or set {PURE_ENV}=1 to run "
                      f"without it and without this warning", RuntimeWarning, stacklevel=4)
    return None


def _checkout(directory: str) -> bool:
    """Whether ``directory`` (a folder of the package) is in a source checkout."""
    return os.path.exists(os.path.join(os.path.dirname(os.path.dirname(directory)), "setup.py"))


def _built(directory: str, name: str) -> str | None:
    """The extension ``name`` built in ``directory``, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = os.path.join(directory, name + suffix)
        if os.path.exists(built):
            return built
    return None


def _stale(directory: str, name: str) -> str | None:
    """Why the extension of a source checkout must not run (a C source beside it edited
    since it was built), or ``None``."""
    built = _built(directory, name) if _checkout(directory) else None
    if built is None:
        return None  # installed from a wheel: what was built is what runs
    when = os.path.getmtime(built)
    sources = [os.path.join(directory, entry) for entry in sorted(os.listdir(directory))
               if entry.endswith((".c", ".h"))]
    edited = [source for source in sources if os.path.getmtime(source) > when]
    if not edited:
        return None
    also = ", ".join(os.path.basename(source) for source in edited[1:])
    return (f"{edited[0]} is newer than its extension {os.path.basename(built)} "
            f"(edited since the build{'; so are ' + also if also else ''})")


def _shadowed(directory: str, name: str) -> str | None:
    """Where another copy of gpubudget on ``sys.path`` has the extension that this source
    checkout lacks (the checkout shadows it), or ``None``."""
    if not _checkout(directory) or _built(directory, name) is not None:
        return None
    folder = os.path.basename(directory)
    for entry in sys.path:
        other = os.path.join(os.path.abspath(entry or os.curdir), "gpubudget", folder)
        if os.path.realpath(other) == os.path.realpath(directory):
            continue
        built = _built(other, name)
        if built is not None:
            return built
    return None
