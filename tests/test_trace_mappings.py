"""Traces of growable roots: a root's line says where its memory starts (and a growable root's
granule), ``map`` and ``unmap`` lines say when its granules were mapped and given back; the
reader checks them and gives them only when asked (a replay leaves them out), every parser
alike; a trace without them (an older one) reads as before; the viewer's model draws them.
Nothing is written on the path of a block whose granules are mapped already."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget.backends.host import HostBackend
from gpubudget.viewer import model_from_trace
from gpubudget.replay import replay
from gpubudget.tracefile import (
    Enter,
    Map,
    TraceError,
    TraceReader,
    Unmap,
    writer_for,
)
from gpubudget.tracefile.cscan import NATIVE
from gpubudget.tracefile.fastparse import AVAILABLE
from gpubudget.units import MiB

GRANULE = MiB  # what a 16 MiB growable root maps at a time on the host backend


def grown(path: Path) -> dict[str, int]:
    """A growable root of 16 MiB that maps 2 MiB at entry, grows for A (6 MiB) and B (2 MiB),
    frees A, is trimmed (A's granules go), places C (1 MiB) at the start again, sleeps and
    wakes (what is mapped goes and comes back); the addresses."""
    with gpu_budget("16MiB", name="pool", backend="host", trace=str(path),
                    initial="2MiB") as pool:
        a = pool.allocate(6 * MiB, tag="a")
        b = pool.allocate(2 * MiB, tag="b")
        assert a is not None and b is not None and pool.free(a)
        assert pool.trim() == 6 * MiB
        c = pool.allocate(MiB, tag="c")
        assert c is not None
        assert pool.offload(pinned=False) == 3 * MiB and pool.restore() == 3 * MiB
        assert pool.free(b) and pool.free(c)
    writer_for(path).flush()
    return {"a": a, "b": b, "c": c}


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


def test_a_growable_root_writes_its_base_granule_and_every_change_of_its_mappings(
        tmp_path: Path) -> None:
    path = tmp_path / "grown.jsonl"
    at = grown(path)
    base = at["a"]  # A, the first block, sits at the start of the range
    written = lines(path)
    assert written[0]["base"] == base and written[0]["granule"] == GRANULE
    changes = [(line["ev"], line["ptr"] - base, line["bytes"]) for line in written
               if line["ev"] in ("map", "unmap")]
    assert changes == [
        ("map", 0, 2 * MiB),  # at entry: initial=
        ("map", 2 * MiB, 4 * MiB),  # A grows the range to 6 MiB
        ("map", 6 * MiB, 2 * MiB),  # B
        ("unmap", 0, 6 * MiB),  # the trim: A's granules
        ("map", 0, MiB),  # C
        ("unmap", 0, MiB), ("unmap", 6 * MiB, 2 * MiB),  # asleep: nothing mapped
        ("map", 0, MiB), ("map", 6 * MiB, 2 * MiB)]  # awake: the live blocks' granules
    kinds = [line["ev"] for line in written]
    assert kinds.index("map") == 1 and kinds[2:4] == ["map", "alloc"]  # mapped, then used


def test_a_reserved_root_says_its_base_and_children_say_neither(tmp_path: Path) -> None:
    path = tmp_path / "reserved.jsonl"
    with gpu_budget("1MiB", name="pool", backend="host", trace=str(path)) as pool:
        with gpu_budget("512KiB", name="child") as child:
            block = child.allocate(1000)
            assert block is not None and child.free(block)
    writer_for(path).flush()
    root, child_line = (line for line in lines(path) if line["ev"] == "enter")
    assert root["base"] == block and "granule" not in root  # the first block: at the base
    assert "base" not in child_line and "granule" not in child_line
    assert [line["ev"] for line in lines(path)].count("map") == 0
    del pool


def test_reading_leaves_mappings_out_unless_asked_and_every_parser_agrees(
        tmp_path: Path) -> None:
    path = tmp_path / "grown.jsonl"
    grown(path)
    parsers = ["json"] + ["c"] * NATIVE + ["msgspec"] * AVAILABLE
    for parser in parsers:
        with TraceReader(path, parser=parser) as reader:
            plain = list(reader)
        with TraceReader(path, parser=parser) as reader:
            everything = list(reader.events_with_mappings())
        assert not any(isinstance(event, (Map, Unmap)) for event in plain), parser
        assert [event for event in everything if not isinstance(event, (Map, Unmap))] == plain
        assert sum(isinstance(event, (Map, Unmap)) for event in everything) == 9, parser
        enter = everything[0]
        assert isinstance(enter, Enter) and enter.granule == GRANULE
        assert enter.span == 16 * MiB
    with TraceReader(path, parser="json") as reader:
        reference = list(reader.events_with_mappings())
    for parser in parsers:
        with TraceReader(path, parser=parser) as reader:
            assert list(reader.events_with_mappings()) == reference, parser


def test_a_replay_of_a_growable_root_ignores_its_mappings(tmp_path: Path) -> None:
    path = tmp_path / "grown.jsonl"
    grown(path)
    stripped = tmp_path / "stripped.jsonl"
    kept = [line for line in path.read_text().splitlines()
            if '"ev": "map"' not in line and '"ev": "unmap"' not in line]
    stripped.write_text("\n".join(kept) + "\n")
    first, second = replay(str(path)), replay(str(stripped))
    assert first.budgets == second.budgets and first.denials == second.denials == {}


def test_a_trace_from_before_reads_as_it_did(tmp_path: Path) -> None:
    """No ``base``, no ``granule``, no ``map`` lines: the events are those of before, and the
    viewer infers the root's region from its blocks."""
    path = tmp_path / "grown.jsonl"
    grown(path)
    old = tmp_path / "old.jsonl"
    kept = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("ev") in ("map", "unmap"):
            continue
        record.pop("base", None)
        record.pop("granule", None)
        kept.append(json.dumps(record))
    old.write_text("\n".join(kept) + "\n")
    with TraceReader(old) as reader:
        events = list(reader.events_with_mappings())
    assert isinstance(events[0], Enter) and events[0].base is None and events[0].granule is None
    model = model_from_trace(old)
    assert model.mappings == [] and [region[1:3] for region in model.regions] == [
        (events[1].ptr, 16 * MiB)]  # type: ignore[union-attr]


BASE = 1 << 30
ROOT = {"ev": "enter", "t": 0.0, "b": 1, "name": "pool", "parent": None, "limit": 4 * MiB,
        "align": 256, "reserve": 0, "backend": "host", "base": BASE, "granule": MiB}


@pytest.mark.parametrize(("lines_after", "message"), [
    ([{"ev": "map", "t": 1.0, "b": 1, "ptr": BASE + 512, "bytes": MiB}],
     "not whole granules of 1048576 bytes"),
    ([{"ev": "map", "t": 1.0, "b": 1, "ptr": BASE, "bytes": 1000}], "not whole granules"),
    ([{"ev": "map", "t": 1.0, "b": 1, "ptr": BASE - MiB, "bytes": MiB}], "not whole granules"),
    ([{"ev": "map", "t": 1.0, "b": 1, "ptr": BASE + 3 * MiB, "bytes": 2 * MiB}],
     "passes the end of the root's range"),
    ([{"ev": "map", "t": 1.0, "b": 1, "ptr": BASE, "bytes": 2 * MiB},
      {"ev": "map", "t": 1.0, "b": 1, "ptr": BASE + MiB, "bytes": MiB}],
     f"granule at {BASE + MiB:#x} is mapped already"),
    ([{"ev": "unmap", "t": 1.0, "b": 1, "ptr": BASE, "bytes": MiB}],
     f"granule at {BASE:#x} is not mapped already"),
    ([{"ev": "map", "t": 1.0, "b": 2, "ptr": BASE, "bytes": MiB}],
     "budget 2 was not entered before this line"),
    ([{**ROOT, "b": 2, "parent": 1, "base": None, "granule": None},
      {"ev": "map", "t": 1.0, "b": 2, "ptr": BASE, "bytes": MiB}],
     "budget 2 (\"pool\") is not a growable root"),
    ([{**ROOT, "b": 2, "parent": 1}], "'granule' is for a root's line, with its 'base'"),
    ([{**ROOT, "b": 2, "granule": 3 * MiB}], "'granule' must be a power of two"),
    ([{**ROOT, "b": 2, "base": -1}], "'base' must be an integer >= 0"),
    ([{"ev": "map", "t": 1.0, "b": 1, "ptr": BASE, "bytes": 0}], "'bytes' must be an integer >= 1"),
])
def test_bad_mapping_lines_are_refused_naming_the_line(tmp_path: Path,
                                                       lines_after: list[dict[str, Any]],
                                                       message: str) -> None:
    path = tmp_path / "bad.jsonl"
    header = {"format": "gpubudget-trace", "version": 1}
    path.write_text("\n".join(json.dumps(line) for line in [header, ROOT, *lines_after]) + "\n")
    with TraceReader(path) as reader, pytest.raises(TraceError) as caught:
        list(reader)  # refused even when they are not given
    assert f"bad.jsonl:{2 + len(lines_after)}: " in str(caught.value)
    assert message in str(caught.value)


def test_nothing_is_told_on_the_path_of_a_block_whose_granules_are_mapped(
        tmp_path: Path) -> None:
    with gpu_budget("16MiB", name="pool", backend="host", trace=str(tmp_path / "t.jsonl"),
                    initial="8MiB") as pool:
        tree = pool._node.tree
        assert tree is not None and tree.mapping is not None
        told: list[tuple[str, list[int]]] = []
        watcher = tree.mapping.watcher
        assert watcher is not None

        def counted(change: str, indices: list[int]) -> None:
            told.append((change, indices))
            watcher(change, indices)

        tree.mapping.watcher = counted
        for _ in range(200):  # within the 8 MiB mapped at entry
            block = pool.allocate(MiB)
            assert block is not None and pool.free(block)
        assert told == []
        big = pool.allocate(12 * MiB)  # a growth
        assert big is not None and told == [("map", [8, 9, 10, 11])]
        assert pool.free(big)


def test_a_growth_the_device_refuses_leaves_no_mapping_line(tmp_path: Path) -> None:
    path = tmp_path / "full.jsonl"
    backend = HostBackend(device_capacity=4 * MiB)  # maps 4 MiB at most
    with gpu_budget("16MiB", name="pool", backend=backend, trace=str(path),
                    initial="2MiB") as pool:
        assert pool.allocate(8 * MiB) is None  # partly mapped, then refused: undone
        block = pool.allocate(3 * MiB)
        assert block is not None and pool.free(block)
    writer_for(path).flush()
    with TraceReader(path) as reader:  # consistent: the reader checks every granule
        changes = [(type(e).__name__, e.nbytes) for e in reader.events_with_mappings()
                   if isinstance(e, (Map, Unmap))]
    assert changes == [("Map", 2 * MiB), ("Map", MiB)]


def test_the_model_has_each_run_of_mapped_granules_over_its_events(tmp_path: Path) -> None:
    path = tmp_path / "grown.jsonl"
    at = grown(path)
    base = at["a"]
    model = model_from_trace(path)
    assert [region[:3] for region in model.regions] == [(0, base, 16 * MiB)]
    runs = sorted((address - base, size, model.times[start] <= model.times[end]
                   if end >= 0 else True) for _, address, size, start, end in model.mappings)
    assert [(offset, size) for offset, size, _ in runs] == [
        (0, MiB), (0, MiB), (0, 2 * MiB), (2 * MiB, 4 * MiB), (6 * MiB, 2 * MiB),
        (6 * MiB, 2 * MiB)]
    assert all(ordered for _, _, ordered in runs)
    assert all(end >= 0 for *_, end in model.mappings)  # released with the root

    def mapped_at(event: int) -> int:
        return sum(size for _, _, size, start, end in model.mappings
                   if start <= event and (end < 0 or end > event))

    trim = next(end for _, address, size, _, end in model.mappings
                if address == base + 2 * MiB)  # A's growth ends at the trim
    assert mapped_at(trim - 1) == 8 * MiB and mapped_at(trim) == 2 * MiB
