"""Budgeted Ray actors on the real GPUs, in the host ledger (needs CUDA, PyCUDA and Ray; the
whole module skips, with the reason, elsewhere).

A local cluster sees every GPU of the machine. Two actors of 0.4 GPU each go on every GPU
(Ray cannot fit a third), each reserving a budget of 40% of the GPU through PyCUDA: all of them appear in the
ledger under the GPUs' UUIDs (the same ones the driver and NVML name), with their pids, and
in ``gpubudget top --once``. Then one more actor asks for more than any GPU has left: its
creation fails with an error naming the processes and budgets that hold the memory. With
``GPUBUDGET_RAY_OUT`` set, ``top``'s text and JSON are written there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget.backends import get_backend
from gpubudget.hostledger import host_view
from gpubudget.units import GiB
from tests.gpu.conftest import devices
from tests.helpers import subprocess_env

if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (on the GPU machine: bash scripts/ray-gpu-check.sh)",
                allow_module_level=True)


def uuids() -> list[str]:
    """Every GPU's UUID, as the PyCUDA backend reads it in this process."""
    found = []
    for ordinal in range(devices()):
        backend: Any = get_backend("pycuda", device=ordinal)
        found.append(str(backend.device_uuid()))
    return found


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ray-ledger")


@pytest.fixture(scope="module")
def cluster(ledger: Path) -> Iterator[None]:
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"GPUBUDGET_LEDGER_DIR": str(ledger),
                                       "GPUBUDGET_BACKEND": "pycuda"}})
    yield
    ray.shutdown()


def test_actors_on_every_gpu_are_in_the_ledger_and_a_third_that_does_not_fit_is_told_who(
        cluster: None, ledger: Path) -> None:
    import ray

    from tests.test_ray import creation_error, model_class

    count = devices()
    total = get_backend("pycuda", device=0).mem_info()[1]  # type: ignore[index]
    limit = int(total * 0.4) // GiB * GiB
    model = model_class(num_gpus=0.4, limit=str(limit))  # Ray fits two, not three, on a GPU
    actors = [model.remote(GiB) for _ in range(2 * count)]
    described = ray.get([actor.describe.remote() for actor in actors], timeout=300)
    pids = ray.get([actor.pid.remote() for actor in actors])
    by_gpu: dict[str, list[int]] = {}
    for info, pid in zip(described, pids):
        by_gpu.setdefault(info["gpu_id"], []).append(pid)
        assert (info["limit"], info["used"]) == (limit, GiB)
    assert sorted(len(group) for group in by_gpu.values()) == [2] * count  # 2 on every GPU

    view = host_view(ledger)
    entries = {entry.pid: entry for entry in view.entries}
    assert set(pids) <= set(entries)
    gpus = [device for device in view.devices if device.entries]
    assert {device.identity for device in gpus} == set(uuids())  # the driver's UUIDs
    for device in gpus:
        mine = [entry for entry in device.entries if entry.pid in pids]
        assert len(mine) == 2 and all(entry.limit == limit and entry.used == GiB
                                      and entry.reserved >= limit and entry.ordinal == 0
                                      for entry in mine)
        if view.nvml_error is None:  # NVML names the GPU alike; contexts are outside budgets
            assert device.used_by is not None, f"NVML does not know {device.identity}"
            assert all(device.outside(entry.pid) is not None for entry in mine)
    text = subprocess.run([sys.executable, "-m", "gpubudget", "top", "--once", "--ledger-dir",
                           str(ledger)], capture_output=True, text=True, check=True,
                          env=subprocess_env()).stdout
    data = subprocess.run([sys.executable, "-m", "gpubudget", "top", "--json", "--ledger-dir",
                           str(ledger)], capture_output=True, text=True, check=True,
                          env=subprocess_env()).stdout
    assert all(str(pid) in text for pid in pids) and all(uuid in text for uuid in uuids())
    assert {b["pid"] for d in json.loads(data)["devices"] for b in d["budgets"]} >= set(pids)
    out = os.environ.get("GPUBUDGET_RAY_OUT")
    if out:
        Path(out, "ray-top.txt").write_text(text)
        Path(out, "ray-top.json").write_text(data)

    # Ray has a fifth of each GPU left, and the ledger 20% of its memory: 30% cannot be had
    too_big = int(total * 0.3) // GiB * GiB
    late = model_class(num_gpus=0.2, limit=str(too_big)).remote()
    message = creation_error(late)
    assert "BudgetError: Ray actor Model" in message and "cannot claim" in message, message
    assert "held by pid" in message
    named = [pid for pid in pids if f"pid {pid} (ray::" in message]
    assert len(named) == 2, message  # the two actors on the GPU Ray gave it
    if out:
        Path(out, "ray-refused.txt").write_text(message)
    for actor in actors:
        ray.kill(actor)
