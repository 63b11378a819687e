"""``gpubudget view`` of hostile PyTorch snapshots: small files of plain data (nothing in them
runs) built to cost time or memory, or to break the reader. Each is read in bounded time and
memory, in a process whose address space is capped well under what the attack asks for, and
answers one line naming the file and the field (exit status 2), or a page where the data is
odd but readable."""

from __future__ import annotations

import pickle
import resource
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gpubudget.tracefile import MAX_TEXT
from gpubudget.viewer import write_page
from gpubudget.viewer.torchsnap import model_from_torch_snapshot

from tests.helpers import subprocess_env

CAP = 2 << 30  # the address space the command runs in: far under what an attack asks for


def splice(data: object, deep: bytes) -> bytes:
    """``data`` pickled (protocol 2: no frames to keep in step) with the string ``"@@"`` in
    it replaced by the opcodes ``deep``."""
    text = pickle.dumps(data, protocol=2)
    marker = pickle.dumps("@@", protocol=2)[2:-3]  # the string's opcodes, not its memo
    assert text.count(marker) == 1
    return text.replace(marker, deep)


def alloc(**fields: Any) -> dict[str, Any]:
    return {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1, **fields}


def bomb() -> list[Any]:
    """A list of 2**40 leaves in 40 shared levels: a few hundred bytes pickled, its repr
    never ends."""
    found: list[Any] = []
    for _ in range(40):
        found = [found, found]
    return found


DEEP = b"(" * 200_000 + b"]" + b"l" * 200_000  # a list 200,000 lists deep


def view(tmp_path: Path, data: bytes, limit: int = CAP) -> subprocess.CompletedProcess[str]:
    """``gpubudget view`` of ``data`` in a process of its own, its address space capped."""
    snapshot = tmp_path / "hostile.pickle"
    snapshot.write_bytes(data)

    def cap() -> None:  # pragma: no cover - runs in the child
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run([sys.executable, "-m", "gpubudget", "view", str(snapshot), "-o",
                           str(tmp_path / "out.html")], capture_output=True, text=True,
                          timeout=300, env=subprocess_env(), preexec_fn=cap)


@pytest.mark.parametrize(("data", "field", "said"), [
    (pickle.dumps({"device_traces": [[alloc(size=bomb())]]}), "device_traces[0][0]['size']",
     "is a list of 2, not a whole number"),
    (pickle.dumps({"device_traces": [[alloc(pool_id=bomb())]]}),
     "device_traces[0][0]['pool_id']", "is a list of 2, not a pair of integers"),
    (pickle.dumps({"segments": bomb()[0]}), "segments[0]", "is a list of 2, not a dictionary"),
    (splice({"device_traces": [[alloc(size="@@")]]}, DEEP), "device_traces[0][0]['size']",
     "is a list of 1, not a whole number"),
    (splice({"device_traces": [[alloc(frames="@@")]]}, DEEP),
     "device_traces[0][0]['frames'][0]", "is a list of 1, not a dictionary"),
    (pickle.dumps({"device_traces": [[alloc(size=10**5000)]]}), "device_traces[0][0]['size']",
     "is a number of 16610 bits"),
    (pickle.dumps({"device_traces": [[alloc(time_us=-1)]]}), "device_traces[0][0]['time_us']",
     "is -1, not a whole number"),
])
def test_a_hostile_value_is_one_line_naming_the_file_and_field(
        tmp_path: Path, data: bytes, field: str, said: str) -> None:
    assert len(data) < 3_000_000
    done = view(tmp_path, data)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "hostile.pickle" in done.stderr, done.stderr
    assert f"{field} {said}" in done.stderr, done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("times", [(0, 0), (0, 2**64 - 1), (2**64 - 1, 2**64 - 1)])
def test_odd_clocks_still_give_a_page(tmp_path: Path, times: tuple[int, int]) -> None:
    """``time_us`` 0 throughout, or 2**64 - 1 (585,000 years): a page, no internal error."""
    data = pickle.dumps({"device_traces": [[
        alloc(time_us=times[0]), alloc(action="free_completed", time_us=times[1])]]})
    done = view(tmp_path, data)
    assert done.returncode == 0, done.stderr
    assert "viewer written to" in done.stdout and done.stderr == ""


def test_a_small_snapshot_asks_for_no_more_memory_than_it_holds(tmp_path: Path) -> None:
    """A 400-byte snapshot is read as 400 bytes, not into a buffer the size of the
    --max-size limit (4 GiB: over the cap this process runs under)."""
    data = pickle.dumps({"segments": [], "device_traces": [[alloc(), alloc(
        action="free_completed", time_us=2)]]})
    assert len(data) < 400
    done = view(tmp_path, data)
    assert done.returncode == 0, done.stderr
    assert "viewer written to" in done.stdout


def test_a_frame_shared_thousands_of_times_is_formatted_once(tmp_path: Path) -> None:
    """One frame of a 100 KB file name, referenced 2,000 times in a stack, and 2,000 frames
    sharing that name: a few hundred kilobytes of pickle. Each frame is formatted once and
    every text cut to the trace format's length: megabytes of memory, not the gigabytes a
    text per reference would take."""
    name = "x" * 100_000 + ".py"
    shared = {"filename": name, "line": 1, "name": "step"}
    many = [{"filename": name, "line": index, "name": "f"} for index in range(2_000)]
    data = pickle.dumps({"device_traces": [[
        alloc(frames=[shared] * 2_000), alloc(addr=8192, frames=many, time_us=2)]]})
    assert len(data) < 300_000
    snapshot = tmp_path / "frames.pickle"
    snapshot.write_bytes(data)
    tracemalloc.start()
    try:
        model = model_from_torch_snapshot(snapshot)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, peak
    assert len(model.stacks) == 2 and len(model.stacks[0]) == 512  # MAX_FRAMES kept
    assert all(len(frame) < 3 * MAX_TEXT + 20 for frame in model.frames)
    assert model.frames[0].endswith("…:1 in step")
    page = tmp_path / "frames.html"
    write_page(model, page)
    assert page.stat().st_size < 4 << 20


def test_a_memo_index_of_gigabytes_fails_in_one_line_not_by_taking_the_memory(
        tmp_path: Path) -> None:
    """Ten bytes: an empty list stored at memo index 2**28 - 1, for which the unpickler would
    grow its memo to 2**29 entries (4 GiB, each written). ``gpubudget view`` reads a pickle
    with its address space capped at what it holds plus room for the file: the load fails
    as out of memory, one line, exit 2 (the test's own cap, 6 GiB, only guards the machine:
    under it the memo would fit and the list be read)."""
    done = view(tmp_path, b"\x80\x02]r\xff\xff\xff\x0f.", limit=6 << 30)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr == "gpubudget: error: " + str(tmp_path / "hostile.pickle") + (
        ": out of memory while reading the pickle\n")
