"""The driver door on a CUDA machine, against the real libraries: what each charges, refuses
and leaves outside, measured beside what NVML says the process holds.

    python -m scripts.door_gpu all [--only PART,...]   every part, each in a process of its own,
                                                      under the door and (where it says) without
    gpubudget run -- python -m scripts.door_gpu PART   one part, under the door

Parts: ``torch`` (convolutions and matmuls: cuBLAS/cuBLASLt/cuDNN workspaces), ``jax-platform``
(``XLA_PYTHON_CLIENT_ALLOCATOR=platform``), ``jax-prealloc`` (JAX's default preallocation,
sized by the budget's ``cuMemGetInfo``), ``nccl`` (``torch.distributed``, world size 1, an
all-reduce), ``cupy`` (its pool off: raw ``cudaMalloc``), ``numba`` (device arrays),
``tensorrt`` (the lean runtime with a budget's allocator attached), ``cost`` (a hooked
``cuMemAlloc_v2`` + ``cuMemFree_v2`` pair against the driver's own, in one process),
``serve`` (loading a model and serving batches, timed, with and without the door; name it
several times in ``--only`` to interleave runs).

Each part creates the CUDA context outside every budget first and reads NVML then (the
baseline); "NVML" below is the process's device memory less that baseline. Every part prints
its findings as lines starting with ``|`` (a table row) or ``>`` (a note); a part that fails
prints its traceback and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30
ROOT_LIMIT = "40GiB"


def need(name: str) -> Any:
    """A module of a GPU library, untyped (they ship no stubs here)."""
    return importlib.import_module(name)


# -- measuring ---------------------------------------------------------------------------------

class Nvml:
    """The process's device memory as NVML reports it (its own entry among the compute
    processes where NVML lists it, else the device's used memory)."""

    def __init__(self) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.base = 0

    def used(self) -> int:
        try:
            for proc in self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except self.nv.NVMLError:
            pass
        return int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).used)

    def mark(self) -> int:
        self.base = self.used()
        return self.base

    def since(self) -> int:
        return self.used() - self.base


def context() -> None:
    """Device 0's primary context, current in this thread, made through the driver (no
    allocation: nothing for the door)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0, "cuInit failed"
    device = ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    ctx = ctypes.c_void_p()
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f} MiB"


def door_line(budget: Any) -> str:
    from gpubudget import door

    n = door.numbers(budget)
    if n is None:
        return "no door numbers (the door is not loaded)"
    libs = ", ".join(f"{lib.name} {mib(lib.live_bytes)}" + (f" ({lib.refusals} refused)"
                                                             if lib.refusals else "")
                     for lib in n.libraries) or "none"
    last = (f"; last refused {mib(n.last_refused)} asked by {n.last_refused_by}"
            if n.refusals else "")
    return (f"held {mib(n.held)} (foreign {mib(n.foreign)}, the root's own {mib(n.own)}), "
            f"peak {mib(n.peak)}, refused {n.refusals}{last}; by library: {libs}")


def outside_line() -> str:
    from gpubudget import door

    seen = door.outside()
    if seen is None:
        return "the door is not loaded"
    total, libraries = seen
    return f"{mib(total)}: " + (", ".join(f"{lib.name} {mib(lib.live_bytes)}"
                                          for lib in libraries) or "none")


def row(*cells: object) -> None:
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def note(text: str) -> None:
    print("> " + text, flush=True)


def compare(what: str, nvml: Nvml, budget: Any) -> None:
    """One table row: NVML's bytes since the baseline against the door's charge of ``budget``
    (the foreign bytes: a growable root's own granules are not what a library took)."""
    from gpubudget import door

    n = door.numbers(budget)
    charged = None if n is None else n.foreign
    seen = nvml.since()
    gap = None if charged is None else seen - charged
    row(what, mib(seen), mib(charged), mib(gap),
        "-" if not charged else f"{seen / charged:.3f}")


def table_head() -> None:
    row("moment", "NVML since baseline", "charged by the door", "NVML - charged", "ratio")
    row("---", "---:", "---:", "---:", "---:")


@contextlib.contextmanager
def root_budget(name: str = "root") -> Iterator[Any]:
    """A growable root on the device (``initial=0``), the kind the door's docs say to give a
    model whose libraries allocate for themselves; where it cannot be entered, a root on the
    host backend (its limit still covers the door's bytes), saying so."""
    from gpubudget import gpu_budget

    stack = contextlib.ExitStack()
    try:
        budget = stack.enter_context(gpu_budget(ROOT_LIMIT, initial=0, name=name))
    except Exception as exc:  # noqa: BLE001 - reported, then the host root is tried
        note(f"a growable device root could not be entered ({type(exc).__name__}: {exc}); "
             "on a host-backend root instead")
        budget = stack.enter_context(gpu_budget(ROOT_LIMIT, backend="host", name=name))
    with stack:
        yield budget


def neighbour(root: Any, work: Callable[[], object], name: str = "neighbour",
              limit: str = "4GiB") -> tuple[threading.Thread, dict[str, Any]]:
    """A thread with a budget of its own under ``root``, running ``work`` while the caller's
    budget is refused; its result and its door line come back in the dict."""
    from gpubudget import gpu_budget

    result: dict[str, Any] = {}
    start = threading.Event()

    def run() -> None:
        try:
            with gpu_budget(limit, name=name, parent=root) as mine:
                start.set()
                result["value"] = work()
                result["door"] = door_line(mine)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            result["error"] = f"{type(exc).__name__}: {exc}"
            start.set()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    start.wait(60)
    return thread, result


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {text[0] if text else ''}"[:300]


# -- the parts -----------------------------------------------------------------------------------

def part_torch() -> None:
    torch = need("torch")

    from gpubudget import gpu_budget

    context()
    torch.cuda.init()
    nvml = Nvml()
    nvml.mark()
    note(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; baseline "
         f"(context, before any budget): NVML {mib(nvml.base)}")
    torch.manual_seed(0)
    table_head()
    with root_budget() as root:
        with gpu_budget("16GiB", name="torch-model") as model:
            net = torch.nn.Sequential(
                torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                torch.nn.Linear(128, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1000),
            ).cuda().eval()
            x = torch.randn(64, 3, 224, 224, device="cuda")
            with torch.no_grad():
                for _ in range(3):
                    y = net(x)
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            m = a @ a
            torch.cuda.synchronize()
            compare("conv net + bf16 matmul, in the budget", nvml, model)
            note(f"torch-model: {door_line(model)}")
            note(f"torch's own count: allocated {mib(torch.cuda.memory_allocated())}, "
                 f"reserved {mib(torch.cuda.memory_reserved())}")
            checksum = float(y.float().sum()) + float(m.float().sum())
            del net, x, y, a, m
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            compare("after empty_cache, in the budget", nvml, model)
        note(f"checksum {checksum:.6e} (compare with the run without the door)")

        with gpu_budget("1GiB", name="small") as small:
            thread, result = neighbour(root, lambda: torch.ones(512 * MiB // 4,
                                                                device="cuda").sum().item())
            try:
                big = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
                note(f"NOT refused: 2 GiB in a 1 GiB budget ({big.numel()} bytes)")
                del big
            except torch.OutOfMemoryError as exc:
                note(f"2 GiB in a 1 GiB budget refused: {first_line(exc)}")
            thread.join()
            note(f"small: {door_line(small)}")
            note(f"neighbour thread (own 4 GiB budget, 512 MiB tensor) at the same time: "
                 f"{result}")
        torch.cuda.empty_cache()
        print(root.report(), flush=True)
    note(f"outside every budget: {outside_line()}")


def part_jax(mode: str) -> None:
    from gpubudget import gpu_budget

    context()
    nvml = Nvml()
    nvml.mark()
    note(f"mode {mode}: XLA_PYTHON_CLIENT_ALLOCATOR={os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR')}"
         f", XLA_PYTHON_CLIENT_PREALLOCATE={os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')}; "
         f"baseline NVML {mib(nvml.base)}")
    table_head()
    limit = "8GiB"
    with root_budget() as root:
        with gpu_budget(limit, name="jax-model") as model:
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            rc = ctypes.CDLL("libcuda.so.1").cuMemGetInfo_v2(ctypes.byref(free),
                                                              ctypes.byref(total))
            note(f"cuMemGetInfo_v2 in the budget, before JAX starts: rc {rc}, free "
                 f"{mib(free.value)}, total {mib(total.value)}")
            jax = need("jax")
            jnp = need("jax.numpy")

            note(f"jax {jax.__version__}, devices {jax.devices()}")
            key = jax.random.PRNGKey(0)
            k1, k2, k3 = jax.random.split(key, 3)
            w1 = jax.random.normal(k1, (4096, 4096), jnp.float32) * 0.01
            w2 = jax.random.normal(k2, (4096, 1000), jnp.float32) * 0.01
            xs = jax.random.normal(k3, (1024, 4096), jnp.float32)

            def forward(x: Any) -> Any:
                return jnp.tanh(x @ w1) @ w2

            mlp = jax.jit(forward)

            out = mlp(xs).block_until_ready()
            compare(f"MLP from random weights, in a {limit} budget", nvml, model)
            note(f"jax-model: {door_line(model)}")
            note(f"checksum {float(out.sum()):.6e}")

            # past the limit: an array larger than what the budget has left
            def torch_neighbour() -> object:
                import numpy as np

                context()
                cuda = ctypes.CDLL("libcuda.so.1")
                ptr = ctypes.c_uint64()
                rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(512 * MiB))
                if rc == 0:
                    cuda.cuMemFree_v2(ptr)
                return f"cuMemAlloc_v2 of 512 MiB answered {rc}; numpy {np.__version__}"

            thread, result = neighbour(root, torch_neighbour)
            try:
                big = jnp.ones((3 * GiB,), jnp.float32).block_until_ready()  # 12 GiB
                note(f"NOT refused: 12 GiB in an {limit} budget ({big.size})")
                del big
            except Exception as exc:  # noqa: BLE001 - JAX's error is what is reported
                note(f"12 GiB in an {limit} budget refused: {first_line(exc)}")
            thread.join()
            note(f"jax-model after the refusal: {door_line(model)}")
            note(f"neighbour thread (own budget, a 512 MiB driver allocation) meanwhile: {result}")
            del w1, w2, xs, out
            jax.clear_caches()
            for buffer in jax.live_arrays():
                buffer.delete()
            compare("JAX's arrays deleted (its pool may keep them)", nvml, model)
        print(root.report(), flush=True)
    note(f"outside every budget: {outside_line()}")


def part_nccl() -> None:
    torch = need("torch")
    dist = need("torch.distributed")

    from gpubudget import gpu_budget

    context()
    torch.cuda.init()
    torch.cuda.set_device(0)
    nvml = Nvml()
    nvml.mark()
    note(f"baseline NVML {mib(nvml.base)}; NCCL {torch.cuda.nccl.version()}")
    table_head()
    with root_budget() as root:
        with gpu_budget("8GiB", name="nccl-model") as model:
            store = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpubudget-nccl-{os.getpid()}"
            dist.init_process_group("nccl", init_method=store.as_uri(),
                                    rank=0, world_size=1, device_id=torch.device("cuda:0"))
            t = torch.arange(64 * MiB // 4, dtype=torch.float32, device="cuda")
            for _ in range(3):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            compare("after 3 all-reduces of 64 MiB", nvml, model)
            note(f"nccl-model: {door_line(model)}")
            note(f"checksum {float(t[:1000].sum()):.6e}")
            dist.destroy_process_group()
            store.unlink(missing_ok=True)
            del t
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            compare("after destroy_process_group + empty_cache", nvml, model)
            note(f"nccl-model at the end: {door_line(model)}")
        print(root.report(), flush=True)
    note(f"outside every budget: {outside_line()}")


def part_cupy() -> None:
    cp = need("cupy")

    from gpubudget import gpu_budget

    context()
    cp.cuda.set_allocator(None)  # the pool off: every array is a cudaMalloc
    cp.cuda.set_pinned_memory_allocator(None)
    nvml = Nvml()
    nvml.mark()
    note(f"cupy {cp.__version__}, pool off; baseline NVML {mib(nvml.base)}")
    table_head()
    with root_budget() as root:
        with gpu_budget("4GiB", name="cupy-model") as model:
            a = cp.random.default_rng(0).standard_normal((4096, 4096), dtype=cp.float32)
            b = a @ a.T
            cp.cuda.Device().synchronize()
            compare("two 64 MiB arrays and a matmul", nvml, model)
            note(f"cupy-model: {door_line(model)}; checksum {float(b.sum()):.6e}")
            try:
                cp.empty(5 * GiB, dtype=cp.uint8)
                note("NOT refused: 5 GiB in a 4 GiB budget")
            except Exception as exc:  # noqa: BLE001 - with the pool off: CUDARuntimeError
                note(f"5 GiB in a 4 GiB budget refused: {first_line(exc)}")
            del a, b
            compare("arrays freed", nvml, model)
        print(root.report(), flush=True)


def part_numba() -> None:
    import numpy as np

    cuda = need("numba.cuda")

    from gpubudget import gpu_budget

    context()
    nvml = Nvml()
    nvml.mark()
    note(f"numba-cuda device {cuda.get_current_device().name}; baseline NVML {mib(nvml.base)}")
    table_head()
    with root_budget() as root:
        with gpu_budget("2GiB", name="numba-model") as model:
            host = np.arange(16 * MiB, dtype=np.float32)  # 64 MiB
            dev = cuda.to_device(host)
            out = cuda.device_array_like(dev)
            out.copy_to_device(dev)  # device to device (a kernel would need Numba to compile:
            cuda.synchronize()       # numba-cuda there fails on numpy 2.5, np.row_stack gone)
            compare("two 64 MiB device arrays", nvml, model)
            ok = bool((out.copy_to_host() == host).all())
            note(f"numba-model: {door_line(model)}; output equals numpy's: {ok}")
            try:
                cuda.device_array(3 * GiB, dtype=np.uint8)
                note("NOT refused: 3 GiB in a 2 GiB budget")
            except Exception as exc:  # noqa: BLE001 - numba's error is what is reported
                note(f"3 GiB in a 2 GiB budget refused: {first_line(exc)}")
            del dev, out
            cuda.current_context().deallocations.clear()
            compare("arrays freed", nvml, model)
        print(root.report(), flush=True)


def part_tensorrt() -> None:
    from gpubudget import gpu_budget
    from gpubudget import tensorrt as gbt

    context()
    nvml = Nvml()
    nvml.mark()
    trt = gbt.load_module("tensorrt_lean_bindings")
    note(f"TensorRT lean runtime {trt.__version__}; baseline NVML {mib(nvml.base)}")
    table_head()
    with root_budget() as root:
        with gpu_budget("2GiB", name="trt-model") as model:
            logger = trt.Logger(trt.Logger.WARNING)
            runtime = gbt.Runtime(logger, trt_module=trt)
            compare("a lean Runtime with the budget's allocator", nvml, model)
            note(f"trt-model: {door_line(model)}; allocator attached: "
                 f"{gbt.allocator_of(runtime) is not None}")
            note("no plan can be built here (the lean runtime only deserializes): stopped there")
            del runtime
        print(root.report(), flush=True)


def part_cost(pairs: int, rounds: int) -> None:
    import statistics

    from gpubudget import door, gpu_budget
    from gpubudget.door import build

    cc = build.compiler()
    assert cc is not None, "no C compiler"
    lib = Path(os.environ.get("TMPDIR", "/tmp")) / f"door-pairs-{os.getpid()}.so"
    subprocess.run([cc, "-O2", "-fPIC", "-shared", "-o", str(lib),
                    str(ROOT / "scripts" / "door_pairs.c")], check=True)
    try:
        timer = ctypes.CDLL(str(lib))
    finally:
        lib.unlink()  # mapped now: the file is not needed
    timer.pairs_ns.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long,
                               ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)]
    context()
    libc = ctypes.CDLL(None)
    libc.dlvsym.restype = ctypes.c_void_p
    libc.dlvsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    real_dlsym = None
    for version in (b"GLIBC_2.34", b"GLIBC_2.2.5"):
        address = libc.dlvsym(None, b"dlsym", version)
        if address:
            real_dlsym = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_char_p)(address)
            break
    assert real_dlsym is not None
    driver = ctypes.CDLL("libcuda.so.1")
    own = (real_dlsym(driver._handle, b"cuMemAlloc_v2"),
           real_dlsym(driver._handle, b"cuMemFree_v2"))
    everywhere = ctypes.CDLL(None)
    hooked = (ctypes.cast(everywhere.cuMemAlloc_v2, ctypes.c_void_p).value,
              ctypes.cast(everywhere.cuMemFree_v2, ctypes.c_void_p).value)
    note(f"door loaded: {door.loaded()}; the driver's own entry points differ from the ones "
         f"the process finds: {own != hooked}")

    def budgeted() -> contextlib.AbstractContextManager[object]:
        return gpu_budget("8GiB", backend="host", name="cost")

    cases: list[tuple[str, tuple[Any, Any], Callable[[], contextlib.AbstractContextManager[object]]]] = [
        ("the driver's own (unhooked)", own, contextlib.nullcontext),
        ("hooked, outside every budget", hooked, contextlib.nullcontext),
        ("hooked, in a budget", hooked, budgeted),
    ]
    for size in (4096, 2 * MiB):
        times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in cases}
        for _ in range(rounds):
            for name, (alloc, free), scope in cases:
                cpu_ns, wall_ns = ctypes.c_double(), ctypes.c_double()
                with scope():
                    rc = timer.pairs_ns(alloc, free, size, pairs, ctypes.byref(cpu_ns),
                                        ctypes.byref(wall_ns))
                assert rc == 0, f"{name}: an allocation failed"
                times[name].append((cpu_ns.value, wall_ns.value))
        base_cpu = statistics.median(t[0] for t in times[cases[0][0]])
        base_wall = statistics.median(t[1] for t in times[cases[0][0]])
        note(f"cuMemAlloc_v2 + cuMemFree_v2 of {size:,} bytes on the H200's driver: median of "
             f"{rounds} interleaved rounds of {pairs:,} pairs, one process")
        row("path", "thread CPU ns/pair", "door adds", "wall ns/pair", "door adds", "wall ratio")
        row("---", "---:", "---:", "---:", "---:", "---:")
        for name, _, _ in cases:
            cpu = statistics.median(t[0] for t in times[name])
            wall = statistics.median(t[1] for t in times[name])
            row(name, f"{cpu:,.0f}", f"{cpu - base_cpu:+,.0f}", f"{wall:,.0f}",
                f"{wall - base_wall:+,.0f}", f"{wall / base_wall:.3f}")


def part_race(seconds: float = 20.0) -> None:
    """Threads of one budget allocating through the door (``cuMemAlloc_v2`` from ctypes) and
    through gpubudget's allocator at the same moments, on the real driver: both sides are
    refused at the budget's limit, the run ends with nothing held and the ledger whole, and
    the trace of it carries the door's line."""
    import random
    import tempfile

    from gpubudget import bind, door, gpu_budget

    context()
    cuda = ctypes.CDLL("libcuda.so.1")
    alloc, free = cuda.cuMemAlloc_v2, cuda.cuMemFree_v2
    alloc.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    free.argtypes = [ctypes.c_uint64]
    trace = os.path.join(tempfile.mkdtemp(), "race.jsonl")
    counts = dict.fromkeys(("door granted", "door refused", "core granted", "core refused"), 0)
    lock = threading.Lock()

    def count(key: str) -> None:
        with lock:
            counts[key] += 1

    with gpu_budget("2GiB", initial=0, name="race-root", trace=trace) as root:
        with gpu_budget("256MiB", name="model") as model:
            deadline = time.monotonic() + seconds

            def driver_side(seed: int) -> None:
                context()  # the device's primary context, current in this thread too
                rng, live = random.Random(seed), list[int]()
                while time.monotonic() < deadline:
                    if live and rng.random() < 0.5:
                        assert free(live.pop(rng.randrange(len(live)))) == 0
                        continue
                    pointer = ctypes.c_uint64()
                    status = alloc(ctypes.byref(pointer), rng.randint(1, 32) * MiB)
                    assert status in (0, 2), status  # granted, or CUDA_ERROR_OUT_OF_MEMORY
                    if status == 0:
                        live.append(pointer.value)
                    count("door granted" if status == 0 else "door refused")
                for address in live:
                    assert free(address) == 0

            def core_side(seed: int) -> None:
                rng, live = random.Random(seed), list[int]()
                while time.monotonic() < deadline:
                    if live and rng.random() < 0.5:
                        assert model.free(live.pop(rng.randrange(len(live))))
                        continue
                    block = model.allocate(rng.randint(1, 32) * MiB)
                    if block is not None:
                        live.append(block)
                    count("core granted" if block is not None else "core refused")
                for block in live:
                    assert model.free(block)

            errors: list[str] = []

            def side(work: Callable[[int], None], seed: int) -> None:
                try:
                    work(seed)
                except BaseException as exc:  # noqa: BLE001 - the part fails below
                    errors.append(first_line(exc))

            sides = [driver_side, driver_side, core_side, core_side]
            threads = [threading.Thread(target=bind(side, work, i))
                       for i, work in enumerate(sides)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise AssertionError(f"a thread failed: {errors}")
            numbers = door.numbers(model)
            model.check()
            note(f"{seconds:.0f} s, two threads through the driver, two through the budget, "
                 f"in one 256 MiB budget: {counts}")
            note(f"at the end: budget used {mib(model.report().used)}, the door holds "
                 f"{mib(numbers.held if numbers else None)} (peak "
                 f"{mib(numbers.peak if numbers else None)}), check() passed")
        root.trim()
    shown = subprocess.run([sys.executable, "-m", "gpubudget", "report", trace],
                           capture_output=True, text=True, check=False)
    lines = [line for line in shown.stdout.splitlines() if "through the door" in line]
    note(f"gpubudget report of the trace (exit {shown.returncode}): {lines or shown.stderr[:300]}")


def part_serve() -> None:
    """Loading and serving a model, timed (the run without the door is the baseline)."""
    torch = need("torch")

    from gpubudget import door, gpu_budget

    context()
    torch.cuda.init()
    torch.manual_seed(0)
    started = time.perf_counter()
    with root_budget() as root, gpu_budget("16GiB", name="served", parent=root):
        layers = []
        for _ in range(24):
            layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
        net = torch.nn.Sequential(*layers).to("cuda", torch.bfloat16).eval()
        torch.cuda.synchronize()
        loaded = time.perf_counter() - started
        x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for _ in range(5):
                net(x)
            torch.cuda.synchronize()
            begin = time.perf_counter()
            for _ in range(200):
                y = net(x)
            torch.cuda.synchronize()
        step = (time.perf_counter() - begin) / 200
        checksum = float(y.float().sum())
        del net, x, y
        torch.cuda.empty_cache()
    note(f"serve: door {'on' if door.loaded() else 'off'}: load {loaded * 1e3:,.0f} ms "
         f"(24 bf16 4096x4096 layers, 0.75 GiB), {step * 1e3:.3f} ms per batch of 256; "
         f"checksum {checksum:.6e}")


PARTS: dict[str, tuple[Callable[[], None], dict[str, str]]] = {
    "torch": (part_torch, {}),
    "jax-platform": (lambda: part_jax("platform"), {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}),
    "jax-prealloc": (lambda: part_jax("prealloc"), {}),
    "nccl": (part_nccl, {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}),
    "cupy": (part_cupy, {}),
    "numba": (part_numba, {}),
    "tensorrt": (part_tensorrt, {}),
    "cost": (lambda: part_cost(20_000, 5), {}),
    "serve": (part_serve, {}),
    "race": (part_race, {}),
}
WITHOUT_DOOR = ("torch", "jax-prealloc", "nccl", "serve")
"""Parts also run without the door: what the report called outside budgets there."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["all", *PARTS])
    parser.add_argument("--only", default="", help="with 'all': a comma-separated subset")
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    if args.part != "all":
        try:
            PARTS[args.part][0]()
        except Exception:  # noqa: BLE001 - the part's failure is printed, the run goes on
            traceback.print_exc()
            return 1
        return 0
    chosen = [p for p in (args.only.split(",") if args.only else PARTS) if p]
    unknown = [p for p in chosen if p not in PARTS]
    if unknown or (args.only and args.part != "all"):
        parser.error(f"--only takes parts of 'all', from {', '.join(PARTS)}; got "
                     f"{args.only!r}")
    failed = 0
    for part in chosen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **PARTS[part][1])
        runs = [("under the door", True)] + ([("without the door", False)]
                                             if part in WITHOUT_DOOR else [])
        for label, door_on in runs:
            print(f"\n## {part}, {label}\n", flush=True)
            command = [sys.executable, "-m", "scripts.door_gpu", part]
            if door_on:
                command = [sys.executable, "-m", "gpubudget", "run", "--", *command]
            started = time.monotonic()
            try:
                rc = str(subprocess.run(command, env=env, cwd=ROOT,
                                        timeout=args.timeout).returncode)
            except subprocess.TimeoutExpired:
                rc = "timed out"
            print(f"\n(exit {rc}, {time.monotonic() - started:.1f} s)", flush=True)
            failed += rc != "0"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
