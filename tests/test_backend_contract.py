"""One contract for every memory backend, and for budgets on each of them.

Every backend (host, host without swap reserved, a trace replay's, Ray's simulated GPU; and,
in ``tests/gpu/test_backend_contract_gpu.py``, PyCUDA) is a :class:`Case`, and every test of
this module runs once per case, as RMM runs one suite over every memory resource. A case
says how the test reads and writes the backend's memory from the host. What is checked:

- the protocol: reservations aligned to 256 bytes, writable, never overlapping one another
  while live, released twice without harm; ``copy`` moves bytes; events complete; a request
  no device can meet is a ``MemoryError`` that leaves the backend usable; ``mem_info`` sane;
  reserving and releasing from many threads at once;
- virtual ranges where the backend has them (``reserve_virtual``): granules mapped on
  demand, copied to and from host memory, a failed map changing nothing, released twice;
- budgets on the backend: blocks aligned, inside the root, never overlapping a live block,
  their bytes intact; a moving resize through the backend's ``copy``; exhaustion a denial;
  a double free refused; threads sharing a root; and every failure the backend can have
  (reserve, copy, recording an event, mapping a granule), injected, leaving the tree whole
  (``check()``), nothing half done and nothing lost.
"""

from __future__ import annotations

import ctypes
import dataclasses
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpubudget import Budget, BudgetError, gpu_budget
from gpubudget.backends import Backend
from gpubudget.backends.host import HostBackend
from gpubudget.backends.virtual import _c as host_libc
from gpubudget.ray.simulated import SimulatedGpu
from gpubudget.replay import ReplayBackend

from .helpers import consistent, finishes

__all__ = [
    "Case", "Faulty", "faulty",
    "test_reservations_are_aligned_writable_and_released_twice_without_harm",
    "test_live_reservations_never_overlap",
    "test_copy_moves_bytes", "test_events_complete", "test_mem_info_is_sane",
    "test_a_request_no_device_can_meet_is_a_memory_error",
    "test_threads_reserve_and_release_at_once",
    "test_a_virtual_range_maps_granules_on_demand", "test_a_failed_map_changes_nothing",
    "test_a_granule_outside_the_range_is_refused",
    "test_a_failed_unmap_leaves_the_granule_mapped_and_known",
    "test_blocks_are_aligned_inside_the_root_and_never_overlap",
    "test_a_moving_resize_copies_through_the_backend",
    "test_exhaustion_is_a_denial_and_a_double_free_is_refused",
    "test_threads_share_a_root", "test_a_failed_reserve_leaves_nothing_held",
    "test_a_failed_copy_leaves_the_block_where_it_was",
    "test_a_failed_event_keeps_the_block_live", "test_a_growable_root_grows_and_trims",
    "test_a_failed_growth_is_a_denial",
]

KiB, MiB, GiB = 2**10, 2**20, 2**30


@dataclass
class Case:
    """A backend under test, and how the host writes and reads its memory."""

    name: str
    backend: Backend
    write: Callable[[int, bytes], None]
    read: Callable[[int, int], bytes]
    limit: int = 64 * MiB
    """What a root budget of the tests may take on it."""
    fail_map: Callable[[Any], Callable[[], None]] | None = None
    """Makes a virtual range's maps fail as the device would (out of memory); returns what
    undoes that. ``None`` where the backend has no virtual ranges."""
    fail_unmap: Callable[[Any], Callable[[], None]] | None = None
    """Makes a virtual range's unmaps fail (a broken driver); returns what undoes that."""
    stream: int = 7
    """A stream handle the backend can record an event on."""
    exact_free: bool = False
    """Whether ``mem_info``'s free bytes move only with this process's reservations (a
    device of its own), so that a failure can be seen to leave them as they were."""


def host_write(address: int, data: bytes) -> None:
    ctypes.memmove(address, data, len(data))


def host_read(address: int, nbytes: int) -> bytes:
    return ctypes.string_at(address, nbytes)


def fail_host_map(memory: Any) -> Callable[[], None]:
    """A host range's capacity set to what it maps now: the next map is out of memory."""
    before = memory.capacity
    memory.capacity = memory.mapped

    def undo() -> None:
        memory.capacity = before

    return undo


def fail_host_unmap(memory: Any) -> Callable[[], None]:
    """The C library's ``mprotect`` failing (with ``EINVAL``), as the kernel's may."""
    libc = host_libc()
    real = getattr(libc, "mprotect")

    def failing(*args: Any) -> int:
        ctypes.set_errno(22)
        return -1

    setattr(libc, "mprotect", failing)

    def undo() -> None:
        setattr(libc, "mprotect", real)

    return undo


def cpu_cases(tmp_path: Path) -> dict[str, Case]:
    return {
        "host": Case("host", HostBackend(), host_write, host_read, fail_map=fail_host_map,
                     fail_unmap=fail_host_unmap),
        "host-noreserve": Case("host-noreserve", HostBackend(noreserve=True), host_write,
                               host_read, fail_map=fail_host_map, fail_unmap=fail_host_unmap),
        "replay": Case("replay", ReplayBackend(), host_write, host_read, fail_map=fail_host_map,
                       fail_unmap=fail_host_unmap),
        "ray-simulated": Case("ray-simulated", SimulatedGpu("contract", 1 * GiB,
                                                            directory=tmp_path / "ledger"),
                              host_write, host_read),
    }


@pytest.fixture(params=["host", "host-noreserve", "replay", "ray-simulated"])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Case:
    return cpu_cases(tmp_path)[request.param]


def pattern(seed: int, nbytes: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


# -- the protocol ------------------------------------------------------------------------


def test_reservations_are_aligned_writable_and_released_twice_without_harm(case: Case) -> None:
    assert isinstance(case.backend, Backend) and isinstance(case.backend.name, str)
    ordinal = getattr(case.backend, "ordinal", None)
    assert ordinal is None or (isinstance(ordinal, int) and ordinal >= 0)
    for nbytes in (1, 255, 4097, MiB + 3):
        reservation = case.backend.reserve(nbytes)
        assert reservation.address % 256 == 0 and reservation.nbytes >= nbytes
        data = pattern(nbytes, min(nbytes, 8192))
        case.write(reservation.address + nbytes - len(data), data)  # its last bytes
        assert case.read(reservation.address + nbytes - len(data), len(data)) == data
        reservation.release()
        reservation.release()


def test_live_reservations_never_overlap(case: Case) -> None:
    rng = random.Random(1)
    live = [case.backend.reserve(rng.randrange(1, 2 * MiB)) for _ in range(24)]
    try:
        spans = sorted((r.address, r.address + r.nbytes) for r in live)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans
        for index, reservation in enumerate(live):  # each holds its own bytes
            case.write(reservation.address, pattern(index, 64))
        assert [case.read(r.address, 64) for r in live] == [pattern(i, 64) for i in range(24)]
    finally:
        for reservation in live:
            reservation.release()


def test_copy_moves_bytes(case: Case) -> None:
    source, target = case.backend.reserve(MiB), case.backend.reserve(MiB)
    try:
        data = pattern(7, 100_000)
        case.write(source.address + 5, data)
        case.backend.copy(target.address + 11, source.address + 5, len(data))
        assert case.read(target.address + 11, len(data)) == data
        case.backend.copy(source.address + 200_000, source.address + 5, len(data))  # within one
        assert case.read(source.address + 200_000, len(data)) == data
        case.write(target.address, b"\x01" * 16)
        case.backend.copy(target.address, source.address, 0)  # nothing
        assert case.read(target.address, 16) == b"\x01" * 16
    finally:
        source.release()
        target.release()


def test_events_complete(case: Case) -> None:
    for stream in (0, 1):
        event = case.backend.record_event(stream)
        event.synchronize()
        assert event.query() is True


def test_mem_info_is_sane(case: Case) -> None:
    info = case.backend.mem_info()
    assert info is None or 0 <= info[0] <= info[1], info


def test_a_request_no_device_can_meet_is_a_memory_error(case: Case) -> None:
    with pytest.raises(MemoryError):
        case.backend.reserve(1 << 62)
    reservation = case.backend.reserve(4096)  # still usable
    case.write(reservation.address, b"after")
    assert case.read(reservation.address, 5) == b"after"
    reservation.release()


def test_threads_reserve_and_release_at_once(case: Case) -> None:
    """Eight threads, each reserving, writing its own bytes, checking them and releasing;
    the live reservations of all of them never overlap."""
    lock = threading.Lock()
    live: dict[int, int] = {}  # address -> end
    overlaps: list[tuple[int, int]] = []
    start = threading.Barrier(8)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        start.wait(timeout=60)
        for round_ in range(40):
            reservation = case.backend.reserve(rng.randrange(1, 256 * KiB))
            span = (reservation.address, reservation.address + reservation.nbytes)
            with lock:
                overlaps.extend((a, e) for a, e in live.items() if a < span[1] and span[0] < e)
                live[span[0]] = span[1]
            data = pattern(seed * 100 + round_, 32)
            case.write(reservation.address, data)
            assert case.read(reservation.address, 32) == data
            with lock:
                del live[span[0]]
            reservation.release()

    def run() -> None:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    finishes(run, 120)
    assert overlaps == [] and live == {}


# -- virtual ranges --------------------------------------------------------------------------


def virtual(case: Case) -> Any:
    if case.fail_map is None or not hasattr(case.backend, "reserve_virtual"):
        pytest.skip(f"{case.name}: no virtual ranges (reserve_virtual) on this backend")
    backend: Any = case.backend
    granule = backend.allocation_granularity()
    return backend.reserve_virtual(4 * granule + 1, granule)


def test_a_virtual_range_maps_granules_on_demand(case: Case) -> None:
    memory = virtual(case)
    try:
        granule = memory.granule
        assert memory.nbytes == 5 * granule and memory.address % 256 == 0
        memory.map(3)
        memory.map(0)
        data = pattern(3, 4096)
        staging = memory.stage(4096, False)
        try:
            ctypes.memmove(staging.address, data, 4096)
            memory.to_device(memory.address + 3 * granule + 5, staging.address, 4096)
            assert case.read(memory.address + 3 * granule + 5, 4096) == data
            ctypes.memset(staging.address, 0, 4096)
            memory.to_host(staging.address, memory.address + 3 * granule + 5, 4096)
            assert ctypes.string_at(staging.address, 4096) == data
        finally:
            staging.release()
            staging.release()
        memory.unmap(3)
        memory.map(3)  # again: the granule is the range's to map
        case.write(memory.address + 3 * granule, b"again")
        assert case.read(memory.address + 3 * granule, 5) == b"again"
    finally:
        memory.release()
        memory.release()


def test_a_failed_map_changes_nothing(case: Case) -> None:
    memory = virtual(case)
    try:
        memory.map(0)
        case.write(memory.address, b"kept")
        assert case.fail_map is not None
        free = case.backend.mem_info()
        undo = case.fail_map(memory)
        try:
            with pytest.raises(MemoryError):
                memory.map(1)
        finally:
            undo()
        assert case.read(memory.address, 4) == b"kept"
        if case.exact_free:  # what the failed map took on the way, it gave back
            assert case.backend.mem_info() == free
        memory.map(1)  # mapped once the device has memory again, as if never tried
        case.write(memory.address + memory.granule, b"then")
        assert case.read(memory.address + memory.granule, 4) == b"then"
        memory.unmap(1)
    finally:
        memory.release()


def test_a_granule_outside_the_range_is_refused(case: Case) -> None:
    """The range's own granules only: an index before or past them is an ``IndexError``
    that maps (or unmaps) nothing, never memory beyond the range."""
    memory = virtual(case)
    try:
        count = memory.nbytes // memory.granule
        memory.map(0)
        for index in (-1, count, count + 10):
            with pytest.raises(IndexError, match="granule"):
                memory.map(index)
            with pytest.raises(IndexError, match="granule"):
                memory.unmap(index)
        case.write(memory.address, b"still")
        assert case.read(memory.address, 5) == b"still"
        assert getattr(memory, "mapped", memory.granule) == memory.granule
        memory.unmap(0)
    finally:
        memory.release()


def test_a_failed_unmap_leaves_the_granule_mapped_and_known(case: Case) -> None:
    """A granule whose unmap failed is still mapped, still the range's: its bytes are
    there, unmapping it again works once the device lets it, and releasing frees it."""
    memory = virtual(case)
    try:
        memory.map(1)
        memory.map(2)
        case.write(memory.address + memory.granule, b"held")
        assert case.fail_unmap is not None
        undo = case.fail_unmap(memory)
        try:
            with pytest.raises(MemoryError):
                memory.unmap(1)
        finally:
            undo()
        assert case.read(memory.address + memory.granule, 4) == b"held"
        memory.unmap(1)  # now it goes
        memory.map(1)  # and is the range's to map again
    finally:
        memory.release()
        memory.release()


# -- budgets on the backend --------------------------------------------------------------


def root(case: Case, **options: Any) -> Budget:
    return gpu_budget(options.pop("limit", case.limit), backend=case.backend,
                      name=f"contract-{case.name}", **options)


def test_blocks_are_aligned_inside_the_root_and_never_overlap(case: Case) -> None:
    rng = random.Random(4)
    with root(case, align=512) as pool:
        base = pool.report()
        live: dict[int, tuple[int, bytes]] = {}
        for step in range(400):
            if live and rng.random() < 0.45:
                freed = rng.choice(list(live))
                _, data = live.pop(freed)
                assert case.read(freed, len(data)) == data  # nobody wrote over it
                assert pool.free(freed)
                continue
            size = rng.randrange(1, 512 * KiB)
            alignment = rng.choice((0, 0, 1024, 64 * KiB))
            address = pool.allocate(size, alignment, tag="contract")
            if address is None:
                continue
            assert address % max(512, alignment) == 0
            spans = [(a, a + n) for a, (n, _) in live.items()]
            assert all(address + size <= a or e <= address for a, e in spans)
            data = pattern(step, min(size, 256))
            case.write(address, data)
            live[address] = (size, data)
        consistent(pool)
        for address, (_, data) in live.items():
            assert case.read(address, len(data)) == data
            assert pool.free(address)
        assert pool.used == 0 and base.free_bytes == pool.report().free_bytes


def test_a_moving_resize_copies_through_the_backend(case: Case) -> None:
    with root(case) as pool:
        first = pool.allocate(MiB)
        blocker = pool.allocate(MiB)  # right after it: growing in place is impossible
        assert first is not None and blocker is not None
        data = pattern(9, MiB)
        case.write(first, data)
        moved = pool.resize(first, 3 * MiB)
        assert moved is not None and moved != first
        assert case.read(moved, MiB) == data
        consistent(pool)
        assert pool.free(moved) and pool.free(blocker)


def test_exhaustion_is_a_denial_and_a_double_free_is_refused(case: Case) -> None:
    with root(case) as pool:
        blocks = []
        while (block := pool.allocate(case.limit // 8)) is not None:
            blocks.append(block)
        assert len(blocks) == 8 and pool.allocate(1) is None
        assert pool.report().denied == 2
        assert pool.free(blocks[0]) and not pool.free(blocks[0])
        assert pool.report().invalid_frees == 1
        for block in blocks[1:]:
            assert pool.free(block)
        consistent(pool)
    with pytest.raises(BudgetError), root(case, limit=1 << 60):
        pass  # pragma: no cover - no device holds 1 EiB


def test_threads_share_a_root(case: Case) -> None:
    spans: dict[int, int] = {}
    overlaps: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    with root(case) as pool:
        def work(seed: int) -> None:
            rng = random.Random(seed)
            start.wait(timeout=60)
            mine: list[int] = []
            for _ in range(300):
                if mine and rng.random() < 0.5:
                    freed = mine.pop(rng.randrange(len(mine)))
                    with lock:
                        del spans[freed]
                    assert pool.free(freed)
                    continue
                size = rng.randrange(256, 64 * KiB)
                address = pool.allocate(size)
                if address is not None:
                    with lock:
                        overlaps.extend(a for a, e in spans.items()
                                        if a < address + size and address < e)
                        spans[address] = address + size
                    mine.append(address)
            for address in mine:
                with lock:
                    del spans[address]
                assert pool.free(address)

        def run() -> None:
            threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        finishes(run, 120)
        assert overlaps == [] and spans == {} and pool.used == 0
        consistent(pool)


# -- failures of the backend, injected ---------------------------------------------------


class Faulty:
    """``backend`` (any), whose ``reserve``, ``copy`` or ``record_event`` raises while the
    test says so, and whose stream frees wait on events (as a device's do)."""

    synchronous = False

    def __init__(self, backend: Backend) -> None:
        self.inner = backend
        self.name = backend.name
        self.failing: set[str] = set()
        self.held: list[Any] = []  # reservations handed out

    def __getattr__(self, name: str) -> Any:  # ordinal, ledger_device, reserve_virtual...
        return getattr(self.inner, name)

    def _maybe_fail(self, what: str) -> None:
        if what in self.failing:
            raise (MemoryError if what == "reserve" else RuntimeError)(f"injected: {what}")

    def reserve(self, nbytes: int) -> Any:
        self._maybe_fail("reserve")
        reservation = self.inner.reserve(nbytes)
        self.held.append(reservation)
        return reservation

    def mem_info(self) -> tuple[int, int] | None:
        return self.inner.mem_info()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._maybe_fail("copy")
        self.inner.copy(dst, src, nbytes)

    def record_event(self, stream: int) -> Any:
        self._maybe_fail("record_event")
        return self.inner.record_event(stream)


@pytest.fixture
def faulty(case: Case) -> Iterator[Case]:
    wrapped = Faulty(case.backend)
    yield dataclasses.replace(case, backend=wrapped)
    for reservation in wrapped.held:  # none may be left held by a failure
        released = getattr(reservation, "released", None)
        assert released in (None, True), f"{case.name}: a reservation was left held"


def test_a_failed_reserve_leaves_nothing_held(faulty: Case) -> None:
    wrapped: Faulty = faulty.backend  # type: ignore[assignment]
    wrapped.failing.add("reserve")
    with pytest.raises(BudgetError, match="injected: reserve"), root(faulty):
        pass  # pragma: no cover
    assert wrapped.held == []
    wrapped.failing.clear()
    with root(faulty) as pool:  # the next root enters as if nothing happened
        block = pool.allocate(4096)
        assert block is not None and pool.free(block)


def test_a_failed_copy_leaves_the_block_where_it_was(faulty: Case) -> None:
    wrapped: Faulty = faulty.backend  # type: ignore[assignment]
    with root(faulty) as pool:
        first, blocker = pool.allocate(MiB), pool.allocate(MiB)
        assert first is not None and blocker is not None
        data = pattern(5, 4096)
        faulty.write(first, data)
        used = pool.used
        wrapped.failing.add("copy")
        assert pool.resize(first, 3 * MiB) is None  # the move failed: the old block stands
        wrapped.failing.clear()
        assert pool.used == used and faulty.read(first, 4096) == data
        assert "injected: copy" in " ".join(pool.report().callback_errors)
        consistent(pool)
        assert pool.free(first) and pool.free(blocker) and not pool.free(first)


def test_a_failed_event_keeps_the_block_live(faulty: Case) -> None:
    wrapped: Faulty = faulty.backend  # type: ignore[assignment]
    with root(faulty) as pool:
        block = pool.allocate(4096)
        assert block is not None
        wrapped.failing.add("record_event")
        assert pool.free(block, stream=faulty.stream) is False  # no event: refused
        wrapped.failing.clear()
        assert pool.used == 4096
        consistent(pool)
        assert pool.free(block, stream=faulty.stream) and pool.used == 0
        consistent(pool)


def test_a_growable_root_grows_and_trims(case: Case) -> None:
    virtual(case).release()  # skips where there are no virtual ranges
    with root(case, limit=256 * MiB, initial=0) as pool:
        assert pool.mapped == 0
        blocks = [pool.allocate(3 * MiB) for _ in range(4)]
        assert all(block is not None for block in blocks) and (pool.mapped or 0) > 0
        for index, block in enumerate(blocks):
            assert block is not None
            case.write(block + 3 * MiB - 8, pattern(index, 8))
        for block in blocks[1:]:
            assert block is not None and pool.free(block)
        pool.trim()
        assert blocks[0] is not None
        assert case.read(blocks[0] + 3 * MiB - 8, 8) == pattern(0, 8)
        consistent(pool)
        assert pool.free(blocks[0])


def test_a_failed_growth_is_a_denial(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    virtual(case).release()  # skips where there are no virtual ranges
    opened: list[Any] = []
    reserve_virtual = case.backend.reserve_virtual  # type: ignore[attr-defined]

    def keep(nbytes: int, granule: int) -> Any:
        memory = reserve_virtual(nbytes, granule)
        opened.append(memory)
        return memory

    monkeypatch.setattr(case.backend, "reserve_virtual", keep)
    with root(case, limit=256 * MiB, initial=0) as pool:
        first = pool.allocate(MiB)
        assert first is not None
        mapped = pool.mapped
        assert case.fail_map is not None
        undo = case.fail_map(opened[0])
        try:
            far = pool.allocate(200 * MiB)  # needs granules the device will not map
        finally:
            undo()
        assert far is None and pool.mapped == mapped
        assert any(d.reason == "device_full" for d in pool.report().denials)
        consistent(pool)
        assert pool.free(first)
