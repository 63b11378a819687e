"""Every registered budget of the host, read at one moment: what ``top`` and metrics show.

:func:`host_view` reads every ledger file of the directory (changing nothing; the slots of
processes that have ended are left out) and, where NVML answers, joins what each process
holds on each GPU: the memory it holds outside its budgets is NVML's figure less what its
budgets reserved there.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .book import read_book
from .children import ChildBudget
from .files import LedgerDirectory, ledger_directory
from .layout import Entry
from .nvml import GpuProcesses, read_nvml

if TYPE_CHECKING:
    from ..door.shared import DoorShare

__all__ = ["DeviceView", "HostView", "host_view"]


@dataclass(frozen=True)
class DeviceView:
    """One device: what its ledger says, and NVML's per-process figures if any.

    >>> gpu = DeviceView("GPU-1", "NVIDIA H200", 2**37, None, False, (), 0, {4242: 2**30})
    >>> gpu.pids, gpu.outside(4242), gpu.claimed
    ((4242,), 1073741824, 0)
    """

    identity: str
    label: str
    total: int
    cap: int | None
    hard: bool
    entries: tuple[Entry, ...]
    """The root budgets of live processes."""
    ended: int
    """Slots of processes that have ended, not yet cleared (they hold nothing)."""
    used_by: dict[int, int] | None
    """NVML: bytes each process holds on this device in all (``None``: not known)."""
    children: Mapping[int, tuple[ChildBudget, ...]] = field(default_factory=dict)
    """The child budgets of each root that its pages show, by the root's slot
    (:attr:`Entry.slot`), depth first; :attr:`Entry.hidden` says how many more it has."""
    limit: int | None = None
    """A limit set on the device from outside (MPS, HAMi, the cgroup's ``dmem.max``, NVML)
    as the last root to claim there read it; shares and claims are sized within it."""
    limited_by: str = ""
    """What set :attr:`limit`."""
    doors: Mapping[tuple[int, int, int], DoorShare] = field(default_factory=dict)
    """Under the driver door: each budget's numbers from its process's door file
    (:mod:`gpubudget.door.shared`); see :meth:`door_of`."""
    serials: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Each root's children's budget numbers, in the order of :attr:`children`."""

    def door_of(self, entry: Entry, child: ChildBudget | None = None) -> DoorShare | None:
        """What the driver door shows of root ``entry`` (or of its ``child``, one of
        :meth:`children_of`'s), if its process runs under the door and shares its numbers."""
        if child is None:
            return self.doors.get((entry.pid, 1, entry.serial))
        shown, serials = self.children_of(entry), self.serials.get(entry.slot, ())
        index = next((i for i, other in enumerate(shown) if other is child), None)
        if index is None or index >= len(serials):
            return None
        return self.doors.get((entry.pid, 2, serials[index]))

    def children_of(self, entry: Entry) -> tuple[ChildBudget, ...]:
        """``entry``'s child budgets shown, depth first (each with its depth)."""
        return self.children.get(entry.slot, ())

    @property
    def hidden(self) -> int:
        """Child budgets that the ledger has no room to show, on this device."""
        return sum(entry.hidden for entry in self.entries)

    @property
    def claimed(self) -> int:
        return sum(entry.holds for entry in self.entries)

    @property
    def used(self) -> int:
        return sum(entry.used for entry in self.entries)

    @property
    def pids(self) -> tuple[int, ...]:
        """Processes with budgets here, then (NVML) those without, in order of pid."""
        budgeted = sorted({entry.pid for entry in self.entries})
        return (*budgeted, *sorted(set(self.used_by or {}) - set(budgeted)))

    def outside(self, pid: int) -> int | None:
        """What process ``pid`` holds on the device beyond its budgets' reservations
        (NVML's figure less theirs), if NVML knows."""
        if self.used_by is None or pid not in self.used_by:
            return None
        reserved = sum(entry.reserved for entry in self.entries if entry.pid == pid)
        return max(self.used_by[pid] - reserved, 0)

    def as_dict(self) -> dict[str, Any]:
        processes = []
        for pid in self.pids:
            mine = [entry for entry in self.entries if entry.pid == pid]
            processes.append({
                "pid": pid, "process": mine[0].process if mine else None,
                "device_used": None if self.used_by is None else self.used_by.get(pid),
                "outside": self.outside(pid)})
        return {"device": self.identity, "label": self.label, "total": self.total,
                "cap": self.cap, "limit": self.limit, "limited_by": self.limited_by or None,
                "simulated": self.hard, "claimed": self.claimed,
                "used": self.used, "ended_entries": self.ended,
                "budgets": [_entry_dict(self, entry) for entry in self.entries],
                "processes": processes}


def _door_dict(door: DoorShare | None) -> dict[str, Any]:
    """A budget's ``driver_door`` key, only under the driver door."""
    return {} if door is None else {"driver_door": door.as_dict()}


def _entry_dict(device: DeviceView, entry: Entry) -> dict[str, Any]:
    return {"pid": entry.pid, "process": entry.process, "budget": entry.name,
            "state": entry.state, "limit": entry.limit, "share": entry.share,
            "reserved": entry.reserved, "used": entry.used, "peak": entry.peak,
            "free": max(entry.limit - entry.used, 0), "denials": entry.denials,
            "cuda_ordinal": entry.ordinal, **_door_dict(device.door_of(entry)),
            "children": _nested(device, entry), "children_hidden": entry.hidden}


def _nested(device: DeviceView, entry: Entry) -> list[dict[str, Any]]:
    """Children listed depth first (each with its depth) as nested dicts."""
    top: list[dict[str, Any]] = []
    path: list[list[dict[str, Any]]] = [top]  # path[d]: where a child of depth d + 1 goes
    for child in device.children_of(entry):
        item: dict[str, Any] = {"budget": child.name, "limit": child.limit,
                                "reserve": child.reserve, "used": child.used,
                                "peak": child.peak, "free": child.free,
                                **_door_dict(device.door_of(entry, child)),
                                "children": []}
        del path[child.depth:]
        path[-1].append(item)
        path.append(item["children"])
    return top


@dataclass(frozen=True)
class HostView:
    """Every device of a ledger directory at one moment."""

    directory: str
    taken_at: datetime.datetime
    devices: tuple[DeviceView, ...]
    nvml_error: str | None
    """Why NVML's per-process figures are missing, if they are."""

    @property
    def entries(self) -> tuple[Entry, ...]:
        return tuple(entry for device in self.devices for entry in device.entries)

    def as_dict(self) -> dict[str, Any]:
        return {"directory": self.directory, "time": self.taken_at.isoformat(),
                "nvml": self.nvml_error or "ok",
                "devices": [device.as_dict() for device in self.devices]}


def host_view(directory: str | os.PathLike[str] | None = None, *, nvml: bool = True,
              idle: bool = False) -> HostView:
    """Read every ledger file of ``directory`` (default: this process's ledger directory,
    which may not exist yet: then nothing is registered). ``nvml``: join NVML's per-process
    figures where it answers. ``idle``: list devices with no live budget too (GPUs NVML sees
    included), except simulated ones: a simulated device is only as real as the budgets on it,
    and its file, once they are gone, is a leftover of the process that simulated it. A
    missing ``directory`` given here, or a bad file, is a ``LedgerError`` naming it.

    >>> import tempfile
    >>> host_view(tempfile.mkdtemp(), nvml=False).devices
    ()
    """
    path = Path(directory) if directory is not None else ledger_directory()
    gpus, nvml_error = read_nvml() if nvml else ({}, "not asked")
    devices: list[DeviceView] = []
    if directory is not None or os.path.lexists(path):
        opened = LedgerDirectory(path, create=False)
        doors = _doors(path)
        try:
            for name in opened.names():
                snapshot = read_book(opened, name)
                header = snapshot.header
                gpu = gpus.pop(header.identity, None)
                idle_shown = idle and not header.hard  # hard: a simulated device
                if snapshot.entries or idle_shown or (gpu is not None and gpu.used_by):
                    devices.append(DeviceView(
                        header.identity, header.label, header.total, header.cap, header.hard,
                        snapshot.entries, snapshot.ended,
                        gpu.used_by if gpu is not None else None, snapshot.children,
                        header.limit, header.limited_by, doors, snapshot.serials))
        finally:
            opened.close()
    devices.extend(_without_ledger(gpu) for gpu in gpus.values() if idle or gpu.used_by)
    return HostView(str(path), datetime.datetime.now(datetime.timezone.utc), tuple(devices),
                    nvml_error)


def _doors(path: Path) -> dict[tuple[int, int, int], DoorShare]:
    """The door files' numbers (a process under the driver door), none if there are none."""
    from ..door.shared import read_doors  # here: only a directory with door files needs it

    return read_doors(path)


def _without_ledger(gpu: GpuProcesses) -> DeviceView:
    """A GPU that NVML sees and no budget has registered on."""
    return DeviceView(gpu.uuid, gpu.name, gpu.total, None, False, (), 0, gpu.used_by)
