"""Registering a root budget in the host ledger: claim, reserve, publish, release.

:func:`open_registered` is what a root's entry calls. In order:

1. Read the device's free memory (a device call, with no lock held).
2. Under the ledger's lock (microseconds, whatever the number of live roots: this
   process's index of the slots reads only those changed since it last looked): clear the
   slots of processes that have ended; decide how much the root may have
   (:func:`~gpubudget.hostledger.sizing.decide`: its limit, or its share of what is
   unclaimed, within the device cap); write its slot, ``claimed``. If a claim of another
   process may not show in the free memory read in 1 (it is still reserving), let go of
   the lock and start again, for up to :data:`SETTLE_SECONDS`; then count it as taken.
3. Reserve the memory (a device call, no lock held). If that fails, the slot is released
   and the error names who holds the device's memory: all or nothing.
4. Mark the slot ``reserved``; from now on every change of the root's ``used`` (with its
   ``peak``) and every denial in its tree is stored into the slot's words, with plain
   stores (:mod:`gpubudget._core.ledger` and :mod:`gpubudget._core.recorder` do it), and
   each child budget that enters gets a row of the root's pages, which its numbers are
   stored into in the same way (:mod:`~gpubudget.hostledger.children`).
5. When the root releases its reservation (or the process exits, or dies), its pages and
   its slot go.

When the ledger cannot be used (a directory or file refused, a file damaged or full, a lock
that another process keeps: :class:`~gpubudget.hostledger.errors.LedgerUnusable`), a root
with a plain limit is entered unregistered, with one ``RuntimeWarning`` per kind of trouble
in the process; a root that needs the ledger (a share, a cap, a simulated device) raises it.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from ..backends import Backend, Reservation
from ..callers import user_stacklevel
from ..errors import BudgetError
from ..tracefile import printable
from ..units import format_size, round_up
from .book import DeviceBook
from .children import Family
from .devices import LedgerDevice, device_for
from .errors import LedgerError, LedgerLocked, LedgerUnusable
from .files import LedgerDirectory, ledger_directory
from .layout import Entry, slot_word
from .procs import myself, process_title
from .sizing import CAP_ENV, Share, decide, headroom, parse_cap

if TYPE_CHECKING:
    from .._core.tree import Tree

__all__ = ["LEDGER_ENV", "SETTLE_SECONDS", "Claim", "book_for", "device_claims", "holders",
           "ledger_enabled", "open_registered"]

LEDGER_ENV: Final = "GPUBUDGET_LEDGER"
"""Environment variable: ``0`` (or ``off``) registers no root in the host ledger."""
SETTLE_SECONDS: Final = 2.0
"""How long a claim waits for other processes' reservations under way to show in the
device's free memory before it counts them as taken."""
SHOWN_HOLDERS: Final = 8

_lock = threading.Lock()
_books: dict[tuple[Path, str], DeviceBook] = {}
_claims: set[Claim] = set()
_serials: Final = itertools.count(1)
_warned: set[str] = set()
"""The kinds of trouble (error classes) already told of by a warning in this process."""


def ledger_enabled() -> bool:
    """Whether roots register in the host ledger (unless ``GPUBUDGET_LEDGER=0``).

    >>> import os
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, GPUBUDGET_LEDGER="0"):
    ...     ledger_enabled()
    False
    """
    return os.environ.get(LEDGER_ENV, "").strip().lower() not in ("0", "off", "no", "false")


def book_for(device: LedgerDevice) -> DeviceBook:
    """This process's handle on ``device``'s ledger file (opened, or created, once);
    :class:`~gpubudget.hostledger.errors.LedgerUnusable` naming the path if the directory or
    file is refused."""
    path = device.directory if device.directory is not None else ledger_directory()
    key = (path, device.identity)
    with _lock:
        book = _books.get(key)
        if book is None:
            try:
                directory = LedgerDirectory(path, create=True)
                try:
                    book = DeviceBook(directory, device.identity, device.label,
                                      device.total, device.hard)
                finally:
                    directory.close()
            except LedgerUnusable:
                raise
            except LedgerError as exc:  # a directory or file refused
                raise LedgerUnusable(str(exc)) from None
            _books[key] = book
        return book


def device_claims(device: LedgerDevice) -> list[Entry]:
    """The root budgets of live processes on ``device`` now (clearing those that ended).

    >>> import tempfile
    >>> from gpubudget import gpu_budget
    >>> from gpubudget.hostledger import LedgerDevice
    >>> gpu = LedgerDevice("GPU-example", "a GPU", 2**30, hard=True,
    ...                    directory=Path(tempfile.mkdtemp()))
    >>> device_claims(gpu)
    []
    """
    book = book_for(device)
    with book.current():
        return book.live_entries()


class Claim:
    """One root's slot in its device's ledger, held by this process."""

    def __init__(self, book: DeviceBook, slot: int, limit: int) -> None:
        self.book: Final = book
        self.slot: Final = slot
        self.limit: Final = limit
        self.pid: Final = os.getpid()
        self.tree: Tree | None = None

    def attach(self, tree: Tree) -> None:
        """The root's memory is reserved: mark the slot, publish the root's numbers there,
        and release the slot with the reservation."""
        reservation = tree.reservation
        assert reservation is not None
        mapping = tree.mapping  # a growable root: what it has mapped, kept current
        held = mapping.mapped_bytes if mapping is not None else reservation.nbytes
        try:
            with self.book.locked():
                self.book.reserved(self.slot, held, time.monotonic_ns())
        except LedgerLocked:  # the slot is ours: mark it without the lock
            self.book.reserved_unlocked(self.slot, held, time.monotonic_ns())
        if mapping is not None:
            at = slot_word(self.slot, "reserved")
            mapping.published = self.book.words[at: at + 1]
        at = slot_word(self.slot, "used")  # then "peak" and "denials"
        words = self.book.words[at: at + 3]
        account = tree.root.account
        words[0], words[1] = account.used, account.peak
        self.tree = tree
        account.published = tree.recorder.published = words
        tree.recorder.family = Family(self.book, self.slot, account)  # its children's rows
        tree.reservation = _Released(reservation, self)

    def release(self) -> None:
        """Free the slot (in the process that claimed it, once); the memory is returned
        already, or was never reserved."""
        with _lock:
            if self not in _claims:
                return
            _claims.discard(self)
        self._detach()
        try:
            with self.book.locked():
                self.book.release(self.slot)
        except LedgerLocked:  # the slot is ours: free it without the lock
            self.book.release_unlocked(self.slot)

    def _detach(self, forked: bool = False) -> None:
        """Stop publishing into the slot (and free the children's pages, unless this is a
        forked child, where they are the parent's)."""
        tree, self.tree = self.tree, None
        if tree is not None:
            tree.root.account.published = tree.recorder.published = None
            family, tree.recorder.family = tree.recorder.family, None
            if family is not None and not forked:
                family.close()


class _Released:
    """A root's reservation whose release also frees the root's slot."""

    __slots__ = ("_inner", "_claim")

    def __init__(self, inner: Reservation, claim: Claim) -> None:
        self._inner = inner
        self._claim = claim

    @property
    def address(self) -> int:
        return self._inner.address

    @property
    def nbytes(self) -> int:
        return self._inner.nbytes

    def release(self) -> None:
        self._inner.release()  # the memory first: a slot never outlives what it stands for
        self._claim.release()


def open_registered(backend: Backend, name: str, request: int | Share, align: int,
                    open_tree: Callable[[int], Tree], initial: int | None = None) -> Tree:
    """Enter a root registered in the host ledger: claim, ``open_tree(limit)`` (which
    reserves), attach; see the module docstring. ``request``: the root's limit in bytes, or
    a share. ``initial``: a growable root's memory at entry (it claims its limit, what it may
    grow to, but only ``initial`` must be free now; its slot's reserved bytes follow what it
    maps). Backends the ledger does not know are not registered (a share is then a
    ``BudgetError``)."""
    device = device_for(backend)
    if device is None:  # not a device (a trace's replay, a backend of the user's own)
        if isinstance(request, Share):
            raise LedgerError(f"budget {name!r} asks for a share ({request.text!r}) of a "
                              f"device's memory, and the {backend.name} backend's memory "
                              f"({backend!r}) is not a device the host ledger knows")
        return open_tree(request)
    cap_text = os.environ.get(CAP_ENV, "").strip()
    required = isinstance(request, Share) or bool(cap_text) or device.hard
    if not ledger_enabled():
        if required:
            asked = (f"a share ({request.text!r})" if isinstance(request, Share) else
                     f"{CAP_ENV}={cap_text!r}" if cap_text else "a simulated device")
            raise LedgerError(f"budget {name!r} asks for {asked}, which needs the host "
                              f"ledger, and {LEDGER_ENV}=0 turns the host ledger off")
        assert isinstance(request, int)
        return open_tree(request)
    cap = parse_cap(cap_text, device.total) if cap_text else None
    kept = headroom() if device.free is not None else 0
    try:
        book = book_for(device)
        claim = _claim(book, device, name, request, align, cap, initial, kept)
    except LedgerUnusable as exc:  # not a refusal: the ledger cannot be used now
        if required:
            raise
        _warn_once(type(exc).__name__, f"gpubudget: root budgets are not registered in the "
                                       f"host ledger: {exc}")
        assert isinstance(request, int)
        return open_tree(request)
    try:
        tree = open_tree(claim.limit)
    except BudgetError as exc:
        claim.release()
        raise BudgetError(f"{exc}{_held_elsewhere(book, device)}") from exc.__cause__
    except BaseException:
        claim.release()
        raise
    claim.attach(tree)
    return tree


def _claim(book: DeviceBook, device: LedgerDevice, name: str, request: int | Share,
           align: int, cap: int | None, initial: int | None, kept: int) -> Claim:
    wanted = request if isinstance(request, Share) else round_up(request, align)
    me = myself()
    numbers = {"pid": me.pid, "start": me.start, "pidns": me.pidns, "boot": me.boot,
               "ordinal": device.ordinal + 1 if device.ordinal is not None else 0,
               "share": round(request.fraction * 1e6) if isinstance(request, Share) else 0}
    process = process_title()
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        started = time.monotonic_ns()
        free = device.free() if device.free is not None else None
        if free is not None and initial is not None:  # growable: only initial is taken now
            free = free + max(wanted - initial, 0) if isinstance(wanted, int) else None
        with book.current() as index:
            shared_cap = book.header().cap
            book.set_device(device.total, device.hard)
            unsettled = index.unsettled(started, time.monotonic_ns())
            if free is None or not unsettled or time.monotonic() > deadline:
                caps = [value for value in (cap, shared_cap) if value is not None]
                decision = decide(wanted, granularity=align, held=index.held,
                                  total=device.total, cap=min(caps) if caps else None,
                                  hard=device.hard, free=free, unsettled=unsettled,
                                  headroom=kept)
                if decision.nbytes is None:
                    asked = (f"{request.text!r} of {_device(device)}"
                             if isinstance(request, Share) else
                             f"{format_size(round_up(request, align))} on {_device(device)}")
                    raise LedgerError(f"budget {name!r} cannot claim {asked}: "
                                      f"{decision.reason}{holders(index.live())}")
                slot = book.claim({**numbers, "limit": decision.nbytes if isinstance(
                    request, Share) else request, "claim": decision.nbytes,
                    "claimed_at": time.monotonic_ns(), "serial": next(_serials)},
                    name, process)
                claim = Claim(book, slot, request if isinstance(request, int)
                              else decision.nbytes)
                with _lock:
                    _claims.add(claim)
                return claim
        time.sleep(0.002)  # a reservation under way elsewhere: read the free memory again


def _device(device: LedgerDevice) -> str:
    """The device as messages name it: its label, and its identity unless that is plain."""
    if device.identity in device.label or device.identity == "host":
        return device.label
    return f"{device.label} ({device.identity})"


def holders(entries: list[Entry]) -> str:
    """``; held by pid 12 (python serve.py) 'detector' 3.00 GiB, ...``: the budgets on a
    device, largest first (empty when there are none)."""
    others = sorted(entries, key=lambda entry: -entry.holds)
    if not others:
        return ""
    shown = [f"pid {entry.pid} ({printable(entry.process)}) {printable(entry.name)!r} "
             f"{format_size(entry.holds)}" for entry in others[:SHOWN_HOLDERS]]
    more = len(others) - len(shown)
    return "; held by " + ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _held_elsewhere(book: DeviceBook, device: LedgerDevice) -> str:
    try:
        with book.current():
            entries = book.live_entries()
    except LedgerError:
        return ""
    found = holders(entries)
    return f" (on {_device(device)}{found})" if found else ""


def _warn_once(kind: str, message: str) -> None:
    """One warning per kind of trouble in the process (a directory refused, a lock kept, a
    full ledger, a damaged file), not one per root."""
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())


def _forked() -> None:
    """In a forked child: the parent's slots and locks are not this process's."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for claim in list(_claims):
        claim._detach(forked=True)
    _claims.clear()
    for book in _books.values():
        book.forget()
    _books.clear()


def _at_exit() -> None:
    """Interpreter exit: free this process's slots (device memory was returned already)."""
    for claim in list(_claims):
        if claim.pid == os.getpid():
            claim.release()


os.register_at_fork(after_in_child=_forked)
atexit.register(_at_exit)
