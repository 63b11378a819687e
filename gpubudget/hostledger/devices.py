"""Which device a backend's memory is, as the host ledger names it.

- The PyCUDA backend: the GPU's UUID (``GPU-8f3c…``, as ``nvidia-smi -L`` and NVML write it,
  so it is the same in every process whatever ``CUDA_VISIBLE_DEVICES`` says), its name, its
  total memory, and a reading of its free memory.
- The host backend (machines without a GPU, tests): ``host``. With
  ``GPUBUDGET_DEVICE_MEMORY`` set (``8GiB``) it stands for a GPU of that size: roots on it,
  in all processes together, must fit in it. Without it, its total is the machine's memory
  and it enforces nothing beyond what the operating system does.
- Any backend with a ``ledger_device()`` method (Ray's simulated GPUs).

Other backends (a trace replay, a user's own) are not registered.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..backends import Backend, HostBackend
from ..errors import raise_if_from_outside
from ..units import format_size, parse_size

__all__ = ["DEVICE_MEMORY_ENV", "HOST_IDENTITY", "LedgerDevice", "device_for", "host_device"]

DEVICE_MEMORY_ENV: Final = "GPUBUDGET_DEVICE_MEMORY"
"""Environment variable: the memory of a GPU simulated in host memory, e.g. ``8GiB``."""
HOST_IDENTITY: Final = "host"


@dataclass(frozen=True)
class LedgerDevice:
    """A device as the ledger knows it.

    >>> LedgerDevice("host", "host memory", 2**30, hard=True).label
    'host memory'
    """

    identity: str
    """Names the device's file: a GPU's UUID, ``host``, or a simulated GPU's key."""
    label: str
    """What ``gpubudget top`` shows beside the identity."""
    total: int
    hard: bool
    """Claims must fit ``total`` (nothing else would stop them: a simulated device)."""
    ordinal: int | None = None
    """The CUDA ordinal of the device in this process."""
    free: Callable[[], int | None] | None = None
    """Reads the device's free memory now (a device call), if the device can say."""
    directory: Path | None = None
    """A ledger directory for this device alone (else the process's)."""
    pci_bus_id: str | None = None
    """The GPU's PCI bus id (``0000:03:00.0``), where known: the cgroup's ``dmem`` files
    name devices by it."""


def host_device() -> LedgerDevice:
    """The host backend's device (see the module docstring); ``ValueError`` naming
    ``GPUBUDGET_DEVICE_MEMORY`` if it does not parse."""
    text = os.environ.get(DEVICE_MEMORY_ENV, "").strip()
    if text:
        try:
            total = parse_size(text, what=DEVICE_MEMORY_ENV)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"environment variable {exc}") from None
        return LedgerDevice(HOST_IDENTITY, f"host memory (a simulated GPU of {format_size(total)})",
                            total, hard=True)
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError) as exc:  # pragma: no cover - platforms without these names
        raise_if_from_outside(exc)
        total = 0
    return LedgerDevice(HOST_IDENTITY, "host memory", total, hard=False)


def device_for(backend: Backend) -> LedgerDevice | None:
    """The device ``backend`` allocates on, or ``None`` if it is not one the ledger knows.

    >>> from gpubudget.backends import HostBackend
    >>> device_for(HostBackend()).identity
    'host'
    """
    describe = getattr(backend, "ledger_device", None)
    if callable(describe):
        device: LedgerDevice = describe()
        return device
    if type(backend) is HostBackend:  # not a subclass such as a trace replay's
        return host_device()
    if not callable(getattr(backend, "device_uuid", None)):
        return None
    known = _gpus.get(backend)
    if known is None:  # a GPU's identity and size never change: asked of the driver once
        known = _gpus[backend] = _gpu(backend)
    return known


_gpus: Final[weakref.WeakKeyDictionary[Backend, LedgerDevice | None]] = (
    weakref.WeakKeyDictionary())


def _gpu(backend: Backend) -> LedgerDevice | None:
    info = backend.mem_info()
    if info is None:
        return None
    ordinal = getattr(backend, "ordinal", None)
    named = getattr(getattr(backend, "device", None), "name", None)
    label = str(named()) if callable(named) else "CUDA device"
    bus = getattr(getattr(backend, "device", None), "pci_bus_id", None)

    def free() -> int | None:
        reading = backend.mem_info()
        return reading[0] if reading else None

    return LedgerDevice(str(getattr(backend, "device_uuid")()), label, info[1], hard=False,
                        ordinal=ordinal if isinstance(ordinal, int) else None, free=free,
                        pci_bus_id=str(bus()) if callable(bus) else None)
