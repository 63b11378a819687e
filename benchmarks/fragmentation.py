"""Fragmentation: how much memory an allocator needs for a trace, over its peak live bytes.

    python -m benchmarks.fragmentation [--seeds 3]

For a budget (best fit in one arena) the need is the smallest limit under which the trace
runs without a denial, found by bisection to 1 MiB on the host backend. For PyTorch's caching
allocator (only where PyTorch with CUDA is installed) it is ``torch.cuda.max_memory_reserved()``
after replaying the trace through ``caching_allocator_alloc``/``delete`` from an emptied cache.
Both over the trace's peak live bytes (sizes aligned to 256); 1.00 is no waste.
"""

from __future__ import annotations

import argparse
import importlib
import warnings
from collections.abc import Callable

from .model_load import smallest_limit
from .traces import Trace, adversarial, model_loading, peak_live, replay

TRACES: dict[str, Callable[[int], Trace]] = {
    "model loading (3 models)": lambda seed: model_loading(models=3, seed=seed),
    "adversarial (two size classes, interleaved lifetimes)": lambda seed: adversarial(seed=seed),
}


def torch_reserved(trace: Trace) -> int | None:
    """Peak bytes PyTorch's caching allocator reserved for ``trace``; ``None`` without CUDA."""
    try:
        torch = importlib.import_module("torch")
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    replay(trace, torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete)
    reserved = int(torch.cuda.max_memory_reserved()) - int(base)
    torch.cuda.empty_cache()
    return reserved


def table(seeds: int) -> list[str]:
    rows = ["| trace | seed | peak live | budget arena needs | ratio | PyTorch reserved | ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for title, make in TRACES.items():
        for seed in range(seeds):
            trace = make(seed)
            peak = peak_live(trace)
            need = smallest_limit(trace)
            torch = torch_reserved(trace)
            theirs = (f"{torch / 2**30:.3f} GiB | {torch / peak:.3f}" if torch is not None
                      else "not run (no PyTorch with CUDA) | -")
            rows.append(f"| {title} | {seed} | {peak / 2**30:.3f} GiB | {need / 2**30:.3f} GiB "
                        f"| {need / peak:.4f} | {theirs} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", RuntimeWarning)
    print("\n".join(table(args.seeds)))


if __name__ == "__main__":
    main()
