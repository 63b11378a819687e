"""Replay (faithful, with the recorded times) and fit (limits, probes, several roots, cost
linear in the roots), including a hypothesis test over random recorded programs."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpubudget import Budget, gpu_budget, label
from gpubudget.replay import ReplayBackend, ReplayError, fit, replay
from gpubudget.replay.fit import _TreeEvents
from gpubudget.replay.run import Replayer
from gpubudget.tracefile import Enter, TraceReader, read_trace, writer_for

from .helpers import subprocess_env

MiB = 2**20
HEADER = {"format": "gpubudget-trace", "version": 1}


def record_abc(path: Path) -> None:
    """A child allocates A and B (1 MiB each), frees A, allocates C (2 MiB): 3 MiB are live
    at the peak, but the root needs 4 MiB (C cannot use A's hole). Known by construction:
    the child fits in 3 MiB, the root in 4 MiB."""
    with gpu_budget("16MiB", name="pool", trace=str(path)):
        with gpu_budget("8MiB", name="model") as model:
            a, b = model.allocate(MiB, tag="a"), model.allocate(MiB, tag="b")
            assert a is not None and b is not None and model.free(a)
            c = model.allocate(2 * MiB, tag="c")
            assert model.allocate(9 * MiB) is None  # recorded as a denial: a probe in replay
            assert c is not None and model.free(b) and model.free(c)
    writer_for(path).flush()


def write_trace(path: Path, *events: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in (HEADER, *events)))
    return path


def enter(b: int, name: str, parent: int | None = None, limit: int = 16 * MiB, t: float = 0.0,
          reserve: int = 0, align: int = 256) -> dict[str, Any]:
    return {"ev": "enter", "t": t, "b": b, "name": name, "parent": parent, "limit": limit,
            "align": align, "reserve": reserve, "backend": "host"}


def alloc(b: int, ptr: int | None, size: int, t: float = 0.0, reason: str | None = None,
          tag: str | None = None) -> dict[str, Any]:
    return {"ev": "alloc", "t": t, "b": b, "size": size, "align": 0, "tag": tag, "ptr": ptr,
            "bytes": size, "reason": reason}


def test_replay_reproduces_the_run(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    record_abc(path)
    result = replay(path)
    (report,) = result.reports
    assert result.roots == (next(b for b, r in result.budgets.items() if r.name == "pool"),)
    assert report.name == "pool" and report.children[0].name == "model"
    assert report.peak == 3 * MiB and report.children[0].allocations == 3
    assert report.children[0].denied == 1  # the recorded denial, denied again by 8 MiB
    assert result.denials == {next(b for b, r in result.budgets.items() if r.name == "model"): 1}
    tags = {u.tag: u.peak for u in report.children[0].by_tag}
    assert tags == {"a": MiB, "b": MiB, "c": 2 * MiB}
    assert replay(read_trace(path)).reports[0].as_dict(timeline=True) == report.as_dict(
        timeline=True)


def test_replay_keeps_the_recorded_times(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        enter(1, "pool", t=5.0),
        alloc(1, 4096, 1024, t=10.0),
        alloc(1, None, 64 * MiB, t=12.5, reason="over_limit"),
        {"ev": "free", "t": 20.0, "b": 1, "ptr": 4096},
        {"ev": "exit", "t": 21.0, "b": 1},
    )
    result = replay(path)
    (report,) = result.reports
    assert [(e.time, e.kind) for e in report.timeline] == [
        (0.0, "alloc"), (2.5, "deny"), (10.0, "free")]
    assert result.budgets[1].entered_at == 5.0
    backend = ReplayBackend()
    backend.now = 3.25
    assert backend.clock() == 3.25 and backend.noreserve


def test_replay_of_a_trace_cut_short_shows_what_was_live(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in (
        HEADER, enter(1, "pool"), enter(2, "model", parent=1), alloc(2, 4096, 5000, tag="w")))
        + '{"ev": "alloc", "t": 1.0, "b": 2, "si')
    result = replay(path)
    assert result.cut_short is not None and "cut short" in result.cut_short
    model = result.reports[0].children[0]
    assert model.state == "open" and [b.tag for b in model.live_blocks] == ["w"]


def test_allocations_after_a_release_that_pins_prevented(tmp_path: Path) -> None:
    # The child exits with nothing live, then allocates again: in the recording something
    # (a TensorRT engine) pinned it; the trace does not say so.
    path = write_trace(
        tmp_path / "t.jsonl", enter(1, "pool"), enter(2, "engine", parent=1, reserve=MiB),
        alloc(2, 4096, 1000), {"ev": "free", "t": 0.0, "b": 2, "ptr": 4096},
        {"ev": "exit", "t": 0.0, "b": 2}, alloc(2, 8192, 3 * MiB),
        {"ev": "free", "t": 0.0, "b": 2, "ptr": 8192})
    streamed = replay(path)
    assert streamed.after_release == 1 and not streamed.denials
    in_memory = replay(read_trace(path))  # kept from release until its last use
    assert in_memory.after_release == 0 and in_memory.reports[0].children[0].peak == 3 * MiB
    found = {f.name: f.limit for f in fit(path)}
    assert found == {"pool": 3 * MiB, "engine": 3 * MiB}


def test_untagged_blocks_take_no_label_from_the_caller(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", enter(1, "pool"), alloc(1, 4096, 1000))
    with label("caller"):
        report = replay(path).reports[0]
    assert report.by_tag == ()


def test_several_roots_replay_each_in_order(tmp_path: Path) -> None:
    path = tmp_path / "two.jsonl"
    for name in ("first", "second", "first"):
        with gpu_budget("1MiB", name=name, trace=str(path)) as budget:
            block = budget.allocate(100)
            assert block is not None and budget.free(block)
    writer_for(path).flush()
    result = replay(path)
    assert [r.name for r in result.reports] == ["first", "second", "first"]
    assert [result.budgets[root].name for root in result.roots] == ["first", "second", "first"]


def test_environment_variable_traces_every_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("GPUBUDGET_TRACE", str(path))
    for name in ("first", "second"):
        with gpu_budget("1MiB", name=name) as budget:
            block = budget.allocate(100)
            assert block is not None and budget.free(block)
    writer_for(path).flush()
    names = [e.name for e in read_trace(path).events if isinstance(e, Enter)]
    assert names == ["first", "second"]
    assert len(replay(path).reports) == 2


def test_trace_only_on_roots_and_bad_paths(tmp_path: Path) -> None:
    with gpu_budget("1MiB"):
        with pytest.raises(ValueError, match="only a root budget writes a trace"):
            with gpu_budget("1KiB", trace=str(tmp_path / "x.jsonl")):
                pass  # pragma: no cover
    with pytest.raises(TypeError, match="trace"):
        gpu_budget("1MiB", trace=3)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="cannot write"):
        with gpu_budget("1MiB", trace=str(tmp_path / "missing" / "x.jsonl")):
            pass  # pragma: no cover


def test_a_replay_is_not_traced_even_where_every_root_is(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "abc.jsonl"
    record_abc(path)
    before = path.read_bytes()
    monkeypatch.setenv("GPUBUDGET_TRACE", str(path))  # the very file being read
    assert replay(path).reports[0].peak == 3 * MiB
    assert [f.limit for f in fit(path)] == [13 * MiB, 12 * MiB]
    assert path.read_bytes() == before


def test_a_root_larger_than_the_host_can_map_is_a_clear_error(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", enter(1, "huge", limit=2**62))
    with pytest.raises(ReplayError, match=r"cannot replay root budget 'huge': its limit of .* "
                                          r"cannot be mapped in host memory"):
        replay(path)


def test_denials_that_no_limit_changes_are_not_replayed(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl", enter(1, "pool"),
        alloc(1, None, 100, reason="released"), alloc(1, None, -5, reason="invalid_size"),
        alloc(1, None, 100, reason="invalid_alignment"), {"ev": "exit", "t": 1.0, "b": 1})
    assert not replay(path).denials
    assert [f.limit for f in fit(path)] == [256]


# -- fit ------------------------------------------------------------------------------


def test_fit_finds_the_limits_known_by_construction(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    record_abc(path)
    found = {f.name: f for f in fit(path)}
    # The denied 9 MiB request is replayed as a probe: B and C are live then, so the model
    # needs 1 + 2 + 9 = 12 MiB, and the pool 13 MiB: A's 1 MiB hole before B stays unused.
    assert found["model"].limit == 12 * MiB and found["model"].largest_denied == 9 * MiB
    assert found["model"].peak == 3 * MiB and found["pool"].peak == 3 * MiB  # granted only
    assert found["pool"].limit == 13 * MiB and found["pool"].largest_denied == 0
    assert found["pool"].parent is None and found["model"].parent == found["pool"].budget
    limits = {f.budget: f.limit for f in found.values()}
    assert not replay(path, limits=limits).denials
    smaller = {**limits, found["pool"].budget: found["pool"].limit - 256}
    assert replay(path, limits=smaller).denials


def test_fit_of_a_trace_without_denials(tmp_path: Path) -> None:
    path = tmp_path / "clean.jsonl"
    with gpu_budget("16MiB", name="pool", trace=str(path)):
        with gpu_budget("8MiB", name="model") as model:
            a, b = model.allocate(MiB), model.allocate(MiB)
            assert a is not None and b is not None and model.free(a)
            c = model.allocate(2 * MiB)
            assert c is not None and model.free(b) and model.free(c)
    writer_for(path).flush()
    found = {f.name: (f.limit, f.peak) for f in fit(path)}
    assert found == {"pool": (4 * MiB, 3 * MiB), "model": (3 * MiB, 3 * MiB)}


def test_fit_keeps_reserves_and_alignments(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with gpu_budget("16MiB", name="pool", align=4096, trace=str(path)):
        with gpu_budget("8MiB", name="model", reserve="2MiB") as model:
            block = model.allocate(100_000)
            assert block is not None and model.free(block)
    writer_for(path).flush()
    found = {f.name: f for f in fit(path)}
    assert (found["model"].reserve, found["model"].align, found["model"].limit) == (2 * MiB, 256, 2 * MiB)
    assert (found["pool"].align, found["pool"].limit) == (4096, 2 * MiB)


def test_fit_of_a_probe_larger_than_the_host_can_map(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", enter(1, "pool"),
                       alloc(1, None, 2**60, reason="over_limit"))
    with pytest.raises(ReplayError, match="cannot fit budget 'pool': host memory cannot map"):
        fit(path)


def test_fit_of_a_trace_with_no_budget(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match="the trace holds no budget"):
        fit(write_trace(tmp_path / "t.jsonl"))


def record_requests(path: Path, roots: int) -> None:
    for index in range(roots):
        with gpu_budget("1MiB", name="request", trace=str(path)):
            with gpu_budget("512KiB", name="model") as model:
                blocks = [model.allocate(1000 * (1 + (index + k) % 7)) for k in range(6)]
                for block in blocks[::2] + blocks[1::2]:
                    assert block is not None and model.free(block)
    writer_for(path).flush()


def test_fit_holds_events_losslessly_in_flat_arrays(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    with gpu_budget("16MiB", name="pool", trace=str(path)):
        with gpu_budget("8MiB", name="model", reserve="1MiB", align=512) as model:
            block = model.allocate(MiB, tag="weights")
            assert block is not None and model.resize(block, 2 * MiB) is not None
            assert model.allocate(9 * MiB) is None and model.allocate(0) is None
            assert model.free(block)
    writer_for(path).flush()
    events = read_trace(path).events
    store = _TreeEvents()
    for event in events:
        store.append(event)
    assert len(store) == len(events) and list(store) == events


def test_fit_is_linear_in_the_number_of_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    replayed = {"events": 0}
    run = Replayer.run

    def counting(self: Replayer, events: Any) -> Any:
        events = list(events)
        replayed["events"] += len(events)
        return run(self, events)

    monkeypatch.setattr(Replayer, "run", counting)
    per_event = []
    for roots in (5, 80):
        path = tmp_path / f"{roots}.jsonl"
        record_requests(path, roots)
        replayed["events"] = 0
        fits = fit(path)
        assert len(fits) == 2 * roots
        per_event.append(replayed["events"] / len(read_trace(path).events))
    # Every root is replayed a few times on its own events: the work per event does not
    # grow with the number of roots (replaying the whole trace per root would make it 16x).
    assert per_event[1] <= per_event[0] * 1.5 and per_event[1] < 30


def test_fit_reports_progress(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    record_requests(path, 3)
    messages: list[str] = []
    fit(path, progress=messages.append)
    assert messages[0] == "fitting root 1 of 3 ('request'): replay 1"
    assert messages[-1].startswith("fitting root 3 of 3 ('request'): replay ")


# -- random programs: a replay is faithful, a fit is tight --------------------------------

OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 300_000), st.sampled_from([0, 0, 512, 4096])),
        st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("resize"), st.integers(0, 50), st.integers(1, 300_000)),
        st.tuples(st.just("child"), st.integers(1, 4), st.sampled_from([0, 0, 64 * 1024])),
        st.tuples(st.just("exit"), st.just(0), st.just(0)),
    ),
    max_size=40,
)


def run_program(path: Path, operations: list[tuple[str, int, int]]) -> Budget:
    """Run ``operations`` on real budgets, traced; return the root (exited)."""
    with gpu_budget("1MiB", name="root", trace=str(path), align=512) as root:
        stack = [root]
        blocks: list[tuple[Budget, int]] = []
        for kind, a, b in operations:
            budget = stack[-1]
            if kind == "alloc":
                address = budget.allocate(a, b, tag=f"t{a % 3}")
                if address is not None:
                    blocks.append((budget, address))
            elif kind == "free" and blocks:
                owner, address = blocks.pop(a % len(blocks))
                assert owner.free(address)
            elif kind == "resize" and blocks:
                index = a % len(blocks)
                owner, address = blocks[index]
                moved = owner.resize(address, b)
                if moved is not None:
                    blocks[index] = (owner, moved)
            elif kind == "child" and len(stack) < 4:
                try:
                    child = gpu_budget(a * 128 * 1024, name=f"c{len(stack)}", reserve=b or None)
                    child.__enter__()
                except Exception:  # noqa: BLE001 - a reserve that does not fit: not entered
                    continue
                stack.append(child)
            elif kind == "exit" and len(stack) > 1:
                stack.pop().__exit__(None, None, None)
        while len(stack) > 1:
            stack.pop().__exit__(None, None, None)
    writer_for(path).flush()
    return root


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=OPERATIONS)
def test_random_programs_replay_faithfully_and_fit_tightly(operations: list[tuple[str, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "program.jsonl"
        root = run_program(path, operations)
        recorded = root.report()
        (replayed,) = replay(path).reports
        for live, again in zip(recorded.walk(), replayed.walk()):
            assert (again.name, again.peak, again.allocations, again.frees, again.denied) == (
                live.name, live.peak, live.allocations, live.frees, live.denied)
            assert sorted((u.tag, u.peak) for u in again.by_tag) == sorted(
                (u.tag, u.peak) for u in live.by_tag)
        fits = fit(path)
        for found in fits:
            assert found.peak <= found.recorded_limit
            assert found.limit >= max(found.peak, found.reserve)
        limits = {f.budget: f.limit for f in fits}
        assert not replay(path, limits=limits).denials
        top = fits[0]
        assert top.parent is None
        if top.limit > top.align:  # one alignment less is denied: the fit is the smallest
            assert replay(path, limits={**limits, top.budget: top.limit - top.align}).denials


def test_a_reader_can_be_replayed(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    record_abc(path)
    with TraceReader(path) as reader:
        assert replay(reader).reports[0].peak == 3 * MiB
    with TraceReader(path) as reader:
        assert [f.limit for f in fit(reader)] == [13 * MiB, 12 * MiB]


def test_a_replay_in_a_thread_is_not_warned_about_separate_roots(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    record_abc(path)
    with gpu_budget("1MiB", name="mine"):  # open while a thread replays: its roots are meant
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ThreadPoolExecutor(1) as executor:
                result = executor.submit(replay, path).result()
    assert [w for w in caught if str(w.message).startswith("gpubudget")] == []
    assert [report.name for report in result.reports] == ["pool"]


def test_reports_show_the_recorded_addresses_the_same_at_every_run(tmp_path: Path) -> None:
    """Live blocks are listed at the addresses the recording gave them (in their order),
    not at the replay's own, which change from run to run: two reports of one trace print
    the same, in the command's text and JSON, by reader and from memory."""
    path = tmp_path / "leaks.jsonl"
    with gpu_budget("64MiB", name="pool", trace=str(path), backend="host") as pool:
        with gpu_budget("32MiB", name="model") as model:
            kept = [model.allocate(10_000 * (k + 1), tag=f"w{k}") for k in range(30)]
            for block in kept[::3]:
                assert block is not None and model.free(block)
        leak = pool.allocate(4096, tag="leak")
        assert leak is not None
    writer_for(path).flush()
    recorded = {record["ptr"]: record["b"] for record in map(json.loads,
                                                             path.read_text().splitlines()[1:])
                if record.get("ev") == "alloc" and record.get("ptr") is not None}
    freed = set(kept[::3])  # (the leak may take the address of one of them)
    held = [block for block in kept if block is not None and block not in freed]
    live = sorted([*held, leak])
    runs = [subprocess.run([sys.executable, "-m", "gpubudget", "report", *options, str(path)],
                           capture_output=True, text=True, env=subprocess_env(), timeout=300)
            for options in ([], [], ["--json"], ["--json"])]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[2].stdout == runs[3].stdout
    shown = [int(word, 16) for word in runs[0].stdout.split() if word.startswith("0x")]
    assert shown and set(shown) <= set(recorded)  # 20 of each report's first rows
    listed = [block["address"] for report in json.loads(runs[2].stdout)["roots"]
              for item in _walk(report) for block in item["live_blocks"]]
    assert sorted(listed) == live  # every live block, at its recorded address
    first, second = replay(path), replay(read_trace(path))
    assert first.reports[0].as_dict() == second.reports[0].as_dict()
    assert [b.address for b in first.reports[0].children[0].live_blocks] == sorted(held)


def _walk(report: dict[str, Any]) -> list[dict[str, Any]]:
    found, stack = [], [report]
    while stack:
        item = stack.pop()
        found.append(item)
        stack.extend(item["children"])
    return found
