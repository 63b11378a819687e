"""Both traces on a CUDA device: gpubudget against the allocators users pick today.

    python -m benchmarks.gpu [--repeat 3] [--steps 20000]

Every allocator runs the churn trace (``benchmarks/traces.py``) and the model-loading trace
(``traces.model_loading``) in one process, interleaved, ``--repeat`` times; prints Markdown
tables of median microseconds per allocate+free pair and ratios to the ``Budget`` path.
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
from .traces import Trace, churn, model_loading, replay

# An opened allocator: allocate(nbytes) -> handle, free(handle), close().
Opened = tuple[Callable[[int], Any], Callable[[Any], object], Callable[[], None]]
BUDGET = "gpubudget Budget.allocate/free"


def _open_budget() -> Opened:
    from gpubudget import gpu_budget

    budget = gpu_budget("16GiB", name="bench", backend="pycuda")
    budget.__enter__()
    return budget.allocate, budget.free, lambda: budget.__exit__(None, None, None)


def _open_trt_methods() -> Opened:
    from gpubudget import gpu_budget
    from gpubudget import tensorrt as gbt

    module = gbt.load_module()
    budget = gpu_budget("16GiB", name="bench", backend="pycuda")
    budget.__enter__()
    alloc = gbt.allocator(budget, trt_module=module)
    return (
        lambda n: alloc.allocate_async(n, 0, 0, 0),
        lambda p: alloc.deallocate_async(p, 0),
        lambda: budget.__exit__(None, None, None),
    )


def _open_pycuda() -> Opened:
    import pycuda.driver as cuda

    from gpubudget.backends import get_backend

    get_backend("pycuda")  # the primary context, current on this thread
    return cuda.mem_alloc, lambda a: a.free(), lambda: None


def _open_cupy_runtime() -> Opened:
    rt = importlib.import_module("cupy").cuda.runtime
    return rt.malloc, rt.free, lambda: None


def _open_cupy_pool(async_pool: bool) -> Opened:
    cupy = importlib.import_module("cupy")
    pool = cupy.cuda.MemoryAsyncPool() if async_pool else cupy.cuda.MemoryPool()
    device = cupy.cuda.Device()

    def close() -> None:
        device.synchronize()
        if not async_pool:
            pool.free_all_blocks()

    return pool.malloc, lambda memory: None, close  # a block returns when its handle dies


def _open_torch() -> Opened:
    torch = importlib.import_module("torch")
    torch.cuda.init()
    return (torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete,
            torch.cuda.empty_cache)


ALLOCATORS: dict[str, Callable[[], Opened]] = {
    BUDGET: _open_budget,
    "gpubudget TensorRT methods": _open_trt_methods,
    "PyCUDA mem_alloc/free (cudaMalloc)": _open_pycuda,
    "CuPy runtime.malloc/free (cudaMalloc)": _open_cupy_runtime,
    "CuPy MemoryPool": lambda: _open_cupy_pool(False),
    "CuPy MemoryAsyncPool (cudaMallocAsync)": lambda: _open_cupy_pool(True),
    "PyTorch caching_allocator_alloc/delete": _open_torch,
}


def _timed(opener: Callable[[], Opened], run: Callable[[Opened], float]) -> float:
    opened = opener()
    try:
        return run(opened)
    finally:
        opened[2]()


def tables(steps: int, repeat: int) -> list[str]:
    warmup, timed = churn(steps=steps)
    load = model_loading()
    traces: dict[str, tuple[Callable[[Opened], float], int]] = {
        f"churn ({len(timed)} steps, 1000 live blocks, 256 B-16 MiB)":
            (lambda o: run_trace(o[0], o[1], warmup, timed), len(timed)),
        f"model loading ({sum(1 for _, s in load if s)} allocations, 3 models)":
            (lambda o: replay(load, o[0], o[1]), sum(1 for _, s in load if s)),
    }
    usable: dict[str, Callable[[], Opened]] = {}
    rows = [f"Python {platform.python_version()}; median of {repeat} interleaved runs", ""]
    for label, opener in ALLOCATORS.items():
        try:
            opener()[2]()
            usable[label] = opener
        except Exception as exc:  # noqa: BLE001 - a missing package: say so, go on
            rows.append(f"- {label}: not run ({type(exc).__name__}: {str(exc)[:120]})")
    for title, (run, pairs) in traces.items():
        times: dict[str, list[float]] = {label: [] for label in usable}
        for _ in range(repeat):
            for label, opener in usable.items():
                times[label].append(_timed(opener, run))
        us = {label: statistics.median(t) / pairs * 1e6 for label, t in times.items()}
        ours = us.get(BUDGET, float("nan"))
        rows += ["", f"### {title}", "", "| allocator | us/pair | / Budget |", "| --- | ---: | ---: |"]
        for label, value in sorted(us.items(), key=lambda item: -item[1]):
            rows.append(f"| {label} | {value:.2f} | {value / ours:.2f}x |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="both traces on a CUDA device")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print("\n".join(tables(args.steps, args.repeat)))


if __name__ == "__main__":
    main()
