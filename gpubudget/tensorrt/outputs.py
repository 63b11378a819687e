"""Outputs whose shape depends on the data, in a budget: a TensorRT ``IOutputAllocator``.

When an output's size is known only during inference (``NonZero``, non-maximum suppression),
TensorRT asks an ``IOutputAllocator`` for its buffer from inside ``execute_async_v3``:
``reallocate_output_async(name, memory, size, alignment, stream)``, then tells the shape with
``notify_shape(name, shape)``. :func:`output_allocator` gives a context one that takes those
buffers from a budget: a buffer large enough (and aligned as asked) is kept; a larger one is
taken from the budget and the old one freed in stream order (at once for that stream, for
others once the stream's work is done; kept until the context ends if the stream cannot take
an event). A refusal is answered ``None`` (a null pointer): TensorRT then fails the
inference — ``execute_async_v3`` returns ``False``, TensorRT logs an error, and NVIDIA's
binding prints ``Return value of reallocateOutputAsync() could not be interpreted as an int``
— and the denial is in the budget's report. Every buffer is freed when the context is
destroyed (or at :meth:`OutputMethods.close`).

Where the binding's argument order could not be established
(:func:`~gpubudget.tensorrt.order.output_order`), no stream is trusted: a buffer replaced
during inference is kept, charged, until the context ends. Nothing raises out of a callback.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from types import ModuleType
from typing import Any

from ..adapter import callback_failed
from ..budget import Budget
from .lifetime import require_budget
from .module import load_module, module_of
from .order import OutputOrder, output_order

__all__ = ["OutputMethods", "output_allocator", "output_allocator_class"]

_lock = threading.Lock()
# a child forked while another thread held it must not wait for that thread
os.register_at_fork(after_in_child=getattr(_lock, "_at_fork_reinit"))
_classes: dict[str, type] = {}
_open: weakref.WeakSet[OutputMethods] = weakref.WeakSet()
MIN_ALIGNMENT = 256
MAX_DIMS = 8  # TensorRT's Dims hold at most eight extents


class OutputMethods:
    """The callbacks and the buffers of one context's outputs; mixed into a subclass of the
    module's ``IOutputAllocator`` by :func:`output_allocator_class`."""

    budget: Budget
    argument_order: OutputOrder  # found once per class (see order.py)
    lock: threading.Lock
    closed: bool
    buffers: dict[str, tuple[int, int]]  # output name -> (address, bytes asked)
    shapes: dict[str, tuple[int, ...]]
    retired: list[int]  # replaced buffers kept until close (stream not trusted)

    def reallocate_output_async(self, tensor_name: str, memory: int, size: int,
                                alignment: int, stream: int) -> int | None:
        """TensorRT callback: a buffer of at least ``size`` bytes for output
        ``tensor_name``, used on ``stream``; ``None`` refuses (the inference fails)."""
        trusted = stream if self.argument_order.stream else None
        return self._reallocate(tensor_name, size, alignment, trusted, "reallocate_output_async")

    def reallocate_output(self, tensor_name: str, memory: int, size: int,
                          alignment: int) -> int | None:
        """TensorRT callback (the older form, without a stream)."""
        return self._reallocate(tensor_name, size, alignment, None, "reallocate_output")

    def notify_shape(self, tensor_name: str, shape: Any) -> int | None:
        """TensorRT callback: the shape of output ``tensor_name`` for this inference (what it
        returns TensorRT does not read: after a failure, what carries a Ctrl-C)."""
        try:
            dims = tuple(int(d) for d in shape)
            if not isinstance(tensor_name, str) or len(dims) > MAX_DIMS or any(
                    d < 0 for d in dims):
                raise ValueError(f"not an output's shape: {tensor_name!r} {dims[:MAX_DIMS + 1]}"
                                 f"{'...' if len(dims) > MAX_DIMS + 1 else ''}")
            with self.lock:
                if not self.closed:
                    self.shapes[tensor_name] = dims
        except BaseException as exc:  # noqa: BLE001 - nothing may leave a callback
            return callback_failed(self.budget, "notify_shape", exc)
        return None

    def _reallocate(self, name: object, size: object, alignment: object, stream: int | None,
                    where: str) -> int | None:
        try:
            if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"bad arguments: name {name!r}, size {size!r}")
            with self.lock:
                if self.closed:
                    return None
                current = self.buffers.get(name)
                align: Any = alignment  # a bad one is the budget's to refuse
                if isinstance(alignment, int) and not alignment & (alignment - 1):
                    align = max(alignment, MIN_ALIGNMENT)  # 0 or a power of two
                if (current is not None and isinstance(align, int) and align > 0
                        and current[0] % align == 0
                        and size <= self.budget.size_of(current[0])):
                    self.buffers[name] = (current[0], size)
                    return current[0]
                address = self.budget.allocate(max(size, 1), align, tag=f"output:{name}",
                                               stream=stream)
                if address is None:
                    return None  # the old buffer stays ours, and TensorRT's
                self.buffers[name] = (address, size)
                if current is not None and (
                        stream is None or not self.budget.free(current[0], stream=stream)):
                    # no trusted stream, or it could not take an event: kept until close
                    self.retired.append(current[0])
        except BaseException as exc:  # noqa: BLE001 - nothing may leave a callback
            return callback_failed(self.budget, where, exc)  # a null address
        return address

    def address(self, name: str) -> int | None:
        """The buffer of output ``name`` (``None`` before the first inference)."""
        with self.lock:
            found = self.buffers.get(name)
            return found[0] if found else None

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape TensorRT last notified for output ``name``."""
        with self.lock:
            return self.shapes.get(name)

    def nbytes(self, name: str) -> int | None:
        """The bytes TensorRT last asked for output ``name``."""
        with self.lock:
            found = self.buffers.get(name)
            return found[1] if found else None

    def close(self, stream: int | None = None) -> None:
        """Free every buffer (after the context is gone, or when no inference is in flight);
        later callbacks are refused. A second call does nothing."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            addresses = [a for a, _ in self.buffers.values()] + self.retired
            self.buffers.clear()
            self.retired.clear()
        for address in addresses:
            self.budget.free(address, stream=stream)

    def __repr__(self) -> str:
        return f"<gpubudget output allocator for {self.budget!r}: {sorted(self.buffers)}>"


def output_allocator_class(module: ModuleType) -> type:
    """The output allocator class for ``module``: its ``IOutputAllocator`` with the methods
    above, and the argument order its binding was found to use."""
    with _lock:
        cls = _classes.get(module.__name__)
        if cls is None:
            base = getattr(module, "IOutputAllocator", None)
            if base is None:
                raise ValueError(f"module {module.__name__!r} has no IOutputAllocator "
                                 "(TensorRT 8.5 or later has it)")
            order = output_order(base)

            def __init__(self: Any, budget: Budget) -> None:
                base.__init__(self)
                self.budget = budget
                self.lock = threading.Lock()
                self.closed = False
                self.buffers = {}
                self.shapes = {}
                self.retired = []

            cls = _classes[module.__name__] = type(
                "BudgetOutputAllocator", (OutputMethods, base),
                {"__init__": __init__, "__module__": __name__, "argument_order": order})
        return cls


def output_allocator(context: Any, names: list[str] | tuple[str, ...] | None = None, *,
                     budget: Budget | None = None,
                     trt_module: ModuleType | str | None = None) -> Any:
    """Give ``context``'s outputs ``names`` (default: every output of its engine) an output
    allocator that takes their buffers from ``budget`` (default: the current one); return it.

    Its buffers are freed when the context is destroyed. Read an output's buffer, shape and
    size with ``address(name)``, ``shape(name)``, ``nbytes(name)`` after the inference.

    Examples
    --------
    >>> outputs = gbt.output_allocator(context)            # doctest: +SKIP
    >>> context.execute_async_v3(stream)                   # doctest: +SKIP
    >>> outputs.address("boxes"), outputs.shape("boxes")   # doctest: +SKIP
    """
    target = require_budget(budget, "output_allocator()")
    module = load_module(trt_module) if trt_module is not None else module_of(context)
    outputs = _outputs(context)
    if names is None:
        if outputs is None:
            raise ValueError(f"the outputs of {context!r} cannot be read from its engine: "
                             "pass names=")
        names = outputs
    elif isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a list of output names, got {names!r}")
    elif outputs is not None and any(n not in outputs for n in names):
        raise ValueError(f"{[n for n in names if n not in outputs]} are not outputs of the "
                         f"context's engine (its outputs: {outputs})")
    made = output_allocator_class(module)(target)
    target.pin()

    def finished(alloc: Any = made) -> None:
        alloc.close()
        target.unpin()

    # before TensorRT holds a pointer to it: it now lives as long as the context, and is
    # made inert at interpreter exit
    done = weakref.finalize(context, finished)
    done.atexit = False
    with _lock:
        _open.add(made)
    before: dict[str, Any] = {}
    try:
        for name in names:
            if name not in before:  # a name given twice: its allocator before this call
                before[name] = _output_allocator_of(context, name)
            if not context.set_output_allocator(name, made):
                raise ValueError(f"TensorRT refused an output allocator for {name!r}: "
                                 "is it an output of this context's engine?")
    except BaseException:
        _undo(context, before, done)  # all or nothing
        raise
    return made


def _outputs(context: Any) -> list[str] | None:
    """The output names of ``context``'s engine, ``None`` if they cannot be read."""
    try:
        engine = context.engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        return [n for n in names if "OUTPUT" in str(engine.get_tensor_mode(n))]
    except Exception:  # noqa: BLE001 - then TensorRT decides, name by name
        return None


def _output_allocator_of(context: Any, name: str) -> Any:
    getter = getattr(context, "get_output_allocator", None)
    try:
        return getter(name) if getter is not None else None
    except Exception:  # noqa: BLE001 - unknown: unset it on failure
        return None


def _undo(context: Any, before: dict[str, Any], done: weakref.finalize[Any, Any]) -> None:
    """Give each output its allocator from ``before`` again; then nothing holds the new one,
    which is closed and its budget unpinned now (else at the context's end, as planned)."""
    try:
        for name, previous in before.items():
            context.set_output_allocator(name, previous)
    except Exception:  # noqa: BLE001 - TensorRT may still hold it: it lives with the context
        return
    done()


@atexit.register
def _at_exit() -> None:
    """Contexts destroyed during teardown must find their allocators inert."""
    with _lock:
        for alloc in list(_open):
            alloc.closed = True
