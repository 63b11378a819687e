"""The benchmark machinery: traces, replay and the fragmentation bisection (not timings)."""

from __future__ import annotations

from benchmarks.model_load import fits, smallest_limit
from benchmarks.traces import churn, model_loading, peak_live
from gpubudget.units import KiB, MiB


def test_smallest_limit_finds_the_known_answer() -> None:
    # A and B (1 MiB each) fill [0, 2 MiB); freeing A leaves a 1 MiB hole that C (2 MiB)
    # cannot use: 3 MiB are live at the peak, and 4 MiB are needed.
    trace = [(0, MiB), (1, MiB), (0, 0), (2, 2 * MiB), (1, 0), (2, 0)]
    assert peak_live(trace) == 3 * MiB
    assert not fits(trace, 4 * MiB - 256)
    assert fits(trace, 4 * MiB)
    assert smallest_limit(trace, step=256) == 4 * MiB


def test_model_loading_trace_is_well_formed_and_reproducible() -> None:
    trace = model_loading(models=2, seed=3)
    assert trace == model_loading(models=2, seed=3)
    live: set[int] = set()
    for slot, size in trace:
        if size:
            assert slot not in live
            live.add(slot)
        else:
            live.remove(slot)
    assert not live  # everything is freed by the end
    assert peak_live(trace) > 500 * MiB


def test_churn_trace_shape() -> None:
    warmup, timed = churn(live=50, steps=200, seed=1)
    assert [slot for slot, _ in warmup] == list(range(50))
    assert all(256 <= size <= 16 * MiB for _, size in warmup + timed)
    assert len(timed) == 200 and all(0 <= slot < 50 for slot, _ in timed)
