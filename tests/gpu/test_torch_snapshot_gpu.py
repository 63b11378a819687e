"""A real PyTorch memory snapshot (``torch.cuda.memory._dump_snapshot``) opened by the
viewer: what the CPU tests build by hand after PyTorch's documented format, PyTorch writes
here. Set ``GPUBUDGET_VIEWER_SHOTS`` to a folder to keep the snapshot and its page."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gpubudget.cli import main
from gpubudget.viewer import write_page
from gpubudget.viewer.torchsnap import model_from_torch_snapshot
from tests.gpu.conftest import torch_or_skip

MiB = 2**20


def test_a_real_snapshot_opens_in_the_viewer(tmp_path: Path) -> None:
    torch = torch_or_skip()
    memory = torch.cuda.memory
    tagged = hasattr(memory, "_set_memory_metadata")  # newer PyTorch: a label per block

    def load_weights() -> object:
        return torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")

    def scratch() -> None:
        temp = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        del temp

    path = tmp_path / "snapshot.pickle"
    memory._record_memory_history(max_entries=100_000)
    try:
        weights = load_weights()
        scratch()
        if tagged:
            memory._set_memory_metadata("cache")
        cache = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        if tagged:
            memory._set_memory_metadata("")
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            pooled = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(2**50, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        else:  # pragma: no cover - a device of a pebibyte
            raise AssertionError("a pebibyte was granted")
        torch.cuda.synchronize()
        memory._dump_snapshot(str(path))
    finally:
        memory._record_memory_history(enabled=None)
    model = model_from_torch_snapshot(path)
    device = torch.cuda.current_device()
    names = [b.name for b in model.budgets]
    assert f"cuda:{device}" in names and any(name.startswith("pool (") for name in names)
    sizes = {int(size): k for k, size in enumerate(model.block_size)  # allocated while
             if model.block_from[k] >= 0}  # recording (not what earlier tests left)
    big = sizes[64 * MiB]
    assert model.block_to[big] == -1  # live in the snapshot
    frames = [model.frames[f] for f in model.stacks[model.block_stack[big]]]
    assert frames[-1].endswith("in load_weights") and any("test_torch_snapshot_gpu.py" in f
                                                          for f in frames)
    temp = sizes[8 * MiB]
    assert model.block_to[temp] >= 0 and model.block_end[temp] >= model.block_start[temp]
    assert model.budgets[model.block_budget[sizes[4 * MiB]]].name.startswith("pool (")
    if tagged:
        assert model.tags[model.block_tag[sizes[16 * MiB]]] == "cache"
    assert any(nbytes == 2**50 and reason.startswith("out of memory")
               for _, _, nbytes, reason, _ in model.denials)
    assert model.budgets[names.index(f"cuda:{device}")].peak >= 84 * MiB
    page = tmp_path / "snapshot.html"
    assert main(["view", str(path), "-o", str(page)]) == 0
    write_page(model, tmp_path / "api.html")
    print(f"snapshot: {path.stat().st_size:,} bytes, {len(model.times):,} actions, "
          f"{len(model.block_size):,} blocks, {len(model.denials)} denials; "
          f"page {page.stat().st_size:,} bytes")
    keep = os.environ.get("GPUBUDGET_VIEWER_SHOTS")
    if keep:
        os.makedirs(keep, exist_ok=True)
        for name in ("snapshot.pickle", "snapshot.html"):
            shutil.copy(tmp_path / name, os.path.join(keep, name))
    del weights, cache, pooled, pool
