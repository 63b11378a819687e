import logging
from typing import Any

from cuda.bindings import driver as binding  # noqa: F401 - Numba names it so

__all__ = ["CudaAPIError", "CudaDriverError", "Driver", "NumbaCUDAMemoryManager", "binding", "driver",
           "make_logger", "set_memory_manager"]

from numba.cuda import GetIpcHandleMixin, HostOnlyCUDAMemoryManager

class CudaDriverError(Exception): ...

class CudaAPIError(CudaDriverError):
    code: Any
    msg: str
    def __init__(self, code: Any, msg: str) -> None: ...

class NumbaCUDAMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager): ...

def set_memory_manager(mm_plugin: Any) -> None: ...

class Driver:
    def __getattr__(self, fname: str) -> Any: ...

driver: Driver
_memory_manager: type[HostOnlyCUDAMemoryManager] | None
_logger: logging.Logger

def make_logger() -> logging.Logger: ...
