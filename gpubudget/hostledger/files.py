"""Where the ledger lives, and opening its files safely in a directory others may write.

The directory is ``GPUBUDGET_LEDGER_DIR`` if set, else ``gpubudget-ledger-<uid>`` in
``/dev/shm`` (memory, gone at reboot), else in the temporary directory. The rules, for a
directory that another user might have prepared as a trap:

- No symbolic link is followed: the directory and every file are opened with
  ``O_NOFOLLOW`` (and files relative to the directory's descriptor), so a link planted in
  their place is refused, never written through.
- The directory must be a directory owned by this user or root. The default one is created
  ``0700`` and must stay private (owned by this user, nobody else may write it); one named by
  ``GPUBUDGET_LEDGER_DIR`` may be shared with a group (then its files are made writable by
  the group), and if everyone may write it, it must be sticky (as ``/tmp`` is).
- A file must be a regular file with one name (a hard link to another file is refused); in
  a private directory it must be this user's.
- A file is never truncated or resized: a new one is written whole under a temporary name
  and linked into place (``link`` fails if the name exists), so nobody sees a half-made
  ledger, and a file that has the wrong size or header is refused, not repaired.

Every refusal is a :class:`~gpubudget.hostledger.errors.LedgerError` naming the path and
what is wrong.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Final

from ..errors import raise_if_from_outside
from .errors import LedgerError
from .layout import FILE_BYTES, HEADER_BYTES, Header, decode_header, encode_header

__all__ = ["LEDGER_DIR_ENV", "LedgerDirectory", "default_directory", "ledger_directory"]

LEDGER_DIR_ENV: Final = "GPUBUDGET_LEDGER_DIR"
"""Environment variable: the directory of the host's ledger files."""
_DIRECTORY_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SUFFIX: Final = ".ledger"
_LINKED_SECONDS: Final = 0.5
"""How long a file with two names may be its creator's, between ``link`` and ``unlink``."""


def default_directory() -> Path:
    """``gpubudget-ledger-<uid>`` in ``/dev/shm``, else in the temporary directory.

    >>> default_directory().name == f"gpubudget-ledger-{os.geteuid()}"
    True
    """
    if os.path.isdir("/dev/shm"):
        base = "/dev/shm"
    else:
        import tempfile  # here: it imports shutil and random

        base = tempfile.gettempdir()
    return Path(base) / f"gpubudget-ledger-{os.geteuid()}"


def ledger_directory() -> Path:
    """The directory this process registers in: ``GPUBUDGET_LEDGER_DIR`` if set, else the
    default.

    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, GPUBUDGET_LEDGER_DIR="/srv/gpu-ledger"):
    ...     ledger_directory()
    PosixPath('/srv/gpu-ledger')
    """
    named = os.environ.get(LEDGER_DIR_ENV, "").strip()
    return Path(named) if named else default_directory()


class LedgerDirectory:
    """An open, checked ledger directory (see the module docstring).

    ``create``: make the directory if it is missing (its parent must exist); otherwise a
    missing directory is a :class:`LedgerError`.
    """

    def __init__(self, path: Path, *, create: bool) -> None:
        self.path: Final = path
        self.private: Final = path == default_directory() and not os.environ.get(
            LEDGER_DIR_ENV, "").strip()
        if create:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise_if_from_outside(exc)
                raise LedgerError(f"cannot create the ledger directory {str(path)!r}: "
                                  f"{exc.strerror or exc}") from None
        try:
            self.fd: Final = os.open(path, _DIRECTORY_FLAGS)
        except OSError as exc:
            raise_if_from_outside(exc)
            raise LedgerError(f"cannot open the ledger directory {str(path)!r}: "
                              + _why(exc, os.path.islink(path))) from None
        try:
            self.mode: Final = self._checked(os.fstat(self.fd))
        except BaseException:
            os.close(self.fd)
            raise

    def _checked(self, info: os.stat_result) -> int:
        where = f"the ledger directory {str(self.path)!r}"
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid not in (os.geteuid(), 0):
            raise LedgerError(f"{where} belongs to uid {info.st_uid}, not to you "
                              f"(uid {os.geteuid()}) or root; remove it or set "
                              f"{LEDGER_DIR_ENV}")
        if self.private and (info.st_uid != os.geteuid() or mode & 0o022):
            raise LedgerError(f"{where} may be written by others (mode {mode:o}); it must be "
                              f"yours alone (chmod 700), or set {LEDGER_DIR_ENV}")
        if mode & 0o002 and not mode & stat.S_ISVTX:
            raise LedgerError(f"{where} may be written by anyone and is not sticky (mode "
                              f"{mode:o}); chmod +t it, or use a directory of your own")
        return mode

    def close(self) -> None:
        os.close(self.fd)

    def names(self) -> list[str]:
        """The ledger files in the directory, sorted."""
        return sorted(name for name in os.listdir(self.fd) if name.endswith(_SUFFIX)
                      and not name.startswith("."))

    @staticmethod
    def file_name(identity: str) -> str:
        """The file of a device (its identity, made safe for a file name)."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in identity)
        return f"{safe.strip('.') or 'device'}{_SUFFIX}"

    def open(self, name: str, *, writable: bool) -> tuple[int, Header]:
        """Open the ledger file ``name`` (read-only unless ``writable``), check it, and
        return its descriptor and header; ``FileNotFoundError`` if it does not exist."""
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
        deadline = time.monotonic() + _LINKED_SECONDS
        while True:
            try:
                fd = os.open(name, flags, dir_fd=self.fd)
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise_if_from_outside(exc)
                raise LedgerError(f"cannot open the ledger file {self._show(name)!r}: "
                                  + _why(exc)) from None
            # Two names for a moment: a creator between link() and unlink() (see create)
            if os.fstat(fd).st_nlink == 1 or time.monotonic() > deadline:
                break
            os.close(fd)
            time.sleep(0.001)
        try:
            return fd, self._check_file(fd, name)
        except BaseException:
            os.close(fd)
            raise

    def create(self, name: str, identity: str, label: str, total: int, hard: bool
               ) -> tuple[int, Header]:
        """Open the ledger file ``name``, creating it (whole, atomically) if it is missing."""
        try:
            return self.open(name, writable=True)
        except FileNotFoundError:
            pass
        temporary = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            os.fchmod(fd, self._file_mode())
            os.ftruncate(fd, FILE_BYTES)  # a file we just created, nobody else's
            os.pwrite(fd, encode_header(identity, label, total, hard), 0)
            os.link(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd,
                    follow_symlinks=False)
        except FileExistsError:  # another process made it meanwhile: use theirs
            return self.open(name, writable=True)
        except OSError as exc:
            raise_if_from_outside(exc)
            raise LedgerError(f"cannot create the ledger file {self._show(name)!r}: "
                              + _why(exc)) from None
        finally:
            os.close(fd)
            try:
                os.unlink(temporary, dir_fd=self.fd)
            except OSError as exc:
                raise_if_from_outside(exc)
        return self.open(name, writable=True)

    def _file_mode(self) -> int:
        """A ledger file may be written by whoever may write its directory."""
        return 0o600 | (0o060 if self.mode & 0o020 else 0) | (0o006 if self.mode & 0o002
                                                              else 0)

    def _check_file(self, fd: int, name: str) -> Header:
        where = f"the ledger file {self._show(name)!r}"
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LedgerError(f"{where} is not a regular file")
        if info.st_nlink != 1:
            raise LedgerError(f"{where} has {info.st_nlink} names (a hard link to another "
                              f"file?); remove it")
        if self.mode & 0o022 == 0 and info.st_uid != os.geteuid():
            raise LedgerError(f"{where} belongs to uid {info.st_uid}, not to you; remove it")
        try:  # the header first: a file of another format is another size too
            header = decode_header(os.pread(fd, HEADER_BYTES, 0)) if (
                info.st_size >= HEADER_BYTES) else None
        except ValueError as exc:
            raise LedgerError(f"{where}: {exc}; remove it") from None
        if info.st_size != FILE_BYTES or header is None:
            raise LedgerError(f"{where} is {info.st_size} bytes, not {FILE_BYTES}: not a "
                              f"gpubudget ledger, or damaged; remove it")
        return header

    def _show(self, name: str) -> str:
        return str(self.path / name)


def _why(exc: OSError, link: bool = False) -> str:
    import errno

    if exc.errno == errno.ELOOP or link:
        return "it is a symbolic link, which gpubudget never follows"
    if exc.errno == errno.ENOTDIR:
        return "it is not a directory"
    return exc.strerror or str(exc)
