"""Which budget is current: ``current_budget()``, ``use()``, ``label()``, ``bind()``.

The active budgets live in a context variable (:mod:`gpubudget.context`). asyncio tasks copy
the context they are created in, so each task sees its own innermost budget; threads start
with an empty context, so budgets reach a thread pool through :func:`bind` or :class:`use`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import Token
from types import TracebackType
from typing import Any, Final, TypeVar

from . import door
from .budget import ADVICE, Budget, misnested
from .context import ACTIVE, LABEL
from .errors import BudgetNestingError

__all__ = ["bind", "current_budget", "current_label", "label", "use"]

R = TypeVar("R")


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


class use:  # noqa: N801 - used like a function: ``with use(pool):``
    """Make an open budget the current one in this context, without entering a child.

    For thread pools and long-lived workers: the budget that allocations, TensorRT objects
    made here and budgets entered here (as its children) see. Nests like a budget; exits
    must be in reverse order. Works with ``with`` and ``async with``.

    Examples
    --------
    >>> import threading
    >>> from gpubudget import gpu_budget, current_budget, use
    >>> seen = []
    >>> def worker(pool):
    ...     with use(pool):                       # a new thread starts with no budget
    ...         with gpu_budget("1KiB", name="request") as request:
    ...             seen.append(request.parent is pool)
    >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
    ...     thread = threading.Thread(target=worker, args=(pool,))
    ...     thread.start(); thread.join()
    >>> seen
    [True]
    """

    __slots__ = ("budget", "_tokens")

    def __init__(self, budget: Budget) -> None:
        if not isinstance(budget, Budget):
            raise TypeError(f"use() takes a Budget, got {budget!r}")
        self.budget: Final = budget
        self._tokens: list[Token[tuple[Budget, ...]]] = []

    def __enter__(self) -> Budget:
        if self.budget.state != "open":
            raise BudgetNestingError(f"use() needs an open budget; {self.budget.name!r} is "
                                     f"{self.budget.state}")
        self._tokens.append(ACTIVE.set(ACTIVE.get() + (self.budget,)))
        door.follow()  # the driver door, where loaded, charges this thread's calls here
        return self.budget

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        chain = ACTIVE.get()
        if not self._tokens or not chain or chain[-1] is not self.budget:
            misnested(f"use({self.budget.name!r}) exited while it is not the innermost "
                      f"budget here; {ADVICE}", exc_type)
            return
        token = self._tokens.pop()
        try:
            ACTIVE.reset(token)
        except ValueError:  # entered in another context (a task copied it)
            ACTIVE.set(chain[:-1])
        door.follow()

    async def __aenter__(self) -> Budget:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"use({self.budget!r})"

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
    # Imported here, at the first bind(): contextvars_extras imports asyncio (and with it
    # ssl), a third of gpubudget's import time that most programs never need.
    from contextvars_extras.context_management import bind_to_snapshot_context

    snapshot = bind_to_snapshot_context(_call)

    def bound(*call_args: Any, **call_kwargs: Any) -> R:
        try:
            result: R = snapshot(fn=fn, args=args + call_args, kwargs={**kwargs, **call_kwargs})
        finally:
            door.follow()  # the driver door, where loaded: this context's budget again
        return result

    return bound


def _call(*, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
    door.follow()  # the snapshot's budget, for the driver door where it is loaded
    return fn(*args, **kwargs)
