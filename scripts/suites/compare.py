"""Compare outcome files of CuPy's suite run unrouted and routed; summarize OpInfo runs.

    python3 scripts/suites/compare.py cupy --unrouted off.json \\
        --routed root.json --routed child.json --tight tight.json \\
        [--md summary.md] [--json summary.json] [--list 20]
    python3 scripts/suites/compare.py opinfo opinfo.json [--md ...] [--json ...]

``cupy`` prints, as markdown tables: each run's counts and wall time; for each routed run
whether its outcomes are the unrouted run's (the differing tests listed, at most ``--list``),
``check()`` failures, hangs, what held budgets after their test; the per-test overhead of
routing (routed minus unrouted duration, setup + call + teardown, over the tests that passed
in both runs) beside what the fixture itself measured; and for each ``--tight`` run (a budget
too small for some tests) whether every failure the unrouted run did not have is a clean
``OutOfMemoryError`` naming the budget. ``opinfo`` prints the table of an ``opinfo.py``
result (its JSON, or the JSON-lines stream of a run that was cut short).

Exit status: 0 when every criterion holds, 1 when one does not, 2 for a missing or bad file.
Needs neither CuPy nor PyTorch.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

if __package__ in (None, ""):  # run as a file: python3 scripts/suites/compare.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.suites.outcomes import (  # noqa: E402
    OUTCOMES,
    Run,
    clean_out_of_memory,
    is_hang,
    load_run,
)

__all__ = ["compare_outcomes", "cupy_report", "main", "opinfo_report", "overhead",
           "run_counts", "tight_failures"]

FAILING: Final = ("failed", "error", "crashed")
PHASES: Final = ("enter", "route", "unroute", "exit", "release", "check")
RELEASED: Final = ("exit", "gc", "plan_cache", "held")


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def _mib(nbytes: object) -> str:
    return f"{int(nbytes) / 2**20:.1f} MiB" if isinstance(nbytes, int) else "—"


def _s(seconds: object) -> str:
    return f"{float(seconds):.1f}" if isinstance(seconds, (int, float)) else "—"


def _outcome(record: dict[str, Any]) -> str:
    outcome = str(record.get("outcome"))
    return outcome + ("+teardown-error" if record.get("teardown_error") else "")


def _snippet(record: dict[str, Any], chars: int = 160) -> str:
    failure = record.get("failure") or {}
    text = failure.get("oom_line") or failure.get("message") or ""
    kind = failure.get("exc_type") or ""
    line = " ".join(str(text).split())
    return f"{kind}: {line[:chars]}" if kind else line[:chars]


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- one run ---------------------------------------------------------------------------------


def run_counts(run: Run) -> dict[str, Any]:
    """Counts of one run: outcomes, hangs, not run, ``check()`` failures, what released the
    budgets, tests that began with a retired pool still in use, wall time."""
    outcomes = Counter(str(record.get("outcome")) for record in run.tests.values())
    info = [record["gpubudget"] for record in run.tests.values() if record.get("gpubudget")]
    collected = run.meta.get("collected")
    return {
        "label": run.label,
        "mode": run.meta.get("mode"),
        "limit": run.meta.get("limit"),
        "tests": len(run.tests),
        "collected": collected,
        "not_run": max(0, int(collected) - len(run.tests)) if isinstance(collected, int) else None,
        "complete": run.complete,
        **{outcome: outcomes.get(outcome, 0) for outcome in OUTCOMES},
        "teardown_errors": sum(bool(r.get("teardown_error")) for r in run.tests.values()),
        "hangs": sum(is_hang(record) for record in run.tests.values()),
        "check_failures": sum(bool(i.get("check_error")) for i in info),
        "released": {key: sum(i.get("released") == key for i in info) for key in RELEASED},
        "held_bytes": sum(int(i.get("held_bytes") or 0) for i in info),
        "peak_max": max((int(i.get("peak") or 0) for i in info), default=None),
        "draining": sum(bool(i.get("draining")) for i in info),
        "wall_s": run.meta.get("wall_s"),
        "workers": run.meta.get("workers"),
        "exitstatus": run.meta.get("exitstatus"),
    }


def _broken(counts: dict[str, Any]) -> bool:
    """pytest itself failed (interrupted, internal error, usage error, nothing collected), or
    the run did not end."""
    status = counts.get("exitstatus")
    return not counts["complete"] or bool(counts["not_run"]) or \
        (isinstance(status, int) and status not in (0, 1))


# -- two runs --------------------------------------------------------------------------------


def compare_outcomes(base: Run, other: Run, limit: int = 20) -> dict[str, Any]:
    """Whether ``other`` has ``base``'s outcome for every test (teardown errors included);
    the differing tests (the first ``limit``), and the tests only one of them ran."""
    common = [nodeid for nodeid in base.tests if nodeid in other.tests]
    differing = [nodeid for nodeid in common
                 if _outcome(base.tests[nodeid]) != _outcome(other.tests[nodeid])]
    only_base = [nodeid for nodeid in base.tests if nodeid not in other.tests]
    only_other = [nodeid for nodeid in other.tests if nodeid not in base.tests]
    return {
        "common": len(common),
        "identical": not differing and not only_base and not only_other,
        "differing": len(differing),
        "only_base": len(only_base),
        "only_other": len(only_other),
        "examples": [{"nodeid": nodeid, "base": _outcome(base.tests[nodeid]),
                      "other": _outcome(other.tests[nodeid]),
                      "failure": _snippet(other.tests[nodeid])
                      or _snippet(base.tests[nodeid])} for nodeid in differing[:limit]],
        "missing_examples": only_base[:5],
    }


def overhead(base: Run, other: Run) -> dict[str, Any]:
    """The per-test cost of routing: ``other``'s duration minus ``base``'s (setup, call and
    teardown) over the tests that passed in both, and the fixture's own phases in ``other``
    (medians and means, seconds)."""
    deltas = [other.tests[n]["duration"] - base.tests[n]["duration"]
              for n, record in base.tests.items()
              if record.get("outcome") == "passed" and n in other.tests
              and other.tests[n].get("outcome") == "passed"]
    info = [record["gpubudget"] for record in other.tests.values() if record.get("gpubudget")]
    phases: dict[str, dict[str, float]] = {}
    for phase in (*PHASES, "all"):
        values = [sum(float(i.get(p) or 0.0) for p in PHASES) if phase == "all"
                  else float(i.get(phase) or 0.0) for i in info]
        phases[phase] = {"median": statistics.median(values) if values else math.nan,
                         "mean": statistics.fmean(values) if values else math.nan}
    return {
        "tests": len(deltas),
        "median": statistics.median(deltas) if deltas else math.nan,
        "mean": statistics.fmean(deltas) if deltas else math.nan,
        "p90": _quantile(deltas, 0.9),
        "total": sum(deltas),
        "fixture": phases,
        "fixture_tests": len(info),
    }


def tight_failures(base: Run, tight: Run, limit: int = 20) -> dict[str, Any]:
    """The failures of ``tight`` that ``base`` did not have: how many are a clean
    ``OutOfMemoryError`` naming the budget (raised as such, or inside the ``AssertionError``
    of CuPy's test helpers), and the others (the first ``limit``)."""
    new = [nodeid for nodeid, record in tight.tests.items()
           if record.get("outcome") in FAILING and nodeid in base.tests
           and base.tests[nodeid].get("outcome") not in FAILING]
    clean = [n for n in new if tight.tests[n].get("outcome") != "crashed"
             and clean_out_of_memory(tight.tests[n].get("failure"))]
    direct = [n for n in clean if (tight.tests[n].get("failure") or {}).get("oom_type")]
    unclean = [n for n in new if n not in set(clean)]
    return {
        "new_failures": len(new),
        "clean": len(clean),
        "direct": len(direct),
        "wrapped": len(clean) - len(direct),
        "unclean": len(unclean),
        "examples": [{"nodeid": n, "outcome": _outcome(tight.tests[n]),
                      "failure": _snippet(tight.tests[n])} for n in unclean[:limit]],
    }


# -- the CuPy report -------------------------------------------------------------------------


def _budget(counts: dict[str, Any]) -> str:
    if counts["mode"] == "off":
        return "none (unrouted)"
    if counts["mode"] == "child":
        return f"{counts['limit']}, a child of one root per worker"
    return f"{counts['limit']}, a root per test"


def cupy_report(unrouted: Run, routed: Sequence[Run], tight: Sequence[Run],
                limit: int = 20) -> tuple[str, dict[str, Any], bool]:
    """Markdown, a JSON-able summary and whether every criterion holds."""
    runs = [unrouted, *routed, *tight]
    counts = [run_counts(run) for run in runs]
    ok = True
    out = ["### CuPy's test suite, every test in a budget", "", "#### Runs", "", _table(
        ("run", "budget", "tests", "passed", "failed", "skipped", "xfailed", "xpassed",
         "errors", "hung", "not run", "pytest exit", "wall s", "workers"),
        ((c["label"], _budget(c), c["tests"], c["passed"], c["failed"], c["skipped"],
          c["xfailed"], c["xpassed"], c["error"], c["hangs"],
          "—" if c["not_run"] is None else c["not_run"],
          "—" if c["exitstatus"] is None else c["exitstatus"], _s(c["wall_s"]), c["workers"])
         for c in counts)), ""]
    cut = [c["label"] for c in counts if _broken(c)]
    if cut:
        ok = False
        out += [f"**Did not run to the end** (a time limit, a crash, or pytest failed: see "
                f"its log): {', '.join(cut)}. The comparisons below cover the tests each "
                f"pair of runs both ran.", ""]
    summary: dict[str, Any] = {"runs": counts, "routed": [], "tight": []}
    rows, timing, details = [], [], []
    for run, c in zip(routed, counts[1:1 + len(routed)]):
        same = compare_outcomes(unrouted, run, limit)
        cost = overhead(unrouted, run)
        run_ok = (same["identical"] and c["check_failures"] == 0 and c["hangs"] == 0
                  and c["teardown_errors"] == 0 and not _broken(c))
        ok = ok and run_ok
        summary["routed"].append({"label": run.label, "outcomes": same, "overhead": cost,
                                  "ok": run_ok})
        released = c["released"]
        rows.append((run.label, "yes" if same["identical"] else
                     "yes, on the tests both ran" if not same["differing"] else "**no**",
                     same["differing"], same["only_base"], same["only_other"],
                     c["check_failures"], c["hangs"],
                     " / ".join(str(released[key]) for key in RELEASED),
                     c["draining"], _mib(c["peak_max"])))
        fixture = cost["fixture"]
        timing.append((run.label, cost["tests"], _ms(cost["median"]), _ms(cost["mean"]),
                       _ms(cost["p90"]), f"{cost['total']:.1f}",
                       *(_ms(fixture[p]["median"]) for p in (*PHASES, "all")),
                       _ms(fixture["all"]["mean"])))
        if same["examples"] or same["missing_examples"]:
            details += [f"Differing outcomes, unrouted → {run.label} (first {limit}):", ""]
            details += [f"- `{e['nodeid']}`: {e['base']} → {e['other']}"
                        + (f" ({e['failure']})" if e["failure"] else "")
                        for e in same["examples"]]
            if same["only_base"]:
                details.append(f"- {same['only_base']} tests of the unrouted run not run by "
                               f"{run.label}, such as: "
                               + ", ".join(f"`{n}`" for n in same["missing_examples"]))
            if same["only_other"]:
                details.append(f"- {same['only_other']} tests run by {run.label} only")
            details.append("")
    if routed:
        out += ["#### Routed against unrouted", "", _table(
            ("run", "identical outcomes", "differing", "only unrouted ran", "only this ran",
             "check() failures", "hung", "budgets released at exit / after gc / after "
             "clearing the FFT plan cache / held", "tests begun with a retired pool in use",
             "largest peak of a test"),
            rows), ""]
        out += ["#### Per-test overhead of routing (ms)", "",
                "Δ: this run's duration of a test (setup + call + teardown) minus the "
                "unrouted run's, over the tests that passed in both; then the fixture's own "
                "phases (medians over every routed test): the budget's `__enter__`, "
                "`allocations().__enter__`, its `__exit__`, the budget's `__exit__` (a root "
                "returns its reservation there), the release retries, `check()`.", "",
                _table(("run", "tests", "median Δ", "mean Δ", "p90 Δ", "sum Δ (s)", "enter",
                        "route", "unroute", "exit", "release", "check", "fixture",
                        "fixture (mean)"), timing), ""]
    tight_rows = []
    for run in tight:
        result = tight_failures(unrouted, run, limit)
        c = run_counts(run)
        run_ok = (result["unclean"] == 0 and c["check_failures"] == 0 and c["hangs"] == 0
                  and not _broken(c))
        ok = ok and run_ok
        summary["tight"].append({"label": run.label, "failures": result, "ok": run_ok})
        tight_rows.append((run.label, result["new_failures"], result["clean"],
                           result["direct"], result["wrapped"],
                           f"**{result['unclean']}**" if result["unclean"] else 0,
                           c["check_failures"], c["hangs"]))
        if result["examples"]:
            details += [f"Failures of {run.label} that are not a clean OutOfMemoryError "
                        f"naming the budget (first {limit}):", ""]
            details += [f"- `{e['nodeid']}`: {e['outcome']} ({e['failure']})"
                        for e in result["examples"]]
            details.append("")
    if tight:
        out += ["#### A budget too small", "", _table(
            ("run", "failures the unrouted run did not have", "clean OutOfMemoryError "
             "naming the budget", "raised as such", "inside CuPy's AssertionError",
             "not clean", "check() failures", "hung"), tight_rows), ""]
    out += details
    out.append(f"All criteria hold: {'yes' if ok else '**no**'}")
    summary["ok"] = ok
    return "\n".join(out) + "\n", summary, ok


# -- OpInfo ----------------------------------------------------------------------------------


def load_opinfo(path: str | Path) -> dict[str, Any]:
    """An ``opinfo.py`` result: its JSON, else its JSON-lines stream (``complete`` False)."""
    p = Path(path)
    if p.suffix == ".json" and p.is_file():
        document: dict[str, Any] = json.loads(p.read_text(encoding="utf-8"))
        document.setdefault("complete", True)
        return document
    stream = p.with_suffix(".jsonl") if p.suffix == ".json" else p
    if not stream.is_file():
        raise FileNotFoundError(f"no OpInfo result {p} (nor {stream})")
    document = {"meta": {}, "pairs": [], "complete": False}
    for line in stream.read_text(encoding="utf-8").splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("meta"), dict):
            document["meta"].update(item["meta"])
        elif isinstance(item.get("pair"), dict):
            document["pairs"].append(item["pair"])
        elif isinstance(item.get("end"), dict):
            document["meta"].update(item["end"])
            document["complete"] = True
    return document


def _fails(outcome: object) -> bool:
    return outcome is not None and outcome != "ok"


def opinfo_report(document: dict[str, Any], limit: int = 20) -> tuple[str, dict[str, Any], bool]:
    """The OpInfo table: per dtype, samples and outcomes of (a) unrouted, (b) routed, (c) a
    tight budget; (a) = (b); (c)'s new failures that are a clean OutOfMemoryError naming
    the budget; growth of PyTorch's memory outside every private pool across (b); check()
    failures; budgets held; times. Markdown, summary, whether every criterion holds."""
    pairs: list[dict[str, Any]] = list(document.get("pairs", []))
    meta = document.get("meta", {})
    by_dtype: dict[str, list[dict[str, Any]]] = {}
    for pair in pairs:
        by_dtype.setdefault(str(pair.get("dtype")), []).append(pair)
    rows, summary_rows, details = [], [], []
    differing: list[str] = []
    unclean: list[str] = []
    grew: list[str] = []
    checks: list[str] = []
    mismatched: list[str] = []
    harness = [f"{p.get('op')}[{p.get('dtype')}]: {p['harness_error']}" for p in pairs
               if p.get("harness_error")]
    held: Counter[str] = Counter()
    sticky = meta.get("sticky_error")
    for dtype, group in by_dtype.items():
        tagged = [(f"{pair.get('op')}[{dtype}] sample {s.get('sample')}", s)
                  for pair in group for s in pair.get("samples", [])]
        samples = [s for _, s in tagged]
        counts = {mode: sum(_fails(s.get(mode)) for s in samples) for mode in "abc"}
        ran = {mode: sum(s.get(mode) is not None for s in samples) for mode in "abc"}
        diff = [(n, s) for n, s in tagged if s.get("b") is not None and s.get("a") != s.get("b")]
        new = [(n, s) for n, s in tagged if _fails(s.get("c")) and not _fails(s.get("a"))]
        clean = [n for n, s in new if s.get("c_clean")]
        growth = [p for p in group if int((p.get("outside_growth") or {}).get("reserved") or 0)]
        check = [p for p in group if p.get("check_error")]
        values = [(n, s) for n, s in tagged if s.get("value_mismatch")]
        for pair in group:
            for mode, how in (pair.get("released") or {}).items():
                held[f"{mode}:{how}"] += 1
        backward = sum(bool(p.get("backward")) for p in group)
        times = {mode: sum(float((p.get("times") or {}).get(mode) or 0.0) for p in group)
                 for mode in "abc"}
        differing += [f"{n}: {s.get('a')} → {s.get('b')}" for n, s in diff]
        unclean += [f"{n}: {s.get('c')} ({s.get('c_message', '')})"
                    for n, s in new if not s.get("c_clean")]
        grew += [f"{p.get('op')}[{dtype}]: +{(p.get('outside_growth') or {}).get('reserved')} "
                 f"bytes reserved, +{(p.get('outside_growth') or {}).get('allocated')} "
                 f"allocated" for p in growth]
        checks += [f"{p.get('op')}[{dtype}]: {p.get('check_error')}" for p in check]
        mismatched += [f"{n}: {s.get('value_mismatch')}" for n, s in values]
        rows.append((dtype, len(group), backward, len(samples),
                     f"{ran['a'] - counts['a']} / {counts['a']}",
                     f"{ran['b'] - counts['b']} / {counts['b']}",
                     f"{ran['c'] - counts['c']} / {counts['c']}",
                     "yes" if not diff else f"**no ({len(diff)})**",
                     len(new), len(clean),
                     f"**{len(new) - len(clean)}**" if len(new) > len(clean) else 0,
                     len(growth) if not growth else f"**{len(growth)}**", len(check),
                     len(values), " / ".join(f"{times[m]:.1f}" for m in "abc")))
        summary_rows.append({"dtype": dtype, "ops": len(group), "samples": len(samples),
                             "failed": counts, "ran": ran, "differing": len(diff),
                             "new_tight_failures": len(new), "clean": len(clean),
                             "outside_growth_ops": len(growth), "check_failures": len(check),
                             "value_mismatches": len(values), "times": times})
    ok = (not differing and not unclean and not grew and not checks and not sticky
          and not harness and bool(pairs))
    out = ["### PyTorch OpInfo samples on CUDA", "",
           f"{meta.get('ops_total', '?')} OpInfos in op_db; dtypes tried in order "
           f"{', '.join(meta.get('dtypes', []))}; stopped "
           f"{'by the time limit' if meta.get('cut_short') else 'after every op'}"
           f"{'' if document.get('complete', True) else ' (the run did not end: from its stream)'}"
           f"; {_s(meta.get('wall_s'))} s in all.", "",
           _table(("dtype", "ops", "ops with backward", "samples", "(a) ok / failed",
                   "(b) ok / failed", "(c) ok / failed", "(a) = (b)",
                   "(c) failures not in (a)", "clean OOM naming the budget", "not clean",
                   "ops whose (b) grew memory outside private pools", "check() failures",
                   "value differences (a)/(b)", "time a / b / c (s)"), rows), ""]
    if held:
        out += ["Budgets after their op: " + ", ".join(f"{key} {count}" for key, count
                                                      in sorted(held.items())), ""]
    if sticky:
        out += [f"**Stopped by a CUDA error that poisons the process:** {sticky}", ""]
    for title, items in (("The harness failed (not the op)", harness),
                         ("(a) and (b) differ", differing),
                         ("(c) failures that are not a clean OutOfMemoryError naming the "
                          "budget", unclean),
                         ("(b) grew PyTorch's memory outside every private pool", grew),
                         ("check() failures", checks),
                         ("values of (b) differ from (a) (informational)", mismatched)):
        if items:
            details += [f"{title} ({len(items)}; first {limit}):", ""]
            details += [f"- {item}" for item in items[:limit]]
            details.append("")
    out += details
    out.append(f"All criteria hold: {'yes' if ok else '**no**'}")
    return "\n".join(out) + "\n", {"dtypes": summary_rows, "ok": ok,
                                   "differing": len(differing), "unclean": len(unclean),
                                   "outside_growth": len(grew), "check_failures": len(checks),
                                   "harness_errors": len(harness),
                                   "sticky_error": sticky}, ok


# -- command line ----------------------------------------------------------------------------


def _emit(markdown: str, summary: dict[str, Any], args: argparse.Namespace) -> None:
    sys.stdout.write(markdown)
    if args.md:
        Path(args.md).write_text(markdown, encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, sort_keys=True, default=str),
                                   encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cupy = commands.add_parser("cupy", help="compare CuPy suite runs")
    cupy.add_argument("--unrouted", required=True, help="the unrouted run's outcome file")
    cupy.add_argument("--routed", action="append", default=[], help="a routed run's file")
    cupy.add_argument("--tight", action="append", default=[],
                      help="a run with a budget too small for some tests")
    opinfo = commands.add_parser("opinfo", help="the table of an opinfo.py result")
    opinfo.add_argument("result", help="opinfo.py's JSON (or its .jsonl stream)")
    for command in (cupy, opinfo):
        command.add_argument("--md", help="write the tables here too")
        command.add_argument("--json", help="write the summary here")
        command.add_argument("--list", type=int, default=20, help="list at most this many")
    args = parser.parse_args(argv)
    try:
        if args.command == "cupy":
            markdown, summary, ok = cupy_report(
                load_run(args.unrouted), [load_run(p) for p in args.routed],
                [load_run(p) for p in args.tight], args.list)
        else:
            markdown, summary, ok = opinfo_report(load_opinfo(args.result), args.list)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"compare.py: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    _emit(markdown, summary, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
