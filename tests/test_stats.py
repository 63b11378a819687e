"""memory_stats() in PyTorch's key style, reset_accumulated_stats(), memory_summary() and
the report's JSON without its timeline."""

from __future__ import annotations

import json

from gpubudget import gpu_budget
from gpubudget._core.node import KEEP_RELEASED_CHILDREN
from gpubudget._budget.stats import STAT_KEYS

KiB = 1024


def test_memory_stats_count_the_subtree_in_pytorch_keys() -> None:
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        own = pool.allocate(1000)  # aligned to 1 KiB
        with gpu_budget("64KiB", name="model") as model:
            first = model.allocate(4 * KiB)
            assert first is not None and model.free(first)
            assert model.allocate(8 * KiB) is not None
            assert model.allocate(128 * KiB) is None  # over the child's limit
            assert model.resize(model.allocate(2 * KiB) or 0, 6 * KiB)  # grows 4 KiB
        stats = pool.memory_stats()
        assert list(stats) == list(STAT_KEYS)
        assert stats == {
            "allocated_bytes.all.current": 1 * KiB + 14 * KiB,
            "allocated_bytes.all.peak": 1 * KiB + 14 * KiB,
            "allocated_bytes.all.allocated": (1 + 4 + 8 + 2 + 4) * KiB,
            "allocated_bytes.all.freed": 4 * KiB,
            "allocation.all.current": 3,
            "allocation.all.allocated": 4,
            "allocation.all.freed": 1,
            "num_ooms": 1,
        }
        assert model.memory_stats()["allocation.all.current"] == 2  # its own subtree only
        assert own is not None and pool.free(own)
        assert pool.memory_stats()["allocated_bytes.all.freed"] == 5 * KiB


def test_reset_accumulated_stats_restarts_the_counters_not_the_report() -> None:
    with gpu_budget("1MiB", backend="host") as pool:
        for _ in range(3):
            block = pool.allocate(KiB)
            assert block is not None and pool.free(block)
        assert pool.allocate(2 * 1024 * KiB) is None
        pool.reset_accumulated_stats()
        after = pool.memory_stats()
        assert (after["allocation.all.allocated"], after["allocation.all.freed"],
                after["allocated_bytes.all.allocated"], after["num_ooms"]) == (0, 0, 0, 0)
        assert pool.allocate(2 * KiB) is not None
        after = pool.memory_stats()
        assert (after["allocation.all.allocated"], after["allocated_bytes.all.allocated"],
                after["allocated_bytes.all.current"]) == (1, 2 * KiB, 2 * KiB)
    report = pool.report()
    assert (report.allocations, report.denied) == (4, 1)  # the report counts from entry


def test_released_children_still_count_once_dropped_from_the_tree() -> None:
    children = KEEP_RELEASED_CHILDREN + 5
    with gpu_budget("1MiB", backend="host") as pool:
        for index in range(children):
            with gpu_budget("8KiB", name=f"c{index}") as child:
                block = child.allocate(KiB)
                assert block is not None and child.free(block)
        assert len(pool.children) < children  # some were dropped
        stats = pool.memory_stats()
    assert stats["allocation.all.allocated"] == children
    assert stats["allocated_bytes.all.allocated"] == stats["allocated_bytes.all.freed"] == (
        children * KiB)


def test_memory_summary_is_one_row_per_budget() -> None:
    with gpu_budget("64MiB", name="server", backend="host") as server:
        for index in range(31):
            with gpu_budget("1MiB", name=f"request-{index:02}") as request:
                assert request.allocate(4 * KiB) is not None
                if index == 7:
                    assert request.allocate(2 * 1024 * KiB) is None
        lines = server.memory_summary().splitlines()
    assert len(lines) == 1 + 1 + 31  # the header, the root, its children
    assert lines[0].split() == ["budget", "state", "used", "peak", "limit", "allocs", "frees",
                                "denied", "live"]
    assert lines[1].split()[:2] == ["server", "open"]
    assert lines[2].split() == ["├─", "request-00", "exited", "4.00", "KiB", "4.00", "KiB",
                                "1.00", "MiB", "1", "0", "0", "1"]
    assert lines[9].split()[1] == "request-07" and lines[9].split()[-2] == "1"
    assert lines[-1].startswith("└─ request-30")
    assert len({len(line) for line in lines}) == 1  # columns line up


def test_to_json_leaves_the_timeline_out_unless_asked() -> None:
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        for _ in range(200):
            block = pool.allocate(KiB, tag="t")
            assert block is not None and pool.free(block)
    report = pool.report()
    short = json.loads(report.to_json())
    assert "timeline" not in short and short["allocations"] == 200
    full = json.loads(report.to_json(timeline=True))
    assert len(full["timeline"]) == 400
    assert full["timeline"][0] == {"time": 0.0, "kind": "alloc", "budget": "pool", "size": KiB,
                                   "tag": "t", "used": KiB, "total": KiB}
    assert report.to_json(timeline=True) == json.dumps(report.as_dict(timeline=True), indent=2)
    assert report.to_json(None) == json.dumps(report.as_dict())


def test_the_summary_and_the_stats_count_the_same_subtree() -> None:
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        assert pool.allocate(KiB) is not None
        with gpu_budget("64KiB", name="model") as model:
            with gpu_budget("16KiB", name="layer") as layer:
                block = layer.allocate(2 * KiB)
                assert block is not None and layer.free(block)
                assert layer.allocate(4 * KiB) is not None
                assert layer.allocate(32 * KiB) is None
            assert model.allocate(8 * KiB) is not None
        rows = {line.split()[-12]: line.split()[-4:]
                for line in pool.memory_summary().splitlines()[1:]}
        for budget in (pool, model, layer):
            stats = budget.memory_stats()
            assert rows[budget.name] == [str(stats[key]) for key in (
                "allocation.all.allocated", "allocation.all.freed", "num_ooms",
                "allocation.all.current")], budget.name
    assert rows == {"pool": ["4", "1", "1", "3"], "model": ["3", "1", "1", "2"],
                    "layer": ["2", "1", "1", "1"]}
