"""Both traces on a CUDA device: gpubudget against the allocators users pick today.

    python -m benchmarks.gpu [--repeat 3] [--steps 20000]

Every allocator runs the churn trace (``benchmarks/traces.py``) and the model-loading trace
(``traces.model_loading``) in one process, interleaved, ``--repeat`` times; prints Markdown
tables of median microseconds per allocate+free pair and ratios to the ``Budget`` path (a
reserved root), with a growable root (``initial=0``, grown to its limit before it is timed)
beside it and the ratio of the two.
Allocators whose package is missing are listed as not run. A third table times CuPy arrays and
PyTorch tensors created and deleted through their own pools and routed into a budget
(``gpubudget.cupy.allocations``, ``gpubudget.torch.allocations``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from .churn import run_trace
from .traces import churn, model_loading, replay

# An opened allocator: allocate(nbytes) -> handle, free(handle), close().
Opened = tuple[Callable[[int], Any], Callable[[Any], object], Callable[[], None]]
BUDGET = "gpubudget Budget.allocate/free"
GROWABLE = "gpubudget Budget, growable root (grown)"


def _open_budget() -> Opened:
    from gpubudget import gpu_budget

    budget = gpu_budget("16GiB", name="bench", backend="pycuda")
    budget.__enter__()
    return budget.allocate, budget.free, lambda: budget.__exit__(None, None, None)


def _open_growable() -> Opened:
    """A growable root (``initial=0``) grown to its limit before the trace: every granule
    mapped, so the trace never grows it (the reserved root's trace, on the growable path)."""
    from gpubudget import gpu_budget

    from .churn import grown

    budget = gpu_budget("16GiB", name="bench", backend="pycuda", initial=0)
    budget.__enter__()
    grown(budget)
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

    cuda.init()
    context = cuda.Device(0).retain_primary_context()
    context.push()  # the primary context, current on this thread while the trace runs
    return cuda.mem_alloc, lambda a: a.free(), cuda.Context.pop


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
    GROWABLE: _open_growable,
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
    import gpubudget

    usable: dict[str, Callable[[], Opened]] = {}
    core = "C (_native)" if gpubudget.compiled else "pure Python"
    rows = [f"Python {platform.python_version()}, gpubudget core {core}; median of {repeat} "
            "interleaved runs", ""]
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
        if GROWABLE in us:
            rows += ["", f"growable root (grown) / reserved root: {us[GROWABLE] / ours:.2f}x"]
    return rows


def _sizes(count: int) -> list[int]:
    """Log-uniform array sizes, 256 B to 4 MiB, the same every run."""
    rng = random.Random(7)
    return [int(2 ** rng.uniform(8, 22)) for _ in range(count)]


def _cupy_arrays(routed: bool, sizes: list[int]) -> float:
    cp = importlib.import_module("cupy")
    from gpubudget import cupy as gbc
    from gpubudget import gpu_budget

    with contextlib.ExitStack() as stack:
        if routed:
            stack.enter_context(gpu_budget("8GiB", name="cupy-bench", backend="pycuda"))
            stack.enter_context(gbc.allocations())
        for size in sizes[:100]:  # warm-up
            cp.empty(size, cp.uint8)
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        for size in sizes:
            array = cp.empty(size, cp.uint8)
            del array
        cp.cuda.Device().synchronize()
        return time.perf_counter() - start


def _torch_tensors(routed: bool, sizes: list[int]) -> float:
    torch = importlib.import_module("torch")
    from gpubudget import gpu_budget
    from gpubudget import torch as gbt

    with contextlib.ExitStack() as stack:
        if routed:
            stack.enter_context(gpu_budget("8GiB", name="torch-bench", backend="pycuda"))
            stack.enter_context(gbt.allocations())
        for size in sizes[:100]:  # warm-up: the pools' first segments
            torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for size in sizes:
            tensor = torch.empty(size, dtype=torch.uint8, device="cuda")
            del tensor
        torch.cuda.synchronize()
        return time.perf_counter() - start


FRAMEWORKS: dict[str, Callable[[list[int]], float]] = {
    "CuPy arrays, CuPy's default pool": lambda sizes: _cupy_arrays(False, sizes),
    "CuPy arrays, routed into a budget": lambda sizes: _cupy_arrays(True, sizes),
    "PyTorch tensors, PyTorch's caching allocator": lambda sizes: _torch_tensors(False, sizes),
    "PyTorch tensors, routed into a budget": lambda sizes: _torch_tensors(True, sizes),
}


def framework_table(count: int, repeat: int) -> list[str]:
    """Microseconds per array/tensor created and deleted, each framework's own pool against
    the same framework routed into a budget, interleaved."""
    sizes = _sizes(count)
    times: dict[str, list[float]] = {label: [] for label in FRAMEWORKS}
    rows = ["", f"### arrays and tensors ({count} created and deleted, 256 B-4 MiB)", "",
            "| allocation | us each | routed / own |", "| --- | ---: | ---: |"]
    for _ in range(repeat):
        for label, run in FRAMEWORKS.items():
            try:
                times[label].append(run(sizes))
            except Exception as exc:  # noqa: BLE001 - a missing package: say so, go on
                rows.insert(0, f"- {label}: not run ({type(exc).__name__}: {str(exc)[:120]})")
                times[label] = []
    us = {label: statistics.median(t) / count * 1e6 for label, t in times.items() if t}
    labels = list(FRAMEWORKS)
    for own, routed in (labels[0:2], labels[2:4]):
        for label in (own, routed):
            if label in us:
                ratio = us[label] / us[own] if own in us else float("nan")
                rows.append(f"| {label} | {us[label]:.2f} | {ratio:.2f}x |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="both traces on a CUDA device")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--arrays", type=int, default=20_000)
    args = parser.parse_args(argv)
    print("\n".join(tables(args.steps, args.repeat)))
    print("\n".join(framework_table(args.arrays, args.repeat)))


if __name__ == "__main__":
    main()
