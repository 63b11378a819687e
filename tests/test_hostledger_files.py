"""gpubudget.hostledger.files: a ledger directory that someone else prepared as a trap is
refused with a clear message; no symbolic link is followed; no file is truncated or
resized; a new file appears whole, with the directory's sharing."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from gpubudget.hostledger import LedgerError, files
from gpubudget.hostledger.files import LedgerDirectory
from gpubudget.hostledger.layout import FILE_BYTES, MAGIC

IDENTITY = ("host", "host memory", 2**30, False)


def made(path: Path, mode: int = 0o700) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


def test_the_default_directory_is_per_user_in_shared_memory(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.delenv("GPUBUDGET_LEDGER_DIR")
    expected = Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    assert files.ledger_directory() == expected / f"gpubudget-ledger-{os.geteuid()}"
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", "/somewhere/else")
    assert files.ledger_directory() == Path("/somewhere/else")


def test_a_new_directory_is_private_and_a_new_file_whole(tmp_path: Path) -> None:
    directory = LedgerDirectory(tmp_path / "ledger", create=True)
    assert stat.S_IMODE(os.stat(tmp_path / "ledger").st_mode) == 0o700
    fd, header = directory.create("host.ledger", *IDENTITY)
    os.close(fd)
    info = os.stat(tmp_path / "ledger" / "host.ledger")
    assert (info.st_size, stat.S_IMODE(info.st_mode), header.identity) == (FILE_BYTES, 0o600,
                                                                          "host")
    assert directory.names() == ["host.ledger"]  # the temporary name is gone
    fd, again = directory.create("host.ledger", "host", "other label", 1, True)  # opened
    os.close(fd)
    assert again.label == "host memory"
    directory.close()


@pytest.mark.parametrize(("mode", "file_mode"), [(0o770, 0o660), (0o1777, 0o666)])
def test_files_in_a_shared_directory_are_writable_by_whoever_shares_it(
        tmp_path: Path, mode: int, file_mode: int) -> None:
    directory = LedgerDirectory(made(tmp_path / "shared", mode), create=False)
    fd, _ = directory.create("host.ledger", *IDENTITY)
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "shared" / "host.ledger").st_mode) == file_mode


def test_a_symbolic_link_in_place_of_the_directory_is_refused(tmp_path: Path) -> None:
    made(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(LedgerError, match=r"ledger directory '.*link': it is a symbolic link, "
                                          r"which gpubudget never follows"):
        LedgerDirectory(tmp_path / "link", create=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(LedgerError, match="'.*file': it is not a directory"):
        LedgerDirectory(tmp_path / "file", create=False)
    with pytest.raises(LedgerError, match="cannot open the ledger directory '.*missing'"):
        LedgerDirectory(tmp_path / "missing", create=False)
    with pytest.raises(LedgerError, match="cannot create the ledger directory '.*a/b'"):
        LedgerDirectory(tmp_path / "a" / "b", create=True)


def test_a_directory_anyone_may_write_must_be_sticky(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match=r"may be written by anyone and is not sticky "
                                          r"\(mode 777\); chmod \+t it"):
        LedgerDirectory(made(tmp_path / "open", 0o777), create=False)
    LedgerDirectory(made(tmp_path / "sticky", 0o1777), create=False).close()


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    path = made(tmp_path / "theirs")
    try:
        os.chown(path, 12345, -1)
    except PermissionError:
        pytest.skip("only root can give a directory to another user")
    with pytest.raises(LedgerError, match=f"belongs to uid 12345, not to you \\(uid "
                                          f"{os.geteuid()}\\) or root"):
        LedgerDirectory(path, create=False)


def test_the_default_directory_must_stay_private(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    default = made(tmp_path / "default", 0o775)
    monkeypatch.delenv("GPUBUDGET_LEDGER_DIR")
    monkeypatch.setattr(files, "default_directory", lambda: default)
    with pytest.raises(LedgerError, match=r"may be written by others \(mode 775\); it must be "
                                          r"yours alone \(chmod 700\)"):
        LedgerDirectory(default, create=True)
    default.chmod(0o700)
    LedgerDirectory(default, create=True).close()


def test_a_planted_link_or_foreign_file_is_refused_never_written(tmp_path: Path) -> None:
    directory = LedgerDirectory(made(tmp_path / "ledger"), create=False)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "ledger" / "host.ledger").symlink_to(victim)
    with pytest.raises(LedgerError, match="'.*host.ledger': it is a symbolic link"):
        directory.create("host.ledger", *IDENTITY)
    assert victim.read_bytes() == b"precious"
    (tmp_path / "ledger" / "host.ledger").unlink()
    os.link(victim, tmp_path / "ledger" / "host.ledger")  # a hard link to someone's file
    with pytest.raises(LedgerError, match="has 2 names \\(a hard link to another file\\?\\)"):
        directory.create("host.ledger", *IDENTITY)
    assert victim.read_bytes() == b"precious"
    (tmp_path / "ledger" / "host.ledger").unlink()
    (tmp_path / "ledger" / "host.ledger").write_bytes(b"mine, not a ledger")
    with pytest.raises(LedgerError, match="is 18 bytes, not 3149824: not a gpubudget ledger, "
                                          "or damaged; remove it"):
        directory.create("host.ledger", *IDENTITY)
    assert (tmp_path / "ledger" / "host.ledger").read_bytes() == b"mine, not a ledger"
    (tmp_path / "ledger" / "host.ledger").write_bytes(b"X" * FILE_BYTES)
    with pytest.raises(LedgerError, match="not a gpubudget ledger \\(it starts with b'XXXX"):
        directory.open("host.ledger", writable=False)
    (tmp_path / "ledger" / "host.ledger").unlink()
    os.mkfifo(tmp_path / "ledger" / "host.ledger")
    with pytest.raises(LedgerError, match="is not a regular file"):
        directory.create("host.ledger", *IDENTITY)
    directory.close()


def test_processes_creating_one_file_at_once_all_get_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an opener waits for the creator's unlink, however long a loaded machine pauses it
    monkeypatch.setattr(files, "_LINKED_SECONDS", 600.0)
    made(tmp_path / "ledger")
    for round_ in range(20):  # creators racing, and openers seeing it between link and unlink
        name = f"device{round_}.ledger"
        inodes: list[int] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(8)

        def create() -> None:
            directory = LedgerDirectory(tmp_path / "ledger", create=False)
            try:
                barrier.wait()
                fd, header = directory.create(name, *IDENTITY)
                inodes.append(os.fstat(fd).st_ino)
                assert header.identity == "host"
                os.close(fd)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                directory.close()

        threads = [threading.Thread(target=create) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [] and len(inodes) == 8 and len(set(inodes)) == 1
        assert (tmp_path / "ledger" / name).read_bytes()[:8] == MAGIC
    assert sorted(os.listdir(tmp_path / "ledger")) == sorted(
        f"device{round_}.ledger" for round_ in range(20))  # no temporary file left


def test_a_file_of_the_previous_format_is_refused_by_its_format_not_its_size(
        tmp_path: Path) -> None:
    """A format-2 file (before child budgets were shown: another size) left in the
    directory: refused as written in format 2, which says what to do; left as it is."""
    import struct

    old = struct.pack("=8s7Q64x64s64s", MAGIC, 2, 256, 4096, 0, 0, 2**30, 0, b"host",
                      b"host memory").ljust(4096 + 4096 * 256, b"\0")  # format 2, whole
    directory = LedgerDirectory(made(tmp_path / "ledger"), create=False)
    (tmp_path / "ledger" / "host.ledger").write_bytes(old)
    with pytest.raises(LedgerError, match="'.*host.ledger': written in ledger format 2; this "
                                          "gpubudget reads format 3; remove it"):
        directory.create("host.ledger", *IDENTITY)
    assert (tmp_path / "ledger" / "host.ledger").read_bytes() == old
    directory.close()
