"""A root's memory: one reservation of its whole limit, or a range that grows and sleeps.

:func:`reserve` takes a root's memory at entry. By default that is one allocation of the
whole limit from the backend (fast to sub-allocate, never fragments the device, and held
from the first line). A root entered with ``initial=`` instead reserves *addresses* for its
whole limit and maps physical memory into them granule by granule as blocks need it
(:mod:`gpubudget.backends.virtual`): a :class:`Mapping`.

The tree's arena places blocks in the whole range either way, so placement and
fragmentation do not change. A :class:`Mapping` makes sure every granule a block touches is
mapped before the block is handed out (:meth:`Mapping.admit`), gives back the granules no
block touches (:meth:`Mapping.trim`), and puts the whole range to sleep and wakes it
(:meth:`Mapping.offload`, :meth:`Mapping.restore`): live blocks copied to pinned host memory
and every granule unmapped, then mapped again and the bytes copied back to the same
addresses, so pointers held by TensorRT, CuPy or PyTorch stay valid.

Everything here runs with the tree's lock held, and is all-or-nothing: a growth the device
cannot back unmaps what it mapped and is refused (``device_full``); an offload that fails
leaves the range awake, a restore that fails or is interrupted leaves it asleep, nothing lost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Final

from ..backends import Backend, Reservation
from ..errors import BudgetError, InvariantError, raise_if_from_outside
from ..units import MiB, format_size, round_up

if TYPE_CHECKING:  # only named here: the virtual backends load with a growable root's range
    from ..backends.virtual import Staging, VirtualRange

__all__ = ["DEFAULT_GRANULE", "Asleep", "Mapping", "free_memory", "reserve"]

DEFAULT_GRANULE: Final = 64 * MiB
"""The most a growable root maps at a time (see :func:`granule_for`)."""


class Asleep:
    """A sleeping range: where each live block's bytes wait in host memory."""

    __slots__ = ("staging", "offsets", "nbytes")

    def __init__(self, staging: Staging, offsets: dict[int, int], nbytes: int) -> None:
        self.staging: Final = staging
        self.offsets: Final = offsets  # block address -> offset of its bytes in ``staging``
        self.nbytes: Final = nbytes  # bytes copied there


class Mapping:
    """Which granules of ``memory`` are mapped; see the module docstring. It is also the
    root's reservation (``address``, ``nbytes``, ``release``).

    ``mapped`` (a bytearray, one byte per granule, 1 where mapped), ``asleep``, ``address``
    and ``granule`` are read by the C core's fast path too (``tree.c``): a block whose
    granules are all mapped already, in a range awake, is placed there without calling
    :meth:`admit`; anything else calls the Python methods. Every change to them is made here,
    with the tree's lock held, so both cores see one state."""

    __slots__ = ("memory", "address", "nbytes", "granule", "mapped", "count", "high", "asleep",
                 "errors", "published", "kept", "kept_pinned", "watcher", "door")

    def __init__(self, memory: VirtualRange) -> None:
        self.memory: Final = memory
        self.address: Final = memory.address
        self.nbytes: Final = memory.nbytes
        self.granule: Final = memory.granule
        self.mapped = bytearray(memory.nbytes // memory.granule)  # 1 where mapped
        self.count = 0  # granules mapped now
        self.high = 0  # the most granules mapped at once
        self.asleep: Asleep | None = None
        self.errors: list[str] = []  # unmaps that failed (kept for the report)
        # the host ledger's word for this root's reserved bytes (see hostledger), if any
        self.published: memoryview | None = None
        self.kept: Staging | None = None  # host memory a restore kept for the next offload
        self.kept_pinned = False
        # entered around each granule mapped, where the driver door is loaded: its driver
        # memory is then the root's own there (gpubudget.door.owning); None without the door
        self.door: Callable[[], AbstractContextManager[None]] | None = None
        # told ("map" or "unmap", the granules' indices) after each growth, trim, sleep or
        # wake that changed what is mapped (the root's recorder, for its trace); never on
        # the path of a block whose granules are mapped already
        self.watcher: Callable[[str, list[int]], None] | None = None

    @property
    def mapped_bytes(self) -> int:
        """Bytes of physical memory mapped now."""
        return self.count * self.granule

    @property
    def peak_bytes(self) -> int:
        """The most bytes mapped at once."""
        return self.high * self.granule

    def admit(self, address: int, nbytes: int) -> str | None:
        """Map every granule that ``[address, address + nbytes)`` touches: ``None`` when done,
        else the reason (``asleep``, ``device_full``) and nothing mapped."""
        if self.asleep is not None:
            return "asleep"
        first = (address - self.address) // self.granule
        last = (address + nbytes - 1 - self.address) // self.granule
        mapped = self.mapped
        index = first
        while index <= last and mapped[index]:
            index += 1
        if index > last:
            return None  # the common case: mapped already
        done: list[int] = []
        try:
            for index in range(index, last + 1):
                if not mapped[index]:
                    self._map(index)
                    done.append(index)
        except Exception as exc:  # noqa: BLE001 - the device cannot back it: undo, say so
            self._undo(done)
            raise_if_from_outside(exc)
            self._note(f"growth of {format_size(nbytes)} refused: {type(exc).__name__}: {exc}")
            return "device_full"
        self._tell("map", done)
        return None

    def check(self, taken: Iterable[tuple[int, int]]) -> None:
        """Invariant ``MAPPED``: awake, every granule a taken block touches is mapped, and
        ``count`` is the number mapped; asleep, none is."""
        mapped = set(self._mapped())
        if len(mapped) != self.count:
            raise InvariantError("MAPPED", f"{len(mapped)} granules mapped, {self.count} counted")
        need = set() if self.asleep is not None else self.touched(taken)
        if not need <= mapped or (self.asleep is not None and mapped):
            raise InvariantError("MAPPED", f"granules {sorted(need - mapped)[:8]} are touched "
                                 f"by blocks but not mapped" if need - mapped else
                                 f"{len(mapped)} granules mapped while asleep")

    def touched(self, blocks: Iterable[tuple[int, int]]) -> set[int]:
        """The granules that blocks ``(address, nbytes)`` touch."""
        found: set[int] = set()
        base, granule = self.address, self.granule
        for address, nbytes in blocks:
            found.update(range((address - base) // granule,
                               (address + nbytes - 1 - base) // granule + 1))
        return found

    def trim(self, taken: Iterable[tuple[int, int]]) -> int:
        """Unmap every mapped granule that no block of ``taken`` touches; the bytes freed."""
        keep = self.touched(taken)
        spare = [index for index in self._mapped() if index not in keep]
        return self._unmap(spare) * self.granule

    def offload(self, live: Iterable[tuple[int, int]], pinned: bool = True) -> int:
        """Copy the blocks ``live`` to host memory (page-locked if ``pinned``) and unmap every
        granule; the bytes copied. The error (``MemoryError``, a failed copy) with nothing
        changed if it cannot."""
        blocks = sorted(live)
        total = sum(nbytes for _, nbytes in blocks)
        kept, self.kept = self.kept, None
        if kept is not None and kept.nbytes >= total and self.kept_pinned == pinned:
            staging = kept  # what the last restore kept: no host memory to get (or lock)
        else:
            if kept is not None:
                kept.release()
            staging = self.memory.stage(total, pinned)
        offsets: dict[int, int] = {}
        try:
            offset = 0
            for address, nbytes in blocks:
                self.memory.to_host(staging.address + offset, address, nbytes)
                offsets[address] = offset
                offset += nbytes
        except BaseException:
            staging.release()
            raise
        self.asleep = Asleep(staging, offsets, total)
        self.kept_pinned = pinned
        self._unmap(self._mapped())
        return total

    def restore(self, live: Iterable[tuple[int, int]], keep: bool = False) -> int:
        """Map the granules the blocks ``live`` touch and copy their bytes back to the same
        addresses; the bytes copied. ``keep``: the host memory is kept for the next offload
        (which then need not get, or lock, any). If the device cannot back them, a copy
        fails, or an exception lands meanwhile (a Ctrl-C), what was mapped here is
        unmapped, the range stays asleep, and the exception propagates."""
        asleep = self.asleep
        if asleep is None:
            return 0
        blocks = sorted(live)
        done: list[int] = []
        try:
            for index in sorted(self.touched(blocks)):
                self._map(index)
                done.append(index)
            copied = 0
            for address, nbytes in blocks:
                self.memory.to_device(address, asleep.staging.address + asleep.offsets[address],
                                      nbytes)
                copied += nbytes
        except BaseException:
            self._undo(done)
            raise
        self._tell("map", done)
        self.asleep = None
        if keep:
            self.kept = asleep.staging
        else:
            asleep.staging.release()
        return copied

    @property
    def kept_bytes(self) -> int:
        """Bytes of host memory kept for the next offload (``restore(keep_host=True)``)."""
        return self.kept.nbytes if self.kept is not None else 0

    def release(self) -> None:
        """Give everything back: staging, mappings and the addresses."""
        if self.asleep is not None:
            self.asleep.staging.release()
            self.asleep = None
        if self.kept is not None:
            self.kept.release()
            self.kept = None
        self.memory.release()
        self.count = 0

    def _mapped(self) -> list[int]:
        """The indices of the granules mapped now."""
        mapped = self.mapped
        return [index for index in range(len(mapped)) if mapped[index]]

    def _map(self, index: int) -> None:
        if self.door is not None:
            with self.door():
                self.memory.map(index)
        else:
            self.memory.map(index)
        self.mapped[index] = 1
        self.count += 1
        if self.count > self.high:
            self.high = self.count
        if self.published is not None:
            self.published[0] = self.count * self.granule

    def _undo(self, done: list[int]) -> None:
        """Unmap ``done``, granules just mapped by a growth (or a wake) that failed: the
        watcher hears only of those that stay mapped (an unmap that failed)."""
        self._unmap(done, told=False)
        self._tell("map", [index for index in done if self.mapped[index]])

    def _tell(self, change: str, indices: list[int]) -> None:
        """Tell the watcher that ``indices`` were mapped or unmapped (``change``)."""
        if self.watcher is not None and indices:
            self.watcher(change, indices)

    def _unmap(self, indices: list[int], told: bool = True) -> int:
        """Unmap ``indices`` (mapped granules); how many were. One that fails stays mapped
        (and counted), its error kept for the report. ``told``: the watcher hears of those
        unmapped (not for granules mapped a moment ago by a growth that failed, which it
        never heard of)."""
        unmapped = 0
        gone: list[int] = []
        try:
            for index in indices:
                try:
                    self.memory.unmap(index)
                except Exception as exc:  # noqa: BLE001 - a broken driver: keep going, say so
                    raise_if_from_outside(exc)  # the granules unmapped so far counted first
                    self._note(f"unmapping granule {index} failed: {type(exc).__name__}: {exc}")
                    continue
                self.mapped[index] = 0
                unmapped += 1
                gone.append(index)
        finally:
            self.count -= unmapped
            if self.published is not None:
                self.published[0] = self.count * self.granule
            if told:
                self._tell("unmap", gone)
        return unmapped

    def _note(self, message: str) -> None:
        self.errors.append(message)
        del self.errors[:-16]


def granule_for(limit: int, minimum: int, largest: int = DEFAULT_GRANULE) -> int:
    """The granule a growable root of ``limit`` bytes maps at a time: the largest multiple of
    the device's ``minimum`` (a power of two times it) that divides the limit rounded up to
    ``minimum`` (so that the range never maps more than that), at most ``largest`` and at
    most a sixteenth of the limit (so that a small budget maps in small steps)."""
    whole = round_up(limit, minimum) // minimum
    largest = min(largest, max(minimum, whole * minimum // 16))
    granule = minimum
    while granule * 2 <= largest and whole % 2 == 0:
        granule *= 2
        whole //= 2
    return granule


def reserve(backend: Backend, capacity: int, align: int, name: str,
            initial: int | None) -> tuple[Reservation | Mapping, int]:
    """A root's memory of ``capacity`` bytes starting at a multiple of ``align``, and that
    start: one reservation, or (``initial`` not ``None``) a growable range with ``initial``
    bytes mapped. ``BudgetError`` (with the device's free and total memory) if it cannot."""
    try:
        if initial is not None:
            return _growable(backend, capacity, align, name, initial)
        reservation = backend.reserve(capacity)
        base = round_up(reservation.address, align)
        if base != reservation.address:  # alignment beyond what the backend guarantees
            reservation.release()
            reservation = backend.reserve(capacity + align)
            base = round_up(reservation.address, align)
        return reservation, base
    except BudgetError:
        raise
    except Exception as exc:  # MemoryError, or whatever a backend of the user's raises
        raise_if_from_outside(exc)
        info = free_memory(backend)
        where = (f"{format_size(info[0])} free of {format_size(info[1])} total" if info
                 else "free memory unknown")
        raise BudgetError(
            f"budget {name!r} could not reserve {format_size(capacity)} from the "
            f"{backend.name} backend ({where}): {type(exc).__name__}: {exc}") from exc


def _growable(backend: Backend, capacity: int, align: int, name: str,
              initial: int) -> tuple[Mapping, int]:
    open_range = getattr(backend, "reserve_virtual", None)
    minimum = getattr(backend, "allocation_granularity", None)
    if open_range is None or minimum is None:
        raise BudgetError(f"budget {name!r}: initial= needs a backend that maps memory as it "
                          f"grows, and the {backend.name} backend cannot")
    granule = granule_for(max(capacity, align), int(minimum()))
    mapping = Mapping(open_range(capacity, granule))
    if mapping.address % align:
        mapping.release()
        raise BudgetError(f"budget {name!r}: the reserved addresses start at "
                          f"{mapping.address:#x}, not a multiple of align={align}")
    if initial and mapping.admit(mapping.address, min(initial, capacity)) is not None:
        mapping.release()
        raise MemoryError(f"cannot map the initial {format_size(initial)}: "
                          f"{'; '.join(mapping.errors) or 'out of memory'}")
    return mapping, mapping.address


def free_memory(backend: Backend) -> tuple[int, int] | None:
    """The backend's ``(free, total)`` bytes, or ``None`` if it cannot say."""
    try:
        return backend.mem_info()
    except Exception as exc:  # noqa: BLE001 - the backend's failure: only a statistic
        raise_if_from_outside(exc)
        return None
