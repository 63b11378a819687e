"""The C scanner of trace lines (``_scan.c``): whether it runs, and making one.

It reads granted ``alloc`` lines and ``free`` lines a buffer at a time, checks them against
the validator's tables in C and makes their events; for a replay it replays them at once, into
the replay's tables (a :data:`Sink`). Any other line it leaves to the reader's Python paths
(:mod:`.fastparse`, :mod:`.checks`), so the events and every message are the same with it or
without it. It is built with the package where a C compiler is at hand (``setup.py``);
``GPUBUDGET_PURE=1`` (the pure-Python build, also when set at run time) leaves it out, and
so does a source checkout whose ``_scan.c`` was edited since it was built (a warning says how
to rebuild).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

from .checks import Validator
from .events import Alloc, Free
from .format import MAX_FRAMES, MAX_LINE_BYTES

if TYPE_CHECKING:
    from ._scan import Scanner

__all__ = ["NATIVE", "Sink", "scanner"]

_PURE_ENV: Final = "GPUBUDGET_PURE"
_HERE: Final = os.path.dirname(os.path.abspath(__file__))

Sink = tuple[dict[int, Any], dict[int, Any], dict[int, Any], Any, Callable[[Any, int], None]]
"""What a replay hands the scanner to replay granted allocations and frees itself:
``(members, blocks, stacks, clock, deny)``, the tables of :mod:`gpubudget.replay.run` (see
``_scan.c`` for what it does with each)."""


def _stale() -> str | None:
    """Why the scanner of a source checkout must not run (``_scan.c`` edited since it was
    built), or ``None``."""
    if not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(_HERE)), "setup.py")):
        return None  # installed from a wheel: what was built is what runs
    source = os.path.join(_HERE, "_scan.c")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = os.path.join(_HERE, "_scan" + suffix)
        if os.path.exists(built) and os.path.exists(source) and (
                os.path.getmtime(source) > os.path.getmtime(built)):
            return f"{source} is newer than {os.path.basename(built)} (edited since the build)"
    return None


def _load() -> ModuleType | None:
    if os.environ.get(_PURE_ENV, "").strip() not in ("", "0"):
        return None
    why = _stale()
    if why is not None:
        warnings.warn(f"gpubudget: {why}: traces are read without the C scanner (slower). "
                      f"Rebuild it with `python setup.py build_ext --inplace`",
                      RuntimeWarning, stacklevel=2)
        return None
    try:
        return importlib.import_module(__name__.rsplit(".", 1)[0] + "._scan")
    except ImportError:
        return None


_SCAN: Final = _load()
NATIVE: Final = _SCAN is not None
"""Whether the C scanner is built and runs."""


def scanner(validator: Validator, sink: Sink | None = None) -> Scanner | None:
    """A scanner sharing ``validator``'s tables, replaying into ``sink`` if given; ``None``
    where the scanner is not built (or not run)."""
    if _SCAN is None:
        return None
    made: Scanner = _SCAN.Scanner(validator.budgets, validator.live, validator.frames, Alloc,
                                  Free, MAX_LINE_BYTES, MAX_FRAMES, sink)
    return made
