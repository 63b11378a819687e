"""Where each binding puts the stream: asked of the binding, and stream-ordered reuse that is
safe with either order (and with none).

Each binding is driven through its C++ virtual methods as TensorRT drives it:

- NVIDIA's own trampolines: TensorRT's lean runtime 10.16, ``allocate_async(size, alignment,
  stream, flags)``; lean 11.4 and TensorRT-RTX 1.7, ``allocate_async(size, alignment, flags,
  stream)`` (tests/bindings.py);
- stand-ins where no real binding behaves so (``tests/trt_standin.c``: NVIDIA's layout, not
  NVIDIA's code): one whose order cannot be established (it drops the stream), one that drops
  the stream of a free, and TensorRT 8's layout.
"""

from __future__ import annotations

import gc
import types
from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget import tensorrt as gbt
from gpubudget.tensorrt import vtable
from gpubudget.tensorrt.order import allocator_order, output_order
from gpubudget.units import KiB
from tests import bindings
from tests.bindings import binding  # noqa: F401 - the fixture
from tests.helpers import StreamBackend, consistent, fill, holds
from tests.trampoline import Trampoline, verify_slots
from tests.trt_standin import build

BINDINGS = (*bindings.IDS, "drops_stream")


@pytest.fixture(scope="module")
def standins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("standin")
    return {variant: build(variant, directory)
            for variant in ("drops_stream", "drops_free_stream", "trt8")}


def module_for(name: str, standins: dict[str, Any]) -> Any:
    if name in bindings.IDS:
        module = bindings.load(name)
        verify_slots(module, "IGpuAsyncAllocator", bindings.STREAM_INDEX[name])
        return module
    return standins[name]


def test_the_order_found_for_each_real_binding(binding: str) -> None:  # noqa: F811
    module = bindings.load(binding)
    order = gbt.argument_order(module)
    index = bindings.STREAM_INDEX[binding]
    assert (order.stream_index, order.frees, order.resize) == (index, True, True)
    expected = "stream, flags" if index == 2 else "flags, stream"
    assert f"allocate_async(size, alignment, {expected})" in order.found
    # found once, when the class was made: the class carries it
    with gpu_budget("64KiB", backend="host"):
        alloc = gbt.allocator(trt_module=module)
        assert type(alloc).argument_order is order


def test_an_order_that_cannot_be_established_is_the_safe_reading(
        standins: dict[str, Any]) -> None:
    unclear = gbt.argument_order(standins["drops_stream"])
    assert (unclear.stream_index, unclear.resize, unclear.known) == (None, False, False)
    assert "not established" in unclear.found and "safe reading" in unclear.found
    assert gbt.allocator_of(object()) is None


@pytest.mark.parametrize("binding", BINDINGS)
@pytest.mark.parametrize(("stream_a", "flags"), [(0, 0), (0, 1), (0x5A0, 0), (0x5A0, 1)])
def test_a_block_freed_on_a_stream_waits_for_it_before_another_stream_gets_it(
        binding: str, stream_a: int, flags: int, standins: dict[str, Any]) -> None:
    module = module_for(binding, standins)
    known = gbt.argument_order(module).known
    stream_b = 0x5B0
    backend = StreamBackend()
    with gpu_budget("64KiB", name="pool", backend=backend) as pool:
        cpp = Trampoline(gbt.allocator(trt_module=module))
        block = cpp.allocate_async(4 * KiB, 0, flags, stream_a)
        assert block is not None
        fill(block, 4 * KiB, 0xA5)
        assert cpp.deallocate_async(block, stream_a)  # stream A's kernels may still read it
        other = cpp.allocate_async(4 * KiB, 0, flags, stream_b)
        assert other is not None and other != block  # never to stream B before A is done
        assert holds(block, 4 * KiB, 0xA5)
        again = cpp.allocate_async(4 * KiB, 0, flags, stream_a)
        assert again is not None
        if known:
            assert again == block  # reused at once on A: A's work runs in order
        else:
            assert again != block  # the safe reading: no stream is trusted, so no reuse
            backend.finish(stream_a)  # A's work is done: now anyone may have it
            after = cpp.allocate_async(4 * KiB, 0, flags, stream_b)
            assert after == block
            assert cpp.deallocate_async(after, stream_b)
        consistent(pool)
        for address in (other, again):
            assert cpp.deallocate_async(address, stream_b)
        backend.finish()
    assert pool.report().invalid_frees == 0


@pytest.mark.parametrize("binding", BINDINGS)
def test_synchronous_calls_carry_the_default_stream_in_either_order(
        binding: str, standins: dict[str, Any]) -> None:
    module = module_for(binding, standins)
    backend = StreamBackend()
    with gpu_budget("64KiB", backend=backend) as pool:
        cpp = Trampoline(gbt.allocator(trt_module=module))
        block = cpp.allocate(4 * KiB, 0, 1)  # RESIZABLE: must never be read as stream 1
        assert block is not None and cpp.deallocate_async(block, 1)  # freed on stream 1
        other = cpp.allocate(4 * KiB, 0, 1)
        assert other is not None and other != block
        assert cpp.deallocate(other)
        backend.finish()
        consistent(pool)


@pytest.mark.parametrize("binding", BINDINGS)
def test_reallocate_is_trusted_only_where_its_order_was_found(
        binding: str, standins: dict[str, Any]) -> None:
    module = module_for(binding, standins)
    with gpu_budget("64KiB", backend="host") as pool:
        cpp = Trampoline(gbt.allocator(trt_module=module))
        block = cpp.allocate(KiB, 0, 1)
        assert block is not None
        fill(block, KiB, 0x3C)
        grown = cpp.reallocate(block, 0, 4 * KiB)
        if gbt.argument_order(module).resize:
            assert grown == block and pool.size_of(block) == 4 * KiB
        else:
            assert grown is None and pool.size_of(block) == KiB  # TensorRT keeps its block
        assert holds(block, KiB, 0x3C) and cpp.deallocate(block)
        consistent(pool)


def test_a_pure_python_stand_in_gets_the_safe_reading() -> None:
    """A module whose allocator classes are plain Python (no C++ object behind them): nothing
    can be called, so no stream is trusted."""
    fake = types.ModuleType("fake_tensorrt")

    class IGpuAllocator:
        def __init__(self) -> None:
            pass

    class IGpuAsyncAllocator(IGpuAllocator):
        pass

    fake.IGpuAllocator = IGpuAllocator  # type: ignore[attr-defined]
    fake.IGpuAsyncAllocator = IGpuAsyncAllocator  # type: ignore[attr-defined]
    order = gbt.argument_order(fake)
    assert not order.known and "not defined by an extension module" in order.found
    backend = StreamBackend()
    with gpu_budget("64KiB", backend=backend):
        alloc = gbt.allocator(trt_module=fake)
        block = alloc.allocate_async(4 * KiB, 0, 0x5A0, 0x5A0)
        assert block is not None and alloc.deallocate_async(block, 0x5A0)
        assert alloc.allocate_async(4 * KiB, 0, 0x5A0, 0x5A0) != block
        assert alloc.reallocate(block, 0, KiB) is None


def test_the_probe_is_silent_and_never_calls_a_layout_it_does_not_know(
        binding: str, capfd: pytest.CaptureFixture[str],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    trt: Any = bindings.load(binding)
    for base in (trt.IGpuAsyncAllocator, trt.IGpuAllocator):
        assert allocator_order(base).found  # ran again, from scratch
    assert output_order(trt.IOutputAllocator).stream
    # IOutputAllocator has six or seven virtual methods: the allocator probe calls no slot 7
    wrong = allocator_order(trt.IOutputAllocator)
    assert not wrong.known and "virtual methods, not 9" in wrong.found
    monkeypatch.setattr(vtable, "MAPS", "/nonexistent/maps")
    blind = allocator_order(trt.IGpuAsyncAllocator)
    assert not blind.known and "memory map cannot be read" in blind.found
    assert capfd.readouterr() == ("", "")


def test_inspect_vtable_checks_before_it_reads(binding: str) -> None:  # noqa: F811
    trt: Any = bindings.load(binding)

    class Probe(trt.IGpuAsyncAllocator):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IGpuAsyncAllocator.__init__(self)

    probe = Probe()
    table = vtable.inspect_vtable(probe, trt.IGpuAsyncAllocator, "GpuAsyncAllocator")
    assert isinstance(table, vtable.VTable) and len(table.slots) == 9
    assert table.class_name.endswith("PyGpuAsyncAllocatorE")
    assert Path(table.library).name.startswith("tensorrt_rtx" if "rtx" in binding
                                               else "tensorrt_lean")
    assert "not a OutputAllocator" in str(
        vtable.inspect_vtable(probe, trt.IGpuAsyncAllocator, "OutputAllocator"))
    assert "not an instance" in str(vtable.inspect_vtable(object(), trt.IGpuAsyncAllocator, "x"))


@pytest.mark.parametrize("binding", BINDINGS)
def test_garbage_exceptions_and_calls_after_the_end_in_either_order(
        binding: str, standins: dict[str, Any], capfd: pytest.CaptureFixture[str]) -> None:
    module = module_for(binding, standins)
    with gpu_budget("64KiB", name="g", backend="host") as budget:
        cpp = Trampoline(gbt.allocator(trt_module=module))
        assert cpp.allocate_async(2**63, 0, 1, 0x5A0) is None  # absurd size
        assert cpp.allocate_async(KiB, 3, 0, 0x5A0) is None  # alignment not a power of two
        denials = len(budget.report().denials)
        assert cpp.allocate_async(0, 256, 0, 0x5A0) is None  # nothing: answered None...
        assert len(budget.report().denials) == denials  # ...as NVIDIA asks, not a denial
        assert cpp.deallocate_async(0, 0x5A0) is True  # the null a denial gave: a no-op
        assert cpp.deallocate_async(0xDEAD000, 0x5A0) is False  # not ours
        assert cpp.reallocate(0xDEAD000, 0, KiB) is None
        original = type(budget).allocate
        try:
            type(budget).allocate = lambda *a, **k: 1 // 0  # type: ignore[method-assign]
            assert cpp.allocate_async(KiB, 0, 0, 0x5A0) is None
        finally:
            type(budget).allocate = original  # type: ignore[method-assign]
        assert any("ZeroDivisionError" in e for e in budget.report().callback_errors)
        late = cpp.allocate_async(KiB, 0, 0, 0x5A0)
    assert late is not None  # after the scope: the bound budget still serves
    assert cpp.deallocate_async(late, 0x5A0) and budget.report().state == "released"
    assert cpp.allocate_async(KiB, 0, 0, 0x5A0) is None  # released: a null pointer, no crash
    assert cpp.deallocate_async(late, 0x5A0) is False
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ZeroDivisionError" not in err
    assert {d.reason for d in budget.report().denials} >= {"over_limit", "invalid_alignment"}
    assert budget.report().invalid_frees == 2  # 0xDEAD000 and the late one twice: not the null


def test_tensorrt_8s_layout_is_never_called(standins: dict[str, Any],
                                            capfd: pytest.CaptureFixture[str]) -> None:
    """TensorRT 8.5/8.6's IOutputAllocator has no IVersionedInterface before its methods: its
    fifth virtual method (slot 4), where TensorRT 10 has its first allocator method, is the
    deleting destructor. Calling it would free the probe under pybind11's feet (a double free
    later). The probe must recognise the layout and call nothing."""
    old = standins["trt8"]
    found = output_order(old.IOutputAllocator)
    assert old.deletions() == 0  # no destructor was called
    assert not found.stream and not found.shape and "IVersionedInterface" in found.found
    order = gbt.argument_order(old)
    assert not order.known and "IVersionedInterface" in order.found
    assert old.deletions() == 0
    from tests.trt_fakes import FakeEngine

    with gpu_budget("64KiB", backend="host") as budget:  # still usable: the safe reading
        context = FakeEngine(bindings.load(bindings.RTX)).create_execution_context()
        made = gbt.output_allocator(context, trt_module=old)
        first = made.reallocate_output("y", 0, 1000, 256)
        assert first is not None and made.reallocate_output("y", first, 5000, 256) != first
        assert budget.size_of(first) == 1024  # kept until the context ends
        del context
        gc.collect()
        assert budget.used == 0
    assert old.deletions() == 0
    assert capfd.readouterr() == ("", "")


def test_a_free_whose_stream_does_not_arrive_is_ordered_on_its_allocations_stream(
        standins: dict[str, Any]) -> None:
    """``deallocate_async`` checked as ``allocate_async`` is: a binding that loses the stream
    of a free (here: always 0) must not have the block reused at once "on stream 0", nor
    once stream 0 is idle, while stream A, which the block was allocated for, still uses it.
    The block is freed on the stream it was allocated for."""
    module = standins["drops_free_stream"]
    order = gbt.argument_order(module)
    assert (order.frees, order.stream_index) == (False, 3)
    assert "deallocate_async does not pass" in order.found
    backend = StreamBackend()
    with gpu_budget("64KiB", backend=backend) as pool:
        cpp = Trampoline(gbt.allocator(trt_module=module))
        block = cpp.allocate_async(4 * KiB, 0, 0, 0x5A0)
        assert block is not None
        fill(block, 4 * KiB, 0xA5)  # stream A's kernels may still read it
        assert cpp.deallocate_async(block, 0x5A0)  # arrives as a free on stream 0
        other = cpp.allocate(4 * KiB, 0, 0)  # the synchronous allocate: stream 0
        assert other is not None and other != block
        backend.finish(0)  # stream 0 is idle: A is not
        later = cpp.allocate_async(4 * KiB, 0, 0, 0x5B0)
        assert later is not None and later != block
        assert holds(block, 4 * KiB, 0xA5)
        again = cpp.allocate_async(4 * KiB, 0, 0, 0x5A0)
        assert again == block  # on A itself: at once, A's work runs in order
        grown = cpp.reallocate(again, 0, 8 * KiB)  # a moved block keeps its stream
        assert grown is not None
        for address in (other, later):
            assert cpp.deallocate(address)
        assert cpp.deallocate_async(grown, 0x5A0)
        assert cpp.allocate_async(8 * KiB, 0, 0, 0x5B0) != grown  # A still busy
        backend.finish()
        consistent(pool)
