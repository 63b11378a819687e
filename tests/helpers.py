"""Helpers for tests: host blocks to write and read, and backends that fail or wait on cue."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from gpubudget import Budget
from gpubudget.backends.host import HostBackend, HostReservation


def fill(address: int, size: int, byte: int) -> None:
    """Write ``byte`` into every byte of a host-backend block."""
    ctypes.memset(address, byte, size)


def holds(address: int, size: int, byte: int) -> bool:
    """Whether every byte of a host-backend block still holds ``byte``."""
    return ctypes.string_at(address, size) == bytes([byte]) * size


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a Python subprocess that imports gpubudget and the tests from this
    checkout, keeping whatever path the suite itself runs with."""
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def consistent(budget: Budget) -> None:
    """Assert, from outside, that a tree's bookkeeping agrees: ``check()`` passes and the
    root's ``used`` is the sum of its live blocks and its children's shares."""
    budget.check()
    root = budget.root.report()
    blocks = sum(report.live_bytes for report in root.walk())
    reserves = sum(max(report.reserve - report.used, 0) for report in root.walk()
                   if report.state != "released")
    assert root.used == blocks + reserves, (root.used, blocks, reserves)


class RecordingBackend(HostBackend):
    """Host memory that remembers the reservations it handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.reservations: list[HostReservation] = []

    def reserve(self, nbytes: int) -> HostReservation:
        reservation = super().reserve(nbytes)
        self.reservations.append(reservation)
        return reservation


class ManualEvent:
    """A stream event that completes when the test says (or when waited for)."""

    def __init__(self, backend: StreamBackend, stream: int) -> None:
        self.backend = backend
        self.stream = stream
        self.done = False

    def query(self) -> bool:
        if self.backend.fail_query:
            raise RuntimeError("event query failed")
        return self.done

    def synchronize(self) -> None:
        if self.backend.fail_query:
            raise RuntimeError("event synchronize failed")
        self.backend.waits += 1
        self.done = True


class StreamBackend(HostBackend):
    """Host memory with streams whose work completes only when the test calls
    :meth:`finish` (or a budget waits on an event); recording an event can be made to fail,
    as PyCUDA does on a bad stream handle."""

    synchronous = False

    def __init__(self) -> None:
        super().__init__()
        self.events: list[ManualEvent] = []
        self.fail_record = False
        self.fail_query = False
        self.waits = 0

    def record_event(self, stream: int) -> ManualEvent:
        if self.fail_record:
            raise RuntimeError(f"invalid stream handle {stream:#x}")
        event = ManualEvent(self, stream)
        self.events.append(event)
        return event

    def finish(self, stream: int | None = None) -> None:
        """Complete the work queued on ``stream`` (every stream when ``None``)."""
        for event in self.events:
            if stream is None or event.stream == stream:
                event.done = True


def finishes(work: Callable[[], object], seconds: float = 30.0) -> None:
    """Run ``work`` in a thread and fail (rather than hang the suite) if it is not done in
    time: a watchdog, with the stacks of every thread dumped when it fires. An exception of
    ``work`` is raised here."""
    import faulthandler

    import pytest

    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        faulthandler.dump_traceback(all_threads=True)
        pytest.fail(f"did not finish in {seconds} s: a deadlock")
    if errors:
        raise errors[0]


def python_paths(budget: Budget) -> None:
    """Send every allocate and free of ``budget``'s tree through the Python methods: the C
    fast path has no line at which a trace function or a Ctrl-C can land (its tests are in
    test_native.py)."""
    tree = budget._node.tree
    assert tree is not None
    tree.fast = False


def forget_stale_handled_exception() -> BaseException | None:
    """An exception that a trace function raises at the very end of an ``except`` block (the
    tests that inject one before every instruction) can leave CPython believing that the
    caught exception is still being handled, in this thread, after its handler is gone:
    every exception raised later names it as its ``__context__``. Clear it (from a plain
    function: in a generator this would clear the generator's own) and return it."""
    stale = sys.exc_info()[1]
    if stale is not None:
        ctypes.pythonapi.PyErr_SetExcInfo(None, None, None)
    return stale


def free_elsewhere(lock: Any) -> bool:
    """Whether another thread can take ``lock`` now (a re-entrant lock: this one always
    could)."""
    taken: list[bool] = []

    def probe() -> None:
        got = lock.acquire(blocking=False)
        if got:
            lock.release()
        taken.append(got)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return taken == [True]
