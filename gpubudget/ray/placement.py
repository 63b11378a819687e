"""Where a budgeted actor runs: its GPU, its share of that GPU, the GPU's memory, its limit.

Ray's GPU resources are logical: ``num_gpus=0.5`` schedules two actors on one GPU and limits
nothing. Inside an actor, Ray says which GPU it gave (``ray.get_gpu_ids()``, with
``CUDA_VISIBLE_DEVICES`` set to match) and how much of it (``get_assigned_resources()``); this
module turns that into a CUDA device ordinal, the device's memory and a default limit. The
functions that take plain values are usable (and tested) without Ray.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from ..backends import Backend, cuda_usable, get_backend
from ..errors import GpuBudgetError
from ..hostledger import DEVICE_MEMORY_ENV
from ..units import GiB, MiB, format_size, parse_size
from .simulated import SimulatedGpu

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_MARGIN",
    "DEVICE_MEMORY_ENV",
    "Placement",
    "PlacementError",
    "cuda_ordinal",
    "derived_limit",
    "gpu_share",
    "open_device",
]

BACKEND_ENV: Final = "GPUBUDGET_BACKEND"
DEFAULT_MARGIN: Final = 1 * GiB
"""Bytes of an actor's share of a GPU left outside its default budget: the CUDA context of
its process and what libraries allocate outside budgets (cuBLAS/cuDNN workspaces)."""


class PlacementError(GpuBudgetError, ValueError):
    """A budgeted actor cannot tell which GPU it has, how much of it, or how much memory that
    GPU has; the message says what to change."""


@dataclass(frozen=True)
class Placement:
    """The GPU a budgeted actor was given, and what its budget draws from."""

    node_id: str
    node_ip: str
    gpu_id: str
    """The GPU's id on its node, as Ray names it (``ray.get_gpu_ids()``)."""
    ordinal: int
    """That GPU's CUDA device ordinal in the actor's process."""
    share: float
    """The actor's ``num_gpus``: 0 < share <= 1."""
    device_memory: int
    """Total memory of the GPU in bytes (from CUDA, or ``GPUBUDGET_DEVICE_MEMORY``)."""
    simulated: bool
    """Whether the GPU is simulated in host memory (no CUDA device in the process)."""
    backend: Backend


def gpu_share(resources: Mapping[str, float], who: str) -> float:
    """The actor's share of one GPU from Ray's assigned resources; ``PlacementError`` unless
    ``0 < share <= 1``.

    >>> gpu_share({"CPU": 1.0, "GPU": 0.5}, "actor Model")
    0.5
    >>> gpu_share({"CPU": 1.0}, "actor Model")
    Traceback (most recent call last):
    ...
    gpubudget.ray.placement.PlacementError: actor Model was given no GPU (num_gpus=0): ...
    """
    share = float(resources.get("GPU", 0.0))
    if share <= 0:
        raise PlacementError(
            f"{who} was given no GPU (num_gpus=0): a budget lives on one GPU; create the "
            f"actor with 0 < num_gpus <= 1, e.g. @ray.remote(num_gpus=0.5) or Serve's "
            f"ray_actor_options={{'num_gpus': 0.5}}")
    if share > 1:
        raise PlacementError(
            f"{who} was given num_gpus={share:g}: a budget lives on one GPU, so budgeted() "
            f"supports 0 < num_gpus <= 1; split the model into one actor per GPU")
    return share


def cuda_ordinal(gpu_ids: Sequence[object], visible: str | None, who: str) -> tuple[str, int]:
    """Ray's id of the actor's GPU and its CUDA ordinal in this process.

    Ray sets ``CUDA_VISIBLE_DEVICES`` to the ids of the GPUs it gave, so the ordinal is the
    id's position there; without that variable it is the id itself.

    >>> cuda_ordinal([3], "3", "actor Model")
    ('3', 0)
    >>> cuda_ordinal([1], "0,1", "actor Model")
    ('1', 1)
    >>> cuda_ordinal([2], None, "actor Model")
    ('2', 2)
    """
    if len(gpu_ids) != 1:
        raise PlacementError(f"{who} was given GPUs {list(gpu_ids)!r}; budgeted() supports "
                             f"one GPU per actor (0 < num_gpus <= 1)")
    gpu_id = str(gpu_ids[0])
    entries = [entry.strip() for entry in (visible or "").split(",") if entry.strip()]
    if gpu_id in entries:
        return gpu_id, entries.index(gpu_id)
    if not entries and gpu_id.isdigit():
        return gpu_id, int(gpu_id)
    raise PlacementError(f"{who} was given Ray GPU {gpu_id!r}, which is not in "
                         f"CUDA_VISIBLE_DEVICES={visible!r}; cannot tell which CUDA device "
                         f"it is")


def derived_limit(share: float, device_memory: int, margin: int, who: str) -> int:
    """``share`` of ``device_memory`` less ``margin``, rounded down to a MiB.

    >>> from gpubudget import format_size
    >>> format_size(derived_limit(0.5, 8 * 2**30, 2**30, "actor Model"))
    '3.00 GiB'
    """
    portion = int(share * device_memory)
    limit = (portion - margin) // MiB * MiB
    if limit <= 0:
        raise PlacementError(
            f"{who}: its share {share:g} of the GPU's {format_size(device_memory)} is "
            f"{format_size(portion)}, not more than the {format_size(margin)} margin kept "
            f"for the CUDA context; give it a larger num_gpus, or pass limit= (and margin=)")
    return limit


def open_device(ordinal: int, key: str, who: str) -> tuple[Backend, int, bool]:
    """The backend for CUDA device ``ordinal``, its total memory, and whether it is simulated.

    A real device when PyCUDA sees one (unless ``GPUBUDGET_BACKEND=host``); otherwise a
    :class:`SimulatedGpu` of ``GPUBUDGET_DEVICE_MEMORY`` bytes, shared by the processes of
    this machine that name the same ``key``.
    """
    choice = os.environ.get(BACKEND_ENV, "").strip()
    if choice != "host" and (choice == "pycuda" or cuda_usable()):
        backend = get_backend("pycuda", device=ordinal)
        info = backend.mem_info()
        if info is None:
            raise PlacementError(f"{who}: CUDA device {ordinal} does not report its memory")
        return backend, info[1], False
    text = os.environ.get(DEVICE_MEMORY_ENV, "").strip()
    if not text:
        raise PlacementError(
            f"{who} runs where no CUDA device is usable (no PyCUDA, no device, or "
            f"{BACKEND_ENV}=host) and {DEVICE_MEMORY_ENV} is not set: on GPU nodes install "
            f"PyCUDA (pip install 'gpubudget[cuda]'); for logical GPUs (ray.init(num_gpus=N) "
            f"on a CPU machine) set {DEVICE_MEMORY_ENV} to each GPU's memory, e.g. "
            f"{DEVICE_MEMORY_ENV}=8GiB")
    try:
        total = parse_size(text, what=DEVICE_MEMORY_ENV)
    except (TypeError, ValueError) as exc:
        raise PlacementError(f"{who}: {exc}") from None
    return SimulatedGpu(key, total), total, True
