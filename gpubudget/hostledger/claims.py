"""Registering a root budget in the host ledger: claim, reserve, publish, release.

A root's entry asks :func:`claim_root` for its limit before it reserves anything, then
reserves it, then tells its :class:`Claim` (the budget layer does it, in one direction: this
module knows nothing of budgets, trees or the core). In order:

1. Read the device's free memory (a device call, with no lock held).
2. Under the ledger's lock (microseconds, whatever the number of live roots: this
   process's index of the slots reads only those changed since it last looked): clear the
   slots of processes that have ended; decide how much the root may have
   (:func:`~gpubudget.hostledger.sizing.decide`: its limit, or its share of what is
   unclaimed, within the device cap and any limit set from outside the process,
   :mod:`~gpubudget.hostledger.limits`); write its slot, ``claimed``. If a claim of another
   process may not show in the free memory read in 1 (it is still reserving), let go of
   the lock and start again, for up to :data:`SETTLE_SECONDS`; then count it as taken.
3. The root reserves the memory (a device call, no lock held). If that fails,
   :meth:`Claim.refused` releases the slot, and the error names who holds the device's
   memory: all or nothing.
4. :meth:`Claim.reserved` marks the slot ``reserved`` and hands out its words: from then on
   every change of the root's ``used`` (with its ``peak``) and every denial in its tree is
   stored into them, with plain stores (the core does it); and its :class:`~gpubudget.
   hostledger.children.Family`, which gives each child budget that enters a row of the
   root's pages, its numbers stored there in the same way.
5. When the root releases its reservation (or the process exits, or dies), its pages and
   its slot go.

When the ledger cannot be used (a directory or file refused, a file damaged or full, a lock
that another process keeps: :class:`~gpubudget.hostledger.errors.LedgerUnusable`), a root
with a plain limit is entered unregistered, with one ``RuntimeWarning`` per kind of trouble
in the process; a root that needs the ledger (a share, a cap, a simulated device) raises it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Final, NamedTuple

from ..backends import Backend, Reservation
from ..callers import user_stacklevel
from ..errors import BudgetError
from ..text import printable
from ..units import format_size, round_up
from . import limits
from .book import DeviceBook
from .children import Family
from .devices import LedgerDevice, device_for
from .errors import LedgerError, LedgerLocked, LedgerUnusable
from .files import LedgerDirectory, ledger_directory
from .layout import Entry, slot_word
from .limits import OutsideLimit, outside_limits, smallest
from .nvml import started as nvml_started
from .procs import myself, process_title
from .sizing import CAP_ENV, Share, decide, headroom, parse_cap

__all__ = ["LEDGER_ENV", "SETTLE_SECONDS", "Claim", "Registered", "book_for", "claim_root",
           "device_claims", "holders", "ledger_enabled"]

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


class Registered(NamedTuple):
    """What a root keeps of its slot once it has reserved its memory (:meth:`Claim.reserved`)."""

    reservation: Reservation
    """To hold in place of its own: its release frees the slot too."""
    numbers: memoryview
    """The slot's words for the root's ``used``, ``peak`` and denials, in that order."""
    mapped: memoryview
    """The slot's word for the bytes the root has mapped (a growable root keeps it current)."""
    family: Family
    """The rows of the root's child budgets (the core tells it as children come and go)."""


class Claim:
    """One root's slot in its device's ledger, held by this process: claimed with its limit
    (:func:`claim_root`), then :meth:`reserved` or :meth:`refused`, later released."""

    def __init__(self, book: DeviceBook, device: LedgerDevice, slot: int, limit: int,
                 outside: OutsideLimit | None = None) -> None:
        self.book: Final = book
        self.device: Final = device
        self.slot: Final = slot
        self.limit: Final = limit
        self.outside: Final = outside
        """The limit set from outside within which the root was sized, if any."""
        self.pid: Final = os.getpid()
        self._detach: Callable[[], None] | None = None
        self._family: Family | None = None

    @property
    def serial(self) -> int:
        """The slot's ``serial``: the root's number among this process's registered roots."""
        return int(self.book.words[slot_word(self.slot, "serial")])

    def reserved(self, reservation: Reservation, held: int, detach: Callable[[], None],
                 root: Any) -> Registered:
        """The root has reserved its memory, ``held`` bytes of it backed now: mark the slot
        ``reserved``, and hand out its words and its children's rows (see
        :class:`Registered`); ``root`` is the root's ledger account (its children's rows
        name it as their parent). ``detach`` is called when the slot goes while the root may
        still store into them (the process exits first, or a forked child lets go of its
        parent's slots): it must stop."""
        try:
            with self.book.locked():
                self.book.reserved(self.slot, held, time.monotonic_ns())
        except LedgerLocked:  # the slot is ours: mark it without the lock
            self.book.reserved_unlocked(self.slot, held, time.monotonic_ns())
        self._detach = detach
        self._family = family = Family(self.book, self.slot, root)
        used = slot_word(self.slot, "used")  # then "peak" and "denials"
        mapped = slot_word(self.slot, "reserved")
        return Registered(_Released(reservation, self), self.book.words[used: used + 3],
                          self.book.words[mapped: mapped + 1], family)

    def refused(self, exc: BudgetError) -> BudgetError:
        """The root could not reserve its memory: free the slot, and return ``exc`` said
        again with who holds the device's memory, to raise."""
        self.release()
        return BudgetError(f"{exc}{_held_elsewhere(self.book, self.device)}")

    def release(self) -> None:
        """Free the slot (in the process that claimed it, once); the memory is returned
        already, or was never reserved."""
        with _lock:
            if self not in _claims:
                return
            _claims.discard(self)
        try:
            self._let_go()
        finally:  # whatever lands meanwhile: the slot is freed, once
            try:
                with self.book.locked():
                    self.book.release(self.slot)
            except LedgerLocked:  # the slot is ours: free it without the lock
                self.book.release_unlocked(self.slot)

    def _let_go(self, forked: bool = False) -> None:
        """Stop publishing into the slot (the root's numbers and its children's rows), and
        free the children's pages, unless this is a forked child, where they are the
        parent's."""
        detach, self._detach = self._detach, None
        family, self._family = self._family, None
        if detach is not None:
            detach()
        if family is not None and not forked:
            family.close()


class _Released:
    """A root's reservation whose release also frees the root's slot."""

    __slots__ = ("_inner", "_claim")

    def __init__(self, inner: Reservation, claim: Claim) -> None:
        self._inner = inner
        self._claim = claim

    @property
    def claim(self) -> Claim:
        return self._claim

    @property
    def address(self) -> int:
        return self._inner.address

    @property
    def nbytes(self) -> int:
        return self._inner.nbytes

    def release(self) -> None:
        self._inner.release()  # the memory first: a slot never outlives what it stands for
        self._claim.release()


def claim_root(backend: Backend, name: str, request: int | Share, align: int,
               initial: int | None = None) -> tuple[int, Claim | None]:
    """A root's limit, decided before it reserves anything, and its claim on a slot of the
    device's ledger: ``(limit, claim)``; see the module docstring. ``request``: the root's
    limit in bytes (which is then its limit), or a share (sized here). ``initial``: a
    growable root's memory at entry (it claims its limit, what it may grow to, but only
    ``initial`` must be free now; its slot's reserved bytes follow what it maps).

    The claim is ``None`` where the root is not registered: a backend the ledger does not
    know (a share is then a ``LedgerError``), the ledger turned off (``GPUBUDGET_LEDGER=0``),
    or a ledger that cannot be used now (one warning per kind of trouble); a root that needs
    the ledger (a share, a cap, a simulated device) gets a ``LedgerError`` instead."""
    device = device_for(backend)
    if device is None:  # not a device (a trace's replay, a backend of the user's own)
        if isinstance(request, Share):
            raise LedgerError(f"budget {name!r} asks for a share ({request.text!r}) of a "
                              f"device's memory, and the {backend.name} backend's memory "
                              f"({backend!r}) is not a device the host ledger knows")
        return request, None
    cap_text = os.environ.get(CAP_ENV, "").strip()
    required = isinstance(request, Share) or bool(cap_text) or device.hard
    if not ledger_enabled():
        if required:
            asked = (f"a share ({request.text!r})" if isinstance(request, Share) else
                     f"{CAP_ENV}={cap_text!r}" if cap_text else "a simulated device")
            raise LedgerError(f"budget {name!r} asks for {asked}, which needs the host "
                              f"ledger, and {LEDGER_ENV}=0 turns the host ledger off")
        assert isinstance(request, int)
        return request, None
    cap = parse_cap(cap_text, device.total) if cap_text else None
    kept = headroom() if device.free is not None else 0
    outside = outside_limit(device)
    try:
        book = book_for(device)
        claim = _claim(book, device, name, request, align, cap, initial, kept, outside)
    except LedgerUnusable as exc:  # not a refusal: the ledger cannot be used now
        if required:
            raise
        _warn_once(type(exc).__name__, f"gpubudget: root budgets are not registered in the "
                                       f"host ledger: {exc}")
        assert isinstance(request, int)
        return request, None
    return claim.limit, claim


def outside_limit(device: LedgerDevice) -> OutsideLimit | None:
    """The limit set from outside that bounds ``device`` for this process, if any (the
    smallest that :func:`~gpubudget.hostledger.limits.outside_limits` reads, when less than
    the device's memory); NVML is asked on GPUs only."""
    gpu = device.identity.startswith("GPU-")
    where = limits.where
    if gpu and where.nvml is None:
        where = replace(where, nvml=nvml_started())
    return smallest(device.total, outside_limits(
        device.ordinal, pci_bus_id=device.pci_bus_id, uuid=device.identity if gpu else None,
        where=where))


_MOST: Final = 1 << 63
"""A root's limit and claim are 64-bit words of its slot, kept below 2**63 like every size
of a trace."""


def _claim(book: DeviceBook, device: LedgerDevice, name: str, request: int | Share,
           align: int, cap: int | None, initial: int | None, kept: int,
           outside: OutsideLimit | None) -> Claim:
    wanted = request if isinstance(request, Share) else round_up(request, align)
    if isinstance(wanted, int) and wanted >= _MOST:
        raise LedgerError(f"budget {name!r} cannot claim {format_size(wanted)}: more than "
                          f"any device holds (a root's limit is below 8 EiB, 2**63 bytes)")
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
            book.set_device(device.total, device.hard, outside.nbytes if outside else None,
                            outside.name if outside else "")
            unsettled = index.unsettled(started, time.monotonic_ns())
            if free is None or not unsettled or time.monotonic() > deadline:
                caps = [(value, index.held, "the device cap") for value in (cap, shared_cap)
                        if value is not None]
                if outside is not None:  # a limit set from outside: as if the device's cap
                    against = index.held if not outside.per_process else sum(
                        entry.holds for entry in index.live()
                        if (entry.pid, entry.pidns) == (me.pid, me.pidns))
                    caps.append((outside.nbytes, against, f"the limit {outside.source}"))
                least = min(caps, key=lambda each: each[0] - each[1], default=None)
                decision = decide(wanted, granularity=align, held=index.held,
                                  total=device.total, cap=least[0] if least else None,
                                  hard=device.hard, free=free, unsettled=unsettled,
                                  headroom=kept,
                                  cap_name=least[2] if least else "the device cap",
                                  cap_held=least[1] if least else None)
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
                claim = Claim(book, device, slot, request if isinstance(request, int)
                              else decision.nbytes, outside)
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
        claim._let_go(forked=True)
    _claims.clear()
    for book in _books.values():
        book.forget()
    _books.clear()


def release_at_exit() -> None:
    """Interpreter exit: free this process's slots (device memory was returned already).
    Registered with :mod:`atexit` by ``gpubudget._budget`` when gpubudget is imported, which
    is before this module is loaded (at a root's entry) and before the handlers that return
    device memory: it runs after them."""
    for claim in list(_claims):
        if claim.pid == os.getpid():
            claim.release()


os.register_at_fork(after_in_child=_forked)
