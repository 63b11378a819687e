"""gpubudget.holding: a generator's context manager lets go of the lock it holds across its
``yield`` when an exception lands just as it is entered (where Python runs a signal handler,
as the generator's first step returns), which ``contextlib.contextmanager`` does not; and
behaves as that one otherwise. An exception is made to land there by ``next`` replaced in the
module with one that raises once the step returned."""

from __future__ import annotations

import builtins
import contextlib
import threading
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpubudget import holding
from gpubudget.holding import holding as held_by


class _LandingAfterNext:
    """While held: ``next`` in ``module`` raises as a ``SIGALRM`` handler would, once the
    generator's step returned (only for the statement it wraps: pytest itself uses
    contextlib)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def __enter__(self) -> None:
        def step(generator: Iterator[Any]) -> Any:
            builtins.next(generator)
            raise TimeoutError("alarm")

        setattr(self.module, "next", step)

    def __exit__(self, *exc: object) -> None:
        delattr(self.module, "next")


def _holder(lock: threading.Lock) -> Generator[str, None, None]:
    with lock:
        yield "in"


@pytest.mark.parametrize("made_by", ["holding", "contextlib"])
def test_an_exception_landing_as_it_is_entered_lets_go_of_the_lock(made_by: str) -> None:
    lock = threading.Lock()
    manager = held_by(_holder) if made_by == "holding" else contextlib.contextmanager(_holder)
    landing = _LandingAfterNext(holding if made_by == "holding" else contextlib)
    with pytest.raises(TimeoutError) as kept:  # the traceback kept, as a program may keep it
        with landing, manager(lock):
            pytest.fail("entered")
    assert kept.value is not None
    assert lock.locked() is (made_by == "contextlib")  # the gap this module closes


def test_it_behaves_as_contextlib_otherwise() -> None:
    lock = threading.Lock()
    with held_by(_holder)(lock) as inside:
        assert inside == "in" and lock.locked()
    assert not lock.locked()
    with pytest.raises(KeyError, match="raised inside"), held_by(_holder)(lock):
        raise KeyError("raised inside")
    assert not lock.locked()

    @held_by
    def suppressing() -> Generator[None, None, None]:
        with contextlib.suppress(KeyError):
            yield

    with suppressing():
        raise KeyError("suppressed")

    @held_by
    def empty() -> Generator[None, None, None]:
        yield from ()

    with pytest.raises(RuntimeError, match="didn't yield"), empty():
        pass

    @held_by
    def twice() -> Generator[None, None, None]:
        yield
        yield

    with pytest.raises(RuntimeError, match="didn't stop"), twice():
        pass


def test_the_host_ledgers_lock_cut_as_it_is_entered_is_let_go(tmp_path: Path) -> None:
    from tests.test_hostledger_book import open_book

    ledger = open_book(tmp_path)
    for taking in (ledger.locked, ledger.current):
        with pytest.raises(TimeoutError) as kept:
            with _LandingAfterNext(holding), taking():
                pytest.fail("entered")
        assert kept.value is not None
        with ledger.locked(0.01):  # this thread again: not waiting for itself
            pass


def test_the_host_ledgers_lock_left_suspended_never_makes_its_thread_wait_for_itself(
        tmp_path: Path) -> None:
    """What an exception landing as ``__exit__`` begins leaves (its first instruction is
    where Python may run a signal handler: nothing of it ran): the lock held while the
    manager lives, as long as the exception's traceback is kept."""
    import fcntl
    import os

    from tests.test_hostledger_book import open_book

    ledger = open_book(tmp_path)
    suspended = ledger.locked()
    suspended.__enter__()
    with ledger.locked(0.01), ledger.current():  # this thread again: no wait for itself
        pass
    other = os.open(ledger.path, os.O_RDONLY)  # another open file: another process's view
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # still held for the suspended
        del suspended  # the traceback gone: the generator closed, its blocks ended
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(other)
