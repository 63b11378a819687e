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
from ..errors import BackendError
from .base import Backend, Event, Reservation
from .host import HostBackend

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "Event",
    "Reservation",
    "cuda_usable",
    "device_of",
    "get_backend",
    "validate_spec",
]

BACKEND_NAMES: Final = ("pycuda", "host")
_ENV: Final = "GPUBUDGET_BACKEND"
_lock = threading.Lock()
_instances: dict[str, Backend] = {}
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


def _create(name: str) -> Backend:
    if name == "host":
        return HostBackend()
    try:
        from .pycuda import PyCudaBackend

        return PyCudaBackend()
    except Exception as exc:  # ImportError, cuda.Error, missing libcuda
        raise BackendError(
            f"the 'pycuda' backend is not usable here ({type(exc).__name__}: {exc}); "
            f"install PyCUDA (pip install 'gpubudget[cuda]') on a machine with a CUDA device, "
            f"or use backend='host'"
        ) from exc


def _named(name: str) -> Backend:
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            backend = _instances[name] = _create(name)
        return backend


def cuda_usable() -> bool:
    """Whether PyCUDA imports and sees at least one CUDA device."""
    try:
        import pycuda.driver as cuda

        cuda.init()
        return bool(cuda.Device.count() > 0)
    except Exception:  # noqa: BLE001 - any failure means "no usable CUDA here"
        return False


def get_backend(spec: Backend | str | None = None) -> Backend:
    """Resolve ``spec`` to a backend instance (see the module docstring)."""
    global _warned
    validate_spec(spec)
    if isinstance(spec, str):
        return _named(spec)
    if spec is not None:
        return spec
    env = os.environ.get(_ENV, "").strip()
    if env:
        validate_spec(env, what=f"environment variable {_ENV}")
        return _named(env)
    if cuda_usable():
        return _named("pycuda")
    if not _warned:
        _warned = True
        warnings.warn(
            "gpubudget: no usable CUDA device or PyCUDA; budgets are simulated in host memory "
            "(pass backend='host' or set GPUBUDGET_BACKEND=host to silence this)",
            RuntimeWarning,
            stacklevel=user_stacklevel(),  # the user's `with` line
        )
    return _named("host")


def device_of(backend: Backend) -> int | None:
    """The CUDA device ordinal a backend allocates on (its ``ordinal``), ``None`` for
    memory that is not a device's (the host backend)."""
    ordinal = getattr(backend, "ordinal", None)
    return ordinal if isinstance(ordinal, int) else None
