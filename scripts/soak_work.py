"""What the soak's threads do, per framework: load a model, serve it, unload it (see
``scripts/soak.py``). Each workload exists twice: on the real library (a GPU) and on the
fakes of ``tests/`` (the CPU), which allocate the same way without computing anything."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import gpubudget


class Refused(MemoryError):
    """A TensorRT allocation the budget refused (TensorRT itself would fail the build)."""


class Work:
    """A framework as the soak uses it."""

    kind: ClassVar[str]
    limits: ClassVar[tuple[str, ...]]
    """Budget limits to pick from; the first is too small for any model (its load fails)."""

    def route(self) -> Any:
        """A context manager routing the thread's allocations to the current budget."""
        raise NotImplementedError

    def load(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def serve(self, model: Any, rng: random.Random) -> None:
        raise NotImplementedError

    def unload(self, model: Any) -> None:
        """Give the model's memory back (dropping it is enough, but for TensorRT)."""

    def release(self) -> None:
        """The framework's ``release_cached()``."""

    def refused(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the framework's out-of-memory error."""
        raise NotImplementedError


class _NoRoute:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class TorchWork(Work):
    kind = "torch"
    limits = ("1MiB", "96MiB", "256MiB")

    def __init__(self, torch: Any, fake: bool) -> None:
        from gpubudget import torch as gbt

        self.torch, self.fake, self.gbt = torch, fake, gbt

    def route(self) -> Any:
        return self.gbt.allocations()

    def load(self, rng: random.Random) -> Any:
        torch = self.torch
        if self.fake:
            return [torch.empty(rng.choice((2**16, 2**20, 3 * 2**20))) for _ in range(4)]
        width = rng.choice((128, 256, 512))
        if rng.random() < 0.3:
            layer = torch.nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True,
                                                     dropout=0.0, device="cuda")
            net = torch.nn.TransformerEncoder(layer, rng.randint(1, 3),
                                              enable_nested_tensor=False)
            return net.eval(), (8, 16, width)
        layers = [torch.nn.Linear(width, width, device="cuda") for _ in range(rng.randint(2, 6))]
        return torch.nn.Sequential(*layers).eval(), (64, width)

    def serve(self, model: Any, rng: random.Random) -> None:
        torch = self.torch
        if self.fake:
            scratch = [torch.empty(rng.choice((2**12, 2**20))) for _ in range(3)]
            del scratch
            return
        net, shape = model
        with torch.no_grad():
            out = net(torch.randn(*shape, device="cuda"))
        float(out.sum())  # waits for the work: it ran

    def release(self) -> None:
        self.gbt.release_cached()

    def refused(self, exc: BaseException) -> bool:
        return isinstance(exc, self.torch.OutOfMemoryError)


class CupyWork(Work):
    kind = "cupy"
    limits = ("16KiB", "64MiB", "256MiB")

    def __init__(self, cp: Any, fake: bool) -> None:
        from gpubudget import cupy as gbc
        from gpubudget import door

        self.cp, self.fake, self.gbc = cp, fake, gbc
        if not fake:  # cuFFT keeps what its first plan takes (6.65 MiB on the H200) for the
            with door.outside_budgets():  # process's life: made outside every budget, as
                float(abs(cp.fft.fft(cp.ones(4096, dtype=cp.float32))).sum())  # door.md says
                cp.fft.config.get_plan_cache().clear()

    def route(self) -> Any:
        return self.gbc.allocations()

    def load(self, rng: random.Random) -> Any:
        cp = self.cp
        if self.fake:
            return [cp.allocate(rng.choice((10_000, 100_000, 1_000_000))) for _ in range(3)]
        return cp.random.random(rng.choice((2**14, 2**18, 2**20)), dtype=cp.float32)

    def serve(self, model: Any, rng: random.Random) -> None:
        cp = self.cp
        if self.fake:
            scratch = cp.allocate(rng.choice((4096, 50_000)))
            del scratch
            return
        if rng.random() < 0.3:
            spectrum = cp.fft.fft(model[:4096])
            float(abs(spectrum).sum())
        else:
            float((model * 2).sum())

    def release(self) -> None:
        self.gbc.release_cached()
        # what cuFFT and cuRAND took from the driver themselves (a plan cache, a generator's
        # states), charged under the driver door to the budget that first used them
        # (the tests' fake CuPy has neither)
        config = getattr(self.cp.fft, "config", None)
        if config is not None:
            config.get_plan_cache().clear()
        reset = getattr(getattr(self.cp, "random", None), "reset_states", None)
        if reset is not None:
            reset()

    def refused(self, exc: BaseException) -> bool:
        return isinstance(exc, self.cp.cuda.memory.OutOfMemoryError)


class TrtWork(Work):
    """TensorRT-RTX's allocator trampoline (``tests/trampoline.py``), as an engine's loading
    and its execution contexts' scratch would call it."""

    kind = "tensorrt"
    limits = ("16KiB", "16MiB", "64MiB")

    def __init__(self, trt: Any) -> None:
        from gpubudget import tensorrt as gbtrt
        from tests.trampoline import Trampoline, verify_slots

        for base in ("IGpuAsyncAllocator", "IGpuAllocator"):  # the vtable slots, proven first
            verify_slots(trt, base)
        self.trt, self.gbtrt, self.trampoline = trt, gbtrt, Trampoline

    def route(self) -> Any:
        return _NoRoute()  # an allocator is bound to the budget current when it is made

    def load(self, rng: random.Random) -> Any:
        cpp = self.trampoline(self.gbtrt.allocator(trt_module=self.trt))
        blocks: list[int] = []
        for _ in range(3):
            address = cpp.allocate(rng.choice((4096, 2**20)), 256, 0)
            if address is None:
                for block in blocks:
                    cpp.deallocate(block)
                budget = gpubudget.current_budget()
                raise Refused(f"TensorRT allocation refused by budget "
                              f"{budget.name if budget else None!r}")
            blocks.append(address)
        return cpp, blocks

    def serve(self, model: Any, rng: random.Random) -> None:
        cpp, _ = model
        scratch = cpp.allocate_async(rng.choice((512, 65536)), 256, 0, 0)
        if scratch is not None:
            cpp.deallocate_async(scratch, 0)

    def unload(self, model: Any) -> None:
        cpp, blocks = model
        for block in blocks:
            cpp.deallocate(block)
        blocks.clear()

    def refused(self, exc: BaseException) -> bool:
        return isinstance(exc, Refused)
