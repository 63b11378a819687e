"""Weight streaming from a budget's room, and TensorRT-RTX's weight unload/load against it
(gpubudget.tensorrt.weights). Engines are fakes with TensorRT's method names; the weights of
the unload/load tests go through a gpubudget allocator by NVIDIA's TensorRT-RTX trampoline."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from gpubudget import BudgetError, gpu_budget
from gpubudget.backends.host import HostBackend
from gpubudget import tensorrt as gbt
from gpubudget.tensorrt.weights import weights_size
from tests.helpers import consistent
from tests.trampoline import Trampoline
from tests.trt_fakes import KiB, FakeEngine

trt: Any = pytest.importorskip("tensorrt_rtx_bindings")


def streaming(streamable: int = 512 * KiB) -> FakeEngine:
    return FakeEngine(trt, per_batch=4 * KiB, max_batch=16, streamable=streamable)


@pytest.mark.parametrize("contexts", [1, 2, 3])
def test_resident_weights_and_contexts_fit_the_room(contexts: int) -> None:
    model = streaming()
    with gpu_budget("600KiB", backend="host") as budget:
        budget.allocate(100 * KiB)  # another model's
        plan = gbt.stream_weights(model, contexts=contexts)
        room = 500 * KiB
        assert plan.room == room and plan.streamable == 512 * KiB
        assert plan.resident == model.weight_streaming_budget_v2 < 512 * KiB
        assert plan.context_memory == model.device_memory_size_v2  # at the setting made
        assert plan.scratch == model.weight_streaming_scratch_memory_size > 0
        charged = -(-plan.context_memory // 256) * 256  # a region is charged aligned
        assert plan.resident + contexts * charged <= room
        assert plan.automatic == 256 * KiB  # TensorRT's guess, shown, not used
        more = plan.resident + 512 * KiB // 1024 + 1  # as good as bisection promises
        model.weight_streaming_budget_v2 = more
        assert more + contexts * -(-model.device_memory_size_v2 // 256) * 256 > room
        model.weight_streaming_budget_v2 = plan.resident
        memory = gbt.ContextMemory(model, trt_module=trt)
        made = [memory.create_context()]  # the contexts fit beside the resident weights
        assert budget.used - 100 * KiB == charged
        del made
        gc.collect()


def test_a_roomy_budget_keeps_every_weight_resident_and_keep_is_set_aside() -> None:
    model = streaming(64 * KiB)
    with gpu_budget("1MiB", backend="host"):
        plan = gbt.stream_weights(model)
        assert plan.resident == 64 * KiB and plan.scratch == 0
        tighter = gbt.stream_weights(model, keep="900KiB")
        assert tighter.room == 124 * KiB and 0 < tighter.resident < 64 * KiB
        assert tighter.resident + tighter.context_memory <= tighter.room
        assert "resident" in tighter.text()


def test_nothing_fits_is_an_error_and_the_setting_is_unchanged() -> None:
    model = streaming()
    with gpu_budget("32KiB", name="tiny", backend="host"):
        with pytest.raises(BudgetError, match="'tiny'"):
            gbt.stream_weights(model)
    assert model.weight_streaming_budget_v2 == 512 * KiB  # all or nothing


def test_bad_arguments_and_engines_without_streaming() -> None:
    with gpu_budget("1MiB", backend="host"):
        with pytest.raises(ValueError, match="WEIGHT_STREAMING"):
            gbt.stream_weights(FakeEngine(trt))
        for contexts in (0, True, 1.5):
            with pytest.raises(ValueError, match="contexts"):
                gbt.stream_weights(streaming(), contexts=contexts)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="keep"):
            gbt.stream_weights(streaming(), keep="lots")
    with pytest.raises(BudgetError, match="stream_weights"):
        gbt.stream_weights(streaming())


def test_unload_gives_the_budget_back_and_load_is_refused_before_tensorrt_without_room() -> None:
    with gpu_budget("256KiB", name="gpu", backend="host") as budget:
        runtime = gbt.Runtime(trt.Logger(trt.Logger.ERROR), trt_module=trt)
        cpp = Trampoline(gbt.allocator_of(runtime))
        model = FakeEngine(trt, weights=160 * KiB, allocator=cpp)
        assert budget.used == 160 * KiB and weights_size(model) == 160 * KiB
        assert gbt.unload_weights(model) == 160 * KiB and budget.used == 0
        other = budget.allocate(128 * KiB)  # another model uses the room meanwhile
        with pytest.raises(BudgetError, match=r"'gpu' has 128\.00 KiB available"):
            gbt.load_weights(model, b"plan")
        assert not model.weights_loaded  # TensorRT was not asked
        assert other is not None and budget.free(other)
        assert gbt.load_weights(model, b"plan") == 160 * KiB and model.weights_loaded
        with pytest.raises(RuntimeError, match="already loaded"):
            gbt.load_weights(model, b"plan")
        assert gbt.unload_weights(model) == 160 * KiB
        with pytest.raises(RuntimeError, match="refused to unload"):
            gbt.unload_weights(model)
        consistent(budget)
        del runtime, cpp


def test_engines_without_weight_loading() -> None:
    class Plain:
        pass

    with gpu_budget("1MiB", backend="host"):
        with pytest.raises(TypeError, match="TensorRT-RTX"):
            gbt.unload_weights(Plain())
        with pytest.raises(TypeError, match="TensorRT-RTX"):
            gbt.load_weights(Plain(), b"")
    assert weights_size(Plain()) is None


def test_a_failure_inside_the_search_restores_the_setting() -> None:
    """All or nothing: TensorRT failing (or a Ctrl-C) half way through the bisection leaves
    the engine's setting as it was."""

    class Failing(FakeEngine):
        reads = 0

        @property
        def device_memory_size_v2(self) -> int:
            self.reads += 1
            if self.reads == 4:
                raise RuntimeError("TensorRT could not size the context")
            return int(FakeEngine.device_memory_size_v2.fget(self))  # type: ignore[attr-defined]

    model = Failing(trt, per_batch=4 * KiB, max_batch=16, streamable=512 * KiB)
    with gpu_budget("600KiB", backend="host") as budget:
        budget.allocate(100 * KiB)
        with pytest.raises(RuntimeError, match="could not size"):
            gbt.stream_weights(model)
    assert model.reads >= 4 and model.weight_streaming_budget_v2 == 512 * KiB


def test_the_setting_found_does_not_depend_on_the_previous_one() -> None:
    """The search's upper end is the context memory with every weight resident (the least),
    not whatever the engine was last set to."""
    with gpu_budget("600KiB", backend="host") as budget:
        budget.allocate(100 * KiB)
        fresh = gbt.stream_weights(streaming())
        model = streaming()
        model.weight_streaming_budget_v2 = 0  # an earlier, tighter setting
        again = gbt.stream_weights(model)
        assert again.resident == fresh.resident


def test_a_sleeping_budget_has_no_room_and_load_is_refused_before_tensorrt() -> None:
    with gpu_budget("1MiB", name="gpu", initial=0, backend="host") as budget:
        runtime = gbt.Runtime(trt.Logger(trt.Logger.ERROR), trt_module=trt)
        cpp = Trampoline(gbt.allocator_of(runtime))
        model = FakeEngine(trt, weights=160 * KiB, allocator=cpp, streamable=64 * KiB)
        assert gbt.unload_weights(model) == 160 * KiB
        budget.offload()  # asleep: every allocation is refused until restore()
        with pytest.raises(BudgetError, match="'gpu' is asleep"):
            gbt.load_weights(model, b"plan")
        with pytest.raises(BudgetError, match="'gpu' is asleep"):
            gbt.stream_weights(model)
        assert budget.report().denials == ()  # TensorRT was not asked
        budget.restore()
        assert gbt.load_weights(model, b"plan") == 160 * KiB
        del runtime, cpp


def test_a_growable_root_counts_only_what_the_device_can_back() -> None:
    """A growable root maps memory as blocks need it: its room is what its limit allows and
    the device can still give (its free memory, and what the root mapped and does not use)."""

    class SmallDevice(HostBackend):
        def mem_info(self) -> tuple[int, int] | None:
            return 200 * KiB, 1 << 30

    model = streaming()
    with gpu_budget("4MiB", initial=0, backend=SmallDevice()) as budget:
        plan = gbt.stream_weights(model)
        assert plan.room == 200 * KiB and plan.resident < plan.streamable
        assert plan.resident + -(-plan.context_memory // 256) * 256 <= 200 * KiB
        assert budget.mapped == 0
        assert gbt.engine_needs(model, budget=budget).room == 200 * KiB  # the same room
