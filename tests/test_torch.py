"""gpubudget.torch's routing, against a stand-in for PyTorch that calls the adapter's C
callbacks through their function pointers, as PyTorch does (tests/gpu/ runs the real one)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpubudget import BudgetError, gpu_budget
from gpubudget import torch as gbt
from gpubudget.units import KiB, MiB
from tests.fakes import SEGMENT, DeviceHostBackend, fake_torch
from tests.helpers import consistent, subprocess_env


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", module)
    return module


def test_segments_are_charged_and_the_report_splits_tensors_from_cache(torch: Any) -> None:
    with gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("16MiB", name="detector") as detector:
            with gbt.allocations():
                kept = torch.empty(MiB)
                scratch = torch.empty(3 * MiB)
            assert detector.used == SEGMENT + 3 * MiB and pool.used == detector.used
            del scratch  # back into PyTorch's cache: still charged
            (usage,) = detector.report().usage
            assert (usage.charged, usage.in_use, usage.cached) == (
                SEGMENT + 3 * MiB, MiB, SEGMENT + 3 * MiB - MiB)
            assert "torch: 5.00 MiB charged, 1.00 MiB in use, 4.00 MiB cached" in str(
                detector.report())
        # the scope ended: the pool is dropped and its cache returned; the tensor stays
        assert detector.used == SEGMENT and detector.state == "exited"
        del kept
        gbt.release_cached()
        assert detector.report().state == "released" and pool.used == 0
        consistent(pool)


def test_a_refused_segment_is_pytorchs_out_of_memory_with_a_note(torch: Any) -> None:
    with gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)):
        with gpu_budget("4MiB", name="small") as small:
            with pytest.raises(torch.OutOfMemoryError) as info:
                with gbt.allocations():
                    torch.empty(8 * MiB)
            notes = "\n".join(getattr(info.value, "__notes__", []))
            assert "budget 'small'" in notes and "over_limit" in notes
            (denial,) = small.report().denials
            assert denial.reason == "over_limit"
            assert denial.count == 2  # PyTorch asked again after emptying its cache


def test_nested_budgets_charge_the_child_and_its_ancestors(torch: Any) -> None:
    with gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("32MiB", name="model") as model:
            with gpu_budget("8MiB", name="head") as head:
                with gbt.allocations():
                    t = torch.empty(5 * MiB)
                assert (head.used, model.used, pool.used) == (5 * MiB,) * 3
                with gbt.allocations(model):
                    u = torch.empty(KiB)
                assert (head.used, model.used) == (5 * MiB, 5 * MiB + SEGMENT)
        del t, u
        gc.collect()
        gbt.release_cached()
        consistent(pool)


def test_errors_inside_the_callback_are_recorded_and_answered_null(torch: Any) -> None:
    with gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        original = type(pool).size_of

        def broken(self: Any, address: int) -> int:
            raise RuntimeError("registry on fire")

        type(pool).size_of = broken  # type: ignore[method-assign]
        try:
            with pytest.raises(torch.OutOfMemoryError):
                with gbt.allocations():
                    torch.empty(KiB)  # granted, then the adapter's bookkeeping fails
        finally:
            type(pool).size_of = original  # type: ignore[method-assign]
        assert any("registry on fire" in e for e in pool.report().callback_errors)
        assert pool.used == 0  # the block went back: PyTorch got a null pointer
        consistent(pool)


def test_host_memory_missing_api_and_no_budget_are_clear_errors(
        torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BudgetError, match="needs a budget"):
        with gbt.allocations():
            pass  # pragma: no cover
    with gpu_budget("1MiB", name="host", backend="host"):
        with pytest.raises(BudgetError, match="'host' is in host memory"):
            with gbt.allocations():
                pass  # pragma: no cover
    monkeypatch.setitem(sys.modules, "torch", fake_torch("2.1.0"))
    del sys.modules["torch"].cuda.use_mem_pool
    with gpu_budget("1MiB", backend=DeviceHostBackend(0)):
        with pytest.raises(ImportError, match=r"torch.cuda.use_mem_pool.*2\.1\.0.*2\.11"):
            with gbt.allocations():
                pass  # pragma: no cover


def test_interpreter_exit_with_live_tensors_is_silent(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import sys
        from tests.fakes import DeviceHostBackend, fake_torch
        torch = sys.modules["torch"] = fake_torch()
        from gpubudget import gpu_budget
        from gpubudget import torch as gbt
        pool = gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)).__enter__()
        with gbt.allocations():
            tensors = [torch.empty(2**20) for _ in range(3)]
        # at exit PyTorch frees what is left after modules are torn down
        import atexit
        atexit.register(lambda: None)
        print("done")
    """))
    env = subprocess_env()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")
