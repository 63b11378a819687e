"""``gpubudget top``: the view as text and JSON, sorted and filtered, in a real terminal (a
pty, and tmux where it is installed) with budgets of several processes; a bad ledger is one
line and exit status 2."""

from __future__ import annotations

import datetime
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubudget.cli import main
from gpubudget.cli.top import SORT_KEYS, TopOptions, render
from gpubudget.hostledger import DeviceView, Entry, HostView
from gpubudget.units import GiB, MiB
from tests.helpers import subprocess_env
from tests.test_hostledger_claims import Worker


@pytest.fixture(autouse=True)
def _ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "8GiB")


@pytest.fixture
def busy() -> Iterator[list[Worker]]:
    """Two processes with three root budgets, one with a name made to attack terminals."""
    first, second = Worker(), Worker()
    try:
        assert first.ask("enter 2GiB detector").startswith("ok")
        assert first.ask("allocate 1048576").startswith("ok")
        assert first.ask("enter 1GiB cls\x1b[2J").startswith("ok")
        assert second.ask("enter 50% trainer").startswith("ok")
        assert second.ask("allocate 314572800").startswith("ok")
        assert second.ask("allocate 99999999999").startswith("denied")
        yield [first, second]
    finally:
        first.close()
        second.close()


def entry(pid: int, name: str, limit: int, used: int, peak: int, denials: int,
          process: str = "python serve.py") -> Entry:
    return Entry(slot=0, state="reserved", pid=pid, start=1, pidns=1, boot=1, limit=limit,
                 claim=limit, reserved=limit, used=used, peak=peak, denials=denials,
                 claimed_at=0, reserved_at=0, ordinal=0, share=None, serial=1, name=name,
                 process=process)


def view() -> HostView:
    gpu = DeviceView("GPU-8f3c", "NVIDIA H200", 140 * GiB, 120 * GiB, False, (
        entry(10, "detector", 40 * GiB, 12 * GiB, 20 * GiB, 3),
        entry(10, "classifier", 30 * GiB, 20 * GiB, 21 * GiB, 0),
        entry(22, "llm", 50 * GiB, 5 * GiB, 49 * GiB, 7, "vllm serve"),
    ), 1, {10: 71 * GiB, 22: 51 * GiB, 33: 2 * GiB})
    return HostView("/dev/shm/ledger", datetime.datetime(2026, 11, 30, 12, 0, 0,
                                                         tzinfo=datetime.timezone.utc),
                    (gpu,), None)


def budgets(lines: list[str]) -> list[str]:
    """The budget column of the rows."""
    return [line.split()[3] if line.split()[2] in ("serve.py", "serve") else line.split()[2]
            for line in lines[4:]]


def test_rows_are_sorted_by_each_key_either_way() -> None:
    lines = render(view())
    assert lines[2] == ("GPU-8f3c NVIDIA H200 · 140.00 GiB · cap 120.00 GiB · claimed 120.00 "
                        "GiB by 3 budgets in 2 processes · used 37.00 GiB · 1 ended not yet "
                        "cleared")
    assert lines[3].split() == ["PID", "PROCESS", "BUDGET", "LIMIT", "USED", "PEAK", "DENIED",
                                "OUTSIDE"]
    assert lines[4].split() == ["10", "python", "serve.py", "classifier", "30.00", "GiB",
                                "20.00", "GiB", "21.00", "GiB", "0", "1.00", "GiB"]
    assert budgets(lines) == ["classifier", "detector", "llm", "(no"]
    expected = {"used": ["classifier", "detector", "llm", "(no"],
                "limit": ["llm", "detector", "classifier", "(no"],
                "peak": ["llm", "classifier", "detector", "(no"],
                "denials": ["llm", "detector", "classifier", "(no"],
                "outside": ["(no", "classifier", "detector", "llm"],
                "pid": ["classifier", "detector", "llm", "(no"],
                "budget": ["(no", "classifier", "detector", "llm"],
                "process": ["(no", "classifier", "detector", "llm"]}
    assert set(expected) == set(SORT_KEYS)
    for key, order in expected.items():
        assert budgets(render(view(), TopOptions(sort=key))) == order, key
    for key, order in {"used": ["(no", "llm", "detector", "classifier"],
                       "outside": ["classifier", "detector", "llm", "(no"],  # ties as they were
                       "budget": ["llm", "detector", "classifier", "(no"]}.items():
        assert budgets(render(view(), TopOptions(sort=key, reverse=True))) == order, key
    assert "sort used ▼" in lines[0] and "sort budget ▲" in render(
        view(), TopOptions(sort="budget"))[0]


def test_the_filter_keeps_matching_rows_or_a_whole_matching_device() -> None:
    assert budgets(render(view(), TopOptions(filter="VLLM"))) == ["llm"]
    assert budgets(render(view(), TopOptions(filter="10"))) == ["classifier", "detector"]
    assert len(budgets(render(view(), TopOptions(filter="h200")))) == 4
    lines = render(view(), TopOptions(filter="nothing"))
    assert "filter 'nothing'" in lines[0] and lines[-1] == "no budget matches the filter"


def test_names_from_other_processes_are_escaped() -> None:
    evil = DeviceView("host", "host memory", GiB, None, True,
                      (entry(1, "a\x1b]0;PWNED\x07", GiB, 0, 0, 0, "x\x1b[2J"),), 0, None)
    text = "\n".join(render(HostView("d", view().taken_at, (evil,), "no NVML")))
    assert "\x1b" not in text and "\x07" not in text and "a\\x1b]0;PWNED\\x07" in text


def test_once_and_json_show_the_budgets_of_several_processes(
        busy: list[Worker], capsys: pytest.CaptureFixture[str]) -> None:
    first, second = busy
    assert main(["top", "--once"]) == 0
    out = capsys.readouterr().out
    assert "claimed 5.50 GiB by 3 budgets in 2 processes" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(
        (str(first.pid), str(second.pid)))]
    assert [(row[0], row[4]) for row in rows] == [  # process: "python -m tests.ledger_…"
        (str(second.pid), "trainer"), (str(first.pid), "detector"),
        (str(first.pid), "cls\\x1b[2J")]
    assert rows[0][5:10] == ["2.50", "GiB", "300.00", "MiB", "300.00"] and rows[0][11] == "1"
    assert main(["top", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (device,) = data["devices"]
    assert {(b["pid"], b["budget"], b["used"], b["denials"]) for b in device["budgets"]} == {
        (first.pid, "detector", MiB, 0), (first.pid, "cls\x1b[2J", 0, 0),
        (second.pid, "trainer", 300 * MiB, 1)}
    assert main(["top"]) == 0  # not a terminal: once, as text
    assert "trainer" in capsys.readouterr().out


def run_in_pty(args: list[str], keys: list[tuple[str, str]], *, rows: int = 24,
               cols: int = 150, timeout: float = 30.0) -> tuple[int, str]:
    """Run ``gpubudget ARGS`` in a pseudo-terminal of ``rows`` x ``cols``; for each ``(text,
    key)`` of ``keys``, wait for ``text`` to be drawn, then type ``key``. Return the exit
    status and everything the program wrote to the terminal."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "gpubudget", *args], stdin=slave,
                               stdout=slave, stderr=slave, close_fds=True,
                               env=subprocess_env(TERM="xterm-256color"))
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if keys and keys[0][0].encode() in seen:
                time.sleep(0.1)
                os.write(master, keys.pop(0)[1].encode())
            ready, _, _ = select.select([master], [], [], 0.1)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the program ended and closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        status = process.wait(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
    return status, seen.decode("utf-8", "replace")


def test_the_live_view_in_a_terminal_shows_several_processes_and_quits_on_q(
        busy: list[Worker]) -> None:
    first, second = busy
    status, drawn = run_in_pty(["top"], [("trainer", "q")])
    assert status == 0 and "Traceback" not in drawn
    # curses draws runs of blanks as cursor moves: look for words, not phrases
    for text in ("detector", "trainer", "cls\\x1b[2J", str(first.pid), str(second.pid),
                 "claimed", "5.50", "300.00", "PROCESS", "DENIED"):
        assert text in drawn, text


def test_a_bad_ledger_in_a_terminal_is_one_line_and_exit_2(tmp_path: Path,
                                                            busy: list[Worker]) -> None:
    (tmp_path / "ledger" / "GPU-bad.ledger").write_bytes(b"not a ledger")
    status, drawn = run_in_pty(["top"], [])
    lines = [line for line in drawn.replace("\r", "").splitlines() if line.strip()]
    assert status == 2 and "Traceback" not in drawn
    assert lines == [f"gpubudget: error: the ledger file "
                     f"'{tmp_path / 'ledger' / 'GPU-bad.ledger'}' is 12 bytes, not 1052672: "
                     f"not a gpubudget ledger, or damaged; remove it"]
    assert main(["top", "--json"]) == 2


def test_bad_arguments_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    assert main(["top", "--sort", "size"]) == 2
    assert "argument --sort: invalid choice: 'size'" in capsys.readouterr().err
    assert main(["top", "--interval", "0"]) == 2
    assert "--interval '0' is not a number of seconds from 0.1 to 3600" in \
        capsys.readouterr().err
    assert main(["top", "--once", "--ledger-dir", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("gpubudget: error: cannot open the ledger "
                                              "directory")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_sorting_and_filtering_keys_in_tmux(busy: list[Worker], tmp_path: Path) -> None:
    session = f"gpubudget-top-{uuid.uuid4().hex[:8]}"
    env = subprocess_env()
    command = " ".join([f"env PYTHONPATH={env['PYTHONPATH']}",
                        f"GPUBUDGET_LEDGER_DIR={tmp_path / 'ledger'}", sys.executable,
                        "-m gpubudget top; echo EXIT=$?; sleep 30"])
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "20",
                    command], check=True)

    def screen(until: str) -> list[str]:
        deadline = time.monotonic() + 20
        while True:
            shown = subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                   capture_output=True, text=True).stdout
            if until in shown or time.monotonic() > deadline:
                return [line for line in shown.splitlines() if line.strip()]
            time.sleep(0.1)

    def keys(*typed: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", session, *typed], check=True)

    try:
        first = screen("trainer")
        assert [line.split()[4] for line in first[3:]] == ["trainer", "detector",
                                                           "cls\\x1b[2J"]
        keys("s")  # sort by limit
        by_limit = screen("sort limit")
        assert [line.split()[4] for line in by_limit[3:]] == ["trainer", "detector",
                                                              "cls\\x1b[2J"]
        keys("r")  # smallest first
        reversed_ = screen("sort limit ▲")
        assert [line.split()[4] for line in reversed_[3:]] == ["cls\\x1b[2J", "detector",
                                                               "trainer"]
        keys("/", "d", "e", "t", "Enter")
        filtered = screen("filter 'det'")
        assert [line.split()[4] for line in filtered[3:]] == ["detector"]
        keys("c")
        assert len(screen("sort limit ▲ ·")[3:]) == 3
        keys("q")
        assert "EXIT=0" in "\n".join(screen("EXIT="))
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
