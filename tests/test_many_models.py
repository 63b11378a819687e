"""Many models in one process, each in its own budget under one pool, loaded, served and
unloaded from threads at once (the mission's own use), on the CPU: PyTorch and CuPy are the
fakes of tests/ (PyTorch's aborts become failures), TensorRT-RTX's allocator is driven
through NVIDIA's own trampoline. scripts/soak.py does the same at random, for minutes."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import gpubudget
from gpubudget import Budget, gpu_budget
from gpubudget import cupy as gbc
from gpubudget import torch as gbt
from gpubudget.units import KiB, MiB
from tests.fake_torch import assert_nothing_would_have_aborted, install
from tests.fakes import DeviceHostBackend, fake_cupy
from tests.helpers import consistent, finishes, subprocess_env

WAIT = 120.0  # seconds a thread waits for a cue before the test fails


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    module = install(monkeypatch)
    yield module
    assert_nothing_would_have_aborted(module)


@pytest.fixture
def cp(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def run_threads(targets: dict[str, Callable[[], None]], seconds: float = WAIT) -> None:
    """Run each target in a thread of that name; fail (not hang) if one does not finish,
    raise the first error one raised."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
                errors.append(exc)
        return run

    def work() -> None:
        threads = [threading.Thread(target=guarded(target), name=name)
                   for name, target in targets.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    finishes(work, seconds)
    if errors:
        raise errors[0]


def test_models_load_serve_and_unload_side_by_side(torch: Any) -> None:
    """Three models and one with too small a limit, each in a thread and a budget of its
    own: the small one fails while the others are loaded and routed, then the others end
    one by one while the rest still route; one model outlives its budget."""
    weights = {"small": MiB, "medium": 3 * MiB, "large": 5 * MiB}
    routed = threading.Barrier(len(weights) + 1)  # every model's thread, routed
    turn = {name: threading.Event() for name in weights}
    finished = {name: threading.Event() for name in [*weights, "tiny"]}
    kept: dict[str, Any] = {}
    served: dict[str, int] = {}
    refused: list[BaseException] = []
    budgets: dict[str, Budget] = {}
    with gpu_budget("256MiB", name="server", backend=DeviceHostBackend(0)) as pool:
        def model(name: str) -> Callable[[], None]:
            def run() -> None:
                with gpubudget.use(pool), gpu_budget("32MiB", name=name) as budget:
                    budgets[name] = budget
                    with gbt.allocations():
                        parameters = [torch.empty(weights[name]) for _ in range(3)]
                        routed.wait(WAIT)
                        count = 0
                        for _ in range(5):
                            activations = [torch.empty(weights[name]), torch.matmul()]
                            del activations
                            count += 1
                        assert turn[name].wait(WAIT), f"{name} never got its turn"
                        for _ in range(5):  # serving on while others have ended
                            activations = [torch.empty(weights[name])]
                            del activations
                            count += 1
                        served[name] = count
                    if name == "small":
                        kept[name] = parameters  # outlives its budget
                    del parameters  # the others are unloaded inside theirs
                finished[name].set()
            return run

        def tiny() -> None:
            with gpubudget.use(pool), gpu_budget("1MiB", name="tiny") as budget:
                budgets["tiny"] = budget
                try:
                    with gbt.allocations():
                        routed.wait(WAIT)
                        torch.empty(4 * MiB)
                except torch.OutOfMemoryError as exc:
                    refused.append(exc)
            finished["tiny"].set()

        def conduct() -> None:
            assert finished["tiny"].wait(WAIT)  # it ended while the others routed
            for name in weights:  # each ends while those after it still route
                turn[name].set()
                assert finished[name].wait(WAIT)

        run_threads({**{name: model(name) for name in weights}, "tiny": tiny,
                     "conductor": conduct})

        assert served == {name: 10 for name in weights}
        (error,) = refused
        notes = "\n".join(getattr(error, "__notes__", []))
        assert "budget 'tiny'" in notes and "(over_limit)" in notes, notes
        assert budgets["tiny"].report().state == "released"
        assert budgets["medium"].report().state == budgets["large"].report().state == "released"
        small = budgets["small"]
        (usage,) = small.report().usage
        assert small.state == "exited" and usage.waiting_in_use == 3 * MiB
        kept.clear()
        gbt.release_cached()
        assert small.report().state == "released"
        assert pool.used == 0 and torch.counts["destroyed"] == 0
        consistent(pool)


def test_pytorch_cupy_and_tensorrt_side_by_side_under_one_root(torch: Any, cp: Any) -> None:
    """PyTorch, CuPy and TensorRT-RTX's allocator (through its C++ trampoline) each load and
    unload models in sibling budgets of one root from their own threads at once."""
    trt = pytest.importorskip("tensorrt_rtx_bindings")
    from gpubudget import tensorrt as gbtrt
    from tests.trampoline import Trampoline, verify_slots

    verify_slots(trt, "IGpuAllocator")
    rounds = 15
    start = threading.Barrier(3)
    outliving: list[Any] = []  # models kept past their budgets, dropped at the end
    names: list[str] = []
    with gpu_budget("512MiB", name="root", backend=DeviceHostBackend(0)) as root:
        def pytorch_models() -> None:
            start.wait(WAIT)
            for index in range(rounds):
                with gpubudget.use(root), gpu_budget("64MiB", name=f"torch{index}"):
                    with gbt.allocations():
                        weights = [torch.empty(MiB), torch.empty(3 * MiB)]
                        temporary = torch.empty(5 * MiB)
                        del temporary
                    if index % 3 == 0:
                        outliving.append(weights)
                names.append(f"torch{index}")

        def cupy_models() -> None:
            start.wait(WAIT)
            for index in range(rounds):
                with gpubudget.use(root), gpu_budget("1MiB", name=f"cupy{index}"):
                    with gbc.allocations():
                        arrays = [cp.allocate(100 * KiB), cp.allocate(300 * KiB)]
                        temporary = cp.allocate(50 * KiB)
                        del temporary
                    if index % 3 == 1:
                        outliving.append(arrays)
                names.append(f"cupy{index}")

        def tensorrt_engines() -> None:
            start.wait(WAIT)
            for index in range(rounds):
                with gpubudget.use(root), gpu_budget("4MiB", name=f"trt{index}"):
                    engine = Trampoline(gbtrt.allocator(trt_module=trt))
                    blocks = [engine.allocate(256 * KiB, 256, 0) for _ in range(3)]
                    scratch = engine.allocate_async(64 * KiB, 256, 0, 0)
                    assert None not in blocks and scratch is not None
                    assert engine.deallocate_async(scratch, 0)
                assert all(engine.deallocate(block) for block in blocks if block)
                del engine
                names.append(f"trt{index}")

        run_threads({"pytorch": pytorch_models, "cupy": cupy_models,
                     "tensorrt": tensorrt_engines})
        root.check()
        outliving.clear()
        gc.collect()
        gbt.release_cached()
        gbc.release_cached()
        states = {child.name: child.state for child in root.report().walk() if child.name in names}
        assert len(names) == 3 * rounds and set(states.values()) <= {"released"}, states
        assert root.used == 0 and torch.counts["destroyed"] == 0
        consistent(root)


def test_the_soak_runs_on_the_fakes_and_passes() -> None:
    """scripts/soak.py in its quick form (a few rounds per thread, whatever the time), as the
    GPU script runs it for minutes: the child ends clean and the parent says so."""
    result = subprocess.run(
        [sys.executable, "-m", "scripts.soak", "--minutes", "0", "--rounds", "12", "--fake",
         "--seed", "3"], capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "soak: passed: 0 aborts, 0 hangs" in result.stdout
    for kind in ("torch", "cupy"):
        for event in ("loads", "serves", "failures (budget too small)"):
            assert f'"{kind}: {event}": ' in result.stdout, (kind, event, result.stdout)
    assert '"problems": []' in result.stdout
