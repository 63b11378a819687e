"""CuPy and PyTorch routed into budgets, on a real device."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpubudget import AllocationDenied, gpu_budget
from tests.gpu.conftest import two_devices

MiB = 2**20


def _cp() -> Any:
    return pytest.importorskip("cupy")


def _torch() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    return torch


# -- CuPy ---------------------------------------------------------------------------------------


def test_cupy_arrays_are_charged_capped_and_compute() -> None:
    cp = _cp()
    from gpubudget import cupy as gbc

    outside_before = cp.get_default_memory_pool().used_bytes()
    with gpu_budget("256MiB", name="pool") as pool:
        with gpu_budget("64MiB", name="pre") as pre:
            with gbc.allocations():
                x = cp.arange(4 * MiB, dtype=cp.float32)  # 16 MiB
                y = x * 2
                total = float(y.sum())
                assert pre.used >= 32 * MiB and pool.used == pre.used
                with pytest.raises(cp.cuda.memory.OutOfMemoryError) as info:
                    cp.empty(64 * MiB, cp.uint8)
            z = cp.ones(MiB, cp.uint8)  # outside the block: CuPy's own pool
            (usage,) = pre.report().usage
            assert usage.charged == pre.used and 32 * MiB <= usage.in_use <= usage.charged
        assert total == pytest.approx(float(4 * MiB) * (4 * MiB - 1))
        assert isinstance(info.value, AllocationDenied) and "'pre'" in str(info.value)
        assert cp.get_default_memory_pool().used_bytes() > outside_before
        del x, y
        gc.collect()
        gbc.release_cached()  # the arrays' chunks, back from the pool's cache
        assert pre.report().state == "released" and pool.used == 0
        del z
        pool.check()


def test_cupy_arrays_outlive_the_block_and_nest() -> None:
    cp = _cp()
    from gpubudget import cupy as gbc

    with gpu_budget("256MiB", name="pool") as pool:
        with gpu_budget("128MiB", name="model") as model:
            with gpu_budget("32MiB", name="head") as head:
                with gbc.allocations():
                    a = cp.zeros(8 * MiB, cp.uint8)
            assert (head.used, model.used, pool.used) == (8 * MiB,) * 3
        assert head.state == "exited"
        a += 1
        assert int(a.sum()) == 8 * MiB
        del a
        gc.collect()
        gbc.release_cached()
        assert head.report().state == "released"


# -- PyTorch ------------------------------------------------------------------------------------


def test_torch_tensors_are_charged_capped_and_compute() -> None:
    torch = _torch()
    from gpubudget import torch as gbt

    with gpu_budget("1GiB", name="pool") as pool:
        with gpu_budget("256MiB", name="detector") as detector:
            with gbt.allocations():
                a = torch.randn(1024, 1024, device="cuda")  # 4 MiB
                b = a @ a
                assert torch.allclose(b, (a.double() @ a.double()).float(), atol=1e-2)
                assert detector.used >= 8 * MiB and pool.used == detector.used
            with pytest.raises(torch.OutOfMemoryError) as info:
                with gbt.allocations():
                    torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
            c = torch.empty(MiB, dtype=torch.uint8, device="cuda")  # not charged
            used = detector.used
            (usage,) = detector.report().usage
            assert usage.source == "torch" and usage.charged == used
            assert 0 < usage.in_use <= usage.charged
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "budget 'detector'" in notes, notes
        assert detector.report().denials[0].reason == "over_limit"
        del a, b
        torch.cuda.synchronize()
        del c


def test_torch_tensors_outlive_the_blocks_then_the_budget_releases() -> None:
    torch = _torch()
    from gpubudget import torch as gbt

    with gpu_budget("512MiB", name="pool") as pool:
        with gpu_budget("256MiB", name="model") as model:
            with gbt.allocations():
                kept = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
                scratch = torch.ones(32 * MiB, dtype=torch.uint8, device="cuda")
            del scratch
        # the scope ended: the pool is dropped, its cache returned; the tensor keeps its segment
        assert model.state == "exited" and 16 * MiB <= model.used < 48 * MiB
        assert int(kept.sum()) == 16 * MiB
        del kept
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        assert model.report().state == "released" and pool.used == 0
        pool.check()


def test_torch_nested_budgets_charge_the_child_and_its_ancestors() -> None:
    torch = _torch()
    from gpubudget import torch as gbt

    with gpu_budget("512MiB", name="pool") as pool:
        with gpu_budget("256MiB", name="model") as model:
            with gpu_budget("64MiB", name="head") as head:
                with gbt.allocations():
                    t = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
                assert head.used >= 20 * MiB and model.used == head.used == pool.used
        del t
        torch.cuda.empty_cache()


@two_devices
def test_torch_and_cupy_on_the_second_device() -> None:
    torch = _torch()
    cp = _cp()
    from gpubudget import cupy as gbc
    from gpubudget import torch as gbt

    with cp.cuda.Device(1):
        with gpu_budget("256MiB", name="one", device=1) as one:
            torch.cuda.set_device(1)
            try:
                with gbt.allocations():
                    t = torch.ones(4 * MiB, dtype=torch.uint8, device="cuda:1")
                with gbc.allocations():
                    c = cp.ones(4 * MiB, cp.uint8)
                assert one.used >= 8 * MiB
                assert int(t.sum()) + int(c.sum()) == 8 * MiB
            finally:
                torch.cuda.set_device(0)
            del t, c
            gc.collect()
            torch.cuda.synchronize(1)
            torch.cuda.empty_cache()


def test_interpreter_exit_with_live_tensors_and_arrays_is_silent(tmp_path: Path) -> None:
    _torch()
    _cp()
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import cupy as cp, torch
        from gpubudget import gpu_budget, cupy as gbc, torch as gbt
        pool = gpu_budget("512MiB", name="pool", backend="pycuda").__enter__()
        with gbt.allocations():
            tensors = [torch.ones(2**20, device="cuda") for _ in range(4)]
        with gbc.allocations():
            arrays = [cp.ones(2**20) for _ in range(4)]
        print("done")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")
