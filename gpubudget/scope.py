"""The context-variable stack of active budgets: ``current_budget()`` and ``bind()``.

The variable holds an immutable tuple of budgets, innermost last. asyncio tasks copy the
context they are created in, so each task sees its own innermost budget; threads start with
an empty context, so budgets reach a thread pool through :func:`bind`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, TypeVar

from contextvars_extras.context_management import bind_to_snapshot_context

if TYPE_CHECKING:
    from .budget import Budget

__all__ = ["active_chain", "bind", "current_budget"]

R = TypeVar("R")

ACTIVE: Final[ContextVar[tuple[Budget, ...]]] = ContextVar("gpubudget_active", default=())


def active_chain() -> tuple[Budget, ...]:
    """The budgets active in this context, outermost first."""
    return ACTIVE.get()


def current_budget() -> Budget | None:
    """The innermost budget active in this context, or ``None``.

    Examples
    --------
    >>> from gpubudget import gpu_budget, current_budget
    >>> current_budget() is None
    True
    >>> with gpu_budget("1MiB", name="outer", backend="host") as outer:
    ...     current_budget() is outer
    True
    """
    chain = ACTIVE.get()
    return chain[-1] if chain else None


def bind(fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Callable[..., R]:
    """Return ``fn`` bound to ``args``/``kwargs`` and to a snapshot of the active budgets.

    The result runs ``fn`` later, anywhere (a thread pool, a callback), inside the budgets
    that were active when ``bind`` was called. Like :func:`functools.partial`, arguments
    given at call time are appended. Built on ``contextvars_extras``'
    ``bind_to_snapshot_context``: every call runs in its own copy of the snapshot.

    Examples
    --------
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from gpubudget import gpu_budget, current_budget, bind
    >>> with gpu_budget("1MiB", name="pool", backend="host") as budget:
    ...     with ThreadPoolExecutor(1) as ex:
    ...         ex.submit(bind(current_budget)).result() is budget
    True
    """
    if not callable(fn):
        raise TypeError(f"bind() needs a callable, got {fn!r}")
    # contextvars_extras 0.7's wrapper forwards the bind-time positional arguments a second
    # time and drops the call-time ones; call-time keyword arguments do pass through, so
    # everything travels as keywords to a fixed trampoline.
    snapshot = bind_to_snapshot_context(_call)

    def bound(*call_args: Any, **call_kwargs: Any) -> R:
        result: R = snapshot(fn=fn, args=args + call_args, kwargs={**kwargs, **call_kwargs})
        return result

    return bound


def _call(*, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
    return fn(*args, **kwargs)
