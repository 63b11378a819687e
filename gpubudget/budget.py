"""``Budget``: what the user holds -- a limit on device memory, entered with ``with``.

A budget checks its arguments, runs the ``with`` protocol (the context-variable stack,
misnesting found and explained) and takes the calls that change memory (``allocate``, ``free``,
``resize``); the work happens in its tree (:mod:`gpubudget._core.tree`). What it answers is in
:mod:`gpubudget._budget.view`, what adapters call in :mod:`gpubudget._budget.hooks`, what a
growable root does with its memory in :mod:`gpubudget._budget.residency` (its three bases).
Lifetime: ``new`` -> ``open`` (entered) -> ``exited`` (scope left) -> ``released`` (nothing
holds it any more: no live block, no pin, no unreleased child; a root then returns its
reservation).
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING, Final, Literal, SupportsIndex, final, overload

from . import context
from ._budget import (
    FORKED,
    THREAD_ROOT,
    BudgetView,
    Hooks,
    Residency,
    checked,
    open_root,
    opened,
    warn_if_thread_trap,
    watch_leaks,
)
from .backends import Backend, get_backend
from . import door  # the driver door (gpubudget run): told which budget is current
from .callers import user_stack, user_stacklevel
from .errors import AllocationDenied, BudgetNestingError
from ._core import Denied, Node, install_fast_path
from .units import DEFAULT_ALIGN, as_int, as_size, format_size, parse_size

if TYPE_CHECKING:
    from typing_extensions import Self

    from .tracefile import TraceWriter

__all__ = ["ADVICE", "THREAD_ROOT", "TRACE_ENV", "Budget", "gpu_budget", "misnested"]

TRACE_ENV: Final = "GPUBUDGET_TRACE"
"""Environment variable: a trace file every root budget without ``trace=`` writes to
(``{pid}`` in it: the process id). If it cannot be written, one ``RuntimeWarning`` per path
says why and the budgets go on untraced; if another process writes it, this one writes
``<stem>.<pid><suffix>`` beside it, and one warning names that file."""
_current_label: Final = context.LABEL.get
ADVICE: Final = ("exit budgets in the reverse order of entry (nest the with-blocks), in the "
                  "thread or task that entered them")


@atexit.register  # at import, as before the writer loaded late: after the handlers that
def _close_traces() -> None:  # free memory (an adapter's, registered later, runs first)
    """Close every trace writer at interpreter exit, where the writers were ever loaded."""
    perpath = sys.modules.get("gpubudget.tracefile.perpath")
    if perpath is not None:
        perpath._close_all()


def _door_at_exit(budget: Budget) -> None:
    """A traced budget about to exit under the driver door: its trace gets what the door
    charged it, on the line before its ``exit`` (``Recorder.door_at_exit``); nothing for a
    budget the door never charged nor refused (its peak and refusals 0)."""
    node = budget._node
    tree = node.tree
    if tree is None or tree.recorder.writer is None or not door.charged(budget):
        return  # (charged reads ten words: the table of live allocations only if need be)
    numbers = door.numbers(budget)
    if numbers is not None:
        tree.recorder.door_at_exit(node.id, numbers)


@final
class Budget(BudgetView, Residency):
    """A scoped limit on device memory; use it as a context manager.

    ``gpu_budget`` is another name for this class, the one the examples use. Entering a
    budget while another is active in the same context (or with ``parent=``) makes it a
    child of that one; otherwise it is a root and reserves its whole limit from the device.

    Parameters
    ----------
    limit
        Most bytes the budget and its children may be charged: an int or a string such as
        ``"4GiB"`` (see :func:`gpubudget.parse_size`). A root budget reserves it from the
        device in one allocation at entry (rounded up to ``align``). A root may instead ask
        for a share of the device memory no root of the host has claimed (``"50%"``,
        ``"rest - 2GiB"``), sized at entry: see :mod:`gpubudget.hostledger`.
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
        PyCUDA when a CUDA device is usable, else host memory with a warning). Root budgets
        only: a child given one is a ``ValueError`` at entry (it draws from its root).
    track_stacks
        Keep the Python stack that allocated each live block (for leak reports); children
        inherit it. Blocks of such a budget still live at interpreter exit are listed, with
        their stacks, on stderr.
    trace
        Root budgets only: write every event of the tree to this file as JSON lines (see
        :mod:`gpubudget.tracefile`); ``{pid}`` in it becomes the process id. A file that
        cannot be written (a symbolic link, not a regular file, a file that is neither empty
        nor an earlier trace of this user's, one another process is writing) is a
        :class:`~gpubudget.errors.TraceError` at entry, in one line. ``None``: the file
        :data:`TRACE_ENV` names, if set (a failure there is a warning, and no trace);
        ``False``: no trace, whatever that variable says.
    parent
        An open budget to enter under, whatever is active in this context: the way to draw
        from an existing pool in another thread or task (where nothing is active, and a
        plain ``gpu_budget(...)`` would be a new root with a reservation of its own). Such a
        root, entered in a thread other than the main one while another root is open, gets
        one ``RuntimeWarning`` saying so; the message begins with :data:`THREAD_ROOT`, which
        ``warnings.filterwarnings("ignore", message=THREAD_ROOT)`` silences.
    device
        The CUDA device (ordinal) a root reserves on; ``None``: the device current in the
        entering thread (what TensorRT, CuPy and PyTorch use there), else 0. A child draws
        from its root's device and refuses a different one (``ValueError`` at entry). Host
        memory belongs to no device: there it is ignored.
    initial
        Root budgets only: reserve *addresses* for the whole limit and map only ``initial``
        bytes of memory at entry (``0``: none); more is mapped as blocks need it (a growth
        the device cannot back is a ``device_full`` denial), never more than the limit
        rounded up to the device's allocation granularity. Such a root can :meth:`trim`,
        :meth:`offload` and :meth:`restore`. ``None``: the whole limit is reserved at entry.
    trim_on_exit
        Growable roots: :meth:`trim` each time a child budget's scope ends.

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

    __slots__ = ("_node", "_backend_spec", "_trace", "_parent", "_device", "_initial", "_token",
                 "_share",
                 "__weakref__")

    def __init__(
        self,
        limit: int | str,
        *,
        align: int = DEFAULT_ALIGN,
        name: str | None = None,
        reserve: int | str | None = None,
        backend: Backend | str | None = None,
        track_stacks: bool = False,
        trace: str | os.PathLike[str] | Literal[False] | None = None,
        parent: Budget | None = None,
        device: int | None = None,
        initial: int | str | None = None,
        trim_on_exit: bool = False,
    ) -> None:
        args = checked(limit, align, name, reserve, backend, track_stacks, trace, device,
                       initial, trim_on_exit)
        if parent is not None and not isinstance(parent, Budget):
            raise TypeError(f"parent must be a Budget or None, got {parent!r}")
        self._node = Node(self, name, args.limit, args.reserve, args.align, track_stacks)
        self._node.trim_on_exit = trim_on_exit
        self._backend_spec: Final = backend
        self._trace: Final = trace
        self._parent: Final = parent
        self._device: Final = args.device
        self._initial: Final = args.initial
        self._token: Token[tuple[Budget, ...]] | None = None
        self._share: Final = args.share

    # -- the with protocol -----------------------------------------------------------------

    def __enter__(self) -> Self:
        node = self._node
        if node.state != "new":
            raise RuntimeError(f"budget {node.name!r} was already entered ({node.state}); a "
                               f"budget is single-use, create a new one with gpu_budget(...)")
        chain = context.ACTIVE.get()
        parent = self._parent if self._parent is not None else chain[-1] if chain else None
        if parent is not None and parent is not self._parent and parent._node.refusal == FORKED:
            parent = None  # in a forked child, inside an inherited budget: a root of its own
        try:
            if parent is None:
                self._open_root()
            else:
                self._open_child(parent)
            self._token = context.ACTIVE.set(chain + (self,))
            door.entered(self, node.account)  # the driver door, where loaded: its account
            door.follow()
        except BaseException:  # all or nothing: an exception landing once it was open
            if context.ACTIVE.get() is not chain:  # made current (its token kept or not)
                context.ACTIVE.set(chain)
                door.follow()
            self._token = None
            node.close()
            raise
        return self

    def _open_root(self) -> None:
        warn_if_thread_trap(self)
        backend = get_backend(self._backend_spec, device=self._device)
        writer: TraceWriter | None = None
        untraced: str | None = None
        if self._trace is not None and self._trace is not False:
            from .tracefile import writer_for  # the trace writer loads with the first trace

            writer = writer_for(self._trace)  # TraceError, one line, if it cannot be written
        elif self._trace is None and os.environ.get(TRACE_ENV):
            from .tracefile import writer_from_env

            writer, untraced = writer_from_env(os.environ[TRACE_ENV], TRACE_ENV)
        node = self._node
        open_root(node, backend, writer, self._share or node.account.limit, self._initial)
        if untraced is not None and node.tree is not None:
            node.tree.recorder.trace_error = untraced  # the report says why
        opened(self)
        watch_leaks(self)  # leaks said at interpreter exit

    def _open_child(self, parent: Budget) -> None:
        name = self._node.name
        if self._share is not None:
            raise ValueError(f"budget {name!r} was given limit {self._share.text!r}, a share of "
                             f"a device's unclaimed memory, but is entered inside "
                             f"{parent.name!r}; only a root budget sizes itself from the device")
        if self._device is not None and parent.device not in (None, self._device):
            raise ValueError(f"budget {name!r} was given device={self._device} but is entered "
                             f"inside {parent.name!r}, which is on device {parent.device}; a "
                             f"child always draws from its root's device")
        if self._backend_spec is not None:
            raise ValueError(f"budget {name!r} was given backend={self._backend_spec!r} but "
                             f"is entered inside {parent.name!r}; backend= is for root budgets "
                             f"only (a child always draws from its root's memory, here "
                             f"{parent.backend!r})")
        if self._initial is not None:
            raise ValueError(f"budget {name!r} was given initial= but is entered inside "
                             f"{parent.name!r}; initial= is for root budgets only (a child "
                             f"draws from its root's memory)")
        if self._trace is not None and self._trace is not False:
            raise ValueError(f"budget {name!r} was given trace={self._trace!r} but is entered "
                             f"inside {parent.name!r}; only a root budget writes a trace "
                             f"(its children's events go into it)")
        self._node.open_child(parent._node)
        if self._node.track_stacks and not parent._node.track_stacks:
            watch_leaks(self)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        chain = context.ACTIVE.get()
        if self not in chain:  # another thread or task, or never entered: change nothing
            misnested(f"budget {self.name!r} exited where it is not active (state "
                       f"{self.state}); {ADVICE}", exc_type)
            return
        innermost = chain[-1] is self
        try:
            if innermost and self._token is not None and self._token.old_value == chain[:-1]:
                try:
                    context.ACTIVE.reset(self._token)
                except ValueError:  # the token is another context's (a task copied it)
                    context.ACTIVE.set(chain[:-1])
            else:  # an inner budget is still active, or an outer one was mis-exited meanwhile
                context.ACTIVE.set(tuple(budget for budget in chain if budget is not self))
        finally:  # closed whatever lands meanwhile
            self._token = None
            door.follow()  # the driver door, where loaded: the budget now current here
            held = Hooks(self)  # exited, not released, while its driver allocations live
            door.leaving(self, held.pin, held.unpin)
            try:
                _door_at_exit(self)
            finally:
                self._node.close()
        if not innermost:
            misnested(f"budget {self.name!r} exited while budget {chain[-1].name!r} entered "
                       f"inside it is still active; {ADVICE}", exc_type)

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)

    # -- allocation ------------------------------------------------------------------------

    @overload
    def allocate(self, size: SupportsIndex | str, alignment: SupportsIndex = 0, *,
                 tag: str | None = None, stream: int | None = None,
                 raise_on_denial: Literal[False] = False) -> int | None: ...

    @overload
    def allocate(self, size: SupportsIndex | str, alignment: SupportsIndex = 0, *,
                 tag: str | None = None, stream: int | None = None,
                 raise_on_denial: Literal[True]) -> int: ...

    def allocate(self, size: SupportsIndex | str, alignment: SupportsIndex = 0, *,
                 tag: str | None = None, stream: int | None = None,
                 raise_on_denial: bool = False) -> int | None:
        """Return the address of a block of at least ``size`` bytes, or ``None``.

        ``size`` is bytes (an ``int``, or anything with ``__index__``) or a string such as
        ``"1MiB"`` (see :func:`gpubudget.parse_size`). The block starts at a multiple of
        ``max(align, alignment)`` and every budget of the chain is charged its aligned size.
        ``None`` (never an exception) when a limit or the arena cannot take it, ``size`` is
        not a positive size (reason ``invalid_size``: zero, a negative number, a string
        that :func:`~gpubudget.parse_size` refuses), ``alignment`` is not 0 or a power of two,
        ``tag`` is not a string, or the budget is not entered or already released; each
        denial is counted in :meth:`report`. With ``raise_on_denial=True`` a denial raises
        :class:`~gpubudget.errors.AllocationDenied` instead, saying which budget refused,
        why, and the sizes. ``tag`` defaults to the current :func:`gpubudget.label`.
        ``stream``: the CUDA stream the block will be used on; a block freed on that stream
        with the same aligned size is reused at once.

        A ``size`` that is neither an integer nor a string (a ``float`` such as ``1.5e9``,
        ``None``, a ``bool``) raises ``TypeError``, as ``torch.cuda.caching_allocator_alloc``
        does: it is a mistake in the calling code, not a request that memory could have
        met, so it is neither a denial nor counted as one (``num_ooms``). The frameworks'
        callbacks always pass integers, so this never reaches them.

        Examples
        --------
        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("4KiB", backend="host") as b:
        ...     b.allocate(1.5e3)
        Traceback (most recent call last):
        ...
        TypeError: size must be an int (bytes) or a string such as '1MiB', not float 1500.0
        >>> with gpu_budget("4KiB", backend="host") as b:
        ...     a = b.allocate(100, alignment=1024)
        ...     (a % 1024, b.used, b.allocate(0), b.allocate(8192), b.allocate("1 lb"))
        (0, 1024, None, None, None)
        >>> with gpu_budget("4KiB", backend="host") as b:
        ...     c = b.allocate("2KiB")
        ...     b.used
        2048
        """
        if type(size) is not int and not isinstance(size, str) and as_int(size) is None:
            raise _not_a_size(size, "size")
        node = self._node
        tree = node.tree
        why: list[Denied] | None = [] if raise_on_denial else None
        if tree is None:
            self._refuse_unentered(size, why)
            address = None
        else:
            if tag is None:
                tag = _current_label()
            stack = user_stack() if node.track_stacks else None
            address = tree.allocate(node, size, alignment, tag, stream, stack, why)
        if address is None and why:
            raise self._denied(size, why[0])
        return address

    def _refuse_unentered(self, size: object, why: list[Denied] | None = None) -> None:
        node = self._node
        nbytes = as_size(size) or 0
        reason = node.refusal or "inactive"
        with node.lock:
            node.stats.count_denial(nbytes, reason, node.name)
        if why is not None:
            why.append((reason, node.name, nbytes))

    def _denied(self, size: object, why: Denied) -> AllocationDenied:
        """The exception for a denial of ``size`` (as given)."""
        reason, refused_by, nbytes = why
        whose = "its own limit" if refused_by == self.name else f"the limit of {refused_by!r}"
        explained = {
            "over_limit": f"over {whose}: {format_size(self.available)} available",
            "fragmented": "no free block large enough (the arena is fragmented)",
        }.get(reason, reason.replace("_", " "))
        if isinstance(size, str) and reason == "invalid_size":  # parse_size says why
            explained = f"{explained}: {_parse_error(size)}"
        shown = repr(size) if isinstance(size, str) else f"{size!r} bytes"
        return AllocationDenied(
            f"budget {self.name!r} (limit {format_size(self.limit)}) refused {shown} "
            f"({format_size(nbytes)} aligned): {explained}", budget=self.name,
            refused_by=refused_by, reason=reason, size=as_size(size) or 0, charged=nbytes)

    def free(self, address: SupportsIndex, *, stream: int | None = None) -> bool:
        """Free the block at ``address``, allocated by this budget or a descendant.

        Returns ``False`` (and changes nothing but the ``invalid_frees`` count) for an
        address this budget tree did not hand out, a double free, or a block of a budget that
        is not this one or its descendant. Never raises. With ``stream``, the block is reused
        at once by allocations on the same stream, and by others only once the work queued
        on ``stream`` before the free has completed; if no event can be recorded on
        ``stream``, the free is refused (``False``, the error in the report) and the block
        stays live.

        Examples
        --------
        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("4KiB", backend="host") as b:
        ...     a = b.allocate(100)
        ...     (b.free(a), b.free(a), b.free(12345), b.used)
        (True, False, False, 0)
        """
        node = self._node
        tree = node.tree
        if tree is None:
            with node.lock:
                node.stats.invalid_frees += 1
            return False
        return tree.free(node, address, stream)

    def resize(self, address: SupportsIndex, new_size: SupportsIndex | str,
               alignment: SupportsIndex = 0) -> int | None:
        """Grow or shrink a block, keeping ``min(old, new)`` bytes; return its address.

        ``new_size`` as ``size`` in :meth:`allocate` (bytes or a string such as ``"2MiB"``).
        In place when the arena allows, else a new block with a device-to-device copy and the
        old block freed; ``None`` when neither works, the old block then untouched. Never
        raises on a denial; the address must belong to this budget or a descendant (else a
        denial with reason ``invalid_address``), ``new_size`` must be a positive size (else
        ``invalid_size``). A ``new_size`` that is neither an integer nor a string raises
        ``TypeError``, as in :meth:`allocate`.

        >>> with gpu_budget("8KiB", backend="host") as b:
        ...     block = b.allocate(1024)
        ...     (b.resize(block, "4KiB") == block, b.used, b.resize(block, "4 KiBs"))
        (True, 4096, None)
        """
        if type(new_size) is not int and not isinstance(new_size, str) and (
                as_int(new_size) is None):
            raise _not_a_size(new_size, "new_size")
        node = self._node
        tree = node.tree
        if tree is None:
            self._refuse_unentered(new_size)
            return None
        return tree.resize(node, address, new_size, alignment)

    def reset_peak(self) -> None:
        """Start the peaks of this budget and its descendants again from now (``peak``,
        the most blocks held at once, and bytes per tag), to measure one phase.

        >>> with gpu_budget("1MiB", backend="host") as pool:
        ...     block = pool.allocate(4096)
        ...     pool.free(block)
        ...     pool.reset_peak()
        ...     (pool.peak, pool.allocate(1024) is not None, pool.peak)
        True
        (0, True, 1024)
        """
        node = self._node
        with node.lock:
            node.reset_peaks()


FAST: Final = install_fast_path(Budget)
"""Whether ``Budget.allocate`` and ``Budget.free`` run in C for the common case (the C core)."""

gpu_budget: Final = Budget
"""Another name for :class:`Budget`: ``with gpu_budget("4GiB") as pool:``."""


def _not_a_size(size: object, what: str) -> TypeError:
    """The error for a ``size`` of a type that is no size (a programming error)."""
    return TypeError(f"{what} must be an int (bytes) or a string such as '1MiB', not "
                     f"{type(size).__name__} {size!r}")


def _parse_error(size: str) -> str:
    try:
        parse_size(size)
    except ValueError as exc:
        return str(exc)
    return "not a size"  # pragma: no cover - only called for strings parse_size refused


def misnested(message: str, exc_type: type[BaseException] | None) -> None:
    """Raise ``BudgetNestingError``, or warn if an exception is already propagating (an
    exit never hides the exception raised in the block)."""
    if exc_type is None:
        raise BudgetNestingError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())
