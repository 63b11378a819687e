"""The C scanner of trace lines (``_scan.c``): whether it runs, and making one.

It reads granted ``alloc`` lines and ``free`` lines a buffer at a time, checks them against
the validator's tables in C and makes their events; for a replay it replays them at once, into
the replay's tables (a :data:`Sink`). Any other line it leaves to the reader's Python paths
(:mod:`.fastparse`, :mod:`.checks`), so the events and every message are the same with it or
without it. It is built with the package where a C compiler is at hand (``setup.py``);
:mod:`gpubudget.extensions` says when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

from ..extensions import extension
from .checks import Validator
from .events import Alloc, Free
from .format import MAX_FRAMES, MAX_LINE_BYTES

if TYPE_CHECKING:
    from ._scan import Scanner

__all__ = ["NATIVE", "Sink", "scanner"]


Sink = tuple[dict[int, Any], dict[int, Any], dict[int, Any], Any, Callable[[Any, int], None]]
"""What a replay hands the scanner to replay granted allocations and frees itself:
``(members, blocks, stacks, clock, deny)``, the tables of :mod:`gpubudget.replay.run` (see
``_scan.c`` for what it does with each)."""


_SCAN: Final = extension("tracefile", "_scan")
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
