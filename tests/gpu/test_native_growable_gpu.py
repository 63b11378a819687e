"""A growable root on a real device (CUDA's virtual memory management) on the C core's fast
path: once its granules are mapped, blocks are placed in C, and the memory they point to is
there (what ``benchmarks/gpu.py``'s growable row measures)."""

from __future__ import annotations

import pytest

from benchmarks.churn import grown
from gpubudget import gpu_budget
from gpubudget._core import native
from tests.gpu.conftest import cupy_or_skip
from tests.test_native import _python_calls

MiB = 2**20


@pytest.mark.skipif(native is None, reason="the C core is not built here")
def test_a_grown_root_on_the_device_places_blocks_in_c_in_mapped_memory() -> None:
    cp = cupy_or_skip()
    from gpubudget import cupy as gbc

    with gpu_budget("1GiB", initial=0, name="grown") as pool:
        grown(pool)
        mapping = pool._node.tree.mapping  # type: ignore[union-attr]
        assert mapping is not None
        maps = mapping.count
        blocks: list[int | None] = []
        sizes = [(index * 7919) % (8 * MiB) + 256 for index in range(64)]
        assert _python_calls(lambda: blocks.extend(pool.allocate(size) for size in sizes)) == []
        assert all(block is not None for block in blocks) and mapping.count == maps
        arrays = [gbc.array_on(block, size, "uint8") for block, size in
                  zip(blocks, sizes) if block is not None]
        for index, array in enumerate(arrays):
            array.fill(index % 251)
        cp.cuda.Device().synchronize()
        assert [int(array[-1]) for array in arrays] == [i % 251 for i in range(len(arrays))]
        del arrays
        cp.cuda.Device().synchronize()
        assert _python_calls(lambda: [pool.free(block) for block in blocks if block]) == []
        assert pool.used == 0
        pool.check()
