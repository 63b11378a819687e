"""GPU tests: skipped, with the reason, where no CUDA device or PyCUDA is usable."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpubudget.backends import cuda_usable


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    usable = cuda_usable()
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not usable:
                item.add_marker(pytest.mark.skip(reason="no usable CUDA device and PyCUDA"))


@pytest.fixture(autouse=True)
def _host_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Overrides the suite-wide fixture: GPU tests run on the PyCUDA backend, with device 0's
    primary context current in the test's thread (as CuPy or PyTorch would leave it), so
    that the tests' own PyCUDA calls have a context."""
    import pycuda.driver as cuda

    from gpubudget.context import ACTIVE

    monkeypatch.setenv("GPUBUDGET_BACKEND", "pycuda")
    cuda.init()
    context = cuda.Device(0).retain_primary_context()
    context.push()
    try:
        yield
    finally:
        cuda.Context.pop()
        leaked = ACTIVE.get()
        ACTIVE.set(())
        assert leaked == (), f"test left budgets active: {leaked}"


def devices() -> int:
    import pycuda.driver as cuda

    cuda.init()
    return int(cuda.Device.count())


two_devices = pytest.mark.skipif(
    not cuda_usable() or devices() < 2, reason="needs two CUDA devices (nvidia-h200-x2)")


def cupy_or_skip() -> Any:
    """CuPy, or the test skipped saying it is missing."""
    return pytest.importorskip("cupy")


def torch_or_skip() -> Any:
    """PyTorch with CUDA, or the test skipped saying which is missing."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    return torch
