"""gpubudget.hostledger.devices: which device a backend allocates on, as the ledger names it."""

from __future__ import annotations

import pytest

from gpubudget.backends import HostBackend
from gpubudget.hostledger import LedgerDevice, device_for
from gpubudget.hostledger.devices import host_device
from gpubudget.replay.run import ReplayBackend
from gpubudget.units import GiB
from tests.helpers import RecordingBackend


class FakeCudaBackend(HostBackend):
    """What the ledger reads of the PyCUDA backend: a UUID, an ordinal, a named device and
    its memory (each ``mem_info`` is a device call: counted)."""

    name = "pycuda"

    def __init__(self) -> None:
        super().__init__()
        self.ordinal = 1
        self.reads = 0

    class device:  # noqa: N801 - as pycuda.driver.Device's instance
        @staticmethod
        def name() -> str:
            return "NVIDIA H200"

    def device_uuid(self) -> str:
        return "GPU-8f3c1a2b-0000-1111-2222-333344445555"

    def mem_info(self) -> tuple[int, int]:
        self.reads += 1
        return 100 * GiB - self.reads, 140 * GiB


def test_the_host_backend_is_the_host_or_a_simulated_gpu(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.delenv("GPUBUDGET_DEVICE_MEMORY", raising=False)
    plain = device_for(HostBackend())
    assert plain is not None and (plain.identity, plain.hard, plain.free) == ("host", False, None)
    assert plain.total > 0 and plain.label == "host memory"
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "8GiB")
    simulated = host_device()
    assert (simulated.total, simulated.hard, simulated.label) == (
        8 * GiB, True, "host memory (a simulated GPU of 8.00 GiB)")
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "eight")
    with pytest.raises(ValueError, match="environment variable GPUBUDGET_DEVICE_MEMORY "
                                         "'eight' is not a size"):
        host_device()


def test_a_gpu_is_named_by_its_uuid_and_read_for_its_free_memory() -> None:
    backend = FakeCudaBackend()
    device = device_for(backend)
    assert device is not None and device.free is not None
    assert (device.identity, device.label, device.total, device.ordinal, device.hard) == (
        "GPU-8f3c1a2b-0000-1111-2222-333344445555", "NVIDIA H200", 140 * GiB, 1, False)
    assert device.free() == 100 * GiB - 2  # read again at each call
    assert device_for(backend) is device and backend.reads == 2  # identity asked once


def test_backends_the_ledger_does_not_know_are_not_registered() -> None:
    assert device_for(ReplayBackend()) is None  # a host backend's subclass: a trace's replay
    assert device_for(RecordingBackend()) is None

    class Described(HostBackend):
        def ledger_device(self) -> LedgerDevice:
            return LedgerDevice("mine", "my device", GiB, hard=True)

    described = device_for(Described())
    assert described is not None and described.identity == "mine"
