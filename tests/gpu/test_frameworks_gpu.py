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
from tests.gpu.conftest import cupy_or_skip, torch_or_skip, two_devices
from tests.helpers import finishes

MiB = 2**20



# -- CuPy ---------------------------------------------------------------------------------------


def test_cupy_arrays_are_charged_capped_and_compute() -> None:
    cp = cupy_or_skip()
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
    cp = cupy_or_skip()
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
    torch = torch_or_skip()
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
    torch = torch_or_skip()
    from gpubudget import torch as gbt

    with gpu_budget("512MiB", name="pool") as pool:
        with gpu_budget("256MiB", name="model") as model:
            with gbt.allocations():
                kept = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
                scratch = torch.ones(32 * MiB, dtype=torch.uint8, device="cuda")
            del scratch
        # the scope ended: the pool retired, its cache returned; the tensor keeps its segment
        assert model.state == "exited" and 16 * MiB <= model.used < 48 * MiB
        (usage,) = model.report().usage
        assert usage.waiting_in_use == 16 * MiB and usage.waiting_cached == model.used - 16 * MiB
        assert int(kept.sum()) == 16 * MiB
        del kept
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # PyTorch frees the segment; the next block gives it back
        with gpu_budget("64MiB", name="next"), gbt.allocations():
            assert model.report().state == "released"
        assert pool.used == 0
        settings = torch.cuda.memory._snapshot()["allocator_settings"]
        assert settings["release_lock_on_cudamalloc"] is True  # no Python under its lock
        pool.check()


def test_torch_nested_budgets_charge_the_child_and_its_ancestors() -> None:
    torch = torch_or_skip()
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
    torch = torch_or_skip()
    cp = cupy_or_skip()
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
    torch_or_skip()
    cupy_or_skip()
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


# -- real workloads: every byte of the step in the budget ----------------------------------------


def _reserved_outside(torch: Any, budget: Any) -> int:
    """Bytes PyTorch holds in segments that are not the budget's."""
    torch.cuda.synchronize()
    charged: int = sum(u.charged for u in budget.report().usage)
    return int(torch.cuda.memory_reserved()) - charged


def _train_steps(torch: Any, steps: int = 2) -> None:
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).cuda()
    for block in model.layers:  # a tensor made by a hook on the backward pass too
        block.linear1.weight.register_hook(lambda grad: grad * 1.0)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 128, 256, device="cuda")
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def test_torch_a_training_step_is_charged_whole_and_capped() -> None:
    torch = torch_or_skip()
    from gpubudget import torch as gbt

    with gpu_budget("4GiB", name="train") as budget:
        with gbt.allocations():
            before = _reserved_outside(torch, budget)
            _train_steps(torch)
            assert _reserved_outside(torch, budget) == before  # backward included
        need = budget.peak
        (usage,) = budget.report().usage
        assert usage.outside > 0  # this thread's cuBLAS workspaces, outside the budget
    torch.cuda.empty_cache()
    assert budget.report().state == "released"
    with gpu_budget(int(need * 0.8), name="tight") as tight:
        with pytest.raises(torch.OutOfMemoryError) as info:
            with gbt.allocations():
                before = _reserved_outside(torch, tight)
                _train_steps(torch)
        assert _reserved_outside(torch, tight) == before and tight.peak <= tight.limit
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "budget 'tight'" in notes, notes
    torch.cuda.empty_cache()


def test_torch_threads_route_into_one_budget_at_once() -> None:
    import threading

    torch = torch_or_skip()
    from gpubudget import torch as gbt

    errors: list[BaseException] = []
    barrier = threading.Barrier(4)
    with gpu_budget("1GiB", name="model") as model:
        def serve() -> None:
            try:
                with gbt.allocations(model):
                    barrier.wait(timeout=30)
                    a = torch.ones(1024, 1024, device="cuda")  # 4 MiB
                    assert float((a @ a).sum()) == 1024.0**3
                    barrier.wait(timeout=30)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=serve) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == [] and not any(thread.is_alive() for thread in threads)
        assert model.used >= 4 * 4 * MiB
    gbt.release_cached()
    assert model.report().state == "released"


def test_torch_library_workspaces_never_keep_a_budget() -> None:
    torch = torch_or_skip()
    from gpubudget import torch as gbt

    with gpu_budget("1GiB", name="pool") as pool:
        with gpu_budget("512MiB", name="ops") as ops:
            with gbt.allocations():
                a = torch.randn(512, 512, device="cuda")
                outs = [a @ a, torch.einsum("ij,jk->ik", a, a),
                        torch.linalg.solve(a + 512 * torch.eye(512, device="cuda"), a),
                        torch.nn.functional.linear(a.bfloat16(), a.bfloat16(),
                                                   a[0].bfloat16()),
                        torch.fft.fft(a)]
                side = torch.cuda.Stream()
                with torch.cuda.stream(side):  # a stream with no workspace yet
                    outs.append(a @ a)
                side.synchronize()
            assert "library workspaces outside budgets" in str(ops.report())
            del a, outs
        torch.cuda.synchronize()
        gbt.release_cached()
        assert ops.report().state == "released", str(ops.report())
        assert pool.used == 0


def test_cupy_a_new_budget_routes_while_a_retired_pool_still_holds_arrays() -> None:
    cp = cupy_or_skip()
    from gpubudget import cupy as gbc

    kept: list[Any] = []

    def work() -> None:
        with cp.cuda.Device(0):
            with gpu_budget("64MiB", name="first") as first:
                with gbc.allocations():
                    kept.append(cp.ones(MiB, cp.uint8))
            assert first.state == "exited"
            with gpu_budget("64MiB", name="second") as second:
                with gbc.allocations():
                    kept.append(cp.ones(MiB, cp.uint8))
                assert second.used >= MiB
            kept.clear()
            gc.collect()
            gbc.release_cached()
            assert first.report().state == second.report().state == "released"

    finishes(work, 120.0)


def test_cupy_many_threads_routing_into_budgets_never_hang() -> None:
    import threading

    cp = cupy_or_skip()
    from gpubudget import cupy as gbc

    with gpu_budget("1GiB", name="server") as server:
        def one_thread(index: int) -> None:
            with cp.cuda.Device(0), gpu_budget("64MiB", name=f"t{index}", parent=server):
                arrays = []
                for round_ in range(30):
                    with gbc.allocations():
                        arrays.append(cp.arange(1000 + round_, dtype=cp.float32) * 2)
                        if round_ % 3 == 0:
                            arrays.pop(0)
                    if round_ % 7 == 0:
                        gbc.release_cached()

        def work() -> None:
            threads = [threading.Thread(target=one_thread, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        finishes(work, 120.0)
        gc.collect()
        gbc.release_cached()
        server.check()


def test_cupy_fft_plans_are_charged_then_dropped_when_the_budget_ends() -> None:
    cp = cupy_or_skip()
    from gpubudget import cupy as gbc

    with gpu_budget("256MiB", name="pool") as pool:
        with gpu_budget("128MiB", name="spectra") as spectra:
            with gbc.allocations():
                x = cp.random.random(1 << 20).astype(cp.complex64)
                y = cp.fft.fft(x)
            (usage,) = spectra.report().usage
            assert usage.library >= 8 * MiB, usage  # the cached plan's work area
            del x, y
        gc.collect()
        gbc.release_cached()
        assert spectra.report().state == "released", str(spectra.report())
        assert pool.used == 0
