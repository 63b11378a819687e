"""Growable roots (``initial=``) on a CUDA device: what growing costs, and what it saves.

    python -m benchmarks.vmm [--repeat 3]

Four tables, every number from this one run:

1. mapping one granule of CUDA's virtual memory management (``cuMemCreate`` + ``cuMemMap`` +
   ``cuMemSetAccess``, then ``cuMemUnmap`` + ``cuMemRelease``), per granule size;
2. the churn and model-loading traces through a reserved root and through a growable root
   that starts with nothing mapped (its growth inside the timing), microseconds per pair;
3. the device memory a root holds: reserved (its limit) against growable (what it mapped);
4. putting a budget of 10 GiB of live blocks to sleep and waking it, against PyTorch copying
   the same bytes to pinned host memory and back (``cudaMemcpy``).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from gpubudget import gpu_budget
from gpubudget.backends import get_backend
from gpubudget.backends.virtual import CudaVirtualRange

from .churn import run_trace
from .traces import churn, model_loading, peak_live, replay

MiB = 2**20
GiB = 2**30


def granule_table(repeat: int) -> list[str]:
    backend: Any = get_backend("pycuda", device=0)
    rows = ["| granule | map us | unmap us | map + unmap us per MiB |", "| ---: | ---: | ---: | ---: |"]
    for granule in (2 * MiB, 8 * MiB, 32 * MiB, 64 * MiB, 128 * MiB, 512 * MiB):
        count = max(4, GiB // granule)
        maps: list[float] = []
        unmaps: list[float] = []
        for _ in range(repeat):
            memory = CudaVirtualRange(backend, count * granule, granule)
            try:
                start = time.perf_counter()
                for index in range(count):
                    memory.map(index)
                middle = time.perf_counter()
                for index in range(count):
                    memory.unmap(index)
                end = time.perf_counter()
            finally:
                memory.release()
            maps.append((middle - start) / count)
            unmaps.append((end - middle) / count)
        m, u = statistics.median(maps) * 1e6, statistics.median(unmaps) * 1e6
        rows.append(f"| {granule // MiB} MiB | {m:.1f} | {u:.1f} | {(m + u) / (granule / MiB):.2f} |")
    return rows


def _pairs(initial: int | None, trace: str) -> tuple[float, int | None]:
    with gpu_budget("16GiB", name="bench", backend="pycuda", initial=initial) as budget:
        if trace == "churn":
            warmup, timed = churn()
            seconds = run_trace(budget.allocate, budget.free, warmup, timed)
            pairs = len(timed)
        else:
            load = model_loading()
            seconds = replay(load, budget.allocate, budget.free)
            pairs = sum(1 for _, size in load if size)
        return seconds / pairs * 1e6, budget.report().mapped_peak


def _churn_peak(steps: list[tuple[int, int]]) -> int:
    """Highest sum of live sizes (256-aligned) over churn steps (each replaces its slot)."""
    live: dict[int, int] = {}
    total = peak = 0
    for slot, size in steps:
        total += (size + 255) // 256 * 256 - live.get(slot, 0)
        live[slot] = (size + 255) // 256 * 256
        peak = max(peak, total)
    return peak


def pairs_table(repeat: int) -> list[str]:
    rows = ["| trace | reserved root us/pair | growable root us/pair | growable / reserved "
            "| growable root mapped at most | trace's peak live |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for trace in ("churn", "model loading"):
        reserved, growable, mapped = [], [], 0
        for _ in range(repeat):
            reserved.append(_pairs(None, trace)[0])
            us, peak = _pairs(0, trace)
            growable.append(us)
            mapped = max(mapped, peak or 0)
        r, g = statistics.median(reserved), statistics.median(growable)
        warmup, timed = churn()
        live = peak_live(model_loading()) if trace != "churn" else _churn_peak(warmup + timed)
        rows.append(f"| {trace} | {r:.2f} | {g:.2f} | {g / r:.2f}x | {mapped / GiB:.2f} GiB | "
                    f"{live / GiB:.2f} GiB |")
    return rows


def held_table() -> list[str]:
    """A PyTorch model loaded into a 40 GiB budget: the device memory the process holds."""
    torch = importlib.import_module("torch")
    from gpubudget import torch as gbt

    rows = ["| root | limit | model's bytes charged | device memory the budget holds |",
            "| --- | ---: | ---: | ---: |"]
    for initial in (None, 0):
        torch.cuda.synchronize()
        with gpu_budget("40GiB", name="held", backend="pycuda", initial=initial) as budget:
            with gbt.allocations():
                layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
                model = torch.nn.TransformerEncoder(layer, 12, enable_nested_tensor=False).cuda()
                torch.cuda.synchronize()
            holds = budget.mapped if budget.mapped is not None else budget.limit
            rows.append(f"| {'growable (initial=0)' if initial == 0 else 'reserved'} | 40 GiB "
                        f"| {budget.used / GiB:.2f} GiB | {holds / GiB:.2f} GiB |")
            del model, layer
        torch.cuda.empty_cache()
    return rows


def sleep_table(repeat: int) -> list[str]:
    torch = importlib.import_module("torch")
    size = 10 * GiB
    rows = ["| what | seconds | GB/s |", "| --- | ---: | ---: |"]
    moves: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    again: tuple[list[float], list[float]] = ([], [])  # a second sleep, host memory kept
    for _ in range(repeat):
        for pinned, (off, on) in moves.items():
            with gpu_budget("12GiB", name="sleepy", backend="pycuda", initial=0) as budget:
                blocks = [budget.allocate(256 * MiB) for _ in range(size // (256 * MiB))]
                assert all(blocks)
                start = time.perf_counter()
                budget.offload(pinned=pinned)
                middle = time.perf_counter()
                budget.restore(keep_host=pinned)
                end = time.perf_counter()
                if pinned:
                    budget.offload()
                    second = time.perf_counter()
                    budget.restore()
                    again[0].append(second - end)
                    again[1].append(time.perf_counter() - second)
                for block in blocks:
                    budget.free(block or 0)
            off.append(middle - start)
            on.append(end - middle)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    down, up = [], []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(device)
        torch.cuda.synchronize()
        middle = time.perf_counter()
        device.copy_(host)
        torch.cuda.synchronize()
        end = time.perf_counter()
        down.append(middle - start)
        up.append(end - middle)
    del device, host
    torch.cuda.empty_cache()
    for label, times in (("offload() of 10 GiB in 40 blocks, pinned host memory", moves[True][0]),
                         ("restore(keep_host=True) from pinned host memory", moves[True][1]),
                         ("offload() again, the pinned host memory kept", again[0]),
                         ("restore() again, the pinned host memory released", again[1]),
                         ("offload(pinned=False): plain host memory", moves[False][0]),
                         ("restore() from plain host memory", moves[False][1]),
                         ("PyTorch: 10 GiB device -> pinned host (cudaMemcpy)", down),
                         ("PyTorch: 10 GiB pinned host -> device (cudaMemcpy)", up)):
        seconds = statistics.median(times)
        rows.append(f"| {label} | {seconds:.3f} | {size / seconds / 1e9:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tables", default="granules,traces,held,sleep",
                        help="which tables, comma-separated (default: all four)")
    args = parser.parse_args()
    tables: dict[str, tuple[str, Callable[[], list[str]]]] = {
        "granules": ("Mapping a granule (one handle each)", lambda: granule_table(args.repeat)),
        "traces": ("Traces through reserved and growable roots",
                   lambda: pairs_table(args.repeat)),
        "held": ("What a 40 GiB budget holds with a 12-layer model loaded", held_table),
        "sleep": ("Sleep and wake", lambda: sleep_table(args.repeat)),
    }
    for name in args.tables.split(","):
        title, table = tables[name.strip()]
        print(f"\n### {title}\n")
        print("\n".join(table()), flush=True)


if __name__ == "__main__":
    main()
