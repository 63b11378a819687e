"""``gpubudget report`` and ``gpubudget fit``: what a trace used, and what it needs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from ..errors import GpuBudgetError
from ..plot import plot_format
from ..replay import Fit, ReplayResult, fit, replay
from ..replay.fit import reading_progress
from ..report import BudgetReport, DoorUsage, LiveBlock
from ..tracefile import TraceReader
from ..text import printable
from ..units import GiB, KiB, MiB, format_size
from .output import EXIT_BAD_INPUT, Failure, Progress, say

__all__ = ["fit_command", "report_command"]

_NAMES_LISTED: Final = 5
"""Root names a message lists at most."""
_NAME_COLUMN: Final = 40
"""Characters of a budget name the fit table shows at most."""
_DEEPEST: Final = 24
"""Levels of a tree that the text report and the fit table indent. Deeper budgets are
drawn at that indentation, their depth beside their name: a chain 10,000 deep prints in
lines proportional to its depth, not characters proportional to its square."""
_NESTED_BLOCKS: Final = 19
"""``with`` blocks the printed code nests at most (Python compiles 20 nested blocks at
most); a chain deeper than that continues in one ``contextlib.ExitStack``."""


def _safe_report(report: BudgetReport) -> BudgetReport:
    """``report`` with every name and tag printable (see :func:`printable`)."""
    made: dict[int, BudgetReport] = {}
    for item in reversed(report.walk()):  # children before parents: no recursion
        made[id(item)] = dataclasses.replace(
            item,
            name=printable(item.name),
            children=tuple(made.pop(id(child)) for child in item.children),
            denials=tuple(dataclasses.replace(d, refused_by=printable(d.refused_by))
                          for d in item.denials),
            live_blocks=tuple(_safe_block(block) for block in item.live_blocks),
            by_tag=tuple(dataclasses.replace(u, tag=printable(u.tag)) for u in item.by_tag),
            callback_errors=tuple(printable(error) for error in item.callback_errors),
            driver_door=_safe_door(item.driver_door),
        )
    return made[id(report)]


def _safe_door(door: DoorUsage | None) -> DoorUsage | None:
    """``door`` (a trace's door line) with its library names printable."""
    if door is None:
        return None
    return dataclasses.replace(
        door, last_refused_by=None if door.last_refused_by is None
        else printable(door.last_refused_by),
        libraries=tuple(dataclasses.replace(lib, name=printable(lib.name))
                        for lib in door.libraries))


def _safe_block(block: LiveBlock) -> LiveBlock:
    """``block`` with its tag and stack printable."""
    if block.tag is None and block.stack is None:
        return block
    return dataclasses.replace(
        block, tag=None if block.tag is None else printable(block.tag),
        stack=None if block.stack is None else tuple(printable(f) for f in block.stack))


def _report_text(report: BudgetReport) -> str:
    """``str(report)``, but deeper than :data:`_DEEPEST` levels indented no further."""
    lines: list[str] = []
    stack: list[tuple[BudgetReport, str, str, int]] = [(report, "", "", 0)]
    while stack:
        item, first, rest, depth = stack.pop()
        if depth > _DEEPEST:
            item = dataclasses.replace(item, name=f"{item.name} (depth {depth})")
        item._render(lines, first, rest)
        last = len(item.children) - 1
        deeper = rest if depth < _DEEPEST else rest[: 3 * (_DEEPEST - 1)]
        for index in range(last, -1, -1):
            stack.append((item.children[index], deeper + ("└─ " if index == last else "├─ "),
                          deeper + ("   " if index == last else "│  "), depth + 1))
    return "\n".join(lines)


def _names(reports: Sequence[BudgetReport]) -> str:
    shown = ", ".join(repr(r.name) for r in reports[:_NAMES_LISTED])
    return shown + (f", … ({len(reports)} in all)" if len(reports) > _NAMES_LISTED else "")


def _choose(reports: tuple[BudgetReport, ...], wanted: str | None,
            trace: str) -> list[BudgetReport]:
    """The roots ``--root`` names: every root called ``wanted``, or ``NAME#K``, the K-th
    root called NAME; all roots without ``--root``."""
    if wanted is None:
        return list(reports)
    named = [r for r in reports if r.name == wanted]
    if named:
        return named
    match = re.fullmatch(r"(.*)#([0-9]+)", wanted, flags=re.DOTALL)
    if match is not None:
        same = [r for r in reports if r.name == match.group(1)]
        index = int(match.group(2))
        if 1 <= index <= len(same):
            return [same[index - 1]]
        if same:
            raise Failure(f"--root {wanted!r}: there are {len(same)} roots named "
                           f"{match.group(1)!r} in {trace}")
    raise Failure(f"--root {wanted!r}: no root budget of that name in {trace}; its roots: "
                   f"{_names(reports)}")


def _report_json(trace: str, reports: Sequence[BudgetReport], result: ReplayResult) -> str:
    """One JSON document: ``{"trace", "cut_short", "after_release", "roots": [report, ...]}``
    (each report as ``BudgetReport.to_json`` writes it)."""
    roots = ",\n".join(report.to_json() for report in reports)
    return (f'{{"trace": {json.dumps(trace)}, "cut_short": {json.dumps(result.cut_short)}, '
            f'"after_release": {result.after_release}, "roots": [\n{roots}\n]}}')


def _plot_one(chosen: list[BudgetReport], wanted: str | None, path: str) -> None:
    """Plot the first chosen root; say which when there was a choice, and how to pick."""
    shown = chosen[0]
    if len(chosen) > 1:
        if wanted is None:
            say(f"the trace has {len(chosen)} root budgets ({_names(chosen)}); the plot "
                 f"shows the first, {shown.name!r}; pick another with --root NAME")
        else:
            say(f"{len(chosen)} root budgets are named {wanted!r}; the plot shows the "
                 f"first; pick another with --root '{wanted}#2' (#3, ...)")
    try:
        shown.plot(path)
    except OSError as exc:
        raise Failure(f"cannot write {path!r}: {exc.strerror or exc}") from None
    print(f"\nplot written to {printable(path)}")


def report_command(trace: str, plot: str | None, as_json: bool, root: str | None,
                   max_bytes: int) -> None:
    """Replay ``trace`` and print its roots' reports (text or one JSON document)."""
    if plot is not None:
        plot_format(plot)
        if importlib.util.find_spec("matplotlib") is None:
            raise Failure("--plot needs matplotlib: pip install 'gpubudget[plot]'")
    progress = Progress(sys.stderr)
    shown = printable(trace)
    base = printable(os.path.basename(trace) or trace)
    total = os.path.getsize(trace) if os.path.isfile(trace) else 0
    of = f" of {format_size(total)}" if total else ""

    def reading(lines: int, nbytes: int) -> None:
        share = f" ({100 * nbytes // total}%)" if total else ""
        progress(f"replaying {base}: {lines:,} lines, {format_size(nbytes)}{of}{share}")

    try:
        result = replay(trace, max_bytes=max_bytes, progress=reading)
    finally:
        progress.clear()
    _note_warnings(result)
    if not result.reports:
        raise Failure(f"{shown}: the trace holds no budget")
    chosen = _choose(result.reports, root, shown)
    if as_json:
        print(_report_json(trace, chosen, result))
    else:
        print("\n\n".join(_report_text(_safe_report(report)) for report in chosen))
    if plot is not None:
        _plot_one(chosen, root, plot)


def _note_warnings(result: ReplayResult) -> None:
    """Warnings about what the replay could not show as recorded."""
    if result.cut_short is not None:
        say(f"warning: {result.cut_short}")
    if result.after_release:
        say(f"warning: {result.after_release} allocation(s) came after their budget was "
             f"released in this replay (something such as a TensorRT engine kept it alive "
             f"in the recording); they were skipped. 'gpubudget fit' replays them")


# -- fit -------------------------------------------------------------------------------


@dataclass
class _Group:
    """Budgets that share a path of names from their root, across roots and traces: one
    ``with`` line in the code ``fit`` prints, with the largest of their numbers."""

    name: str
    count: int = 0
    recorded_limit: int = 0
    align: int = 1
    reserve: int = 0
    peak: int = 0
    largest_denied: int = 0
    limit: int = 0
    children: dict[str, _Group] = field(default_factory=dict)

    def add(self, found: Fit) -> None:
        self.count += 1
        self.recorded_limit = max(self.recorded_limit, found.recorded_limit)
        self.align = max(self.align, found.align)
        self.reserve = max(self.reserve, found.reserve)
        self.peak = max(self.peak, found.peak)
        self.largest_denied = max(self.largest_denied, found.largest_denied)
        self.limit = max(self.limit, found.limit)

    def walk(self) -> Iterator[tuple[str, int, _Group]]:
        """``(prefix of its line, depth, group)``, depth first, parents first, with a stack
        instead of recursion (trees may be deep); deeper than :data:`_DEEPEST` levels the
        prefix grows no longer."""
        stack: list[tuple[str, str, int, _Group]] = [("", "", 0, self)]
        while stack:
            head, tail, depth, group = stack.pop()
            yield head, depth, group
            children = list(group.children.values())
            if depth >= _DEEPEST:
                tail = tail[: 3 * (_DEEPEST - 1)]
            for index in range(len(children) - 1, -1, -1):
                last = index == len(children) - 1
                stack.append((tail + ("└─ " if last else "├─ "),
                              tail + ("   " if last else "│  "), depth + 1, children[index]))


def _group(fits: Sequence[Fit], into: dict[str, _Group]) -> None:
    """Add ``fits`` (parents before children) to the forest ``into``, by name path."""
    placed: dict[int, _Group] = {}
    for found in fits:
        siblings = into if found.parent is None else placed[found.parent].children
        group = siblings.get(found.name)
        if group is None:
            group = siblings[found.name] = _Group(found.name)
        group.add(found)
        placed[found.budget] = group


def _cell(name: str, count: int, depth: int) -> str:
    shown = printable(name)
    if len(shown) > _NAME_COLUMN:
        shown = shown[: _NAME_COLUMN - 1] + "…"
    return (shown + (f" (×{count})" if count > 1 else "")
            + (f" (depth {depth})" if depth > _DEEPEST else ""))


def _fit_table(forest: dict[str, _Group]) -> list[str]:
    rows = [(head + _cell(group.name, group.count, depth), group)
            for root in forest.values() for head, depth, group in root.walk()]
    width = max(len("budget"), *(len(cell) for cell, _ in rows))
    lines = [f"{'budget':<{width}}  {'recorded':>10}  {'peak':>10}  {'denied':>10}  "
             f"{'fits in':>10}"]
    for cell, group in rows:
        denied = format_size(group.largest_denied) if group.largest_denied else "-"
        lines.append(f"{cell:<{width}}  {format_size(group.recorded_limit):>10}  "
                     f"{format_size(group.peak):>10}  {denied:>10}  "
                     f"{format_size(group.limit):>10}")
    return lines


def _size_literal(nbytes: int) -> str:
    """``nbytes`` as ``gpu_budget`` reads it: ``"13MiB"`` when a unit divides it exactly."""
    for unit, factor in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes % factor == 0:
            return f'"{nbytes // factor}{unit}"'
    return str(nbytes)


def _fit_code(forest: dict[str, _Group]) -> list[str]:
    """Nested ``with gpu_budget(...)`` blocks that reproduce the run without a denial; a
    chain deeper than Python nests continues in a ``contextlib.ExitStack``."""
    lines = []
    for root in forest.values():
        stacked = False  # inside the ExitStack of a deep chain
        for _, depth, group in root.walk():
            call = _budget_call(group)
            if depth < _NESTED_BLOCKS:
                stacked = False
                indent = "    " * depth
                lines.append(f"{indent}with {call}:{_note(group)}")
                if not group.children:
                    lines.append(f"{indent}    ...")
                continue
            indent = "    " * _NESTED_BLOCKS
            if not stacked:
                stacked = True
                lines.append(f"{indent}with contextlib.ExitStack() as deeper:  # a chain "
                             f"deeper than Python nests 'with' blocks")
            lines.append(f"{indent}    deeper.enter_context({call}){_note(group)}")
            if len(group.children) > 1:
                lines.append(f"{indent}    # {group.name!r} has {len(group.children)} "
                             f"children here, entered one after another: see the table")
            if not group.children:
                lines.append(f"{indent}    ...")
    if any("contextlib.ExitStack" in line for line in lines):
        lines.insert(0, "import contextlib\n")
    return lines


def _budget_call(group: _Group) -> str:
    reserve = f", reserve={_size_literal(group.reserve)}" if group.reserve else ""
    return (f"gpu_budget({_size_literal(group.limit)}, align={group.align}{reserve}, "
            f"name={group.name!r})")


def _note(group: _Group) -> str:
    notes = [format_size(group.limit)] if _size_literal(group.limit).isdigit() else []
    if group.count > 1:
        notes.append(f"the largest of {group.count}")
    return f"  # {', '.join(notes)}" if notes else ""


def _trace_files(paths: Sequence[str]) -> list[str]:
    """The files named, a directory standing for its ``*.jsonl`` files (sorted)."""
    files: list[str] = []
    for path in paths:
        if path != "-" and os.path.isdir(path):
            found = sorted(os.path.join(path, name) for name in os.listdir(path)
                           if name.endswith(".jsonl"))
            if not found:
                raise Failure(f"{printable(path)}: a directory with no .jsonl trace in it")
            files += found
        else:
            files.append(path)
    return files


def fit_command(paths: Sequence[str], max_bytes: int) -> int:
    """Fit every trace named; print a table for each, then the code for all of them."""
    files = _trace_files(paths)
    progress = Progress(sys.stderr, log=True)  # a fit may run long: a CI log hears of it
    merged: dict[str, _Group] = {}
    fitted = failed = 0
    for path in files:
        shown = printable(path)
        base = printable(os.path.basename(path) or path)
        tell = _Prefixed(f"{base}: ", progress)
        try:
            with TraceReader(path, max_bytes=max_bytes, progress=reading_progress(tell)) as reader:
                fits = fit(reader, progress=tell)
        except (GpuBudgetError, ValueError) as exc:
            progress.clear()
            say(f"error: {exc}")
            failed += 1
            continue
        progress.clear()
        if reader.cut_short is not None:  # as report says it: the fit stops before that line
            say(f"warning: {reader.cut_short}")
        forest: dict[str, _Group] = {}
        _group(fits, forest)
        _group(fits, merged)
        roots = sum(1 for f in fits if f.parent is None)
        print(f"{shown}: {roots} root{'s' * (roots != 1)}, {len(fits)} "
              f"budget{'s' * (len(fits) != 1)}\n")
        print("\n".join(_fit_table(forest)) + "\n")
        fitted += 1
    if fitted:
        print(_fit_legend(fitted, failed))
        print("\n".join(_fit_code(merged)))
    return EXIT_BAD_INPUT if failed else 0


class _Prefixed:
    """A progress callback that puts ``prefix`` before each message."""

    def __init__(self, prefix: str, progress: Callable[[str], None]) -> None:
        self.prefix = prefix
        self.progress = progress

    def __call__(self, message: str) -> None:
        self.progress(self.prefix + message)


def _fit_legend(fitted: int, failed: int) -> str:
    which = "the trace replays" if fitted == 1 else f"all {fitted} traces replay"
    skipped = f" ({failed} more could not be read: see above)" if failed else ""
    return ("peak: the most the run was granted. denied: the largest request it was refused,"
            "\nreplayed as a probe (memory the program wanted), so the limit found grants it."
            f"\n\n# Smallest limits under which {which} without a denial{skipped}:")


# -- main --------------------------------------------------------------------------------
