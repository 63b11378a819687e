"""The context variables: the active budgets, the current label, separate roots.

``ACTIVE`` holds an immutable tuple of budgets, innermost last; ``Budget.__enter__`` and
:class:`gpubudget.use` push on it and reset it with their tokens. ``LABEL`` holds the
innermost :class:`gpubudget.label`. The functions that read them live in
:mod:`gpubudget.scope`. ``SEPARATE_ROOTS`` is true where root budgets are separate on purpose
(a replay's): a root entered there in a thread other than the main one, while another root
is open, is not warned about (see ``Budget``).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from .budget import Budget

__all__ = ["ACTIVE", "LABEL", "SEPARATE_ROOTS"]

ACTIVE: Final[ContextVar[tuple[Budget, ...]]] = ContextVar("gpubudget_active", default=())
LABEL: Final[ContextVar[str | None]] = ContextVar("gpubudget_label", default=None)
SEPARATE_ROOTS: Final[ContextVar[bool]] = ContextVar("gpubudget_separate_roots",
                                                    default=False)
