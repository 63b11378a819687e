"""A trace or a report in the Trace Event Format (JSON), which ui.perfetto.dev and
``chrome://tracing`` open: ``gpubudget export --perfetto TRACE -o out.json``.

Each root budget is a process, each budget a thread of it (``"ph": "M"`` events name both).
A budget's life is a complete slice (``"ph": "X"``) from its entry to its exit (to the end of
the run while open), its ``used`` bytes a counter track (``"ph": "C"``, named after the
budget, series ``used``; its own blocks' bytes the series ``own``), and each denial an
instant event (``"ph": "i"``, thread-scoped) with the bytes, the reason and the tag.
Timestamps are microseconds since the trace began.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .html.model import ViewModel, model_from_report, model_from_trace
from .units import format_size

if TYPE_CHECKING:
    from .report import BudgetReport

__all__ = ["perfetto_events", "write_perfetto", "write_perfetto_report"]

_US = 1e6


def _roots(model: ViewModel) -> list[int]:
    """Each budget's root (its process), as an index into ``model.budgets``."""
    roots: list[int] = []
    for index, budget in enumerate(model.budgets):  # parents come before children
        roots.append(index if budget.parent is None else roots[budget.parent])
    return roots


def _names(model: ViewModel, roots: list[int]) -> list[str]:
    """Each budget's thread and counter name: its name, ``#2``... for a second of the same
    name under one root."""
    names: list[str] = []
    seen: dict[tuple[int, str], int] = {}
    for index, budget in enumerate(model.budgets):
        key = (roots[index], budget.name)
        seen[key] = seen.get(key, 0) + 1
        names.append(budget.name if seen[key] == 1 else f"{budget.name} #{seen[key]}")
    return names


def _budget_events(model: ViewModel, roots: list[int],
                   names: list[str]) -> Iterator[dict[str, Any]]:
    """Metadata and a slice per budget."""
    for index, budget in enumerate(model.budgets):
        pid, tid = roots[index] + 1, index + 1
        if budget.parent is None:
            yield {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": f"gpubudget {budget.name}"}}
        yield {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
               "args": {"name": names[index]}}
        yield {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
               "args": {"sort_index": index}}
        end = budget.exited if budget.exited is not None else model.end
        yield {"ph": "X", "name": names[index], "cat": "budget", "pid": pid, "tid": tid,
               "ts": budget.entered * _US, "dur": max(end - budget.entered, 0.0) * _US,
               "args": {"limit": budget.limit, "limit_text": format_size(budget.limit),
                        "reserve": budget.reserve, "peak": budget.peak,
                        "allocations": budget.allocations, "frees": budget.frees,
                        "denied": budget.denied}}


def _denial_events(model: ViewModel, roots: list[int]) -> Iterator[dict[str, Any]]:
    for t, member, nbytes, reason, tag in model.denials:
        yield {"ph": "i", "s": "t", "name": f"denied {format_size(nbytes)}", "cat": "denial",
               "pid": roots[member] + 1, "tid": member + 1, "ts": t * _US,
               "args": {"bytes": nbytes, "reason": reason,
                        "tag": model.tags[tag] if tag >= 0 else None}}


def perfetto_events(model: ViewModel) -> Iterator[dict[str, Any]]:
    """The Trace Event Format events of ``model``: metadata, slices, counters, instants
    (what the files written hold, as dicts)."""
    roots = _roots(model)
    names = _names(model, roots)
    yield from _budget_events(model, roots, names)
    for t, member, used, own in zip(model.point_t, model.point_budget, model.point_used,
                                    model.point_own):
        yield {"ph": "C", "name": names[member], "pid": roots[member] + 1, "ts": t * _US,
               "args": {"used": int(used), "own": int(own)}}
    yield from _denial_events(model, roots)


def _write(model: ViewModel, path: str | os.PathLike[str]) -> None:
    roots = _roots(model)
    names = _names(model, roots)
    # Counters are most of the file: written from a template, each name quoted once.
    heads = [f'{{"ph":"C","name":{json.dumps(name)},"pid":{roots[index] + 1},"ts":'
             for index, name in enumerate(names)]
    with open(path, "w", encoding="utf-8") as out:
        out.write('{"displayTimeUnit": "ms", "otherData": ')
        out.write(json.dumps({"generator": "gpubudget", "source": model.title}))
        out.write(', "traceEvents": [\n')
        out.write(",\n".join(json.dumps(event, separators=(",", ":"))
                             for event in _budget_events(model, roots, names)))
        chunk: list[str] = []
        for t, member, used, own in zip(model.point_t, model.point_budget, model.point_used,
                                        model.point_own):
            chunk.append(f'{heads[member]}{t * _US!r},"args":{{"used":{int(used)},'
                         f'"own":{int(own)}}}}}')
            if len(chunk) >= 65536:
                out.write(",\n" + ",\n".join(chunk))
                chunk.clear()
        if chunk:
            out.write(",\n" + ",\n".join(chunk))
        for event in _denial_events(model, roots):
            out.write(",\n" + json.dumps(event, separators=(",", ":")))
        out.write("\n]}\n")


def write_perfetto(trace: str | os.PathLike[str], path: str | os.PathLike[str], *,
                   max_bytes: int | None = None) -> None:
    """Write the trace file ``trace`` into ``path`` in the Trace Event Format.

    Examples
    --------
    >>> import json, os, tempfile
    >>> from gpubudget import gpu_budget
    >>> folder = tempfile.mkdtemp()
    >>> with gpu_budget("1MiB", name="pool", backend="host",
    ...                 trace=os.path.join(folder, "run.jsonl")) as pool:
    ...     _ = pool.allocate(4096)
    ...     _ = pool.allocate(2**21)
    >>> write_perfetto(os.path.join(folder, "run.jsonl"), os.path.join(folder, "run.json"))
    >>> events = json.load(open(os.path.join(folder, "run.json")))["traceEvents"]
    >>> sorted({event["ph"] for event in events})
    ['C', 'M', 'X', 'i']
    """
    model = (model_from_trace(trace) if max_bytes is None
             else model_from_trace(trace, max_bytes=max_bytes))
    _write(model, path)


def write_perfetto_report(report: BudgetReport, path: str | os.PathLike[str]) -> None:
    """Write ``report``'s timeline into ``path`` in the Trace Event Format."""
    _write(model_from_report(report), path)
