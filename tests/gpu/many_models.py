"""Several models of different sizes on one GPU, each loaded and served from its own thread in
its own budget under one pool, at once; run by ``tests/gpu/test_many_models_gpu.py`` in a
process of its own (an abort fails the test instead of ending the suite) and with
``CUBLAS_WORKSPACE_CONFIG`` set, as PyTorch's deterministic algorithms need. Prints one line,
``MANY_MODELS {json}``, that the test reads.

    python3 -m tests.gpu.many_models            # the models, compared bit for bit
    python3 -m tests.gpu.many_models --issue    # the many-models issue's own workers
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
import threading
import traceback
from typing import Any

import gpubudget
from gpubudget import gpu_budget
from gpubudget import torch as gbt

PASSES = 30
BATCH = (8, 64)
SPECS: dict[str, tuple[int, int, int, str]] = {
    # name: (d_model, heads, layers, the budget's limit)
    "small": (128, 4, 2, "256MiB"),
    "medium": (256, 8, 3, "512MiB"),
    "wide": (768, 12, 2, "1GiB"),
    "deep": (256, 8, 8, "1GiB"),
    "starved": (512, 8, 4, "8MiB"),  # its weights alone are about 50 MiB: its load fails
}
WAIT = 300.0


def default_pool_bytes(torch: Any) -> int:
    """Bytes PyTorch holds outside every private pool (segments of pool (0, 0))."""
    return sum(int(segment["total_size"]) for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0))


def side_by_side() -> dict[str, Any]:
    torch = importlib.import_module("torch")
    torch.use_deterministic_algorithms(True, warn_only=True)  # the comparison says if not
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    models: dict[str, Any] = {}
    inputs: dict[str, list[Any]] = {}
    for index, (name, (width, heads, layers, _)) in enumerate(SPECS.items()):
        torch.manual_seed(index)  # built on the CPU, in this thread: the same every run
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True,
                                                 dropout=0.0)
        models[name] = torch.nn.TransformerEncoder(layer, layers,
                                                   enable_nested_tensor=False).eval()
        generator = torch.Generator().manual_seed(100 + index)
        inputs[name] = [torch.randn(*BATCH, width, generator=generator) for _ in range(PASSES)]

    reference: dict[str, list[Any]] = {}  # unbudgeted, one model at a time
    with torch.no_grad():
        for name in SPECS:
            model = copy.deepcopy(models[name]).cuda()
            reference[name] = [model(x.cuda()).cpu() for x in inputs[name]]
            del model
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    default_before = default_pool_bytes(torch)

    start = threading.Barrier(len(SPECS))
    refused = threading.Event()
    results: dict[str, list[Any]] = {}
    refusals: dict[str, str] = {}
    problems: list[str] = []
    with gpu_budget("8GiB", name="server", backend="pycuda") as pool:
        def serve(name: str) -> None:
            try:
                start.wait(WAIT)
                with gpubudget.use(pool), gpu_budget(SPECS[name][3], name=name):
                    with gbt.allocations():
                        model = copy.deepcopy(models[name]).cuda()  # loading, at once
                        if not refused.wait(WAIT):
                            problems.append(f"{name}: the starved model never failed")
                        with torch.no_grad():  # serving on after it failed
                            results[name] = [model(x.cuda()).cpu() for x in inputs[name]]
            except torch.OutOfMemoryError as exc:
                refusals[name] = " ".join([str(exc), *getattr(exc, "__notes__", [])])
                refused.set()
            except BaseException:  # noqa: BLE001 - reported
                problems.append(f"{name}: {traceback.format_exc()}")
                refused.set()

        threads = [threading.Thread(target=serve, args=(name,), name=name) for name in SPECS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2 * WAIT)
        hung = [thread.name for thread in threads if thread.is_alive()]
        torch.cuda.synchronize()
        default_after = default_pool_bytes(torch)
        used_before_release = pool.used
        gbt.release_cached()  # the models died with their threads, after their budgets
        used_after = pool.used
        states = {child.name: child.state for child in pool.report().children}
        pool.check()
        if used_after:
            problems.append(str(pool.report()))
    equal = sorted(name for name, outputs in results.items()
                   if len(outputs) == PASSES
                   and all(torch.equal(a, b) for a, b in zip(outputs, reference[name])))
    largest_difference = {
        name: max(float((a - b).abs().max()) for a, b in zip(outputs, reference[name]))
        for name, outputs in results.items() if outputs}
    settings = torch.cuda.memory._snapshot()["allocator_settings"]
    return {"bitwise_equal": equal, "served": sorted(results), "refused": refusals,
            "largest_difference": largest_difference,
            "problems": problems, "hung": hung, "default_pool_before": default_before,
            "default_pool_after": default_after, "pool_used_before_release": used_before_release,
            "pool_used_after_release": used_after, "states": states,
            "release_lock_on_cudamalloc": settings.get("release_lock_on_cudamalloc"),
            "mempools_kept": gbt.mempools_kept(), "core": "C" if gpubudget.compiled else "pure"}


def the_issues_workers() -> dict[str, Any]:
    """Four workers as the many-models issue wrote them (it aborted in 5 s before)."""
    torch = importlib.import_module("torch")
    problems: list[str] = []
    with gpu_budget("16GiB", name="server", backend="pycuda") as pool:
        def worker(name: str, width: int, passes: int) -> None:
            try:
                with gpubudget.use(pool), gpu_budget("3GiB", name=name), gbt.allocations():
                    layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width,
                                                             batch_first=True)
                    model = torch.nn.TransformerEncoder(layer, 4).cuda().eval()
                    with torch.no_grad():
                        for _ in range(passes):
                            model(torch.randn(8, 128, width, device="cuda"))
                    torch.cuda.synchronize()
            except BaseException:  # noqa: BLE001 - reported
                problems.append(f"{name}: {traceback.format_exc()}")

        threads = [threading.Thread(target=worker, args=(f"m{i}", 256 * (i + 1), 10 * (i + 1)))
                   for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2 * WAIT)
        hung = [thread.name for thread in threads if thread.is_alive()]
        gbt.release_cached()
        used = pool.used
        pool.check()
    return {"problems": problems, "hung": hung, "pool_used_after_release": used}


def main(argv: list[str]) -> int:
    summary = the_issues_workers() if "--issue" in argv else side_by_side()
    print("MANY_MODELS " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
