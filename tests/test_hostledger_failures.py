"""The host ledger when it cannot be used: a process stopped while it holds the file's lock, a
full ledger, a damaged file. A root with a plain limit enters unregistered with one warning
and works; a root that needs the ledger fails with a ``LedgerError`` naming the problem;
readers (``gpubudget top``, metrics) read or refuse the file in one clear error; nothing else
ever escapes (no ``struct.error``, no ``IndexError``, no hang)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpubudget import Budget, BudgetError, gpu_budget
from gpubudget.cli.top import render
from gpubudget.hostledger import LedgerError, claims, host_view
from gpubudget.hostledger.book import DeviceBook
from gpubudget.hostledger.devices import host_device
from gpubudget.hostledger.errors import LedgerDamaged, LedgerFull, LedgerLocked
from gpubudget.hostledger.files import LedgerDirectory
from gpubudget.hostledger.layout import (
    CHANGES_WORD,
    HEADER,
    HEADER_BYTES,
    PAGE_BYTES,
    LOG_LENGTH,
    LOG_WORD,
    SLOT,
    SLOT_BYTES,
    SLOT_FIELDS,
    SLOTS,
    UNLOCKED_WORD,
    header_word,
)
from gpubudget.hostledger.layout import CHILD_BYTES, CHILD_FIELDS, CHILDREN, PAGE_FIELDS
from gpubudget.hostledger.procs import myself
from gpubudget.metrics import families
from gpubudget.units import MiB
from tests.helpers import subprocess_env

HANG = 120.0
"""Seconds after which a step counts as hung (its only job: to fail instead of hanging)."""


@pytest.fixture(autouse=True)
def _ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A ledger of the test's own on the host backend as a host (a device that enforces
    nothing itself, so that a plain root does not need the ledger), warnings not yet given."""
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))
    monkeypatch.delenv("GPUBUDGET_DEVICE_MEMORY", raising=False)
    monkeypatch.delenv("GPUBUDGET_DEVICE_CAP", raising=False)
    monkeypatch.setattr(claims, "_warned", set())


def ledger_file() -> Path:
    with gpu_budget("1MiB", name="first"):  # creates the directory and the device's file
        pass
    return Path(os.environ["GPUBUDGET_LEDGER_DIR"]) / "host.ledger"


def enter(limit: str, name: str) -> tuple[Budget, contextvars.Context]:
    """A root entered in a context of its own (as in another thread or task)."""
    budget = gpu_budget(limit, name=name)
    context = contextvars.Context()
    context.run(budget.__enter__)
    return budget, context


def leave(budget: Budget, context: contextvars.Context) -> None:
    context.run(budget.__exit__, None, None, None)


def works(budget: Budget) -> None:
    """The root hands out and takes back memory, and its books agree."""
    size = min(4096, budget.limit)  # a share may come to little
    block = budget.allocate(size)
    assert block is not None and budget.used == size
    assert budget.free(block) and budget.used == 0
    budget.check()


def names() -> list[str]:
    return [entry.name for entry in host_view(nvml=False).entries]


# -- a process stopped while it holds the lock ---------------------------------------------

LOCK_HOLDER = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDONLY)   # a read-only descriptor is enough to lock it
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.fixture
def stopped_holder() -> Iterator[subprocess.Popen[bytes]]:
    """A process that holds the ledger file's lock and is stopped (SIGSTOP), known to be
    both before the test goes on."""
    path = ledger_file()
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(path)],
                              stdout=subprocess.PIPE, env=subprocess_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        _, status = os.waitpid(holder.pid, os.WUNTRACED)  # returns once it has stopped
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        yield holder
    finally:
        holder.kill()  # SIGKILL ends a stopped process too; the kernel drops its lock
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def test_a_stopped_process_holding_the_lock_lets_plain_roots_in_unregistered(
        stopped_holder: subprocess.Popen[bytes]) -> None:
    started = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"root budgets are not registered in the host "
                      r"ledger: the ledger file '.*host.ledger' has been locked by another "
                      r"process for more than 0.5 s \(one stopped while changing it\?\)"):
        with gpu_budget("64MiB", name="plain") as plain:
            works(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning for this kind of trouble, not one per root
        for _ in range(20):  # each waits briefly now, not the whole wait again
            with gpu_budget("64MiB", name="again") as again:
                works(again)
    with pytest.raises(LedgerLocked, match=r"is still locked by another process"):
        gpu_budget("50%", name="share").__enter__()  # a share needs the ledger
    assert names() == []  # readers read without the lock rather than fail
    assert time.monotonic() - started < HANG


def test_roots_registered_before_the_lock_was_kept_still_leave_their_slots(
        tmp_path: Path) -> None:
    held, context = enter("16MiB", "before")
    path = Path(os.environ["GPUBUDGET_LEDGER_DIR"]) / "host.ledger"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(path)],
                              stdout=subprocess.PIPE, env=subprocess_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        _, status = os.waitpid(holder.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        assert names() == ["before"]
        works(held)
        leave(held, context)  # its slot is its own: freed without the lock
        assert names() == []
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    with gpu_budget("8MiB", name="after") as after:  # the lock is free: registered again
        assert names() == ["after"]
        works(after)


def test_a_root_whose_lock_is_taken_between_claim_and_reserve_still_marks_its_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ledger_file()
    claim, locked = DeviceBook.claim, DeviceBook.locked
    kept = {"now": False}

    def claiming(book: DeviceBook, *args: Any) -> int:
        kept["now"] = True  # from here on another process keeps the lock
        return claim(book, *args)

    @contextlib.contextmanager
    def locking(book: DeviceBook) -> Iterator[None]:
        if kept["now"]:
            raise LedgerLocked("kept by another process")
        with locked(book):
            yield

    monkeypatch.setattr(DeviceBook, "claim", claiming)
    monkeypatch.setattr(DeviceBook, "locked", locking)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # registered: nothing to warn of
        with gpu_budget("16MiB", name="between") as between:
            (entry,) = host_view(nvml=False).entries
            assert (entry.name, entry.state, entry.reserved) == ("between", "reserved",
                                                                  16 * MiB)
            works(between)
    assert names() == []  # and freed its slot without the lock too


# -- a full ledger -------------------------------------------------------------------------


def test_a_full_ledger_lets_plain_roots_in_unregistered_and_refuses_shares() -> None:
    crowd = [enter("1MiB", f"r{number}") for number in range(SLOTS)]
    try:
        assert len(names()) == SLOTS
        with pytest.warns(RuntimeWarning, match=r"not registered in the host ledger: the "
                          r"ledger file '.*host.ledger' is full: 4096 root budgets of live "
                          r"processes are registered on this device"):
            with gpu_budget("8MiB", name="one more") as more:
                works(more)
        with pytest.raises(LedgerFull, match="is full: 4096 root budgets"):
            gpu_budget("1%", name="share").__enter__()
        leave(*crowd.pop(100))
        with gpu_budget("8MiB", name="in again") as again:
            assert "in again" in names() and len(names()) == SLOTS
            works(again)
    finally:
        for budget, context in crowd:
            leave(budget, context)
    assert names() == []


# -- a damaged file ------------------------------------------------------------------------


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """What another program does to the file while this process has it open and mapped."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def test_a_header_overwritten_while_the_file_is_open_is_a_damaged_ledger() -> None:
    path = ledger_file()  # this process has the file open and mapped from here on
    overwrite(path, header_word("high") * 8, (5000).to_bytes(8, sys.byteorder))
    with pytest.warns(RuntimeWarning, match=r"not registered in the host ledger: the ledger "
                      r"file '.*host.ledger': damaged header \(5000 slots in use of 4096\); "
                      r"remove it"):
        with gpu_budget("8MiB", name="plain") as plain:
            works(plain)
    with pytest.raises(LedgerDamaged, match="damaged header"):
        gpu_budget("50%", name="share").__enter__()
    with pytest.raises(LedgerError, match=r"host.ledger': damaged header \(slots 4096 of 256 "
                                          r"bytes, 5000 used\)"):
        host_view(nvml=False)


# Every field of the header, and of a slot, as (offset, length) in the file.
_HEADER_FIELDS = [(offset, size) for offset, size in zip(
    (0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 128, 192),
    (8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 64, 64))]
assert sum(size for _, size in _HEADER_FIELDS) + 40 == HEADER.size
_HEADER_FIELDS += [(CHANGES_WORD * 8, 8), (UNLOCKED_WORD * 8, 8)]
_LOG = [((LOG_WORD + word) * 8, 8) for word in range(LOG_LENGTH)]
_SLOT_FIELDS = [(index * 8, 8) for index in range(len(SLOT_FIELDS))] + [(136, 64), (200, 56)]
assert SLOT.size == SLOT_BYTES == 256
# A page's head, and the rows of its first children, as (offset in the page, length).
_PAGE_FIELDS = [(index * 8, 8) for index in range(len(PAGE_FIELDS))] + [
    (row * CHILD_BYTES + index * 8, 8) for row in (1, 2) for index in range(len(CHILD_FIELDS))
] + [(row * CHILD_BYTES + 64, 64) for row in (1, 2)]


def _another_holder() -> DeviceBook:
    """Another live holder of the file (a second handle: slot locks of its own) with a slot,
    and a slot of a process that has ended."""
    directory = LedgerDirectory(Path(os.environ["GPUBUDGET_LEDGER_DIR"]), create=False)
    try:
        other = DeviceBook(directory, "host", "host memory", host_device().total, False)
    finally:
        directory.close()
    me = myself()
    with other.current():
        other.claim({"pid": me.pid, "start": me.start, "pidns": me.pidns, "boot": me.boot,
                     "claim": 3 * MiB, "limit": 3 * MiB}, "other's", "another process")
        ended = other.claim({"pid": 2**22 + 1, "start": 1, "pidns": me.pidns,
                             "boot": me.boot, "claim": MiB}, "ended", "a process that ended")
    other._unlock_slot(ended)  # it ended: nobody holds its slot's lock
    return other


def _close(*books: DeviceBook) -> None:
    """Let go of the files' descriptors (each example has a directory of its own)."""
    for book in books:
        os.close(book.fd)
        if book.locks_fd is not None:
            os.close(book.locks_fd)


def _everything_documented(path: Path) -> None:
    """Enter roots, read as top and metrics do: only documented outcomes."""
    for limit in ("8MiB", "1%"):
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                with gpu_budget(limit, name="probe") as probe:
                    works(probe)
        except BudgetError:  # refused (a LedgerError), the ledger unusable for a share, or
            pass  # no memory to reserve: documented
        else:
            said = [warning for warning in seen  # not another test's garbage, finalized now
                    if str(warning.message).startswith("gpubudget")]
            assert all(issubclass(warning.category, RuntimeWarning)
                       and "not registered in the host ledger" in str(warning.message)
                       for warning in said), [str(warning.message) for warning in said]
    try:
        view = host_view(nvml=False)
    except LedgerError as exc:
        assert str(path) in str(exc)
    else:
        render(view)
        families(view)
        view.as_dict()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(where=st.one_of(
    st.tuples(st.just("header"), st.sampled_from(_HEADER_FIELDS), st.just(0)),
    st.tuples(st.just("header"), st.sampled_from(_LOG), st.just(0)),
    st.tuples(st.just("slot"), st.sampled_from(_SLOT_FIELDS), st.integers(0, 3)),
    st.tuples(st.just("page"), st.sampled_from(_PAGE_FIELDS), st.integers(0, 1))),
    noise=st.binary(min_size=1, max_size=64), at=st.integers(0, 63))
@example(where=("header", (header_word("high") * 8, 8), 0),  # the attack as found
         noise=(5000).to_bytes(8, sys.byteorder), at=0)
def test_random_bytes_in_any_field_give_only_documented_errors(
        where: tuple[str, tuple[int, int], int], noise: bytes, at: int) -> None:
    kind, (offset, size), slot = where
    noise = noise[:size]
    at %= size - len(noise) + 1
    with mock.patch.dict(os.environ, GPUBUDGET_LEDGER_DIR=tempfile.mkdtemp()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # checked per root below
        claims._warned.clear()
        path = ledger_file()
        kept, context = enter("4MiB", "kept")  # slot 0, this process's own
        child = gpu_budget("2MiB", name="kid")  # shown in page 0, row 1
        context.run(child.__enter__)
        other = _another_holder()  # slots 1 (alive) and 2 (ended); 3 is free
        base = (offset if kind == "header" else HEADER_BYTES + slot * SLOT_BYTES + offset
                if kind == "slot" else CHILDREN + slot * PAGE_BYTES + offset)
        started = time.monotonic()
        try:
            overwrite(path, base + at, noise)
            _everything_documented(path)
            works(kept)
            works(child)
            another = gpu_budget("1MiB", name="grandkid")  # a row taken after the damage
            context.run(another.__enter__)
            works(another)
            context.run(another.__exit__, None, None, None)
        finally:
            context.run(child.__exit__, None, None, None)
            leave(kept, context)
        _everything_documented(path)
        assert time.monotonic() - started < HANG
        _close(other, claims._books.pop((path.parent, "host")))
