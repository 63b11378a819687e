"""GPU tests: skipped, with the reason, where no CUDA device or PyCUDA is usable."""

from __future__ import annotations

from collections.abc import Iterator

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
    """Overrides the suite-wide fixture: GPU tests run on the PyCUDA backend."""
    monkeypatch.setenv("GPUBUDGET_BACKEND", "pycuda")
    yield
