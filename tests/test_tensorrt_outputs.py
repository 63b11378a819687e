"""Outputs whose shape depends on the data, in a budget (gpubudget.tensorrt.outputs).

Every callback goes through an ``IOutputAllocator`` C++ trampoline, as ``execute_async_v3``
calls it: NVIDIA's own, of each real binding of tests/bindings.py (TensorRT-RTX 1.7:
``reallocateOutputAsync``, ``notifyShape``; the lean runtimes 10.16 and 11.4 with
``reallocateOutput`` before them), and a stand-in of tests/trt_standin.c whose order cannot be
established. The contexts are fakes.
"""

from __future__ import annotations

import ctypes
import gc
import types
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget import tensorrt as gbt
from gpubudget.tensorrt.outputs import output_allocator_class
from tests import bindings
from tests.helpers import StreamBackend, consistent, fill, holds
from tests.trampoline import OutputTrampoline, _Dims
from tests.trt_fakes import KiB, FakeContext, FakeEngine
from tests.trt_standin import build

trt: Any = pytest.importorskip("tensorrt_rtx_bindings")


@pytest.fixture(params=bindings.IDS, scope="module")
def module(request: pytest.FixtureRequest) -> Any:
    """Each real binding's module in turn."""
    return bindings.load(request.param)


@pytest.fixture(scope="module")
def standins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("standin")
    return {variant: build(variant, directory) for variant in ("drops_stream",)}


def outputs_of(context: Any, module: Any = trt, **kwargs: Any) -> tuple[Any, OutputTrampoline]:
    made = gbt.output_allocator(context, trt_module=module, **kwargs)
    return made, OutputTrampoline(made, module.IOutputAllocator)


def test_buffers_grow_inside_the_budget_and_shapes_are_kept(module: Any) -> None:
    backend = StreamBackend()
    with gpu_budget("64KiB", name="model", backend=backend) as budget:
        context = FakeEngine(module).create_execution_context()
        made, cpp = outputs_of(context, module)
        assert isinstance(made, module.IOutputAllocator) and context.get_output_allocator("y") is made
        assert type(made).argument_order.stream and type(made).argument_order.shape
        first = cpp.reallocate_output_async("y", 0, 1000, 256, 0x5A0)
        assert first is not None and first % 256 == 0 and budget.size_of(first) == 1024
        fill(first, 1000, 0x77)
        cpp.notify_shape("y", (125,))
        assert (made.address("y"), made.shape("y"), made.nbytes("y")) == (first, (125,), 1000)
        assert cpp.reallocate_output_async("y", first, 900, 256, 0x5A0) == first  # big enough
        second = cpp.reallocate_output_async("y", first, 4000, 256, 0x5A0)
        assert second is not None and second != first
        assert budget.used == 4096  # the old buffer is uncharged at once...
        assert holds(first, 1000, 0x77)  # ...but waits for stream 0x5A0's work
        assert budget.allocate(1024, stream=0x5B0) != first
        assert budget.allocate(1024, stream=0x5A0) == first  # same stream: reused at once
        tags = {b.address: b.tag for b in budget.report().live_blocks}
        assert tags[second] == "output:y"
        consistent(budget)


def test_a_refusal_is_a_null_pointer_and_keeps_the_old_buffer(
        module: Any,
        capfd: pytest.CaptureFixture[str]) -> None:
    with gpu_budget("8KiB", name="small", backend="host") as budget:
        context = gbt.execution_context(FakeEngine(module, per_batch=256, max_batch=4),
                                        scratch=False, trt_module=module)
        made, cpp = outputs_of(context, module)
        first = cpp.reallocate_output_async("y", 0, 2 * KiB, 256, 0)
        assert first is not None
        assert cpp.reallocate_output_async("y", first, 64 * KiB, 256, 0) is None
        assert made.address("y") == first and budget.size_of(first) == 2 * KiB
        assert budget.used == 3 * KiB  # the context's 1 KiB and the output's 2 KiB
        assert context.execute_async_v3(0, found=100_000, budget=budget, trt=module) is False
        assert budget.report().denials[0].reason == "over_limit"
    err = capfd.readouterr().err  # only NVIDIA's binding speaks: a null pointer
    assert err and all("could not be interpreted as an int" in line
                       for line in err.splitlines() if line.strip()), err


def test_garbage_and_exceptions_inside_never_escape(
        module: Any, capfd: pytest.CaptureFixture[str]) -> None:
    with gpu_budget("64KiB", name="g", backend="host") as budget:
        context = FakeEngine(module).create_execution_context()
        made, cpp = outputs_of(context, module)
        assert cpp.reallocate_output_async("y", 0, 100, 3, 0) is None  # alignment 3
        assert cpp.reallocate_output_async("y", 0, 2**63, 256, 0) is None  # absurd size
        assert made.reallocate_output_async(b"y", 0, 100, 256, 0) is None  # not a name
        assert made.reallocate_output_async("y", 0, 1.5, 256, 0) is None  # not a size
        made.notify_shape("y", object())  # not a shape: recorded as an error
        original = type(budget).allocate
        try:
            type(budget).allocate = lambda *a, **k: 1 // 0  # type: ignore[method-assign]
            assert cpp.reallocate_output_async("y", 0, 100, 256, 0) is None
        finally:
            type(budget).allocate = original  # type: ignore[method-assign]
        errors = budget.report().callback_errors
        assert any("ZeroDivisionError" in e for e in errors)
        assert any(e.startswith("notify_shape") for e in errors)
        assert budget.used == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ZeroDivisionError" not in err


def test_buffers_are_freed_with_the_context_and_later_calls_refused(module: Any) -> None:
    with gpu_budget("64KiB", name="m", backend="host") as budget:
        context = FakeEngine(module).create_execution_context()
        made, cpp = outputs_of(context, module)
        assert cpp.reallocate_output_async("y", 0, 3000, 256, 0) is not None
    assert budget.report().state == "exited"
    assert cpp.reallocate_output_async("y", 0, 9000, 256, 0) is not None  # after the scope
    assert budget.used == 9216
    del context
    gc.collect()
    assert budget.used == 0 and budget.state == "released"
    assert cpp.reallocate_output_async("y", 0, 100, 256, 0) is None  # the context is gone
    assert budget.report().invalid_frees == 0


@pytest.mark.parametrize("binding", tuple(bindings.LEAN))
def test_tensorrt_10_and_11s_three_slots(binding: str) -> None:
    """TensorRT's own bindings have ``reallocate_output`` (no stream) before the other two."""
    module = bindings.load(binding)
    with gpu_budget("64KiB", backend="host") as budget:
        context = FakeEngine(module).create_execution_context()
        made, cpp = outputs_of(context, module)
        assert isinstance(made, module.IOutputAllocator)
        first = cpp.reallocate_output_async("y", 0, 1000, 256, 0x5A0)
        cpp.notify_shape("y", (4, 2))
        assert first is not None and made.shape("y") == (4, 2)
        older = cpp.reallocate_output("y", first, 5000, 256)  # the form without a stream
        assert older is not None and older != first
        assert budget.size_of(first) == 1024  # no stream: kept until the context ends
        del context
        gc.collect()
        assert budget.used == 0


def test_an_order_not_established_keeps_replaced_buffers_until_the_end(
        standins: dict[str, Any]) -> None:
    module = standins["drops_stream"]
    backend = StreamBackend()
    with gpu_budget("64KiB", backend=backend) as budget:
        context = FakeEngine(trt).create_execution_context()
        made, cpp = outputs_of(context, module)
        assert not type(made).argument_order.stream
        first = cpp.reallocate_output_async("y", 0, 1000, 256, 0x5A0)
        second = cpp.reallocate_output_async("y", first or 0, 8000, 256, 0x5A0)
        assert first is not None and second is not None and budget.size_of(first) == 1024
        assert budget.allocate(1024, stream=0) != first  # never handed on while it may be read
        del context
        gc.collect()
        assert budget.report().invalid_frees == 0
        consistent(budget)


def test_arguments_of_output_allocator() -> None:
    context = FakeEngine(trt).create_execution_context()
    with gpu_budget("64KiB", backend="host"):
        with pytest.raises(TypeError, match="names"):
            gbt.output_allocator(context, "y", trt_module=trt)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="'z'"):
            gbt.output_allocator(context, ["z"], trt_module=trt)
    with pytest.raises(ValueError, match="no IOutputAllocator"):
        output_allocator_class(types.ModuleType("no_outputs"))


def test_a_refused_name_leaves_the_context_as_it_was() -> None:
    """All or nothing: when one of the names is not an output, no output of the context gets
    the new allocator, and nothing stays pinned or charged."""
    with gpu_budget("64KiB", name="m", backend="host") as budget:
        context = FakeEngine(trt).create_execution_context()
        before = context.get_output_allocator("y")
        with pytest.raises(ValueError, match="'z'"):
            gbt.output_allocator(context, ["y", "z"], trt_module=trt)
        assert context.get_output_allocator("y") is before  # "y" was not changed either
    assert budget.state == "released"  # nothing pinned it: the context still lives
    del context

    class Refusing(FakeContext):  # TensorRT refuses the second call, an output all the same
        calls = 0

        def set_output_allocator(self, name: str, output_allocator: Any) -> bool:
            self.calls += 1
            if output_allocator is not None and self.calls == 2:
                return False
            return super().set_output_allocator(name, output_allocator)

    with gpu_budget("64KiB", name="m", backend="host") as budget:
        refusing = Refusing(FakeEngine(trt))
        with pytest.raises(ValueError, match="TensorRT refused"):
            gbt.output_allocator(refusing, ["y", "y"], trt_module=trt)
        assert refusing.get_output_allocator("y") is None  # given back its previous one
    assert budget.state == "released"


def test_a_replaced_buffer_whose_stream_free_fails_is_kept_not_lost(module: Any) -> None:
    """When the old buffer cannot be freed in stream order (no event can be recorded on the
    stream), it stays charged until the context ends, and is freed then."""
    backend = StreamBackend()
    with gpu_budget("64KiB", name="m", backend=backend) as budget:
        context = FakeEngine(module).create_execution_context()
        made, cpp = outputs_of(context, module)
        first = cpp.reallocate_output_async("y", 0, 1000, 256, 0x5A0)
        backend.fail_record = True  # the stream cannot take an event
        second = cpp.reallocate_output_async("y", first or 0, 4000, 256, 0x5A0)
        backend.fail_record = False
        assert first is not None and second not in (None, first)
        assert budget.size_of(first) == 1024  # kept: stream 0x5A0 may still read it
        del context, made, cpp
        gc.collect()
        backend.finish()
        assert budget.used == 0  # every buffer came back with the context
        consistent(budget)


def test_a_kept_buffer_has_the_alignment_asked_for(module: Any) -> None:
    with gpu_budget("64KiB", backend="host") as budget:
        assert budget.allocate(256, 256) is not None  # the next block is 256-aligned only
        context = FakeEngine(module).create_execution_context()
        made, cpp = outputs_of(context, module)
        first = cpp.reallocate_output_async("y", 0, 4000, 256, 0)
        assert first is not None and first % 4096
        again = cpp.reallocate_output_async("y", first, 1000, 4096, 0)
        assert again is not None and again % 4096 == 0
        del context, made, cpp
        gc.collect()
        consistent(budget)


def test_a_shape_that_is_not_one_is_an_error_not_kept(
        module: Any, capfd: pytest.CaptureFixture[str]) -> None:
    """``notify_shape`` through NVIDIA's trampoline with a garbage ``Dims``: a rank above 8
    (the trampoline then reads past the struct: NVIDIA's, not ours) or a negative extent is
    recorded as an error, and the last good shape stays."""
    import ctypes

    from tests.trampoline import _Dims

    class Wide(ctypes.Structure):  # room for what the trampoline reads past eight extents
        _fields_ = [("nbDims", ctypes.c_int32), ("d", ctypes.c_int64 * 16)]

    with gpu_budget("64KiB", name="g", backend="host") as budget:
        context = FakeEngine(module).create_execution_context()
        made, cpp = outputs_of(context, module)
        cpp.notify_shape("y", (3, 4))
        for rank, first in ((9, 1), (2, -1)):
            dims = Wide(rank, (ctypes.c_int64 * 16)(first, *[1] * 15))
            cpp._shape(cpp.cpp, b"y", ctypes.cast(ctypes.pointer(dims), ctypes.POINTER(_Dims)))
        assert made.shape("y") == (3, 4)
        errors = [e for e in budget.report().callback_errors if e.startswith("notify_shape")]
        assert len(errors) == 2 and all("not an output's shape" in e for e in errors)
        del context, made, cpp
    assert "Traceback" not in capfd.readouterr().err


def test_an_unknown_rank_is_recorded_as_unknown_not_as_a_scalar(module: Any) -> None:
    """A ``Dims`` with ``nbDims`` -1 (TensorRT's "unknown rank") through NVIDIA's trampoline:
    the shape is recorded as unknown (``None``), not as ``()``, and it is not an error."""
    with gpu_budget("64KiB", name="u", backend="host") as budget:
        context = FakeEngine(module).create_execution_context()
        made, cpp = outputs_of(context, module)
        cpp.notify_shape("y", ())
        assert made.shape("y") == ()  # a scalar, known
        cpp.notify_shape("y", (3, 4))
        cpp._shape(cpp.cpp, b"y", ctypes.byref(_Dims(-1, (ctypes.c_int64 * 8)(5, 5))))
        assert made.shape("y") is None
        assert budget.report().callback_errors == ()
        cpp.notify_shape("y", (2,))
        assert made.shape("y") == (2,)
        del context, made, cpp
