"""Model-loading trace (``traces.model_loading``) on the host backend: fragmentation of the
budget arena, and time per allocate+free pair against the bare best-fit allocators.

    python -m benchmarks.model_load [--repeat 3]

Fragmentation is the smallest budget limit under which the whole trace runs without a
denial, found by bisection to 1 MiB, divided by the trace's peak live bytes (aligned to 256).
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable

from gpubudget import gpu_budget
from gpubudget.units import MiB

from .churn import CAPACITY, BareBestFit, TextbookBestFit
from .traces import Trace, model_loading, peak_live, replay


def fits(trace: Trace, limit: int) -> bool:
    """Whether a root budget of ``limit`` bytes runs the whole trace without a denial."""
    with gpu_budget(limit, name="fit", backend="host") as budget:
        try:
            replay(trace, budget.allocate, budget.free)
        except MemoryError:
            return False
        finally:
            for block in budget.report().live_blocks:
                budget.free(block.address)
    return True


def smallest_limit(trace: Trace, step: int = MiB) -> int:
    """Bisection, over multiples of 256, between the peak (a lower bound) and a limit that
    fits; the answer is within ``step`` of the smallest such limit."""
    low = peak_live(trace)
    high = 2 * low
    while not fits(trace, high):
        low, high = high, 2 * high
    if fits(trace, low):
        return low
    while high - low > step:
        middle = (low + high) // 2 & -256  # the arena rounds a limit up to its alignment
        if fits(trace, middle):
            high = middle
        else:
            low = middle
    return high


def table(repeat: int = 3, models: int = 3) -> list[str]:
    trace = model_loading(models=models)
    pairs = sum(1 for _, size in trace if size)
    peak = peak_live(trace)
    ratios = []
    for seed in range(5):
        sample = model_loading(models=models, seed=seed)
        ratios.append((seed, peak_live(sample), smallest_limit(sample)))

    def budget_run() -> float:
        with gpu_budget(CAPACITY, name="load", backend="host") as budget:
            return replay(trace, budget.allocate, budget.free)

    def textbook_run() -> float:
        bare = TextbookBestFit(CAPACITY)
        return replay(trace, bare.allocate, bare.free)

    def packed_run() -> float:
        bare = BareBestFit(CAPACITY)
        return replay(trace, bare.allocate, bare.free)

    runs: dict[str, Callable[[], float]] = {
        "textbook bisect best-fit": textbook_run,
        "packed bisect best-fit": packed_run,
        "Budget (root)": budget_run,
    }
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeat):
        for label, run in runs.items():
            times[label].append(run())
    us = {label: statistics.median(t) / pairs * 1e6 for label, t in times.items()}
    rows = [
        f"model-loading trace, {models} models: fragmentation = smallest limit without a "
        "denial (bisection, 1 MiB) / peak live bytes",
        "",
        "| seed | peak live | smallest limit | ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    rows += [
        f"| {seed} | {p / 2**30:.3f} GiB | {lim / 2**30:.3f} GiB | {lim / p:.4f} |"
        for seed, p, lim in ratios
    ]
    rows += [
        f"| worst | | | {max(lim / p for _, p, lim in ratios):.4f} |",
        "",
        f"time per allocate+free pair, seed 0 ({pairs} allocations, peak "
        f"{peak / 2**30:.3f} GiB), host backend, median of {repeat} runs:",
        "",
        "| allocator | us/pair |",
        "| --- | ---: |",
    ]
    rows += [f"| {label} | {value:.2f} |" for label, value in us.items()]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="model-loading trace on the host backend")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--models", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", RuntimeWarning)
    print("\n".join(table(args.repeat, args.models)))


if __name__ == "__main__":
    main()
