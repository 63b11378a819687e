"""Stacks in traces: ``track_stacks=True`` writes each frame once and names it by id; the
reader gives each allocation its stack; replay and ``report`` keep them; every bad variant
is one line and exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget.cli import EXIT_BAD_INPUT, main
from gpubudget.replay import replay
from gpubudget.tracefile import MAX_FRAMES, Alloc, TraceError, TraceReader, writer_for
from gpubudget.tracefile.cscan import NATIVE

HEADER = {"format": "gpubudget-trace", "version": 1}
ROOT = {"ev": "enter", "t": 0.0, "b": 1, "name": "pool", "parent": None, "limit": 1 << 20,
        "align": 256, "reserve": 0}


def grant(ptr: int, stack: Any) -> dict[str, Any]:
    return {"ev": "alloc", "t": 0.1, "b": 1, "size": 4096, "align": 0, "tag": "w",
            "ptr": ptr, "bytes": 4096, "reason": None, "stack": stack}


def frame(index: Any, at: Any = "model.py:12 in load") -> dict[str, Any]:
    return {"ev": "frame", "id": index, "at": at}


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def load_weights(budget: Any) -> int | None:
    block: int | None = budget.allocate(4096, tag="weights")
    return block


def record(path: Path) -> tuple[list[tuple[int, tuple[str, ...] | None]], Any]:
    """A traced root keeping stacks: 20 allocations from one place, one from another; the
    live blocks with their stacks, as the budget itself reports them."""
    with gpu_budget("1MiB", name="pool", backend="host", trace=str(path),
                    track_stacks=True) as pool:
        for _ in range(20):
            load_weights(pool)
        other = pool.allocate(256)
        assert other is not None and pool.free(other)
        report = pool.report()
    writer_for(str(path)).flush()
    return [(block.address, block.stack) for block in report.live_blocks], report


def test_each_frame_is_written_once_and_every_stack_read_back(tmp_path: Path) -> None:
    path = tmp_path / "stacks.jsonl"
    recorded, _ = record(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    frames = [line for line in lines if line.get("ev") == "frame"]
    texts = [line["at"] for line in frames]
    assert len(texts) == len(set(texts)) and any("load_weights" in at for at in texts)
    with TraceReader(path) as reader:
        allocs = {event.ptr: event.stack for event in reader if type(event) is Alloc}
    assert len(allocs) == 21
    for address, stack in recorded:
        assert stack is not None and allocs[address] == stack
        assert "load_weights" in stack[-1]  # innermost last, as the budget reports it


def test_replay_and_report_show_the_stacks_of_leaked_blocks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "stacks.jsonl"
    recorded, _ = record(path)
    (report,) = replay(path).reports
    assert sorted(block.stack or () for block in report.live_blocks) == sorted(
        stack or () for _, stack in recorded)
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "in load_weights" in out


def test_frames_from_a_file_reach_the_terminal_escaped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "t.jsonl", [HEADER, ROOT, frame(0, "evil\x1b[2J.py:1 in f"),
                                        grant(4096, [0])])
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "evil\\x1b[2J.py:1 in f" in out


def test_stacks_survive_fit_storage(tmp_path: Path) -> None:
    """``fit`` holds a tree's events in flat arrays: the stacks come back from them."""
    from gpubudget.replay.fit import _TreeEvents

    path = tmp_path / "stacks.jsonl"
    record(path)
    with TraceReader(path) as reader:
        events = list(reader)
    store = _TreeEvents()
    for event in events:
        store.append(event)
    assert list(store) == events
    assert any(type(e) is Alloc and e.stack for e in store)


@pytest.mark.parametrize(("records", "message"), [
    ([frame(0), grant(4096, [0, 1])],
     ":4: alloc event: 'stack' names frame 1, which no earlier line defines"),
    ([grant(4096, [0]), frame(0)],
     ":3: alloc event: 'stack' names frame 0, which no earlier line defines"),
    ([frame(0), frame(0, "other.py:1 in g")],
     ":4: frame event: frame id 0 was already defined, at line 3"),
    ([frame(0), grant(4096, [0] * (MAX_FRAMES + 1))],
     f":4: alloc event: 'stack' has {MAX_FRAMES + 1} frames, more than {MAX_FRAMES}"),
    ([frame(0), grant(4096, 0)],
     ":4: alloc event: 'stack' must be a list of frame ids or null, got 0"),
    ([frame(0), grant(4096, ["0"])],
     ":4: alloc event: 'stack' must hold frame ids (integers), got \"0\""),
    ([frame(True)], ":3: frame event: 'id' must be an integer, got true"),
    ([frame(-1)], ":3: frame event: 'id' must be an integer >= 0 and below 2**63, got -1"),
    ([frame(0, None)], ":3: frame event: 'at' must be a string, got null"),
    ([{"ev": "frame", "at": "x"}], ":3: frame event: missing field 'id'"),
])
@pytest.mark.parametrize("parser", ["json", "msgspec"])
def test_every_bad_stack_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], records: list[dict[str, Any]],
        message: str, parser: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if parser == "msgspec":
        pytest.importorskip("msgspec", reason="the fast path needs the traces extra")
    monkeypatch.setenv("GPUBUDGET_TRACE_PARSER", parser)
    path = write(tmp_path / "bad.jsonl", [HEADER, ROOT, *records])
    with pytest.raises(TraceError, match=re.escape(message) + "$"), \
            TraceReader(path, parser=parser) as reader:
        list(reader)
    for command in ("report", "fit"):
        assert main([command, str(path)]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].endswith(message), err


def test_without_msgspec_the_plain_path_reads_and_says_what_is_missing(tmp_path: Path) -> None:
    """In a process where msgspec cannot be imported: ``auto`` reads with the C scanner
    where it is built, else with json, the same events; asking for msgspec names the
    extra."""
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    path = tmp_path / "stacks.jsonl"
    record(path)
    with TraceReader(path, parser="json") as reader:
        expected = repr(list(reader))
    script = (
        "import sys; sys.modules['msgspec'] = None\n"
        "from gpubudget.tracefile import TraceReader\n"
        f"reader = TraceReader({str(path)!r})\n"
        "print(reader.parser); print(repr(list(reader)))\n"
        "try:\n"
        f"    TraceReader({str(path)!r}, parser='msgspec')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    parser, events, missing = done.stdout.splitlines()
    assert parser == ("c" if NATIVE else "json") and events == expected
    assert missing == ("TraceReader(parser='msgspec') needs msgspec: pip install "
                       "'gpubudget[traces]'")
