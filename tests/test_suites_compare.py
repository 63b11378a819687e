"""scripts/suites: outcome records, outcome files and their comparison, on synthetic runs
(no CuPy, no PyTorch: the GPU runs are scripts/gpu-suites.sh's)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts.suites import compare
from scripts.suites.compare import (
    compare_outcomes,
    cupy_report,
    load_opinfo,
    opinfo_report,
    overhead,
    run_counts,
    tight_failures,
)
from scripts.suites.outcomes import (
    Recorder,
    clean_out_of_memory,
    describe_failure,
    exception_chain,
    is_hang,
    is_out_of_memory_type,
    load_run,
    stream_path,
)


class OutOfMemoryError(MemoryError):
    """Named like CuPy's and PyTorch's."""


class BudgetOutOfMemoryError(OutOfMemoryError):
    """Named like gpubudget's subclass of CuPy's."""


# -- describing a failure --------------------------------------------------------------------


def test_out_of_memory_errors_are_known_by_the_name_of_a_class_they_derive_from() -> None:
    assert is_out_of_memory_type(OutOfMemoryError())
    assert is_out_of_memory_type(BudgetOutOfMemoryError())
    assert not is_out_of_memory_type(MemoryError())
    assert not is_out_of_memory_type(AssertionError("OutOfMemoryError"))


def test_the_chain_holds_causes_and_contexts_once() -> None:
    inner = OutOfMemoryError("inner")
    try:
        try:
            raise inner
        except OutOfMemoryError as exc:
            raise RuntimeError("outer") from exc
    except RuntimeError as outer:
        chain = exception_chain(outer)
    assert [type(e).__name__ for e in chain] == ["RuntimeError", "OutOfMemoryError"]
    assert exception_chain(None) == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups: Python 3.11")
def test_the_chain_holds_the_members_of_exception_groups() -> None:
    group = ExceptionGroup("many", [ValueError("a"), OutOfMemoryError("b")])
    assert {type(e).__name__ for e in exception_chain(group)} == {
        "ExceptionGroup", "ValueError", "OutOfMemoryError"}


def test_an_out_of_memory_error_naming_the_budget_is_clean() -> None:
    error = BudgetOutOfMemoryError("budget 'test_x#gw0.3' (limit 1.00 MiB) refused 4194304 bytes")
    failure = describe_failure("call", error, "E   BudgetOutOfMemoryError: ...", "test_x#gw0.3")
    assert failure["oom_type"] and failure["oom"] and failure["names_budget"]
    assert clean_out_of_memory(failure)
    assert failure["exc_type"] == "BudgetOutOfMemoryError" and failure["when"] == "call"
    other = describe_failure("call", error, "", "test_y#gw0.4")
    assert other["oom"] and not other["names_budget"] and not clean_out_of_memory(other)


def test_cupys_assertion_error_holding_the_error_counts_by_its_text() -> None:
    text = ("Only cupy raises error\n\nTraceback (most recent call last):\n  ...\n"
            "gpubudget.cupy.BudgetOutOfMemoryError: budget 't#main.1' (limit 1.00 MiB) "
            "refused 8 bytes")
    failure = describe_failure("call", AssertionError(text), text, "t#main.1")
    assert failure["exc_type"] == "AssertionError" and not failure["oom_type"]
    assert failure["oom"] and failure["names_budget"] and clean_out_of_memory(failure)
    assert failure["oom_line"].startswith("gpubudget.cupy.BudgetOutOfMemoryError")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes: Python 3.11")
def test_pytorchs_note_naming_the_budget_is_searched() -> None:
    error = OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    error.add_note("gpubudget: budget 'add:float32:tight' (limit 1048576 bytes) refused")
    failure = describe_failure("call", error, "", "add:float32:tight")
    assert failure["names_budget"] and clean_out_of_memory(failure)


def test_a_plain_failure_is_not_an_out_of_memory_error() -> None:
    failure = describe_failure("call", AssertionError("1 != 2"), "assert 1 == 2", "t#main.1")
    assert not failure["oom"] and not clean_out_of_memory(failure)
    assert failure["message"] == "1 != 2"
    assert not clean_out_of_memory(None)


# -- recording reports -----------------------------------------------------------------------


def _report(recorder: Recorder, nodeid: str, *phases: tuple[str, str], **kw: Any) -> None:
    for when, outcome in phases:
        recorder.add(nodeid, when, outcome, 0.001, **kw)


def test_the_recorder_gives_pytests_outcomes(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path / "run.jsonl", {"label": "r", "mode": "root"})
    ok = ("setup", "passed"), ("teardown", "passed")
    _report(recorder, "t::passes", ok[0], ("call", "passed"), ok[1])
    _report(recorder, "t::fails", ok[0], ("call", "failed"), ok[1])
    _report(recorder, "t::setup_fails", ("setup", "failed"), ok[1])
    _report(recorder, "t::skipped", ("setup", "skipped"), ok[1])
    _report(recorder, "t::xfails", ok[0], ("call", "skipped"), ok[1], wasxfail=True)
    _report(recorder, "t::xpasses", ok[0], ("call", "passed"), ok[1], wasxfail=True)
    _report(recorder, "t::teardown_fails", ok[0], ("call", "passed"), ("teardown", "failed"))
    _report(recorder, "t::both_fail", ok[0], ("call", "failed"), ("teardown", "failed"))
    _report(recorder, "t::crashes", ok[0], ("???", "failed"))
    _report(recorder, "t::never_ends", ok[0])
    document = recorder.document(wall_s=1.5)
    recorder.close()
    outcomes = {nodeid: (r["outcome"], r["teardown_error"])
                for nodeid, r in document["tests"].items()}
    assert outcomes == {
        "t::passes": ("passed", False), "t::fails": ("failed", False),
        "t::setup_fails": ("error", False), "t::skipped": ("skipped", False),
        "t::xfails": ("xfailed", False), "t::xpasses": ("xpassed", False),
        "t::teardown_fails": ("error", True), "t::both_fail": ("failed", True),
        "t::crashes": ("crashed", False), "t::never_ends": ("crashed", False)}
    assert document["tests"]["t::never_ends"]["incomplete"]
    assert document["tests"]["t::crashes"]["failure"]["exc_type"] == "WorkerCrash"
    assert document["tests"]["t::passes"]["duration"] == pytest.approx(0.003)
    assert set(document["tests"]["t::passes"]["phases"]) == {"setup", "call", "teardown"}
    assert is_hang(document["tests"]["t::crashes"])
    assert not is_hang(document["tests"]["t::fails"])
    run = load_run(tmp_path / "run.jsonl")  # the stream alone reads back the same
    assert run.complete and run.meta["wall_s"] == 1.5
    assert {n: r["outcome"] for n, r in run.tests.items()} == {
        n: r["outcome"] for n, r in document["tests"].items()}


def test_the_routing_fixtures_measurements_and_failures_travel_as_user_properties() -> None:
    recorder = Recorder(None, {})
    info = {"budget": "t#main.1", "enter": 0.001, "released": "exit", "check_error": None}
    failure = {"when": "call", "exc_type": "BudgetOutOfMemoryError", "oom": True}
    recorder.add("t::a", "setup", "passed", 0.0)
    recorder.add("t::a", "call", "failed", 0.0,
                 properties=[("gpubudget.failure.call", failure), ("other", 1)])
    record = recorder.add("t::a", "teardown", "passed", 0.0,
                          properties=[("gpubudget.failure.call", failure), ("gpubudget", info)])
    assert record is not None
    assert record["failure"]["exc_type"] == "BudgetOutOfMemoryError"
    assert record["gpubudget"] == info and "_failures" not in record
    timeout = recorder.add("t::b", "call", "failed", 0.0,
                           text="Timeout (>60.0s) from pytest-timeout")
    assert timeout is None
    assert recorder.document()["tests"]["t::b"]["failure"]["message"].startswith("Timeout")


def test_stream_path() -> None:
    assert stream_path("out/root.json") == Path("out/root.jsonl")
    assert stream_path("out/root") == Path("out/root.jsonl")


# -- synthetic runs --------------------------------------------------------------------------


def _record(nodeid: str, outcome: str = "passed", duration: float = 0.010, *,
            failure: dict[str, Any] | None = None, info: dict[str, Any] | None = None,
            teardown_error: bool = False) -> dict[str, Any]:
    return {"nodeid": nodeid, "outcome": outcome, "duration": duration,
            "teardown_error": teardown_error, "phases": {}, "failure": failure,
            "gpubudget": info}


def _info(released: str = "exit", **kw: Any) -> dict[str, Any]:
    return {"budget": "b", "enter": 0.001, "route": 0.0002, "unroute": 0.0001, "exit": 0.007,
            "release": 0.0, "check": 0.0001, "released": released, "held_bytes": 0,
            "draining": 0, "check_error": None, **kw}


def _write(path: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"meta": meta, "tests": {r["nodeid"]: r for r in records}}))
    return path


NODES = [f"tests/cupy_tests/t.py::test_{i}" for i in range(10)]


@pytest.fixture
def unrouted(tmp_path: Path) -> Path:
    records = [_record(n) for n in NODES[:8]]
    records += [_record(NODES[8], "failed", failure={"exc_type": "AssertionError",
                                                     "message": "1 != 2", "oom": False})]
    records += [_record(NODES[9], "skipped")]
    return _write(tmp_path / "off.json", {"label": "unrouted", "mode": "off",
                                          "collected": 10, "wall_s": 30.0, "workers": 8},
                  records)


def _routed(tmp_path: Path, name: str, changes: dict[int, dict[str, Any]] | None = None,
            collected: int = 10) -> Path:
    records = []
    for i, nodeid in enumerate(NODES):
        outcome = "failed" if i == 8 else "skipped" if i == 9 else "passed"
        kwargs: dict[str, Any] = {"duration": 0.012, "info": _info()}
        if i == 8:
            kwargs["failure"] = {"exc_type": "AssertionError", "message": "1 != 2"}
        kwargs.update((changes or {}).get(i, {}))
        records.append(_record(nodeid, kwargs.pop("outcome", outcome), **kwargs))
    return _write(tmp_path / f"{name}.json", {"label": name, "mode": "root", "limit": "16GiB",
                                              "collected": collected, "wall_s": 33.0,
                                              "workers": 8}, records)


def test_identical_outcomes_and_the_overhead_per_test(tmp_path: Path, unrouted: Path) -> None:
    base, routed = load_run(unrouted), load_run(_routed(tmp_path, "root"))
    same = compare_outcomes(base, routed)
    assert same["identical"] and same["differing"] == 0 and same["common"] == 10
    cost = overhead(base, routed)
    assert cost["tests"] == 8
    assert cost["median"] == pytest.approx(0.002) and cost["mean"] == pytest.approx(0.002)
    assert cost["total"] == pytest.approx(0.016)
    assert cost["fixture"]["enter"]["median"] == pytest.approx(0.001)
    assert cost["fixture"]["all"]["median"] == pytest.approx(0.0084)
    markdown, summary, ok = cupy_report(base, [routed], [])
    assert ok and summary["ok"]
    assert "| root | yes | 0 | 0 | 0 | 0 | 0 | 10 / 0 / 0 / 0 | 0 |" in markdown
    assert "| root | 8 | 2.00 | 2.00 | 2.00 | 0.0 | 1.00 |" in markdown
    assert "All criteria hold: yes" in markdown


def test_differences_check_failures_and_hangs_are_listed(tmp_path: Path, unrouted: Path) -> None:
    changes: dict[int, dict[str, Any]] = {
        2: {"outcome": "failed", "failure": {"exc_type": "ValueError", "message": "bad"}},
        3: {"outcome": "error", "teardown_error": True,
            "info": _info(check_error="InvariantError: invariant LEDGER violated")},
        4: {"outcome": "crashed", "failure": {"exc_type": "WorkerCrash", "message": "crashed"}},
        5: {"info": _info("held", held_bytes=4096)},
        6: {"info": _info("plan_cache", draining=1)},
    }
    base, routed = load_run(unrouted), load_run(_routed(tmp_path, "root", changes))
    same = compare_outcomes(base, routed, limit=2)
    assert not same["identical"] and same["differing"] == 3 and len(same["examples"]) == 2
    assert same["examples"][0]["base"] == "passed"
    assert same["examples"][0]["other"] == "failed"
    assert same["examples"][0]["failure"] == "ValueError: bad"
    counts = run_counts(routed)
    assert counts["check_failures"] == 1 and counts["hangs"] == 1
    assert counts["released"] == {"exit": 8, "gc": 0, "plan_cache": 1, "held": 1}
    assert counts["held_bytes"] == 4096 and counts["draining"] == 1
    assert counts["teardown_errors"] == 1
    markdown, _, ok = cupy_report(base, [routed], [])
    assert not ok and "**no**" in markdown and "`tests/cupy_tests/t.py::test_2`" in markdown
    assert "passed → error+teardown-error" in markdown


def test_a_tight_run_must_fail_only_with_clean_out_of_memory_errors(tmp_path: Path,
                                                                    unrouted: Path) -> None:
    oom = {"exc_type": "BudgetOutOfMemoryError", "oom_type": True, "oom": True,
           "names_budget": True, "message": "budget 't' refused"}
    wrapped = {"exc_type": "AssertionError", "oom_type": False, "oom": True,
               "names_budget": True, "oom_line": "BudgetOutOfMemoryError: budget 't'"}
    nameless = {**oom, "names_budget": False}
    other = {"exc_type": "RuntimeError", "oom": False, "names_budget": False,
             "message": "cuFFT failed"}
    changes = {0: {"outcome": "failed", "failure": oom},
               1: {"outcome": "failed", "failure": wrapped},
               2: {"outcome": "error", "failure": nameless},
               3: {"outcome": "failed", "failure": other},
               4: {"outcome": "crashed", "failure": oom},
               8: {"outcome": "failed", "failure": other}}  # failed unrouted too: not counted
    base, tight = load_run(unrouted), load_run(_routed(tmp_path, "tight", changes))
    result = tight_failures(base, tight)
    assert (result["new_failures"], result["clean"], result["direct"], result["wrapped"],
            result["unclean"]) == (5, 2, 1, 1, 3)
    assert [e["nodeid"][-6:] for e in result["examples"]] == ["test_2", "test_3", "test_4"]
    markdown, summary, ok = cupy_report(base, [], [tight])
    assert not ok and not summary["tight"][0]["ok"]
    assert "| tight | 5 | 2 | 1 | 1 | **3** | 0 | 1 |" in markdown
    assert "RuntimeError: cuFFT failed" in markdown


def test_a_run_killed_by_its_time_limit_is_read_from_its_stream(tmp_path: Path,
                                                              unrouted: Path) -> None:
    stream = tmp_path / "child.jsonl"
    lines = [{"meta": {"label": "child", "mode": "child", "limit": "16GiB"}},
             {"meta": {"collected": 10}}]
    lines += [{"test": _record(n, duration=0.011, info=_info())} for n in NODES[:6]]
    stream.write_text("\n".join(json.dumps(line) for line in lines) + '\n{"test": {"nodei')
    run = load_run(tmp_path / "child.json")
    assert not run.complete and len(run.tests) == 6 and run.label == "child"
    counts = run_counts(run)
    assert counts["not_run"] == 4 and not counts["complete"]
    same = compare_outcomes(load_run(unrouted), run)
    assert same["differing"] == 0 and same["only_base"] == 4 and not same["identical"]
    markdown, _, ok = cupy_report(load_run(unrouted), [run], [])
    assert not ok and "Did not run to the end" in markdown
    assert "yes, on the tests both ran" in markdown and "4 tests of the unrouted run" in markdown
    with pytest.raises(FileNotFoundError):
        load_run(tmp_path / "missing.json")


def test_a_run_where_pytest_failed_does_not_pass(tmp_path: Path, unrouted: Path) -> None:
    broken = _write(tmp_path / "root.json", {"label": "root", "mode": "root", "limit": "16GiB",
                                             "exitstatus": 3, "wall_s": 2.0}, [])
    markdown, summary, ok = cupy_report(load_run(unrouted), [load_run(broken)], [])
    assert not ok and "Did not run to the end" in markdown
    assert "| root | 16GiB, a root per test | 0 |" in markdown and "| 3 |" in markdown
    tight = _write(tmp_path / "tight.json", {"label": "tight", "mode": "root", "limit": "1MiB",
                                             "exitstatus": 3}, [])
    assert not cupy_report(load_run(unrouted), [], [load_run(tight)])[2]


def test_the_command_line(tmp_path: Path, unrouted: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    root = _routed(tmp_path, "root")
    md, js = tmp_path / "summary.md", tmp_path / "summary.json"
    assert compare.main(["cupy", "--unrouted", str(unrouted), "--routed", str(root),
                         "--md", str(md), "--json", str(js)]) == 0
    assert "### Runs" in capsys.readouterr().out
    assert "| unrouted | none (unrouted) | 10 | 8 | 1 | 1 |" in md.read_text()
    assert json.loads(js.read_text())["ok"] is True
    bad = _routed(tmp_path, "bad", {0: {"outcome": "failed"}})
    assert compare.main(["cupy", "--unrouted", str(unrouted), "--routed", str(bad)]) == 1
    assert compare.main(["cupy", "--unrouted", str(tmp_path / "nope.json")]) == 2
    assert "nope" in capsys.readouterr().err


# -- OpInfo ----------------------------------------------------------------------------------


def _pair(op: str, dtype: str = "float32", samples: list[dict[str, Any]] | None = None,
          **kw: Any) -> dict[str, Any]:
    return {"op": op, "dtype": dtype, "backward": dtype == "float32",
            "samples": samples if samples is not None else [
                {"sample": 0, "a": "ok", "b": "ok", "c": "fwd:OutOfMemoryError",
                 "c_clean": True}],
            "times": {"a": 0.5, "b": 0.25, "c": 0.125}, "released": {"b": "exit", "c": "exit"},
            "outside_growth": {"reserved": 0, "allocated": 0}, "check_error": None, **kw}


def test_an_opinfo_run_where_everything_holds() -> None:
    document = {"meta": {"ops_total": 700, "dtypes": ["float32", "int64"], "wall_s": 9.0},
                "pairs": [_pair("add"), _pair("mul"), _pair("add", "int64")]}
    markdown, summary, ok = opinfo_report(document)
    assert ok and summary["ok"]
    assert ("| float32 | 2 | 2 | 2 | 2 / 0 | 2 / 0 | 0 / 2 | yes | 2 | 2 | 0 | 0 | 0 | 0 | "
            "1.0 / 0.5 / 0.2 |") in markdown
    assert "| int64 | 1 | 0 | 1 |" in markdown
    assert "b:exit 3, c:exit 3" in markdown


def test_an_opinfo_run_lists_what_does_not_hold() -> None:
    samples = [{"sample": -1, "a": "gen:RuntimeError", "b": "gen:RuntimeError",
                "c": "gen:RuntimeError"},
               {"sample": 0, "a": "ok", "b": "bwd:RuntimeError", "c": "fwd:RuntimeError",
                "c_clean": False, "c_message": "CUBLAS_STATUS_ALLOC_FAILED"},
               {"sample": 1, "a": "ok", "b": "ok", "c": "ok", "value_mismatch": "differ"}]
    pairs = [_pair("matmul", samples=samples,
                   outside_growth={"reserved": 2097152, "allocated": 512},
                   check_error="InvariantError: invariant LEDGER violated",
                   released={"b": "workspaces", "c": "exit"})]
    markdown, summary, ok = opinfo_report({"meta": {"cut_short": True}, "pairs": pairs})
    assert not ok
    assert (summary["differing"], summary["unclean"], summary["outside_growth"],
            summary["check_failures"]) == (1, 1, 1, 1)
    assert "matmul[float32] sample 0: ok → bwd:RuntimeError" in markdown
    assert "CUBLAS_STATUS_ALLOC_FAILED" in markdown
    assert "+2097152 bytes reserved" in markdown and "by the time limit" in markdown
    assert "b:workspaces 1" in markdown and "values of (b) differ" in markdown
    sticky = opinfo_report({"meta": {"sticky_error": "RuntimeError: illegal memory access"},
                            "pairs": [_pair("add")]})
    assert not sticky[2] and "poisons the process" in sticky[0]
    assert not opinfo_report({"meta": {}, "pairs": []})[2]  # nothing ran: nothing holds


def test_an_opinfo_result_is_read_from_its_stream_when_the_run_was_killed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stream = tmp_path / "opinfo.jsonl"
    stream.write_text("\n".join([json.dumps({"meta": {"ops_total": 3, "dtypes": ["float32"]}}),
                                 json.dumps({"pair": _pair("add")}), '{"pair": {"op": "mu']))
    document = load_opinfo(tmp_path / "opinfo.json")
    assert not document["complete"] and len(document["pairs"]) == 1
    markdown, _, ok = opinfo_report(document)
    assert ok and "the run did not end" in markdown
    assert compare.main(["opinfo", str(tmp_path / "opinfo.json")]) == 0
    assert "| float32 | 1 |" in capsys.readouterr().out
    assert compare.main(["opinfo", str(tmp_path / "none.json")]) == 2


def test_quantiles_and_formatting() -> None:
    assert compare._quantile([3.0, 1.0, 2.0], 0.9) == 3.0
    assert math.isnan(compare._quantile([], 0.5))
    assert compare._ms(math.nan) == "—" and compare._ms(0.0012345) == "1.23"
