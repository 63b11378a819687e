"""Every TensorRT door at once, in any order (Hypothesis): contexts created (alone or sharing a
region), shapes changed, inferences whose outputs grow and shrink, contexts destroyed, model
budgets exited early, streams finishing. After every step: ``check()`` clean, ``used`` the sum
of the live blocks, nothing freed twice, every context's memory and outputs charged to its own
model's budget, and no output buffer that a stream may still be using handed to another
stream: each inference writes its output with its context's own byte, as its kernels would,
and those bytes must stay until that stream's work is done. At the end, nothing lost.

Engines and contexts are fakes with TensorRT's method names (tests/trt_fakes.py); the scratch
allocator and the output allocator are classes of each real binding of tests/bindings.py
(lean 10.16, lean 11.4, TensorRT-RTX 1.7), called through NVIDIA's C++ trampolines.
"""

from __future__ import annotations

import contextvars
import gc
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gpubudget import Budget, BudgetError, gpu_budget
from gpubudget import tensorrt as gbt
from tests import bindings
from tests.helpers import StreamBackend, consistent, fill, holds
from tests.trt_fakes import KiB, FakeEngine



@dataclass
class Model:
    budget: Budget
    scope: contextvars.Context  # entered and exited there, so any order of exits is fine
    engine: FakeEngine
    open: bool = True


@dataclass
class Live:
    context: Any
    memory: gbt.ContextMemory
    outputs: Any
    model: Model
    stream: int
    byte: int  # what its "kernels" write into its outputs


@dataclass
class InFlight:
    """An output buffer that stream work may still use: ``nbytes`` of ``byte`` at
    ``address``, written on ``stream`` when the backend had ``events`` events."""

    address: int
    nbytes: int
    byte: int
    stream: int
    events: int


class Doors(RuleBasedStateMachine):
    trt: Any  # the binding whose classes the callbacks subclass (see the test below)

    def __init__(self) -> None:
        super().__init__()
        self.backend = StreamBackend()
        self.pool = gpu_budget("1MiB", name="pool", backend=self.backend)
        self.pool.__enter__()
        self.models: list[Model] = []
        self.live: dict[int, Live] = {}
        self.serial = 0
        self.in_flight: list[InFlight] = []

    @initialize(limit=st.sampled_from([256 * KiB, 512 * KiB]), share=st.booleans())
    def two_contexts(self, limit: int, share: bool) -> None:
        """Every run starts with a model and two contexts: the steps go to the doors."""
        self.new_model(limit, KiB)
        self.create(self.models[0], False)
        self.create(self.models[0], share)
        assert len(self.live) == 2

    @precondition(lambda self: len(self.models) < 4)
    @rule(limit=st.sampled_from([96 * KiB, 256 * KiB, 512 * KiB]),
          per_batch=st.sampled_from([KiB, 4 * KiB]))
    def new_model(self, limit: int, per_batch: int) -> None:
        scope = contextvars.copy_context()
        budget = gpu_budget(limit, name=f"model-{len(self.models)}", parent=self.pool)
        scope.run(budget.__enter__)
        self.models.append(Model(budget, scope, FakeEngine(self.trt, per_batch=per_batch)))

    @precondition(lambda self: self.models)
    @rule(data=st.data(), share=st.booleans())
    def create_context(self, data: st.DataObject, share: bool) -> None:
        self.create(data.draw(st.sampled_from(self.models)), share)

    def create(self, model: Model, share: bool) -> None:
        shared = [live.memory for live in self.live.values() if live.model is model]
        before = model.budget.used
        try:
            memory = shared[0] if share and shared else gbt.ContextMemory(
                model.engine, budget=model.budget, trt_module=self.trt)
            context = memory.create_context()
        except BudgetError:  # over its limit, or a model exited early with nothing left
            assert model.budget.used == before  # refused before TensorRT: nothing changed
            return
        outputs = gbt.output_allocator(context, budget=model.budget, trt_module=self.trt)
        self.serial += 1
        self.live[self.serial] = Live(context, memory, outputs, model, 0x100 + self.serial,
                                      1 + self.serial % 255)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), batch=st.integers(1, 16))
    def change_shapes(self, data: st.DataObject, batch: int) -> None:
        live = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        before = (live.memory.address, live.memory.size, live.context.memory)
        assert live.context.set_input_shape("x", (batch, 16))
        try:
            size = live.memory.fit(live.context)
        except BudgetError:
            assert (live.memory.address, live.memory.size, live.context.memory) == before
            live.context.set_input_shape("x", (1, 16))  # do not run shapes it cannot hold
            live.memory.fit(live.context)
            return
        assert size >= live.context.update_device_memory_size_for_shapes()
        for other in self.live.values():  # every context sharing it was told
            if other.memory is live.memory:
                assert other.context.memory == (live.memory.address, size)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), found=st.sampled_from([0, 100, 500, 1000, 4000]))
    def infer(self, data: st.DataObject, found: int) -> None:
        live = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        ran = live.context.execute_async_v3(live.stream, found=found, budget=live.model.budget,
                                            trt=self.trt)
        if ran:
            address = live.outputs.address("y")
            assert live.model.budget.size_of(address) >= max(found, 1) * 8
            assert live.outputs.shape("y") == (found,)
            nbytes = max(found, 1) * 8
            fill(address, nbytes, live.byte)  # the inference's kernels, on its stream
            self.in_flight.append(InFlight(address, nbytes, live.byte, live.stream,
                                           len(self.backend.events)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def destroy_context(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.live)))
        stream = self.live[key].stream
        self.backend.finish(stream)  # TensorRT: a context's work is done before it is destroyed
        self.in_flight = [f for f in self.in_flight if f.stream != stream]
        del self.live[key]
        gc.collect()

    @precondition(lambda self: any(m.open for m in self.models))
    @rule(data=st.data())
    def exit_model_early(self, data: st.DataObject) -> None:
        model = data.draw(st.sampled_from([m for m in self.models if m.open]))
        model.scope.run(model.budget.__exit__, None, None, None)
        model.open = False

    @rule()
    def streams_finish(self) -> None:
        self.backend.finish()
        self.in_flight.clear()

    def settled(self, flight: InFlight) -> bool:
        """Whether the budget has waited for ``flight``'s stream since it was written (an
        event recorded on that stream later is complete)."""
        return any(event.done and event.stream == flight.stream
                   for event in self.backend.events[flight.events:])

    @invariant()
    def books_agree(self) -> None:
        consistent(self.pool)
        for report in self.pool.report().walk():
            assert report.invalid_frees == 0, report.name  # nothing freed twice
        for live in self.live.values():
            assert live.memory.address is not None
            assert live.model.budget.size_of(live.memory.address) >= live.memory.size
            assert live.model.budget.owner_of(live.memory.address) is live.model.budget
            output = live.outputs.address("y")
            assert output is None or live.model.budget.owner_of(output) is live.model.budget
        for flight in self.in_flight:  # still being used on its stream: nobody else wrote it
            assert self.settled(flight) or holds(flight.address, flight.nbytes, flight.byte), (
                f"an output buffer of stream {flight.stream:#x} was handed on before that "
                "stream's work was done")

    def teardown(self) -> None:
        self.live.clear()
        gc.collect()
        self.backend.finish()
        lost = {m.budget.name: m.budget.used for m in self.models if m.budget.used}
        for model in self.models:
            if model.open:
                model.scope.run(model.budget.__exit__, None, None, None)
        self.pool.__exit__(None, None, None)
        assert lost == {}, lost  # nothing lost: every block came back
        assert all(m.budget.report().state == "released" for m in self.models)
        assert self.pool.report().state == "released"


@pytest.mark.parametrize("binding", bindings.IDS)
def test_every_door_at_once_in_any_order(binding: str) -> None:
    """On each real binding (TensorRT-RTX with more examples: the lean runtimes' trampolines
    differ from it only in their output allocator's slots and their argument order)."""
    machine = type("Doors", (Doors,), {"trt": bindings.load(binding)})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40 if binding == bindings.RTX else 20, stateful_step_count=30,
        deadline=None, suppress_health_check=[HealthCheck.too_slow]))
