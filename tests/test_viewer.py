"""The viewer's model and page, and the Perfetto export: what they hold, checked against the
replay of the same trace and against the Trace Event Format's documented fields."""

from __future__ import annotations

import base64
import json
import math
import re
import zlib
from array import array
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from gpubudget import gpu_budget
from gpubudget.cli import EXIT_BAD_INPUT, main
from gpubudget.html import ViewModel, model_from_report, model_from_trace, page_html
from gpubudget.html.model import _TraceState
from gpubudget.perfetto import perfetto_events, write_perfetto
from gpubudget.replay import replay
from gpubudget.tracefile import Alloc, Enter, writer_for

KiB, MiB = 2**10, 2**20


def record(path: Path) -> Path:
    """A root, a child with a reserve and one with a denial, a resize, a block left live."""
    with gpu_budget("16MiB", name="pool", trace=str(path)) as pool:
        with gpu_budget("4MiB", name="reserved", reserve="2MiB") as reserved:
            block = reserved.allocate(MiB, tag="weights")
            assert block is not None and reserved.resize(block, 3 * MiB)
            assert reserved.free(block)
        with gpu_budget("2MiB", name="model") as model:
            kept = model.allocate(512 * KiB, tag="weights")
            assert model.allocate(4 * MiB, tag="activations") is None
            temp = model.allocate(256 * KiB, tag="activations")
            assert temp is not None and model.free(temp)
        assert kept is not None and pool.allocate(KiB, tag="root") is not None
    writer_for(path).flush()
    return path


def _column(encoded: str, kind: str) -> list[Any]:
    return list(array(kind, zlib.decompress(base64.b64decode(encoded))))


def test_the_model_of_a_trace_agrees_with_its_replay(tmp_path: Path) -> None:
    trace = record(tmp_path / "run.jsonl")
    model = model_from_trace(trace)
    (report,) = replay(trace).reports
    names = [b.name for b in model.budgets]
    assert names == ["pool", "reserved", "model"]
    assert [b.parent for b in model.budgets] == [None, 0, 0]
    for item in report.walk():  # each budget's last point is its used at the end
        index = names.index(item.name)
        last = max(i for i, b in enumerate(model.point_budget) if b == index)
        assert model.point_used[last] == item.used
        assert model.budgets[index].peak == item.peak
    pool = [model.point_used[i] for i, b in enumerate(model.point_budget) if b == 0]
    assert pool[:2] == [0, 2 * MiB]  # the reserve, charged to the pool at the child's entry
    assert max(pool) == 3 * MiB  # the child's 3 MiB block: 1 MiB over its reserve
    assert model.denials == [(model.denials[0][0], 2, 4 * MiB, "over_limit",
                              model.tags.index("activations"))]
    sizes = list(model.block_size)
    assert sizes == [MiB, 3 * MiB, 512 * KiB, 256 * KiB, KiB]  # a resize: a new life
    assert model.block_end[0] == model.block_start[1]  # where the resize happened
    live = [k for k in range(len(sizes)) if math.isnan(model.block_end[k])]
    assert live == [2, 4]  # kept, and the root's block


def test_the_model_of_a_report_keeps_its_blocks_and_stacks() -> None:
    with gpu_budget("1MiB", name="pool", backend="host", track_stacks=True) as pool:
        with gpu_budget("256KiB", name="model") as model:
            block = model.allocate(4 * KiB, tag="weights")
            assert model.allocate(512 * KiB) is None
    model_ = model_from_report(pool.report())
    assert block is not None and model.free(block)
    assert model_.source == "report" and [b.name for b in model_.budgets] == ["pool", "model"]
    assert list(model_.block_size) == [4 * KiB] and math.isnan(model_.block_start[0])
    frames = [model_.frames[f] for f in model_.stacks[model_.block_stack[0]]]
    assert any("test_viewer.py" in frame for frame in frames)
    assert len(model_.denials) == 1 and model_.denials[0][1] == 1


def test_the_page_is_self_contained_and_carries_the_model(tmp_path: Path) -> None:
    model = model_from_trace(record(tmp_path / "run.jsonl"))
    model.budgets[1].name = "</script><script>alert(1)</script>"
    page = page_html(model)
    assert page.startswith("<!DOCTYPE html>") and page.count("</script>") == 2
    assert not re.search(r"(src|href)\s*=|https?://|@import|fetch\(", page)
    data = json.loads(page[page.index('id="gpubudget-data">') + 20:page.index("</script>")])
    assert data["budgets"][1][0] == "</script><script>alert(1)</script>"
    assert _column(data["points"]["used"], "d") == list(model.point_used)
    assert _column(data["blocks"]["b"], "i") == list(model.block_budget)
    t1 = _column(data["blocks"]["t1"], "d")
    assert [math.isnan(x) for x in t1] == [math.isnan(x) for x in model.block_end]


def test_to_html_and_view_write_the_same_renderer(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    trace = record(tmp_path / "run.jsonl")
    assert main(["view", str(trace), "-o", str(tmp_path / "view.html")]) == 0
    assert "viewer written to" in capsys.readouterr().out
    (report,) = replay(trace).reports
    report.to_html(tmp_path / "report.html")
    one, two = ((tmp_path / name).read_text() for name in ("view.html", "report.html"))
    script = re.compile(r"<script>.*</script>", re.DOTALL)
    assert script.findall(one) == script.findall(two)


@pytest.mark.parametrize("command", ["view", "export"])
def test_a_bad_trace_or_output_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "gpubudget-trace", "version": 1}\n{"ev": "free"}\n')
    extra = ["--perfetto"] if command == "export" else []
    for trace, output in ((bad, tmp_path / "out"), (tmp_path / "none.jsonl", tmp_path / "out"),
                          (record(tmp_path / "ok.jsonl"), tmp_path / "no" / "dir" / "out")):
        status = main([command, *extra, str(trace), "-o", str(output)])
        out, err = capsys.readouterr()
        assert status == EXIT_BAD_INPUT and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# -- Perfetto ----------------------------------------------------------------------------

_PHASES = {"M", "X", "C", "i"}


def _check_trace_event_format(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The fields the Trace Event Format documents, for the phases written; times in whole
    microseconds."""
    assert set(document) >= {"traceEvents"} and document["displayTimeUnit"] in ("ms", "ns")
    events = document["traceEvents"]
    for event in events:
        assert event["ph"] in _PHASES and isinstance(event["name"], str)
        assert isinstance(event["pid"], int)
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "thread_name", "thread_sort_index")
            assert set(event["args"]) in ({"name"}, {"sort_index"})
            continue
        assert type(event["ts"]) is int and event["ts"] >= 0
        if event["ph"] == "X":
            assert isinstance(event["tid"], int) and type(event["dur"]) is int
            assert event["dur"] >= 0
        elif event["ph"] == "C":
            assert all(type(v) is int for v in event["args"].values())
        else:
            assert event["s"] in ("g", "p", "t") and isinstance(event["tid"], int)
    return list(events)


def test_the_perfetto_export_follows_the_trace_event_format(tmp_path: Path) -> None:
    trace = record(tmp_path / "run.jsonl")
    out = tmp_path / "run.json"
    assert write_perfetto(trace, out) == 1  # a small trace: every change kept
    events = _check_trace_event_format(json.loads(out.read_text()))
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == ["gpubudget pool"]
    assert sorted(threads.values()) == ["model", "model blocks", "model blocks 2", "pool",
                                        "pool blocks", "reserved", "reserved blocks"]
    slices = {e["name"]: e for e in events if e.get("cat") == "budget"}
    assert set(slices) == {"pool", "reserved", "model"}
    assert slices["reserved"]["ts"] + slices["reserved"]["dur"] <= slices["model"]["ts"]
    (denial,) = [e for e in events if e["ph"] == "i"]
    assert threads[denial["tid"]] == "model"
    assert denial["args"] == {"bytes": 4 * MiB, "reason": "over_limit", "tag": "activations"}
    model_counter = [e["args"]["model"] for e in events if e["ph"] == "C"
                     and "model" in e["args"]]
    assert max(model_counter) == 768 * KiB and model_counter[-1] == 512 * KiB
    assert events == list(perfetto_events(model_from_trace(trace)))  # the file's fast path


class _AllocWithStack(NamedTuple):
    """An alloc event as a reader that carries stacks yields it (``stack`` last)."""

    t: float
    budget: int
    size: int
    align: int
    tag: str | None
    ptr: int | None
    nbytes: int
    reason: str | None
    stack: tuple[str, ...] | None


def test_stacks_on_alloc_events_are_interned_frame_by_frame() -> None:
    model = ViewModel("t", "trace")
    state = _TraceState(model)
    state.enter(Enter(0.0, 1, "pool", None, MiB, 256, 0, "host"))
    outer, inner, other = "app.py:3 in main", "model.py:9 in load", "model.py:12 in warm"
    for index, stack in enumerate([(outer, inner), (outer, inner), (outer, other), None]):
        state.alloc(_AllocWithStack(0.1 * index, 1, KiB, 0, None, 4096 * (index + 1), KiB,
                                    None, stack))  # type: ignore[arg-type]
    state.alloc(Alloc(0.5, 1, KiB, 0, None, 4096 * 9, KiB, None))  # a reader without stacks
    assert model.frames == [outer, inner, other]
    assert model.stacks == [[0, 1], [0, 2]]
    assert list(model.block_stack) == [0, 0, 1, -1, -1]
