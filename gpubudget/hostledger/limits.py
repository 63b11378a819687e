"""Limits on a device's memory set from outside the process, read as the device's size.

A pod, an MPS client or a container may use less of a GPU than the GPU has. Each limit this
module can read:

- ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (NVIDIA MPS, per client): ``"0=1G,1=2G"`` (a limit
  per CUDA ordinal) or ``"2G"`` (every device);
- ``CUDA_DEVICE_MEMORY_LIMIT`` (HAMi-core, per container): ``"10g"`` for every device, or
  ``CUDA_DEVICE_MEMORY_LIMIT_<ordinal>`` for one;
- the cgroup v2 ``dmem`` controller (MPS memory partitions, DRM drivers): ``dmem.max`` of
  this process's cgroup and of each cgroup above it, one ``<region> <bytes|max>`` per line,
  a region being the device's when its name holds the device's PCI bus id or UUID;
- NVML's memory limits (``nvmlDeviceGetMemoryLimits_v1``), where the installed binding has
  them and the driver answers.

Sizes in the variables are a number with an optional unit: ``K``, ``M``, ``G``, ``T``
(powers of 1024, any case, ``B``/``iB`` allowed after them) or a gpubudget size
(``"1.5GiB"``); a bare number is bytes. A value that does not parse is a ``ValueError``
naming the variable and quoting it. The host ledger sizes a root's share and checks its
limit against the smallest of the device's memory and these (:func:`smallest`), as if
that limit were the device's cap: over this process's roots for an MPS limit (one per
client), over every root the ledger sees for the others (a container's or a cgroup's
processes together; in a pod, the ledger's default directory is the pod's own).
``gpubudget top`` says which applied.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..errors import raise_if_from_outside
from ..units import format_size, parse_size

__all__ = ["CGROUP_ROOT", "HAMI_ENV", "MPS_ENV", "OutsideLimit", "Where", "outside_limits",
           "smallest", "where"]

MPS_ENV: Final = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
HAMI_ENV: Final = "CUDA_DEVICE_MEMORY_LIMIT"
CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
_SIZE: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
_POWERS: Final = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_PCI: Final = re.compile(r"([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", re.IGNORECASE)


@dataclass(frozen=True)
class OutsideLimit:
    """``nbytes`` that ``source`` (a variable with its value, or a file with its line) lets
    this process use on the device.

    >>> OutsideLimit(2**30, "CUDA_DEVICE_MEMORY_LIMIT='1g'", "CUDA_DEVICE_MEMORY_LIMIT").text
    "CUDA_DEVICE_MEMORY_LIMIT='1g' (1.00 GiB)"
    """

    nbytes: int
    source: str
    name: str = ""
    """What set it, in short (the variable, ``dmem.max``, ``NVML``): ``gpubudget top``
    shows it."""
    per_process: bool = False
    """It limits each process on its own (MPS), not a group of processes together."""

    @property
    def text(self) -> str:
        return f"{self.source} ({format_size(self.nbytes)})"


@dataclass(frozen=True)
class Where:
    """Where to read limits (tests point these at files and variables they make)."""

    environ: Mapping[str, str] | None = None
    """The environment (default: the process's)."""
    cgroup_root: Path = CGROUP_ROOT
    proc_cgroup: Path = Path("/proc/self/cgroup")
    nvml: Any = None
    """A started ``pynvml`` module to ask (default: none; the ledger passes its own)."""


where = Where()
"""Where the host ledger reads limits (tests replace it)."""


def _size(text: str, what: str) -> int:
    match = _SIZE.fullmatch(text)
    if match is not None:
        return int(float(match[1]) * 1024 ** _POWERS[match[2].lower()])
    try:
        return parse_size(text.strip(), what=what)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: not a size (write bytes, or a number and K, M, G or T "
                         f"such as '2G')") from None


def _mps(environ: Mapping[str, str], ordinal: int | None) -> list[OutsideLimit]:
    text = environ.get(MPS_ENV, "").strip()
    if not text:
        return []
    what = f"{MPS_ENV}={text!r}"
    if "=" not in text:
        return [OutsideLimit(_size(text, what), what, MPS_ENV, per_process=True)]
    found = []
    for item in text.split(","):
        device, sep, value = item.partition("=")
        if not sep or not device.strip().isdigit():
            raise ValueError(f"{what}: {item.strip()!r} is not '<device ordinal>=<size>' "
                             f"(such as '0=1G,1=2G')")
        nbytes = _size(value, what)  # every value checked, whichever device it is for
        if ordinal is not None and int(device) == ordinal:
            found.append(OutsideLimit(nbytes, f"{what} for device {ordinal}", MPS_ENV,
                                      per_process=True))
    return found


def _hami(environ: Mapping[str, str], ordinal: int | None) -> list[OutsideLimit]:
    found = []
    names = [HAMI_ENV] + ([f"{HAMI_ENV}_{ordinal}"] if ordinal is not None else [])
    for name in names:
        text = environ.get(name, "").strip()
        if text:
            found.append(OutsideLimit(_size(text, f"{name}={text!r}"), f"{name}={text!r}",
                                      name))
    return found


def _pci_key(text: str) -> tuple[int, ...] | None:
    match = _PCI.search(text)
    return tuple(int(part, 16) for part in match.groups()) if match else None


def _own_cgroup(where: Where) -> Path | None:
    """This process's cgroup v2 directory (the ``0::`` line of ``/proc/self/cgroup``)."""
    try:
        lines = where.proc_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise_if_from_outside(exc)
        return None
    for line in lines:
        if line.startswith("0::"):
            relative = line[3:].strip().lstrip("/")
            return where.cgroup_root / relative if relative else where.cgroup_root
    return None


def _dmem(where: Where, pci_bus_id: str | None, uuid: str | None) -> list[OutsideLimit]:
    """The device's ``dmem.max`` in this process's cgroup and every cgroup above it."""
    directory = _own_cgroup(where)
    if directory is None or (pci_bus_id is None and uuid is None):
        return []
    wanted = _pci_key(pci_bus_id) if pci_bus_id else None
    found = []
    while True:
        path = directory / "dmem.max"
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise_if_from_outside(exc)
            lines = []
        for line in lines:
            region, _, value = line.strip().rpartition(" ")
            region, value = region.strip(), value.strip()
            if not region or value == "max":
                continue
            ours = (wanted is not None and _pci_key(region) == wanted) or (
                uuid is not None and uuid.lower() in region.lower())
            if ours:
                if not value.isdigit():
                    raise ValueError(f"{path}: {line.strip()!r} is not '<region> <bytes>' or "
                                     f"'<region> max'")
                found.append(OutsideLimit(int(value), f"{path}: {region}", "dmem.max"))
        if directory == where.cgroup_root or where.cgroup_root not in directory.parents:
            return found
        directory = directory.parent


def _nvml(nvml: Any, uuid: str | None) -> list[OutsideLimit]:
    """NVML's hard memory limit of the device, where the binding and the driver have one."""
    ask = getattr(nvml, "nvmlDeviceGetMemoryLimits_v1", None)
    shape = getattr(nvml, "c_nvmlGetMemoryLimits_v1_t", None)
    if nvml is None or uuid is None or ask is None or shape is None:
        return []
    unlimited = getattr(nvml, "NVML_DEVICE_MEMORY_LIMIT_MAX", 2**64 - 1)
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        limits = shape()
        ask(handle, limits)
        hard = int(limits.hardLimit)
    except Exception as exc:  # noqa: BLE001 - NVMLError_NotSupported, a driver without them
        raise_if_from_outside(exc)
        return []
    if hard <= 0 or hard >= unlimited:
        return []
    return [OutsideLimit(hard, "NVML's memory limit (nvmlDeviceGetMemoryLimits_v1)", "NVML")]


def outside_limits(ordinal: int | None, *, pci_bus_id: str | None = None,
                   uuid: str | None = None, where: Where = Where()) -> list[OutsideLimit]:
    """Every limit set from outside on the device of CUDA ``ordinal`` (in this process),
    with PCI bus id ``pci_bus_id`` and UUID ``uuid`` where known; see the module docstring.

    >>> outside_limits(1, where=Where(environ={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G,1=2G",
    ...                                        "CUDA_DEVICE_MEMORY_LIMIT_1": "1536m"}))
    ... # doctest: +NORMALIZE_WHITESPACE
    [OutsideLimit(nbytes=2147483648,
                  source="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='0=1G,1=2G' for device 1",
                  name='CUDA_MPS_PINNED_DEVICE_MEM_LIMIT', per_process=True),
     OutsideLimit(nbytes=1610612736, source="CUDA_DEVICE_MEMORY_LIMIT_1='1536m'",
                  name='CUDA_DEVICE_MEMORY_LIMIT_1', per_process=False)]
    """
    environ = os.environ if where.environ is None else where.environ
    return (_mps(environ, ordinal) + _hami(environ, ordinal)
            + _dmem(where, pci_bus_id, uuid) + _nvml(where.nvml, uuid))


def smallest(total: int, limits: list[OutsideLimit]) -> OutsideLimit | None:
    """The limit that bounds a device of ``total`` bytes: the smallest of ``limits`` if it
    is less than ``total``, else ``None`` (the device's own size applies).

    >>> smallest(8 * 2**30, [OutsideLimit(4 * 2**30, "a"), OutsideLimit(2 * 2**30, "b")])
    OutsideLimit(nbytes=2147483648, source='b', name='', per_process=False)
    >>> smallest(2**30, [OutsideLimit(4 * 2**30, "a")]) is None
    True
    """
    least = min(limits, key=lambda limit: limit.nbytes, default=None)
    return least if least is not None and least.nbytes < total else None
