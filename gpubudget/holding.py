"""Context managers written as generators that hold a lock across their ``yield``, and let go
of it whatever exception lands from outside (a Ctrl-C, a signal handler's ``TimeoutError``).

:func:`contextlib.contextmanager` leaves one gap: an exception that Python raises in its
``__enter__`` just after the generator reached its ``yield`` (where a signal handler runs,
as the call returns) leaves the generator suspended inside its ``with lock:``, holding the
lock for as long as anything keeps the exception's traceback (which keeps ``__enter__``'s
frame, and the generator with it). :func:`holding` closes the generator there, so that its
``with`` blocks and ``finally`` clauses run before the exception goes on. Otherwise it
behaves as :func:`contextlib.contextmanager` for generators that yield once.

>>> import threading
>>> lock = threading.Lock()
>>> @holding
... def held():
...     with lock:
...         yield "in"
>>> with held() as inside:
...     print(inside, lock.locked())
in True
>>> lock.locked()
False
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Generic, ParamSpec, TypeVar

__all__ = ["Held", "holding"]

P = ParamSpec("P")
T = TypeVar("T")


class Held(Generic[T]):
    """The context manager :func:`holding` makes of one generator."""

    __slots__ = ("_generator",)

    def __init__(self, generator: Generator[T, None, None]) -> None:
        self._generator = generator

    def __enter__(self) -> T:
        generator = self._generator
        try:
            return next(generator)
        except StopIteration:
            raise RuntimeError("generator didn't yield") from None
        except BaseException:
            generator.close()  # suspended at its yield if it landed after: its blocks end
            raise

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> bool | None:
        generator = self._generator
        if value is None:
            try:
                next(generator)
            except StopIteration:
                return False
            generator.close()
            raise RuntimeError("generator didn't stop")
        try:
            generator.throw(value)
        except StopIteration as done:
            return done is not value  # the generator caught it: suppressed
        except BaseException as exc:
            if exc is value:
                return False  # raised on, as it was
            raise
        generator.close()
        raise RuntimeError("generator didn't stop after throw()")


def holding(function: Callable[P, Generator[T, None, None]]) -> Callable[P, Held[T]]:
    """A decorator like :func:`contextlib.contextmanager`, closing the generator when an
    exception lands as it is entered (see the module docstring)."""

    @functools.wraps(function)
    def made(*args: P.args, **kwargs: P.kwargs) -> Held[T]:
        return Held(function(*args, **kwargs))

    return made
