"""docs/frameworks.md: its example runs as shown, on the fake PyTorch of tests/fake_torch.py
(a root budget in host memory that says it is device 0's, since the suite has no GPU)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpubudget
from tests.fake_torch import assert_nothing_would_have_aborted, install
from tests.fakes import DeviceHostBackend

DOC = Path(__file__).resolve().parent.parent / "docs" / "frameworks.md"


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    module = install(monkeypatch)
    yield module
    assert_nothing_would_have_aborted(module)


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_the_many_models_example_runs(torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (example,) = [block for block in python_blocks() if "def worker" in block]
    real = gpubudget.gpu_budget

    def gpu_budget(limit: Any, **kwargs: Any) -> gpubudget.Budget:
        if gpubudget.current_budget() is None and "parent" not in kwargs:
            kwargs.setdefault("backend", DeviceHostBackend(0))  # the root, on "device 0"
        return real(limit, **kwargs)

    monkeypatch.setattr(gpubudget, "gpu_budget", gpu_budget)
    loaded: list[str] = []
    served: list[int] = []

    def load(name: str) -> list[Any]:
        loaded.append(name)
        return [torch.empty(3 * 2**20) for _ in range(4)]

    def serve(model: list[Any], request: int) -> None:
        activations = torch.empty(2**20)
        del activations
        served.append(request)

    exec(compile(example, str(DOC), "exec"), {"load": load, "serve": serve})
    assert sorted(loaded) == ["classifier", "detector", "ranker"] and len(served) == 90
