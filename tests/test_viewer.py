"""The viewer's model and page, and the Perfetto export: what they hold, checked against the
replay of the same trace and against the Trace Event Format's documented fields."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import zlib
from array import array
from itertools import accumulate
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from gpubudget import gpu_budget
from gpubudget.cli import EXIT_BAD_INPUT, main
from gpubudget.viewer import ViewModel, model_from_report, model_from_trace, page_html
from gpubudget.viewer.tracemodel import TraceState
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


_CODES = {"u8": "B", "i8": "b", "u16": "H", "i16": "h", "u32": "I", "i32": "i", "f64": "d"}


def _column(spec: dict[str, str]) -> list[Any]:
    return list(array(_CODES[spec["type"]], zlib.decompress(base64.b64decode(spec["data"]))))


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
            temp = model.allocate(8 * KiB, tag="scratch")
            assert temp is not None and model.free(temp)
            assert model.allocate(512 * KiB) is None
    model_ = model_from_report(pool.report())
    assert block is not None and model.free(block)
    assert model_.source == "report" and [b.name for b in model_.budgets] == ["pool", "model"]
    # the timeline's allocations are blocks; the live one took the report's address, stack
    assert list(model_.block_size) == [4 * KiB, 8 * KiB]
    assert [model_.tags[t] for t in model_.block_tag] == ["weights", "scratch"]
    assert list(model_.block_address) == [block, -1]  # a freed one's address is not kept
    assert list(model_.block_to) == [-1, model_.block_from[1] + 1]
    frames = [model_.frames[f] for f in model_.stacks[model_.block_stack[0]]]
    assert any("test_viewer.py" in frame for frame in frames)
    assert model_.block_stack[1] == -1
    assert len(model_.denials) == 1 and model_.denials[0][1] == 1
    assert model_.regions == [(0, block, MiB, -1, -1)]  # from its lowest block, its limit


def test_a_report_block_from_before_its_timeline_is_live_from_the_start() -> None:
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        old = pool.allocate(KiB, tag="old")
        report = pool.report()
    assert old is not None and pool.free(old)
    trimmed = dataclasses.replace(report, timeline=())  # as if its events had rolled out
    model = model_from_report(trimmed)
    assert list(model.block_from) == [-1] and list(model.block_to) == [-1]
    assert list(model.block_address) == [old] and list(model.point_used) == [KiB]


def test_times_never_go_back_and_name_their_events(tmp_path: Path) -> None:
    """Threads may write a trace's lines slightly out of order: the model's clock does not
    go back, and points and blocks name their events by index."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in [
        {"format": "gpubudget-trace", "version": 1},
        {"ev": "enter", "t": 1.0, "b": 1, "name": "pool", "parent": None, "limit": MiB,
         "align": 256, "reserve": 0, "backend": "host"},
        {"ev": "alloc", "t": 2.0, "b": 1, "size": 256, "align": 0, "tag": None, "ptr": 4096,
         "bytes": 256, "reason": None},
        {"ev": "alloc", "t": 1.5, "b": 1, "size": 256, "align": 0, "tag": None, "ptr": 8192,
         "bytes": 256, "reason": None},
        {"ev": "free", "t": 3.0, "b": 1, "ptr": 4096}]) + "\n")
    model = model_from_trace(trace)
    assert list(model.times) == [1.0, 2.0, 2.0, 3.0]
    assert list(model.point_t) == [model.times[i] for i in model.point_at]
    assert list(model.block_from) == [1, 2] and list(model.block_to) == [3, -1]
    assert model.regions == [(0, 4096, MiB, 0, -1)]


def test_the_page_is_self_contained_and_carries_the_model(tmp_path: Path) -> None:
    model = model_from_trace(record(tmp_path / "run.jsonl"))
    model.budgets[1].name = "</script><script>alert(1)</script>"
    page = page_html(model)
    assert page.startswith("<!DOCTYPE html>") and page.count("</script>") == 2
    overview = page[page.index('<section id="overview">'):page.index("</section>")]
    assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in overview  # escaped
    assert "3 budgets, 5 blocks, 1 denial, 2 leaked blocks" in overview
    assert not re.search(r"(src|href)\s*=|https?://|@import|fetch\(", page)
    payload = json.loads(page[page.index('id="gpubudget-data">') + 20:page.index("</script>")])
    data = payload["main"]
    assert payload["other"] is None
    assert data["budgets"][1][0] == "</script><script>alert(1)</script>"
    assert _column(data["points"]["used"]) == list(model.point_used)
    assert data["points"]["used"]["type"] == "u32"  # whole bytes under 4 GiB: 4 bytes each
    assert _column(data["blocks"]["b"]) == list(model.block_budget)
    assert data["blocks"]["b"]["type"] == "u8" and data["blocks"]["to"]["type"] == "i8"
    assert _column(data["blocks"]["to"]) == list(model.block_to)
    assert _column(data["blocks"]["addr"]) == list(model.block_address)  # 64-bit: f64
    assert data["times"]["t"]["steps"] == "ns"  # a trace's times: whole nanoseconds
    assert list(accumulate(_column(data["times"]["t"]))) == [round(t * 1e9) for t in model.times]
    assert [ns / 1e9 for ns in accumulate(_column(data["times"]["t"]))] == list(model.times)
    assert data["points"]["at"]["type"] == "u8"  # steps of 0 and 1 mostly
    assert list(accumulate(_column(data["points"]["at"]))) == list(model.point_at)
    assert data["regions"] == [list(r) for r in model.regions]


def test_times_that_are_not_whole_nanoseconds_travel_as_they_are() -> None:
    model = ViewModel("t", "report")
    for t in (0.0, 1 / 3, 0.5, 2 / 3):
        model.tick(t)
    spec = json.loads(page_html(model).split('id="gpubudget-data">')[1].split("</script>")[0])
    assert spec["main"]["times"]["t"]["type"] == "f64" and "steps" not in spec["main"]["times"]["t"]
    assert _column(spec["main"]["times"]["t"]) == list(model.times)


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
    state = TraceState(model)
    state.enter(Enter(0.0, 1, "pool", None, MiB, 256, 0, "host"))
    outer, inner, other = "app.py:3 in main", "model.py:9 in load", "model.py:12 in warm"
    for index, stack in enumerate([(outer, inner), (outer, inner), (outer, other), None]):
        state.alloc(_AllocWithStack(0.1 * index, 1, KiB, 0, None, 4096 * (index + 1), KiB,
                                    None, stack))  # type: ignore[arg-type]
    state.alloc(Alloc(0.5, 1, KiB, 0, None, 4096 * 9, KiB, None))  # a reader without stacks
    assert model.frames == [outer, inner, other]
    assert model.stacks == [[0, 1], [0, 2]]
    assert list(model.block_stack) == [0, 0, 1, -1, -1]


def page_data(page: Path) -> dict[str, Any]:
    """The model the page carries (its data block, decoded)."""
    text = page.read_text(encoding="utf-8")
    found = re.search(r'<script type="application/json" id="gpubudget-data">(.*?)</script>',
                      text, re.S)
    assert found is not None
    data: dict[str, Any] = json.loads(found.group(1))
    return data


def test_view_reads_a_report_as_report_json_or_to_json_writes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``gpubudget view r.json`` of ``gpubudget report --json``'s output draws its first root,
    and of ``to_json(timeline=True)`` the whole timeline: the budgets and the live blocks the
    report lists, with their addresses."""
    trace = record(tmp_path / "run.jsonl")
    assert main(["report", "--json", str(trace)]) == 0
    document = tmp_path / "r.json"
    document.write_text(capsys.readouterr().out, encoding="utf-8")
    page = tmp_path / "r.html"
    assert main(["view", str(document), "-o", str(page)]) == 0
    assert "viewer written to" in capsys.readouterr().out
    data = page_data(page)["main"]
    assert [b[0] for b in data["budgets"]] == ["pool", "reserved", "model"]
    assert data["source"] == "report"
    addresses = _column(data["blocks"]["addr"])
    replayed = model_from_trace(trace)
    live = sorted(int(replayed.block_address[k]) for k in range(len(replayed.block_size))
                  if replayed.block_to[k] < 0)
    assert sorted(a for a in addresses if a >= 0) == live
    assert any("without its timeline" in note for note in data["notes"])

    with gpu_budget("1MiB", name="alone", backend="host") as alone:
        block = alone.allocate(1000, tag="weights")
        assert block is not None and alone.free(block)
        kept = alone.allocate(2000, tag="cache")
        one = tmp_path / "one.json"
        one.write_text(alone.report().to_json(timeline=True), encoding="utf-8")
    assert kept is not None
    assert main(["view", str(one), "-o", str(page)]) == 0
    data = page_data(page)["main"]
    assert [b[0] for b in data["budgets"]] == ["alone"] and data["tags"] == ["weights", "cache"]
    assert len(_column(data["blocks"]["size"])) == 2  # both, from the timeline
    assert _column(data["blocks"]["to"])[1] == -1  # the cache block, live at the end


@pytest.mark.parametrize(("text", "said"), [
    ('{"name": "pool", "state": "open"}', "the report has no 'limit'"),
    ('{"name": "pool", "state": "odd", "limit": 1, "used": 0, "peak": 0}',
     "the report['state'] is 'odd'"),
    ('{"name": "pool", "state": "open", "limit": -1, "used": 0, "peak": 0}',
     "the report['limit'] is -1"),
    ('{"name": "pool", "state": "open", "limit": ' + "9" * 5000 + ', "used": 0, "peak": 0}',
     "not JSON"),
    ('{"name": "pool", "state": "open", "limit": 1, "used": 0, "peak": 0, "live_blocks": '
     '[{"address": 1, "size": 2, "tag": [[["x"]]]}]}', "['live_blocks'][0]['tag'] is a list"),
    ('{"trace": "x", "roots": []}', "'roots' is empty"),
    ('{"trace": "x", "roots": [5]}', "roots[0] is 5, not an object"),
    ('{"name": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{\n"name": "pool", "state": "open", "limit": 1, "used": 0, "peak": 0, "children": '
     '[{"name": "c", "state": "open", "limit": 1, "used": 0, "peak": 1.5}]}',
     "the report['children'][0]['peak'] is 1.5"),
])
def test_a_bad_report_is_one_line_naming_the_file_and_field_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(text, encoding="utf-8")
    assert main(["view", str(bad), "-o", str(tmp_path / "x.html")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and said in err, err
    assert "Traceback" not in err and "internal error" not in err
