"""How a budgeted actor's methods run: each with the actor's budget current.

:func:`with_budget` wraps one method, keeping its kind -- plain, coroutine, generator, async
generator -- so that Ray (and Ray Serve) call it as before; the budget comes from the
instance's :class:`ActorScope`. Generators get the budget for each step only: nothing stays
current in the consumer's context between items. :func:`closing` makes the methods that end
an actor (``__ray_shutdown__``, ``__del__``) exit its budget.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import dataclass
from typing import Any, Final

from ..budget import Budget
from ..scope import use

__all__ = ["SCOPE_ATTRIBUTE", "ActorScope", "actor_methods", "closing", "scope_of",
           "with_budget"]

SCOPE_ATTRIBUTE: Final = "_gpubudget_scope"
"""The instance attribute that holds a budgeted actor's :class:`ActorScope`."""


def actor_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The functions of ``cls`` (and its bases) that Ray may call as actor methods: every
    plain function but the special ``__x__`` ones, except ``__call__`` (Serve calls it)."""
    found: dict[str, Callable[..., Any]] = {}
    for klass in reversed(cls.__mro__[:-1]):  # object's own methods are not actor methods
        for name, value in vars(klass).items():
            special = name.startswith("__") and name.endswith("__") and name != "__call__"
            if inspect.isfunction(value) and not special:
                found[name] = value
            else:
                found.pop(name, None)  # overridden by something that is not a function
    return found


def with_budget(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, run with its instance's budget current; of the same kind (plain,
    coroutine, generator, async generator) and with the same metadata."""
    if inspect.isasyncgenfunction(method):
        wrapper = _async_generator_method(method)
    elif inspect.iscoroutinefunction(method):
        wrapper = _coroutine_method(method)
    elif inspect.isgeneratorfunction(method):
        wrapper = _generator_method(method)
    else:
        wrapper = _plain_method(method)
    return functools.wraps(method)(wrapper)


@dataclass(frozen=True)
class ActorScope:
    """An actor's budget and the context it was entered in (where it must be exited)."""

    budget: Budget
    context: contextvars.Context

    def close(self) -> None:
        """Exit the budget (its trace gets an ``exit`` event and is flushed); never raises."""
        if self.budget.state == "open":
            try:
                self.context.run(self.budget.__exit__, None, None, None)
            except Exception:  # noqa: BLE001, S110 - the actor is going away regardless
                pass


def scope_of(instance: object) -> ActorScope | None:
    scope = vars(instance).get(SCOPE_ATTRIBUTE)
    return scope if isinstance(scope, ActorScope) else None


def _budget_of(instance: object) -> Budget | None:
    scope = scope_of(instance)
    return scope.budget if scope is not None and scope.budget.state == "open" else None


def _plain_method(method: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: object, *args: Any, **kwargs: Any) -> Any:
        budget = _budget_of(self)
        if budget is None:
            return method(self, *args, **kwargs)
        with use(budget):
            return method(self, *args, **kwargs)

    return call


def _coroutine_method(method: Callable[..., Any]) -> Callable[..., Any]:
    async def call(self: object, *args: Any, **kwargs: Any) -> Any:
        budget = _budget_of(self)
        if budget is None:
            return await method(self, *args, **kwargs)
        with use(budget):
            return await method(self, *args, **kwargs)

    return call


def _generator_method(method: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: object, *args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        budget = _budget_of(self)
        if budget is None:
            return (yield from method(self, *args, **kwargs))
        return (yield from _each_step_in(budget, method(self, *args, **kwargs)))

    return call


def _each_step_in(budget: Budget, steps: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
    """Drive ``steps`` with ``budget`` current during each step only, so that nothing stays
    current in the consumer's context between items, whichever thread asks for the next."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        with use(budget):
            try:
                item = steps.throw(thrown) if thrown is not None else steps.send(sent)
            except StopIteration as stop:
                return stop.value
        sent, thrown = None, None
        try:
            sent = yield item
        except GeneratorExit:
            with use(budget):
                steps.close()
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the generator, as yield from does
            thrown = exc


def _async_generator_method(method: Callable[..., Any]) -> Callable[..., Any]:
    async def call(self: object, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        steps = method(self, *args, **kwargs)
        budget = _budget_of(self)
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                step = steps.asend(sent) if thrown is None else steps.athrow(thrown)
                if budget is None:
                    item = await step
                else:
                    with use(budget):
                        item = await step
            except StopAsyncIteration:
                return
            sent, thrown = None, None
            try:
                sent = yield item
            except GeneratorExit:
                await steps.aclose()
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the generator
                thrown = exc

    return call


def closing(name: str, hook: Callable[..., Any] | None) -> Callable[..., Any]:
    """A method ``name`` that runs the class's own ``hook`` (with the budget current), then
    exits the actor's budget, which writes the trace's last events. For
    ``__ray_shutdown__``, which Ray calls when an actor exits gracefully, and ``__del__``,
    which Ray Serve calls when it stops a replica. Of the hook's kind (Serve accepts an
    ``async def __del__``)."""
    if hook is not None and inspect.iscoroutinefunction(hook):
        async def close_async(self: object) -> None:
            try:
                await with_budget(hook)(self)
            finally:
                _close_scope(self)

        return functools.update_wrapper(close_async, hook)

    def close(self: object) -> None:
        try:
            if hook is not None:
                with_budget(hook)(self)
        finally:
            _close_scope(self)

    close.__name__ = close.__qualname__ = name
    return functools.update_wrapper(close, hook) if inspect.isfunction(hook) else close


def _close_scope(instance: object) -> None:
    scope = scope_of(instance) if hasattr(instance, "__dict__") else None
    if scope is not None:
        scope.close()
