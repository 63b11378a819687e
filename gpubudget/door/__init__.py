"""The driver door from Python: whether it is loaded, each budget's account in it, its numbers.

The door is a native library (``door.c`` beside this file, no Python in it) that a process
loads before the CUDA driver, with ``gpubudget run -- python serve.py`` (or ``LD_PRELOAD``
set by hand to :func:`gpubudget.door.build.library`'s answer). It charges every device
allocation a thread asks of the driver to the budget current in that thread. This module is
its Python side, and does nothing at all when the door is not loaded:

- :func:`loaded` says whether it is (its ``gbd_*`` functions resolve in the process);
- the budget layer calls :func:`entered` when a budget opens (the budget gets an account in
  C, chained to its parent's, and the ledger's account is given the C account's words, so
  that each side counts the other's bytes against the limit), :func:`follow` whenever the
  budgets active in a thread change (entering, leaving, ``use()``, ``bind()``), and
  :func:`owning` around a root's own backend calls (its reservation, its granules), which
  the door counts as the root's device memory instead of charging them as foreign;
- :func:`numbers` reads what the door charged a budget, by library, for reports.

The hooks never take the interpreter lock: they read only the thread's account pointer,
which :func:`follow` stores in C.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final, Protocol

from ..context import ACTIVE

if TYPE_CHECKING:  # ctypes and the numbers' dataclasses load when the door is first asked
    import ctypes

    from ..budget import Budget
    from .records import DoorLibrary, DoorNumbers

__all__ = ["DoorLibrary", "DoorNumbers", "charged", "device_view", "entered", "follow",
           "leaving", "loaded", "numbers", "outside", "outside_budgets", "owning", "owner_of",
           "registered"]

WORDS: Final = 4
"""How many 64-bit words of an account the ledger shares: held, core, own, limit."""


class Ledgered(Protocol):
    """What the door needs of a ledger account: its limit, and a place for the words."""

    @property
    def limit(self) -> int: ...

    door: memoryview | None


_lib: list[ctypes.CDLL | None] = []
_lib_lock: Final = threading.Lock()


def _door() -> ctypes.CDLL | None:
    if _lib:
        return _lib[0]
    with _lib_lock:
        if not _lib:
            _lib.append(_find())
    return _lib[0]


def _find() -> ctypes.CDLL | None:
    import ctypes  # here, at the first budget's entry: not at import

    _I64, _P = ctypes.c_int64, ctypes.c_void_p
    # every library loaded, the door first if it is preloaded
    process = ctypes.CDLL(None, use_errno=True)
    try:
        version = process.gbd_version
    except AttributeError:
        return None
    version.restype = ctypes.c_int
    from .build import VERSION

    if version() != VERSION:  # gpubudget run refuses such a library: loaded by hand
        import warnings

        warnings.warn(f"the driver door loaded in this process is version {version()}; this "
                      f"gpubudget needs version {VERSION}: it is not used (its hooks charge "
                      f"nothing, every driver allocation counts as outside budgets)",
                      RuntimeWarning, stacklevel=2)
        return None
    process.gbd_account_new.restype = _P
    process.gbd_account_new.argtypes = [ctypes.c_char_p, _I64, _P]
    process.gbd_account_drop.argtypes = [_P]
    process.gbd_account_set_limit.argtypes = [_P, _I64]
    process.gbd_set_current.argtypes = [_P]
    process.gbd_current.restype = _P
    process.gbd_set_owner.restype = _P
    process.gbd_set_owner.argtypes = [_P]
    process.gbd_account_numbers.argtypes = [_P, ctypes.POINTER(_I64)]
    process.gbd_library.restype = ctypes.c_char_p
    process.gbd_library.argtypes = [ctypes.c_int]
    process.gbd_library_refusals.restype = _I64
    process.gbd_library_refusals.argtypes = [_P, ctypes.c_int]
    process.gbd_live_bytes.restype = _I64
    process.gbd_live_bytes.argtypes = [_P, ctypes.POINTER(_I64), ctypes.c_int,
                                       ctypes.POINTER(_I64)]
    process.gbd_attribute_only.restype = ctypes.c_int
    process.gbd_label.argtypes = [_P, _I64, _I64]
    process.gbd_set_notify.argtypes = [ctypes.c_int]
    process.gbd_watch.argtypes = [_P, ctypes.c_int]
    process.gbd_share.restype = ctypes.c_int
    process.gbd_share.argtypes = [ctypes.c_int, _I64]
    return process


def loaded() -> bool:
    """Whether the driver door is loaded in this process.

    Examples
    --------
    >>> from gpubudget import door
    >>> isinstance(door.loaded(), bool)
    True
    """
    return _door() is not None


class _Account:
    """A budget's account in the door: its address, dropped when the budget goes."""

    __slots__ = ("address", "words", "__weakref__")

    def __init__(self, lib: ctypes.CDLL, name: str, limit: int, parent: _Account | None) -> None:
        address = lib.gbd_account_new(name.encode("utf-8", "replace"),
                                      min(limit, 2**63 - 1), parent.address if parent else None)
        if not address:
            raise MemoryError(f"the driver door could not make an account for budget {name!r}")
        self.address: Final[int] = address
        import ctypes

        words = (ctypes.c_int64 * WORDS).from_address(address)
        setattr(words, "account", self)  # the ledger's view keeps this (and its C memory) alive
        self.words: Final = memoryview(words).cast("B").cast("q")
        weakref.finalize(self, lib.gbd_account_drop, address)


_accounts: Final[weakref.WeakKeyDictionary[Budget, _Account]] = weakref.WeakKeyDictionary()


_shared: list[bool] = []  # whether this process's door file was tried (shared.py)


def _account(lib: ctypes.CDLL, budget: Budget, limit: int) -> _Account:
    account = _accounts.get(budget)
    if account is None:
        if not _shared:  # the first account: the door file first, for top and metrics
            with _lib_lock:
                if not _shared:
                    _shared.append(True)
                    from .shared import share

                    share(lib)
        parent = budget.parent
        account = _Account(lib, budget.name, limit,
                           _accounts.get(parent) if parent is not None else None)
        _accounts[budget] = account
    return account


def entered(budget: Budget, ledger: Ledgered) -> None:
    """``budget`` just opened, its ledger account ``ledger``: make (or find) its account in
    the door, set its limit, and share its words with the ledger."""
    lib = _door()
    if lib is None:
        return
    account = _account(lib, budget, ledger.limit)
    lib.gbd_account_set_limit(account.address, min(ledger.limit, 2**63 - 1))
    ledger.door = account.words
    if budget.parent is not None:  # named in the door file as its ledger row names it
        lib.gbd_label(account.address, 2, getattr(budget, "_node").id)


def registered(budget: Budget, serial: int) -> None:
    """Root ``budget`` registered in the host ledger with ``serial``: its row of the door
    file (:mod:`gpubudget.door.shared`) says so, for top and metrics to find it."""
    lib = _door()
    account = _accounts.get(budget)
    if lib is not None and account is not None:
        lib.gbd_label(account.address, 1, serial)


def follow() -> None:
    """Tell the door which budget is innermost in this thread's context now."""
    lib = _door()
    if lib is None:
        return
    chain = ACTIVE.get()
    account = _accounts.get(chain[-1]) if chain else None
    lib.gbd_set_current(account.address if account is not None else None)


# ended, pinned until the door's bytes in them are freed: each one's unpin
_kept: Final[dict[Budget, Callable[[], None]]] = {}
_kept_lock: Final = threading.Lock()
_watcher: list[threading.Thread] = []
_wake: list[int] = []  # the eventfd the door writes to when a kept budget's bytes are gone


def _foreign(account: _Account) -> int:
    return int(account.words[0] - account.words[2])


def leaving(budget: Budget, pin: Callable[[], None], unpin: Callable[[], None]) -> None:
    """``budget``'s scope is ending: while driver allocations made in it (or in its
    children) live, it stays exited, not released, as it would for blocks of its own. The
    hooks cannot call Python: the door marks its account watched and, when the last of those
    bytes is freed (by any thread), writes to an eventfd that a watcher thread (started the
    first time a budget is kept) waits on; it then lets the budget go. ``pin`` and ``unpin``
    are the budget's (see ``gpubudget.adapter.hooks``)."""
    lib = _door()
    account = _accounts.get(budget)
    if lib is None or account is None or _foreign(account) <= 0:
        return
    pin()
    with _kept_lock:
        _kept[budget] = unpin
        if not _wake:
            _wake.append(os.eventfd(0, os.EFD_CLOEXEC))
            lib.gbd_set_notify(_wake[0])
        lib.gbd_watch(account.address, 1)
        if not _watcher or not _watcher[0].is_alive():
            _watcher[:] = [threading.Thread(target=_watch, args=(lib, _wake[0]),
                                            name="gpubudget-door-watch", daemon=True)]
            _watcher[0].start()
    if _foreign(account) <= 0:  # freed before it was watched: no wake-up will come for it
        os.eventfd_write(_wake[0], 1)


def _watch(lib: ctypes.CDLL, wake: int) -> None:
    """Wait on ``wake``; at each wake-up, let go the kept budgets whose bytes are freed."""
    while True:
        os.eventfd_read(wake)  # blocks, without the interpreter lock, until the door writes
        _let_go(lib)  # a function: nothing of it stays referenced while this thread waits


def _let_go(lib: ctypes.CDLL) -> None:
    """Release the kept budgets whose driver allocations are all freed."""
    with _kept_lock:
        done = [(budget, unpin) for budget, unpin in _kept.items()
                if (account := _accounts.get(budget)) is None or _foreign(account) <= 0]
        for budget, _ in done:
            del _kept[budget]
            account = _accounts.get(budget)
            if account is not None:
                lib.gbd_watch(account.address, 0)
    for _, unpin in done:
        unpin()  # released now, if nothing else holds it


def _forked() -> None:  # the parent's budgets are closed to a forked child (forks.py)
    getattr(_kept_lock, "_at_fork_reinit")()
    _shared[:] = [True]  # the parent's file, privately copied by the door: never another
    _kept.clear()
    _watcher.clear()
    _wake.clear()  # the parent's eventfd (the door forgot it in the child): a new one here


os.register_at_fork(after_in_child=_forked)


@contextlib.contextmanager
def _owning(lib: ctypes.CDLL, account: _Account) -> Iterator[None]:
    before = lib.gbd_set_owner(account.address)
    try:
        yield
    finally:
        lib.gbd_set_owner(before)


def owning(budget: Budget, limit: int) -> contextlib.AbstractContextManager[None]:
    """While this is entered, the driver allocations this thread makes are ``budget``'s own
    (a root's reservation or granules, ``limit`` its limit): the door counts them as its
    device memory, against that limit."""
    lib = _door()
    if lib is None:
        return contextlib.nullcontext()
    return _owning(lib, _account(lib, budget, limit))


@contextlib.contextmanager
def _nobody(lib: ctypes.CDLL) -> Iterator[None]:
    before = lib.gbd_current()
    lib.gbd_set_current(None)
    try:
        yield
    finally:
        lib.gbd_set_current(before)


def outside_budgets() -> contextlib.AbstractContextManager[None]:
    """While this is entered, the driver allocations this thread makes are charged to no
    budget (counted outside every budget): for what an adapter deliberately keeps outside
    them, such as the cuBLAS workspaces PyTorch's routing makes before it routes (see
    ``gpubudget.torch``), which a reserved root would otherwise refuse."""
    lib = _door()
    if lib is None:
        return contextlib.nullcontext()
    return _nobody(lib)


def owner_of(budget: Budget) -> Callable[[], contextlib.AbstractContextManager[None]] | None:
    """What a growable root's memory enters around mapping a granule (see :func:`owning`),
    or ``None`` when the door is not loaded."""
    lib = _door()
    account = _accounts.get(budget)
    if lib is None or account is None:
        return None
    return lambda: _owning(lib, account)


def device_view(budget: Budget) -> tuple[Callable[[], contextlib.AbstractContextManager[None]],
                                         Callable[[], int]] | None:
    """For a root's statistics: a context in which this thread's ``cuMemGetInfo`` answers for
    the device (the root's own, as in :func:`owning`), and a function giving the bytes the
    door charged the root's tree that are not its own memory; ``None`` when the door is not
    loaded or the budget has no account."""
    lib = _door()
    account = _accounts.get(budget)
    if lib is None or account is None:
        return None
    words = account.words
    return (lambda: _owning(lib, account)), (lambda: max(0, words[0] - words[2]))


LIBRARIES: Final = 64
"""Libraries the door tells apart (door.c's LIBS); the rest count as "(other)"."""


def _libraries(lib: ctypes.CDLL,
               address: int | None) -> tuple[int, tuple[DoorLibrary, ...], int]:
    """The bytes live that ``address``'s account (``None``: nobody) was charged for itself,
    their libraries (largest first), and how many allocations hold them."""
    import ctypes
    from .records import DoorLibrary

    live = (ctypes.c_int64 * LIBRARIES)()
    count = ctypes.c_int64()
    total = int(lib.gbd_live_bytes(address, live, LIBRARIES, ctypes.byref(count)))
    found = []
    index = 0
    while (name := lib.gbd_library(index)) is not None:
        refusals = int(lib.gbd_library_refusals(address, index)) if address else 0
        if live[index] or refusals:
            found.append(DoorLibrary(name.decode("utf-8", "replace"), live[index], refusals))
        index += 1
    return (total, tuple(sorted(found, key=lambda item: (-item.live_bytes, item.name))),
            count.value)


def _words(budget: Budget) -> tuple[ctypes.CDLL, int, ctypes.Array[ctypes.c_int64]] | None:
    """The door, ``budget``'s account in it and its numbers (``gbd_account_numbers``' ten
    words, read now); ``None`` when the door is not loaded or the budget never entered
    under it."""
    lib = _door()
    account = _accounts.get(budget)
    if lib is None or account is None:
        return None
    import ctypes

    out = (ctypes.c_int64 * 10)()
    lib.gbd_account_numbers(account.address, out)
    return lib, account.address, out


def charged(budget: Budget) -> bool:
    """Whether the door ever charged or refused ``budget`` (its peak or its refusals): ten
    loads, where :func:`numbers` also walks the table of live allocations."""
    found = _words(budget)
    return found is not None and bool(found[2][7] or found[2][5])


def numbers(budget: Budget) -> DoorNumbers | None:
    """What the door charged ``budget``, or ``None`` (the door is not loaded, or the budget
    was never entered under it)."""
    found = _words(budget)
    if found is None:
        return None
    from .records import DoorNumbers

    lib, address, out = found
    name = lib.gbd_library(out[9]) if out[8] else None
    _, libraries, count = _libraries(lib, address)
    return DoorNumbers(held=out[0], own=out[2], live=count, peak=out[7], refusals=out[5],
                       last_refused=out[8],
                       last_refused_by=name.decode("utf-8", "replace") if name else None,
                       libraries=libraries,
                       attribute_only=bool(lib.gbd_attribute_only()))


def outside() -> tuple[int, tuple[DoorLibrary, ...]] | None:
    """Bytes the driver gave outside every budget since the door was loaded, and by which
    library; ``None`` when the door is not loaded."""
    lib = _door()
    if lib is None:
        return None
    total, libraries, _ = _libraries(lib, None)
    return total, libraries


if not TYPE_CHECKING:  # mypy sees the names imported above, and no catch-all
    def __getattr__(name: str) -> object:
        """The numbers' records, :class:`DoorNumbers` and :class:`DoorLibrary`, loaded (with
        :mod:`dataclasses`) when first named."""
        if name in ("DoorLibrary", "DoorNumbers"):
            from . import records

            return getattr(records, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(globals()) | {"DoorLibrary", "DoorNumbers"})
