"""A trace writer's queue (gpubudget/tracefile/queue.py) and its C twin (_core/trace.c): the
same lines for the same events, byte for byte; a full queue stops and counts; what is in
flight stays until done."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpubudget._core import native
from gpubudget.tracefile.queue import Queue, TraceQueue

KINDS = ["python", "C"]


def made(kind: str, limit: int = 1 << 20, wake: int = 1 << 16) -> TraceQueue:
    if kind == "C":
        if native is None:
            pytest.skip("the C core is not built here")
        queue: TraceQueue = native.TraceQueue(100.0, limit, wake)
        return queue
    return Queue(100.0, limit, wake)


TAGS = ["weights", "w\u00e9ights \u2603 \U0001F600", 'a "quoted" \\ tag\n\t\x01\x7f', "x" * 3000,
        "\ud800 lone surrogate"]
STACK = tuple(f"/srv/app{i % 600}.py:{i} in f{i}" for i in range(700))  # beyond MAX_FRAMES


def feed(queue: TraceQueue) -> None:
    """Events at times both write alike (fractions that are short in decimal)."""
    queue.put('{"ev": "enter", "t": 0.5, "b": 1}\n')
    for number, tag in enumerate([None, *TAGS]):
        queue.alloc(101.25, 1, 1000 + number, 0 if number % 2 else 256, tag,
                    4096 * (number + 1), 1024 * (number + 1))
    queue.alloc(102.5, 2, 1, 0, "t", 1 << 62, 256, STACK)
    queue.alloc(102.5, 2, 1, 0, None, 7, 256, STACK[:3] + ("/new.py:1 in g",))
    queue.free(103.0, 2, 1 << 62)
    queue.free(100.0, -1, -(1 << 63))


@pytest.mark.parametrize("kind", KINDS)
def test_the_lines_are_json_dumps_of_the_events(kind: str) -> None:
    queue = made(kind)
    feed(queue)
    data = queue.take(0)
    assert data is not None
    records: list[dict[str, Any]] = [json.loads(line) for line in data.decode().splitlines()]
    allocs = [r for r in records if r["ev"] == "alloc"]
    assert [a["tag"] for a in allocs[:6]] == [None, *TAGS[:3], "x" * 1023 + "\u2026", TAGS[4]]
    assert allocs[0] == {"ev": "alloc", "t": 1.25, "b": 1, "size": 1000, "align": 256,
                         "tag": None, "ptr": 4096, "bytes": 1024, "reason": None}
    frames = {r["id"]: r["at"] for r in records if r["ev"] == "frame"}
    assert [frames[i] for i in allocs[6]["stack"]] == list(STACK[-512:])
    assert len(frames) == 512 + 4  # each frame once; the second stack's four after them
    assert [frames[i] for i in allocs[7]["stack"]] == [*STACK[:3], "/new.py:1 in g"]
    assert records[-2:] == [{"ev": "free", "t": 3.0, "b": 2, "ptr": 1 << 62},
                            {"ev": "free", "t": 0.0, "b": -1, "ptr": -(1 << 63)}]
    assert queue.entries == len(records) and queue.lost == 0


def test_both_queues_write_the_same_bytes() -> None:
    python, c = made("python"), made("C")
    feed(python)
    feed(c)
    assert python.take(0) == c.take(0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_queue_drops_every_later_event_and_its_next_batch_says_how_many(
        kind: str) -> None:
    queue = made(kind, limit=1000)
    line = '{"ev": "exit", "t": 0.5, "b": 1}\n'
    kept = 0
    while queue.put(line):
        kept += 1
    assert kept == 1000 // len(line) and queue.stopped and queue.lost == 1
    assert not queue.free(101.0, 1, 2) and not queue.alloc(101.0, 1, 1, 0, None, 2, 256)
    data = queue.take(0)
    assert data is not None
    lines = data.decode().splitlines()
    assert lines[:-1] == [line.strip()] * kept
    lost = json.loads(lines[-1])
    assert lost["ev"] == "lost" and lost["events"] == 3 and lost["t"] >= 0
    queue.done()
    assert not queue.put(line)  # stopped for good: the trace has no hole in it
    again = queue.take(0)
    assert again is not None and json.loads(again)["events"] == 1  # the counts add up
    queue.done()
    assert queue.take(0) is None


@pytest.mark.parametrize("kind", KINDS)
def test_what_is_in_flight_stays_until_done(kind: str) -> None:
    queue = made(kind, limit=200)
    assert queue.take(0) is None and queue.inflight() is None
    assert queue.put("a" * 99 + "\n")
    data = queue.take(7)
    assert data == b"a" * 99 + b"\n" and queue.inflight() == (7, data)
    assert queue.pending == 0
    with pytest.raises(RuntimeError, match="in flight"):
        queue.take(8)
    assert queue.put("b" * 99 + "\n")
    assert not queue.put("c\n")  # in flight counts against the limit
    queue.done()
    assert queue.inflight() is None


@pytest.mark.parametrize("kind", KINDS)
def test_due_once_the_wake_bytes_are_queued(kind: str) -> None:
    queue = made(kind, wake=64)
    assert queue.put("x" * 40 + "\n") and not queue.due
    assert queue.put("y" * 40 + "\n") and queue.due and queue.pending == 82
