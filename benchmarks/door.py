"""What the driver door costs a driver allocation: hooked against unhooked, in one process.

    python -m benchmarks.door [--repeat R] [--pairs N] [--size BYTES]

Builds the tests' fake CUDA driver (host memory) and the door into a temporary directory,
then runs itself again under ``gpubudget run``. There, side by side and interleaved (median
of R rounds of N pairs each), it times in C (the thread's CPU clock around a loop of
``cuMemAlloc_v2`` + ``cuMemFree_v2``, so no Python is in the measured path, and time the
thread spent waiting for a CPU on a loaded machine does not count):

- the fake driver's own entry points, reached without the door (unhooked);
- the door's hooks, outside every budget (the allocation is recorded as outside);
- the door's hooks inside a budget (charged, checked against its limit, recorded);
- the door's hooks inside a budget four deep (charged to every level).

and prints nanoseconds per pair (median, and best of the rounds) and what the door adds. The
fake driver runs with ``FAKECUDA_NULL=1``: an allocation is an address counted up and a free
does nothing, so the driver costs a few nanoseconds and the difference is the door's own
cost.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "door" / "fakecuda.c"
UNDER = "GPUBUDGET_BENCH_DOOR_UNDER"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args()
    if os.environ.get(UNDER):
        return measure(args.repeat, args.pairs, args.size)
    from gpubudget.door import build

    cc = build.compiler()
    if cc is None:
        print("no C compiler here: the fake driver and the door are built from C",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as where:
        subprocess.run([cc, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-o",
                        f"{where}/libcuda.so.1", str(FAKE), "-ldl", "-lpthread"], check=True)
        env = dict(os.environ, LD_LIBRARY_PATH=where, GPUBUDGET_DOOR_CACHE=f"{where}/cache",
                   FAKECUDA_NULL="1",
                   GPUBUDGET_LEDGER="0", PYTHONPATH=str(ROOT), **{UNDER: "1"})
        return subprocess.run([sys.executable, "-m", "gpubudget", "run", "--", sys.executable,
                               "-m", "benchmarks.door", *sys.argv[1:]], env=env,
                              check=False).returncode


def measure(repeat: int, pairs: int, size: int) -> int:
    from gpubudget import door, gpu_budget

    if not door.loaded():
        print("the door is not loaded", file=sys.stderr)
        return 2
    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_pairs_ns.restype = ctypes.c_double
    fake.fake_pairs_ns.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.c_long]
    fake.fake_unhooked_alloc.restype = ctypes.c_void_p
    fake.fake_unhooked_free.restype = ctypes.c_void_p
    unhooked = (fake.fake_unhooked_alloc(), fake.fake_unhooked_free())
    hooked = (ctypes.cast(fake.cuMemAlloc_v2, ctypes.c_void_p).value,
              ctypes.cast(fake.cuMemFree_v2, ctypes.c_void_p).value)
    assert hooked != unhooked

    @contextmanager
    def nested(depth: int) -> Iterator[None]:
        with ExitStack() as stack:
            for level in range(depth):
                stack.enter_context(gpu_budget(f"{64 - level}MiB",
                                               backend="host" if level == 0 else None))
            yield

    def outside() -> AbstractContextManager[object]:
        return ExitStack()

    cases: list[tuple[str, tuple[int | None, int | None],
                      Callable[[], AbstractContextManager[object]]]] = [
        ("unhooked (the fake driver's own)", unhooked, outside),
        ("hooked, outside every budget", hooked, outside),
        ("hooked, in a budget", hooked, lambda: nested(1)),
        ("hooked, in a budget 4 deep", hooked, lambda: nested(4)),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(repeat):
        for name, (alloc, free), scope in cases:
            with scope():
                ns = fake.fake_pairs_ns(alloc, free, size, pairs)
            if ns < 0:
                print(f"{name}: an allocation failed", file=sys.stderr)
                return 1
            times[name].append(ns)
    base = statistics.median(times[cases[0][0]])
    print(f"cuMemAlloc_v2 + cuMemFree_v2 of {size} bytes, timed in C (thread CPU time): "
          f"median of {repeat} interleaved rounds of {pairs:,} pairs, one process")
    print()
    best = min(times[cases[0][0]])
    print(f"| {'path':<34} | ns/pair | door adds (ns) | ratio | best ns | best adds |")
    print(f"| {'-' * 34} | ------: | -------------: | ----: | ------: | --------: |")
    for name, _, _ in cases:
        ns, low = statistics.median(times[name]), min(times[name])
        print(f"| {name:<34} | {ns:7.1f} | {ns - base:14.1f} | {ns / base:5.2f} | {low:7.1f} "
              f"| {low - best:9.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
