"""Execution-context memory (TensorRT's activations) carved from a budget, sized exactly.

TensorRT gives each execution context a region of device memory for its activations. Left to
itself it takes the region through the runtime's allocator, sized for the largest shapes of
every optimization profile. With the ``USER_MANAGED`` strategy the application hands it a
region instead: :class:`ContextMemory` takes that region from a budget, sized by the engine
(``device_memory_size_v2``, or the profile's ``get_device_memory_size_for_profile_v2``), and,
once input shapes are set, by ``update_device_memory_size_for_shapes()`` (:meth:`fit`):
grown or shrunk in place, or moved, with TensorRT told the new address.

Lifetime: the region outlives every context using it. It is freed when the last of them is
destroyed (after TensorRT's object is gone: pybind11 destroys the C++ context before Python's
weak-reference callbacks run), and while a context lives its budget is pinned, so the budget's
allocator outlives both. Several contexts of one engine may share one region (opt-in: create
them from the same :class:`ContextMemory`); TensorRT allows it when they never run at once.

Scratch: by default each context's ``temporary_allocator`` (scratch TensorRT needs inside
``execute_async_v3``, of a size known only then) is an allocator of the same budget, tagged
``"scratch"``, so that everything the context allocates counts where the user asked.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from types import ModuleType
from typing import Any

from ..budget import Budget
from ..errors import AllocationDenied, BudgetError
from ..units import format_size
from .lifetime import make, require_budget
from .module import load_module, module_of, require_api
from ..adapter import hooks

__all__ = ["ContextMemory", "context_memory", "execution_context", "fit_shapes"]

ALIGNMENT = 256  # what set_device_memory requires
_lock = threading.Lock()
# a child forked while another thread held it must not wait for that thread
os.register_at_fork(after_in_child=getattr(_lock, "_at_fork_reinit"))
_regions: weakref.WeakKeyDictionary[Any, ContextMemory] = weakref.WeakKeyDictionary()


class ContextMemory:
    """One region of device memory from ``budget`` for execution contexts of ``engine``.

    Parameters
    ----------
    engine
        A deserialized TensorRT ``ICudaEngine``.
    budget
        Where the region comes from (default: the current budget; ``BudgetError`` if none).
    profile
        Size for this optimization profile only (``get_device_memory_size_for_profile_v2``);
        ``None``: for every profile (``device_memory_size_v2``).
    scratch
        Give each context a ``temporary_allocator`` of the same budget (default ``True``).
    trt_module
        The TensorRT module (default: the engine's).

    Examples
    --------
    >>> memory = ContextMemory(engine)                   # doctest: +SKIP
    >>> context = memory.create_context()               # doctest: +SKIP
    >>> context.set_input_shape("x", (8, 3, 224, 224))  # doctest: +SKIP
    >>> memory.fit(context)                             # doctest: +SKIP
    """

    def __init__(self, engine: Any, *, budget: Budget | None = None, profile: int | None = None,
                 scratch: bool = True, trt_module: ModuleType | str | None = None) -> None:
        self.budget: Budget = require_budget(budget, "ContextMemory()")
        if profile is not None and (isinstance(profile, bool) or not isinstance(profile, int)
                                    or profile < 0):
            raise ValueError(f"profile must be a profile index (an int >= 0) or None, "
                             f"got {profile!r}")
        require_api(engine, ("device_memory_size_v2", "get_device_memory_size_for_profile_v2"),
                    "ContextMemory()")
        self.engine = engine
        self.profile = profile
        self.scratch = bool(scratch)
        self.module = load_module(trt_module) if trt_module is not None else module_of(engine)
        self._lock = threading.Lock()  # never re-entered: a finalizer only queues (_dead)
        self._dead: list[int] = []  # contexts gone, their keys not yet processed
        self._address: int | None = None
        self._size = 0
        self._contexts: dict[int, weakref.ref[Any]] = {}  # key -> context
        self._keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._needs: dict[int, int] = {}  # key -> bytes the context's shapes need
        self._count = itertools.count()
        self._scratch: Any = None

    @property
    def address(self) -> int | None:
        """The region's address, ``None`` while no context uses it."""
        return self._address

    @property
    def size(self) -> int:
        """The region's size in bytes (0 while no context uses it)."""
        return self._size

    @property
    def contexts(self) -> list[Any]:
        """The live contexts using the region."""
        with self._lock:
            return self._live()

    def _live(self) -> list[Any]:
        return [c for c in (ref() for ref in self._contexts.values()) if c is not None]

    def engine_size(self) -> int:
        """What the engine says a context needs before shapes are known."""
        if self.profile is None:
            size = self.engine.device_memory_size_v2
        else:
            size = self.engine.get_device_memory_size_for_profile_v2(self.profile)
        return _bytes(size, "the engine's device memory size")

    def create_context(self) -> Any:
        """A new execution context of the engine using this region; the region is taken from
        the budget first (``AllocationDenied`` naming the budget and the size, before
        TensorRT is called) or grown to the engine's size."""
        try:
            with self._lock:
                self._reap()
                fresh = self._address is None
                size = self.engine_size()
                self._reserve(size, None)
                try:
                    context = self._create()
                except BaseException:
                    if fresh and not self._contexts:
                        self._release()
                    raise
                key = next(self._count)
                self._contexts[key] = weakref.ref(context)
                self._keys[context] = key
                self._needs[key] = size
                hooks(self.budget).pin()
                weakref.finalize(context, self._died, key).atexit = False
        finally:
            self._reap_later()
        with _lock:
            _regions[context] = self
        return context

    def fit(self, context: Any) -> int:
        """After ``context``'s input shapes are set: resize the region to what the contexts
        using it need (``update_device_memory_size_for_shapes()``), tell TensorRT, return
        the size. Call it while none of these contexts has work in flight. A denial raises
        ``BudgetError`` naming the budget, the size and the shapes; the region and TensorRT's
        view of it are then unchanged (too small for those shapes: do not run them)."""
        try:
            with self._lock:
                self._reap()
                key = self._keys.get(context, -1)
                if key not in self._contexts:
                    raise ValueError(f"{context!r} does not use this ContextMemory")
                need = _bytes(context.update_device_memory_size_for_shapes(),
                              "update_device_memory_size_for_shapes()")
                others = [n for k, n in self._needs.items() if k != key]
                self._reserve(max([need, *others]), context, shrink=True)
                self._needs[key] = need
                return self._size
        finally:
            self._reap_later()

    def _reserve(self, size: int, context: Any, *, shrink: bool = False) -> None:
        """Lock held: make the region ``size`` bytes (at least 1), telling every context."""
        size = max(size, 1)
        if self._address is None:
            try:
                self._address = self.budget.allocate(size, ALIGNMENT, tag="context",
                                                     raise_on_denial=True)
            except AllocationDenied as exc:
                shapes = (_shapes(self.engine, context) if context is not None else
                          "the largest of every profile" if self.profile is None else
                          f"the largest of profile {self.profile}")
                raise AllocationDenied(
                    f"execution-context memory of {_name(self.engine)} for input shapes "
                    f"{shapes}: {exc}", budget=exc.budget, refused_by=exc.refused_by,
                    reason=exc.reason, size=exc.size, charged=exc.charged) from None
            self._size = size
            return
        if size == self._size or (size < self._size and not shrink):
            return
        moved = self.budget.resize(self._address, size, ALIGNMENT)
        if moved is None:
            shapes = _shapes(self.engine, context) if context is not None else "the engine's"
            raise BudgetError(
                f"budget {self.budget.name!r} cannot hold {format_size(size)} of "
                f"execution-context memory for {_name(self.engine)} with input shapes {shapes} "
                f"(the region stays {format_size(self._size)}; "
                f"{format_size(self.budget.available)} available)")
        self._address, self._size = moved, size
        for live in self._live():
            _set_memory(live, moved, size)

    def _create(self) -> Any:
        """Lock held, region reserved: TensorRT's context, pointed at the region."""
        strategy = getattr(self.module, "ExecutionContextAllocationStrategy", None)
        if strategy is not None:
            context = self.engine.create_execution_context(strategy.USER_MANAGED)
        else:
            context = self.engine.create_execution_context_without_device_memory()
        if context is None:
            raise RuntimeError(f"TensorRT could not create an execution context of "
                               f"{_name(self.engine)} (see its log)")
        assert self._address is not None
        _set_memory(context, self._address, self._size)
        if self.scratch:
            if self._scratch is None:
                self._scratch = make(self.module, self.budget, "scratch")
            context.temporary_allocator = self._scratch
        return context

    def _died(self, key: int) -> None:
        """Finalizer of a context (TensorRT's object already gone): queue it, and process
        the queue unless another call holds the lock (that call will, on its way out)."""
        self._dead.append(key)
        self._reap_later()

    def _reap_later(self) -> None:
        """Lock not held by this call: process dead contexts if nobody else is."""
        while self._dead and self._lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self._lock.release()

    def _reap(self) -> None:
        """Lock held: forget dead contexts; free the region after the last one."""
        while self._dead:
            key = self._dead.pop()
            if self._contexts.pop(key, None) is None:
                continue
            self._needs.pop(key, None)
            if not self._contexts:
                self._release()
            hooks(self.budget).unpin()

    def _release(self) -> None:
        if self._address is not None:
            self.budget.free(self._address)
        self._address, self._size = None, 0

    def __repr__(self) -> str:
        return (f"<ContextMemory of {_name(self.engine)} in {self.budget.name!r}: "
                f"{format_size(self._size)}, {len(self._contexts)} context(s)>")


def execution_context(engine: Any, *, budget: Budget | None = None,
                      profile: int | None = None, scratch: bool = True,
                      trt_module: ModuleType | str | None = None) -> Any:
    """A new execution context of ``engine`` whose activation memory is a region of its own
    from ``budget`` (default: the current one); see :class:`ContextMemory`.

    >>> context = gbt.execution_context(engine)    # doctest: +SKIP
    """
    return ContextMemory(engine, budget=budget, profile=profile, scratch=scratch,
                         trt_module=trt_module).create_context()


def context_memory(context: Any) -> ContextMemory | None:
    """The :class:`ContextMemory` ``context`` uses, if gpubudget made it."""
    try:
        with _lock:
            return _regions.get(context)
    except TypeError:
        return None


def fit_shapes(context: Any) -> int:
    """After setting ``context``'s input shapes: :meth:`ContextMemory.fit` for it."""
    memory = context_memory(context)
    if memory is None:
        raise ValueError(f"{context!r} was not made by gpubudget (use execution_context())")
    return memory.fit(context)


def _set_memory(context: Any, address: int, size: int) -> None:
    try:
        context.set_device_memory(address, size)
    except TypeError:  # TensorRT before set_device_memory(memory, size)
        context.device_memory = address


def _bytes(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RuntimeError(f"TensorRT answered {value!r} for {what}: are all input shapes and "
                           f"the optimization profile set?")
    return value


def _name(engine: Any) -> str:
    try:
        name = engine.name
    except Exception:  # noqa: BLE001 - a name for messages only
        name = None
    return f"engine {name!r}" if isinstance(name, str) and name else "the engine"


def _shapes(engine: Any, context: Any) -> str:
    """``{input: shape}`` of the context, for messages."""
    try:
        shapes = {}
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            if "INPUT" in str(engine.get_tensor_mode(name)):
                shapes[name] = tuple(int(d) for d in context.get_tensor_shape(name))
        return str(shapes)
    except Exception as exc:  # noqa: BLE001
        return f"(unknown: {type(exc).__name__})"
