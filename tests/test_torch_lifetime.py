"""gpubudget.torch when budgets begin and end while other threads route: no MemPool is ever
destroyed (PyTorch 2.11 aborts the process when one is destroyed while a thread routes), a
retired pool's segments come back once PyTorch frees them, and the report says what waits.
Against the fake PyTorch of tests/fake_torch.py, which turns those aborts into failures."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

import gpubudget
from gpubudget import Budget, gpu_budget
from gpubudget import torch as gbt
from gpubudget.units import MiB
from tests.fake_torch import assert_nothing_would_have_aborted, install
from tests.fakes import DeviceHostBackend
from tests.helpers import consistent, subprocess_env

WAIT = 120.0  # seconds a thread waits for a cue before the test fails


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    module = install(monkeypatch)
    yield module
    assert_nothing_would_have_aborted(module)


class Router:
    """A thread serving a model in a budget of its own under ``parent``: routed from the
    moment :meth:`__enter__` returns until :meth:`__exit__` tells it to leave."""

    def __init__(self, torch: Any, parent: Budget, name: str = "serving") -> None:
        self.torch, self.parent, self.name = torch, parent, name
        self.inside, self.leave = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        self.budget: Budget | None = None
        self.thread = threading.Thread(target=self._run, name=name)

    def _run(self) -> None:
        try:
            with gpubudget.use(self.parent), gpu_budget("16MiB", name=self.name) as budget:
                self.budget = budget
                with gbt.allocations():
                    held = [self.torch.empty(MiB)]
                    scratch = self.torch.empty(3 * MiB)
                    del scratch  # cached in the routed pool
                    self.inside.set()
                    assert self.leave.wait(WAIT), "never told to leave"
                    held.append(self.torch.empty(MiB))  # routing still works
                del held
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            self.errors.append(exc)
            self.inside.set()

    def __enter__(self) -> Router:
        self.thread.start()
        assert self.inside.wait(WAIT), "the router never started routing"
        assert self.errors == []
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.leave.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the router did not finish"
        if self.errors:
            raise self.errors[0]


def test_budgets_end_while_another_thread_routes(torch: Any) -> None:
    """The issue's abort: a budget's pools retired while another thread routes. Failed
    before (a MemPool destroyed while the router routed: the fake's violation)."""
    with gpu_budget("128MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with Router(torch, pool) as router:
            made: list[tuple[Budget, Any]] = []
            for index in range(5):
                with gpu_budget("16MiB", name=f"model{index}") as model:
                    with gbt.allocations():
                        kept = torch.empty(3 * MiB)
                        scratch = torch.empty(5 * MiB)
                    del scratch
                assert model.state == "exited" and model.used == 3 * MiB  # scratch's came back
                made.append((model, kept))
            assert torch.captures != []  # the router routed all along
        assert all(model.state == "exited" for model, _ in made)
        models = [model for model, _ in made]
        made.clear()  # the tensors die
        del kept
        gbt.release_cached()
        assert [model.report().state for model in models] == ["released"] * 5
        assert router.budget is not None and router.budget.report().state == "released"
        assert pool.used == 0 and torch.counts["destroyed"] == 0
        consistent(pool)


def test_what_waits_is_reported_until_it_returns(torch: Any) -> None:
    with gpu_budget("128MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with Router(torch, pool):
            with gpu_budget("16MiB", name="model") as model:
                with gbt.allocations():
                    kept = torch.empty(3 * MiB)
            (usage,) = model.report().usage
            assert (usage.charged, usage.in_use, usage.waiting_in_use, usage.waiting_cached) == (
                3 * MiB, 3 * MiB, 3 * MiB, 0)
            assert ("waiting to return: 3.00 MiB under live objects, 0 B at the next "
                    "release_cached()") in str(model.report())
            del kept  # into the retired pool's cache: PyTorch frees it at the next emptying
            (usage,) = model.report().usage
            assert (usage.in_use, usage.waiting_in_use, usage.waiting_cached) == (0, 0, 3 * MiB)
            gbt.release_cached()  # while the router routes
            (usage,) = model.report().usage
            assert model.report().state == "released" and usage.charged == 0
        consistent(pool)


def test_pytorchs_own_empty_cache_returns_at_the_next_block(torch: Any) -> None:
    with gpu_budget("128MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("16MiB", name="model") as model:
            with gbt.allocations():
                kept = torch.empty(3 * MiB)
        del kept
        torch.cuda.empty_cache()  # PyTorch frees the segment; gpubudget learns it later
        assert model.state == "exited" and model.used == 3 * MiB
        with gpu_budget("16MiB", name="next"), gbt.allocations():
            assert model.report().state == "released"  # given back as the block began
        assert pool.used == 0


def test_no_mempool_is_destroyed_and_the_loser_of_a_race_makes_none(
        torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads make the first pool of one budget at once: the one that loses is dropped
    having made no MemPool."""
    made_before = gbt.mempools_kept()
    both_making = threading.Barrier(2)
    new_pool = gbt.allocations.new_pool

    def racing(self: Any, module: Any, budget: Budget) -> Any:
        both_making.wait(WAIT)
        return new_pool(self, module, budget)

    monkeypatch.setattr(gbt.allocations, "new_pool", racing)
    errors: list[BaseException] = []
    with gpu_budget("64MiB", name="model", backend=DeviceHostBackend(0)) as model:
        def load() -> None:
            try:
                with gbt.allocations(model):
                    torch.empty(MiB)
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        threads = [threading.Thread(target=load) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        assert errors == [] and not any(thread.is_alive() for thread in threads)
        (pool,) = gbt.allocations.pools()
        made = len(pool.ids)  # the winner's MemPools: one or two, as the routes overlapped
    workspace_pool = 1
    assert torch.counts["made"] == made + workspace_pool
    assert gbt.mempools_kept() - made_before == made + workspace_pool
    assert torch.counts["destroyed"] == 0


def test_release_cached_while_other_threads_route(torch: Any) -> None:
    with gpu_budget("128MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with Router(torch, pool) as router:
            assert router.budget is not None
            serving = router.budget.used  # 1 MiB tensor + 3 MiB cached in its routed pool
            with gpu_budget("32MiB", name="idle") as idle:
                with gbt.allocations():
                    scratch = torch.empty(6 * MiB)
                del scratch
                assert idle.used == 6 * MiB  # cached by PyTorch in an idle pool
                gbt.release_cached()
                assert idle.used == 0
                assert router.budget.used == serving  # a routed pool is left alone
                with gbt.allocations():  # a new MemPool serves the next block
                    kept = torch.empty(MiB)
                assert idle.used == 2 * MiB
                del kept
        gbt.release_cached()
        assert pool.used == 0


def test_a_budget_entered_again_after_its_scope_keeps_one_pool(torch: Any) -> None:
    """Before, the retired pool refused new blocks and a second pool replaced it in the
    report: its usage no longer matched what the budget was charged."""
    with gpu_budget("128MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("32MiB", name="model") as model:
            with gbt.allocations():
                first = torch.empty(3 * MiB)
        with gbt.allocations(model):  # the exited budget serves a late block
            second = torch.empty(5 * MiB)
        (usage,) = model.report().usage
        assert usage.charged == model.used == 8 * MiB
        assert usage.waiting_in_use == 8 * MiB  # retired again as the block left
        del first, second
        gbt.release_cached()
        assert model.report().state == "released" and pool.used == 0


def test_released_budgets_are_not_kept_alive_by_their_pools(torch: Any) -> None:
    """Before, the map of pools kept every budget that ever routed (its pool held it), long
    after its parent stopped listing it (a parent lists the last 32 released children)."""
    gone = []
    with gpu_budget("128MiB", name="pool", backend=DeviceHostBackend(0)):
        for index in range(40):
            with gpu_budget("32MiB", name=f"model{index}") as model:
                with gbt.allocations():
                    torch.empty(MiB)
            assert model.report().state == "released"
            gone.append(weakref.ref(model))
        del model
        gc.collect()
        assert [ref() is None for ref in gone[:8]] == [True] * 8
        assert gbt.allocations.pools() == []


def test_python_is_kept_out_of_pytorchs_allocator_lock(torch: Any) -> None:
    torch.cuda.memory._set_allocator_settings("max_split_size_mb:64")  # the user's, earlier
    with gpu_budget("64MiB", name="model", backend=DeviceHostBackend(0)):
        with gbt.allocations():
            kept = torch.empty(MiB)
        del kept
    assert torch.settings["release_lock_on_cudamalloc"] is True
    assert torch.settings["max_split_size_mb"] == "64"  # kept
    assert torch.hazards == []  # the free function is C: no Python under the lock


def test_the_settings_go_through_the_accelerator_call_where_pytorch_has_it(
        torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch 2.11 deprecates ``torch.cuda.memory._set_allocator_settings`` with a
    FutureWarning (seen on the H200): the accelerator-wide call is used where it exists."""
    calls: list[str] = []

    def accelerator(text: str) -> None:
        calls.append(text)
        torch.cuda.memory._set_allocator_settings(text)  # what the fake reads

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", accelerator,
                        raising=False)
    with gpu_budget("64MiB", name="model", backend=DeviceHostBackend(0)):
        with gbt.allocations():
            kept = torch.empty(MiB)
        del kept
    assert calls == ["release_lock_on_cudamalloc:True"]


def test_the_deprecated_settings_call_warns_nobody(
        torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.cuda.memory._set_allocator_settings

    def deprecated(text: str) -> None:
        warnings.warn("torch.cuda._set_allocator_settings is deprecated", FutureWarning)
        real(text)

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", deprecated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gpu_budget("64MiB", name="model", backend=DeviceHostBackend(0)):
            with gbt.allocations():
                kept = torch.empty(MiB)
            del kept
    assert torch.settings["release_lock_on_cudamalloc"] is True


def test_the_fake_sees_python_under_the_lock_without_the_setting(
        torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the setting prevents, shown: the allocate callback runs with the lock held."""
    monkeypatch.setattr(gbt, "release_lock_on_malloc", lambda module: None)
    with gpu_budget("64MiB", name="model", backend=DeviceHostBackend(0)):
        with gbt.allocations():
            kept = torch.empty(MiB)
        del kept
    assert [hazard for hazard in torch.hazards if "allocate callback" in hazard]
    torch.hazards.clear()


def test_interpreter_exit_while_a_thread_routes_is_silent(tmp_path: Path) -> None:
    """Before, the pools still alive were destroyed at teardown while a daemon thread routed:
    PyTorch's abort (here the fake's, ``abort=True``)."""
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import sys, threading
        from tests.fakes import DeviceHostBackend, fake_torch
        torch = sys.modules["torch"] = fake_torch(abort=True)
        import gpubudget
        from gpubudget import gpu_budget
        from gpubudget import torch as gbt
        pool = gpu_budget("64MiB", name="pool", backend=DeviceHostBackend(0)).__enter__()
        with gpu_budget("8MiB", name="ended"):
            with gbt.allocations():
                kept = torch.empty(2**20)  # outlives its budget: a retired pool holds it
        inside = threading.Event()
        def serve():
            with gpubudget.use(pool), gpu_budget("8MiB", name="serving"), gbt.allocations():
                held = torch.empty(2**20)
                inside.set()
                threading.Event().wait()  # routing until the process ends
        threading.Thread(target=serve, daemon=True).start()
        assert inside.wait(120)
        print("done")
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=subprocess_env(), timeout=180)
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")
