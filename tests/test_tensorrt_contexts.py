"""Execution-context memory and scratch from a budget (gpubudget.tensorrt.contexts).

The engines and contexts are fakes with TensorRT's method names (tests/trt_fakes.py): no
engine can run here. The allocation strategy, the scratch allocator and its trampoline are
TensorRT-RTX's own.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

from gpubudget import AllocationDenied, BudgetError, gpu_budget
from gpubudget import tensorrt as gbt
from tests import bindings
from tests.helpers import StreamBackend, consistent
from tests.trampoline import Trampoline
from tests.trt_fakes import KiB, FakeEngine

trt: Any = pytest.importorskip("tensorrt_rtx_bindings")


def engine(**kwargs: Any) -> FakeEngine:
    return FakeEngine(trt, **kwargs)


def test_a_context_gets_exactly_the_engine_size_from_the_budget_user_managed() -> None:
    model = engine(per_batch=4 * KiB, max_batch=16)
    with gpu_budget("1MiB", name="model", backend="host") as budget:
        context = gbt.execution_context(model, trt_module=trt)
        memory = gbt.context_memory(context)
        assert memory is not None and memory.size == 64 * KiB == model.device_memory_size_v2
        assert context.memory == (memory.address, 64 * KiB)
        assert model.strategies == [trt.ExecutionContextAllocationStrategy.USER_MANAGED]
        assert budget.used == 64 * KiB
        tags = {b.address: b.tag for b in budget.report().live_blocks}
        assert memory.address is not None and tags[memory.address] == "context"
        assert context.execute_async_v3(0, budget=budget, trt=trt)
        consistent(budget)
        del context
        gc.collect()
        assert budget.used == 0


def test_a_profile_is_sized_by_its_own_size() -> None:
    model = engine(per_batch=4 * KiB, max_batch=16, profiles=2)
    with gpu_budget("1MiB", backend="host") as budget:
        memory = gbt.ContextMemory(model, profile=1, trt_module=trt)
        context = memory.create_context()
        assert memory.size == model.get_device_memory_size_for_profile_v2(1) == 32 * KiB
        assert budget.used == 32 * KiB
        del context


def test_shapes_shrink_in_place_grow_in_place_or_move_and_tensorrt_is_told() -> None:
    model = engine(per_batch=4 * KiB, max_batch=16)
    with gpu_budget("256KiB", backend="host") as budget:
        memory = gbt.ContextMemory(model, trt_module=trt)
        context = memory.create_context()
        first = memory.address
        assert context.set_input_shape("x", (2, 16))
        assert gbt.fit_shapes(context) == 8 * KiB
        assert memory.address == first and context.memory == (first, 8 * KiB)  # in place
        assert budget.used == 8 * KiB
        blocker = budget.allocate(8 * KiB)  # right after the region: it cannot grow there
        assert blocker == first + 8 * KiB  # type: ignore[operator]
        context.set_input_shape("x", (4, 16))
        assert memory.fit(context) == 16 * KiB
        assert memory.address != first and context.memory == (memory.address, 16 * KiB)
        assert context.execute_async_v3(0, budget=budget, trt=trt)  # a live block, big enough
        assert blocker is not None and budget.free(blocker)
        consistent(budget)
        del context
        gc.collect()
        assert budget.used == 0


def test_a_denial_is_a_clear_error_before_tensorrt_is_called() -> None:
    model = engine(per_batch=4 * KiB, max_batch=16)  # needs 64 KiB
    with gpu_budget("32KiB", name="small", backend="host") as budget:
        with pytest.raises(AllocationDenied, match=r"shapes the largest of every profile.*"
                           r"'small'.*64\.00 KiB"):
            gbt.execution_context(model, trt_module=trt)
        assert model.strategies == []  # TensorRT was never asked for a context
        assert budget.used == 0 and budget.report().denials[0].reason == "over_limit"


def test_a_fit_denial_names_budget_size_and_shapes_and_changes_nothing() -> None:
    model = engine(per_batch=4 * KiB, max_batch=16)
    with gpu_budget("80KiB", name="tight", backend="host") as budget:
        memory = gbt.ContextMemory(model, trt_module=trt)
        context = memory.create_context()
        context.set_input_shape("x", (1, 16))
        memory.fit(context)
        assert budget.allocate(70 * KiB) is not None  # someone else takes the rest
        context.set_input_shape("x", (16, 16))
        before = (memory.address, memory.size, context.memory)
        with pytest.raises(BudgetError) as raised:
            memory.fit(context)
        message = str(raised.value)
        assert "'tight'" in message and "64.00 KiB" in message and "{'x': (16, 16)}" in message
        assert (memory.address, memory.size, context.memory) == before
        consistent(budget)


def test_memory_outlives_the_context_and_the_budget_outlives_both() -> None:
    model = engine()
    with gpu_budget("1MiB", name="m", backend="host") as budget:
        context = gbt.execution_context(model, trt_module=trt)
        region = context.device_memory
    assert budget.report().state == "exited"  # the scope ended; the context still holds it
    assert budget.size_of(region) == model.device_memory_size_v2
    assert context.execute_async_v3(0, budget=budget, trt=trt)  # scratch after the scope too
    del context
    gc.collect()
    assert budget.state == "released"


def test_contexts_sharing_one_region_opt_in() -> None:
    model = engine(per_batch=4 * KiB, max_batch=16)
    with gpu_budget("1MiB", backend="host") as budget:
        memory = gbt.ContextMemory(model, trt_module=trt)
        a, b = memory.create_context(), memory.create_context()
        assert a.memory == b.memory and budget.used == 64 * KiB  # one region
        a.set_input_shape("x", (2, 16))
        memory.fit(a)
        assert memory.size == 64 * KiB  # b still may run its largest shapes
        b.set_input_shape("x", (4, 16))
        memory.fit(b)
        assert memory.size == 16 * KiB and a.memory == b.memory == (memory.address, 16 * KiB)
        del a
        gc.collect()
        assert budget.used == 16 * KiB and len(memory.contexts) == 1
        del b
        gc.collect()
        assert budget.used == 0 and memory.address is None
        c = memory.create_context()  # the region comes back for a new context
        assert budget.used == 64 * KiB
        del c
        gc.collect()
        assert budget.used == 0


@pytest.mark.parametrize("binding", bindings.IDS)
def test_scratch_comes_from_the_same_budget_tagged_scratch(binding: str) -> None:
    module = bindings.load(binding)
    model = FakeEngine(module)
    backend = StreamBackend()  # stream work is done only when the test says so
    with gpu_budget("1MiB", name="pool", backend=backend):
        with gpu_budget("512KiB", name="model") as budget:
            context = gbt.execution_context(model, trt_module=module)
        scratch = Trampoline(context.temporary_allocator)  # NVIDIA's trampoline, as enqueue uses
        assert isinstance(context.temporary_allocator, module.IGpuAllocator)
        stream = 0x5A0
        block = scratch.allocate_async(3 * KiB, 256, 1, stream)
        assert block is not None and budget.owner_of(block) is budget
        live = {b.address: b for b in budget.report().live_blocks}
        assert live[block].tag == "scratch"
        assert scratch.deallocate_async(block, stream)
        # freed on its stream: that stream may reuse it at once (the stream was read where
        # this binding puts it: a flag read as the stream would not reuse it)
        again = scratch.allocate_async(3 * KiB, 256, 1, stream)
        assert again == block and scratch.deallocate_async(again, stream)
        backend.finish()
        plain = gbt.execution_context(model, budget=budget, scratch=False, trt_module=module)
        assert plain.temporary_allocator is None
        del context, plain, scratch
        gc.collect()
        assert budget.state == "released"


def test_bad_arguments_are_named() -> None:
    model = engine()
    with pytest.raises(BudgetError, match="ContextMemory"):
        gbt.ContextMemory(model, trt_module=trt)
    with gpu_budget("1MiB", backend="host"):
        for profile in (-1, True, 1.5):
            with pytest.raises(ValueError, match="profile"):
                gbt.ContextMemory(model, profile=profile, trt_module=trt)  # type: ignore[arg-type]
        memory = gbt.ContextMemory(model, trt_module=trt)
        stranger = model.create_execution_context()
        with pytest.raises(ValueError, match="does not use"):
            memory.fit(stranger)
        with pytest.raises(ValueError, match="not made by gpubudget"):
            gbt.fit_shapes(stranger)
        assert gbt.context_memory(42) is None


def test_tensorrt_refusing_a_context_gives_the_region_back() -> None:
    class Refusing(FakeEngine):
        def create_execution_context(self, strategy: Any = None) -> Any:
            return None

    model = Refusing(trt)
    with gpu_budget("1MiB", backend="host") as budget:
        with pytest.raises(RuntimeError, match="could not create an execution context"):
            gbt.execution_context(model, trt_module=trt)
        assert budget.used == 0
        consistent(budget)


def test_interpreter_exit_with_live_contexts_and_outputs_is_silent(tmp_path: Any) -> None:
    import subprocess
    import sys
    import textwrap

    from tests.helpers import subprocess_env

    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import tensorrt_rtx_bindings as trt
        from gpubudget import gpu_budget
        from gpubudget import tensorrt as gbt
        from tests.trampoline import OutputTrampoline
        from tests.trt_fakes import FakeEngine
        pool = gpu_budget("1MiB", name="pool").__enter__()
        engine = FakeEngine(trt)
        memory = gbt.ContextMemory(engine, trt_module=trt)
        contexts = [memory.create_context(), memory.create_context()]
        outputs = gbt.output_allocator(contexts[0], trt_module=trt)
        side = OutputTrampoline(outputs, trt.IOutputAllocator)
        assert side.reallocate_output_async("y", 0, 5000, 256, 7)
        assert contexts[0].execute_async_v3(7, budget=pool, trt=trt)
        print("done")
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=subprocess_env(GPUBUDGET_BACKEND="host"), timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (0, "done\n", "")


def test_contexts_destroyed_in_other_threads_while_one_is_fitted() -> None:
    """A context's end (its weak-reference callback, on whatever thread drops it) while
    another thread fits a context of the same region: the region follows every context,
    nothing is freed twice or lost."""
    import sys
    import threading

    model = engine(per_batch=KiB, max_batch=16)
    with gpu_budget("1MiB", backend="host") as budget:
        memory = gbt.ContextMemory(model, trt_module=trt)
        keep = memory.create_context()
        start = threading.Barrier(2, timeout=60)
        failures: list[BaseException] = []

        def fitter() -> None:
            try:
                start.wait()
                for i in range(200):
                    keep.set_input_shape("x", (1 + i % 16, 16))
                    memory.fit(keep)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        def churner() -> None:
            try:
                start.wait()
                for i in range(200):
                    box = [memory.create_context()]
                    box[0].set_input_shape("x", (1 + (i * 7) % 16, 16))
                    memory.fit(box[0])
                    dropper = threading.Thread(target=box.clear)  # its end, elsewhere
                    dropper.start()
                    dropper.join(60)
                    assert not dropper.is_alive()
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=fitter), threading.Thread(target=churner)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
                assert not thread.is_alive()
        finally:
            sys.setswitchinterval(interval)
        assert failures == []
        gc.collect()
        assert memory.contexts == [keep] and keep.memory == (memory.address, memory.size)
        assert keep.execute_async_v3(0, budget=budget, trt=trt)
        consistent(budget)
        del keep
        gc.collect()
        assert budget.used == 0 and budget.report().invalid_frees == 0
