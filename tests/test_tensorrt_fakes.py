"""The fakes the sizing tests use have TensorRT's names: every public method or attribute of
``FakeEngine`` and ``FakeContext`` exists on TensorRT-RTX's ``ICudaEngine`` and
``IExecutionContext`` (which cannot be made here: making them needs a GPU)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.trt_fakes import FakeContext, FakeEngine

trt: Any = pytest.importorskip("tensorrt_rtx_bindings")

# what the fakes keep for the tests themselves, not TensorRT API
TEST_ONLY = {"trt", "per_batch", "max_batch", "weights", "weights_at", "allocator", "strategies",
             "live_contexts", "memory", "batch", "output_allocators"}


def public(obj: Any) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")} - TEST_ONLY


def test_fake_engines_use_the_real_names() -> None:
    engine = FakeEngine(trt)
    missing = sorted(n for n in public(engine) if not hasattr(trt.ICudaEngine, n))
    assert missing == []
    assert len(public(engine)) >= 15  # the names the sizing logic calls


def test_fake_contexts_use_the_real_names() -> None:
    context = FakeEngine(trt).create_execution_context()
    assert isinstance(context, FakeContext)
    missing = sorted(n for n in public(context) if not hasattr(trt.IExecutionContext, n))
    assert missing == []


def test_the_real_enums_the_adapter_passes_exist() -> None:
    assert trt.ExecutionContextAllocationStrategy.USER_MANAGED is not None
    assert {"INPUT", "OUTPUT"} <= set(trt.TensorIOMode.__members__)
    assert "TOTAL_WEIGHTS_SIZE" in trt.EngineStat.__members__
    assert {"MALFORMED_ENGINE", "VERSION_MISMATCH"} <= set(
        trt.EngineInvalidityDiagnostics.__members__)
