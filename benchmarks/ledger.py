"""What the host ledger costs: on the allocate/free path, and at a root's entry and exit.

    python -m benchmarks.ledger [--repeat R]

Prints, side by side in one run (median of R, interleaved): nanoseconds per charge+uncharge
pair of ``ledger.charge`` with and without a slot to store into (the only ledger code on the
allocate/free path); microseconds per free+allocate pair on the churn trace for a packed
best-fit, a root budget registered in the ledger and one that is not (``GPUBUDGET_LEDGER=0``);
microseconds to enter and exit a root, registered or not, with 0 and 100 other roots of
live processes in the ledger; then, with ``--crowd``, what entering and leaving a registered
root costs with 1, 1,024, 2,048 and 4,095 other roots live on the device (the ledger holds
4,096), how long the ledger's lock is held for it, and what entering and leaving a child
budget costs: in a root that is not registered, in a registered one (whose children the
ledger shows), and a registered root's first child with the root's entry and exit around it.

    python -m benchmarks.ledger --crowd [--entries N]
"""

from __future__ import annotations

import argparse
import contextvars
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gpubudget import Budget, gpu_budget
from gpubudget.hostledger import book as _book
from gpubudget._core.ledger import Account, charge

from .churn import ALIGN, CAPACITY, BareBestFit, run_trace
from .traces import churn


@contextmanager
def registered(yes: bool) -> Iterator[None]:
    previous = os.environ.get("GPUBUDGET_LEDGER")
    os.environ["GPUBUDGET_LEDGER"] = "1" if yes else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["GPUBUDGET_LEDGER"]
        else:
            os.environ["GPUBUDGET_LEDGER"] = previous


def charge_pairs(slot: memoryview | None, pairs: int = 200_000) -> float:
    """Nanoseconds per charge+uncharge of a child whose root stores into ``slot``."""
    root = Account("root", 1 << 40)
    child = Account("child", 1 << 40, 0, root)
    root.published = slot
    charge(child, 1 << 30)
    start = time.perf_counter()
    for _ in range(pairs):
        charge(child, 4096)
        charge(child, -4096)
    return (time.perf_counter() - start) / pairs * 1e9


def churn_pairs(register: bool | None) -> float:
    """Microseconds per free+allocate pair: a bare best-fit (``None``) or a root budget."""
    warmup, timed = churn()
    if register is None:
        bare = BareBestFit(CAPACITY)
        seconds = run_trace(bare.allocate, bare.free, warmup, timed)
    else:
        with registered(register), gpu_budget(CAPACITY, align=ALIGN, name="churn",
                                              backend="host") as budget:
            seconds = run_trace(budget.allocate, budget.free, warmup, timed)
    return seconds / len(timed) * 1e6


def entries(register: bool, count: int = 200) -> float:
    """Microseconds to enter and exit a root ``count`` times."""
    with registered(register):
        start = time.perf_counter()
        for _ in range(count):
            with gpu_budget("1MiB", backend="host"):
                pass
        return (time.perf_counter() - start) / count * 1e6


def others(count: int) -> list[tuple[Budget, contextvars.Context]]:
    """``count`` roots kept open in contexts of their own: slots the next claims read."""
    held = []
    for _ in range(count):
        context = contextvars.Context()
        budget = gpu_budget("1MiB", backend="host")
        context.run(budget.__enter__)
        held.append((budget, context))
    return held


def table(repeat: int = 5) -> list[str]:
    slot = memoryview(mmap.mmap(-1, mmap.PAGESIZE)).cast("Q")[0:3]
    runs: dict[str, Callable[[], float]] = {
        "charge pair, no slot (ns)": lambda: charge_pairs(None),
        "charge pair, into a slot (ns)": lambda: charge_pairs(slot),
        "churn pair, packed best-fit (us)": lambda: churn_pairs(None),
        "churn pair, root not registered (us)": lambda: churn_pairs(False),
        "churn pair, root registered (us)": lambda: churn_pairs(True),
        "root entry+exit, not registered (us)": lambda: entries(False),
        "root entry+exit, registered (us)": lambda: entries(True),
    }
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeat):
        for label, run in runs.items():
            times[label].append(run())
    crowd = others(100)
    crowded = statistics.median(entries(True) for _ in range(repeat))
    for budget, context in crowd:
        context.run(budget.__exit__, None, None, None)
    rows = [f"host ledger costs, median of {repeat} interleaved runs", "",
            "| measure | value |", "| --- | ---: |"]
    rows += [f"| {label} | {statistics.median(values):.2f} |" for label, values in times.items()]
    rows.append(f"| root entry+exit, registered, 100 other roots live (us) | {crowded:.2f} |")
    return rows


def child_entries(register: bool, count: int = 200) -> float:
    """Microseconds to enter and exit a child budget (the median of ``count``), in one root
    (registered in the ledger or not) that stays entered around them."""
    costs = []
    with registered(register), gpu_budget("1MiB", backend="host"):
        with gpu_budget("64KiB"):  # the root's first child: what is set up once is set up
            pass
        for _ in range(count):
            start = time.perf_counter()
            with gpu_budget("64KiB"):
                pass
            costs.append(time.perf_counter() - start)
    return statistics.median(costs) * 1e6


def first_child() -> float:
    """Seconds to enter a registered root, enter and exit its first child, and exit it."""
    start = time.perf_counter()
    with gpu_budget("1MiB", backend="host"), gpu_budget("64KiB"):
        pass
    return time.perf_counter() - start


CROWDS = (1, 1024, 2048, 4095)
"""Other roots live on the device while one more enters and leaves (the ledger holds 4,096)."""


@contextmanager
def lock_timer() -> Iterator[list[float]]:
    """Seconds the ledger's lock was held, each time it was taken (by this process)."""
    held: list[float] = []
    original = _book.DeviceBook.locked

    @contextmanager
    def timed(self: _book.DeviceBook, *wait: float | None) -> Iterator[None]:
        with original(self, *wait):
            start = time.perf_counter()
            try:
                yield
            finally:
                held.append(time.perf_counter() - start)

    _book.DeviceBook.locked = timed  # type: ignore[method-assign, assignment]
    try:
        yield held
    finally:
        _book.DeviceBook.locked = original  # type: ignore[method-assign]


def crowd_table(entries_per_size: int = 50) -> list[str]:
    """Entry+exit of a registered root, and the lock held for it, as the crowd grows."""
    rows = [f"root entry+exit with other roots live, median of {entries_per_size}", "",
            "| other live roots | entry+exit (us) | lock held per entry+exit (us) "
            "| child entry+exit, root not registered (us) | child entry+exit, root registered "
            "(us) | root+first child entry+exit (us) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    crowd: list[tuple[Budget, contextvars.Context]] = []
    with registered(True):
        for size in CROWDS:
            crowd += others(size - len(crowd))
            costs, locks = [], []
            for _ in range(entries_per_size):
                with lock_timer() as held:
                    start = time.perf_counter()
                    with gpu_budget("1MiB", backend="host"):
                        pass
                    costs.append(time.perf_counter() - start)
                locks.append(sum(held))
            children = [child_entries(register) for register in (False, True)]
            first = [first_child() for _ in range(entries_per_size)]
            rows.append(f"| {size:,} | {statistics.median(costs) * 1e6:.1f} | "
                        f"{statistics.median(locks) * 1e6:.1f} | {children[0]:.1f} | "
                        f"{children[1]:.1f} | {statistics.median(first) * 1e6:.1f} |")
    for budget, context in crowd:
        context.run(budget.__exit__, None, None, None)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--crowd", action="store_true",
                        help="only the cost of entry as the other live roots grow")
    parser.add_argument("--entries", type=int, default=50,
                        help="entries timed per crowd size (with --crowd)")
    args = parser.parse_args(argv)
    import gpubudget

    os.environ.setdefault("GPUBUDGET_LEDGER_DIR", tempfile.mkdtemp(prefix="gpubudget-bench-"))
    print(f"core: {'C (_native)' if gpubudget.compiled else 'pure Python'}")
    for row in crowd_table(args.entries) if args.crowd else table(args.repeat):
        print(row)


if __name__ == "__main__":
    main()
