"""The Numba and cuda.core doors on a GPU, with the real packages: the examples of
docs/numba.md and docs/cuda_core.md run as a reader runs them, a Numba kernel and cuda.core's
copies write into budget blocks, and cuda.core's stream-ordered frees hold with real streams.
Each case runs in a fresh process: Numba takes its memory manager before its first context."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_examples import ROOT, blocks
from tests.helpers import subprocess_env

THIS = "tests/gpu/test_doors_gpu.py"


def page_code(name: str) -> str:
    """The page's Python blocks that run here or that this test checks, in order."""
    return "\n".join(block.text for block in blocks(ROOT / "docs" / name)
                     if block.language == "python"
                     and (block.runs_here or block.checked_by == THIS))


def run(code: str, tmp_path: Path) -> list[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path,
                            env=subprocess_env(GPUBUDGET_BACKEND="pycuda",
                                               GPUBUDGET_LEDGER_DIR=str(tmp_path / "ledger"),
                                               PYTHONPATH=os.pathsep.join(
                                                   [str(ROOT), *os.environ.get("PYTHONPATH", "")
                                                    .split(os.pathsep)]).rstrip(os.pathsep)))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


@pytest.mark.parametrize("page, module, printed", [
    ("numba.md", "numba.cuda", ["4194304", "True", "over_limit stencil"]),
    ("cuda_core.md", "cuda.core", ["8388608", "over_limit decoder", "1"]),
])
def test_the_pages_examples_run_on_a_gpu(page: str, module: str, printed: list[str],
                                         tmp_path: Path) -> None:
    pytest.importorskip(module)
    assert run(page_code(page), tmp_path) == printed


NUMBA_KERNEL = """
import numpy as np
from numba import cuda
import gpubudget.numba
from gpubudget import gpu_budget

cuda.set_memory_manager(gpubudget.numba.BudgetMemoryManager)

@cuda.jit
def fill(out, value):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value + i

with gpu_budget("16MiB", name="kernel") as budget:
    out = cuda.device_array(1 << 20, dtype=np.int32)
    start = out.device_ctypes_pointer.value
    print(budget.owner_of(start) is budget)
    fill[(1 << 20) // 256, 256](out, 7)
    host = out.copy_to_host()
    print(bool((host == np.arange(1 << 20, dtype=np.int32) + 7).all()))
    outside = cuda.device_array(1024, dtype=np.int32)  # Numba's own, not the budget's
print(budget.owner_of(outside.device_ctypes_pointer.value) is None)
del out, host
cuda.current_context().memory_manager.deallocations.clear()
print(budget.used)
"""


NUMBA_ALONE = """
from numba import cuda

@cuda.jit
def one(out):
    out[0] = 1

one[1, 1](cuda.device_array(1))
"""


def test_a_numba_kernel_writes_into_a_budget_block(tmp_path: Path) -> None:
    pytest.importorskip("numba.cuda")
    alone = subprocess.run([sys.executable, "-c", NUMBA_ALONE], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    if alone.returncode != 0:  # Numba itself, without gpubudget (numba-cuda beside numpy 2.5)
        pytest.skip("Numba cannot compile a kernel here, without gpubudget: "
                    + (alone.stderr.strip().splitlines() or ["?"])[-1])
    assert run(NUMBA_KERNEL, tmp_path) == ["True", "True", "True", "0"]


CUDA_CORE_STREAMS = """
import numpy as np
from cuda.core import Device
from gpubudget import gpu_budget
from gpubudget import cuda_core as gbcc

device = Device(0)
device.set_current()
first, second = device.create_stream(), device.create_stream()
with gpu_budget("64MiB", name="streams") as budget:
    mr = gbcc.resource()
    print(mr.device_id == 0, mr.is_device_accessible, mr.is_host_accessible)
    data = np.arange(1 << 20, dtype=np.uint8)
    block = mr.allocate(data.nbytes, stream=first)
    from cuda.core import Buffer
    host = Buffer.from_handle(data.ctypes.data, data.nbytes)
    block.copy_from(host, stream=first)
    back = np.zeros_like(data)
    block.copy_to(Buffer.from_handle(back.ctypes.data, back.nbytes), stream=first)
    first.sync()
    print(bool((back == data).all()))
    address = int(block.handle)
    block.close()                                         # freed on `first`
    again = mr.allocate(data.nbytes, stream=first)        # the same stream: the same block
    print(int(again.handle) == address)
    again.close(stream=second)                            # freed on `second` this time
    second.sync()
    empty = mr.allocate(0, stream=first)                  # no block for an empty buffer
    print(empty.size, budget.used, budget.report().allocations)
    empty.close()
print(budget.used)
"""


def test_cuda_core_copies_and_stream_ordered_frees(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    assert run(CUDA_CORE_STREAMS, tmp_path) == ["True True False", "True", "True", "0 0 2",
                                                "0"]
