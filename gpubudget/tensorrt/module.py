"""Which TensorRT module to use: ``tensorrt``, ``tensorrt_rtx`` or ``tensorrt_lean``, or the
bindings alone (``tensorrt_bindings``, ``tensorrt_rtx_bindings``, ``tensorrt_lean_bindings``:
NVIDIA's front-end packages only re-export these).

The oldest TensorRT supported is 10.1: TensorRT 10.0 (and 8.x) lack the sizes that
execution-context memory and weight streaming are built on (:data:`REQUIRED`); such a module
is refused with one line naming what it lacks.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Final

__all__ = ["MODULE_NAMES", "OLDEST", "REQUIRED", "load_module", "module_of", "require_api"]

MODULE_NAMES: Final = ("tensorrt", "tensorrt_bindings", "tensorrt_rtx", "tensorrt_rtx_bindings",
                       "tensorrt_lean", "tensorrt_lean_bindings")
"""The modules tried, in order, when none is named."""
OLDEST: Final = "10.1"
"""The oldest TensorRT version supported."""
REQUIRED: Final = (("ICudaEngine", "device_memory_size_v2"),
                   ("ICudaEngine", "get_device_memory_size_for_profile_v2"),
                   ("ICudaEngine", "weight_streaming_budget_v2"),
                   ("IExecutionContext", "set_device_memory"))
"""What a TensorRT module with an ``ICudaEngine`` must have (TensorRT 10.1 and later do)."""


def load_module(trt_module: ModuleType | str | None = None) -> ModuleType:
    """Return the TensorRT module to use: ``trt_module`` (a module object or its import
    name), else the first importable of :data:`MODULE_NAMES`.

    Raises ``ImportError`` naming every candidate when none can be imported, ``TypeError``
    when ``trt_module`` is neither a module nor a name, and ``ValueError`` when the module has
    no ``IGpuAllocator`` or is older than TensorRT :data:`OLDEST` (the message names what it
    lacks).
    """
    if isinstance(trt_module, ModuleType):
        module = trt_module
    elif isinstance(trt_module, str):
        module = importlib.import_module(trt_module)
    elif trt_module is None:
        module = _first_importable()
    else:
        raise TypeError(f"trt_module must be a module, a module name or None, got {trt_module!r}")
    if not hasattr(module, "IGpuAllocator"):
        raise ValueError(f"module {module.__name__!r} has no IGpuAllocator; is it TensorRT?")
    engine = getattr(module, "ICudaEngine", None)
    lacks = [f"{cls}.{name}" for cls, name in REQUIRED
             if engine is not None and not hasattr(getattr(module, cls, None), name)]
    if lacks:
        version = getattr(module, "__version__", None)
        raise ValueError(f"{module.__name__} {version if isinstance(version, str) else ''}"
                         f" is older than gpubudget supports (TensorRT {OLDEST}): it lacks "
                         + ", ".join(lacks))
    return module


def _first_importable() -> ModuleType:
    errors = []
    for name in MODULE_NAMES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError(
        "no TensorRT module can be imported; tried " + "; ".join(errors) + ". Install TensorRT "
        "(pip install 'gpubudget[trt]' with NVIDIA's index) or TensorRT-RTX "
        "(tensorrt-rtx-cu13-bindings), or pass trt_module="
    )


def module_of(obj: object) -> ModuleType:
    """The TensorRT module ``obj``'s class comes from (skipping gpubudget's subclasses)."""
    for cls in type(obj).__mro__:
        top = cls.__module__.split(".")[0]
        if top not in ("gpubudget", "builtins"):
            return load_module(importlib.import_module(top))
    raise TypeError(f"{obj!r} is not a TensorRT object")


def require_api(obj: object, names: tuple[str, ...], what: str) -> None:
    """Raise ``TypeError``, one line naming what is missing, unless ``obj`` (an engine or a
    context TensorRT made) has every attribute of ``names``: TensorRT 10.0 lacks the ``*_v2``
    sizes, ``weight_streaming_budget_v2`` and ``set_device_memory``."""
    lacks = [name for name in names if not hasattr(obj, name)]
    if lacks:
        raise TypeError(f"{what}: {type(obj).__name__} lacks {', '.join(lacks)} (a TensorRT "
                        f"older than {OLDEST}, the oldest gpubudget supports?)")
