"""The Perfetto export (the Trace Event Format): a slice per block with its tag, bytes and
stack, on threads where slices never overlap; whole microseconds; counters that keep every
peak; and a file no larger than the trace it comes from."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks.trace_gen import record_server
from gpubudget import gpu_budget
from gpubudget.viewer import ViewModel, ViewBudget, model_from_trace
from gpubudget.perfetto import RESOLUTIONS, perfetto_events, write_perfetto, write_perfetto_report
from gpubudget.tracefile import writer_for

KiB, MiB = 2**10, 2**20


def _events(path: Path) -> list[dict[str, Any]]:
    document = json.loads(path.read_text())
    return list(document["traceEvents"])


def _blocks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "X" and e.get("cat") != "budget"]


def test_every_block_is_a_slice_and_slices_of_a_thread_never_overlap(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    with gpu_budget("16MiB", name="pool", trace=str(trace)) as pool:
        with gpu_budget("8MiB", name="model") as model:
            held = [model.allocate((index + 1) * 64 * KiB, tag=f"layer{index % 3}")
                    for index in range(12)]
            for block in held[::2]:
                assert block is not None and model.free(block)
            assert model.allocate(MiB) is not None
        assert pool.allocate(KiB) is not None  # untagged
    writer_for(trace).flush()
    out = tmp_path / "run.json"
    write_perfetto(trace, out)
    events = _events(out)
    blocks = _blocks(events)
    view = model_from_trace(trace)
    assert sorted((e["name"], e["args"]["bytes"]) for e in blocks) == sorted(
        (view.tags[tag] if tag >= 0 else "untagged", int(size))
        for tag, size in zip(view.block_tag, view.block_size))
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {threads[e["tid"]] for e in blocks} == {"model blocks", "model blocks 2",
                                                  "model blocks 3", "model blocks 4",
                                                  "model blocks 5", "model blocks 6",
                                                  "model blocks 7", "model blocks 8",
                                                  "model blocks 9", "model blocks 10",
                                                  "model blocks 11", "model blocks 12",
                                                  "pool blocks"}
    by_thread: dict[int, list[tuple[int, int]]] = {}
    for event in blocks:
        by_thread.setdefault(event["tid"], []).append((event["ts"], event["ts"] + event["dur"]))
    for spans in by_thread.values():
        spans.sort()
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    sorts = {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    order = [threads[tid] for tid in sorted(threads, key=lambda tid: sorts[tid])]
    assert order[:3] == ["pool", "pool blocks", "model"]  # each budget, then its blocks


def test_times_are_whole_microseconds(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"
    with gpu_budget("1MiB", name="pool", trace=str(trace)) as pool:
        for _ in range(50):
            block = pool.allocate(4096)
            assert block is not None and pool.free(block)
    writer_for(trace).flush()
    out = tmp_path / "run.json"
    write_perfetto(trace, out)
    text = out.read_text()
    assert re.findall(r'"(?:ts|dur)":-?[0-9]+', text)
    assert not re.findall(r'"(?:ts|dur)":-?[0-9]*[.eE]', text)  # no 2122.1600000000003
    assert all(type(e["ts"]) is int for e in _events(out) if e["ph"] != "M")


def test_a_block_carries_its_stack_as_the_format_and_perfetto_read_it(tmp_path: Path) -> None:
    trace = tmp_path / "run.jsonl"

    def load_weights(budget: Any) -> int | None:
        block: int | None = budget.allocate(4096, tag="weights")
        return block

    with gpu_budget("1MiB", name="pool", trace=str(trace), track_stacks=True) as pool:
        assert load_weights(pool) is not None
        assert pool.allocate(1024, tag="other") is not None
    writer_for(trace).flush()
    out = tmp_path / "run.json"
    write_perfetto(trace, out)
    document = json.loads(out.read_text())
    frames = document["stackFrames"]
    slices = {e["name"]: e for e in _blocks(document["traceEvents"])}
    weights = slices["weights"]
    chain, node = [], str(weights["sf"])
    while node is not None:  # innermost first, up the callers
        chain.append(frames[node]["name"])
        node = frames[node].get("parent")
    (recorded,) = [b.stack for b in pool.report().live_blocks if b.tag == "weights"]
    assert recorded is not None and chain[::-1] == list(recorded)
    assert weights["args"]["at"] == recorded[-1] and "in load_weights" in recorded[-1]
    assert slices["other"]["sf"] != weights["sf"]


def test_the_export_is_no_larger_than_the_trace_and_keeps_every_peak(tmp_path: Path) -> None:
    trace = tmp_path / "server.jsonl"
    record_server(str(trace), events=15_000)
    assert trace.stat().st_size > MiB  # where size matters
    out = tmp_path / "server.json"
    resolution = write_perfetto(trace, out)
    assert resolution in RESOLUTIONS
    assert out.stat().st_size <= trace.stat().st_size
    events = _events(out)
    view = model_from_trace(trace)
    assert len(_blocks(events)) == len(view.block_budget)  # every block, whatever else
    peaks: dict[str, int] = {}
    last: dict[str, int] = {}
    for event in events:
        if event["ph"] == "C":
            for name, value in event["args"].items():
                peaks[name] = max(peaks.get(name, 0), value)
                last[name] = value
    names = [budget.name for budget in view.budgets]
    for index, budget in enumerate(view.budgets):
        if names.count(budget.name) == 1:
            assert peaks[budget.name] == budget.peak, budget.name
            final = max(i for i, b in enumerate(view.point_budget) if b == index)
            assert last[budget.name] == view.point_used[final], budget.name
    full = tmp_path / "full.json"
    assert write_perfetto(trace, full, resolution=1) == 1  # every change, if asked
    if resolution > 1:
        assert full.stat().st_size > trace.stat().st_size  # what the coarser counters saved


def test_a_peak_inside_an_interval_survives_a_coarser_resolution() -> None:
    model = ViewModel("t", "trace")
    model.budgets.append(ViewBudget("pool", None, MiB, 0, 0.0))
    for t, used in ((0.000_001, 100), (0.000_002, 900), (0.000_003, 200), (0.000_150, 300)):
        model.point(model.tick(t), 0, used, used)
    model.end = 0.000_150
    fine = [e["args"] for e in perfetto_events(model) if e["ph"] == "C"]
    assert [args["pool"] for args in fine] == [100, 900, 200, 300]
    coarse = [(e["ts"], e["args"]["pool"]) for e in perfetto_events(model, 100)
              if e["ph"] == "C"]
    assert coarse == [(1, 900), (3, 200), (150, 300)]  # the peak, the last, the next


def test_a_report_exports_and_a_bad_resolution_is_refused(tmp_path: Path) -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        assert pool.allocate(4096, tag="weights") is not None
    out = tmp_path / "report.json"
    write_perfetto_report(pool.report(), out)
    assert [e["name"] for e in _blocks(_events(out))] == ["weights"]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="resolution must be a whole number"):
            write_perfetto(tmp_path / "none.jsonl", out, resolution=bad)  # type: ignore[arg-type]
