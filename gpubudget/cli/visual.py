"""``gpubudget view`` (the viewer's page for a trace) and ``gpubudget export --perfetto``
(the trace in the Trace Event Format)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ..html import model_from_trace, write_page
from ..perfetto import write_perfetto
from ..tracefile import printable
from ..units import format_size
from .output import Failure, Progress

__all__ = ["export_command", "view_command"]


def _reading(trace: str, progress: Progress) -> Callable[[int, int], None]:
    base = printable(os.path.basename(trace) or trace)

    def tell(lines: int, nbytes: int) -> None:
        progress(f"reading {base}: {lines:,} lines, {format_size(nbytes)}")

    return tell


def _written(path: str, action: str) -> None:
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    print(f"{action} written to {printable(path)} ({format_size(size)})")


def view_command(trace: str, output: str, max_bytes: int) -> None:
    """Write the viewer's page for ``trace`` into ``output``."""
    progress = Progress(sys.stderr)
    try:
        model = model_from_trace(trace, max_bytes=max_bytes,
                                 progress=_reading(trace, progress))
    finally:
        progress.clear()
    if not model.budgets:
        raise Failure(f"{printable(trace)}: the trace holds no budget")
    try:
        write_page(model, output)
    except OSError as exc:
        raise Failure(f"cannot write {output!r}: {exc.strerror or exc}") from None
    _written(output, "viewer")


def export_command(trace: str, output: str, max_bytes: int) -> None:
    """Write ``trace`` into ``output`` in the Trace Event Format."""
    try:
        write_perfetto(trace, output, max_bytes=max_bytes)
    except OSError as exc:
        if exc.filename is not None and os.fspath(exc.filename) == output:
            raise Failure(f"cannot write {output!r}: {exc.strerror or exc}") from None
        raise
    _written(output, "Trace Event Format (ui.perfetto.dev, chrome://tracing)")
