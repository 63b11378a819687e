"""On a GPU: a root budget's metrics carry the labels NVIDIA's DCGM exporter gives the same
GPU (``UUID``, ``gpu``, ``modelName``), read from NVML here, so that queries join on them.
Needs ``nvidia-ml-py`` and ``prometheus_client`` besides PyCUDA; skipped, saying which is
missing, without them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpubudget import gpu_budget


def test_a_root_on_device_0_is_labelled_as_dcgm_labels_its_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
    from gpubudget.hostledger import host_view
    from gpubudget.metrics import families, nvml_indexes

    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        uuid, name = pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetName(handle)
    finally:
        pynvml.nvmlShutdown()
    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    name = name.decode() if isinstance(name, bytes) else str(name)
    with gpu_budget("64MiB", name="model", device=0) as budget:
        block = budget.allocate(2**20)
        indexes = nvml_indexes()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in families(host_view(), indexes) for s in family.samples}
        assert block is not None and budget.free(block)
    # CUDA's ordinal 0 is NVML's index 0 unless CUDA_VISIBLE_DEVICES reorders them
    assert uuid in indexes
    key = ("gpubudget_used_bytes", tuple(sorted(
        {"UUID": uuid, "gpu": indexes[uuid], "modelName": name, "budget": "model",
         "process": str(os.getpid())}.items())))
    assert samples[key] == 2**20
