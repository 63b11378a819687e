"""The two context variables: the active budgets and the current label.

``ACTIVE`` holds an immutable tuple of budgets, innermost last; ``Budget.__enter__`` and
:class:`gpubudget.use` push on it and reset it with their tokens. ``LABEL`` holds the
innermost :class:`gpubudget.label`. The functions that read them live in
:mod:`gpubudget.scope`.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from .budget import Budget

__all__ = ["ACTIVE", "LABEL"]

ACTIVE: Final[ContextVar[tuple[Budget, ...]]] = ContextVar("gpubudget_active", default=())
LABEL: Final[ContextVar[str | None]] = ContextVar("gpubudget_label", default=None)
