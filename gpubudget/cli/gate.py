"""``gpubudget fit --check LIMITS TRACE...``: a CI gate. Exit 1, with a table, when a recorded
run needs more than LIMITS allow or does not match LIMITS; 0 when it fits.

LIMITS is either the code ``gpubudget fit`` prints (or any Python with nested
``with gpu_budget("2GiB", name="detector"):`` blocks: the limit a literal, the name a
``name=`` string), or a TOML file (``.toml``) of nested tables, one per budget, each with a
``limit`` (see :mod:`gpubudget.cli.limits`)::

    [shared]
    limit = "4GiB"

    [shared.detector]
    limit = "2GiB"

Budgets are matched by their path of names from the root (``shared/detector``), as ``fit``
groups them: the largest need of budgets sharing a path is checked. The gate fails (exit 1)
when:

- a budget needs more than its limit: the smallest limit under which the run replays
  without a denial is above it. A budget whose denials are expected (``denials =
  "expected"``) is fitted on the run without its denied requests: it must fit what it was
  granted;
- a budget of LIMITS is not in the run (misspelt, or the run changed), unless it says
  ``absent = "ok"``;
- a budget of the run has no limit in LIMITS although LIMITS names its root (LIMITS speaks
  for that whole tree), unless it or a budget above it says ``unlisted = "unchecked"``.

``--allow absent``, ``--allow unlisted`` and ``--allow denials`` say the same for every
budget. Budgets of roots that LIMITS does not name are listed, not checked. LIMITS that
match no budget of the run at all are bad input (exit 2): a gate that checks nothing does
not pass; so is a trace of a run that did not end (a root never exited, a last line cut
short: the program was killed), whose needs after that are unknown.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from ..errors import GpuBudgetError
from ..replay import fit
from ..tracefile import Alloc, Enter, Exit, TraceEvent, TraceReader
from ..text import printable
from ..units import format_size
from .limits import Limits, Path, read_limits
from .output import Failure

__all__ = ["ALLOWANCES", "EXIT_OVER", "check_command"]

EXIT_OVER: Final = 1
"""The exit status when the run needs more than the limits allow, or does not match them."""
ALLOWANCES: Final = ("absent", "unlisted", "denials")
"""What ``--allow`` takes: each turns a setting of :mod:`gpubudget.cli.limits` on for every
budget."""


class _Run(TraceReader):
    """A trace read for the gate: it counts each budget's denied requests and leaves out
    those of the budgets whose denials are expected, so that ``fit`` does not grant them."""

    def __init__(self, path: str, max_bytes: int, limits: Limits, all_expected: bool,
                 denied: dict[Path, int], expected: dict[Path, int]) -> None:
        super().__init__(path, max_bytes=max_bytes)
        self.limits = limits
        self.all_expected = all_expected
        self.denied = denied
        self.expected = expected
        self.paths: dict[int, Path] = {}
        self.open_roots: dict[int, Path] = {}
        """The roots entered and not (yet) exited: a run that ended has none."""

    def __iter__(self) -> Iterator[TraceEvent]:
        paths, open_roots = self.paths, self.open_roots
        for event in super().__iter__():
            if type(event) is Enter:
                parent = paths[event.parent] if event.parent is not None else ()
                paths[event.budget] = parent + (event.name,)
                if event.parent is None:
                    open_roots[event.budget] = paths[event.budget]
            elif type(event) is Exit:
                open_roots.pop(event.budget, None)
            elif type(event) is Alloc and event.ptr is None:
                path = paths[event.budget]
                self.denied[path] = self.denied.get(path, 0) + 1
                if self.all_expected or self.limits.settings(path).denials:
                    self.expected[path] = self.expected.get(path, 0) + 1
                    continue
            yield event


@dataclass
class _Measured:
    """What the traces need, path by path."""

    needs: dict[Path, int] = field(default_factory=dict)
    """The largest fitted limit among the traces (``fit``'s numbers)."""
    denied: dict[Path, int] = field(default_factory=dict)
    """Requests the run was refused."""
    expected: dict[Path, int] = field(default_factory=dict)
    """Of those, the ones expected (left out of the fit)."""


def _trace_files(paths: Sequence[str]) -> list[str]:
    files: list[str] = []
    for path in paths:
        if path != "-" and os.path.isdir(path):
            files += sorted(os.path.join(path, name) for name in os.listdir(path)
                            if name.endswith(".jsonl"))
        else:
            files.append(path)
    if not files:
        raise Failure("no .jsonl trace in " + ", ".join(printable(p) for p in paths))
    return files


def _ended(run: _Run) -> None:
    """A :class:`Failure` unless ``run`` is the trace of a run that ended: every root exited,
    the last line whole. A run killed midway (``kill -9``, out of memory) may have needed more
    than it recorded: the gate does not pass it."""
    if run.lost:
        raise Failure(f"{run.cut_short}; so the run may have needed more than it recorded: "
                      f"the gate checks only a whole trace")
    if run.cut_short is not None:
        raise Failure(f"{run.name}: its last line is cut short: the run did not end "
                      f"(killed?), so it may have needed more than it recorded; the gate "
                      f"checks only a run that ended")
    if run.open_roots:
        names = ", ".join(sorted({repr(_name(path)) for path in run.open_roots.values()}))
        raise Failure(f"{run.name}: the run did not end: root budget(s) {names} never exited "
                      f"(killed?), so it may have needed more than it recorded; the gate "
                      f"checks only a run that ended")


def _measure(paths: Sequence[str], max_bytes: int, limits: Limits,
             all_expected: bool) -> _Measured:
    found = _Measured()
    for path in _trace_files(paths):
        run = _Run(path, max_bytes, limits, all_expected, found.denied, found.expected)
        with run:
            fits = fit(run)
        _ended(run)
        where: dict[int, Path] = {}
        for each in fits:  # parents before children
            key = (where[each.parent] if each.parent is not None else ()) + (each.name,)
            where[each.budget] = key
            found.needs[key] = max(found.needs.get(key, 0), each.limit)
    return found


def _literal(nbytes: int) -> str:
    """``nbytes`` as a limit is written: ``"9MiB"`` when a unit divides it, else bytes."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % factor == 0:
            return f'"{nbytes // factor}{unit}"'
    return str(nbytes)


def _name(path: Path) -> str:
    return printable("/".join(path))


@dataclass
class _Verdict:
    """The gate's findings."""

    checked: list[Path]
    over: list[Path]
    absent: list[Path]
    """Budgets of LIMITS not in the run (the outermost of each missing subtree): failures."""
    absent_ok: list[Path]
    unlisted: list[Path]
    """Budgets of the run without a limit in LIMITS, which speaks for their tree: failures."""
    unchecked: list[Path]

    @property
    def fails(self) -> bool:
        return bool(self.over or self.absent or self.unlisted)


def _judge(limits: Limits, run: _Measured, allowed: Collection[str]) -> _Verdict:
    needs = run.needs
    checked = [path for path in needs if path in limits.limits]
    if not checked:  # a gate that checks nothing must not pass
        raise Failure(f"none of the budgets of {limits.shown} is in the run (its root "
                      f"budgets: {', '.join(sorted({printable(p[0]) for p in needs}))}); "
                      f"names are matched from the root down")
    over = [path for path in checked if needs[path] > limits.limits[path]]
    missing = [path for path in limits.named
               if path not in needs and (len(path) == 1 or path[:-1] in needs)]
    may_miss = "absent" in allowed
    absent = [path for path in missing if not (may_miss or limits.settings(path).absent)]
    absent_ok = [path for path in missing if path not in absent]
    claimed = limits.roots()
    without = [path for path in needs if path not in limits.limits]
    unlisted = [path for path in without if path[0] in claimed
                and "unlisted" not in allowed and not limits.unlisted_unchecked(path)]
    unchecked = [path for path in without if path not in unlisted]
    return _Verdict(checked, over, absent, absent_ok, unlisted, unchecked)


def _headline(verdict: _Verdict, shown: str) -> str:
    if not verdict.fails:
        return f"gpubudget fit --check: the run fits in {shown}"
    parts = []
    if verdict.over:
        parts.append(f"{len(verdict.over)} budget(s) need more than {shown} allows")
    if verdict.absent:
        parts.append(f"{len(verdict.absent)} budget(s) of {shown} not in the run")
    if verdict.unlisted:
        parts.append(f"{len(verdict.unlisted)} budget(s) of the run without a limit in "
                     f"{shown}")
    return "gpubudget fit --check: " + "; ".join(parts)


def _table(verdict: _Verdict, limits: Limits, run: _Measured) -> list[str]:
    over, needs = verdict.over, run.needs
    width = max([len("budget")] + [len(_name(p)) for p in verdict.checked])
    lines = [f"  {'budget':<{width}}  {'limit':>10}  {'needs':>10}"]
    for path in sorted(verdict.checked, key=lambda p: (p not in over, p)):
        limit = limits.limits[path]
        if path in over:
            verdict_text = f"+{format_size(needs[path] - limit)} over"
        else:
            verdict_text = "ok"
        if run.expected.get(path):
            verdict_text += f" ({run.expected[path]} denial(s) expected, left out)"
        lines.append(f"{'-' if path in over else ' '} {_name(path):<{width}}  "
                     f"{format_size(limit):>10}  {format_size(needs[path]):>10}  "
                     f"{verdict_text}")
    if over:
        lines.append("to fit, change:")
        for path in sorted(over):
            lines.append(f"  {_name(path)}: {_literal(limits.limits[path])} -> "
                         f"{_literal(needs[path])}")
        refused = [path for path in sorted(over)
                   if run.denied.get(path, 0) > run.expected.get(path, 0)]
        for path in refused:
            lines.append(f"  ({_name(path)} was refused {run.denied[path]} request(s) in the "
                         f"run: if the program handles them, say denials = \"expected\" in "
                         f"its table, and it need only fit what it was granted)")
    return lines


def _similar(path: Path, needs: Collection[Path]) -> str:
    """`` (the run has: a/b?)`` for the budgets of the run with a name like ``path``'s."""
    siblings = {other[-1] for other in needs if other[:-1] == path[:-1]}
    close = difflib.get_close_matches(path[-1], sorted(siblings), n=3, cutoff=0.6)
    if not close:
        return ""
    return f" (misspelt? the run has {', '.join(_name(path[:-1] + (c,)) for c in close)})"


def _mismatches(verdict: _Verdict, limits: Limits, run: _Measured) -> list[str]:
    shown, lines = limits.shown, []
    if verdict.absent:
        lines.append(f"in {shown} but not in the run (if a run may lack one, say absent = "
                     f"\"ok\" in its table, or --allow absent):")
        lines += [f"- {_name(path)}{_similar(path, run.needs)}" for path in verdict.absent]
    if verdict.unlisted:
        lines.append(f"in the run but without a limit in {shown}, which names their root "
                     f"(add one; or say unlisted = \"unchecked\" in the table of a budget "
                     f"above them, or --allow unlisted):")
        lines += [f"- {_name(path)}: needs {format_size(run.needs[path])}, limit = "
                  f"{_literal(run.needs[path])}" for path in verdict.unlisted]
    if verdict.unchecked:
        lines.append(f"not in {shown} (not checked): "
                     f"{', '.join(_name(p) for p in verdict.unchecked)}")
    if verdict.absent_ok:
        lines.append(f"in {shown} but not in the run (absent allowed): "
                     f"{', '.join(_name(p) for p in verdict.absent_ok)}")
    return lines


def check_command(limits_path: str, traces: Sequence[str], max_bytes: int,
                  allow: Collection[str] = ()) -> int:
    """Compare what ``traces`` need with the limits in ``limits_path``; print the table and
    what does not match; return :data:`EXIT_OVER` when the gate fails, else 0."""
    unknown = set(allow) - set(ALLOWANCES)
    if unknown:
        raise ValueError(f"allow takes {', '.join(ALLOWANCES)}, not {sorted(unknown)}")
    limits = read_limits(limits_path)
    try:
        run = _measure(traces, max_bytes, limits, "denials" in allow)
    except (GpuBudgetError, ValueError) as exc:
        raise Failure(str(exc)) from None
    verdict = _judge(limits, run, allow)
    print(_headline(verdict, limits.shown))
    print("\n".join(_table(verdict, limits, run) + _mismatches(verdict, limits, run)))
    sys.stdout.flush()
    return EXIT_OVER if verdict.fails else 0
