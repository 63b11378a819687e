"""``gpubudget view`` (the viewer's page for a trace, a report's JSON or a PyTorch memory
snapshot, and another to compare it with) and ``gpubudget export --perfetto`` (the trace in the Trace
Event Format)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from ..viewer import ViewModel, model_from_trace, write_page
from ..viewer.reportfile import looks_like_report, model_from_report_file
from ..viewer.plainpickle import SnapshotError, load_plain
from ..viewer.sources import read_bounded
from ..viewer.torchsnap import looks_like_pickle, model_from_torch_data
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


_ROOM_PER_BYTE = 64
"""Address space a snapshot may take while read, per byte of it (its plain data and the
model: tens of bytes each), on top of what the process held and a fixed 2 GiB."""


@contextlib.contextmanager
def _address_space_for(size: int) -> Iterator[None]:
    """While a pickle of ``size`` bytes is read, the process's address space capped at what
    it holds now plus room for it: a pickle of ten bytes can ask the unpickler's memo for gigabytes (a
    memo index of 2**31), which then fails as a MemoryError, one line, instead of taking
    the machine's memory. Where the platform cannot say or cap (not Linux), no cap."""
    try:
        import resource

        with open("/proc/self/statm", encoding="ascii") as statm:
            held = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        yield
        return
    cap = held + (2 << 30) + _ROOM_PER_BYTE * size
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _model(path: str, max_bytes: int, progress: Progress) -> ViewModel:
    """The model of a trace, of a report's JSON (``report --json``, ``to_json()``), or of a
    PyTorch snapshot (a pickle: read as plain data only)."""
    if looks_like_pickle(path):
        data = read_bounded(path, max_bytes, "snapshot", SnapshotError)
        with _address_space_for(len(data)):
            return model_from_torch_data(load_plain(data, printable(path)),
                                         title=os.path.basename(path), name=printable(path))
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
