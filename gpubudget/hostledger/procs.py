"""Which process owns a slot, and whether it still runs.

A slot records its process's pid with the process's start time (``/proc/PID/stat``, clock
ticks after boot), its PID namespace and the boot it ran in. A pid the kernel has given to a
new process since has another start time, so a reused pid is never taken for the owner. A
slot written in another boot is dead. Where the slot's PID namespace is not the reader's (a
ledger directory shared between containers), its pid means nothing here: the answer is then
``None`` and the caller asks the slot's lock instead (see :mod:`gpubudget.hostledger.book`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import cache
from typing import Final

from ..errors import raise_if_from_outside

__all__ = ["ProcessIdentity", "alive", "boot_id", "myself", "pid_namespace", "process_title",
           "start_time"]

_PROC: Final = "/proc"
_PID_MAX: Final = 2**31 - 1
"""The largest pid any system gives (``pid_t`` is a signed 32-bit number)."""


@cache
def boot_id() -> int:
    """This boot's identity (the first 64 bits of ``/proc/sys/kernel/random/boot_id``), 0
    where unknown."""
    try:
        with open(f"{_PROC}/sys/kernel/random/boot_id", encoding="ascii") as file:
            return int(file.read().strip().replace("-", "")[:16], 16)
    except (OSError, ValueError) as exc:
        raise_if_from_outside(exc)
        return 0


def pid_namespace() -> int:
    """The inode of this process's PID namespace, 0 where unknown."""
    try:
        return os.stat(f"{_PROC}/self/ns/pid").st_ino
    except OSError as exc:
        raise_if_from_outside(exc)
        return 0


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; ``None`` if there is no such
    process (or no ``/proc``).

    >>> start_time(os.getpid()) == start_time(os.getpid()) is not None
    True
    """
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as file:
            data = file.read()
    except OSError as exc:
        raise_if_from_outside(exc)  # or another root's slot would be taken for a dead one's
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; field 22 is the
    # start time, the 20th after the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    """What makes a process unique on a host, for as long as the host runs."""

    pid: int
    start: int
    pidns: int
    boot: int


@cache
def _identity(pid: int) -> ProcessIdentity:
    return ProcessIdentity(pid, start_time(pid) or 0, pid_namespace(), boot_id())


def myself() -> ProcessIdentity:
    """This process (computed once per pid, so a forked child gets its own)."""
    return _identity(os.getpid())


def alive(pid: int, start: int, pidns: int, boot: int) -> bool | None:
    """Whether the process a slot names still runs: ``False`` for certain if it ended (or
    its pid now belongs to another process), ``True`` if it runs, ``None`` when this process
    cannot tell (another PID namespace)."""
    me = myself()
    if not 0 < pid <= _PID_MAX or (boot and me.boot and boot != me.boot):
        return False  # no process has that pid (a damaged slot), or another boot's
    if pidns and me.pidns and pidns != me.pidns:
        return None
    if pid == me.pid:
        return start in (0, me.start)
    if os.path.isdir(_PROC):
        now = start_time(pid)
        return now is not None and (not start or now == start)
    try:  # no /proc (macOS): whether the pid exists at all
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def process_title() -> str:
    """This process as ``ps`` shows it: its command line, the program without its directory
    (what Ray's workers set as their title, ``ray::Model``, included)."""
    try:
        with open(f"{_PROC}/self/cmdline", "rb") as file:
            words = [word.decode("utf-8", "replace") for word in file.read().split(b"\0")
                     if word]
    except OSError as exc:
        raise_if_from_outside(exc)
        words = [sys.executable, *sys.argv]
    if not words:
        return f"pid {os.getpid()}"
    return " ".join([os.path.basename(words[0]), *words[1:]])
