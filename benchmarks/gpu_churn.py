"""Churn trace on a CUDA device: gpubudget against the allocators users pick today.

    python -m benchmarks.gpu_churn [--repeat 3] [--steps 20000]

Every allocator runs the same trace (DESIGN §8) in one process, interleaved, ``--repeat``
times; prints a Markdown table of median microseconds per free+allocate pair and ratios.
Allocators whose package is missing are listed as not run.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import statistics
from collections.abc import Callable
from typing import Any

from .churn import run_trace
from .traces import Trace, churn

def _budget() -> Callable[[Trace, Trace], float]:
    from gpubudget import gpu_budget
    from gpubudget.backends import get_backend

    get_backend("pycuda")  # fails here, and is reported as not run, without a GPU

    def run(warmup: Trace, timed: Trace) -> float:
        with gpu_budget("8GiB", name="churn", backend="pycuda") as budget:
            return run_trace(budget.allocate, budget.free, warmup, timed)

    return run


def _budget_trt_methods() -> Callable[[Trace, Trace], float]:
    from gpubudget import gpu_budget
    from gpubudget import tensorrt as gbt

    module = gbt.load_module()
    _budget()

    def run(warmup: Trace, timed: Trace) -> float:
        with gpu_budget("8GiB", name="churn", backend="pycuda"):
            alloc = gbt.allocator(trt_module=module)
            return run_trace(lambda n: alloc.allocate_async(n, 0, 0, 0),
                        lambda p: alloc.deallocate_async(p, 0), warmup, timed)

    return run


def _pycuda() -> Callable[[Trace, Trace], float]:
    import pycuda.driver as cuda

    from gpubudget.backends import get_backend

    get_backend("pycuda")  # primary context current

    def run(warmup: Trace, timed: Trace) -> float:
        return run_trace(cuda.mem_alloc, lambda a: a.free(), warmup, timed)

    return run


def _cupy_runtime() -> Callable[[Trace, Trace], float]:
    cupy = importlib.import_module("cupy")

    rt = cupy.cuda.runtime
    return lambda w, t: run_trace(rt.malloc, rt.free, w, t)


def _cupy_pool(async_pool: bool) -> Callable[[Trace, Trace], float]:
    cupy = importlib.import_module("cupy")

    def run(warmup: Trace, timed: Trace) -> float:
        pool = cupy.cuda.MemoryAsyncPool() if async_pool else cupy.cuda.MemoryPool()
        try:
            return run_trace(pool.malloc, lambda m: None, warmup, timed)  # freed when dropped
        finally:
            cupy.cuda.Device().synchronize()
            if not async_pool:
                pool.free_all_blocks()

    return run


def _torch_caching() -> Callable[[Trace, Trace], float]:
    torch = importlib.import_module("torch")

    torch.cuda.init()
    alloc = torch.cuda.caching_allocator_alloc
    delete = torch.cuda.caching_allocator_delete

    def run(warmup: Trace, timed: Trace) -> float:
        try:
            return run_trace(alloc, delete, warmup, timed)
        finally:
            torch.cuda.empty_cache()

    return run


CANDIDATES: dict[str, Callable[[], Callable[[Trace, Trace], float]]] = {
    "gpubudget Budget.allocate/free": _budget,
    "gpubudget TensorRT methods": _budget_trt_methods,
    "PyCUDA mem_alloc/free (cudaMalloc)": _pycuda,
    "CuPy runtime.malloc/free (cudaMalloc)": _cupy_runtime,
    "CuPy MemoryPool": lambda: _cupy_pool(False),
    "CuPy MemoryAsyncPool (cudaMallocAsync)": lambda: _cupy_pool(True),
    "PyTorch caching_allocator_alloc/delete": _torch_caching,
}


def table(steps: int, repeat: int) -> list[str]:
    warmup, timed = churn(steps=steps)
    runs: dict[str, Callable[[Trace, Trace], float]] = {}
    missing: list[str] = []
    for label, make in CANDIDATES.items():
        try:
            runs[label] = make()
        except Exception as exc:  # noqa: BLE001 - a missing package: say so, go on
            missing.append(f"{label}: not run ({type(exc).__name__}: {exc})")
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeat):
        for label, run in runs.items():
            times[label].append(run(warmup, timed))
    us = {label: statistics.median(t) / len(timed) * 1e6 for label, t in times.items()}
    ours = us.get("gpubudget Budget.allocate/free", float("nan"))
    rows = [
        f"churn trace: 1000 live blocks, log-uniform 256 B-16 MiB, {len(timed)} steps; "
        f"median of {repeat} interleaved runs; Python {platform.python_version()}",
        "",
        "| allocator | us/pair | Budget is faster by |",
        "| --- | ---: | ---: |",
    ]
    for label, value in sorted(us.items(), key=lambda item: -item[1]):
        rows.append(f"| {label} | {value:.2f} | {value / ours:.2f}x |")
    rows += [""] + missing
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="churn trace on a CUDA device")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print("\n".join(table(args.steps, args.repeat)))


if __name__ == "__main__":
    main()
