"""Memory backends and how one is chosen.

``get_backend(spec)``: ``spec`` is a :class:`Backend` instance, a name (``"pycuda"`` or
``"host"``), or ``None``. With ``None`` the ``GPUBUDGET_BACKEND`` environment variable
decides, else PyCUDA when a CUDA device is usable, else the host backend with a one-time
``RuntimeWarning`` saying budgets are simulated in host memory. Backends are created once per
name and shared.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Final

from ..callers import user_stacklevel
from ..errors import BackendError, raise_if_from_outside
from .base import Backend, Event, Reservation
from .host import HostBackend

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "Event",
    "HostBackend",
    "Reservation",
    "cuda_usable",
    "current_device",
    "device_of",
    "get_backend",
    "validate_spec",
]

BACKEND_NAMES: Final = ("pycuda", "host")
_ENV: Final = "GPUBUDGET_BACKEND"
_lock = threading.Lock()
_instances: dict[tuple[str, int | None], Backend] = {}
_warned = False


def validate_spec(spec: object, what: str = "backend") -> None:
    """Raise ``TypeError``/``ValueError`` naming ``spec`` if it cannot name a backend."""
    if spec is None or isinstance(spec, Backend):
        return
    if not isinstance(spec, str):
        raise TypeError(
            f"{what} must be None, one of {BACKEND_NAMES} or a Backend object, got {spec!r}"
        )
    if spec not in BACKEND_NAMES:
        raise ValueError(f"{what} {spec!r} is unknown; choose one of {BACKEND_NAMES}")


def _create(name: str, device: int | None) -> Backend:
    if name == "host":
        return HostBackend()
    try:
        from .pycuda import PyCudaBackend

        return PyCudaBackend(device if device is not None else 0)
    except Exception as exc:  # ImportError, cuda.Error, missing libcuda, no such device
        raise_if_from_outside(exc)
        raise BackendError(
            f"the 'pycuda' backend is not usable here for device {device} "
            f"({type(exc).__name__}: {exc}); install PyCUDA (pip install 'gpubudget[cuda]') on "
            f"a machine with a CUDA device, or use backend='host'"
        ) from exc


def _named(name: str, device: int | None) -> Backend:
    """The shared instance for a backend name and device (host memory has no device)."""
    key = (name, None if name == "host" else device)
    with _lock:
        backend = _instances.get(key)
        if backend is None:
            backend = _instances[key] = _create(*key)
        return backend


def cuda_usable() -> bool:
    """Whether PyCUDA imports and sees at least one CUDA device."""
    try:
        import pycuda.driver as cuda

        cuda.init()
        return bool(cuda.Device.count() > 0)
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable CUDA here"
        raise_if_from_outside(exc)
        return False


def current_device() -> int:
    """The CUDA device current in the calling thread (what TensorRT, CuPy and PyTorch use
    there), else 0."""
    try:
        from .pycuda import current_device as current

        return current()
    except Exception as exc:  # noqa: BLE001 - no CUDA here: device 0
        raise_if_from_outside(exc)
        return 0


def get_backend(spec: Backend | str | None = None, *, device: int | None = None) -> Backend:
    """Resolve ``spec`` to a backend instance (see the module docstring).

    ``device``: the CUDA device for a device backend (``None``: the device current in the
    calling thread); host memory belongs to no device and ignores it. A backend object is
    returned as it is, after checking that it is on ``device`` when it says where it is.
    """
    validate_spec(spec)
    if spec is not None and not isinstance(spec, str):
        ordinal = device_of(spec)
        if device is not None and ordinal is not None and ordinal != device:
            raise ValueError(f"backend {spec!r} allocates on device {ordinal}, not on the "
                             f"device={device} asked for")
        return spec
    name = spec or _from_environment() or ("pycuda" if cuda_usable() else _host_fallback())
    if name == "host":
        return _named("host", None)
    return _named(name, device if device is not None else current_device())


def _from_environment() -> str | None:
    env = os.environ.get(_ENV, "").strip()
    if not env:
        return None
    validate_spec(env, what=f"environment variable {_ENV}")
    return env


def _host_fallback() -> str:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "gpubudget: no usable CUDA device or PyCUDA; budgets are simulated in host memory "
            "(pass backend='host' or set GPUBUDGET_BACKEND=host to silence this)",
            RuntimeWarning,
            stacklevel=user_stacklevel(),  # the user's `with` line
        )
    return "host"


def device_of(backend: Backend) -> int | None:
    """The CUDA device ordinal a backend allocates on (its ``ordinal``), ``None`` for
    memory that is not a device's (the host backend)."""
    ordinal = getattr(backend, "ordinal", None)
    return ordinal if isinstance(ordinal, int) else None
