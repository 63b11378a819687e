"""One budget tree: a root's reservation, sub-allocated to every budget entered in it.

Two classes, the plumbing behind what the user holds (:class:`~gpubudget.budget.Budget`):

- :class:`Tree`, one per root: the lock, the backend and its reservation, the
  :class:`~gpubudget.arena.Arena` over it, the live-block registry (address -> owner, aligned
  size, tag, stack: :mod:`~gpubudget._core.registry`), the stream-ordered frees still
  pending, and the recorder. Its methods
  ``allocate``, ``free`` and ``resize`` are the only code that changes blocks.
- :class:`Node`, one per budget: its place in the tree (parent, children), its
  :class:`~gpubudget.ledger.Account` and :class:`~gpubudget.recorder.Stats`, its state and
  what keeps it from being released (live blocks, pins, unreleased children).

Every operation has the same shape: checks that touch nothing; then, under the lock, the
refusal check, the placement, and one commit (charge the ledger, register the block, record
the event). Side effects that can fail come before the commit (a stream event: if it fails,
nothing changes and the caller is told) or after it, isolated (the trace writer). So an
operation either happens whole or not at all. Each holds the lock in a ``with`` block; an
exception that lands inside one anyway (a Ctrl-C, a signal handler's ``TimeoutError``, which
Python raises wherever the main thread runs Python code) propagates, and the operation it cut
short leaves the tree as its registry says: whole or not at all (:meth:`Tree.fault`,
:mod:`~gpubudget._core.recovery`).

Invariants, checked by :meth:`Tree.check` (``Budget.check()``):

``ARENA``
    The arena's own invariants (``TILED``, ``COALESCED``, ``ALIGNED``, ``INDEXED``).
``REGISTERED``
    The arena's taken blocks are exactly the registry's blocks plus the pending frees, with
    the same sizes.
``LEDGER``
    Every budget's ``used`` is its own live bytes plus what its unreleased children pass up
    (``max(used, reserve)``), and stays within its limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final, Literal, TypeVar

from .arena import Arena
from ..backends import Backend, Event, Reservation, device_of
from ..errors import InvariantError, raise_if_from_outside
from .ledger import charge, claim, passed_up, settle
from .memory import Mapping, free_memory, reserve
from .recorder import Recorder
from .registry import LiveEntry, Record, new_registry
from .streams import PendingFrees
from ..units import as_int, as_size, is_power_of_two, round_up
from ..extensions import extension
from .locks import Turns, new_lock
from .recovery import recover

native: Final = extension("_core", "_native")  # the C core, or None

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from .node import Node  # a budget's plumbing; Node makes Trees, so named here only
    from ..tracefile import TraceWriter

__all__ = ["Denied", "Tree", "new_lock", "unreleased"]  # new_lock from locks.py

T = TypeVar("T")

Denied = tuple[str, str, int]
"""Why a request was denied: (reason, name of the budget that refused, aligned bytes)."""
# What moving a block needs: (owner, size, alignment, tag, stack, old and new aligned sizes).
_Move = tuple["Node", int, int, "str | None", "tuple[str, ...] | None", int, int]


_unreleased: Final[set[Tree]] = set()
"""Every tree whose root has not released yet: a budget the program dropped while blocks of
it are live keeps its memory (a block is never freed under its user by the collector)."""


def unreleased() -> list[Tree]:
    """Every tree of this process whose root has not released yet."""
    return list(_unreleased)


class Tree:
    """A root's memory and what is placed in it; see the module docstring."""

    __slots__ = ("root", "lock", "turns", "backend", "device", "reservation", "mapping", "arena",
                 "live", "pending", "ordered", "recorder", "free_at_entry", "free_at_exit",
                 "door_view", "fast", "closed", "reading", "deferred")

    def __init__(self, root: Node, backend: Backend, writer: TraceWriter | None, limit: int,
                 initial: int | None = None) -> None:
        capacity = round_up(limit, root.align)
        reservation, base = reserve(backend, capacity, root.align, root.name, initial)
        self.root: Final = root
        self.lock: Final = new_lock()  # re-entrant for a moving resize
        self.turns: Final = Turns()  # who waits for it (see ``locks.let_in``)
        self.backend: Final = backend
        self.device: Final = device_of(backend)
        self.reservation: Reservation | Mapping | None = reservation
        # a growable root's memory: granules mapped as blocks need them (see memory.py)
        self.mapping: Final = reservation if isinstance(reservation, Mapping) else None
        self.arena = Arena(base, capacity, root.align)  # rebuilt by recover() if need be
        self.live: Final = new_registry()  # address -> (owner, aligned size, tag, stack)
        self.pending: Final = PendingFrees()
        # A backend whose work is always complete (host memory) needs no stream events.
        self.ordered: Final = not getattr(backend, "synchronous", False)
        self.recorder: Final = Recorder(writer, getattr(backend, "clock", time.perf_counter))
        self.recorder.place(self.arena.base, self.mapping)  # where the root sits, for traces
        # Under the driver door (set by the budget layer): a context in which the backend's
        # cuMemGetInfo answers for the device rather than for a budget, and the bytes the
        # door charged this tree now (taken in its scope, so not by others).
        self.door_view: tuple[Callable[[], AbstractContextManager[None]],
                              Callable[[], int]] | None = None
        # Device memory free just after the reservation, and at the root's exit: what others
        # took meanwhile shows in the report (device backends only).
        self.free_at_entry = None if self.device is None else self.unclaimed()
        self.free_at_exit: int | None = None
        # Whether Budget.allocate and free may run in C (the C core; see tree.c); False
        # sends every call through the methods below (tests compare the two).
        self.fast = native is not None
        self.closed: str | None = None  # why no block of it may change any more (close_to)
        # walks of the registry under way in the thread holding the lock (see ``read``), and
        # the frees that arrived meanwhile (a finalizer the collector ran inside the walk)
        self.reading = 0
        self.deferred: list[tuple[Node, int, int | None]] = []
        _unreleased.add(self)

    # -- the three operations --------------------------------------------------------------

    def allocate(self, node: Node, requested: object, alignment: object, label: object,
                 on_stream: object, stack: tuple[str, ...] | None,
                 why: list[Denied] | None = None) -> int | None:
        """A block of at least ``requested`` bytes for ``node``, or ``None`` (each denial
        recorded, and appended to ``why`` when given). The arguments are the caller's, as
        given: each is checked here."""
        size = requested if type(requested) is int else as_size(requested)
        if size is None or size <= 0:
            self._deny(node, size or 0, 0, None, 0, "invalid_size", node.name, why)
            return None
        if label is not None and type(label) is not str:
            self._deny(node, size, 0, None, size, "invalid_tag", node.name, why)
            return None
        tag: str | None = label
        stream = on_stream if on_stream is None or type(on_stream) is int else as_int(on_stream)
        if stream is None and on_stream is not None:
            self._deny(node, size, 0, tag, size, "invalid_stream", node.name, why)
            return None
        granularity = node.granularity
        align = 0
        if alignment:
            checked = alignment if type(alignment) is int else as_int(alignment)
            if checked is None or checked <= 0 or checked & (checked - 1):  # a power of 2?
                self._deny(node, size, 0, tag, size, "invalid_alignment", node.name, why)
                return None
            align = checked
            if align > granularity:
                granularity = align
        nbytes = (size + granularity - 1) & -granularity
        turns = self.turns
        address = None
        try:
            turns.waiting += 1  # counted (see locks.let_in)
            with self.lock:
                turns.arrived()
                if node.refusal is not None:
                    self._deny_locked(node, size, align, tag, nbytes, node.refusal, node.name,
                                      why)
                    return None
                account = node.account
                refused = claim(account, nbytes)  # shown to the driver door, if it is loaded
                if refused is not None:
                    refused.refusals += 1
                    self._deny_locked(node, size, align, tag, nbytes, "over_limit",
                                      refused.name, why)
                    return None
                if self.pending:
                    address = self._place_with_pending(nbytes, granularity, stream)
                else:
                    address = self.arena.allocate(nbytes, granularity)
                reason = "fragmented"
                if address is not None and self.mapping is not None:
                    reason = self.mapping.admit(address, nbytes) or reason
                    if reason != "fragmented":  # asleep, or the device cannot back it
                        self.arena.free(address)
                        address = None
                if address is None:
                    settle(account, nbytes)  # the claim withdrawn
                    self._deny_locked(node, size, align, tag, nbytes, reason, node.name, why)
                    return None
                charge(account, nbytes)  # the commit: ledger, registry, record
                self.live[address] = (node, nbytes, tag, stack)
                self.recorder.granted(node.stats, node.id, size, align, tag, address, nbytes,
                                      account.used, self.root.account.used, stack)
        except BaseException:
            self.fault(address)  # the block, if granted, is not handed out
            raise
        return address

    def free(self, node: Node, where: object, on_stream: object) -> bool:
        """Free a block of ``node`` or a descendant; ``False`` (counted) if it is not one, or
        if ``on_stream`` is not a stream."""
        address = where if type(where) is int else as_int(where) or 0  # no block is at 0
        stream = on_stream if on_stream is None or type(on_stream) is int else as_int(on_stream)
        turns = self.turns
        try:
            turns.waiting += 1  # counted (see locks.let_in)
            with self.lock:
                turns.arrived()
                record = self.live.get(address)
                if (stream is None and on_stream is not None) or self.closed is not None:
                    record = None
                if record is None or not (record[0] is node or node.encloses(record[0])):
                    node.stats.invalid_frees += 1
                    return False
                if self.reading:  # a finalizer inside a walk of this thread's: freed after it
                    self.deferred.append((node, address, stream))
                    return True
                owner, nbytes, tag, _ = record
                event: Event | None | Literal[False] = None
                if stream is not None and self.ordered and (
                        self.mapping is None or self.mapping.asleep is None):
                    # before the commit: if the stream cannot take an event, nothing changes
                    event = self._event_on(owner, stream)
                if event is False:
                    return False
                del self.live[address]  # the commit
                charge(owner.account, -nbytes)
                if event is None or stream is None:
                    self.arena.free(address)
                else:
                    self.pending.add(address, nbytes, stream, event)
                self.recorder.freed(owner.stats, owner.id, address, nbytes, tag,
                                    owner.account.used, self.root.account.used)
                if owner.state == "exited":
                    owner.release_if_unused()
        except BaseException:
            self.fault()
            raise
        return True

    def resize(self, node: Node, where: object, new_size: object,
               alignment: object) -> int | None:
        """Grow or shrink a block in place, else move it (copying ``min(old, new)`` bytes),
        else ``None`` with the old block untouched."""
        address = where if type(where) is int else as_int(where) or 0
        turns = self.turns
        try:
            turns.waiting += 1  # counted (see locks.let_in)
            with self.lock:  # held through a move, so that no thread sees it half done
                turns.arrived()
                outcome = self._resize_in_place(node, address, new_size, alignment)
                return self._move(address, outcome) if isinstance(outcome, tuple) else outcome
        except BaseException:
            self.fault()
            raise

    def read(self, walk: Callable[[], T]) -> T:
        """``walk()`` (a walk of the registry and the arena: a report, ``check()``) with the
        lock held: a block freed meanwhile by this thread (a finalizer that the collector
        runs at an allocation inside the walk; the lock is re-entrant) is freed as the walk
        ends, so that the walk sees one state, and nothing changes under its loops.

        The lock is a ``with`` block and the walk's end plain statements of the same frame
        (no context manager's ``__exit__``, whose first instruction may raise): an exception
        landing anywhere, even as the walk starts or ends, leaves no walk open."""
        with self.lock:
            self.reading += 1
            fast, self.fast = self.fast, False  # every free through ``free`` meanwhile
            try:
                return walk()
            finally:
                self.reading -= 1  # first, before any call
                if not self.reading:
                    self.fast = fast if self.closed is None else False
                    deferred = self.deferred
                    while deferred:  # each left listed until freed
                        node, address, stream = deferred[0]
                        self.free(node, address, stream)
                        del deferred[0]

    def fault(self, granted: int | None = None) -> None:
        """In the ``except`` of an operation cut short by an exception that landed inside it
        (a Ctrl-C, a signal handler's): put the tree right under its lock
        (:func:`~gpubudget._core.recovery.recover`), dropping ``granted``, a block the
        operation registered and will not hand out."""
        with self.lock:
            recover(self, granted)

    def _move(self, address: int, move: _Move) -> int | None:
        """Lock held (taken again by ``allocate`` and ``free``): a new block, the bytes
        copied, the old block freed; ``None`` with the old block kept if any step fails."""
        owner, size, align, tag, stack, old, nbytes = move
        moved = self.allocate(owner, size, align, tag, None, stack)
        if moved is None:
            return None
        try:
            self.backend.copy(moved, address, min(old, nbytes))
        except Exception as exc:  # noqa: BLE001 - the backend's failure: the old block stays
            self.free(owner, moved, None)
            raise_if_from_outside(exc)
            self.note_error(owner, f"resize copy failed, block kept: "
                                   f"{type(exc).__name__}: {exc}")
            return None
        self.free(owner, address, None)
        return moved

    def _resize_in_place(self, node: Node, address: int, new_size: object,
                         alignment: object) -> int | None | _Move:
        """Lock held: the address once resized in place; ``None`` for a request refused
        (recorded); else what moving the block needs."""
        record = self.live.get(address)
        if self.closed is not None:
            self._deny_locked(node, 0, 0, None, 0, self.closed, node.name)
            return None
        if record is None or not (record[0] is node or node.encloses(record[0])):
            self._deny_locked(node, 0, 0, None, 0, "invalid_address", node.name)
            return None
        owner, old, tag, stack = record
        size = as_size(new_size)
        if size is None or size <= 0:
            self._deny_locked(owner, 0, 0, tag, 0, "invalid_size", owner.name)
            return None
        align = as_int(alignment) if alignment else 0
        if align is None or (align and not is_power_of_two(align)):
            self._deny_locked(owner, size, 0, tag, size, "invalid_alignment", owner.name)
            return None
        granularity = max(owner.granularity, align)
        nbytes = round_up(size, granularity)
        delta = nbytes - old
        if self.mapping is not None and self.mapping.asleep is not None:
            self._deny_locked(owner, size, align, tag, nbytes, "asleep", owner.name)
            return None
        in_place = address % granularity == 0 and (
            delta <= 0 or claim(owner.account, delta) is None)
        if in_place and self.arena.resize(address, nbytes) and not self._unbacked(
                address, old, nbytes):
            charge(owner.account, delta)  # the commit
            self.live[address] = (owner, nbytes, tag, stack)
            self.recorder.resized(owner.stats, owner.id, address, size, align, tag, old,
                                  nbytes, owner.account.used, self.root.account.used)
            return address
        if in_place:
            settle(owner.account, delta)  # claimed, not grown in place (a move claims again)
        return (owner, size, align, tag, stack, old, nbytes)

    def _unbacked(self, address: int, old: int, nbytes: int) -> bool:
        """Lock held, a block just resized in place from ``old`` to ``nbytes``: whether its
        growth could not be mapped (then it is ``old`` bytes again, and the move is tried)."""
        if self.mapping is None or nbytes <= old or self.mapping.admit(address, nbytes) is None:
            return False
        self.arena.resize(address, old)
        return True

    def close_to(self, reason: str) -> None:
        """From now on no block of this tree changes: frees are refused (counted as invalid),
        resizes denied with ``reason``; allocations are its nodes' to refuse (their
        ``refusal``). What a forked child does with the trees it inherited (``_budget/forks.py``)."""
        self.closed = reason
        self.fast = False  # every call through the methods here, which check ``closed``

    def trim(self) -> int:
        """Lock held: unmap the granules of a growable root that no block touches (pending
        frees included); the bytes given back (0 for a root that reserved its limit)."""
        if self.mapping is None or self.mapping.asleep is not None:
            return 0
        return self.mapping.trim((block.address, block.size) for block in self.arena.walk()
                                 if not block.free)

    def owner(self, where: object) -> LiveEntry | None:
        """The registry's entry of the live block at ``where``, or ``None``."""
        record = self._record(where)
        return LiveEntry._make(record) if record is not None else None

    def size_of(self, where: object) -> int:
        """The aligned size of the live block at ``where``, 0 if there is none: what
        :meth:`owner` reads, with no entry made (adapters ask it of every block they get)."""
        record = self._record(where)
        return record[1] if record is not None else 0

    def _record(self, where: object) -> Record | None:
        address = where if type(where) is int else as_int(where) or 0
        with self.lock:
            return self.live.get(address)

    def entries(self) -> Iterator[tuple[int, LiveEntry]]:
        """Lock held: every live block's address and entry."""
        for address, record in self.live.items():
            yield address, LiveEntry._make(record)

    # -- internals -------------------------------------------------------------------------

    def _event_on(self, owner: Node, stream: int) -> Event | None | Literal[False]:
        """Lock held: an event recorded on ``stream`` now, ``None`` if its work is already
        complete, ``False`` (the error kept for ``owner``'s report) if the stream cannot take
        one."""
        try:
            event = self.backend.record_event(stream)
            return None if event.query() else event
        except Exception as exc:  # noqa: BLE001 - the backend's failure: free never raises
            raise_if_from_outside(exc)  # nothing changed yet
            owner.stats.errors.append(f"free on stream {stream:#x} refused, block kept: "
                                      f"{type(exc).__name__}: {exc}")
            return False

    def note_error(self, node: Node, message: str) -> None:
        """Keep an error for ``node``'s report (an operation that failed and changed nothing)."""
        with self.lock:
            node.stats.errors.append(message)

    def deny(self, node: Node, size: int, reason: str) -> None:
        """Count a request an adapter refused before it asked (``wrong_device``)."""
        self._deny(node, size, 0, None, size, reason, node.name)

    def _deny(self, node: Node, size: int, alignment: int, tag: str | None, nbytes: int,
              reason: str, refused_by: str, why: list[Denied] | None = None) -> None:
        with self.lock:
            self._deny_locked(node, size, alignment, tag, nbytes, reason, refused_by, why)

    def _deny_locked(self, node: Node, size: int, alignment: int, tag: str | None, nbytes: int,
                     reason: str, refused_by: str, why: list[Denied] | None = None) -> None:
        self.recorder.denied(node.stats, node.id, size, alignment, tag, nbytes, reason,
                             refused_by, node.account.used, self.root.account.used)
        if why is not None:
            why.append((reason, refused_by, nbytes))

    def _place_with_pending(self, nbytes: int, alignment: int, stream: int | None) -> int | None:
        """Placement while stream-ordered frees are pending: retire the finished ones, reuse
        a same-stream block of the same size, else the arena; when the arena is full, wait
        for every pending free and try once more."""
        pending = self.pending
        pending.retire(self.arena, False, self._event_failed)
        address = pending.reuse(nbytes, alignment, stream) if stream is not None else None
        if address is None:
            address = self.arena.allocate(nbytes, alignment)
            if address is None and pending:
                pending.retire(self.arena, True, self._event_failed)
                address = self.arena.allocate(nbytes, alignment)
        return address

    def _event_failed(self, message: str) -> None:
        self.root.stats.errors.append(message)

    def unclaimed(self) -> int | None:
        """The device's free memory, plus what a growable root has mapped (its own growth is
        not memory taken by others) and what the driver door charged the tree."""
        mapped = self.mapping.mapped_bytes if self.mapping is not None else 0
        if self.door_view is None:
            info = free_memory(self.backend)
            return info[0] + mapped if info else None
        device, charged = self.door_view
        with device():
            info = free_memory(self.backend)
        return info[0] + mapped + charged() if info else None

    def note_free_at_exit(self) -> None:
        if self.device is not None:
            self.free_at_exit = self.unclaimed()

    def release_reservation(self) -> None:
        """Lock held, the root released: wait for pending frees, give the memory back."""
        self.pending.retire(self.arena, True, self._event_failed)
        _unreleased.discard(self)
        reservation, self.reservation = self.reservation, None
        if reservation is not None:
            try:
                reservation.release()
            except Exception as exc:  # noqa: BLE001 - the backend's failure: the accounting is done
                raise_if_from_outside(exc)
                self.root.stats.errors.append(
                    f"returning the reservation failed: {type(exc).__name__}: {exc}")

    def check(self) -> None:
        """Raise :class:`~gpubudget.errors.InvariantError` naming the first broken invariant."""
        self.read(self._check_locked)

    def _check_locked(self) -> None:
        self.arena.check()
        taken = {block.address: block.size for block in self.arena.walk() if not block.free}
        if self.mapping is not None:
            self.mapping.check(taken.items())
        held = {address: record[1] for address, record in self.live.items()}
        held.update((p.address, p.nbytes) for p in self.pending)
        if taken != held:
            raise InvariantError("REGISTERED", f"arena holds {len(taken)} blocks, the "
                                 f"registry and pending frees {len(held)}")
        own: dict[Node, int] = {}
        for node, nbytes, _, _ in self.live.values():
            own[node] = own.get(node, 0) + nbytes
        for node in self.root.subtree():
            expected = own.get(node, 0) + sum(
                passed_up(child.account, child.account.used)
                for child in node.children if child.state != "released")
            if node.account.used != expected or node.account.used > node.account.limit:
                raise InvariantError("LEDGER", f"budget {node.name!r} used "
                                     f"{node.account.used}, its blocks and children make "
                                     f"{expected}, limit {node.account.limit}")
