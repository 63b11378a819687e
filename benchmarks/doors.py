"""What the Numba door costs on the CPU: Numba's memory manager over a budget against Numba's
own manager, a budget alone and the team's baseline (``bare_bestfit.BestFit``), on the
baseline's churn trace, side by side in one run.

    python -m benchmarks.doors [--steps N] [--repeat R] [--baseline PATH]

Prints microseconds per free+allocate pair (median of R interleaved runs) and the ratios to
the baseline:

- the baseline, a bare bisect best-fit;
- ``Budget.allocate``/``free`` (a root in host memory that says it is device 0's);
- ``gpubudget.numba.BudgetMemoryManager.memalloc`` and ``MemoryPointer.free`` in that budget:
  Numba's pointer, its queue of pending frees (flushed as Numba flushes it), the budget;
- Numba's own manager (``NumbaCUDAMemoryManager``), the same calls, with ``cuMemAlloc`` and
  ``cuMemFree`` answered at once by stand-ins (there is no GPU here): what Numba's own
  bookkeeping costs, without the driver's 40-90 us per pair.

cuda.core's ``Buffer`` cannot be made without a CUDA driver, so the cuda.core door is not
timed here.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
from collections.abc import Callable
from typing import Any

from gpubudget import gpu_budget
from gpubudget.backends.host import HostBackend

from . import baseline

CAPACITY = 8 * 2**30


class Device0(HostBackend):
    """Host memory (never touched: mapped without reserving swap) that says it is device 0's,
    so that Numba's door routes to the budget."""

    def __init__(self) -> None:
        super().__init__(noreserve=True)
        self.ordinal = 0


class Context:
    """What a Numba context gives its memory manager here: its device's ordinal."""

    class Device:
        id = 0

    device = Device()


def start_numba_driver() -> None:
    """Numba's driver as far as its managers need it without a GPU: its logger (made when
    the driver starts), and cuMemAlloc, cuMemFree and cuMemGetInfo answered at once."""
    from numba.cuda.cudadrv import driver

    driver._logger = driver.make_logger()
    addresses = itertools.count(0x7000_0000_0000, 0x100_0000)
    functions = driver.driver.__dict__
    functions["cuMemAlloc"] = lambda size: next(addresses)
    functions["cuMemFree"] = lambda pointer: None
    functions["cuMemGetInfo"] = lambda: (CAPACITY, CAPACITY)


def rows(trace: Any, run: Callable[..., float], best_fit: type) -> dict[str, float]:
    """One interleaved round: each allocator once over the trace."""
    import gpubudget.numba
    from numba.cuda.cudadrv.driver import NumbaCUDAMemoryManager

    times: dict[str, float] = {}
    fit = best_fit(64 << 30)
    times["bare best-fit (baseline)"] = run(fit.alloc, fit.free, trace)
    with gpu_budget(CAPACITY, name="bench", backend=Device0()) as budget:
        times["Budget.allocate/free"] = run(budget.allocate, budget.free, trace)
        plugin = gpubudget.numba.BudgetMemoryManager(context=Context())
        plugin.initialize()  # Numba's pending frees sized from the budget, as Numba does
        times["gpubudget.numba memalloc/free"] = run(plugin.memalloc, _free, trace)
        plugin.deallocations.clear()
    own = NumbaCUDAMemoryManager(context=Context())
    own.initialize()
    times["Numba's own manager, driver stand-in"] = run(own.memalloc, _free, trace)
    own.deallocations.clear()
    return times


def _free(pointer: Any) -> None:
    pointer.free()


def table(steps: int, repeat: int, module: Any) -> list[str]:
    start_numba_driver()
    trace = module.churn_trace(steps=steps)
    rounds: dict[str, list[float]] = {}
    for _ in range(repeat):
        gc.collect()
        for name, value in rows(trace, module.run, module.BestFit).items():
            rounds.setdefault(name, []).append(value)
    base = statistics.median(rounds["bare best-fit (baseline)"])
    lines = [f"churn trace: {len(trace[1])} steps, {len(trace[0]) - len(trace[1])} live blocks; "
             f"median of {repeat} interleaved rounds", "",
             "| allocator | us/pair | vs baseline |", "| --- | ---: | ---: |"]
    for name, values in rounds.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:.2f} | {median / base:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="path of bare_bestfit.py")
    args = parser.parse_args(argv)
    import gpubudget

    print(f"core: {'C (_native)' if gpubudget.compiled else 'pure Python'}")
    for line in table(args.steps, args.repeat, baseline.load(args.baseline)):
        print(line)


if __name__ == "__main__":
    main()
