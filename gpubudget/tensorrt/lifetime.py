"""Who keeps which allocator alive, and for how long.

TensorRT holds a C++ pointer to its allocator; if the Python object dies first, the next call
crashes the process. So every allocator made here is referenced from this module until its
budget is released and no attached object uses it; every attached object (``Builder``,
``Runtime``) pins its budget until the object is collected; and at interpreter exit the
allocators still referenced are kept alive for good and made inert, so engines destroyed
during teardown find a live object that touches nothing.

An object TensorRT made without a working CUDA (:func:`~gpubudget.tensorrt.vtable.unusable`:
the lean runtime's ``Runtime`` on a machine without a driver) is never touched and never
destroyed: destroying it crashes the process, so :func:`require_usable` keeps one reference to
it for good (a deliberate leak of one small Python object) before raising.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import weakref
from types import ModuleType
from typing import Any, Protocol

from ..budget import Budget
from ..errors import BackendError, BudgetError
from ..scope import current_budget
from .callbacks import AllocatorMethods, allocator_class
from .module import load_module, module_of
from .vtable import unusable
from ..adapter import hooks

__all__ = ["allocator", "allocator_of", "attach", "attach_as", "keep_if_unusable", "require_budget",
           "require_usable"]

_lock = threading.Lock()
# a child forked while another thread held it must not wait for that thread
os.register_at_fork(after_in_child=getattr(_lock, "_at_fork_reinit"))
_shared: dict[tuple[int, str], AllocatorMethods] = {}  # (id(budget), module) -> allocator()
_kept: list[AllocatorMethods] = []  # every allocator whose budget may still be called
_attached: weakref.WeakKeyDictionary[object, AllocatorMethods] = weakref.WeakKeyDictionary()


class Attachable(Protocol):
    gpu_allocator: Any


def require_budget(budget: Budget | None, what: str) -> Budget:
    """``budget``, else the current one; ``BudgetError`` if there is none or it cannot
    allocate, ``TypeError`` if it is not a budget."""
    if budget is None:
        budget = current_budget()
        if budget is None:
            raise BudgetError(
                f"{what} needs a budget: call it inside `with gpu_budget(...)` or pass budget=")
    elif not isinstance(budget, Budget):
        raise TypeError(f"budget must be a gpubudget.Budget, got {budget!r}")
    if budget.state in ("new", "released"):
        raise BudgetError(f"{what}: budget {budget.name!r} is {budget.state}")
    return budget


def keep_if_unusable(obj: object) -> str | None:
    """Why ``obj``, which TensorRT just returned, has no real C++ object, after keeping it
    alive for good (destroying it would crash); ``None`` if it looks real."""
    why = unusable(obj)
    if why is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # a deliberate leak
    return why


def require_usable(obj: object, what: str, log: str | None = None) -> None:
    """Raise ``BackendError`` if ``obj``, which TensorRT just returned, has no real C++ object
    (TensorRT could not initialise CUDA), after keeping it alive for good; ``log``: what
    TensorRT logged, if known, for the message."""
    why = keep_if_unusable(obj)
    if why is None:
        return
    said = f"; TensorRT said: {log}" if log else ""
    raise BackendError(
        f"{what}: TensorRT could not initialise CUDA on this machine (no GPU or no CUDA "
        f"driver it can use): {why}{said}. The {type(obj).__name__} is unusable; gpubudget "
        "keeps it alive for good, since destroying it would crash")


def make(module: ModuleType, budget: Budget, phase: str | None) -> Any:
    """A new allocator, kept referenced until its budget is released."""
    made = allocator_class(module)(budget)
    made.phase = phase
    with _lock:
        _forget_released()
        _kept.append(made)
    return made


def _forget_released() -> None:
    """Lock held: drop allocators whose budget is released and that no live object uses."""
    in_use = {id(alloc) for alloc in _attached.values()}
    _kept[:] = [a for a in _kept if a.budget.state != "released" or id(a) in in_use]
    for key, alloc in list(_shared.items()):
        if alloc.budget.state == "released" and id(alloc) not in in_use:
            del _shared[key]


def allocator(budget: Budget | None = None, *, trt_module: ModuleType | str | None = None) -> Any:
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
    target = require_budget(budget, "allocator()")
    module = load_module(trt_module)
    key = (id(target), module.__name__)
    with _lock:
        found = _shared.get(key)
        if found is not None and found.budget is target:
            return found
    made = make(module, target, None)
    with _lock:
        return _shared.setdefault(key, made)


def _phase_of(obj: object) -> str | None:
    name = type(obj).__name__
    if "Builder" in name:
        return "build"
    if "Runtime" in name:
        return "runtime"
    return None


def attach(obj: Attachable, budget: Budget | None = None) -> Attachable:
    """Give ``obj`` (a ``Builder`` or ``Runtime``) an allocator of the budget's, pin the
    budget for as long as ``obj`` lives, and return ``obj``.

    Blocks allocated through it are tagged with its phase ("build" for a builder, "runtime"
    for a runtime, "deserialize" during ``deserialize_cuda_engine`` of a runtime made by
    :func:`~gpubudget.tensorrt.Runtime`) unless a :func:`gpubudget.label` or an explicit tag
    says otherwise. Raises ``BudgetError`` outside any budget, ``TypeError`` if ``obj`` takes
    no allocator, ``BackendError`` if TensorRT made ``obj`` without a working CUDA (it is
    then kept alive for good and never touched: see :func:`require_usable`).
    """
    return attach_as(obj, require_budget(budget, "attach()"), "attach()")


def attach_as(obj: Attachable, target: Budget, what: str) -> Attachable:
    """:func:`attach` for ``what`` (the caller's name in its errors), the budget checked."""
    require_usable(obj, what)
    alloc = make(module_of(obj), target, _phase_of(obj))
    try:
        obj.gpu_allocator = alloc
    except (AttributeError, TypeError) as exc:
        raise TypeError(f"{obj!r} does not take a gpu_allocator: {exc}") from exc
    hooks(target).pin()
    with _lock:
        _attached[obj] = alloc
    weakref.finalize(obj, hooks(target).unpin)
    return obj


def allocator_of(obj: object) -> Any:
    """The allocator gpubudget attached to ``obj``, or ``None`` (TensorRT's ``gpu_allocator``
    attribute cannot be read from Python)."""
    try:
        with _lock:
            return _attached.get(obj)
    except TypeError:  # not weak-referenceable: never attached
        return None


@atexit.register
def _at_exit() -> None:
    """Keep every allocator alive through interpreter teardown and make it inert."""
    with _lock:
        keep = list(_kept) + list(_attached.values())
    for alloc in keep:
        alloc.closed = True
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(alloc))
