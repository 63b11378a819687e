"""gpubudget.hostledger.view: every registered budget of the host at one moment, joined with
NVML's per-process figures; a bad ledger file or directory is an error naming it."""

from __future__ import annotations

import contextvars
import os
from pathlib import Path

import pytest

from gpubudget import gpu_budget
from gpubudget.backends import HostBackend
from gpubudget.hostledger import LedgerDevice, LedgerError, host_view, nvml
from gpubudget.hostledger.nvml import GpuProcesses
from gpubudget.units import GiB, MiB


@pytest.fixture(autouse=True)
def _ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))


class Gpu(HostBackend):
    def ledger_device(self) -> LedgerDevice:
        return LedgerDevice("GPU-1234", "NVIDIA H200", 140 * GiB, hard=False)


def test_budgets_per_device_with_what_processes_hold_outside_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "read_nvml", lambda: ({
        "GPU-1234": GpuProcesses("GPU-1234", "NVIDIA H200", 140 * GiB,
                                 {os.getpid(): 2 * GiB + 300 * MiB, 4242: GiB}),
        "GPU-idle": GpuProcesses("GPU-idle", "NVIDIA H200", 140 * GiB, {}),
        "GPU-other": GpuProcesses("GPU-other", "NVIDIA H200", 140 * GiB, {4343: GiB})}, None))
    from gpubudget.hostledger import view

    monkeypatch.setattr(view, "read_nvml", nvml.read_nvml)
    context = contextvars.Context()
    gpu_root = context.run(gpu_budget("2GiB", name="detector", backend=Gpu()).__enter__)
    with gpu_budget("1MiB", name="host side") as host_root:
        block = gpu_root.allocate(GiB)
        seen = host_view()
        gpu, host, _ = seen.devices
        assert (gpu.identity, gpu.claimed, gpu.used, gpu.pids) == ("GPU-1234", 2 * GiB, GiB,
                                                                   (os.getpid(), 4242))
        assert gpu.outside(os.getpid()) == 300 * MiB  # NVML's 2.3 GiB less the 2 GiB reserved
        assert gpu.outside(4242) == GiB  # holds memory, has no budget
        assert host.identity == "host" and host.used_by is None and host.outside(1) is None
        assert [d.identity for d in seen.devices] == ["GPU-1234", "host", "GPU-other"]
        assert [d.identity for d in host_view(idle=True).devices] == [
            "GPU-1234", "host", "GPU-idle", "GPU-other"]
        data = seen.as_dict()
        assert data["nvml"] == "ok" and data["devices"][0]["budgets"][0] == {
            "pid": os.getpid(), "process": gpu.entries[0].process, "budget": "detector",
            "state": "reserved", "limit": 2 * GiB, "share": None, "reserved": 2 * GiB,
            "used": GiB, "peak": GiB, "free": GiB, "denials": 0, "cuda_ordinal": None,
            "children": [], "children_hidden": 0}
        assert data["devices"][0]["processes"][1] == {
            "pid": 4242, "process": None, "device_used": GiB, "outside": GiB}
        assert host_root.used == 0 and block is not None and gpu_root.free(block)
    context.run(gpu_root.__exit__, None, None, None)
    assert host_view(nvml=False).devices == ()


def test_where_nothing_was_registered_the_view_is_empty(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "never made"))
    view = host_view(nvml=False)
    assert (view.devices, view.nvml_error, view.directory) == ((), "not asked",
                                                               str(tmp_path / "never made"))
    with pytest.raises(LedgerError, match="cannot open the ledger directory '.*never made'"):
        host_view(tmp_path / "never made", nvml=False)  # named explicitly: it must exist


def test_a_bad_ledger_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with gpu_budget("1MiB"):
        pass
    (tmp_path / "ledger" / "GPU-x.ledger").write_bytes(b"garbage")
    with pytest.raises(LedgerError, match="the ledger file '.*GPU-x.ledger' is 7 bytes, not "
                                          "3149824: not a gpubudget ledger"):
        host_view(nvml=False)


class SimulatedGpu(HostBackend):
    def ledger_device(self) -> LedgerDevice:
        return LedgerDevice("sim-gpu-7", "simulated GPU sim-gpu-7", 8 * GiB, hard=True)


def test_a_simulated_device_shows_while_budgets_live_on_it_and_not_as_a_leftover() -> None:
    context = contextvars.Context()
    root = context.run(gpu_budget("1GiB", name="sim", backend=SimulatedGpu()).__enter__)
    with gpu_budget("1GiB", name="plain", backend="host"):
        pass  # the host's file: a device that stays, idle
    try:
        shown = [d.identity for d in host_view(nvml=False, idle=True).devices]
        assert "sim-gpu-7" in shown and "host" in shown
    finally:
        context.run(root.__exit__, None, None, None)
    assert os.listdir(os.environ["GPUBUDGET_LEDGER_DIR"])  # both files stay behind
    assert [d.identity for d in host_view(nvml=False, idle=True).devices] == ["host"]
    assert [d.identity for d in host_view(nvml=False).devices] == []
