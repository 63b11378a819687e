"""What NVML says each process holds on each GPU (optional: ``nvidia-ml-py``).

The ledger knows what each process's budgets reserved; NVML knows what each process holds
on the device in all (its CUDA context, libraries' workspaces, other allocators). The
difference is the memory a process holds outside its budgets. Where ``pynvml`` is not
importable or NVML does not start (no driver), :func:`read_nvml` says why and the views show
no such column. NVML's pids are the host's: inside a container without the host's PID
namespace they may not match the ledger's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import raise_if_from_outside

__all__ = ["GpuProcesses", "read_nvml", "started"]

_lock = threading.Lock()
_started: list[Any] = []  # the pynvml module, once nvmlInit() has worked


@dataclass(frozen=True)
class GpuProcesses:
    """One GPU as NVML sees it: its UUID, name, memory, and bytes used by each pid."""

    uuid: str
    name: str
    total: int
    used_by: dict[int, int] = field(default_factory=dict)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _module() -> Any:
    """pynvml, initialized once per process; raises with the reason where it cannot be."""
    with _lock:
        if not _started:
            import pynvml

            pynvml.nvmlInit()
            _started.append(pynvml)
        return _started[0]


def started() -> Any:
    """pynvml, started, or ``None`` where it is not installed or NVML does not start."""
    try:
        return _module()
    except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, ...
        raise_if_from_outside(exc)  # a root's entry asks: a signal handler's propagates
        return None


def read_nvml() -> tuple[dict[str, GpuProcesses], str | None]:
    """Every GPU NVML sees, by UUID, with the memory each process uses there; or nothing and
    the reason NVML cannot be read here."""
    try:
        nvml = _module()
    except ImportError:
        return {}, "nvidia-ml-py is not installed (pip install 'gpubudget[nvml]')"
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return {}, f"NVML is not usable here: {exc}"
    found: dict[str, GpuProcesses] = {}
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            used_by: dict[int, int] = {}
            for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                memory = getattr(process, "usedGpuMemory", None)
                if isinstance(memory, int):
                    used_by[int(process.pid)] = used_by.get(int(process.pid), 0) + memory
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            found[uuid] = GpuProcesses(uuid, _text(nvml.nvmlDeviceGetName(handle)),
                                       int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                                       used_by)
    except Exception as exc:  # noqa: BLE001 - a GPU lost meanwhile, a permission refused
        return found, f"NVML stopped answering: {exc}"
    return found, None
