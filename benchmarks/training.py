"""A PyTorch training step inside a budget, measured with PyTorch's own counters.

    python -m benchmarks.training [--models small,large] [--variants fp32,amp,hooks,compile]

For each model and variant, three runs, each in a fresh process so that no allocator state
carries over:

- *unrouted*: the training steps alone: ``torch.cuda.max_memory_allocated()`` and
  ``max_memory_reserved()`` (PyTorch's peaks) and the time of a step;
- *routed*: the same inside ``gpu_budget("64GiB")`` and ``gpubudget.torch.allocations()``
  (model made inside): the budget's peak, and the bytes PyTorch holds outside the budget's
  pools (``torch.cuda.memory_reserved()`` less the segments charged to the budget) before the
  model is made and after the last step — their growth must be 0;
- *tight*: the routed run with the limit at 80% of the routed peak: it must end in
  ``torch.OutOfMemoryError`` naming the budget, with the budget's peak within its limit and
  no growth outside it.

Models: *small* is a 6-layer ``TransformerEncoder`` (d_model 512, batch 16x256, 5 AdamW
steps); *large* a 12-layer one (d_model 1024, batch 16x512, 50 AdamW steps). Variants:
*fp32*; *amp* (bf16 autocast and a ``GradScaler``); *hooks* (forward hooks keep a copy of
each layer's output, tensor hooks scale every gradient: tensors made inside hooks, the
backward ones on the backward pass); *compile* (``torch.compile`` of a 2-layer model, where
it runs on the machine). Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any

MiB = 2**20
MODELS = {  # layers, d_model, sequence, steps
    "small": (6, 512, 256, 5),
    "large": (12, 1024, 512, 50),
}
VARIANTS = ("fp32", "amp", "hooks", "compile")


def _torch() -> Any:
    return importlib.import_module("torch")


def _model(torch: Any, name: str, variant: str) -> tuple[Any, Any, int, int]:
    layers, width, sequence, steps = MODELS[name]
    if variant == "compile":
        layers = 2
    layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True,
                                             dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).cuda()
    kept: list[Any] = []
    if variant == "hooks":
        for block in model.layers:
            block.register_forward_hook(lambda m, i, o: kept.append(o.detach().clone()))
        for parameter in model.parameters():
            parameter.register_hook(lambda grad: grad * 1.0)
    step_model = torch.compile(model) if variant == "compile" else model
    return model, step_model, sequence, steps


def _train(torch: Any, model: Any, step_model: Any, width: int, sequence: int, steps: int,
           variant: str) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda") if variant == "amp" else None
    x = torch.randn(16, sequence, width, device="cuda")
    started = time.perf_counter()
    for _ in range(steps):
        if scaler is not None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step_model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss = step_model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def run_one(name: str, variant: str, mode: str, limit: int) -> dict[str, Any]:
    """One run in this process; what it measured."""
    torch = _torch()
    width = MODELS[name][1]
    torch.cuda.init()
    torch.cuda.synchronize()
    if mode == "unrouted":
        torch.cuda.reset_peak_memory_stats()
        model, step_model, sequence, steps = _model(torch, name, variant)
        seconds = _train(torch, model, step_model, width, sequence, steps, variant)
        return {"seconds": seconds, "max_allocated": torch.cuda.max_memory_allocated(),
                "max_reserved": torch.cuda.max_memory_reserved()}
    from gpubudget import gpu_budget
    from gpubudget import torch as gbt

    result: dict[str, Any] = {"limit": limit}
    with gpu_budget(limit, name=f"{name}-{variant}", backend="pycuda") as budget:
        def outside() -> int:
            torch.cuda.synchronize()
            charged = sum(usage.charged for usage in budget.report().usage)
            return int(torch.cuda.memory_reserved()) - charged

        try:
            with gbt.allocations():
                before = outside()  # after the block made this thread's library workspaces
                torch.cuda.reset_peak_memory_stats()
                reserved_before = torch.cuda.memory_reserved()
                model, step_model, sequence, steps = _model(torch, name, variant)
                result["seconds"] = _train(torch, model, step_model, width, sequence, steps,
                                           variant)
                result["outcome"] = "ok"
        except torch.OutOfMemoryError as exc:
            notes = " ".join(getattr(exc, "__notes__", []))
            result["outcome"] = "OutOfMemoryError"
            result["names_budget"] = f"budget '{budget.name}'" in notes
            result["note"] = notes[:300]
        result["outside_growth"] = outside() - before
        result["max_reserved_growth"] = int(torch.cuda.max_memory_reserved()) - reserved_before
        result["max_allocated"] = int(torch.cuda.max_memory_allocated())
        result["peak"] = budget.peak
        result["workspaces"] = sum(usage.outside for usage in budget.report().usage)
        budget.check()
    return result


def _child(name: str, variant: str, mode: str, limit: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.training", "--child", name, variant, mode,
               str(limit)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=420,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            loaded: dict[str, Any] = json.loads(line)
            return loaded
    return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def _mib(value: Any) -> str:
    return f"{value / MiB:,.0f}" if isinstance(value, int) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "VARIANT", "MODE", "LIMIT"))
    args = parser.parse_args()
    if args.child:
        name, variant, mode, limit = args.child
        print(json.dumps(run_one(name, variant, mode, int(limit))))
        return
    print("| model | variant | run | limit MiB | budget peak MiB | PyTorch max allocated MiB "
          "| PyTorch reserved growth MiB | outside growth MiB | workspaces outside MiB "
          "| outcome | ms/step |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            plain = _child(name, variant, "unrouted", 0)
            routed = _child(name, variant, "routed", 64 << 30)
            runs = [("unrouted", plain), ("routed", routed)]
            if isinstance(routed.get("peak"), int):
                runs.append(("tight", _child(name, variant, "routed",
                                             int(routed["peak"] * 0.8))))
            for label, result in runs:
                outcome = result.get("error") or result.get("outcome", "ok")
                if result.get("outcome") == "OutOfMemoryError":
                    outcome += (" naming the budget" if result.get("names_budget")
                                else " WITHOUT the budget's name")
                seconds = result.get("seconds")
                limit = _mib(result.get("limit")) if label != "unrouted" else "-"
                grew = result.get("max_reserved_growth", result.get("max_reserved"))
                cells = [name, variant, label, limit, _mib(result.get("peak")),
                         _mib(result.get("max_allocated")), _mib(grew),
                         _mib(result.get("outside_growth")), _mib(result.get("workspaces")),
                         outcome, f"{seconds * 1e3:.1f}" if isinstance(seconds, float) else "-"]
                print("| " + " | ".join(str(cell) for cell in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
