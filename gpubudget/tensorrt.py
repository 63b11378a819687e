"""The TensorRT adapter: a context-aware ``IGpuAllocator`` that routes to budgets.

Usage::

    import tensorrt as trt
    from gpubudget import gpu_budget
    from gpubudget import tensorrt as gbt

    with gpu_budget("4GiB", name="shared") as pool:
        runtime = gbt.Runtime(logger)                     # allocator attached, lifetime tracked
        with gpu_budget("2GiB", name="detector"):
            detector = runtime.deserialize_cuda_engine(plan_a)   # charged to detector and pool

Routing. An allocator is bound to one budget. Each call goes to the innermost budget active in
the calling context when that is the bound budget or one of its descendants, else to the bound
budget (TensorRT's own threads, whose context is empty, or calls after the block has exited).
Frees find the owning budget by address, whatever the context.

Answers. ``allocate``/``allocate_async``/``reallocate`` return an ``int`` address or ``None``;
``deallocate``/``deallocate_async`` return ``True`` or ``False``. Nothing ever raises out of a
callback: an internal error is recorded in the budget's report and answered with ``None``.
TensorRT's trampoline prints ``[ERROR] Return value of allocate() could not be interpreted as
an int`` when it receives ``None``; that line is TensorRT's, and means "denied".

Lifetime. Every object attached (``Builder``, ``Runtime``, :func:`attach`) pins the budget until
the object is collected. The allocator stays referenced from here while its budget can still
be called (until the budget is released), so engines that outlive their runtime keep a live
allocator. At interpreter exit the allocators still referenced are kept alive for good and
answer every later call without touching anything, so teardown with live engines is silent.

Module. ``trt_module`` (a module object or its import name), else the first importable of
``tensorrt``, ``tensorrt_rtx``, ``tensorrt_rtx_bindings`` and ``tensorrt_lean``. When the module
has ``IGpuAsyncAllocator`` (TensorRT 10 and later) the allocator subclasses it, so stream-ordered
calls arrive with their stream; it is a subclass of ``IGpuAllocator`` either way.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import threading
import weakref
from types import ModuleType
from typing import Any, Final, Protocol

from .budget import Budget
from .errors import BudgetError
from .scope import ACTIVE, LABEL, current_budget

__all__ = [
    "Builder",
    "MODULE_NAMES",
    "Runtime",
    "allocator",
    "allocator_of",
    "attach",
    "load_module",
]

MODULE_NAMES: Final = ("tensorrt", "tensorrt_rtx", "tensorrt_rtx_bindings", "tensorrt_lean")

_lock = threading.Lock()
_classes: dict[str, type] = {}
_runtimes: dict[str, type] = {}
_shared: dict[tuple[int, str], _BudgetAllocatorBase] = {}
_kept: list[_BudgetAllocatorBase] = []
_attached: weakref.WeakKeyDictionary[object, _BudgetAllocatorBase] = weakref.WeakKeyDictionary()


class _Attachable(Protocol):
    gpu_allocator: Any


def load_module(trt_module: ModuleType | str | None = None) -> ModuleType:
    """Return the TensorRT module to use (see the module docstring).

    Raises ``ImportError`` naming every candidate when none can be imported, ``TypeError``
    when ``trt_module`` is neither a module nor a name, and ``ValueError`` when the module has
    no ``IGpuAllocator``.
    """
    if isinstance(trt_module, ModuleType):
        module = trt_module
    elif isinstance(trt_module, str):
        module = importlib.import_module(trt_module)
    elif trt_module is None:
        errors = []
        for name in MODULE_NAMES:
            try:
                module = importlib.import_module(name)
                break
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
        else:
            raise ImportError(
                "no TensorRT module can be imported; tried "
                + "; ".join(errors)
                + ". Install TensorRT (pip install 'gpubudget[trt]' with NVIDIA's index) or "
                "TensorRT-RTX (tensorrt-rtx-cu13-bindings), or pass trt_module="
            )
    else:
        raise TypeError(f"trt_module must be a module, a module name or None, got {trt_module!r}")
    if not hasattr(module, "IGpuAllocator"):
        raise ValueError(f"module {module.__name__!r} has no IGpuAllocator; is it TensorRT?")
    return module


class _BudgetAllocatorBase:
    """The methods of every budget allocator; mixed into a subclass of the module's
    ``IGpuAllocator`` (or ``IGpuAsyncAllocator``) by :func:`_allocator_class`."""

    budget: Budget
    phase: str | None
    deserializing: int
    lock: threading.Lock
    _closed: bool

    def _fail(self, where: str, exc: BaseException) -> None:
        try:
            self.budget.record_error(f"{where}: {type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - nothing may leave a callback
            pass

    def allocate(self, size: int, alignment: int, flags: int) -> int | None:
        """TensorRT callback: a block of ``size`` bytes, or ``None`` (denied)."""
        return self.allocate_async(size, alignment, flags, None)

    def allocate_async(
        self, size: int, alignment: int, flags: int, stream: int | None
    ) -> int | None:
        """TensorRT callback: a block for use on ``stream``, or ``None`` (denied).

        Routed to the innermost active budget when it is the bound budget or a descendant,
        else to the bound budget; tagged with the current label, else this allocator's phase.
        """
        try:
            if self._closed:
                return None
            target = self.budget
            chain = ACTIVE.get()
            if chain:
                current = chain[-1]
                if current is not target and target in current._chain:
                    target = current
            return target.allocate(size, alignment, tag=LABEL.get() or self.phase, stream=stream)
        except Exception as exc:  # noqa: BLE001 - nothing may leave a callback
            self._fail("allocate" if stream is None else "allocate_async", exc)
            return None

    def deallocate(self, memory: int) -> bool:
        """TensorRT callback: free a block by address; ``False`` if it is not ours."""
        try:
            if self._closed:
                return True
            return self.budget._root.free(memory)
        except Exception as exc:  # noqa: BLE001
            self._fail("deallocate", exc)
            return False

    def deallocate_async(self, memory: int, stream: int) -> bool:
        """TensorRT callback: free a block once ``stream``'s queued work is done with it."""
        try:
            if self._closed:
                return True
            return self.budget._root.free(memory, stream=stream)
        except Exception as exc:  # noqa: BLE001
            self._fail("deallocate_async", exc)
            return False

    def reallocate(self, address: int, alignment: int, new_size: int) -> int | None:
        """TensorRT callback: resize in place, else move (copying ``min(old, new)`` bytes),
        else ``None`` with the old block still valid."""
        try:
            if self._closed:
                return None
            owner = self.budget._root.owner_of(address)
            if owner is None:
                return None
            return owner.resize(address, new_size, alignment)
        except Exception as exc:  # noqa: BLE001
            self._fail("reallocate", exc)
            return None

    def __repr__(self) -> str:
        return f"<gpubudget allocator for {self.budget!r}>"


def _allocator_class(module: ModuleType) -> type:
    with _lock:
        cls = _classes.get(module.__name__)
        if cls is None:
            base = getattr(module, "IGpuAsyncAllocator", None) or module.IGpuAllocator

            def __init__(self: Any, budget: Budget) -> None:
                base.__init__(self)
                self.budget = budget
                self.phase = None
                self.deserializing = 0
                self.lock = threading.Lock()
                self._closed = False

            cls = type(
                "BudgetAllocator",
                (_BudgetAllocatorBase, base),
                {"__init__": __init__, "__module__": __name__},
            )
            _classes[module.__name__] = cls
        return cls


def _require_budget(budget: Budget | None, what: str) -> Budget:
    if budget is None:
        budget = current_budget()
        if budget is None:
            raise BudgetError(
                f"{what} needs a budget: call it inside `with gpu_budget(...)` or pass budget="
            )
    elif not isinstance(budget, Budget):
        raise TypeError(f"budget must be a gpubudget.Budget, got {budget!r}")
    if budget.state in ("new", "released"):
        raise BudgetError(f"{what}: budget {budget.name!r} is {budget.state}")
    return budget


def allocator(
    budget: Budget | None = None, *, trt_module: ModuleType | str | None = None
) -> Any:
    """The ``IGpuAllocator`` bound to ``budget`` (default: the current one).

    One such shared allocator exists per (budget, TensorRT module); objects attached with
    :func:`attach` get one of their own, which knows their phase. Every allocator is kept
    alive for as long as its budget can still be called. Raises ``BudgetError`` when no
    budget is active.

    Examples
    --------
    >>> import tensorrt_rtx_bindings as trt  # doctest: +SKIP
    >>> with gpu_budget("1GiB") as b:                    # doctest: +SKIP
    ...     alloc = allocator(trt_module=trt)
    ...     isinstance(alloc, trt.IGpuAllocator)
    True
    """
    target = _require_budget(budget, "allocator()")
    module = load_module(trt_module)
    key = (id(target), module.__name__)
    with _lock:
        found = _shared.get(key)
        if found is not None and found.budget is target:
            return found
    made = _make(module, target, None)
    with _lock:
        return _shared.setdefault(key, made)


def _make(module: ModuleType, budget: Budget, phase: str | None) -> Any:
    """A new allocator, kept referenced until its budget is released."""
    made = _allocator_class(module)(budget)
    made.phase = phase
    with _lock:
        _forget_released()
        _kept.append(made)
    return made


def _forget_released() -> None:
    """Drop allocators whose budget is released and that no live attached object uses."""
    in_use = {id(a) for a in _attached.values()}
    _kept[:] = [a for a in _kept if a.budget.state != "released" or id(a) in in_use]
    for key, alloc in list(_shared.items()):
        if alloc.budget.state == "released" and id(alloc) not in in_use:
            del _shared[key]


def _module_of(obj: object) -> ModuleType:
    """The TensorRT module ``obj``'s class comes from (skipping gpubudget's subclasses)."""
    for cls in type(obj).__mro__:
        top = cls.__module__.split(".")[0]
        if top not in ("gpubudget", "builtins"):
            return load_module(importlib.import_module(top))
    raise TypeError(f"{obj!r} is not a TensorRT object")


def _phase_of(obj: object) -> str | None:
    name = type(obj).__name__
    if "Builder" in name:
        return "build"
    if "Runtime" in name:
        return "runtime"
    return None


def attach(obj: _Attachable, budget: Budget | None = None) -> _Attachable:
    """Give ``obj`` (a ``Builder`` or ``Runtime``) an allocator of the budget's, pin the
    budget for as long as ``obj`` lives, and return ``obj``.

    Blocks allocated through it are tagged with its phase ("build" for a builder, "runtime"
    for a runtime, "deserialize" during ``deserialize_cuda_engine`` of a runtime made by
    :func:`Runtime`) unless a :func:`gpubudget.label` or an explicit tag says otherwise.
    Raises ``BudgetError`` outside any budget, ``TypeError`` if ``obj`` takes no allocator.
    """
    target = _require_budget(budget, "attach()")
    alloc = _make(_module_of(obj), target, _phase_of(obj))
    try:
        obj.gpu_allocator = alloc
    except (AttributeError, TypeError) as exc:
        raise TypeError(f"{obj!r} does not take a gpu_allocator: {exc}") from exc
    target.pin()
    with _lock:
        _attached[obj] = alloc
    weakref.finalize(obj, target.unpin)
    return obj


def allocator_of(obj: object) -> Any:
    """The allocator gpubudget attached to ``obj``, or ``None`` (TensorRT's ``gpu_allocator``
    attribute cannot be read from Python)."""
    try:
        with _lock:
            return _attached.get(obj)
    except TypeError:  # not weak-referenceable: never attached
        return None


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

            cls = type("Runtime", (base,), {
                "deserialize_cuda_engine": deserialize_cuda_engine,
                "__del__": __del__,
                "__module__": __name__,
                "__doc__": base.__doc__,
            })
            _runtimes[module.__name__] = cls
        return cls


def Builder(logger: Any, *, trt_module: ModuleType | str | None = None) -> Any:  # noqa: N802
    """A TensorRT ``Builder`` with an allocator of the current budget attached."""
    budget = _require_budget(None, "Builder()")
    return attach(load_module(trt_module).Builder(logger), budget)


def Runtime(logger: Any, *, trt_module: ModuleType | str | None = None) -> Any:  # noqa: N802
    """A TensorRT ``Runtime`` (a subclass of the module's) with an allocator of the current
    budget attached; its ``deserialize_cuda_engine`` tags allocations "deserialize"."""
    budget = _require_budget(None, "Runtime()")
    return attach(_runtime_class(load_module(trt_module))(logger), budget)


def _at_exit() -> None:
    """Keep every allocator alive through interpreter teardown and make it inert: engines
    destroyed late still call it, and must find a live object that touches nothing."""
    with _lock:
        keep = list(_kept) + list(_attached.values())
    for alloc in keep:
        alloc._closed = True
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(alloc))


atexit.register(_at_exit)
