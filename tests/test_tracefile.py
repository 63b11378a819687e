"""Trace files: the writer (format, flushing, a real SIGKILL) and the validating reader
(every kind of bad input, streaming, limits), with a hypothesis fuzz of the reader."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpubudget import gpu_budget
from gpubudget.tracefile import (
    FLUSH_SECONDS,
    MAX_LINE_BYTES,
    Alloc,
    Enter,
    Exit,
    Free,
    Resize,
    TraceError,
    TraceReader,
    TraceWriter,
    printable,
    read_trace,
    writer_for,
)

from tests.helpers import subprocess_env

MiB = 2**20
HEADER: dict[str, Any] = {"format": "gpubudget-trace", "version": 1, "created": "2026-11-30T00:00:00+00:00",
                          "pid": 1}
ROOT: dict[str, Any] = {"ev": "enter", "t": 0.0, "b": 1, "name": "pool", "parent": None,
                        "limit": 16 * MiB, "align": 256, "reserve": 0, "backend": "host"}
CHILD: dict[str, Any] = {**ROOT, "t": 0.1, "b": 2, "name": "model", "parent": 1, "limit": 8 * MiB}
ALLOC: dict[str, Any] = {"ev": "alloc", "t": 0.2, "b": 2, "size": 1000, "align": 0, "tag": "w",
                         "ptr": 4096, "bytes": 1024, "reason": None}
DENY: dict[str, Any] = {**ALLOC, "t": 0.3, "size": 9 * MiB, "ptr": None, "bytes": 9 * MiB,
                        "reason": "over_limit"}
RESIZE: dict[str, Any] = {"ev": "resize", "t": 0.4, "b": 2, "ptr": 4096, "size": 2000, "align": 0,
                          "bytes": 2048}
FREE: dict[str, Any] = {"ev": "free", "t": 0.5, "b": 2, "ptr": 4096}
EXIT_CHILD: dict[str, Any] = {"ev": "exit", "t": 0.6, "b": 2}
EXIT_ROOT: dict[str, Any] = {"ev": "exit", "t": 0.7, "b": 1}
VALID = [HEADER, ROOT, CHILD, ALLOC, DENY, RESIZE, FREE, EXIT_CHILD, EXIT_ROOT]


def lines_of(*records: dict[str, Any] | str) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def write(path: Path, *records: dict[str, Any] | str) -> Path:
    path.write_text(lines_of(*records))
    return path


# -- the writer ----------------------------------------------------------------------------


def test_writer_writes_a_versioned_header_and_every_event(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    with gpu_budget("16MiB", name="pool", trace=str(path)):
        with gpu_budget("8MiB", name="model", reserve="1MiB") as model:
            a = model.allocate(MiB, tag="a")
            assert a is not None and model.resize(a, MiB // 2) == a
            assert model.allocate(9 * MiB) is None and model.allocate(-1) is None
            assert model.free(a)
    writer_for(path).flush()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["format"] == "gpubudget-trace" and lines[0]["version"] == 1
    assert [e["ev"] for e in lines[1:]] == [
        "enter", "enter", "alloc", "resize", "alloc", "alloc", "free", "exit", "exit"]
    assert lines[2]["reserve"] == MiB and lines[2]["parent"] == lines[1]["b"]
    assert lines[5]["ptr"] is None and lines[5]["reason"] == "over_limit"
    assert lines[6]["reason"] == "invalid_size"
    trace = read_trace(path)
    assert trace.header.version == 1 and trace.header.pid == os.getpid()
    assert [type(e) for e in trace.events] == [Enter, Enter, Alloc, Resize, Alloc, Alloc, Free,
                                               Exit, Exit]
    granted = trace.events[2]
    assert isinstance(granted, Alloc) and (granted.size, granted.nbytes, granted.tag) == (MiB, MiB, "a")
    assert trace.events[0] == Enter(lines[1]["t"], lines[1]["b"], "pool", None, 16 * MiB, 256,
                                    0, "host", lines[1]["base"], None)  # a root's base
    assert lines[1]["base"] == granted.ptr  # the first block: at the start of its memory


def _lines_within(path: Path, count: int, seconds: float = 60.0) -> int:
    """The file's lines once it holds ``count`` (or ``seconds`` went by: a loaded machine)."""
    deadline = time.monotonic() + seconds
    while path.read_bytes().count(b"\n") < count and time.monotonic() < deadline:
        time.sleep(FLUSH_SECONDS / 10)
    return path.read_bytes().count(b"\n")


def test_writer_writes_its_header_at_once_and_its_thread_writes_events_unasked(
        tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    writer = TraceWriter(str(path))
    try:
        assert json.loads(path.read_text())["format"] == "gpubudget-trace"  # no flush called
        for index in range(100):
            writer.free(1, index)
        # no flush called: the writers' thread writes them (within FLUSH_SECONDS, or as
        # soon as the machine lets it)
        assert _lines_within(path, 101) == 101
        writer.free(1, 100)  # a lone event after a quiet spell: written too
        assert _lines_within(path, 102) == 102
    finally:
        writer.close()


_KILLED_CHILD = textwrap.dedent("""
    import os, sys, time
    from gpubudget import gpu_budget
    events = int(sys.argv[2])
    with gpu_budget("64MiB", name="pool", backend="host", trace=sys.argv[1]) as pool:
        blocks = []
        for index in range(events - 1):  # the root's entry is the first event
            if index % 3 == 2:
                pool.free(blocks.pop())
            else:
                blocks.append(pool.allocate(4096))
        deadline = time.monotonic() + 60
        while (open(sys.argv[1], "rb").read().count(b"\\n") < events + 1
               and time.monotonic() < deadline):
            time.sleep(0.01)  # the writers' thread writes them, no flush asked
        print("written", flush=True)
        sys.stdin.read()  # until killed
""")


@pytest.mark.parametrize("events", [10, 20_017])
def test_sigkill_loses_nothing_the_writers_thread_wrote(tmp_path: Path, events: int) -> None:
    path = tmp_path / "killed.jsonl"
    env = subprocess_env()
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(path), str(events)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"written\n"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    with TraceReader(path) as reader:
        kept = list(reader)
    assert len(kept) == events and reader.cut_short is None
    assert isinstance(kept[0], Enter) and kept[0].name == "pool"


def test_a_full_queue_stops_the_trace_and_counts_every_event_it_drops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpubudget.tracefile.queue.BUFFER_BYTES", 16384)
    path = tmp_path / "full.jsonl"
    writer = writer_for(path)
    with writer._lock:  # held: the writers' thread cannot write meanwhile (a stalled disk)
        with gpu_budget("64MiB", name="pool", backend="host", trace=str(path)) as pool:
            for _ in range(500):
                assert pool.free(pool.allocate(4096, tag="t"))  # type: ignore[arg-type]  # never denied
            report = pool.report()
            assert pool.used == 0 and report.allocations == 500
            assert report.trace_error is not None and "queue was full" in report.trace_error
        lost = writer.lost  # the root's exit dropped too
    assert 0 < lost < 1002  # the root's entry, 1,000 events, its exit
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1]) == {"ev": "lost", "t": json.loads(lines[-1])["t"],
                                     "events": lost}
    with TraceReader(path) as reader:
        events = list(reader)
    assert len(events) + lost == 1002 and reader.lost == lost
    assert reader.cut_short is not None and f"{lost:,} event(s)" in reader.cut_short
    assert "queue was full" in reader.cut_short
    # once its lost line is written, the writers' thread finds nothing to do: it does not
    # reopen the closed file each time it wakes (it did, every 0.25 s, for good)
    reopened: list[int] = []
    reopen = type(writer)._reopened

    def counted(self: Any) -> int:
        reopened.append(1)
        return reopen(self)

    monkeypatch.setattr(type(writer), "_reopened", counted)
    for _ in range(5):
        writer._written_by_thread()
    assert reopened == [] and path.read_text().splitlines() == lines


# -- the reader: every kind of bad input ---------------------------------------------------


def bad(**changes: Any) -> dict[str, Any]:
    """The granted allocation with some fields changed (``None`` values delete the key when
    the value is the string ``'<missing>'``)."""
    record = {**ALLOC, **changes}
    return {k: v for k, v in record.items() if v != "<missing>"}


BAD_LINES: list[tuple[str, list[dict[str, Any] | str], int, str]] = [
    ("not JSON", [HEADER, "{oops"], 2, "not JSON"),
    ("a list", [HEADER, "[1, 2]"], 2, "expected a JSON object, got an array"),
    ("null", [HEADER, "null"], 2, "expected a JSON object, got null"),
    ("1e400", [HEADER, {**ROOT, "t": "<inf>"}], 2, "'t' must be a finite number"),
    ("NaN", [HEADER, json.dumps(ROOT).replace('"t": 0.0', '"t": NaN')], 2, "NaN is not a number"),
    ("negative time", [HEADER, {**ROOT, "t": -1.0}], 2, "'t' must be a finite number of seconds >= 0"),
    ("time a string", [HEADER, {**ROOT, "t": "0"}], 2, "'t' must be a finite number"),
    ("4,300+ digits", [HEADER, json.dumps(ROOT).replace('"limit": 16777216', '"limit": ' + "9" * 5000)],
     2, "not JSON this reader accepts"),
    ("deeply nested", [HEADER, "[" * 100_000 + "]" * 100_000], 2, "nested too deeply"),
    ("nested in a field", [HEADER, {**ROOT, "name": {"a": [1]}}], 2, "'name' must be a string"),
    ("unknown event", [HEADER, {"ev": "boom", "t": 0, "b": 1}], 2, 'unknown event "boom"'),
    ("event not a string", [HEADER, {"ev": ["enter"], "t": 0, "b": 1}], 2, "unknown event [\"enter\"]"),
    ("missing field", [HEADER, ROOT, {"ev": "free", "t": 0, "b": 1}], 3, "missing field 'ptr'"),
    ("limit a bool", [HEADER, {**ROOT, "limit": True}], 2, "'limit' must be an integer, got true"),
    ("limit a float", [HEADER, {**ROOT, "limit": 1.0}], 2, "'limit' must be an integer, got 1.0"),
    ("limit null", [HEADER, {**ROOT, "limit": None}], 2, "'limit' must be an integer, got null"),
    ("limit zero", [HEADER, {**ROOT, "limit": 0}], 2, "'limit' must be an integer >= 1"),
    ("limit past 64 bits", [HEADER, {**ROOT, "limit": 2**64}], 2, "below 2**63"),
    ("id a string", [HEADER, {**ROOT, "b": "1"}], 2, "'b' must be an integer, got \"1\""),
    ("id negative", [HEADER, {**ROOT, "b": -1}], 2, "'b' must be an integer >= 0"),
    ("align not a power of two", [HEADER, {**ROOT, "align": 300}], 2, "'align' must be a power of two"),
    ("align zero at entry", [HEADER, {**ROOT, "align": 0}], 2, "'align' must be a power of two"),
    ("blank name", [HEADER, {**ROOT, "name": "  "}], 2, "'name' must not be blank"),
    ("name a number", [HEADER, {**ROOT, "name": 5}], 2, "'name' must be a string, got 5"),
    ("backend a number", [HEADER, {**ROOT, "backend": 5}], 2, "'backend' must be a string or null"),
    ("reserve negative", [HEADER, {**ROOT, "reserve": -1}], 2, "'reserve' must be an integer >= 0"),
    ("duplicate id", [HEADER, ROOT, {**ROOT, "name": "again"}], 3,
     "budget id 1 was already entered, at line 2"),
    ("self-parent", [HEADER, {**ROOT, "parent": 1}], 2, "budget 1 names itself as its parent"),
    ("unknown parent", [HEADER, ROOT, {**CHILD, "parent": 7}], 3,
     "parent 7 was not entered before this line"),
    ("two-budget cycle", [HEADER, {**ROOT, "parent": 2}, {**CHILD, "parent": 1}], 2,
     "parent 2 was not entered before this line"),
    ("parent a float", [HEADER, ROOT, {**CHILD, "parent": 1.5}], 3, "'parent' must be an integer, got 1.5"),
    ("parent a bool", [HEADER, ROOT, {**CHILD, "parent": True}], 3, "'parent' must be an integer, got true"),
    ("parent exited", [HEADER, ROOT, EXIT_ROOT, CHILD], 4,
     "parent budget 1 (\"pool\") had already exited, at line 3"),
    ("alloc of an unknown budget", [HEADER, ROOT, {**ALLOC, "b": 9}], 3,
     "budget 9 was not entered before this line"),
    ("size a float", [HEADER, ROOT, CHILD, bad(size=1.5)], 4, "'size' must be an integer, got 1.5"),
    ("size zero, granted", [HEADER, ROOT, CHILD, bad(size=0)], 4, "needs 'size' >= 1"),
    ("bytes below size", [HEADER, ROOT, CHILD, bad(bytes=10)], 4, "'bytes' 10 is less than 'size' 1000"),
    ("ptr negative", [HEADER, ROOT, CHILD, bad(ptr=-4096)], 4, "'ptr' must be an integer >= 0"),
    ("ptr a bool", [HEADER, ROOT, CHILD, bad(ptr=True)], 4, "'ptr' must be an integer, got true"),
    ("tag a number", [HEADER, ROOT, CHILD, bad(tag=3)], 4, "'tag' must be a string or null, got 3"),
    ("granted with a reason", [HEADER, ROOT, CHILD, bad(reason="over_limit")], 4,
     "a granted allocation ('ptr' 0x1000) has 'reason' \"over_limit\""),
    ("denied without a reason", [HEADER, ROOT, CHILD, bad(ptr=None)], 4, "needs a 'reason'"),
    ("probe of no bytes", [HEADER, ROOT, CHILD, {**DENY, "size": 0}], 4,
     "a request denied for over_limit needs 'size' >= 1"),
    ("missing ptr", [HEADER, ROOT, CHILD, bad(ptr="<missing>")], 4, "missing field 'ptr'"),
    ("address handed out twice", [HEADER, ROOT, CHILD, ALLOC, ALLOC], 5,
     "block 0x1000 is handed out again while budget 2 (\"model\") still holds it"),
    ("free of a block not live", [HEADER, ROOT, CHILD, FREE], 4, "block 0x1000 is not live"),
    ("double free", [HEADER, ROOT, CHILD, ALLOC, FREE, FREE], 6, "block 0x1000 is not live"),
    ("free by another budget", [HEADER, ROOT, CHILD, ALLOC, {**FREE, "b": 1}], 5,
     "block 0x1000 is held by budget 2 (\"model\"), not by budget 1 (\"pool\")"),
    ("resize of a block not live", [HEADER, ROOT, CHILD, RESIZE], 4, "block 0x1000 is not live"),
    ("resize to nothing", [HEADER, ROOT, CHILD, ALLOC, {**RESIZE, "size": 0}], 5,
     "'size' must be an integer >= 1"),
    ("exit twice", [HEADER, ROOT, EXIT_ROOT, EXIT_ROOT], 4, "already exited, at line 3"),
    ("exit of an unknown budget", [HEADER, ROOT, {"ev": "exit", "t": 1.0, "b": 5}], 3,
     "budget 5 was not entered before this line"),
    ("not UTF-8", [HEADER, '{"ev": "\udcff"}'], 2, "not UTF-8 text (byte 0xff"),
]


@pytest.mark.parametrize(("what", "records", "line", "message"), BAD_LINES,
                         ids=[case[0] for case in BAD_LINES])
def test_every_bad_line_is_one_clear_error(tmp_path: Path, what: str,
                                            records: list[dict[str, Any] | str], line: int,
                                            message: str) -> None:
    path = tmp_path / "t.jsonl"
    text = lines_of(*records).replace('"<inf>"', "1e400")
    path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    error = str(caught.value)
    assert error.startswith(f"{path}:{line}: "), error
    assert message in error and "\n" not in error


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "the file is empty"),
        ("\n   \n\t\n", "no header: the file holds only blank lines"),
        ("{oops\n", ":1: not a gpubudget trace: not JSON"),
        ('{"format": "other"}\n', ':1: not a gpubudget trace: the first line has no "format"'),
        ('{"format": "gpubudget-trace", "version": 99}\n', ":1: trace version 99 is newer"),
        ('{"format": "gpubudget-trace", "version": true}\n', ":1: bad trace version true"),
        ('{"format": "gpubudget-trace", "version": 1.0}\n', ":1: bad trace version 1.0"),
        ('{"format": "gpubudget-trace", "version": 1, "pid": "x"}\n', "'pid' must be an integer"),
        ('{"format": "gpubudget-trace", "ver', ":1: the header line is cut short"),
    ],
)
def test_bad_headers_and_empty_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_binary_junk_is_refused_on_its_first_line(tmp_path: Path) -> None:
    path = tmp_path / "junk.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(TraceError, match=r"junk.bin:1: not a gpubudget trace: not JSON"):
        read_trace(path)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(300))
    with pytest.raises(TraceError, match=r"junk.bin:1: not a gpubudget trace: not UTF-8 text"):
        read_trace(path)


def test_files_that_are_not_regular_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="nope.jsonl: no such file"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="is a directory, not a trace file"):
        read_trace(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would wait for a writer: it is refused before
    with pytest.raises(TraceError, match=r"fifo: not a regular file \(a FIFO\)"):
        read_trace(fifo)
    with pytest.raises(TraceError, match=r"/dev/zero: not a regular file \(a character device\)"):
        read_trace("/dev/zero")


def test_paths_that_cannot_be_read(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", *VALID)
    with pytest.raises(TraceError, match=r"t.jsonl/x: cannot read: Not a directory"):
        read_trace(path / "x")
    os.symlink("loop", tmp_path / "loop")
    with pytest.raises(TraceError, match=r"loop: cannot read: Too many levels of symbolic links"):
        read_trace(tmp_path / "loop")


def test_standard_input_that_is_a_terminal_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    with pytest.raises(TraceError, match="standard input is a terminal"):
        TraceReader("-")


def test_a_line_over_the_limit_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    with path.open("wb") as handle:
        handle.write(lines_of(HEADER).encode())
        handle.write(b"x" * (4 * MAX_LINE_BYTES))  # no newline at all
    with TraceReader(path) as reader:
        with pytest.raises(TraceError, match=r"long.jsonl:2: line longer than 1.00 MiB"):
            list(reader)
        assert reader.bytes_read <= 2 * MAX_LINE_BYTES


def test_a_trace_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", *VALID)
    with pytest.raises(TraceError, match=r"the trace is .* over the limit of 100 B"):
        TraceReader(path, max_bytes=100)
    limit = len(path.read_bytes()) - 1
    reader = TraceReader(path, max_bytes=limit + 1)  # a file that grows while read:
    with open(path, "a") as handle:
        handle.write(lines_of(ROOT | {"b": 3, "t": 1.0}))
    with reader, pytest.raises(TraceError, match=r"t.jsonl:10: the trace passes the limit"):
        list(reader)


def test_a_last_line_cut_short_is_skipped_and_said(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(lines_of(*VALID[:4]) + json.dumps(DENY)[:25])
    with TraceReader(path) as reader:
        events = list(reader)
    assert len(events) == 3
    assert reader.cut_short is not None and f"{path}:5: the last line is cut short" in reader.cut_short
    path.write_text(lines_of(*VALID[:4]) + "{oops\n" + lines_of(FREE))
    with pytest.raises(TraceError, match=":5: not JSON"):  # cut short but not last: an error
        read_trace(path)


def test_a_complete_last_line_without_its_newline_counts(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(lines_of(*VALID).rstrip("\n"))
    assert len(read_trace(path).events) == len(VALID) - 1


def test_blank_lines_and_unknown_keys_are_allowed(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", HEADER, "", ROOT | {"future": [1, {"x": 2}]}, "  ", EXIT_ROOT)
    assert [type(e) for e in read_trace(path).events] == [Enter, Exit]


def test_integers_are_accepted_for_times_and_old_writers_optional_fields(tmp_path: Path) -> None:
    old_alloc = {k: v for k, v in ALLOC.items() if k not in ("bytes", "tag", "reason")}
    root = {k: v for k, v in ROOT.items() if k != "backend"}
    path = write(tmp_path / "t.jsonl", HEADER, root | {"t": 0}, CHILD, old_alloc)
    events = read_trace(path).events
    assert events[0] == Enter(0.0, 1, "pool", None, 16 * MiB, 256, 0, None)
    assert events[2] == Alloc(0.2, 2, 1000, 0, None, 4096, 1000, None)


def test_the_reader_streams(tmp_path: Path) -> None:
    frees = [lines_of(bad(ptr=4096 * (i + 1)), {**FREE, "ptr": 4096 * (i + 1)}) for i in range(500)]
    path = tmp_path / "t.jsonl"
    path.write_text(lines_of(HEADER, ROOT, CHILD) + "".join(frees) + "{oops\n")
    with TraceReader(path) as reader:
        events = iter(reader)
        assert isinstance(next(events), Enter)
        assert reader.lines <= 3  # one event read, not the file
        assert sum(1 for _ in zip(range(900), events)) == 900
        with pytest.raises(TraceError, match=":1004: not JSON"):
            list(events)
        with pytest.raises(RuntimeError, match="read once"):
            iter(reader).__next__()


def test_progress_is_called_while_reading(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    body = "".join(lines_of(bad(ptr=4096 * (i + 1)), {**FREE, "ptr": 4096 * (i + 1)})
                   for i in range(20_000))
    path.write_text(lines_of(HEADER, ROOT, CHILD) + body)
    calls: list[tuple[int, int]] = []
    with TraceReader(path, progress=lambda lines, nbytes: calls.append((lines, nbytes))) as reader:
        assert sum(1 for _ in reader) == 40_002
    assert [lines for lines, _ in calls] == [16_384, 32_768]
    assert calls[0][1] < calls[1][1] < path.stat().st_size


def test_printable_escapes_what_a_terminal_would_act_on() -> None:
    assert printable("model/weights é 模型") == "model/weights é 模型"
    assert printable("\x1b[2J\x1b]0;owned\x07") == "\\x1b[2J\\x1b]0;owned\\x07"
    assert printable("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert printable("\u202eevil\u200b") == "\\u202eevil\\u200b"
    assert printable("\ud800\x9b") == "\\ud800\\x9b"


def test_error_messages_quote_bad_values_briefly_and_safely(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", HEADER, ROOT | {"name": ["\x1b[31m" * 100]})
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    message = str(caught.value)
    assert "\x1b" not in message and "…" in message and len(message) < 200


# -- fuzz: random lines, and mutations of a recorded trace --------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
FIELDS = ["ev", "t", "b", "name", "parent", "limit", "align", "reserve", "backend", "size",
          "tag", "ptr", "bytes", "reason"]
EVENT_NAMES = st.sampled_from(["enter", "alloc", "free", "resize", "exit"])


@st.composite
def event_like(draw: st.DrawFn) -> dict[str, Any]:
    """A dict that looks like an event: a known kind, known fields, any JSON values."""
    record: dict[str, Any] = {"ev": draw(EVENT_NAMES)}
    for key in draw(st.lists(st.sampled_from(FIELDS[1:]), unique=True)):
        record[key] = draw(JSON_VALUES | st.integers(min_value=0, max_value=4))
    return record


def check_outcome(path: Path) -> None:
    """Reading ``path`` either works or fails with one line naming the file."""
    try:
        with TraceReader(path) as reader:
            for _ in reader:
                pass
    except TraceError as exc:
        message = str(exc)
        assert message.startswith(str(path) + ":") and "\n" not in message, message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(event_like() | JSON_VALUES.map(json.dumps) | st.binary(max_size=40), max_size=6))
def test_fuzz_random_lines_after_a_valid_start(lines: list[Any]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzz.jsonl"
        with path.open("wb") as handle:
            handle.write(lines_of(*VALID[:4]).encode())
            for line in lines:
                data = line if isinstance(line, bytes) else (
                    line if isinstance(line, str) else json.dumps(line)).encode()
                handle.write(data.replace(b"\n", b" ") + b"\n")
        check_outcome(path)


@functools.cache
def recorded_trace() -> bytes:
    """A real trace: two roots, children, granted and denied allocations, a resize."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "real.jsonl")
        for name in ("first", "second"):
            with gpu_budget("4MiB", name=name, trace=path, backend="host"):
                with gpu_budget("2MiB", name="model", reserve="256KiB") as model:
                    blocks = [model.allocate(size, tag="t") for size in (1000, 50_000, 300_000)]
                    assert model.allocate(3 * 2**20) is None
                    assert blocks[0] is not None and model.resize(blocks[0], 2000) is not None
                    for block in blocks[1:]:
                        assert block is not None and model.free(block)
        writer_for(path).flush()
        return Path(path).read_bytes()


MUTATIONS = st.sampled_from(["delete", "duplicate", "swap", "truncate", "flip", "field", "drop"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutations_of_a_recorded_trace(data: st.DataObject) -> None:
    lines = recorded_trace().split(b"\n")[:-1]
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(MUTATIONS)
        index = data.draw(st.integers(0, len(lines) - 1))
        if kind == "delete" and len(lines) > 1:
            del lines[index]
        elif kind == "duplicate":
            lines.insert(index, lines[index])
        elif kind == "swap":
            other = data.draw(st.integers(0, len(lines) - 1))
            lines[index], lines[other] = lines[other], lines[index]
        elif kind == "truncate":
            lines[index] = lines[index][: data.draw(st.integers(0, len(lines[index])))]
        elif kind == "flip" and lines[index]:
            at = data.draw(st.integers(0, len(lines[index]) - 1))
            lines[index] = lines[index][:at] + bytes([data.draw(st.integers(0, 255))]) + lines[index][at + 1:]
        elif kind in ("field", "drop"):
            try:
                record = json.loads(lines[index])
            except ValueError:
                continue
            key = data.draw(st.sampled_from(sorted(record)))
            if kind == "drop":
                del record[key]
            else:
                record[key] = data.draw(JSON_VALUES)
            lines[index] = json.dumps(record).encode()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mutated.jsonl"
        path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
        check_outcome(path)
