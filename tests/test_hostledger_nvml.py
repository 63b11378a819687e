"""gpubudget.hostledger.nvml: NVML's per-process figures where nvidia-ml-py answers, and the
reason where it does not (no module, no driver)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from gpubudget.hostledger import nvml


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(nvml, "_started", [])
    yield


def fake_pynvml(processes: dict[str, list[tuple[int, int | None]]], *,
                fails: bool = False) -> types.ModuleType:
    """A pynvml with one GPU per UUID of ``processes``, each with (pid, used bytes)."""
    module = types.ModuleType("pynvml")
    uuids = list(processes)

    def init() -> None:
        if fails:
            raise RuntimeError("NVML Shared Library Not Found")

    info = types.SimpleNamespace
    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: len(uuids)  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda index: uuids[index]  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda handle: handle.encode()  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda handle: "NVIDIA H200"  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = (  # type: ignore[attr-defined]
        lambda handle: info(total=140 * 2**30))
    module.nvmlDeviceGetComputeRunningProcesses = (  # type: ignore[attr-defined]
        lambda handle: [info(pid=pid, usedGpuMemory=used) for pid, used in processes[handle]])
    return module


def install(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", module)


def test_without_the_module_it_says_which_package(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, None)  # import pynvml -> ImportError
    assert nvml.read_nvml() == ({}, "nvidia-ml-py is not installed (pip install "
                                    "'gpubudget[nvml]')")


def test_without_a_driver_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml({}, fails=True))
    assert nvml.read_nvml() == ({}, "NVML is not usable here: NVML Shared Library Not Found")


def test_each_gpu_with_what_each_process_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_pynvml({"GPU-a": [(10, 2**30), (11, None), (10, 2**20)],
                                      "GPU-b": []}))
    gpus, error = nvml.read_nvml()
    assert error is None and set(gpus) == {"GPU-a", "GPU-b"}
    assert gpus["GPU-a"].used_by == {10: 2**30 + 2**20}  # unknown figures left out
    assert (gpus["GPU-b"].name, gpus["GPU-b"].total, gpus["GPU-b"].used_by) == (
        "NVIDIA H200", 140 * 2**30, {})
