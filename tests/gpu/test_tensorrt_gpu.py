"""TensorRT's async allocator with real CUDA streams (run on the H200 by scripts/gpu-check.sh).

No TensorRT runs there (TensorRT-RTX refuses compute capability 9.0, and full TensorRT cannot
be installed), so the allocator is driven through the stand-in bindings of
tests/trt_standin.c — NVIDIA's object layout, TensorRT 10's argument order, an order that
cannot be established, or frees that lose their stream (a stream-0 event would not wait for
a non-blocking stream A: the block must be freed on A) — built there with gcc. A kernel on stream A holds its block until the
test opens a gate in pinned memory: no timing assumption.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget import tensorrt as gbt
from tests.gpu.test_pycuda_gpu import GATE, MiB
from tests.trampoline import Trampoline
from tests.trt_standin import build


@pytest.mark.parametrize("variant", ["stream_third", "drops_stream", "drops_free_stream"])
def test_a_block_freed_on_a_busy_stream_is_never_handed_to_another(
        variant: str, tmp_path: Path) -> None:
    cp: Any = pytest.importorskip("cupy")
    import numpy as np

    module = build(variant, tmp_path)
    known = gbt.argument_order(module).known
    assert known == (variant != "drops_stream")  # drops_free_stream: frees on A, remembered
    kernel = cp.RawKernel(GATE, "gate_fill")
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    gate_memory = cp.cuda.alloc_pinned_memory(4)
    gate = np.frombuffer(gate_memory, np.int32, 1)
    gate[0] = 0
    size = 4 * MiB
    with gpu_budget("64MiB", name="trt-streams") as budget:
        cpp = Trampoline(gbt.allocator(trt_module=module))
        block = cpp.allocate_async(size, 256, 1, a.ptr)  # flags 1 (RESIZABLE): not a stream
        assert block is not None
        taken = []
        try:
            with a:  # A writes into the block once the gate opens
                kernel((1,), (256,), (cp.uint64(gate_memory.ptr), cp.uint64(block),
                                      cp.uint64(size), cp.uint8(0xAA)))
            assert cpp.deallocate_async(block, a.ptr)
            other = cpp.allocate_async(size, 256, 1, b.ptr)
            assert other is not None and other != block  # B must not get it while A runs
            taken.append(other)
            same = cpp.allocate_async(size, 256, 1, a.ptr)
            assert same is not None
            taken.append(same)
            assert (same == block) == known  # reused on A at once only when A is known
        finally:
            gate[0] = 1
        a.synchronize()
        for address in taken:
            assert cpp.deallocate_async(address, b.ptr)
        b.synchronize()
