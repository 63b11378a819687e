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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpubudget.cli import main
from gpubudget.cli.top import SORT_KEYS, TopOptions, render
from gpubudget.hostledger import ChildBudget, DeviceView, Entry, HostView
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


def table(lines: list[str]) -> list[list[str]]:
    """The rows of the (first) table, split on blanks: the lines after its column titles."""
    start = next(index for index, line in enumerate(lines) if line.split()[:1] == ["PID"])
    return [line.split() for line in lines[start + 1:] if line.strip()]


def budgets(lines: list[str]) -> list[str]:
    """The budget column of the rows."""
    return [row[3] if row[1] in ("python", "vllm") else row[2] for row in table(lines)]


def test_rows_are_sorted_by_each_key_either_way() -> None:
    lines = render(view())
    assert lines[2] == ("GPU-8f3c NVIDIA H200 · 140.00 GiB · cap 120.00 GiB · claimed 120.00 "
                        "GiB · 3 budgets in 2 processes · unclaimed 0 B · used 37.00 GiB · 1 "
                        "ended not yet cleared")
    assert lines[3].split() == ["PID", "PROCESS", "BUDGET", "LIMIT", "USED", "FREE", "PEAK",
                                "DENIED", "OUTSIDE"]
    assert lines[4].split() == ["10", "python", "serve.py", "classifier", "30.00", "GiB",
                                "20.00", "GiB", "10.00", "GiB", "21.00", "GiB", "0", "1.00",
                                "GiB"]
    assert budgets(lines) == ["classifier", "detector", "llm", "(no"]
    expected = {"used": ["classifier", "detector", "llm", "(no"],
                "limit": ["llm", "detector", "classifier", "(no"],
                "free": ["llm", "detector", "classifier", "(no"],
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


def two_devices() -> HostView:
    gpu = view().devices[0]
    other = DeviceView("GPU-77aa", "NVIDIA L4", 24 * GiB, None, False, (
        entry(40, "embedder", 4 * GiB, GiB, GiB, 0, "python embed.py"),), 0, None)
    return HostView("/dev/shm/ledger", view().taken_at, (gpu, other), None)


def test_the_filter_matches_rows_never_a_whole_device() -> None:
    assert budgets(render(view(), TopOptions(filter="VLLM"))) == ["llm"]
    assert budgets(render(view(), TopOptions(filter="10"))) == ["classifier", "detector"]
    # the device's name holds "h200" and its UUID "8f3c": neither matches its rows
    for text in ("h200", "8f3c"):
        lines = render(view(), TopOptions(filter=text))
        assert lines[-1] == "no budget matches the filter" and "PID" not in "".join(lines)
    lines = render(view(), TopOptions(filter="nothing"))
    assert "filter 'nothing'" in lines[0] and lines[-1] == "no budget matches the filter"


def test_devices_are_chosen_apart_by_uuid_or_name() -> None:
    both = render(two_devices())
    assert sum(line.startswith("GPU-") for line in both) == 2
    for text, kept in (("l4", "embedder"), ("77AA", "embedder"), ("h200", "classifier")):
        lines = render(two_devices(), TopOptions(device=text))
        assert sum(line.startswith("GPU-") for line in lines) == 1, text
        assert f"device {text!r}" in lines[0] and kept in budgets(lines)
    lines = render(two_devices(), TopOptions(device="l4", filter="classifier"))
    assert lines[-1] == "no budget matches the filter"


@pytest.mark.parametrize("width, columns", [
    (150, ["PID", "PROCESS", "BUDGET", "LIMIT", "USED", "FREE", "PEAK", "DENIED", "OUTSIDE"]),
    (100, ["PID", "PROCESS", "BUDGET", "LIMIT", "USED", "FREE", "PEAK", "DENIED", "OUTSIDE"]),
    (80, ["PID", "BUDGET", "LIMIT", "USED", "FREE", "PEAK", "DENIED"]),
    (70, ["PID", "BUDGET", "LIMIT", "USED", "FREE", "DENIED"]),
    (50, ["PID", "BUDGET", "LIMIT", "USED"]),
    (40, ["PID", "BUDGET", "USED"]),
])
def test_a_narrow_terminal_gets_fewer_columns_never_cut_ones(width: int,
                                                             columns: list[str]) -> None:
    lines = render(two_devices(), TopOptions(), width)
    assert max(len(line) for line in lines) <= width
    assert [line.split() for line in lines if line.split()[:1] == ["PID"]] == [columns] * 2
    row = next(line for line in lines if "classifier" in line)
    assert "20.00 GiB" in row  # sizes whole
    text = "\n".join(lines)
    assert "unclaimed 0 B" in text and "claimed 120.00 GiB" in text  # wrapped, not cut
    assert "embedder" in text  # names shrink only as far as they must


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
    assert "claimed 5.50 GiB · 3 budgets in 2 processes" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(
        (str(first.pid), str(second.pid)))]
    assert [(row[0], row[4]) for row in rows] == [  # process: "python -m tests.ledger_…"
        (str(second.pid), "trainer"), (str(first.pid), "detector"),
        (str(first.pid), "cls\\x1b[2J")]
    assert rows[0][5:12] == ["2.50", "GiB", "300.00", "MiB", "2.21", "GiB", "300.00"]
    assert rows[0][13] == "1"
    assert main(["top", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (device,) = data["devices"]
    assert {(b["pid"], b["budget"], b["used"], b["denials"]) for b in device["budgets"]} == {
        (first.pid, "detector", MiB, 0), (first.pid, "cls\x1b[2J", 0, 0),
        (second.pid, "trainer", 300 * MiB, 1)}
    assert main(["top"]) == 0  # not a terminal: once, as text
    assert "trainer" in capsys.readouterr().out


def run_in_pty(args: list[str], keys: list[tuple[str, str]], *, rows: int = 24,
               cols: int = 150, timeout: float = 120.0) -> tuple[int, str]:
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
            if keys and keys[0][0].encode() in seen:  # a frame is drawn whole before a key
                os.write(master, keys.pop(0)[1].encode())  # is read: none is lost
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
                     f"'{tmp_path / 'ledger' / 'GPU-bad.ledger'}' is 12 bytes, not 3149824: "
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


class Tmux:
    """``gpubudget top`` in a tmux session of its own, on a tmux server of its own (whatever
    else runs tmux on the machine), read with ``capture-pane``."""

    def __init__(self, ledger: Path, width: int, height: int = 20) -> None:
        self.session = f"gpubudget-top-{uuid.uuid4().hex[:8]}"
        self.tmux = ["tmux", "-L", self.session]  # the server's socket
        env = subprocess_env()
        command = " ".join([f"env PYTHONPATH={env['PYTHONPATH']}",
                            f"GPUBUDGET_LEDGER_DIR={ledger}", sys.executable,
                            "-m gpubudget top; echo EXIT=$?; sleep 600"])
        subprocess.run([*self.tmux, "new-session", "-d", "-s", self.session, "-x", str(width),
                        "-y", str(height), command], check=True)

    def lines(self) -> list[str]:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", self.session],
                              capture_output=True, text=True).stdout.splitlines()

    def until(self, what: str, state: Callable[[list[str]], bool]) -> list[str]:
        """The screen once ``state`` holds of it: each key's test waits for what only that
        key can bring about (polling, as nothing else tells when tmux has drawn); 120 s
        without it fails the test, showing the screen."""
        deadline = time.monotonic() + 120
        while True:
            shown = self.lines()
            try:
                if state(shown):
                    return shown
            except (StopIteration, IndexError, ValueError):
                pass  # a frame half drawn
            if time.monotonic() > deadline:
                pytest.fail(f"top never showed {what}; the screen:\n" + "\n".join(shown))
            time.sleep(0.05)

    def keys(self, *typed: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", self.session, *typed], check=True)

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


def header(lines: list[str]) -> str:
    """The title lines, joined (they wrap on a narrow terminal)."""
    return " ".join(lines[:lines.index("")] if "" in lines else lines)


def names(lines: list[str]) -> list[str]:
    """The budget column of the rows, the process column being ``python -m tests.ledger…``."""
    return [row[4] for row in table(lines)]


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@needs_tmux
def test_sorting_and_filtering_keys_in_tmux(busy: list[Worker], tmp_path: Path) -> None:
    top = Tmux(tmp_path / "ledger", 150)
    everyone = ["trainer", "detector", "cls\\x1b[2J"]
    try:
        top.until("the three roots", lambda s: "sort used ▼" in header(s) and names(s) == everyone)
        top.keys("s")  # sort by limit, largest first
        top.until("sorted by limit", lambda s: "sort limit ▼" in header(s)
                  and names(s) == everyone)
        top.keys("r")  # smallest first
        top.until("the order reversed", lambda s: "sort limit ▲" in header(s)
                  and names(s) == everyone[::-1])
        top.keys("/", "d", "e", "t")
        top.until("the filter being typed", lambda s: "filter 'det' (typing" in header(s)
                  and names(s) == ["detector"])
        top.keys("Enter")
        top.until("the filter kept", lambda s: "filter 'det'" in header(s)
                  and "typing" not in header(s) and names(s) == ["detector"])
        top.keys("c")
        top.until("the filter cleared", lambda s: "· filter '" not in header(s)
                  and names(s) == everyone[::-1])
        top.keys("q")
        top.until("the exit", lambda s: "EXIT=0" in s)
    finally:
        top.close()


@needs_tmux
def test_a_narrow_terminal_adapts_and_follows_a_resize_in_tmux(busy: list[Worker],
                                                              tmp_path: Path) -> None:
    top = Tmux(tmp_path / "ledger", 60)
    try:
        narrow = top.until("the narrow table", lambda s: [line.split() for line in s if line
                           .split()[:1] == ["PID"]] == [["PID", "BUDGET", "LIMIT", "USED",
                                                         "FREE"]])
        assert all(len(line) <= 60 for line in narrow) and "…" not in "".join(
            line for line in narrow if line.split()[:1] == ["PID"])
        subprocess.run([*top.tmux, "resize-window", "-t", top.session, "-x", "150"], check=True)
        top.until("all the columns after the resize", lambda s: "OUTSIDE" in next(
            line for line in s if line.split()[:1] == ["PID"]))
        top.keys("q")
        top.until("the exit", lambda s: "EXIT=0" in s)
    finally:
        top.close()


# -- child budgets ---------------------------------------------------------------------------


def family_view() -> HostView:
    """Two roots of one process; the first with a tree of children and two hidden."""
    kids = (ChildBudget("backbone", 1, 20 * GiB, GiB, 8 * GiB, 9 * GiB, 12 * GiB),
            ChildBudget("stem", 2, 4 * GiB, 0, GiB, 2 * GiB, 3 * GiB),
            ChildBudget("blocks", 2, 12 * GiB, 0, 7 * GiB, 7 * GiB, 5 * GiB),
            ChildBudget("head", 1, 2 * GiB, 0, 0, MiB, 2 * GiB))
    detector = entry(10, "detector", 40 * GiB, 12 * GiB, 20 * GiB, 3)._replace(slot=0, hidden=2)
    classifier = entry(10, "classifier", 30 * GiB, 20 * GiB, 21 * GiB, 0)._replace(slot=1)
    gpu = DeviceView("GPU-8f3c", "NVIDIA H200", 140 * GiB, None, False,
                     (detector, classifier), 0, None, {0: kids})
    return HostView("/dev/shm/ledger", view().taken_at, (gpu,), "no NVML")


def tree(lines: list[str]) -> list[str]:
    """The BUDGET column of the table's rows, as drawn (the tree before a child's name)."""
    start = next(index for index, line in enumerate(lines) if line.split()[:1] == ["PID"])
    budget_at = lines[start].index("BUDGET")
    return [row[budget_at:].split("  ")[0] for row in lines[start + 1:]]


def test_children_are_drawn_as_a_tree_under_their_root() -> None:
    lines = render(family_view())
    assert "2 child budgets hidden (no room in the ledger)" in lines[2]
    whole = ["detector", "├ backbone", "│ ├ stem", "│ └ blocks", "└ head", "… 2 hidden"]
    assert tree(lines) == ["classifier", *whole]  # sorted by used: the roots, each with its
    stem = next(line for line in lines if "stem" in line)  # children under it
    assert stem.split()[3:] == ["4.00", "GiB", "1.00", "GiB", "3.00", "GiB", "2.00", "GiB",
                                "-"]  # limit, used, free, peak; no denials of its own
    assert tree(render(family_view(), TopOptions(reverse=True))) == [*whole, "classifier"]
    for text in ("STEM", "detector"):  # a child's name keeps its root, with all of its tree
        assert tree(render(family_view(), TopOptions(filter=text))) == whole, text
    narrow = render(family_view(), width=50)
    assert max(map(len, narrow)) <= 50 and any("│ └ blocks" in line for line in narrow)


def test_json_nests_the_children_of_another_process(capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    worker = Worker()
    try:
        assert worker.ask("enter 2GiB server").startswith("ok")
        assert worker.ask("child 1GiB model").startswith("ok")
        assert worker.ask("allocate 1048576").startswith("ok")
        assert worker.ask("child 256MiB cache").startswith("ok")
        assert main(["top", "--json"]) == 0
        (budget,) = json.loads(capsys.readouterr().out)["devices"][0]["budgets"]
        assert (budget["budget"], budget["used"], budget["children_hidden"]) == (
            "server", MiB, 0)
        assert budget["children"] == [{
            "budget": "model", "limit": GiB, "reserve": 0, "used": MiB, "peak": MiB,
            "free": GiB - MiB, "children": [{
                "budget": "cache", "limit": 256 * MiB, "reserve": 0, "used": 0, "peak": 0,
                "free": 256 * MiB, "children": []}]}]
        assert worker.ask("leave").startswith("ok")
        assert main(["top", "--json"]) == 0
        (budget,) = json.loads(capsys.readouterr().out)["devices"][0]["budgets"]
        assert [child["budget"] for child in budget["children"]] == ["model"]
        assert budget["children"][0]["children"] == []
    finally:
        worker.close()


@needs_tmux
def test_children_appear_and_vanish_in_tmux(tmp_path: Path) -> None:
    worker = Worker()
    top = Tmux(tmp_path / "ledger", 150)
    try:
        assert worker.ask("enter 2GiB server").startswith("ok")
        assert worker.ask("child 1GiB model").startswith("ok")
        assert worker.ask("child 256MiB cache").startswith("ok")
        top.until("the tree", lambda s: [row[:2] for row in table(s)] == [
            [str(worker.pid), "python"], ["└", "model"], ["└", "cache"]])
        assert worker.ask("leave").startswith("ok")  # cache goes: it was drawn before
        top.until("cache gone", lambda s: [row[:2] for row in table(s)] == [
            [str(worker.pid), "python"], ["└", "model"]])
        assert worker.ask("leave").startswith("ok")
        top.until("model gone", lambda s: [row[:2] for row in table(s)] == [
            [str(worker.pid), "python"]])
        top.keys("q")
        top.until("the exit", lambda s: "EXIT=0" in s)
    finally:
        top.close()
        worker.close()
