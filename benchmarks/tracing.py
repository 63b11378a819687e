"""What it costs to know what happened: an allocate+free pair plain, tagged, with stacks and
traced, side by side in one process.

    python -m benchmarks.tracing [--pairs N] [--rounds R] [--json PATH]

Each row is a child budget of a root on host memory (the common shape: a model's budget in a
shared pool), and each pair is ``child.allocate(4096, tag=...)`` then ``child.free(address)``
from Python: ``plain`` (no tag), ``tag=`` (a tag on every block), ``track_stacks=True`` (the
Python stack of every block kept), ``trace=`` (every event written to a trace file, in a
temporary directory; the file's size per event is printed too), both (``trace=`` with
``track_stacks=True``: each allocation's stack in the trace) and the pair as TensorRT
makes it, through TensorRT-RTX's own C++ trampoline (where ``tensorrt_rtx_bindings``
imports). Rounds are interleaved (one
round of every row, then the next), each on a fresh pair of budgets and a collected heap; the
table gives the best round's CPU microseconds per pair (``time.process_time``: the cost,
whatever else the machine runs) and the median, and the best against ``plain``'s best.
The targets: traced at most 3x plain, with stacks at most 5x. The writer's thread runs in
the same process: its CPU time is in the figures. A traced round that lost events (its
writer's queue full) fails the run: its figures would be those of a trace that stopped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gpubudget
from gpubudget import gpu_budget
from gpubudget.tracefile import writer_for

SIZE = 4096
TARGETS: dict[str, float] = {"track_stacks=True": 5.0, "trace=": 3.0}
"""The most each row may cost, in plain pairs."""


def _pairs(child: gpubudget.Budget, pairs: int, tag: str | None) -> float:
    """CPU seconds for ``pairs`` allocate+free pairs in ``child``."""
    allocate, free = child.allocate, child.free
    gc.collect()
    started = time.process_time()
    for _ in range(pairs):
        free(allocate(SIZE, tag=tag))  # type: ignore[arg-type]  # never denied: 1 MiB room
    return time.process_time() - started


def plain(pairs: int, where: Path) -> float:
    with gpu_budget("64MiB", name="pool", backend="host"):
        with gpu_budget("1MiB", name="model") as child:
            return _pairs(child, pairs, None)


def tagged(pairs: int, where: Path) -> float:
    with gpu_budget("64MiB", name="pool", backend="host"):
        with gpu_budget("1MiB", name="model") as child:
            return _pairs(child, pairs, "weights")


def stacks(pairs: int, where: Path) -> float:
    with gpu_budget("64MiB", name="pool", backend="host", track_stacks=True):
        with gpu_budget("1MiB", name="model", track_stacks=True) as child:
            return _pairs(child, pairs, None)


def trampoline(pairs: int, where: Path) -> float:
    """The pair as TensorRT makes it: C++ calls into gpubudget's allocator through
    TensorRT-RTX's own trampoline (``tests/trampoline.py`` drives its vtable)."""
    from gpubudget import tensorrt as gbt
    from tests.trampoline import Trampoline

    module = gbt.load_module("tensorrt_rtx_bindings")
    with gpu_budget("64MiB", name="pool", backend="host"):
        with gpu_budget("1MiB", name="model"):
            cpp = Trampoline(gbt.allocator(trt_module=module))
            allocate, free = cpp.allocate_async, cpp.deallocate_async
            gc.collect()
            started = time.process_time()
            for _ in range(pairs):
                free(allocate(SIZE, 0, 0, 0), 0)  # type: ignore[arg-type]  # never denied
            return time.process_time() - started


def traced(pairs: int, where: Path, stacks: bool = False) -> float:
    path = where / f"trace-{time.monotonic_ns()}.jsonl"
    with gpu_budget("64MiB", name="pool", backend="host", trace=str(path), track_stacks=stacks):
        with gpu_budget("1MiB", name="model") as child:
            spent = _pairs(child, pairs, None)
    started = time.process_time()
    writer = writer_for(path)
    writer.flush()  # what is still queued, written: part of the cost
    spent += time.process_time() - started
    if writer.lost:
        raise RuntimeError(f"the trace lost {writer.lost:,} events (its queue was full): "
                           f"the figures would be a stopped trace's")
    if not stacks:
        traced.bytes_per_event = path.stat().st_size / (2 * pairs)  # type: ignore[attr-defined]
    path.unlink()
    return spent


def traced_stacks(pairs: int, where: Path) -> float:
    return traced(pairs, where, stacks=True)


ROWS: dict[str, Callable[[int, Path], float]] = {
    "plain": plain, "tag=": tagged, "track_stacks=True": stacks, "trace=": traced,
    "trace= track_stacks=True": traced_stacks, "through TensorRT's trampoline": trampoline}
"""Each row's run (the trampoline's where ``tensorrt_rtx_bindings`` imports)."""


def _rows() -> dict[str, Callable[[int, Path], float]]:
    try:
        import tensorrt_rtx_bindings  # noqa: F401 - only whether it is there
    except ImportError:
        return {name: run for name, run in ROWS.items() if run is not trampoline}
    return ROWS


def measure(pairs: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds per pair, each row's rounds."""
    rows = _rows()
    found: dict[str, list[float]] = {name: [] for name in rows}
    with tempfile.TemporaryDirectory(prefix="gpubudget-tracing-") as where:
        for run in rows.values():  # warm-up: code paths, the file system
            run(min(pairs, 2_000), Path(where))
        for _ in range(rounds):
            for name, run in rows.items():
                found[name].append(run(pairs, Path(where)) / pairs * 1e6)
    return found


def table(found: dict[str, list[float]]) -> list[str]:
    base = min(found["plain"])
    lines = ["| pair | CPU us, best | CPU us, median | best vs plain | target |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, times in found.items():
        target = f"<= {TARGETS[name]:g}x" if name in TARGETS else ""
        lines.append(f"| {name} | {min(times):.2f} | {statistics.median(times):.2f} | "
                     f"{min(times) / base:.2f}x | {target} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    found = measure(args.pairs, args.rounds)
    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"C core {'built' if gpubudget.compiled else 'absent'}; {args.pairs:,} pairs a "
          f"round, {args.rounds} interleaved rounds; a child of a root on host memory\n")
    print("\n".join(table(found)))
    per_event = getattr(traced, "bytes_per_event", 0.0)
    print(f"\ntrace file: {per_event:.1f} bytes per event")
    base = min(found["plain"])
    for name, most in TARGETS.items():
        ratio = min(found[name]) / base
        print(f"{name}: {ratio:.2f}x plain (target: at most {most:g}x): "
              f"{'met' if ratio <= most else 'missed'}")
    if args.json is not None:
        args.json.write_text(json.dumps({"pairs": args.pairs, "rows": found,
                                         "bytes_per_event": per_event}))


if __name__ == "__main__":
    main()
