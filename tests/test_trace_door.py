"""Traces written under the driver door: a ``door`` line before a budget's ``exit`` says what
the door charged it. The writer keeps every line readable (numbers clipped, names shortened,
64 libraries at most); the reader checks the line, every parser alike, gives it only when
asked (iterating, ``fit`` and the gate leave it out) and refuses a bad one naming its line;
the replay's reports and the viewer carry its numbers; the budget layer writes it (or not)
at the exit. The door itself, on the fake driver, is in tests/test_door.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import gpubudget.door
from gpubudget import gpu_budget
from gpubudget.door import DoorLibrary, DoorNumbers
from gpubudget.replay import fit, replay
from gpubudget.report import DoorUsage
from gpubudget.tracefile import (
    MAX_LINE_BYTES,
    MAX_TEXT,
    Door,
    Exit,
    TraceError,
    TraceReader,
    TraceWriter,
    read_trace,
    writer_for,
)
from gpubudget.tracefile.cscan import NATIVE
from gpubudget.tracefile.fastparse import AVAILABLE
from gpubudget.units import MiB
from gpubudget.viewer import model_from_trace

PARSERS = ["json"] + ["c"] * NATIVE + ["msgspec"] * AVAILABLE
"""Every reader there is here: the C scanner and msgspec leave a door line to the plain
path, and must give the same events and messages."""

HEADER: dict[str, Any] = {"format": "gpubudget-trace", "version": 1}
ROOT: dict[str, Any] = {"ev": "enter", "t": 0.0, "b": 1, "name": "pool", "parent": None,
                        "limit": 16 * MiB, "align": 256, "reserve": 0, "backend": "host"}
CHILD: dict[str, Any] = {**ROOT, "t": 0.1, "b": 2, "name": "model", "parent": 1,
                         "limit": 8 * MiB}
ALLOC: dict[str, Any] = {"ev": "alloc", "t": 0.2, "b": 2, "size": 1000, "align": 0,
                         "tag": "w", "ptr": 4096, "bytes": 1024, "reason": None}
FREE: dict[str, Any] = {"ev": "free", "t": 0.3, "b": 2, "ptr": 4096}
DOOR: dict[str, Any] = {"ev": "door", "t": 0.4, "b": 2, "held": 3 * MiB, "own": 0,
                        "allocations": 2, "peak": 4 * MiB, "refusals": 1,
                        "last_refused": 8 * MiB, "last_refused_by": "libcublasLt.so.13",
                        "libraries": [["libcublasLt.so.13", 2 * MiB, 1],
                                      ["libnccl.so.2", MiB, 0]],
                        "attribute_only": False}
EXIT_CHILD: dict[str, Any] = {"ev": "exit", "t": 0.5, "b": 2}
ROOT_DOOR: dict[str, Any] = {**DOOR, "t": 0.6, "b": 1, "allocations": 0, "refusals": 0,
                             "last_refused": 0, "last_refused_by": None, "libraries": []}
EXIT_ROOT: dict[str, Any] = {"ev": "exit", "t": 0.7, "b": 1}
GOOD = [HEADER, ROOT, CHILD, ALLOC, FREE, DOOR, EXIT_CHILD, ROOT_DOOR, EXIT_ROOT]
"""A trace of a root and a child under the door, as the writer lays it out."""
CHILD_DOOR = Door(0.4, 2, 3 * MiB, 0, 2, 4 * MiB, 1, 8 * MiB, "libcublasLt.so.13",
                  (("libcublasLt.so.13", 2 * MiB, 1), ("libnccl.so.2", MiB, 0)), False)


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def door_lines(path: Path) -> list[dict[str, Any]]:
    return [line for line in map(json.loads, path.read_text().splitlines()[1:])
            if line["ev"] == "door"]


# -- reading -------------------------------------------------------------------------------


def test_a_door_line_is_read_alike_by_every_parser_and_only_when_asked(tmp_path: Path) -> None:
    path = write(tmp_path / "door.jsonl", GOOD)
    for parser in PARSERS:
        with TraceReader(path, parser=parser) as reader:
            plain = list(reader)
        with TraceReader(path, parser=parser) as reader:
            everything = list(reader.events(door=True))
        with TraceReader(path, parser=parser) as reader:
            mapped = list(reader.events_with_mappings(door=True))
        with TraceReader(path, parser=parser) as reader:
            mapped_only = list(reader.events_with_mappings())
        assert not any(isinstance(event, Door) for event in plain + mapped_only), parser
        assert [event for event in everything if not isinstance(event, Door)] == plain
        assert everything == mapped, parser
        assert [event for event in everything if isinstance(event, Door)] == [
            CHILD_DOOR, Door(0.6, 1, 3 * MiB, 0, 0, 4 * MiB, 0, 0, None, (), False)], parser
        assert isinstance(everything[everything.index(CHILD_DOOR) + 1], Exit)
    trace = read_trace(path)
    assert trace.door == [CHILD_DOOR, everything[-2]]
    assert not any(isinstance(event, Door) for event in trace.events)


def test_attribute_only_may_be_left_out_and_a_root_counts_its_own_memory_apart(
        tmp_path: Path) -> None:
    line = {key: value for key, value in DOOR.items() if key != "attribute_only"}
    path = write(tmp_path / "door.jsonl", [HEADER, ROOT, CHILD, line, EXIT_CHILD,
                                          {**ROOT_DOOR, "own": MiB, "attribute_only": True}])
    with TraceReader(path) as reader:
        doors = [event for event in reader.events(door=True) if isinstance(event, Door)]
    assert doors[0].attribute_only is False
    assert (doors[1].foreign, doors[1].attribute_only) == (2 * MiB, True)
    usage = DoorUsage.from_trace(doors[1])
    assert (usage.held, usage.peak, usage.libraries, usage.attribute_only) == (
        2 * MiB, 4 * MiB, (), True)


BAD_DOOR_LINES = [
    ("no held", {"held": None}, "door event: 'held' must be an integer, got null"),
    ("negative peak", {"peak": -1}, "door event: 'peak' must be an integer >= 0"),
    ("float refusals", {"refusals": 1.0}, "'refusals' must be an integer, got 1.0"),
    ("huge allocations", {"allocations": 2**63}, "'allocations' must be an integer >= 0 and "
                                                 "below 2**63"),
    ("bool own", {"own": True}, "'own' must be an integer, got true"),
    ("missing last_refused", {"last_refused": "drop"}, "missing field 'last_refused'"),
    ("number for who", {"last_refused_by": 3}, "'last_refused_by' must be a string or null"),
    ("libraries not a list", {"libraries": {"libffi.so.8": 1}},
     "'libraries' must be a list of [name, bytes, refusals]"),
    ("a library of two", {"libraries": [["libffi.so.8", 1]]},
     "'libraries'[0] must be [name, bytes, refusals]"),
    ("a blank library", {"libraries": [["libffi.so.8", 1, 0], [" ", 1, 0]]},
     "'libraries'[1] must be [name, bytes, refusals]"),
    ("negative library bytes", {"libraries": [["libffi.so.8", -1, 0]]},
     "'libraries'[0] must be"),
    ("library refusals a float", {"libraries": [["libffi.so.8", 1, 0.5]]},
     "'libraries'[0] must be"),
    ("attribute_only a number", {"attribute_only": 1},
     "'attribute_only' must be true or false, got 1"),
    ("no such budget", {"b": 9}, "door event: budget 9 was not entered before this line"),
    ("bad time", {"t": -1}, "'t' must be a finite number of seconds >= 0"),
    ("a blank last_refused_by", {"last_refused_by": "  "},
     "'last_refused_by' must not be blank, got \"  \""),
    ("a last refusal of none", {"refusals": 0},
     "'last_refused' and 'last_refused_by' name a refusal where 'refusals' is 0"),
]


@pytest.mark.parametrize(("what", "changes", "message"), BAD_DOOR_LINES,
                         ids=[case[0] for case in BAD_DOOR_LINES])
@pytest.mark.parametrize("parser", PARSERS)
def test_a_bad_door_line_is_one_clear_error_naming_its_line(
        tmp_path: Path, parser: str, what: str, changes: dict[str, Any], message: str) -> None:
    line = {**DOOR}
    for key, value in changes.items():
        if value == "drop":
            del line[key]
        else:
            line[key] = value
    path = write(tmp_path / "bad.jsonl", [HEADER, ROOT, CHILD, ALLOC, line, EXIT_CHILD])
    with TraceReader(path, parser=parser) as reader, pytest.raises(TraceError) as caught:
        list(reader)  # refused even when door lines are not given
    text = str(caught.value)
    assert text.startswith(f"{reader.name}:5: door event: "), text
    assert message in text and "\n" not in text


@pytest.mark.parametrize("parser", PARSERS)
def test_a_door_line_after_its_budgets_exit_is_refused(tmp_path: Path, parser: str) -> None:
    path = write(tmp_path / "late.jsonl", [HEADER, ROOT, CHILD, EXIT_CHILD, DOOR])
    with TraceReader(path, parser=parser) as reader, pytest.raises(TraceError) as caught:
        list(reader.events(door=True))
    assert str(caught.value) == (f"{reader.name}:5: door event: budget 2 (\"model\") already "
                                 f"exited, at line 4; its door line comes before its exit")


@pytest.mark.parametrize("parser", PARSERS)
def test_a_second_door_line_for_a_budget_is_refused(tmp_path: Path, parser: str) -> None:
    path = write(tmp_path / "twice.jsonl", [HEADER, ROOT, CHILD, DOOR, DOOR, EXIT_CHILD])
    with TraceReader(path, parser=parser) as reader, pytest.raises(TraceError) as caught:
        list(reader.events(door=True))
    assert str(caught.value) == (f"{reader.name}:5: door event: budget 2 (\"model\") has a "
                                 f"door line already, at line 4: one per budget")


# -- what reads it -------------------------------------------------------------------------


def test_a_replay_of_some_of_a_traces_events_skips_the_others_door_lines(
        tmp_path: Path) -> None:
    # a Trace whose events were cut down to one root keeps every door line; the budgets not
    # replayed are not reported (and do not stop the replay)
    second = {**ROOT, "t": 0.8, "b": 3, "name": "other"}
    other_door = {**ROOT_DOOR, "t": 0.9, "b": 3}
    path = write(tmp_path / "two.jsonl",
                 GOOD + [second, other_door, {"ev": "exit", "t": 1.0, "b": 3}])
    trace = read_trace(path)
    assert {line.budget for line in trace.door} == {1, 2, 3}
    only_other = dataclasses.replace(trace, events=[e for e in trace.events if e.budget == 3])
    (report,) = replay(only_other).reports
    assert report.name == "other" and report.driver_door is not None
    assert report.driver_door.peak == 4 * MiB


def test_the_replays_reports_carry_the_recorded_door_numbers(tmp_path: Path) -> None:
    path = write(tmp_path / "door.jsonl", GOOD)
    streamed = replay(str(path)).reports[0]
    in_memory = replay(read_trace(path)).reports[0]
    assert streamed == in_memory
    child = streamed.children[0]
    assert child.driver_door == DoorUsage.from_trace(CHILD_DOOR)
    assert streamed.driver_door is not None and streamed.driver_door.held == 3 * MiB
    assert ("driver allocations (through the door): 3.00 MiB held, peak 4.00 MiB; by "
            "library: libcublasLt.so.13 2.00 MiB, libnccl.so.2 1.00 MiB; 1 refused, the last "
            "8.00 MiB asked by libcublasLt.so.13") in str(streamed)
    plain = write(tmp_path / "plain.jsonl", [line for line in GOOD if line.get("ev") != "door"])
    without = replay(str(plain)).reports[0]
    assert without.driver_door is None and without.children[0].driver_door is None
    assert fit(str(path)) == fit(str(plain))  # nothing of the door is replayed


def test_the_viewer_draws_the_door_of_each_budget_from_a_trace(tmp_path: Path) -> None:
    from gpubudget.viewer.page import _data

    path = write(tmp_path / "door.jsonl", [line for line in GOOD if line is not ROOT_DOOR])
    model = model_from_trace(path)
    assert [row[10] for row in _data(model)["budgets"]] == [
        None, [3 * MiB, 1, 8 * MiB, "libcublasLt.so.13",
               [["libcublasLt.so.13", 2 * MiB, 1], ["libnccl.so.2", MiB, 0]]]]
    assert len(model.times) == len(model_from_trace(write(
        tmp_path / "plain.jsonl", [line for line in GOOD if line.get("ev") != "door"])).times)


# -- writing -------------------------------------------------------------------------------


def numbers(**changes: Any) -> DoorNumbers:
    fields: dict[str, Any] = dict(
        held=3 * MiB, own=0, live=2, peak=4 * MiB, refusals=1, last_refused=8 * MiB,
        last_refused_by="libcublasLt.so.13",
        libraries=(DoorLibrary("libcublasLt.so.13", 2 * MiB, 1),
                   DoorLibrary("libnccl.so.2", MiB, 0)), attribute_only=False)
    fields.update(changes)
    return DoorNumbers(**fields)


def test_the_writer_keeps_every_door_line_readable(tmp_path: Path) -> None:
    """Names shortened as other texts are, numbers within [0, 2**63), 64 libraries at most:
    the longest line it can write stays under the reader's limit."""
    path = tmp_path / "w.jsonl"
    writer = TraceWriter(str(path))
    try:
        writer.enter(1, "pool", None, 16 * MiB, 256, 0, "host")
        long = "\U0001f600" * (MAX_TEXT + 5)  # 12 bytes a character in JSON
        writer.exit(1, writer.door_line(1, numbers(
            held=2**70, own=-5, last_refused=2**64, last_refused_by=long,
            libraries=tuple(DoorLibrary(f"{index}{long}", 2**65, index) for index in range(70)))))
    finally:
        writer.close()
    raw = path.read_bytes().splitlines()[2]
    assert len(raw) < MAX_LINE_BYTES
    (line,) = door_lines(path)
    assert (line["held"], line["own"], line["last_refused"]) == (2**63 - 1, 0, 2**63 - 1)
    assert len(line["libraries"]) == 64 and line["libraries"][0][1] == 2**63 - 1
    assert len(line["last_refused_by"]) == MAX_TEXT and line["last_refused_by"][-1] == "…"
    with TraceReader(path) as reader:
        (door,) = [event for event in reader.events(door=True) if isinstance(event, Door)]
    assert door.libraries[63][0].startswith("63") and len(door.libraries[63][0]) == MAX_TEXT


def _charged(monkeypatch: pytest.MonkeyPatch, found: dict[str, DoorNumbers | None]) -> None:
    """``gpubudget.door.numbers`` answers ``found[budget.name]``: the door's numbers, as if
    it were loaded (the budget layer asks it at each traced budget's exit, after
    ``charged``, which says whether they would have anything)."""
    def charged(budget: Any) -> bool:
        known = found.get(budget.name)
        return known is not None and bool(known.peak or known.refusals)

    monkeypatch.setattr(gpubudget.door, "charged", charged)
    monkeypatch.setattr(gpubudget.door, "numbers", lambda budget: found.get(budget.name))


def test_a_traced_budget_gets_its_door_line_just_before_its_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    _charged(monkeypatch, {"model": numbers(), "pool": numbers(peak=4 * MiB, refusals=0),
                           "idle": numbers(held=0, peak=0, refusals=0, libraries=())})
    with gpu_budget("16MiB", name="pool", backend="host", trace=str(path)):
        with gpu_budget("8MiB", name="model") as model:
            block = model.allocate(1000)
            assert block is not None and model.free(block)
        with gpu_budget("1MiB", name="idle"):
            pass  # the door charged it nothing and refused it nothing: no line
        with gpu_budget("1MiB", name="untouched"):
            pass  # never entered under the door (numbers None): no line
    writer_for(path).flush()
    lines = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert [line["ev"] for line in lines] == [
        "enter", "enter", "alloc", "free", "door", "exit", "enter", "exit", "enter", "exit",
        "door", "exit"]
    assert lines[4]["b"] == lines[5]["b"] == lines[1]["b"]
    assert lines[10]["b"] == lines[11]["b"] == lines[0]["b"]
    assert {key: value for key, value in lines[4].items() if key not in ("t", "b")} == {
        key: value for key, value in DOOR.items() if key not in ("t", "b")}


def test_an_untraced_budget_never_asks_the_door_at_its_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(gpubudget.door, "charged", lambda budget: asked.append(budget.name))
    monkeypatch.setattr(gpubudget.door, "numbers", lambda budget: asked.append(budget.name))
    with gpu_budget("1MiB", name="pool", backend="host", trace=False):
        pass
    assert asked == []


@pytest.mark.parametrize("where", ["asking the door", "making the door line"])
def test_a_budget_exits_even_when_its_door_line_is_cut_short(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """An exception landing while the door is asked, or while the door line is made (a
    signal handler's, a Ctrl-C), still leaves the budget exited, its exit traced: the line
    is made before the exit, outside the tree's lock, and queued with the exit line as one
    text, so only the door line is lost."""
    def interrupted(*args: object) -> Any:
        raise KeyboardInterrupt

    _charged(monkeypatch, {"pool": numbers()})
    if where == "asking the door":
        monkeypatch.setattr(gpubudget.door, "numbers", interrupted)
    else:
        monkeypatch.setattr(TraceWriter, "door_line", interrupted)
    path = tmp_path / "t.jsonl"
    with pytest.raises(KeyboardInterrupt):
        with gpu_budget("1MiB", name="pool", backend="host", trace=str(path)) as pool:
            pass
    assert pool.state == "released"
    writer_for(path).flush()
    assert [line["ev"] for line in map(json.loads, path.read_text().splitlines()[1:])] == [
        "enter", "exit"]


def test_a_traced_budget_the_door_never_charged_is_not_asked_for_its_numbers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``charged`` (ten words read) decides; the table of live allocations is walked only
    for a budget with a door line to write."""
    asked: list[str] = []

    def found(budget: Any) -> DoorNumbers:
        asked.append(budget.name)
        return numbers()

    monkeypatch.setattr(gpubudget.door, "charged", lambda budget: budget.name == "model")
    monkeypatch.setattr(gpubudget.door, "numbers", found)
    with gpu_budget("1MiB", name="pool", backend="host", trace=str(tmp_path / "t.jsonl")):
        with gpu_budget("64KiB", name="model"):
            pass
    assert asked == ["model"]


def test_a_blank_library_name_is_written_unnamed(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    writer = TraceWriter(str(path))
    try:
        writer.enter(1, "pool", None, 16 * MiB, 256, 0, "host")
        writer.exit(1, writer.door_line(1, numbers(
            last_refused_by=" ", libraries=(DoorLibrary("", MiB, 1),))))
    finally:
        writer.close()
    (line,) = door_lines(path)
    assert (line["last_refused_by"], line["libraries"]) == ("(unnamed)", [["(unnamed)", MiB, 1]])
    other = tmp_path / "w2.jsonl"
    writer = TraceWriter(str(other))  # a refusal counted after its size was read: none yet
    try:
        writer.enter(2, "pool", None, 16 * MiB, 256, 0, "host")
        writer.exit(2, writer.door_line(2, numbers(refusals=0)))
    finally:
        writer.close()
    (last,) = door_lines(other)
    assert (last["refusals"], last["last_refused"], last["last_refused_by"]) == (0, 0, None)
    with TraceReader(path) as reader:  # and it reads back
        assert [type(event).__name__ for event in reader.events(door=True)] == [
            "Enter", "Door", "Exit"]


def test_report_prints_a_traces_library_names_safely(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A trace is input: a library name that a terminal would act on is printed escaped."""
    from gpubudget.cli.traces import report_command

    evil = "lib\x1b]0;owned\x07.so"
    path = write(tmp_path / "evil.jsonl", [
        HEADER, ROOT, {**ROOT_DOOR, "refusals": 1, "last_refused": MiB,
                       "last_refused_by": evil, "libraries": [[evil, MiB, 1]]}, EXIT_ROOT])
    report_command(str(path), None, False, None, 1 << 30)
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown
    assert ("by library: lib\\x1b]0;owned\\x07.so 1.00 MiB; 1 refused, the last 1.00 MiB "
            "asked by lib\\x1b]0;owned\\x07.so") in shown
