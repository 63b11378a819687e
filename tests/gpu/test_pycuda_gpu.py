"""The PyCUDA backend on a real device (run by scripts/gpu-check.sh on the H200)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from gpubudget import BudgetError, gpu_budget
from gpubudget.backends import get_backend

MiB = 2**20


def _cuda() -> Any:
    import pycuda.driver as cuda

    return cuda


def _cp() -> Any:
    return pytest.importorskip("cupy")


def _read(address: int, nbytes: int) -> bytes:
    cuda = _cuda()
    out = bytearray(nbytes)
    buffer = (ctypes.c_char * nbytes).from_buffer(out)
    cuda.memcpy_dtoh(buffer, address)
    return bytes(out)


def test_root_is_one_allocation_in_the_primary_context() -> None:
    cuda = _cuda()
    backend: Any = get_backend("pycuda")
    free_before, _ = cuda.mem_get_info()
    with gpu_budget("1GiB", name="root") as root:
        free_during, _ = cuda.mem_get_info()
        assert free_before - free_during >= 2**30  # reserved at entry, at once
        block = root.allocate(MiB)
        assert block is not None
        driver = backend.driver
        context = ctypes.c_void_p()
        primary = ctypes.c_void_p()
        # CU_POINTER_ATTRIBUTE_CONTEXT = 1
        assert driver.cuPointerGetAttribute(ctypes.byref(context), 1, block) == 0
        assert driver.cuDevicePrimaryCtxRetain(ctypes.byref(primary), 0) == 0
        assert context.value == primary.value
        assert free_during - cuda.mem_get_info()[0] < MiB  # the block came from the reservation
        root.free(block)
    assert cuda.mem_get_info()[0] >= free_during + 2**30 - 64 * MiB  # given back


def test_patterns_in_every_live_block_survive() -> None:
    cuda = _cuda()
    import random

    rng = random.Random(1)
    with gpu_budget("256MiB", name="patterns") as root:
        live: dict[int, tuple[int, int]] = {}
        for step in range(400):
            if live and rng.random() < 0.4:
                address = rng.choice(list(live))
                size, byte = live.pop(address)
                assert _read(address, size) == bytes([byte]) * size
                assert root.free(address)
            else:
                size = rng.randrange(1, 2 * MiB)
                new = root.allocate(size)
                if new is not None:
                    byte = step % 255 + 1
                    cuda.memset_d8(new, byte, size)
                    live[new] = (size, byte)
        cuda.Context.synchronize()
        for address, (size, byte) in live.items():
            assert _read(address, size) == bytes([byte]) * size
            root.free(address)
        root.check()


def test_cupy_array_on_a_budget_block_computes() -> None:
    cp = _cp()
    from gpubudget import cupy as gbc

    with gpu_budget("64MiB", name="cupy") as budget:
        x = gbc.empty((1000, 1000), "float32", tag="x")
        x[:] = cp.arange(1000, dtype=cp.float32)
        assert float(x.sum()) == pytest.approx(1000 * 999 * 1000 / 2)
        assert budget.used == 4_000_000 + (-4_000_000 % 256)
        y = x @ cp.ones((1000, 1), dtype=cp.float32)
        assert float(y[0, 0]) == pytest.approx(999 * 1000 / 2)
        del x
        assert budget.used == 0  # freed back when the array died
        with pytest.raises(cp.cuda.memory.OutOfMemoryError, match="'cupy'.*refused"):
            gbc.empty((100 * MiB,), "uint8")


def test_limits_nesting_and_reserve_with_real_memory() -> None:
    with gpu_budget("256MiB", name="pool") as pool:
        with gpu_budget("128MiB", name="vip", reserve="64MiB") as vip:
            a = vip.allocate(32 * MiB)
        with gpu_budget("256MiB", name="other") as other:
            assert other.allocate(200 * MiB) is None  # 64 MiB stay set aside for vip
            b = other.allocate(192 * MiB)
        c = vip.allocate(32 * MiB)
        assert None not in (a, b, c)
        assert pool.used == 256 * MiB and vip.allocate(1) is None
        for budget, block in ((vip, a), (other, b), (vip, c)):
            assert block is not None and budget.free(block)
    assert pool.state == "released"


def test_root_larger_than_the_device_raises_with_free_and_total() -> None:
    cuda = _cuda()
    _, total = cuda.mem_get_info()
    with pytest.raises(BudgetError) as info:
        with gpu_budget(total * 2, name="too-big"):
            pass  # pragma: no cover
    assert "free of" in str(info.value) and "total" in str(info.value)


GATE = r"""
extern "C" __global__ void gate_fill(volatile int* gate, unsigned char* p, size_t n,
                                     unsigned char v) {
    if (threadIdx.x == 0) {
        long long start = clock64();  // waits for the host to open the gate (60 s at most)
        while (*gate == 0 && clock64() - start < 120000000000LL) { }
    }
    __syncthreads();
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) p[i] = v;
}
"""


def test_stream_ordered_reuse_waits_for_the_freeing_stream() -> None:
    """A kernel on stream A holds the block until the test opens a gate in pinned host
    memory: no timing assumption, the work on A is unfinished for as long as we say."""
    cp = _cp()
    import numpy as np

    kernel = cp.RawKernel(GATE, "gate_fill")
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    gate_memory = cp.cuda.alloc_pinned_memory(4)
    gate = np.frombuffer(gate_memory, np.int32, 1)
    gate[0] = 0
    size = 4 * MiB
    with gpu_budget("64MiB", name="streams") as budget:
        block = budget.allocate(size, stream=a.ptr)
        assert block is not None
        try:
            with a:  # A writes 0xAA into the block once the gate opens
                kernel((1,), (256,), (cp.uint64(gate_memory.ptr), cp.uint64(block),
                                      cp.uint64(size), cp.uint8(0xAA)))
            assert budget.free(block, stream=a.ptr)
            other = budget.allocate(size, stream=b.ptr)
            assert other is not None and other != block  # B must not get A's block yet
            same = budget.allocate(size, stream=a.ptr)
            assert same == block  # the same stream reuses it at once: ordered after A's work
            with a:
                kernel((1,), (256,), (cp.uint64(gate_memory.ptr), cp.uint64(same),
                                      cp.uint64(size), cp.uint8(0x55)))
        finally:
            gate[0] = 1
        a.synchronize()
        assert _read(same, size) == b"\x55" * size  # the first kernel's write came first
        budget.free(same, stream=a.ptr)
        a.synchronize()
        again = budget.allocate(size, stream=b.ptr)
        assert again is not None  # once A's work is done anyone may have the block
        budget.free(other)
        budget.free(again)


def test_resize_moves_data_on_the_device() -> None:
    cuda = _cuda()
    with gpu_budget("64MiB", name="resize") as budget:
        block = budget.allocate(MiB)
        blocker = budget.allocate(MiB)
        assert block is not None and blocker is not None
        cuda.memset_d8(block, 0x3C, MiB)
        moved = budget.resize(block, 8 * MiB)
        assert moved is not None and moved != block
        assert _read(moved, MiB) == b"\x3c" * MiB
        budget.free(moved)
        budget.free(blocker)


def test_exit_with_live_budgets_and_blocks_is_silent(tmp_path: Any) -> None:
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        from gpubudget import gpu_budget
        pool = gpu_budget("512MiB", name="pool", backend="pycuda").__enter__()
        child = gpu_budget("128MiB", name="child").__enter__()
        blocks = [child.allocate(1 << 20) for _ in range(16)]
        assert all(blocks)
        with gpu_budget("64MiB", name="closed") as closed:
            kept = closed.allocate(1 << 20)
        print("done")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")


def test_report_shows_device_memory_taken_outside_budgets() -> None:
    cp = _cp()
    with gpu_budget("256MiB", name="seen") as budget:
        assert budget.report().outside_bytes is not None
        outside = cp.cuda.runtime.malloc(512 * MiB)  # e.g. TensorRT's or cuBLAS's own memory
        during = budget.report().outside_bytes
    after = budget.report().outside_bytes
    cp.cuda.runtime.free(outside)
    assert during is not None and 512 * MiB <= during < 600 * MiB
    assert after is not None and 512 * MiB <= after < 600 * MiB
    assert "taken outside budgets" in str(budget.report())


def test_a_free_on_the_legacy_stream_from_a_thread_without_a_context() -> None:
    """TensorRT's and other libraries' threads may have no CUDA context current: the legacy
    stream (0) must be asked about and recorded in the budget's device's context. Before, the
    event's record failed there (the free refused) and its handle was recycled twice, and
    two events later shared one handle (a segfault at exit, seen in the soak on the H200)."""
    import threading

    cp = _cp()
    import numpy as np

    kernel = cp.RawKernel(GATE, "gate_fill")
    b = cp.cuda.Stream(non_blocking=True)
    gate_memory = cp.cuda.alloc_pinned_memory(4)
    gate = np.frombuffer(gate_memory, np.int32, 1)
    gate[0] = 0
    size = 4 * MiB
    with gpu_budget("64MiB", name="legacy") as budget:
        block = budget.allocate(size)
        assert block is not None
        freed: list[bool] = []
        try:
            with cp.cuda.Stream.null:  # the legacy stream holds the block until the gate opens
                kernel((1,), (256,), (cp.uint64(gate_memory.ptr), cp.uint64(block),
                                      cp.uint64(size), cp.uint8(0xAA)))
            thread = threading.Thread(target=lambda: freed.append(budget.free(block, stream=0)))
            thread.start()
            thread.join(60)
            assert freed == [True]
            other = budget.allocate(size, stream=b.ptr)
            assert other is not None and other != block  # not before the legacy stream's work
        finally:
            gate[0] = 1
        cp.cuda.Stream.null.synchronize()
        again = budget.allocate(size, stream=b.ptr)
        assert again is not None
        budget.free(other)
        budget.free(again)
    from gpubudget.backends.pycuda import PyCudaBackend

    backend = get_backend("pycuda", device=0)
    assert isinstance(backend, PyCudaBackend)
    events = backend._events
    assert len(events) == len(set(events)), "an event handle was recycled twice"
