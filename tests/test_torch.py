"""gpubudget.torch's routing, against a stand-in for PyTorch that calls the adapter's C
callbacks through their function pointers and routes pools as PyTorch 2.11 does
(tests/gpu/ runs the real one)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget import BudgetError, gpu_budget
from gpubudget import torch as gbt
from gpubudget.units import KiB, MiB
from tests.fake_torch import assert_nothing_would_have_aborted, install
from tests.fakes import LT_WORKSPACE, SEGMENT, WORKSPACE, DeviceHostBackend, fake_torch
from tests.helpers import consistent, subprocess_env


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    module = install(monkeypatch)
    yield module
    assert_nothing_would_have_aborted(module)


def outside(torch: Any) -> int:
    """Bytes PyTorch holds in its default pool (outside every private pool)."""
    return sum(entry["total_size"] for entry in torch.default.snapshot())


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
            assert usage.outside == WORKSPACE + LT_WORKSPACE  # made at entry, not charged
            assert "torch: 5.00 MiB charged, 1.00 MiB in use, 4.00 MiB cached" in str(
                detector.report())
        # the scope ended: the pool is dropped and its cache returned; the tensor stays
        assert detector.used == SEGMENT and detector.state == "exited"
        del kept
        gbt.release_cached()
        assert detector.report().state == "released" and pool.used == 0
        consistent(pool)


def test_the_backward_pass_runs_on_the_calling_thread_and_is_charged(torch: Any) -> None:
    before = outside(torch)
    torch.backward(MiB)  # unrouted: on PyTorch's engine thread
    assert outside(torch) == before + SEGMENT
    before = outside(torch)
    with gpu_budget("64MiB", name="train", backend=DeviceHostBackend(0)) as train:
        with gbt.allocations():
            activations = torch.empty(3 * MiB)
            grads = torch.backward(5 * MiB)
            weights = torch.matmul()
        assert train.used == 3 * MiB + 5 * MiB + SEGMENT
        assert outside(torch) == before  # nothing of the step outside the budget
        assert torch._C._is_multithreading_enabled()  # the thread's setting is back
        del activations, grads, weights
    gbt.release_cached()
    assert train.report().state == "released"


def test_a_refused_segment_is_pytorchs_out_of_memory_naming_the_refusal_that_raised(
        torch: Any) -> None:
    with gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)):
        with gpu_budget("4MiB", name="small") as small:
            with gbt.allocations():
                with pytest.raises(torch.OutOfMemoryError):
                    torch.empty(40 * MiB)  # the largest denial, caught here
            with pytest.raises(torch.OutOfMemoryError) as info:
                with gbt.allocations():
                    torch.empty(6 * MiB)
            notes = "\n".join(getattr(info.value, "__notes__", []))
            assert "budget 'small'" in notes and "(over_limit)" in notes, notes
            assert "6.00 MiB aligned" in notes and "40" not in notes, notes
            (denial,) = small.report().denials
            assert denial.reason == "over_limit"
            assert denial.count == 2  # refused once each: PyTorch does not ask again


def test_a_step_over_the_limit_fails_and_nothing_goes_outside(torch: Any) -> None:
    before = outside(torch)
    with gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)):
        with gpu_budget("8MiB", name="tight") as tight:
            with pytest.raises(torch.OutOfMemoryError):
                with gbt.allocations():
                    kept = [torch.empty(3 * MiB), torch.empty(3 * MiB)]
                    torch.backward(3 * MiB)  # the gradients would go over the limit
            assert tight.peak <= tight.limit
            del kept
    assert outside(torch) == before


def test_nested_budgets_charge_the_child_and_its_ancestors(torch: Any) -> None:
    with gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("32MiB", name="model") as model:
            with gbt.allocations(model):
                with gpu_budget("8MiB", name="head") as head:
                    with gbt.allocations():
                        t = torch.empty(5 * MiB)
                    assert (head.used, model.used, pool.used) == (5 * MiB,) * 3
                    u = torch.empty(KiB)  # the outer block routes again: model's pool
                assert (head.used, model.used) == (5 * MiB, 5 * MiB + SEGMENT)
        del t, u
        gc.collect()
        gbt.release_cached()
        consistent(pool)


def test_threads_route_into_one_budget_at_once(torch: Any) -> None:
    """PyTorch lets one thread at a time route into a pool: each thread gets its own."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)
    held: list[Any] = []
    with gpu_budget("256MiB", name="model", backend=DeviceHostBackend(0)) as model:
        route = gbt.allocations(model)  # one object, entered by every thread

        def serve() -> None:
            try:
                with route:
                    barrier.wait(timeout=120)
                    held.append(torch.empty(3 * MiB))
                    barrier.wait(timeout=120)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        with gbt.allocations(model):  # this thread routes too, meanwhile
            threads = [threading.Thread(target=serve) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads) and errors == []
        assert model.used == 4 * 3 * MiB and len(held) == 4
        del held[:]
    gbt.release_cached()
    assert model.report().state == "released"


def test_library_workspaces_stay_outside_and_never_pin_a_budget(torch: Any) -> None:
    with gpu_budget("256MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("128MiB", name="model") as model:
            with gbt.allocations():
                out = torch.matmul()  # cuBLAS: its workspace was made before routing
            assert model.used == SEGMENT
            del out
        assert model.report().state == "released"
        with gpu_budget("128MiB", name="streams") as streams:
            with gbt.allocations():
                with torch.cuda.stream(7):  # a stream without a workspace yet
                    out = torch.matmul()
            assert streams.used == WORKSPACE + SEGMENT  # that one was made inside
            del out
        assert streams.report().state == "released"  # cleared when the pool retired
        assert pool.used == 0
        consistent(pool)
    report_line = f"library workspaces outside budgets: {(WORKSPACE + LT_WORKSPACE) // MiB}.00 MiB"
    with gpu_budget("64MiB", name="again", backend=DeviceHostBackend(0)) as again:
        with gbt.allocations():
            kept = torch.empty(KiB)
        assert report_line in str(again.report())
        del kept


def test_workspaces_are_made_outside_budgets_under_the_driver_door(
        torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # under the driver door the workspaces' own driver allocations must be charged to no
    # budget (a reserved root would refuse them: seen on the H200, torch.OutOfMemoryError at
    # routing's entry); the door's outside_budgets() is entered around them
    import contextlib

    from gpubudget import door

    inside: list[bool] = []
    seen: list[bool] = []

    @contextlib.contextmanager
    def outside_budgets() -> Iterator[None]:
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(door, "outside_budgets", outside_budgets)
    handle = torch._C._cuda_getCurrentBlasHandle

    def seeing() -> Any:
        seen.append(bool(inside))
        return handle()

    monkeypatch.setattr(torch._C, "_cuda_getCurrentBlasHandle", seeing)
    with gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)):
        with gbt.allocations():
            kept = torch.empty(KiB)
        del kept
    assert seen == [True]


def test_release_cached_returns_the_cache_of_idle_pools(torch: Any) -> None:
    with gpu_budget("64MiB", name="server", backend=DeviceHostBackend(0)) as server:
        with gbt.allocations():
            scratch = torch.empty(6 * MiB)
        del scratch
        assert server.used == 6 * MiB  # cached by PyTorch, still charged
        gbt.release_cached()
        assert server.used == 0
        with gbt.allocations():  # a new pool is made when needed
            kept = torch.empty(KiB)
        assert server.used == SEGMENT
        del kept
    gbt.release_cached()


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
    old = fake_torch("2.1.0")
    del old._C._cuda_beginAllocateCurrentThreadToPool
    monkeypatch.setitem(sys.modules, "torch", old)
    with gpu_budget("1MiB", backend=DeviceHostBackend(0)):
        with pytest.raises(ImportError, match=r"_cuda_beginAllocateCurrentThreadToPool.*"
                                              r"2\.1\.0.*2\.11"):
            with gbt.allocations():
                pass  # pragma: no cover


def test_an_exit_in_another_thread_is_refused(torch: Any) -> None:
    with gpu_budget("1MiB", backend=DeviceHostBackend(0)):
        route = gbt.allocations()
        route.__enter__()
        failed: list[BaseException] = []

        def leave() -> None:
            try:
                route.__exit__(None, None, None)
            except BaseException as exc:  # noqa: BLE001 - checked below
                failed.append(exc)

        thread = threading.Thread(target=leave)
        thread.start()
        thread.join()
        assert len(failed) == 1 and "did not enter it" in str(failed[0])
        route.__exit__(None, None, None)


def test_interpreter_exit_with_live_tensors_is_silent(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import sys
        from tests.fakes import DeviceHostBackend, fake_torch
        torch = sys.modules["torch"] = fake_torch(abort=True)  # aborts as PyTorch does
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
