"""Churn benchmark on the host backend: ``Budget.allocate``/``free`` against the team's
baseline, ``bare_bestfit.BestFit`` (see ``benchmarks/baseline.py``), on its churn trace, side
by side in one run.

    python -m benchmarks.churn [--steps N] [--repeat R] [--baseline PATH]

Prints microseconds per free+allocate pair (median of R interleaved runs) and the ratios to
the baseline: a budget through the C core's fast path and through the Python methods (the
same tree, ``fast`` off), a growable root (``initial=0``) grown to its limit before it is
timed, a child budget, and TensorRT-RTX's trampoline into a budget and into
a no-op allocator (the floor of any Python allocator inside TensorRT); then the aggregate
throughput of 1 and 8 threads sharing one tree, and the bookkeeping bytes per live block.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
import tracemalloc
from bisect import bisect_left, insort
from collections.abc import Callable
from typing import Any

from gpubudget import EVENT_LOG_LIMIT, gpu_budget
from gpubudget.backends.host import HostBackend
from gpubudget.adapter import hooks

from . import baseline
from .traces import Trace, churn

ALIGN = 256
CAPACITY = 8 * 2**30
SHIFT = 64
GROWABLE = "Budget (growable root, grown)"
MASK = (1 << SHIFT) - 1


class TextbookBestFit:
    """Best-fit with coalescing as it is usually written: free blocks in a list of
    ``(size, offset)`` tuples sorted by size, and a sorted list of free offsets in which
    ``bisect`` finds a freed block's neighbours."""

    def __init__(self, capacity: int) -> None:
        self.by_size: list[tuple[int, int]] = [(capacity, 0)]
        self.offsets: list[int] = [0]
        self.free_size: dict[int, int] = {0: capacity}
        self.used: dict[int, int] = {}

    def allocate(self, size: int) -> int | None:
        size = (size + ALIGN - 1) & -ALIGN
        i = bisect_left(self.by_size, (size, 0))
        if i == len(self.by_size):
            return None
        block, offset = self.by_size.pop(i)
        self._unlink(offset)
        if block > size:
            self._link(offset + size, block - size)
        self.used[offset] = size
        return offset

    def free(self, offset: int) -> bool:
        size = self.used.pop(offset, 0)
        if not size:
            return False
        i = bisect_left(self.offsets, offset)
        if i < len(self.offsets) and self.offsets[i] == offset + size:
            following = self.free_size[offset + size]
            self.by_size.remove((following, offset + size))
            self._unlink(offset + size)
            size += following
        if i > 0:
            start = self.offsets[i - 1]
            if start + self.free_size[start] == offset:
                preceding = self.free_size[start]
                self.by_size.remove((preceding, start))
                self._unlink(start)
                offset, size = start, size + preceding
        self._link(offset, size)
        return True

    def _link(self, offset: int, size: int) -> None:
        insort(self.by_size, (size, offset))
        insort(self.offsets, offset)
        self.free_size[offset] = size

    def _unlink(self, offset: int) -> None:
        del self.offsets[bisect_left(self.offsets, offset)]
        del self.free_size[offset]


class BareBestFit:
    """The arena's own structure with nothing around it: free blocks as packed
    ``size << 64 | offset`` ints in one sorted list, and start/end maps for coalescing."""

    def __init__(self, capacity: int) -> None:
        self.keys = [capacity << SHIFT]
        self.free_at = {0: capacity}
        self.free_end = {capacity: 0}
        self.used: dict[int, int] = {}

    def allocate(self, size: int) -> int | None:
        size = (size + ALIGN - 1) & -ALIGN
        keys = self.keys
        i = bisect_left(keys, size << SHIFT)
        if i == len(keys):
            return None
        key = keys.pop(i)
        block, address = key >> SHIFT, key & MASK
        del self.free_at[address]
        del self.free_end[address + block]
        if block > size:
            self._add(address + size, block - size)
        self.used[address] = size
        return address

    def free(self, address: int) -> bool:
        size = self.used.pop(address, 0)
        if not size:
            return False
        end = address + size
        following = self.free_at.pop(end, 0)
        if following:
            del self.keys[bisect_left(self.keys, following << SHIFT | end)]
            del self.free_end[end + following]
            size += following
        start = self.free_end.pop(address, None)
        if start is not None:
            preceding = self.free_at.pop(start)
            del self.keys[bisect_left(self.keys, preceding << SHIFT | start)]
            address, size = start, size + preceding
        self._add(address, size)
        return True

    def _add(self, address: int, size: int) -> None:
        insort(self.keys, size << SHIFT | address)
        self.free_at[address] = size
        self.free_end[address + size] = address


def run_trace(
    allocate: Callable[[int], Any],
    free: Callable[[Any], object],
    warmup: Trace,
    timed: Trace,
    collect: bool = True,
) -> float:
    """Seconds for the timed steps; every step must succeed. ``allocate`` returns a handle
    (an address, or an allocator's own object) that ``free`` takes back."""
    slots: dict[int, Any] = {}
    if collect:
        gc.collect()  # every allocator starts timing from the same collector state
    for slot, size in warmup:
        address = allocate(size)
        assert address is not None, "warm-up allocation denied"
        slots[slot] = address
    start = time.perf_counter()
    for slot, size in timed:
        free(slots[slot])
        address = allocate(size)
        if address is None:
            raise RuntimeError(f"allocation of {size} bytes denied during the trace")
        slots[slot] = address
    elapsed = time.perf_counter() - start
    for address in slots.values():
        free(address)
    return elapsed


def _threaded(count: int, steps: int, make: Callable[[int], tuple[Any, Callable[[], None]]]
              ) -> float:
    """Pairs per second for ``count`` threads, each with ``make(i)`` = (an allocator with
    ``allocate``/``free``, its cleanup) and an equal share of ``steps``."""
    shares = [churn(live=1000 // count, steps=steps // count, seed=i) for i in range(count)]
    made = [make(i) for i in range(count)]
    barrier = threading.Barrier(count + 1)

    def work(allocator: Any, warm: Trace, timed: Trace) -> None:
        barrier.wait()
        run_trace(allocator.allocate, allocator.free, warm, timed, collect=False)

    threads = [threading.Thread(target=work, args=(allocator, *share))
               for (allocator, _), share in zip(made, shares)]
    gc.collect()  # once, before the clock starts: not once a thread inside the timing
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    rate = steps / (time.perf_counter() - start)
    for _, cleanup in made:
        cleanup()
    return rate


def threads_table(steps: int = 20_000, counts: tuple[int, ...] = (1, 8)) -> list[str]:
    """Aggregate pairs per second when ``n`` threads share one tree, each churning in a
    child budget of its own (the same total work for every ``n``), beside the same threads
    each running a textbook allocator of its own: no shared state, no lock, only the GIL."""
    rows = ["", f"threads ({steps} pairs in all, an equal share each), aggregate throughput",
            "", "| threads | Budget: one tree, a child each | vs 1 thread "
            "| textbook: one each, no lock | vs 1 thread |",
            "| ---: | ---: | ---: | ---: | ---: |"]
    rates: dict[int, tuple[float, float]] = {}
    for count in counts:
        with gpu_budget(CAPACITY, align=ALIGN, name="shared", backend="host") as root:
            def child(i: int) -> tuple[Any, Callable[[], None]]:
                budget = gpu_budget(CAPACITY // count, name=f"t{i}", parent=root)
                budget.__enter__()
                hooks(budget).pin()  # keeps serving after this thread left its scope
                budget.__exit__(None, None, None)
                return budget, hooks(budget).unpin

            shared = _threaded(count, steps, child)
        alone = _threaded(count, steps, lambda i: (TextbookBestFit(CAPACITY), lambda: None))
        rates[count] = (shared, alone)
    first = rates[counts[0]]
    for count, (shared, alone) in rates.items():
        rows.append(f"| {count} | {shared:,.0f} | {shared / first[0]:.2f}x | {alone:,.0f} "
                    f"| {alone / first[1]:.2f}x |")
    return rows


def memory_table(blocks: int = 200_000) -> list[str]:
    """Bookkeeping bytes per live block (registry, arena index, ledger), by tracemalloc."""
    gc.collect()
    with gpu_budget(blocks * ALIGN, align=ALIGN, name="memory", backend="host") as budget:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        addresses = [budget.allocate(ALIGN) for _ in range(blocks)]
        after = tracemalloc.get_traced_memory()[0]
        list_bytes = sys.getsizeof(addresses)  # the benchmark's own list, not ours
        tracemalloc.stop()
        events = len(budget.report().timeline)
        for address in addresses:
            assert address is not None
            budget.free(address)
    per_block = (after - before - list_bytes) / blocks
    return ["", f"bookkeeping per live block ({blocks} live blocks; the event log, bounded to "
            f"{EVENT_LOG_LIMIT} events, holds {events} of them): {per_block:.0f} bytes"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", help="path of bare_bestfit.py")
    args = parser.parse_args(argv)
    import gpubudget

    bare = baseline.load(args.baseline)
    print(f"core: {'C (_native)' if gpubudget.compiled else 'pure Python'}")
    for row in (table(bare, args.steps, args.repeat) + threads_table(args.steps)
                + memory_table()):
        print(row)


def _budget_runs(bare: Any) -> dict[str, Callable[[Any], float]]:
    """Each row's run: microseconds per pair on ``trace`` through ``bare.run``."""
    def baseline_run(trace: Any) -> float:
        allocator = bare.BestFit(64 << 30)
        return float(bare.run(allocator.alloc, allocator.free, trace))

    def budget_run(fast: bool) -> Callable[[Any], float]:
        def run(trace: Any) -> float:
            with gpu_budget(64 << 30, name="churn",
                            backend=HostBackend(noreserve=True)) as budget:
                tree = budget._node.tree
                assert tree is not None
                tree.fast = fast and tree.fast
                return float(bare.run(budget.allocate, budget.free, trace))
        return run

    def growable_run(trace: Any) -> float:
        with gpu_budget(64 << 30, name="churn", backend=HostBackend(), initial=0) as budget:
            grown(budget)
            return float(bare.run(budget.allocate, budget.free, trace))

    def child_run(trace: Any) -> float:
        with gpu_budget(64 << 30, name="pool", backend=HostBackend(noreserve=True)):
            with gpu_budget(32 << 30, name="model") as child:
                return float(bare.run(child.allocate, child.free, trace))

    def trampoline_run(trace: Any) -> float:
        from gpubudget import tensorrt as gbt
        from tests.trampoline import Trampoline

        module = gbt.load_module("tensorrt_rtx_bindings")
        with gpu_budget(64 << 30, name="trt", backend=HostBackend(noreserve=True)):
            cpp = Trampoline(gbt.allocator(trt_module=module))
            return float(bare.run(lambda n: cpp.allocate_async(n, 0, 0, 0),
                                  lambda p: cpp.deallocate_async(p, 0), trace))

    def floor_run(trace: Any) -> float:
        cpp = _trivial_trampoline()
        return float(bare.run(lambda n: cpp.allocate_async(n, 0, 0, 0),
                              lambda p: cpp.deallocate_async(p, 0), trace))

    return {"bare_bestfit.BestFit (baseline)": baseline_run,
            "Budget (root), C fast path": budget_run(True),
            "Budget (root), Python methods": budget_run(False),
            GROWABLE: growable_run,
            "Budget (child of root)": child_run,
            "TensorRT trampoline -> Budget": trampoline_run,
            "TensorRT trampoline -> no-op": floor_run}


def grown(budget: Any) -> None:
    """Map every granule of a growable root (``initial=0``) before it is timed: one block of
    its whole limit, allocated and freed. Its granules stay mapped (nothing trims them), so
    the trace that follows never grows it."""
    block = budget.allocate(budget.limit)
    assert block is not None and budget.free(block), "the growable root could not grow"
    assert budget.mapped is not None and budget.mapped >= budget.limit, budget.mapped


def _trivial_trampoline() -> Any:
    """TensorRT-RTX's trampoline into an allocator whose methods do nothing."""
    from gpubudget import tensorrt as gbt
    from tests.trampoline import Trampoline

    base = gbt.load_module("tensorrt_rtx_bindings").IGpuAsyncAllocator

    class Trivial(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)
            self.next = 256

        def allocate_async(self, size: int, alignment: int, flags: int, stream: int) -> int:
            self.next += 256
            return self.next

        def deallocate_async(self, memory: int, stream: int) -> bool:
            return True

    return Trampoline(Trivial())


def table(bare: Any, steps: int = 20_000, repeat: int = 5) -> list[str]:
    """Every row ``repeat`` times, interleaved; the printed table."""
    trace = bare.churn_trace(steps=steps)
    runs = _budget_runs(bare)
    try:
        _trivial_trampoline()
    except ImportError:  # no TensorRT-RTX here
        del runs["TensorRT trampoline -> Budget"], runs["TensorRT trampoline -> no-op"]
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeat):  # interleaved, so drift hits every row alike
        for label, run in runs.items():
            times[label].append(run(trace))
    us = {label: statistics.median(t) for label, t in times.items()}
    base = us["bare_bestfit.BestFit (baseline)"]
    rows = [
        f"bare_bestfit's churn trace: {len(trace[0]) - len(trace[1])} live blocks, "
        f"log-uniform 256 B-16 MiB, {len(trace[1])} steps; median of {repeat} interleaved "
        f"runs, microseconds per free+allocate pair",
        "",
        f"| {'allocator':<34} | {'us/pair':>8} | {'vs baseline':>11} |",
        f"| {'-' * 34} | {'-' * 8}:| {'-' * 10}:|",
    ]
    for label, value in us.items():
        rows.append(f"| {label:<34} | {value:>8.2f} | {value / base:>10.2f}x |")
    reserved = us["Budget (root), C fast path"]
    rows += ["", f"growable root (grown) / reserved root: {us[GROWABLE] / reserved:.2f}x"]
    if "TensorRT trampoline -> no-op" in us:
        extra = us["TensorRT trampoline -> Budget"] - us["TensorRT trampoline -> no-op"]
        rows += ["", f"TensorRT-facing pair over the trampoline's floor: {extra:.2f} us = "
                     f"{extra / base:.2f} baseline pairs"]
    return rows


if __name__ == "__main__":
    main()
