"""cuda.core inside budgets: ``gpubudget.cuda_core.resource(budget)`` is a cuda.core
``MemoryResource`` whose buffers are the budget's blocks.

>>> from cuda.core import Device                                # doctest: +SKIP
>>> from gpubudget import gpu_budget, cuda_core as gbcc          # doctest: +SKIP
>>> device = Device(0)                                          # doctest: +SKIP
>>> device.set_current()                                        # doctest: +SKIP
>>> stream = device.create_stream()                             # doctest: +SKIP
>>> with gpu_budget("1GiB", name="decoder") as budget:          # doctest: +SKIP
...     mr = gbcc.resource()                                    # the current budget
...     buffer = mr.allocate(4096, stream=stream)                # a block of the budget
...     budget.used
...     buffer.close()                                          # freed in stream order
4096

Everything cuda.core hands a ``MemoryResource`` goes to the budget: ``allocate(size, *,
stream)`` takes a block (tagged with the current :func:`gpubudget.label` or
``"cuda_core"``), placed for ``stream`` (a block freed on that stream is reused at once);
``deallocate(ptr, size, *, stream)``, which ``Buffer.close()`` calls with the buffer's
stream, frees it in that stream's order: the same stream may reuse it at once, any other
only once the work queued on the stream before the free has completed, as every
stream-ordered free of a budget. A ``GraphBuilder`` (a graph being captured) is refused with
a ``TypeError``: a budget's frees are ordered by events, which a capture would put inside the
graph; allocate before the capture, or use cuda.core's ``GraphMemoryResource`` inside it.

The resource belongs to the budget's device: ``device_id`` is the budget's CUDA ordinal,
``is_device_accessible`` is true and ``is_host_accessible`` false. It serves its budget
after the ``with`` block has ended too: the resource keeps the budget's memory alive (as a
TensorRT runtime does) until the resource and the budget's last block are gone.

Denial: cuda.core's own error (``CUDAError``, as cuda.core raises for
``CUDA_ERROR_OUT_OF_MEMORY``) that is also an :class:`~gpubudget.errors.AllocationDenied`,
naming the budget, its limit and why. A buffer that cannot be made once the block is taken
gives the block back before the error goes on; ``deallocate`` of a pointer that is not a
live block of the budget is a ``ValueError`` naming it. A buffer of 0 bytes takes no block;
a negative size is a ``ValueError``.
"""

from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING, Any, Final

from .adapter import hooks
from .budget import Budget
from .errors import AllocationDenied
from .routing import target_budget
from .scope import current_label

try:
    from cuda.core import Buffer, MemoryResource
    from cuda.core._utils.cuda_utils import CUDAError
except ImportError as exc:  # pragma: no cover - exercised where cuda-core is missing
    raise ImportError("gpubudget.cuda_core needs cuda-core (pip install 'gpubudget[cuda-core]')"
                      ) from exc

try:
    from cuda.core.graph import GraphBuilder
except ImportError:  # pragma: no cover - cuda.core before 1.0 kept it at the top
    from cuda.core import GraphBuilder  # type: ignore[attr-defined]

if TYPE_CHECKING:
    from cuda.core import Stream

__all__ = ["BudgetOutOfMemoryError", "BudgetResource", "resource"]

SOURCE: Final = "cuda_core"


class BudgetOutOfMemoryError(CUDAError, AllocationDenied):
    """cuda.core's ``CUDAError`` for a budget's denial (its text begins as cuda.core's does
    for an out-of-memory error); also an :class:`~gpubudget.errors.AllocationDenied`."""

    def __init__(self, denied: AllocationDenied) -> None:
        Exception.__init__(self, f"CUDA_ERROR_OUT_OF_MEMORY: {denied}")
        self.budget, self.refused_by = denied.budget, denied.refused_by
        self.reason, self.size, self.charged = denied.reason, denied.size, denied.charged


def _stream_handle(stream: object) -> int:
    """The CUDA stream a cuda.core ``Stream`` stands for (the CUDA stream protocol,
    ``__cuda_stream__``); ``TypeError`` naming anything else, and a ``GraphBuilder``."""
    if isinstance(stream, GraphBuilder):
        raise TypeError("gpubudget.cuda_core: a budget's blocks are not allocated or freed "
                        "into a graph being built (a GraphBuilder): allocate before the "
                        "capture, or use cuda.core's GraphMemoryResource inside it")
    protocol = getattr(stream, "__cuda_stream__", None)
    if not callable(protocol):
        raise TypeError(f"stream must be a cuda.core Stream or GraphBuilder, got {stream!r}")
    version_and_handle: tuple[int, int] = protocol()
    return int(version_and_handle[1])


class BudgetResource(MemoryResource):
    """A cuda.core ``MemoryResource`` over one budget; see the module docstring."""

    def __init__(self, budget: Budget) -> None:
        self.budget: Final = budget
        device = budget.device
        assert device is not None  # target_budget refuses host memory
        self._device: Final = device
        held = hooks(budget)
        held.pin()  # the budget keeps its memory for as long as its resource lives
        weakref.finalize(self, held.unpin)

    def allocate(self, size: int, *, stream: Stream | GraphBuilder) -> Buffer:
        nbytes = operator.index(size)  # TypeError for anything but an integer
        handle = _stream_handle(stream)
        if nbytes < 0:
            raise ValueError(f"gpubudget.cuda_core: a buffer's size is at least 0, got {size!r}")
        if nbytes == 0:  # an empty buffer: no block, nothing to free
            return Buffer.from_handle(0, 0, mr=self, stream=stream)
        try:
            address = self.budget.allocate(nbytes, tag=current_label() or SOURCE,
                                           stream=handle, raise_on_denial=True)
        except AllocationDenied as denied:
            raise BudgetOutOfMemoryError(denied) from None
        done = False
        try:
            buffer = Buffer.from_handle(address, nbytes, mr=self, stream=stream)
            done = True
        finally:
            if not done:  # never handed out: back at once
                self.budget.free(address)
        return buffer

    def deallocate(self, ptr: Any, size: int, *, stream: Stream | GraphBuilder) -> None:
        address = int(ptr)
        handle = _stream_handle(stream)
        if address == 0 and size == 0:  # an empty buffer's
            return
        if not self.budget.free(address, stream=handle):
            raise ValueError(f"gpubudget.cuda_core: {address:#x} is not a live block of budget "
                             f"{self.budget.name!r} (freed already, another budget's, or the "
                             f"free on stream {handle:#x} could not be ordered: see its "
                             f"report)")

    @property
    def device_id(self) -> int:
        return self._device

    @property
    def is_device_accessible(self) -> bool:
        return True

    @property
    def is_host_accessible(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<gpubudget.cuda_core.BudgetResource of {self.budget!r}>"


def resource(budget: Budget | None = None) -> BudgetResource:
    """A cuda.core ``MemoryResource`` over ``budget`` (default: the current one).

    ``BudgetError`` outside any budget, for a budget that can no longer allocate, or for a
    budget in host memory (cuda.core's device buffers need device memory); ``TypeError``
    for anything but a :class:`~gpubudget.Budget`.
    """
    return BudgetResource(target_budget(budget, "gpubudget.cuda_core.resource()"))
