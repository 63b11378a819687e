"""``gpubudget view`` (the viewer's page for a trace, a report's JSON or a PyTorch memory
snapshot, and another to compare it with) and ``gpubudget export --perfetto`` (the trace in the Trace
Event Format)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ..viewer import ViewModel, model_from_trace, write_page
from ..viewer.reportfile import looks_like_report, model_from_report_file
from ..viewer.torchsnap import looks_like_pickle, model_from_torch_snapshot
from ..perfetto import write_perfetto
from ..text import printable
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


def _model(path: str, max_bytes: int, progress: Progress) -> ViewModel:
    """The model of a trace, of a report's JSON (``report --json``, ``to_json()``), or of a
    PyTorch snapshot (a pickle: read as plain data only)."""
    if looks_like_pickle(path):
        return model_from_torch_snapshot(path, max_bytes=max_bytes)
    if looks_like_report(path):
        return model_from_report_file(path, max_bytes=max_bytes)
    try:
        model = model_from_trace(path, max_bytes=max_bytes, progress=_reading(path, progress))
    finally:
        progress.clear()
    if not model.budgets:
        raise Failure(f"{printable(path)}: the trace holds no budget")
    return model


def view_command(trace: str, output: str, max_bytes: int, compare: str | None = None) -> None:
    """Write the viewer's page for ``trace`` (a trace or a PyTorch memory snapshot) into
    ``output``; with ``compare``, another record that the page compares it with."""
    progress = Progress(sys.stderr)
    model = _model(trace, max_bytes, progress)
    other = _model(compare, max_bytes, progress) if compare is not None else None
    try:
        write_page(model, output, compare=other)
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
