"""``Budget``: a limit on device memory, nested per model, with accounting and lifetime.

Accounting. A budget's ``used`` is the aligned bytes charged to it: its own blocks plus what
its children pass up. A child with a ``reserve`` floor passes up ``max(used, reserve)``, so the
reserved bytes are counted in the parent from entry on. One function, :meth:`Budget._charge`,
checks every budget of the chain and then applies the change; an allocation charges first,
then takes a block from the arena, and rolls the charge back if no block fits.

Placement. A root budget owns one backend reservation and an :class:`~gpubudget.arena.Arena`
over it; the whole tree places its blocks there. A ``reserve=`` floor is a guarantee by
limits: the bytes are charged to the parent from entry, so no sibling can be granted them.
It does not pin an address range, so a fragmented arena can still refuse a large block.

Lifetime. ``new`` -> ``open`` (entered) -> ``exited`` (scope left) -> ``released``. A budget is
released once it has exited, holds no live block, has no unreleased child and no pin (an
object such as a TensorRT runtime that may still allocate through it); then a child gives its
region and reserve back to the parent, and a root returns its reservation to the backend.

Threads. Every budget of a tree shares the root's lock; allocator callbacks may arrive on any
thread at any time.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING, Final, Literal, final

from . import scope
from .arena import Arena
from .backends import Backend, Event, Reservation, get_backend, validate_spec
from .errors import BudgetError, BudgetNestingError
from .report import BudgetReport, Denial, LiveBlock, TagUsage, TimelineEvent
from .tracefile import TraceWriter, writer_for
from .units import format_size, parse_size

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Budget", "gpu_budget"]

State = Literal["new", "open", "exited", "released"]
_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__))
_KEEP_RELEASED_CHILDREN: Final = 32
_KEEP_ERRORS: Final = 16
EVENT_LOG_LIMIT: Final = 50_000
"""Events a budget tree keeps for its timeline; older ones are dropped. An event is a tuple of
seven small values, about 200 bytes with its numbers: at most about 10 MB per tree."""
_TRACE_ENV: Final = "GPUBUDGET_TRACE"
_clock = time.perf_counter
_current_label = scope.LABEL.get
_leak_watch: weakref.WeakSet[Budget] = weakref.WeakSet()
_counter = iter(range(1, sys.maxsize))


# A live block: (owner, aligned size, tag, stack). A plain tuple: it is built on every
# allocation, and a NamedTuple costs several times more to create.
_Live = tuple["Budget", int, "str | None", "tuple[str, ...] | None"]
# A timeline event: (time, kind, budget id, aligned bytes, tag, budget's used after, root's
# used after). kind is "alloc", "free" or "deny" (then bytes is the refused size). Atomic
# values only, so that the garbage collector stops tracking them and no cycle forms.
_Event = tuple[float, str, int, int, "str | None", int, int]
_NO_ARENA: Final = Arena(0, 1, 1)  # placeholder until a budget is entered; never allocated from


class _Pending:
    """A block freed on a stream whose earlier work may still use it."""

    __slots__ = ("address", "nbytes", "stream", "event", "taken")

    def __init__(self, address: int, nbytes: int, stream: int, event: Event):
        self.address = address
        self.nbytes = nbytes
        self.stream = stream
        self.event = event
        self.taken = False


def _check_align(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int power of two, got {value!r}")
    if value < 1 or value & (value - 1):
        raise ValueError(f"{what} must be a power of two >= 1, got {value!r}")
    return value


def _round_up(value: int, granularity: int) -> int:
    return (value + granularity - 1) & -granularity


def _user_stack() -> tuple[str, ...]:
    frames = traceback.extract_stack()
    return tuple(
        f"{frame.filename}:{frame.lineno} in {frame.name}"
        for frame in frames
        if not os.path.abspath(frame.filename).startswith(_PACKAGE_DIR + os.sep)
    )


@final
class Budget:
    """A scoped limit on device memory; use it as a context manager.

    Create budgets with :func:`gpu_budget`. Entering a budget while another is active makes
    it a child of that one. See the module docstring for accounting, placement and lifetime.

    Examples
    --------
    >>> from gpubudget import gpu_budget
    >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
    ...     with gpu_budget("256KiB", name="model") as model:
    ...         a = model.allocate(200_000)
    ...         b = model.allocate(100_000)        # over the child's limit
    ...     (pool.used, model.used, b)
    (200192, 200192, None)
    >>> pool
    <Budget 'pool' limit=1.00 MiB used=195.50 KiB peak=195.50 KiB exited>
    """

    __slots__ = (
        "_name",
        "_limit",
        "_align",
        "_reserve",
        "_backend_spec",
        "_track_stacks",
        "_state",
        "_refusal",
        "_token",
        "_parent",
        "_root",
        "_chain",
        "_plain_chain",
        "_children",
        "_lock",
        "_backend",
        "_reservation",
        "_arena",
        "_granularity",
        "_stacks",
        "_live",
        "_pending",
        "_pending_fifo",
        "_pins",
        "_open_children",
        "_used",
        "_peak",
        "_allocations",
        "_frees",
        "_invalid_frees",
        "_denied",
        "_largest_denied",
        "_denials",
        "_errors",
        "_id",
        "_trace_spec",
        "_writer",
        "_events",
        "_event_count",
        "_tags",
        "_free_at_entry",
        "_free_at_exit",
        "__weakref__",
    )

    def __init__(
        self,
        limit: int | str,
        *,
        align: int = 256,
        name: str | None = None,
        reserve: int | str | None = None,
        backend: Backend | str | None = None,
        track_stacks: bool = False,
        trace: str | os.PathLike[str] | None = None,
    ) -> None:
        self._limit: Final = parse_size(limit, what="limit")
        self._align: Final = _check_align(align, "align")
        if name is None:
            name = f"budget-{next(_counter)}"
        elif not isinstance(name, str) or not name.strip():
            raise (TypeError if not isinstance(name, str) else ValueError)(
                f"name must be a non-empty string, got {name!r}"
            )
        self._name: Final = name
        self._reserve = 0 if reserve is None else parse_size(reserve, what="reserve")
        if self._reserve > self._limit:
            raise ValueError(
                f"reserve {reserve!r} ({format_size(self._reserve)}) exceeds limit {limit!r} "
                f"({format_size(self._limit)}) of budget {name!r}"
            )
        validate_spec(backend)
        self._backend_spec = backend
        if not isinstance(track_stacks, bool):
            raise TypeError(f"track_stacks must be a bool, got {track_stacks!r}")
        self._track_stacks: Final = track_stacks
        if trace is not None and not isinstance(trace, (str, os.PathLike)):
            raise TypeError(f"trace must be a file path, got {trace!r}")
        if isinstance(trace, str) and not trace:
            raise ValueError("trace must be a file path, got ''")
        self._trace_spec = trace
        self._id = next(_counter)
        self._writer: TraceWriter | None = None
        self._events: collections.deque[_Event] = collections.deque(maxlen=EVENT_LOG_LIMIT)
        self._event_count = [0]  # shared by the tree: events ever logged
        self._tags: dict[str, list[int]] = {}  # tag -> [live bytes, peak bytes], own blocks
        self._free_at_entry: int | None = None
        self._free_at_exit: int | None = None
        self._state: State = "new"
        self._refusal: str | None = "inactive"  # the denial reason while not allocatable
        self._token: Token[tuple[Budget, ...]] | None = None
        self._parent: Budget | None = None
        self._root: Budget = self
        self._chain: tuple[Budget, ...] = (self,)
        self._plain_chain = True
        self._children: list[Budget] = []
        self._lock = threading.Lock()
        self._backend: Backend | None = None
        self._reservation: Reservation | None = None
        self._arena = _NO_ARENA  # the root's arena, shared by the whole tree
        self._granularity = self._align
        self._stacks = track_stacks
        self._live: dict[int, _Live] = {}
        self._pending: dict[tuple[int, int], list[_Pending]] = {}
        self._pending_fifo: collections.deque[_Pending] = collections.deque()
        self._pins = 0
        self._open_children = 0
        self._used = 0
        self._peak = 0
        self._allocations = 0
        self._frees = 0
        self._invalid_frees = 0
        self._denied = 0
        self._largest_denied = 0
        self._denials: dict[tuple[str, str], list[int]] = {}
        self._errors: collections.deque[str] = collections.deque(maxlen=_KEEP_ERRORS)

    # -- read-only state -------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The budget's name (given, or ``budget-N``)."""
        return self._name

    @property
    def limit(self) -> int:
        """The most bytes this budget (with its children) may be charged."""
        return self._limit

    @property
    def align(self) -> int:
        """Minimum alignment of this budget's blocks; sizes are rounded up to it."""
        return self._align

    @property
    def reserve(self) -> int:
        """Bytes guaranteed to this budget at entry (0 without ``reserve=``)."""
        return self._reserve

    @property
    def state(self) -> State:
        """``new``, ``open``, ``exited`` or ``released``."""
        return self._state

    @property
    def used(self) -> int:
        """Aligned bytes charged now (children's included)."""
        return self._used

    @property
    def peak(self) -> int:
        """Highest ``used`` so far."""
        return self._peak

    @property
    def available(self) -> int:
        """Bytes one allocation could still be charged, by this budget's and its ancestors'
        limits (the arena may still be too fragmented to place them)."""
        with self._root._lock:
            return self._available()

    @property
    def parent(self) -> Budget | None:
        """The budget this one was entered in, ``None`` for a root."""
        return self._parent

    @property
    def children(self) -> tuple[Budget, ...]:
        """Budgets entered inside this one (unreleased ones, and the last released ones)."""
        with self._root._lock:
            return tuple(self._children)

    @property
    def backend(self) -> Backend | None:
        """The backend the tree draws from (``None`` before entry)."""
        return self._backend

    def __repr__(self) -> str:
        return (
            f"<Budget {self._name!r} limit={format_size(self._limit)} "
            f"used={format_size(self._used)} peak={format_size(self._peak)} {self._state}>"
        )

    # -- scope -----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        if self._state != "new":
            raise RuntimeError(
                f"budget {self._name!r} was already entered ({self._state}); a budget is "
                f"single-use, create a new one with gpu_budget(...)"
            )
        chain = scope.active_chain()
        self._open(chain[-1] if chain else None)
        self._token = scope.ACTIVE.set(chain + (self,))
        return self

    def _open(self, parent: Budget | None) -> None:
        """Enter the budget under ``parent`` without touching the context stack (``with``
        does that; the trace replayer opens budgets in the order a trace recorded)."""
        if parent is None:
            self._open_as_root()
        else:
            self._open_as_child(parent)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        chain = scope.active_chain()
        misnested = not chain or chain[-1] is not self
        if misnested:
            if self in chain:
                scope.ACTIVE.set(tuple(b for b in chain if b is not self))
        else:
            token = self._token
            assert token is not None
            try:
                if token.old_value != chain[:-1]:  # an outer budget was mis-exited meanwhile
                    raise ValueError("stale token")
                scope.ACTIVE.reset(token)
            except ValueError:  # stale, or exited in another context than it was entered in
                scope.ACTIVE.set(chain[:-1])
        self._token = None
        self._close_scope()
        if misnested:
            inner = chain[-1].name if chain else None
            message = (
                f"budget {self._name!r} exited while "
                + (f"budget {inner!r} entered inside it is still active" if inner else
                   "it is not active in this context")
                + "; exit budgets in the reverse order of entry (nest the with-blocks), and "
                "do not exit a budget in another thread or task than the one that entered it"
            )
            if exc_type is None:
                raise BudgetNestingError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _close_scope(self) -> None:
        """Leave the ``open`` state (the context stack is the caller's business)."""
        if self._parent is None and self._free_at_entry is not None and self._backend:
            info = self._backend.mem_info()
            self._free_at_exit = info[0] if info else None
        with self._root._lock:
            if self._state == "open":
                if self._writer is not None:
                    self._writer.write("exit", b=self._id)
                    if self._parent is None:
                        self._writer.flush()
                self._set_state("exited")
                self._try_release()

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def _open_as_root(self) -> None:
        backend = get_backend(self._backend_spec)
        align = self._align
        capacity = _round_up(self._limit, align)
        try:
            reservation = backend.reserve(capacity)
            base = _round_up(reservation.address, align)
            if base != reservation.address:  # alignment beyond what the backend guarantees
                reservation.release()
                reservation = backend.reserve(capacity + align)
                base = _round_up(reservation.address, align)
        except MemoryError as exc:
            info = backend.mem_info()
            where = (
                f"{format_size(info[0])} free of {format_size(info[1])} total"
                if info
                else "free memory unknown"
            )
            raise BudgetError(
                f"budget {self._name!r} could not reserve {format_size(capacity)} from the "
                f"{backend.name} backend ({where}): {exc}"
            ) from exc
        self._reserve = 0  # a root holds its whole limit; a floor means nothing there
        trace = self._trace_spec if self._trace_spec is not None else os.environ.get(_TRACE_ENV)
        if trace:
            try:
                self._writer = writer_for(trace)
            except Exception:
                reservation.release()
                raise
        if backend.name == "pycuda":  # device memory taken outside budgets shows in reports
            info = backend.mem_info()
            self._free_at_entry = info[0] if info else None
        self._backend = backend
        self._reservation = reservation
        self._arena = Arena(base, capacity, align)
        self._set_state("open")
        self._log_enter()

    def _open_as_child(self, parent: Budget) -> None:
        root = parent._root
        if self._backend_spec is not None and get_backend(self._backend_spec) is not root._backend:
            raise ValueError(
                f"budget {self._name!r} was given backend={self._backend_spec!r} but is "
                f"entered inside {parent._name!r}, which uses {root._backend!r}; a child "
                f"always draws from its root's backend"
            )
        if self._trace_spec is not None:
            raise ValueError(
                f"budget {self._name!r} was given trace={self._trace_spec!r} but is entered "
                f"inside {parent._name!r}; only a root budget writes a trace (its children's "
                f"events go into it)"
            )
        with root._lock:
            if parent._state != "open":
                raise BudgetNestingError(
                    f"budget {self._name!r} entered inside {parent._name!r}, which is {parent._state}"
                )
            granularity = max(self._align, parent._granularity)
            if self._reserve:
                self._reserve = _round_up(self._reserve, granularity)
                refused = parent._charge(self._reserve)
                if refused is not None:
                    raise BudgetError(
                        f"budget {self._name!r} cannot set aside reserve "
                        f"{format_size(self._reserve)}: {refused._name!r} has "
                        f"{format_size(refused._limit - refused._used)} left of "
                        f"{format_size(refused._limit)}"
                    )
            self._parent = parent
            self._root = root
            self._chain = (self,) + parent._chain
            self._plain_chain = not any(b._reserve for b in self._chain)
            self._lock = root._lock
            self._live = root._live  # one registry per tree: free() finds any block by address
            self._pending = root._pending
            self._pending_fifo = root._pending_fifo
            self._events = root._events
            self._event_count = root._event_count
            self._writer = root._writer
            self._backend = root._backend
            self._arena = root._arena
            self._granularity = granularity
            self._stacks = self._track_stacks or parent._stacks
            parent._children.append(self)
            parent._open_children += 1
            self._set_state("open")
            self._log_enter()

    # -- allocation ------------------------------------------------------------------------

    def allocate(
        self,
        size: int,
        alignment: int = 0,
        *,
        tag: str | None = None,
        stream: int | None = None,
    ) -> int | None:
        """Return the address of a block of at least ``size`` bytes, or ``None``.

        The block starts at a multiple of ``max(align, alignment)`` and every budget of the
        chain is charged its aligned size. ``None`` (never an exception) when a limit or the
        arena cannot take it, ``size`` is not a positive int, ``alignment`` is not 0 or a
        power of two, or the budget is not entered or already released; each denial is
        counted in :meth:`report`. ``stream``: the CUDA stream the block will be used on;
        a block freed on that stream with the same aligned size is reused at once.

        Examples
        --------
        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("4KiB", backend="host") as b:
        ...     a = b.allocate(100, alignment=1024)
        ...     (a % 1024, b.used, b.allocate(0), b.allocate(8192))
        (0, 1024, None, None)
        """
        if tag is None:
            tag = _current_label()
        if type(size) is not int or size <= 0:
            self._deny(size if type(size) is int else 0, "invalid_size", self, tag)
            return None
        granularity = self._granularity
        if alignment:
            if type(alignment) is not int or alignment < 0 or alignment & (alignment - 1):
                self._deny(size, "invalid_alignment", self, tag)
                return None
            if alignment > granularity:
                granularity = alignment
        nbytes = (size + granularity - 1) & -granularity
        stack = _user_stack() if self._stacks else None
        with self._lock:
            if self._refusal is not None:
                self._deny_locked(nbytes, self._refusal, self, tag)
                return None
            if self._plain_chain:  # _charge(nbytes), inlined for the common case
                chain = self._chain
                for budget in chain:
                    if budget._used + nbytes > budget._limit:
                        self._deny_locked(nbytes, "over_limit", budget, tag)
                        return None
                for budget in chain:
                    used = budget._used = budget._used + nbytes
                    if used > budget._peak:
                        budget._peak = used
            else:
                refused = self._charge(nbytes)
                if refused is not None:
                    self._deny_locked(nbytes, "over_limit", refused, tag)
                    return None
            if self._pending_fifo:
                address = self._place_with_pending(nbytes, granularity, stream)
            else:
                address = self._arena.allocate(nbytes, granularity)
            if address is None:
                self._charge(-nbytes)
                self._deny_locked(nbytes, "fragmented", self, tag)
                return None
            self._live[address] = (self, nbytes, tag, stack)
            self._allocations += 1
            if tag is not None:
                self._count_tag(tag, nbytes)
            self._events.append((_clock(), "alloc", self._id, nbytes, tag, self._used, self._root._used))
            self._event_count[0] += 1
            if self._writer is not None:
                self._writer.write("alloc", b=self._id, size=size, align=alignment, tag=tag,
                                   ptr=address, bytes=nbytes, reason=None)
        return address

    def free(self, address: int, *, stream: int | None = None) -> bool:
        """Free the block at ``address``, allocated by this budget or a descendant.

        Returns ``False`` (and changes nothing but the ``invalid_frees`` count) for an
        address this budget tree did not hand out, a double free, or a block of a budget that
        is not this one or its descendant. Never raises. With ``stream``, the block is reused
        at once by allocations on the same stream, and by others only once the work queued
        on ``stream`` before the free has completed.

        Examples
        --------
        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("4KiB", backend="host") as b:
        ...     a = b.allocate(100)
        ...     (b.free(a), b.free(a), b.free(12345), b.used)
        (True, False, False, 0)
        """
        with self._lock:
            try:
                record = self._live.pop(address)
            except (KeyError, TypeError):
                self._invalid_frees += 1
                return False
            owner, nbytes, tag, _ = record
            if owner is not self and self not in owner._chain:
                self._live[address] = record
                self._invalid_frees += 1
                return False
            if owner._plain_chain:  # _charge(-nbytes), inlined for the common case
                for budget in owner._chain:
                    budget._used -= nbytes
            else:
                owner._charge(-nbytes)
            owner._frees += 1
            if tag is not None:
                owner._tags[tag][0] -= nbytes
            self._events.append((_clock(), "free", owner._id, nbytes, tag, owner._used, self._root._used))
            self._event_count[0] += 1
            if self._writer is not None:
                self._writer.write("free", b=owner._id, ptr=address)
            if stream is None:
                self._arena.free(address)
            else:
                self._root._defer_free(address, nbytes, stream)
            if owner._state == "exited" and owner._allocations == owner._frees:
                owner._try_release()
        return True

    def resize(self, address: int, new_size: int, alignment: int = 0) -> int | None:
        """Grow or shrink a block, keeping ``min(old, new)`` bytes; return its address.

        In place when the arena allows, else a new block with a device-to-device copy and the
        old block freed; ``None`` when neither works, the old block then untouched. Never
        raises; the address must belong to this budget or a descendant.
        """
        root = self._root
        with root._lock:
            record = root._live.get(address) if type(address) is int else None
            if record is None or (record[0] is not self and self not in record[0]._chain):
                self._invalid_frees += 1
                return None
            owner, old_nbytes, tag, stack = record
            if type(new_size) is not int or new_size <= 0:
                owner._deny_locked(0, "invalid_size", owner)
                return None
            if type(alignment) is not int or alignment < 0 or alignment & (alignment - 1):
                owner._deny_locked(new_size, "invalid_alignment", owner)
                return None
            granularity = max(owner._granularity, alignment)
            nbytes = _round_up(new_size, granularity)
            delta = nbytes - old_nbytes
            if address % granularity == 0:
                refused = owner._charge(delta) if delta > 0 else None
                if refused is None:
                    if self._arena.resize(address, nbytes):
                        if delta < 0:
                            owner._charge(delta)
                        root._live[address] = (owner, nbytes, tag, stack)
                        if tag is not None:
                            owner._tags[tag][0] -= old_nbytes
                            owner._count_tag(tag, nbytes)
                        kind = "alloc" if delta > 0 else "free"
                        self._events.append(
                            (_clock(), kind, owner._id, abs(delta), tag, owner._used, root._used)
                        )
                        self._event_count[0] += 1
                        if self._writer is not None:
                            self._writer.write("resize", b=owner._id, ptr=address,
                                               size=new_size, align=alignment, bytes=nbytes)
                        return address
                    if delta > 0:
                        owner._charge(-delta)
        new = owner.allocate(new_size, alignment, tag=tag)
        if new is None:
            return None
        backend = root._backend
        assert backend is not None
        try:
            backend.copy(new, address, min(old_nbytes, nbytes))
        except Exception as exc:  # noqa: BLE001 - resize never raises; the old block stays
            owner.free(new)
            owner.record_error(f"resize copy failed: {type(exc).__name__}: {exc}")
            return None
        owner.free(address)
        return new

    def size_of(self, address: int) -> int:
        """Aligned size of the live block at ``address`` in this tree, 0 if none."""
        with self._root._lock:
            record = self._root._live.get(address)
            return record[1] if record is not None else 0

    def owner_of(self, address: int) -> Budget | None:
        """The budget of this tree that holds the live block at ``address``, if any."""
        with self._root._lock:
            record = self._root._live.get(address)
            return record[0] if record is not None else None

    # -- lifetime pins and errors (for adapters such as gpubudget.tensorrt) ----------------

    def pin(self) -> None:
        """Keep this budget's memory alive for an object that may allocate through it later
        (a TensorRT runtime, an engine); pair every call with :meth:`unpin`."""
        with self._root._lock:
            if self._state in ("new", "released"):
                raise BudgetError(f"budget {self._name!r} is {self._state}; it cannot be pinned")
            self._pins += 1

    def unpin(self) -> None:
        """Undo one :meth:`pin`; releases the budget if it was the last thing holding it."""
        with self._root._lock:
            if self._pins > 0:
                self._pins -= 1
                self._try_release()

    def record_error(self, message: str) -> None:
        """Record an internal error caught inside a callback (kept: the last 16)."""
        with self._root._lock:
            self._errors.append(message)
            self._deny_locked(0, "internal_error", self)

    # -- report ----------------------------------------------------------------------------

    def report(self) -> BudgetReport:
        """A snapshot of this budget and its children; works in every state.

        Examples
        --------
        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
        ...     _ = pool.allocate(4096, tag="weights")
        >>> print(pool.report())  # doctest: +ELLIPSIS
        pool [host] (exited): used 4.00 KiB of 1.00 MiB, peak 4.00 KiB
          allocations 1, frees 0, denied 0
        ...
        """
        outside = None
        if self._parent is None and self._free_at_entry is not None and self._backend:
            now = self._free_at_exit
            if now is None and self._state == "open":
                info = self._backend.mem_info()
                now = info[0] if info else None
            outside = self._free_at_entry - now if now is not None else None
        with self._root._lock:
            report = self._report()
            names = {budget._id: budget._name for budget in self._subtree()}
            events = [e for e in self._events if e[2] in names]
            dropped = self._event_count[0] - len(self._events)
        start = events[0][0] if events else 0.0
        timeline = tuple(
            TimelineEvent(t - start, kind, names[budget], size, tag, used, total)
            for t, kind, budget, size, tag, used, total in events
        )
        return dataclasses.replace(
            report, timeline=timeline, events_dropped=dropped, outside_bytes=outside
        )

    def _subtree(self) -> list[Budget]:
        found = [self]
        for child in self._children:
            found += child._subtree()
        return found

    def _report(self) -> BudgetReport:
        arena = self._arena if self._state in ("open", "exited") else None
        live = tuple(
            LiveBlock(address, nbytes, tag, stack)
            for address, (owner, nbytes, tag, stack) in self._root._live.items()
            if owner is self
        )
        return BudgetReport(
            name=self._name,
            state=self._state,
            backend=self._backend.name if self._backend is not None else None,
            limit=self._limit,
            reserve=self._reserve,
            align=self._align,
            used=self._used,
            peak=self._peak,
            available=self._available(),
            allocations=self._allocations,
            frees=self._frees,
            invalid_frees=self._invalid_frees,
            denied=self._denied,
            largest_denied=self._largest_denied,
            denials=tuple(
                Denial(reason, refused_by, count, largest)
                for (reason, refused_by), (count, largest) in self._denials.items()
            ),
            free_bytes=arena.free_bytes if arena is not None else 0,
            largest_free_block=arena.largest_free if arena is not None else 0,
            live_blocks=tuple(sorted(live, key=lambda block: block.address)),
            callback_errors=tuple(self._errors),
            by_tag=tuple(TagUsage(tag, live, peak) for tag, (live, peak) in self._tags.items()),
            children=tuple(child._report() for child in self._children),
        )

    # -- internals (called with the root's lock held) --------------------------------------

    def _set_state(self, state: State) -> None:
        self._state = state
        self._refusal = "inactive" if state == "new" else "released" if state == "released" else None

    def _charge(self, delta: int) -> Budget | None:
        """Add ``delta`` bytes to this budget and, as reserves pass them up, its ancestors.

        Returns the first budget whose limit a positive ``delta`` would exceed, changing
        nothing; else applies the change everywhere and returns ``None``.
        """
        if self._plain_chain:  # no reserve in the chain: every budget gets the same delta
            chain = self._chain
            if delta > 0:
                for budget in chain:
                    if budget._used + delta > budget._limit:
                        return budget
            for budget in chain:
                used = budget._used = budget._used + delta
                if used > budget._peak:
                    budget._peak = used
            return None
        link: Budget | None = self
        d = delta
        if delta > 0:
            while link is not None and d:
                used = link._used + d
                if used > link._limit:
                    return link
                if link._reserve:
                    d = max(used, link._reserve) - max(link._used, link._reserve)
                link = link._parent
            link, d = self, delta
        while link is not None and d:
            old = link._used
            used = link._used = old + d
            if used > link._peak:
                link._peak = used
            if link._reserve:
                d = max(used, link._reserve) - max(old, link._reserve)
            link = link._parent
        return None

    def _available(self) -> int:
        best = self._limit - self._used
        slack = 0  # reserved but unused bytes below the current level
        link = self
        while link._parent is not None:
            slack += max(link._reserve - link._used, 0)
            parent = link._parent
            best = min(best, parent._limit - parent._used + slack)
            link = parent
        return max(best, 0)

    def _deny(self, size: int, reason: str, refused_by: Budget, tag: str | None = None) -> None:
        with self._root._lock:
            self._deny_locked(size, reason, refused_by, tag)

    def _deny_locked(
        self, size: int, reason: str, refused_by: Budget, tag: str | None = None
    ) -> None:
        self._events.append((_clock(), "deny", self._id, size, tag, self._used, self._root._used))
        self._event_count[0] += 1
        if self._writer is not None:
            self._writer.write("alloc", b=self._id, size=size, align=0, tag=tag, ptr=None,
                               bytes=size, reason=reason)
        self._denied += 1
        if size > self._largest_denied:
            self._largest_denied = size
        entry = self._denials.get((reason, refused_by._name))
        if entry is None:
            self._denials[(reason, refused_by._name)] = [1, size]
        else:
            entry[0] += 1
            if size > entry[1]:
                entry[1] = size

    def _count_tag(self, tag: str, nbytes: int) -> None:
        entry = self._tags.get(tag)
        if entry is None:
            self._tags[tag] = [nbytes, nbytes]
        else:
            entry[0] += nbytes
            if entry[0] > entry[1]:
                entry[1] = entry[0]

    def _log_enter(self) -> None:
        if self._track_stacks:
            _leak_watch.add(self)
        if self._writer is not None:
            backend = self._backend.name if self._backend is not None else None
            self._writer.write(
                "enter", b=self._id, name=self._name,
                parent=self._parent._id if self._parent is not None else None,
                limit=self._limit, align=self._align, reserve=self._reserve, backend=backend,
            )

    def _place_with_pending(self, nbytes: int, alignment: int, stream: int | None) -> int | None:
        """Place a block while stream-ordered frees are pending: retire the completed ones,
        reuse a same-stream block of the same size, else take one from the arena; when the
        arena is full, wait for the pending frees and try once more."""
        root = self._root
        address = root._reuse_pending(nbytes, alignment, stream)
        if address is None:
            address = self._arena.allocate(nbytes, alignment)
            if address is None and root._pending_fifo:
                root._retire_pending(wait=True)
                address = self._arena.allocate(nbytes, alignment)
        return address

    def _defer_free(self, address: int, nbytes: int, stream: int) -> None:
        """Root only: free now if ``stream``'s work is done, else keep the block pending."""
        backend = self._backend
        assert backend is not None
        event = backend.record_event(stream)
        if event.query():
            self._arena.free(address)
            return
        pending = _Pending(address, nbytes, stream, event)
        self._pending.setdefault((stream, nbytes), []).append(pending)
        self._pending_fifo.append(pending)

    def _reuse_pending(self, nbytes: int, alignment: int, stream: int | None) -> int | None:
        """Root only: retire completed frees; hand out a same-stream, same-size block."""
        self._retire_pending(wait=False)
        if stream is not None:
            candidates = self._pending.get((stream, nbytes))
            while candidates:
                pending = candidates.pop()
                if not pending.taken and pending.address % alignment == 0:
                    pending.taken = True
                    return pending.address
        return None

    def _retire_pending(self, wait: bool) -> None:
        """Root only: free pending blocks whose stream work is done (``wait``: all of them)."""
        fifo = self._pending_fifo
        while fifo:
            pending = fifo[0]
            if not pending.taken:
                if wait:
                    pending.event.synchronize()
                elif not pending.event.query():
                    return
                pending.taken = True
                self._arena.free(pending.address)
            fifo.popleft()
            same = self._pending.get((pending.stream, pending.nbytes))
            if same is not None:
                if pending in same:
                    same.remove(pending)
                if not same:
                    del self._pending[(pending.stream, pending.nbytes)]

    def _try_release(self) -> None:
        if (
            self._state != "exited"
            or self._allocations != self._frees  # live blocks
            or self._pins
            or self._open_children
        ):
            return
        self._set_state("released")
        parent = self._parent
        if parent is None:
            self._retire_pending(wait=True)
            reservation, self._reservation = self._reservation, None
            if reservation is not None:
                reservation.release()
            return
        if self._reserve:
            parent._charge(-self._reserve)
        parent._open_children -= 1
        released = [c for c in parent._children if c._state == "released"]
        for child in released[: max(len(released) - _KEEP_RELEASED_CHILDREN, 0)]:
            parent._children.remove(child)
        parent._try_release()


@atexit.register
def _report_leaks_at_exit() -> None:
    """Budgets made with ``track_stacks=True`` list the blocks still live at exit, with the
    stacks that allocated them, on stderr (budgets without it stay silent)."""
    for budget in list(_leak_watch):
        if budget._state not in ("exited", "released"):
            continue
        if any(ancestor in _leak_watch for ancestor in budget._chain[1:]):
            continue  # listed with its ancestor's
        leaks = budget.report().leaks
        if not leaks:
            continue
        lines = [f"gpubudget: {len(leaks)} block(s) of budget {budget._name!r} still live at exit:"]
        for block in leaks:
            tag = f" {block.tag}" if block.tag else ""
            lines.append(f"  {block.address:#x} {format_size(block.size)}{tag}")
            lines += [f"      {frame}" for frame in (block.stack or ())[-4:]]
        print("\n".join(lines), file=sys.stderr)


def gpu_budget(
    limit: int | str,
    *,
    align: int = 256,
    name: str | None = None,
    reserve: int | str | None = None,
    backend: Backend | str | None = None,
    track_stacks: bool = False,
    trace: str | os.PathLike[str] | None = None,
) -> Budget:
    """Create a :class:`Budget`; enter it with ``with`` (or ``async with``).

    Parameters
    ----------
    limit
        Most bytes the budget and its children may be charged: an int or a string such as
        ``"4GiB"`` (see :func:`gpubudget.parse_size`). A root budget reserves it from the
        device in one allocation at entry (rounded up to ``align``).
    align
        Power of two: blocks start at a multiple of ``max(align, requested alignment)`` and
        are charged their size rounded up to that. Default 256, what ``cudaMalloc`` gives.
        A child never aligns finer than the root it draws from.
    name
        Shown in reports and error messages; ``budget-N`` if omitted.
    reserve
        Child budgets only: bytes set aside in the parent at entry for this budget alone
        (``BudgetError`` if the parent cannot). Ignored by a root, which holds its whole limit.
    backend
        ``"pycuda"``, ``"host"``, a backend object, or ``None`` (``GPUBUDGET_BACKEND``, else
        PyCUDA when a CUDA device is usable, else host memory with a warning). Roots only.
    track_stacks
        Keep the Python stack that allocated each live block (for leak reports); children
        inherit it. Blocks of such a budget still live at interpreter exit are listed, with
        their stacks, on stderr.
    trace
        Root budgets only: write every event of the tree to this file as JSON lines (see
        :mod:`gpubudget.tracefile`); ``GPUBUDGET_TRACE`` does the same for every root.

    Examples
    --------
    >>> from gpubudget import gpu_budget
    >>> with gpu_budget("4GiB", name="shared", backend="host") as pool:
    ...     with gpu_budget("2GiB", name="detector") as detector:
    ...         detector.allocate(3 * 2**30) is None       # over the detector's limit
    True
    """
    return Budget(
        limit,
        align=align,
        name=name,
        reserve=reserve,
        backend=backend,
        track_stacks=track_stacks,
        trace=trace,
    )

