"""A root asking for ``"rest"`` on a real GPU after others took fixed shares: it enters (its
``cuMemAlloc`` succeeds) and leaves the headroom the docs promise (``GPUBUDGET_HEADROOM``,
256 MiB by default) free for what the process creates outside its budgets afterwards.

Run on the H200: ``python3 -m pytest tests/gpu/test_rest_gpu.py -v -p no:cacheprovider``
(``scripts/gpu-check.sh`` runs it with the other GPU tests)."""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget import Budget, gpu_budget
from gpubudget.backends import get_backend
from gpubudget.hostledger import host_view
from gpubudget.hostledger.sizing import HEADROOM, MIN_HEADROOM
from tests.gpu.conftest import torch_or_skip

MiB = 2**20
PAGE = 2 * MiB
"""What the driver rounds a large ``cuMemAlloc`` to: free memory moves by whole pages."""


@pytest.fixture(autouse=True)
def _own_ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A ledger of the test's own (no other root of the session counts), default headroom."""
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))
    monkeypatch.delenv("GPUBUDGET_HEADROOM", raising=False)
    monkeypatch.delenv("GPUBUDGET_DEVICE_CAP", raising=False)


@pytest.fixture
def roots() -> Iterator[list[tuple[Budget, contextvars.Context]]]:
    """Roots entered in contexts of their own; left, last first, at the end."""
    entered: list[tuple[Budget, contextvars.Context]] = []
    yield entered
    for budget, context in reversed(entered):
        context.run(budget.__exit__, None, None, None)


def enter(roots: list[tuple[Budget, contextvars.Context]], limit: str, name: str) -> Budget:
    budget = gpu_budget(limit, name=name)
    context = contextvars.Context()
    context.run(budget.__enter__)  # a BudgetError here fails the test: the root must enter
    roots.append((budget, context))
    return budget


def free_now() -> int:
    backend: Any = get_backend("pycuda", device=0)
    info = backend.mem_info()
    assert info is not None
    return int(info[0])


def touch_the_end(budget: Budget) -> None:
    """Write the last MiB of the root's memory: it is real device memory."""
    import pycuda.driver as cuda

    block = budget.allocate(budget.limit)
    assert block is not None, budget.report()
    cuda.memset_d8(block + budget.limit - MiB, 0xAB, MiB)
    cuda.Context.synchronize()
    assert budget.free(block)


def test_rest_after_fixed_shares_enters_and_leaves_the_headroom(
        roots: list[tuple[Budget, contextvars.Context]]) -> None:
    import pycuda.driver as cuda

    first = enter(roots, "25%", "first")
    second = enter(roots, "30%", "second")
    before = free_now()
    rest = enter(roots, "rest", "rest")
    after = free_now()
    numbers = f"free {before} before 'rest', limit {rest.limit}, free {after} after"
    assert before - HEADROOM - MiB < rest.limit <= before - HEADROOM, numbers
    # what the docs say: the headroom, less what the driver keeps for the allocation itself
    # (3-4 MiB measured), plus the MiB a share is rounded to and a page
    assert HEADROOM - MIN_HEADROOM <= after <= HEADROOM + MiB + PAGE, numbers
    assert sorted(entry.name for entry in host_view(nvml=False).entries) == [
        "first", "rest", "second"]
    for budget in (first, second, rest):
        touch_the_end(budget)
    extra = cuda.mem_alloc(64 * MiB)  # room left for what the process makes afterwards
    extra.free()


def test_the_least_headroom_is_still_enough_for_the_allocation_itself(
        monkeypatch: pytest.MonkeyPatch, roots: list[tuple[Budget, contextvars.Context]]
        ) -> None:
    monkeypatch.setenv("GPUBUDGET_HEADROOM", f"{MIN_HEADROOM // MiB}MiB")
    before = free_now()
    rest = enter(roots, "rest", "rest")  # the driver needs 3-4 MiB of it: this must enter
    after = free_now()
    numbers = f"free {before} before, limit {rest.limit}, free {after} after"
    assert before - MIN_HEADROOM - MiB < rest.limit <= before - MIN_HEADROOM, numbers
    assert after <= MIN_HEADROOM + MiB + PAGE, numbers
    touch_the_end(rest)


def test_pytorch_still_works_in_the_headroom_that_rest_leaves(
        roots: list[tuple[Budget, contextvars.Context]]) -> None:
    torch = torch_or_skip()
    enter(roots, "rest", "rest")
    before = free_now()
    x = torch.randn(1024, 1024, device="cuda")  # PyTorch's context, kernels, cuBLAS handle
    y = (x @ x).sum().item()
    torch.cuda.synchronize()
    taken = before - free_now()
    assert math.isfinite(y) and taken <= HEADROOM, f"PyTorch took {taken / MiB:.0f} MiB"
    del x
    torch.cuda.empty_cache()
