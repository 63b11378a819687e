"""gpubudget.hostledger.caps: the host-wide cap kept in the device's ledger file."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpubudget.hostledger import LedgerError, device_cap, set_device_cap
from gpubudget.units import GiB
from tests.helpers import RecordingBackend


@pytest.fixture(autouse=True)
def _ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path))
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "10GiB")


def test_set_read_and_clear(tmp_path: Path) -> None:
    assert device_cap(backend="host") is None
    assert set_device_cap("90%", backend="host") == 9 * GiB
    assert device_cap(backend="host") == 9 * GiB
    assert set_device_cap(2 * GiB, backend="host") == 2 * GiB
    assert set_device_cap("1.5GiB", backend="host") == 3 * GiB // 2
    assert set_device_cap(None, backend="host") is None and device_cap(backend="host") is None
    assert [path.name for path in tmp_path.iterdir()] == ["host.ledger"]


@pytest.mark.parametrize(("cap", "error", "message"), [
    ("lots", ValueError, "cap='lots' 'lots' is not a size"),
    ("200%", ValueError, "cap='200%' is not a cap"),
    (0, ValueError, "cap must be a positive number of bytes, got 0"),
    (True, TypeError, "cap must be an int"),
    (1.5, TypeError, "cap must be an int"),
])
def test_a_bad_cap_is_an_error_naming_it(cap: object, error: type[Exception], message: str
                                         ) -> None:
    with pytest.raises(error, match=message):
        set_device_cap(cap, backend="host")  # type: ignore[arg-type]


def test_only_devices_of_the_ledger_have_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="does not allocate on a device the host ledger knows"):
        set_device_cap("1GiB", backend=RecordingBackend())
    monkeypatch.setenv("GPUBUDGET_LEDGER", "off")
    with pytest.raises(LedgerError, match="the host ledger is turned off"):
        device_cap(backend="host")
