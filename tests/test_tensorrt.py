"""The TensorRT adapter, driven through NVIDIA's own trampolines: every allocator test runs on
each real binding of tests/bindings.py (lean 10.16, lean 11.4, TensorRT-RTX 1.7); builders and
runtimes, which the lean runtime cannot make without a GPU, on TensorRT-RTX."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import types
from typing import Any

import pytest

from gpubudget import BudgetError, gpu_budget, label
from gpubudget import tensorrt as gbt
from tests import bindings
from tests.helpers import fill, holds, subprocess_env
from tests.trampoline import Trampoline, verify_slots

trt: Any = pytest.importorskip("tensorrt_rtx_bindings")
KiB = 1024
LOGGER = trt.Logger(trt.Logger.ERROR)


@pytest.fixture(params=bindings.IDS, scope="module")
def module(request: pytest.FixtureRequest) -> Any:
    """Each real binding's module in turn, its slots verified."""
    found = bindings.load(request.param)
    verify_slots(found, "IGpuAsyncAllocator", bindings.STREAM_INDEX[request.param])
    verify_slots(found, "IGpuAllocator")
    return found


def test_allocator_is_a_real_igpuallocator_one_per_budget(module: Any) -> None:
    with gpu_budget("1MiB") as budget:
        alloc = gbt.allocator(trt_module=module)
        assert isinstance(alloc, module.IGpuAllocator)
        assert gbt.allocator(budget, trt_module=module.__name__) is alloc
        assert alloc.budget is budget


def test_allocation_through_the_trampoline_charges_and_aligns(module: Any) -> None:
    with gpu_budget("64KiB", name="model") as budget:
        cpp = Trampoline(gbt.allocator(trt_module=module))
        address = cpp.allocate(1000, 0, 0)
        assert address is not None and budget.size_of(address) == 1024
        fill(address, 1000, 0x11)
        aligned = cpp.allocate_async(100, 4096, 0, 5)
        assert aligned is not None and aligned % 4096 == 0
        assert budget.used == 1024 + 4096
        assert cpp.deallocate(address) is True
        assert cpp.deallocate(address) is False  # double free
        assert cpp.deallocate_async(aligned, 5) is True
        assert budget.used == 0


def test_denials_are_null_pointers_and_only_tensorrt_prints(
        module: Any, capfd: pytest.CaptureFixture[str]) -> None:
    with gpu_budget("8KiB", name="tiny") as budget:
        cpp = Trampoline(gbt.allocator(trt_module=module))
        assert cpp.allocate(16 * KiB) is None  # over the limit
        assert cpp.allocate(0) is None  # size 0: None, as NVIDIA asks, and no denial
        assert cpp.allocate(100, 3) is None  # alignment not a power of two
        assert cpp.deallocate(0xDEAD000) is False
        assert cpp.deallocate(0) is True  # the null of a denial: nothing to free
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all("could not be interpreted as an int" in line for line in lines), err
    assert [d.reason for d in budget.report().denials] == ["over_limit", "invalid_alignment"]
    assert budget.report().invalid_frees == 1


def test_routing_one_runtime_two_sibling_models() -> None:
    with gpu_budget("1MiB", name="shared") as pool:
        runtime = gbt.Runtime(LOGGER, trt_module=trt)
        cpp = Trampoline(gbt.allocator_of(runtime))
        with gpu_budget("256KiB", name="detector") as detector:
            a = cpp.allocate(100 * KiB)
        with gpu_budget("128KiB", name="classifier") as classifier:
            b = cpp.allocate(50 * KiB)
            assert cpp.allocate(100 * KiB) is None  # over the classifier's cap
        c = cpp.allocate(10 * KiB)  # no child active: the bound budget
    assert None not in (a, b, c)
    assert (detector.used, classifier.used) == (100 * KiB, 50 * KiB)
    assert pool.used == 160 * KiB
    assert classifier.report().denials[0].refused_by == "classifier"
    for address in (a, b, c):
        assert address is not None and cpp.deallocate(address)
    assert pool.used == 0
    del runtime, cpp
    gc.collect()
    assert pool.state == "released"


def test_unrelated_inner_budget_does_not_capture_calls() -> None:
    with gpu_budget("1MiB", name="a") as a:
        runtime = gbt.Runtime(LOGGER, trt_module=trt)  # keeps "a" serving after its block
        cpp = Trampoline(gbt.allocator_of(runtime))
    with gpu_budget("1MiB", name="elsewhere") as elsewhere:
        block = cpp.allocate(KiB)  # the bound budget, not the unrelated active one
        assert block is not None and a.used == KiB and elsewhere.used == 0
        assert cpp.deallocate(block)


def test_calls_from_threads_without_context_route_to_the_bound_budget(module: Any) -> None:
    results: list[int | None] = []
    with gpu_budget("1MiB", name="pool") as pool:
        with gpu_budget("256KiB", name="child") as child:
            cpp = Trampoline(gbt.allocator(trt_module=module))

            def tensorrt_thread() -> None:  # a thread that never saw the caller's context
                for _ in range(50):
                    results.append(cpp.allocate(KiB))

            threads = [threading.Thread(target=tensorrt_thread) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    blocks = [r for r in results if r is not None]
    assert len(blocks) == 200 and len(set(blocks)) == 200
    assert child.used == pool.used == 200 * KiB
    freed: list[bool] = []
    threads = [
        threading.Thread(target=lambda part=part: freed.extend(cpp.deallocate(b) for b in part))
        for part in (blocks[:100], blocks[100:])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(freed) and len(freed) == 200 and pool.used == 0


def test_reallocate_in_place_move_and_refuse(module: Any) -> None:
    with gpu_budget("64KiB", name="r") as budget:
        cpp = Trampoline(gbt.allocator(trt_module=module))
        block = cpp.allocate(KiB, 0, 1)  # RESIZABLE arrives as bit value 1
        assert block is not None
        fill(block, KiB, 0x42)
        assert cpp.reallocate(block, 0, 4 * KiB) == block  # in place
        blocker = cpp.allocate(KiB)
        moved = cpp.reallocate(block, 0, 8 * KiB)
        assert moved is not None and moved != block and holds(moved, KiB, 0x42)
        assert cpp.reallocate(moved, 0, 1 << 20) is None  # over the limit: old block stays
        assert budget.size_of(moved) == 8 * KiB and holds(moved, KiB, 0x42)
        assert cpp.reallocate(0x1234, 0, KiB) is None  # not ours
        assert blocker is not None and cpp.deallocate(blocker) and cpp.deallocate(moved)


def test_internal_errors_are_caught_recorded_and_denied(
        module: Any, capfd: pytest.CaptureFixture[str]) -> None:
    with gpu_budget("64KiB", name="broken") as budget:
        alloc = gbt.allocator(trt_module=module)
        cpp = Trampoline(alloc)

        def explode(*args: object, **kwargs: object) -> None:
            raise RuntimeError("arena on fire")

        budget_type = type(budget)
        original = budget_type.allocate
        try:
            budget_type.allocate = explode  # type: ignore[method-assign, assignment]
            assert cpp.allocate(KiB) is None
        finally:
            budget_type.allocate = original  # type: ignore[method-assign]
    report = budget.report()
    assert report.callback_errors == ("allocate_async: RuntimeError: arena on fire",)
    err = capfd.readouterr().err
    assert "arena on fire" not in err and "Traceback" not in err


def test_builder_runtime_attach_and_allocator_of() -> None:
    with gpu_budget("1MiB", name="b") as budget:
        builder = gbt.Builder(LOGGER, trt_module=trt)
        runtime = gbt.Runtime(LOGGER)  # first importable module: tensorrt_rtx_bindings here
        mine = gbt.attach(trt.Runtime(LOGGER))
        assert isinstance(builder, trt.Builder) and isinstance(runtime, trt.Runtime)
        allocators = [gbt.allocator_of(obj) for obj in (builder, runtime, mine)]
        assert all(isinstance(a, trt.IGpuAllocator) and a.budget is budget for a in allocators)
        assert len({id(a) for a in allocators}) == 3  # one each: they carry the phase
        assert [a.phase for a in allocators] == ["build", "runtime", "runtime"]
        assert gbt.allocator_of(trt.Runtime(LOGGER)) is None
        assert gbt.allocator_of(42) is None
    assert budget.report().state == "exited"  # three pins
    del builder, runtime, mine
    gc.collect()
    assert budget.report().state == "released"


def test_phases_and_labels_tag_blocks() -> None:
    with gpu_budget("1MiB", name="tags") as budget:
        builder = Trampoline(gbt.allocator_of(gbt.Builder(LOGGER, trt_module=trt)))
        runtime_obj = gbt.Runtime(LOGGER, trt_module=trt)
        runtime = Trampoline(gbt.allocator_of(runtime_obj))
        a = builder.allocate(1000)
        b = runtime.allocate(2000)
        with label("detector/weights"):
            c = runtime.allocate(3000)
        seen: list[int | None] = []
        original = trt.Runtime.deserialize_cuda_engine
        try:  # stand in for TensorRT's deserialization, which allocates through the runtime
            trt.Runtime.deserialize_cuda_engine = lambda self, plan: seen.append(runtime.allocate(4000))
            runtime_obj.deserialize_cuda_engine(b"plan")
        finally:
            trt.Runtime.deserialize_cuda_engine = original
        d = runtime.allocate(5000)
    tags = {block.address: block.tag for block in budget.report().live_blocks}
    assert [tags[x] for x in (a, b, c, seen[0], d)] == [  # type: ignore[index]
        "build", "runtime", "detector/weights", "deserialize", "runtime"
    ]
    usage = {u.tag: (u.live, u.peak) for u in budget.report().by_tag}
    assert usage["deserialize"] == (4096, 4096) and usage["build"] == (1024, 1024)


def test_outside_a_budget_is_a_budget_error() -> None:
    for make in (gbt.Builder, gbt.Runtime):
        with pytest.raises(BudgetError, match="gpu_budget"):
            make(LOGGER, trt_module=trt)
    with pytest.raises(BudgetError):
        gbt.attach(trt.Runtime(LOGGER))
    with pytest.raises(BudgetError):
        gbt.allocator(trt_module=trt)
    with pytest.raises(TypeError, match="budget must be"):
        gbt.allocator("4GiB", trt_module=trt)  # type: ignore[arg-type]


def test_module_choice_errors() -> None:
    with pytest.raises(ImportError):
        gbt.load_module("tensorrt_does_not_exist")
    with pytest.raises(ValueError, match="IGpuAllocator"):
        gbt.load_module(os)
    with pytest.raises(TypeError, match="trt_module"):
        gbt.load_module(3)  # type: ignore[arg-type]


def test_a_tensorrt_older_than_10_1_is_refused_in_one_line_naming_what_it_lacks() -> None:
    old = types.ModuleType("tensorrt")  # TensorRT 10.0: the allocator, not the _v2 sizes
    old.__version__ = "10.0.1"  # type: ignore[attr-defined]
    old.IGpuAllocator = trt.IGpuAllocator  # type: ignore[attr-defined]
    old.ICudaEngine = type("ICudaEngine", (), {"device_memory_size": 0})  # type: ignore[attr-defined]
    old.IExecutionContext = type("IExecutionContext", (), {})  # type: ignore[attr-defined]
    with pytest.raises(ValueError) as raised:
        gbt.load_module(old)
    message = str(raised.value)
    assert message.startswith("tensorrt 10.0.1 is older than gpubudget supports (TensorRT 10.1)")
    assert "\n" not in message
    for name in ("ICudaEngine.device_memory_size_v2", "ICudaEngine.weight_streaming_budget_v2",
                 "IExecutionContext.set_device_memory"):
        assert name in message


def test_every_binding_and_front_end_is_looked_for() -> None:
    assert set(gbt.MODULE_NAMES) >= {"tensorrt", "tensorrt_bindings", "tensorrt_rtx",
                                     "tensorrt_rtx_bindings", "tensorrt_lean",
                                     "tensorrt_lean_bindings"}
    assert gbt.MODULE_NAMES.index("tensorrt") == 0  # the full TensorRT first


def test_lifetime_after_scope_and_references_dropped() -> None:
    with gpu_budget("64KiB", name="life") as budget:
        runtime = gbt.Runtime(LOGGER, trt_module=trt)
    cpp = Trampoline(gbt.allocator_of(runtime))
    weights = cpp.allocate(16 * KiB)  # e.g. an engine deserialized later
    del runtime  # the runtime goes; the "engine" keeps its block
    gc.collect()
    assert budget.state == "exited" and weights is not None
    context = cpp.allocate(40 * KiB)  # create_execution_context later: still within the limit
    assert context is not None and cpp.allocate(16 * KiB) is None
    assert cpp.deallocate(context) and cpp.deallocate(weights)
    assert budget.report().state == "released"
    assert cpp.allocate(KiB) is None  # a released budget answers null, never crashes


@pytest.mark.parametrize("binding", bindings.IDS)
def test_interpreter_exit_with_live_objects_is_silent(binding: str, tmp_path: Any) -> None:
    """A program of its own, importing the binding by its real name."""
    bindings.load(binding)  # skips (or fails, in CI) where it is not installed
    name, path = (("tensorrt_rtx_bindings", "") if binding == bindings.RTX else
                  ("tensorrt_lean_bindings", str(bindings.path_of(binding))))
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent(f"""
        import {name} as trt
        from gpubudget import gpu_budget
        from gpubudget import tensorrt as gbt
        from tests.trampoline import Trampoline
        logger = trt.Logger(trt.Logger.ERROR)
        pool = gpu_budget("1MiB", name="pool").__enter__()
        if hasattr(trt, "Builder"):  # TensorRT-RTX: a runtime and a builder without a GPU
            runtime = gbt.Runtime(logger, trt_module=trt)
            builder = gbt.Builder(logger, trt_module=trt)
            cpp = Trampoline(gbt.allocator_of(runtime))
        else:
            cpp = Trampoline(gbt.allocator(trt_module=trt))
        blocks = [cpp.allocate(4096) for _ in range(10)]
        assert all(blocks)
        print("done", trt.__name__)
    """))
    env = subprocess_env(GPUBUDGET_BACKEND="host")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env["PYTHONPATH"]) if p)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"done {name}\n", "")


@pytest.mark.parametrize("binding", tuple(bindings.LEAN))
def test_a_lean_runtime_has_no_builder_and_says_so(binding: str) -> None:
    module = bindings.load(binding)
    with gpu_budget("1MiB") as budget:
        with pytest.raises(ValueError, match=f"Builder\\(\\): {module.__name__} has no Builder"):
            gbt.Builder(LOGGER, trt_module=module)
    assert budget.report().state == "released"  # nothing was attached, nothing pinned


def test_real_objects_and_python_ones_are_never_called_unusable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorRT-RTX makes real runtimes and builders without a GPU: their C++ objects are
    recognised as real; a Python object is not TensorRT's to judge (the bogus lean Runtime is
    in tests/test_tensorrt_nogpu.py, in a program of its own)."""
    from gpubudget.tensorrt import vtable

    for obj in (trt.Runtime(LOGGER), trt.Builder(LOGGER), trt.Logger()):
        assert vtable.unusable(obj) is None, obj
    assert vtable.unusable(object()) is None
    with gpu_budget("1MiB"):
        assert gbt.allocator_of(gbt.attach(trt.Runtime(LOGGER))) is not None
    monkeypatch.setattr(vtable, "_MEM", "/nonexistent/mem")  # the memory map instead
    assert vtable.unusable(trt.Runtime(LOGGER)) is None
    monkeypatch.setattr(vtable, "MAPS", "/nonexistent/maps")
    assert vtable.unusable(trt.Runtime(LOGGER)) is None  # nothing can be said: not refused
