"""gpubudget.hostledger.procs: a process is known by pid and start time, so a pid reused by
another process is not its owner; another boot is dead; another PID namespace cannot be told."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpubudget.hostledger import procs


def test_this_process_is_alive_and_a_finished_one_is_not() -> None:
    me = procs.myself()
    assert me.pid == os.getpid() and me.start == procs.start_time(os.getpid()) and me.start
    assert procs.alive(me.pid, me.start, me.pidns, me.boot) is True
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    pid = int(finished.stdout)
    assert procs.start_time(pid) is None
    assert procs.alive(pid, 12345, me.pidns, me.boot) is False


def test_a_pid_with_another_start_time_is_another_process() -> None:
    me = procs.myself()
    assert procs.alive(me.pid, me.start + 1, me.pidns, me.boot) is False
    parent = os.getppid()
    assert procs.alive(parent, procs.start_time(parent) or 0, me.pidns, me.boot) is True
    assert procs.alive(parent, 1, me.pidns, me.boot) is False


def test_another_boot_is_dead_and_another_namespace_unknown() -> None:
    me = procs.myself()
    if not me.boot or not me.pidns:
        pytest.skip("no /proc boot id or PID namespace here")
    assert procs.alive(me.pid, me.start, me.pidns, me.boot ^ 1) is False
    assert procs.alive(me.pid, me.start, me.pidns + 1, me.boot) is None


def test_start_times_survive_command_names_with_spaces_and_parentheses() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import ctypes, sys, time; "
         "ctypes.CDLL(None).prctl(15, b'x) 1 2 (y', 0, 0, 0); print(flush=True); "
         "time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline()  # renamed (PR_SET_NAME)
        with open(f"/proc/{child.pid}/stat", "rb") as stat:
            assert b"(x) 1 2 (y)" in stat.read()
        assert procs.start_time(child.pid) == procs.start_time(child.pid) is not None
        assert procs.start_time(child.pid) >= procs.myself().start  # type: ignore[operator]
    finally:
        child.kill()
        child.wait()


def test_the_process_title_is_its_command_line() -> None:
    title = procs.process_title()
    assert title.split()[0] == os.path.basename(open("/proc/self/cmdline", "rb").read()
                                                .split(b"\0")[0].decode())
    assert "pytest" in title or "py" in title


@pytest.mark.parametrize("pid", [0, 2**31, 2**64 - 1])
def test_a_pid_no_system_gives_is_a_process_that_ended(pid: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    me = procs.myself()
    assert procs.alive(pid, 1, me.pidns, me.boot) is False
    monkeypatch.setattr(procs, "_PROC", "/no/proc/here")  # where os.kill would be asked
    assert procs.alive(pid, 1, me.pidns, me.boot) is False


def test_a_signal_handlers_timeout_reading_proc_propagates_not_taken_for_an_ended_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def alarm(*args: object, **kwargs: object) -> None:
        raise TimeoutError("alarm")  # an OSError without an error number

    def missing(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError(2, "No such file or directory")

    me = procs.myself()
    other = os.getppid()
    monkeypatch.setattr(procs, "open", missing, raising=False)
    assert procs.start_time(other) is None  # the system's answer: no such process
    assert procs.alive(other, 1, me.pidns, me.boot) is False
    monkeypatch.setattr(procs, "open", alarm, raising=False)
    for read in (lambda: procs.start_time(other), lambda: procs.alive(other, 1, me.pidns,
                                                                      me.boot),
                 procs.process_title, procs.boot_id.__wrapped__):
        with pytest.raises(TimeoutError, match="alarm"):
            read()
