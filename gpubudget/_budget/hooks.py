"""What adapters call on a budget: lifetime pins, their own denials and errors, their usage,
and a hook at the end of the scope.

:class:`Hooks` is what :func:`gpubudget.adapter.hooks` gives for a budget: the TensorRT,
CuPy, PyTorch and Ray adapters use its methods, and code of your own that wraps another
allocator can too. They are not on the budget itself, which is the user's object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import BudgetError
from .._core import Node
from ..units import as_int

if TYPE_CHECKING:
    from ..budget import Budget

__all__ = ["Hooks"]


class Hooks:
    """A budget's methods for adapters; see the module docstring."""

    __slots__ = ("_node",)

    def __init__(self, budget: Budget) -> None:
        self._node: Node = budget._node

    def pin(self) -> None:
        """Keep this budget's memory alive for an object that may allocate through it later
        (a TensorRT runtime, an engine); pair every call with :meth:`unpin`."""
        node = self._node
        with node.lock:
            if node.state in ("new", "released"):
                raise BudgetError(f"budget {node.name!r} is {node.state}; it cannot be pinned")
            node.pins += 1

    def unpin(self) -> None:
        """Undo one :meth:`pin`; releases the budget if it was the last thing holding it."""
        node = self._node
        with node.lock:
            if node.pins > 0:
                node.pins -= 1
                node.release_if_unused()

    def record_denial(self, size: int, reason: str) -> None:
        """Count a request an adapter refused before asking (for instance ``wrong_device``:
        a TensorRT call made while another CUDA device is current)."""
        node = self._node
        nbytes = as_int(size) or 0
        if node.tree is None:
            with node.lock:
                node.stats.count_denial(nbytes, str(reason), node.name)
        else:
            node.tree.deny(node, nbytes, str(reason))

    def report_usage(self, source: str, probe: Callable[[], tuple[int, ...]]) -> None:
        """For adapters: ``probe()`` answers, for ``source`` (``"torch"``, ``"cupy"``),
        ``(bytes charged, bytes of them in live arrays or tensors)``, optionally followed by
        ``(bytes of them that libraries keep across calls, bytes of library memory kept
        outside every budget)`` and then ``(bytes in live objects of retired pools, cached
        bytes of retired pools)``; reports show them, and the rest of the charged bytes as
        cached. Called outside the tree's lock; one that raises is noted in the report."""
        node = self._node
        with node.lock:
            node.probes[str(source)] = probe

    def call_on_exit(self, hook: Callable[[], None]) -> None:
        """For adapters: call ``hook()`` once this budget's scope has ended (at once if it has
        already). Hooks run outside the tree's lock; one that raises is noted in the report."""
        node = self._node
        with node.lock:
            if node.state in ("new", "open"):
                node.exit_hooks.append(hook)
                return
        hook()

    def record_error(self, message: str) -> None:
        """Record an error caught inside a callback, counted as a denial (``internal_error``)
        and kept for the report (the most recent 16)."""
        node = self._node
        with node.lock:
            node.stats.errors.append(str(message))
            node.stats.count_denial(0, "internal_error", node.name)
