"""memory.py: a growable range's granules, against a fake range that records and can fail."""

from __future__ import annotations

from typing import Any

import pytest

from gpubudget.backends.virtual import HostStaging
from gpubudget.errors import InvariantError
from gpubudget._core.memory import Mapping, granule_for
from gpubudget.units import KiB, MiB


class FakeRange:
    """A VirtualRange on paper: which granules are mapped, failures on cue."""

    def __init__(self, granules: int, granule: int = 64 * KiB) -> None:
        self.address, self.granule, self.nbytes = 1 << 40, granule, granules * granule
        self.on: set[int] = set()
        self.capacity = granules  # granules that can be mapped at once
        self.fail_copy_after: int | None = None
        self.copies = 0
        self.released = False
        self.staged: list[HostStaging] = []

    def map(self, index: int) -> None:
        assert index not in self.on, "mapped twice"
        if len(self.on) >= self.capacity:
            raise MemoryError("device full")
        self.on.add(index)

    def unmap(self, index: int) -> None:
        self.on.remove(index)

    def release(self) -> None:
        self.released = True

    def stage(self, nbytes: int, pinned: bool = True) -> HostStaging:
        staging = HostStaging(nbytes)
        self.staged.append(staging)
        return staging

    def _copy(self) -> None:
        self.copies += 1
        if self.fail_copy_after is not None and self.copies > self.fail_copy_after:
            raise RuntimeError("copy failed")

    def to_host(self, host: int, device: int, nbytes: int) -> None:
        self._copy()

    def to_device(self, device: int, host: int, nbytes: int) -> None:
        assert all(i in self.on for i in range((device - self.address) // self.granule,
                                                (device + nbytes - 1 - self.address)
                                                // self.granule + 1)), "copy to unmapped"
        self._copy()


def at(fake: FakeRange, granule: int, offset: int = 0) -> int:
    return fake.address + granule * fake.granule + offset


def test_granules_suit_the_limit() -> None:
    assert granule_for(40 * 2**30, 2 * MiB) == 64 * MiB  # big: the largest granule
    assert granule_for(64 * MiB, 2 * MiB) == 4 * MiB  # a sixteenth of a small limit
    assert granule_for(100 * MiB, 2 * MiB) == 4 * MiB  # dividing 100 MiB: never maps more
    assert granule_for(1 * MiB, 2 * MiB) == 2 * MiB  # never under the device's minimum
    assert granule_for(6 * MiB, 2 * MiB) == 2 * MiB


def test_admit_maps_what_a_block_touches_once_and_undoes_a_failed_growth() -> None:
    fake = FakeRange(8)
    mapping = Mapping(fake)
    assert mapping.admit(at(fake, 1, 100), 2 * fake.granule) is None  # granules 1, 2, 3
    assert fake.on == {1, 2, 3} and mapping.mapped_bytes == 3 * fake.granule
    assert mapping.admit(at(fake, 2), 10) is None and fake.on == {1, 2, 3}  # mapped already
    fake.capacity = 4
    assert mapping.admit(at(fake, 4), 2 * fake.granule) == "device_full"  # 4 fits, 5 not
    assert fake.on == {1, 2, 3} and mapping.count == 3  # all or nothing
    assert "refused" in mapping.errors[-1]
    mapping.check([(at(fake, 1, 100), 2 * fake.granule)])
    with pytest.raises(InvariantError, match="MAPPED"):
        mapping.check([(at(fake, 6), 10)])


def test_trim_keeps_exactly_the_granules_blocks_touch() -> None:
    fake = FakeRange(8)
    mapping = Mapping(fake)
    mapping.admit(fake.address, 8 * fake.granule)
    freed = mapping.trim([(at(fake, 2, 10), 20), (at(fake, 5, fake.granule - 1), 2)])
    assert fake.on == {2, 5, 6} and freed == 5 * fake.granule and mapping.count == 3
    assert mapping.peak_bytes == 8 * fake.granule


def test_offload_and_restore_are_all_or_nothing() -> None:
    fake = FakeRange(8)
    mapping = Mapping(fake)
    live = [(at(fake, 0), 100), (at(fake, 3), 2 * fake.granule)]
    for address, nbytes in live:
        mapping.admit(address, nbytes)
    fake.fail_copy_after = 1  # the second block's copy fails: still awake, all mapped
    with pytest.raises(RuntimeError):
        mapping.offload(live)
    assert mapping.asleep is None and fake.on == {0, 3, 4}
    fake.fail_copy_after = None
    assert mapping.offload(live) == 100 + 2 * fake.granule
    assert fake.on == set() and mapping.count == 0 and mapping.admit(at(fake, 0), 1) == "asleep"
    fake.capacity = 2  # the device has less now: restore refused, still asleep, nothing lost
    with pytest.raises(MemoryError):
        mapping.restore(live)
    assert mapping.asleep is not None and fake.on == set()
    fake.capacity = 8
    copy = fake.to_device
    calls: list[int] = []

    def interrupted(device: int, host: int, nbytes: int) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a Ctrl-C lands after the first block's copy
        copy(device, host, nbytes)

    fake.to_device = interrupted
    with pytest.raises(KeyboardInterrupt):
        mapping.restore(live)
    fake.to_device = copy
    assert mapping.asleep is not None and fake.on == set()
    assert mapping.restore(live) == 100 + 2 * fake.granule
    assert mapping.asleep is None and fake.on == {0, 3, 4} and mapping.count == 3
    mapping.release()
    assert fake.released


def test_unmap_errors_are_kept_not_raised() -> None:
    fake: Any = FakeRange(4)
    mapping = Mapping(fake)
    mapping.admit(fake.address, 4 * fake.granule)

    def broken(index: int) -> None:
        raise RuntimeError("driver gone")

    fake.unmap = broken
    assert mapping.trim([]) == 0 and mapping.count == 4
    assert "driver gone" in mapping.errors[-1]


def test_host_memory_kept_by_a_restore_serves_the_next_offload() -> None:
    fake = FakeRange(8)
    mapping = Mapping(fake)
    live = [(at(fake, 0), 100)]
    mapping.admit(*live[0])
    mapping.offload(live)
    mapping.restore(live, keep=True)
    assert len(fake.staged) == 1 and mapping.kept_bytes == 100
    mapping.offload(live)  # no new host memory
    assert len(fake.staged) == 1 and mapping.kept_bytes == 0
    mapping.restore(live, keep=True)
    assert mapping.admit(at(fake, 2), 200) is None
    mapping.offload(live + [(at(fake, 2), 200)])  # more than was kept: new host memory
    assert len(fake.staged) == 2 and fake.staged[0].nbytes == 100
    assert mapping.asleep is not None and mapping.asleep.nbytes == 300
