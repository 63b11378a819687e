"""The TensorRT adapter: a context-aware ``IGpuAllocator`` that routes to budgets.

Usage::

    import tensorrt as trt
    from gpubudget import gpu_budget
    from gpubudget import tensorrt as gbt

    with gpu_budget("4GiB", name="shared") as pool:
        runtime = gbt.Runtime(logger)                     # allocator attached, lifetime tracked
        with gpu_budget("2GiB", name="detector"):
            detector = runtime.deserialize_cuda_engine(plan_a)   # charged to detector and pool

The parts: :mod:`~gpubudget.tensorrt.module` finds the TensorRT module,
:mod:`~gpubudget.tensorrt.order` asks its binding in which order it passes arguments,
:mod:`~gpubudget.tensorrt.callbacks` is the allocator (routing, answers, never raising) and
:mod:`~gpubudget.tensorrt.lifetime` keeps allocators and budgets alive as long as TensorRT
may call them. The other doors of TensorRT: :mod:`~gpubudget.tensorrt.contexts`
(execution-context memory and scratch), :mod:`~gpubudget.tensorrt.outputs` (outputs whose
shape depends on the data), :mod:`~gpubudget.tensorrt.weights` (weight streaming, and
TensorRT-RTX's weight unload and load), and :mod:`~gpubudget.tensorrt.fit` (what an engine
needs, before loading it). This file adds ``Builder`` and ``Runtime``, which attach an
allocator and tag allocations with their phase ("build", "deserialize", "runtime").

TensorRT's trampoline prints ``[ERROR] Return value of allocate() could not be interpreted as
an int`` when it receives ``None``; that line is TensorRT's, and means "denied".
"""

from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import Any

from .callbacks import argument_order as _argument_order
from .contexts import ContextMemory, context_memory, execution_context, fit_shapes
from .fit import EngineNeeds, PlanError, engine_needs, plan_needs
from .lifetime import allocator, allocator_of, attach, attach_as, require_budget
from .module import MODULE_NAMES, load_module
from .order import AllocatorOrder, OutputOrder
from .outputs import output_allocator
from .weights import WeightStreaming, load_weights, stream_weights, unload_weights

__all__ = [
    "MODULE_NAMES",
    "AllocatorOrder",
    "Builder",
    "ContextMemory",
    "EngineNeeds",
    "OutputOrder",
    "PlanError",
    "Runtime",
    "WeightStreaming",
    "allocator",
    "allocator_of",
    "argument_order",
    "attach",
    "context_memory",
    "engine_needs",
    "execution_context",
    "fit_shapes",
    "load_module",
    "load_weights",
    "output_allocator",
    "plan_needs",
    "stream_weights",
    "unload_weights",
]

_lock = threading.Lock()
# a child forked while another thread held it must not wait for that thread
os.register_at_fork(after_in_child=getattr(_lock, "_at_fork_reinit"))
_runtimes: dict[str, type] = {}


def _runtime_class(module: ModuleType) -> type:
    """The module's ``Runtime`` with deserialization tagged as the "deserialize" phase."""
    with _lock:
        cls = _runtimes.get(module.__name__)
        if cls is None:
            base = module.Runtime

            def deserialize_cuda_engine(self: Any, *args: Any, **kwargs: Any) -> Any:
                alloc = allocator_of(self)
                if alloc is None:
                    return base.deserialize_cuda_engine(self, *args, **kwargs)
                with alloc.lock:
                    alloc.deserializing += 1
                    alloc.phase = "deserialize"
                try:
                    return base.deserialize_cuda_engine(self, *args, **kwargs)
                finally:
                    with alloc.lock:
                        alloc.deserializing -= 1
                        if not alloc.deserializing:
                            alloc.phase = "runtime"

            def __del__(self: Any) -> None:
                # TensorRT's deprecated Runtime.__del__ would run (and warn) as the
                # finalizer of a Python subclass; pybind11's own deallocation is what frees it.
                pass

            cls = _runtimes[module.__name__] = type("Runtime", (base,), {
                "deserialize_cuda_engine": deserialize_cuda_engine,
                "__del__": __del__,
                "__module__": __name__,
                "__doc__": base.__doc__,
            })
        return cls


def argument_order(trt_module: ModuleType | str | None = None) -> AllocatorOrder:
    """How the TensorRT module's binding passes the allocator's arguments, found by calling
    its own C++ trampoline once when gpubudget made its allocator class.

    ``stream_index`` 3: ``allocate_async(size, alignment, flags, stream)`` (TensorRT-RTX);
    2: ``(size, alignment, stream, flags)`` (TensorRT 10); ``None``: not established, and the
    allocator reads no stream at all (``found`` says why).

    Examples
    --------
    >>> from gpubudget import tensorrt as gbt
    >>> gbt.argument_order("tensorrt_rtx_bindings").stream_index    # doctest: +SKIP
    3
    """
    return _argument_order(load_module(trt_module))


def Builder(logger: Any, *, trt_module: ModuleType | str | None = None) -> Any:  # noqa: N802
    """A TensorRT ``Builder`` with an allocator of the current budget attached.
    ``BackendError`` where TensorRT cannot initialise CUDA (see :func:`Runtime`);
    ``ValueError`` for a module without a builder (the lean runtime)."""
    budget = require_budget(None, "Builder()")
    module = load_module(trt_module)
    if not hasattr(module, "Builder"):
        raise ValueError(f"Builder(): {module.__name__} has no Builder (TensorRT's lean "
                         "runtime only runs plans: build them with full TensorRT or TensorRT-RTX)")
    return attach_as(module.Builder(logger), budget, "Builder()")


def Runtime(logger: Any, *, trt_module: ModuleType | str | None = None) -> Any:  # noqa: N802
    """A TensorRT ``Runtime`` (a subclass of the module's) with an allocator of the current
    budget attached; its ``deserialize_cuda_engine`` tags allocations "deserialize".

    Raises ``BackendError`` where TensorRT could not initialise CUDA (the lean runtime on a
    machine without a CUDA driver returns a Runtime with no real C++ object behind it): that
    Runtime is never touched and kept alive for good, since destroying it would crash."""
    budget = require_budget(None, "Runtime()")
    return attach_as(_runtime_class(load_module(trt_module))(logger), budget, "Runtime()")
