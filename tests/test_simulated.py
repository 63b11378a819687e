"""The files of a simulated GPU (``gpubudget.ray.simulated``) in a directory others can write
in: no link followed, no file of others' truncated, directories of this user's only."""

from __future__ import annotations

import itertools
import os
import stat
from pathlib import Path

import pytest

from gpubudget.ray import simulated
from gpubudget.ray.simulated import SimulatedGpu

MiB = 2**20


@pytest.fixture
def ledger_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """:data:`LEDGER_ROOT` in a fresh place inside ``tmp_path`` (as in ``$TMPDIR``)."""
    root = tmp_path / "gpubudget-simulated-gpus-test"
    monkeypatch.setattr(simulated, "LEDGER_ROOT", root)
    return root


def test_the_directories_and_files_are_made_private(ledger_root: Path) -> None:
    gpu = SimulatedGpu("node-gpu0", 64 * MiB)
    held = gpu.reserve(MiB)
    try:
        assert gpu.directory == ledger_root / "node-gpu0"
        for folder in (ledger_root, gpu.directory):
            assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
        records = [p for p in gpu.directory.iterdir() if p.name != ".lock"]
        assert len(records) == 1 and records[0].read_text() == str(MiB)
        assert stat.S_IMODE(records[0].stat().st_mode) & 0o077 == 0
        assert gpu.mem_info() == (63 * MiB, 64 * MiB)
    finally:
        held.release()


def test_a_ledger_directory_that_is_a_link_or_open_to_others_is_refused(
        ledger_root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    ledger_root.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="is a symbolic link: refused"):
        SimulatedGpu("gpu0", 64 * MiB).reserve(MiB)
    assert list(elsewhere.iterdir()) == []  # nothing made through the link
    ledger_root.unlink()
    ledger_root.mkdir(mode=0o700)
    (ledger_root / "gpu0").mkdir()
    os.chmod(ledger_root / "gpu0", 0o777)  # anyone could plant files there
    with pytest.raises(PermissionError, match=r"may be written by others \(mode 0777\)"):
        SimulatedGpu("gpu0", 64 * MiB).mem_info()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_ledger_directory_of_another_user_is_refused(ledger_root: Path) -> None:
    ledger_root.mkdir(mode=0o700)
    os.chown(ledger_root, 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to uid 12345, not this user"):
        SimulatedGpu("gpu0", 64 * MiB).reserve(MiB)


def test_no_file_is_written_or_read_through_a_link(ledger_root: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    gpu = SimulatedGpu("gpu0", 64 * MiB)
    gpu.mem_info()  # makes the directories and the lock file
    (gpu.directory / ".lock").unlink()
    (gpu.directory / ".lock").symlink_to(victim)
    with pytest.raises(PermissionError, match=r"\.lock' is a symbolic link: refused"):
        gpu.reserve(MiB)
    (gpu.directory / ".lock").unlink()
    monkeypatch.setattr(simulated, "_serial", itertools.count(1))
    (gpu.directory / f"{os.getpid()}-1").symlink_to(victim)  # where the next record would go
    held = gpu.reserve(MiB)  # written beside it, and the link is not counted as a record
    try:
        assert gpu.mem_info() == (63 * MiB, 64 * MiB)
        assert (gpu.directory / f"{os.getpid()}-2").read_text() == str(MiB)
    finally:
        held.release()
    assert victim.read_text() == "precious\n"
