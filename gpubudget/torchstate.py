"""What :mod:`gpubudget.torch` keeps or sets for the whole process: the ``MemPool``\\ s it
made (kept for ever), the C function PyTorch calls to free a segment, the allocator setting
that keeps Python out of PyTorch's allocator lock, which pool each thread routes into, and the
cuBLAS/cuBLASLt workspaces made outside every budget.

Why MemPools are kept. PyTorch 2.11 aborts the process when a ``MemPool`` is destroyed while
any thread routes into a pool (``~MemPool`` empties the pool's cache, which asserts that no
routing is under way), and also when one is destroyed after PyTorch has freed its last
segment. No destructor of a ``MemPool`` made here ever runs: each gets one reference that is
never given back, so neither normal code nor interpreter teardown deallocates it. Once its
budget is done with it, a pool is *retired* instead (``torch._C._cuda_releasePool``), which
lets ``torch.cuda.empty_cache()`` free its segments; the object itself stays (small: see
``docs/frameworks.md``).

Why PyTorch never calls Python with its lock held. PyTorch calls a pool's allocator with its
allocator lock held, unless ``release_lock_on_cudamalloc`` is set, and always frees a segment
with it held. A Python callback there waits for the GIL, while a thread that holds the GIL may
be waiting for that lock (``torch._C._cuda_beginAllocateCurrentThreadToPool``,
``torch.cuda.memory_stats()``, ``memory_snapshot()`` take it without releasing the GIL): a
deadlock. So gpubudget sets ``release_lock_on_cudamalloc`` (keeping every other setting), and
hands PyTorch, as the function that frees a segment, a C function that does nothing:
``gpubudget.torch`` gives the segment back to its budget once PyTorch's snapshot no longer
lists it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from typing import Any, Final

__all__ = ["clear_workspaces", "has_workspaces", "inert_free_address", "kept_for_ever",
           "make_workspaces", "mempools_kept", "release_lock_on_malloc", "routed_mempool",
           "routes", "workspace_bytes"]

_count_lock = threading.Lock()
_kept_count = [0]
_LOCK_SETTING: Final = "release_lock_on_cudamalloc"
_settings_lock = threading.Lock()
_settings_done: list[bool] = [False]


def kept_for_ever(mempool: Any) -> Any:
    """``mempool``, given one reference that is never released: its destructor never runs."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(mempool))
    with _count_lock:
        _kept_count[0] += 1
    return mempool


def mempools_kept() -> int:
    """How many ``torch.cuda.MemPool`` objects :mod:`gpubudget.torch` has made in this
    process; none is ever destroyed (PyTorch 2.11 can abort the process when one is).

    Each stays in host memory for the rest of the process (``python3 -m scripts.soak
    --measure N`` measures how much): a server that loads and unloads models makes one per
    model and per thread routing into it at once, and one more each time
    :func:`gpubudget.torch.release_cached` retires an idle pool that caches something.

    Examples
    --------
    >>> from gpubudget.torch import mempools_kept
    >>> mempools_kept() >= 0
    True
    """
    with _count_lock:
        return _kept_count[0]


def _no_op_in_c() -> int | None:
    """The address of a C function that takes no argument, changes nothing and needs no
    GIL (``pthread_self``): called with PyTorch's four arguments it ignores them (every
    calling convention Linux uses passes them in registers the callee may ignore)."""
    try:
        function = ctypes.CDLL(None).pthread_self
    except (OSError, AttributeError):
        return None
    address: int | None = ctypes.cast(function, ctypes.c_void_p).value
    return address


_FREE: Final = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_void_p)
_python_no_op = _FREE(lambda address, size, device, stream: None)  # where no C one is found
_INERT: Final = _no_op_in_c() or ctypes.cast(_python_no_op, ctypes.c_void_p).value


def inert_free_address() -> int:
    """What PyTorch calls to free a segment of gpubudget's pools: a function that does
    nothing (a C one where the C library is found), so that no Python runs there."""
    assert _INERT is not None
    return _INERT


def _set_settings(torch: Any, memory: Any, text: str) -> None:
    """PyTorch's allocator settings set to ``text``: through the accelerator-wide call where
    PyTorch has it (2.11 deprecates ``torch.cuda.memory._set_allocator_settings`` with a
    ``FutureWarning`` that would reach the user), else the CUDA one, its warning kept quiet."""
    accelerator = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if accelerator is not None:
        accelerator(text)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        memory._set_allocator_settings(text)


def release_lock_on_malloc(torch: Any) -> None:
    """Once per process: make PyTorch release its allocator lock while it calls a pool's
    allocator (``release_lock_on_cudamalloc:True``), keeping the settings made before. A
    PyTorch that refuses gets a warning: threads routing at once may then deadlock."""
    with _settings_lock:
        if _settings_done[0]:
            return
        _settings_done[0] = True
        memory: Any = getattr(torch.cuda, "memory", None)
        try:
            settings = memory._snapshot()["allocator_settings"]
            if settings.get(_LOCK_SETTING):
                return
            before = str(settings.get("PYTORCH_CUDA_ALLOC_CONF") or "")
        except Exception:  # noqa: BLE001 - an older snapshot: what the environment set
            before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get(
                "PYTORCH_ALLOC_CONF") or ""
        wanted = ",".join(part for part in (before, f"{_LOCK_SETTING}:True") if part)
        try:
            _set_settings(torch, memory, wanted)
        except Exception as exc:  # noqa: BLE001 - said, and routing goes on
            warnings.warn(f"gpubudget.torch could not set PyTorch's {_LOCK_SETTING} "
                          f"({type(exc).__name__}: {exc}); threads allocating in budgets "
                          f"while others route may deadlock", RuntimeWarning, stacklevel=4)


# -- which MemPool each thread routes into ---------------------------------------------------

_threads = threading.local()  # .routes: [(pool, mempool id)], innermost last


def routes() -> list[tuple[object, tuple[int, int]]]:
    """The calling thread's routes, innermost last: (gpubudget's pool, MemPool id)."""
    found: list[tuple[object, tuple[int, int]]] | None = getattr(_threads, "routes", None)
    if found is None:
        found = _threads.routes = []
    return found


def routed_mempool(pool: object) -> tuple[int, int] | None:
    """The MemPool of ``pool`` the calling thread routes into, innermost (where PyTorch puts
    what the thread allocates), or ``None``."""
    for owner, mempool in reversed(routes()):
        if owner is pool:
            return mempool
    return None


# -- library workspaces, outside budgets -----------------------------------------------------

_workspace_lock = threading.Lock()
_workspace_pools: dict[int, Any] = {}  # device -> the MemPool holding workspaces made here
_made = threading.local()  # .streams: {(device, stream)} whose workspaces this thread made
_generation = [0]  # bumped when cuBLAS's workspaces are cleared: all must be made again


def _streams_made() -> set[tuple[int, int]]:
    """(device, stream) pairs whose workspaces this thread has made (and still has)."""
    made: set[tuple[int, int]] | None = getattr(_made, "streams", None)
    if made is None or getattr(_made, "generation", -1) != _generation[0]:
        made = _made.streams = set()
        _made.generation = _generation[0]
    return made


def has_workspaces(device: int, stream: int) -> bool:
    return (device, stream) in _streams_made()


def make_workspaces(torch: Any, device: int) -> None:
    """Make this thread's cuBLAS and cuBLASLt workspaces for its current stream on
    ``device``, in gpubudget's workspace pool, unless made already."""
    stream = int(torch.cuda.current_stream(device).cuda_stream)
    made = _streams_made()
    if (device, stream) in made:
        return
    from .door import outside_budgets

    # the workspaces are library memory outside budgets (the report says so); under the
    # driver door too, where a reserved root would refuse them
    with _workspace_lock, outside_budgets():  # one thread at a time routes into the pool
        mempool = _workspace_pools.get(device)
        if mempool is None:
            mempool = _workspace_pools[device] = kept_for_ever(torch.cuda.MemPool())
        with torch.cuda.device(device):
            torch._C._cuda_beginAllocateCurrentThreadToPool(device, mempool.id)
            try:
                a = torch.ones((16, 16), device=device, dtype=torch.bfloat16)
                torch.addmm(a[0], a, a)  # an addmm with a bias: cuBLASLt's workspace
                torch._C._cuda_getCurrentBlasHandle()  # cuBLAS's workspace
                del a
            finally:
                torch._C._cuda_endAllocateToPool(device, mempool.id)
                torch._C._cuda_releasePool(device, mempool.id)
    made.add((device, stream))


def clear_workspaces(torch: Any) -> None:
    """Clear PyTorch's cuBLAS workspaces (made again at next use), safe while others route."""
    with _workspace_lock:
        torch._C._cuda_clearCublasWorkspaces()
        _generation[0] += 1


def workspace_bytes(device: int) -> int:
    """Bytes of cuBLAS/cuBLASLt workspaces that ``allocations`` made outside budgets on
    ``device`` (PyTorch keeps one per thread and stream)."""
    mempool = _workspace_pools.get(device)
    if mempool is None:
        return 0
    return sum(int(segment.get("allocated_size", 0)) for segment in mempool.snapshot())
