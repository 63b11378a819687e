"""The context-variable stack of active budgets: ``current_budget()`` and ``bind()``.

The variable holds an immutable tuple of budgets, innermost last. asyncio tasks copy the
context they are created in, so each task sees its own innermost budget; threads start with
an empty context, so budgets reach a thread pool through :func:`bind`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, Final, TypeVar

from contextvars_extras.context_management import bind_to_snapshot_context

if TYPE_CHECKING:
    from .budget import Budget

__all__ = ["active_chain", "bind", "current_budget", "current_label", "label"]

R = TypeVar("R")

ACTIVE: Final[ContextVar[tuple[Budget, ...]]] = ContextVar("gpubudget_active", default=())
LABEL: Final[ContextVar[str | None]] = ContextVar("gpubudget_label", default=None)


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


def current_label() -> str | None:
    """The innermost label set with :func:`label` in this context, or ``None``."""
    return LABEL.get()


class label:  # noqa: N801 - used like a function: ``with label("detector/weights"):``
    """Tag every block allocated in this context, inside the ``with`` block, with ``name``.

    An explicit ``tag=`` wins over a label; a label wins over the phase that the TensorRT
    adapter supplies ("build", "deserialize", "runtime"). Labels nest: the innermost one
    applies. Works with ``with`` and ``async with``.

    Examples
    --------
    >>> from gpubudget import gpu_budget, label
    >>> with gpu_budget("1MiB", backend="host") as budget:
    ...     with label("detector/weights"):
    ...         block = budget.allocate(4096)
    ...     [b.tag for b in budget.report().live_blocks]
    ['detector/weights']
    """

    __slots__ = ("name", "_tokens")

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise (TypeError if not isinstance(name, str) else ValueError)(
                f"label name must be a non-empty string, got {name!r}"
            )
        self.name = name
        self._tokens: list[Token[str | None]] = []

    def __enter__(self) -> label:
        self._tokens.append(LABEL.set(self.name))
        return self

    def __exit__(self, *exc: object) -> None:
        LABEL.reset(self._tokens.pop())

    async def __aenter__(self) -> label:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__()

    def __repr__(self) -> str:
        return f"label({self.name!r})"


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
