from __future__ import annotations

import ctypes
import warnings

import pytest

import gpubudget.backends as backends
from gpubudget import BackendError, gpu_budget
from gpubudget.backends import get_backend
from gpubudget.backends.host import HostBackend


def test_host_reservation_is_real_writable_memory() -> None:
    backend = HostBackend()
    reservation = backend.reserve(1 << 20)
    assert reservation.address % 4096 == 0 and reservation.nbytes == 1 << 20
    ctypes.memset(reservation.address, 0x5A, 1 << 20)
    backend.copy(reservation.address + 100, reservation.address, 10)
    assert ctypes.string_at(reservation.address + 100, 10) == b"\x5a" * 10
    assert backend.record_event(7).query()
    reservation.release()
    reservation.release()  # a second release does nothing
    assert reservation.released


def test_host_reserve_failure_is_memory_error() -> None:
    with pytest.raises(MemoryError):
        HostBackend().reserve(1 << 62)


def test_selection_by_argument_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_backend("host") is get_backend("host")
    mine = HostBackend()
    assert get_backend(mine) is mine
    monkeypatch.setenv("GPUBUDGET_BACKEND", "host")
    assert get_backend(None).name == "host"
    monkeypatch.setenv("GPUBUDGET_BACKEND", "quantum")
    with pytest.raises(ValueError, match="GPUBUDGET_BACKEND.*'quantum'"):
        get_backend(None)


def test_pycuda_unavailable_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if backends.cuda_usable():
        pytest.skip("a CUDA device is usable here")
    monkeypatch.delitem(backends._instances, ("pycuda", 0), raising=False)
    with pytest.raises(BackendError, match="pycuda.*backend='host'"):
        with gpu_budget("1MiB", backend="pycuda"):
            pass  # pragma: no cover


def test_fallback_to_host_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUBUDGET_BACKEND")
    monkeypatch.setattr(backends, "cuda_usable", lambda: False)
    monkeypatch.setattr(backends, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpu_budget("1MiB") as first:
            pass
        with gpu_budget("1MiB"):
            pass
    warned = [w for w in caught if issubclass(w.category, RuntimeWarning)
              and str(w.message).startswith("gpubudget")]  # not another's garbage's
    assert len(warned) == 1 and "simulated in host memory" in str(warned[0].message)
    assert warned[0].filename == __file__  # points at the user's `with` line
    assert first.report().backend == "host"


def test_alignment_beyond_the_backend_guarantee_over_reserves() -> None:
    with gpu_budget("4MiB", align=1 << 20) as budget:  # mmap gives 4 KiB alignment
        blocks = [budget.allocate(10) for _ in range(4)]
        assert all(b is not None and b % (1 << 20) == 0 for b in blocks)
        assert budget.used == 4 << 20 and budget.allocate(10) is None
