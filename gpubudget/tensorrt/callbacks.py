"""The allocator TensorRT calls: five callbacks that route to budgets and never raise.

Routing. An allocator is bound to one budget. An allocation goes to the innermost budget
active in the calling context when the bound budget encloses it (one runtime, two models in
two child budgets), else to the bound budget (TensorRT's own threads, whose context is empty,
or calls after the block has exited). Frees and resizes find the owning budget by address.
An allocation asked while another CUDA device than the budget's is current is denied
(``wrong_device``): TensorRT would get memory of the wrong device.

Arguments. NVIDIA's bindings disagree on where ``allocate_async`` gets its stream
(TensorRT-RTX: ``(size, alignment, flags, stream)``; TensorRT 10: ``(size, alignment, stream,
flags)``). Each allocator class asks its binding once, when it is made
(:mod:`~gpubudget.tensorrt.order`), and reads the stream where the binding puts it; where the
order cannot be established, no allocation carries a stream (a block freed on a stream then
waits for that stream's work before anyone reuses it) and ``reallocate`` refuses. Where
allocations carry their stream but ``deallocate_async`` was not seen to pass its own, each
block is freed on the stream it was allocated for (remembered per block), whatever arrives.

Answers. ``allocate``/``allocate_async``/``reallocate`` return an ``int`` address or
``None``; ``deallocate``/``deallocate_async`` return ``True`` or ``False``. Every callback
catches everything (``BaseException``) and answers as a denial (a null address, ``False``):
a Ctrl-C is raised again in the main thread once control is back in Python, anything else
is recorded in the budget's report and sent to ``sys.unraisablehook`` (see
:mod:`gpubudget.interrupts`).
"""

from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import Any, TypeVar, cast

from ..adapter import callback_failed, current_device
from ..budget import Budget
from ..scope import current_budget, current_label
from .order import AllocatorOrder, allocator_order

__all__ = ["AllocatorMethods", "RememberingMethods", "allocator_class", "argument_order"]

A = TypeVar("A", bound=int)
_lock = threading.Lock()
# a child forked while another thread held it must not wait for that thread
os.register_at_fork(after_in_child=getattr(_lock, "_at_fork_reinit"))
_classes: dict[str, type] = {}


class AllocatorMethods:
    """The callbacks, mixed into a subclass of the module's ``IGpuAsyncAllocator`` (or
    ``IGpuAllocator``) by :func:`allocator_class`."""

    budget: Budget
    root: Budget  # the root of the budget's tree: frees and resizes go through it
    device: int | None  # the budget tree's CUDA device, None on host memory
    phase: str | None  # the tag of blocks allocated through it, unless a label says otherwise
    deserializing: int  # deserialize_cuda_engine calls in progress (phase "deserialize")
    lock: threading.Lock
    closed: bool  # at interpreter exit: answer everything, touch nothing

    argument_order: AllocatorOrder  # how this class's binding passes its arguments

    def allocate(self, size: int, alignment: int, flags: int) -> int | None:
        """TensorRT callback: a block of ``size`` bytes, or ``None`` (denied)."""
        return self._allocate(size, alignment, None, "allocate")

    def allocate_async(self, size: int, alignment: int, third: int, fourth: int) -> int | None:
        """TensorRT callback: a block for use on the stream, or ``None`` (denied); tagged
        with the current label, else this allocator's phase. The stream is ``fourth``
        (TensorRT-RTX) or ``third`` (TensorRT 10), as :attr:`argument_order` found; none
        when it could not be found."""
        index = self.argument_order.stream_index
        stream = None if index is None else (third if index == 2 else fourth)
        return self._allocate(size, alignment, stream, "allocate_async")

    def _allocate(self, size: int, alignment: int, stream: int | None,
                  where: str) -> int | None:
        try:
            if self.closed:
                return None
            target = self.budget
            current = current_budget()
            if current is not None and current is not target and target.encloses(current):
                target = current
            if self.device is not None and current_device() != self.device:
                target.record_denial(size, "wrong_device")  # never another device's memory
                return None
            address = target.allocate(size, alignment, tag=current_label() or self.phase,
                                      stream=stream)
        except BaseException as exc:  # noqa: BLE001 - nothing may leave a callback
            return self._failed(where, exc, 0)
        return address

    def deallocate(self, memory: int) -> bool:
        """TensorRT callback: free a block by address; ``False`` if it is not ours."""
        return self.deallocate_async(memory, None)

    def deallocate_async(self, memory: int, stream: int | None) -> bool:
        """TensorRT callback: free a block once ``stream``'s queued work is done with it."""
        try:
            if self.closed:
                return True
            done = self.root.free(memory, stream=stream)
        except BaseException as exc:  # noqa: BLE001
            return self._failed("deallocate" if stream is None else "deallocate_async", exc,
                                False)
        return done

    def reallocate(self, address: int, alignment: int, new_size: int) -> int | None:
        """TensorRT callback: resize in place, else move (copying ``min(old, new)`` bytes),
        else ``None`` with the old block still valid."""
        try:
            if self.closed or not self.argument_order.resize:
                return None  # an order not established: TensorRT keeps its block
            owner = self.root.owner_of(address)
            moved = owner.resize(address, new_size, alignment) if owner is not None else None
        except BaseException as exc:  # noqa: BLE001
            return self._failed("reallocate", exc, 0)
        return moved

    def _failed(self, where: str, exc: BaseException, answer: A) -> A:
        """Record ``exc``; what to answer: ``answer``, or in the main thread an equal
        ``int`` that carries a Ctrl-C (see :func:`gpubudget.adapter.callback_failed`),
        returned as it is, as the callback's last step."""
        return cast(A, callback_failed(self.budget, where, exc, answer))

    def __repr__(self) -> str:
        return f"<gpubudget allocator for {self.budget!r}>"


class RememberingMethods(AllocatorMethods):
    """The callbacks for a binding whose ``deallocate_async`` loses its stream while
    ``allocate_async`` passes it (:attr:`AllocatorOrder.remember`): each block is freed on
    the stream it was allocated for, remembered here (the common bindings pay nothing)."""

    streams: dict[int, int | None]  # block -> the stream it was allocated for

    def _allocate(self, size: int, alignment: int, stream: int | None,
                  where: str) -> int | None:
        address = AllocatorMethods._allocate(self, size, alignment, stream, where)
        if address is not None:
            try:
                with self.lock:
                    self.streams[address] = stream
            except BaseException as exc:  # noqa: BLE001 - all or nothing: give it back
                self.root.free(address)
                return self._failed(where, exc, 0)
        return address

    def deallocate_async(self, memory: int, stream: int | None) -> bool:
        """TensorRT callback: free a block once the work queued on the stream it was
        allocated for is done (the stream that arrives is not trusted)."""
        try:
            with self.lock:
                stream = self.streams.get(memory)
        except BaseException as exc:  # noqa: BLE001
            return self._failed("deallocate_async", exc, False)
        done = AllocatorMethods.deallocate_async(self, memory, stream)
        if done:
            try:
                with self.lock:
                    self.streams.pop(memory, None)
            except BaseException as exc:  # noqa: BLE001 - freed; only the note stays
                return self._failed("deallocate_async", exc, True)
        return done

    def reallocate(self, address: int, alignment: int, new_size: int) -> int | None:
        """TensorRT callback: as :meth:`AllocatorMethods.reallocate`; a moved block keeps
        its stream."""
        moved = AllocatorMethods.reallocate(self, address, alignment, new_size)
        if moved is not None and moved != address:
            try:
                with self.lock:
                    self.streams[moved] = self.streams.pop(address, None)
            except BaseException as exc:  # noqa: BLE001 - moved; only the note is lost
                return self._failed("reallocate", exc, moved)
        return moved


def allocator_class(module: ModuleType) -> type:
    """The allocator class for ``module``: its ``IGpuAsyncAllocator`` (TensorRT 10 and later,
    so that stream-ordered calls arrive with their stream) or ``IGpuAllocator``, with the
    callbacks above."""
    with _lock:
        cls = _classes.get(module.__name__)
        if cls is None:
            base = getattr(module, "IGpuAsyncAllocator", None) or module.IGpuAllocator
            order = allocator_order(base)  # asks the binding itself; never raises

            def __init__(self: Any, budget: Budget) -> None:
                base.__init__(self)
                self.budget = budget
                self.root = budget.root
                self.device = budget.device
                self.phase = None
                self.deserializing = 0
                self.lock = threading.Lock()
                self.closed = False
                if order.remember:
                    self.streams = {}

            methods = RememberingMethods if order.remember else AllocatorMethods
            cls = _classes[module.__name__] = type(
                "BudgetAllocator", (methods, base),
                {"__init__": __init__, "__module__": __name__, "argument_order": order})
        return cls


def argument_order(module: ModuleType) -> AllocatorOrder:
    """How ``module``'s binding passes the allocator's arguments, as found when its
    allocator class was made (see :mod:`~gpubudget.tensorrt.order`)."""
    order = allocator_class(module).__dict__["argument_order"]
    assert isinstance(order, AllocatorOrder)
    return order
