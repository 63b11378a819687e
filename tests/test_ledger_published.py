"""A registered root's numbers stored into its host-ledger slot as they change (by
gpubudget._core.ledger.charge and the recorder's denials), exactly: reserve floors and their
release, resizes, reset_peak(); nothing after the root released its slot."""

from __future__ import annotations

import contextvars
from pathlib import Path

import pytest

from gpubudget import gpu_budget
from gpubudget.hostledger import host_view
from gpubudget.units import KiB, MiB


@pytest.fixture(autouse=True)
def _ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path))


def slot() -> tuple[int, int, int]:
    (entry,) = host_view(nvml=False).entries
    return entry.used, entry.peak, entry.denials


def test_the_slot_follows_the_root_through_children_reserves_and_denials() -> None:
    with gpu_budget("4MiB", name="pool") as pool:
        assert slot() == (0, 0, 0)
        with gpu_budget("1MiB", name="model", reserve="512KiB") as model:
            assert slot() == (512 * KiB, 512 * KiB, 0)  # the reserve counts from entry
            block = model.allocate(256 * KiB)
            assert slot() == (512 * KiB, 512 * KiB, 0)  # inside the reserve
            bigger = model.allocate(768 * KiB)
            assert slot() == (MiB, MiB, 0)
            assert model.allocate(MiB) is None  # over the child's limit: a denial in the tree
            assert slot() == (MiB, MiB, 1)
            assert block is not None and bigger is not None
            model.free(block)
            model.free(bigger)
        assert slot() == (0, MiB, 1)  # the child's release gave its reserve back
        small = pool.allocate(KiB)
        moved = pool.resize(small or 0, 64 * KiB)
        assert moved is not None and slot() == (64 * KiB, MiB, 1)
        pool.reset_peak()
        pool.free(pool.allocate(KiB) or 0)
        assert slot()[1] == 65 * KiB  # the peak as the budget sees it after reset_peak()
        assert pool.free(moved) and slot()[0] == pool.used == 0
    assert host_view(nvml=False).entries == ()  # gone with the reservation


def test_a_released_root_stops_publishing_into_what_may_be_another_slot() -> None:
    pool = gpu_budget("1MiB", name="pool")
    context = contextvars.Context()
    context.run(pool.__enter__)
    block = pool.allocate(KiB)
    context.run(pool.__exit__, None, None, None)
    assert block is not None and host_view(nvml=False).entries != ()  # a live block holds it
    assert pool.free(block)  # the last block: the root releases, and its slot goes
    assert host_view(nvml=False).entries == ()
    assert pool.allocate(KiB) is None  # a denial after release touches no slot
    assert host_view(nvml=False).entries == ()
