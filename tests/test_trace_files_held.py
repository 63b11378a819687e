"""A trace file is held open only while a root budget writes to it: a long-running program
that gives each job its own trace holds no descriptor for the jobs that have ended; a path
named again appends to the same trace; another process never takes a trace that a live
process has closed between two roots."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpubudget import BudgetError, TraceError, gpu_budget
from gpubudget.errors import TraceWriteError
from gpubudget.tracefile import Enter, Exit, Free, perpath, read_trace, writer_for
from gpubudget.tracefile.files import TraceBusy
from tests.helpers import subprocess_env

_MANY_ROOTS = textwrap.dedent("""
    import os, resource, sys
    from gpubudget import gpu_budget
    directory, roots = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    start = len(os.listdir("/proc/self/fd"))
    most = start
    for job in range(roots):
        with gpu_budget("1MiB", name=f"job{job}", backend="host",
                        trace=f"{directory}/job{job}.jsonl") as pool:
            block = pool.allocate(1000)
            assert block is not None, job
            most = max(most, len(os.listdir("/proc/self/fd")))
            pool.free(block)
    with open(os.devnull) as anything:  # every open() of the program still works
        pass
    print(start, len(os.listdir("/proc/self/fd")), most)
""")


@pytest.mark.parametrize("pure", ["0", "1"])
def test_300_roots_with_their_own_traces_under_64_descriptors(tmp_path: Path, pure: str
                                                              ) -> None:
    done = subprocess.run([sys.executable, "-c", _MANY_ROOTS, str(tmp_path), "300"],
                          capture_output=True, text=True, timeout=120,
                          env=subprocess_env(GPUBUDGET_PURE=pure, GPUBUDGET_LEDGER="0"))
    assert done.returncode == 0, done.stderr
    start, end, most = map(int, done.stdout.split())
    assert end == start and most == start + 1, (start, end, most)  # one: the open root's
    traces = sorted(tmp_path.glob("job*.jsonl"))
    assert len(traces) == 300
    for trace in traces[::37]:
        report = subprocess.run([sys.executable, "-m", "gpubudget", "report", str(trace)],
                                capture_output=True, text=True, env=subprocess_env())
        assert report.returncode == 0, report.stderr
        assert report.stdout.startswith(f"{trace.stem} [host] (released)")
        assert "allocations 1, frees 1" in report.stdout


def _open_on(*paths: Path) -> int:
    """File descriptors of this process open on ``paths`` (counting them, not all of the
    process's: those of earlier tests close when the collector gets to them)."""
    names = {str(path) for path in paths}
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}") in names
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return found


def test_a_path_named_again_appends_to_the_same_trace(tmp_path: Path) -> None:
    path = tmp_path / "again.jsonl"
    other = tmp_path / "o.jsonl"
    kept = None
    for name in ("first", "second", "third"):
        with gpu_budget("1MiB", name=name, backend="host", trace=str(path)) as pool:
            assert _open_on(path) == 1
            block = pool.allocate(1000)
            assert block is not None
            if name == "second":
                kept = (pool, block)  # freed after the root's exit: appended later
            else:
                pool.free(block)
        assert _open_on(path) == 0 and not perpath._writers[perpath._key(str(path))].is_open
    assert kept is not None
    kept[0].free(kept[1])
    writer_for(path).flush()  # opens, appends; open until the next root or writer_for()
    assert _open_on(path) == 1
    with gpu_budget("1MiB", name="other", backend="host", trace=str(other)):
        pass
    assert _open_on(path, other) == 0
    trace = read_trace(path)
    assert trace.header.pid == os.getpid()
    names = [event.name for event in trace.events if isinstance(event, Enter)]
    assert names == ["first", "second", "third"]
    assert isinstance(trace.events[-1], Free) and isinstance(trace.events[-2], Exit)
    times = [event.t for event in trace.events]
    assert times == sorted(times)  # one clock across the roots
    report = subprocess.run([sys.executable, "-m", "gpubudget", "report", str(path)],
                            capture_output=True, text=True, env=subprocess_env())
    assert report.returncode == 0 and report.stdout.count("(released)") == 3, report.stderr


def test_a_trace_removed_between_roots_starts_again_and_a_changed_one_is_refused(
        tmp_path: Path) -> None:
    path = tmp_path / "moved.jsonl"
    with gpu_budget("1MiB", name="first", backend="host", trace=str(path)):
        pass
    path.unlink()
    with gpu_budget("1MiB", name="second", backend="host", trace=str(path)):
        pass
    assert [e.name for e in read_trace(path).events if isinstance(e, Enter)] == ["second"]
    with path.open("a") as file:
        file.write("\n")  # someone else wrote to it meanwhile
    budget = gpu_budget("1MiB", name="third", backend="host", trace=str(path))
    with pytest.raises(TraceWriteError, match="changed since this process last wrote it"):
        budget.__enter__()
    assert budget.state == "new"


_CLOSED_BETWEEN_ROOTS = textwrap.dedent("""
    import sys
    from gpubudget import gpu_budget
    with gpu_budget("1MiB", name="done", backend="host", trace=sys.argv[1]):
        pass
    print("closed", flush=True)
    sys.stdin.readline()  # alive until told
""")


def test_another_process_does_not_take_a_trace_its_live_writer_closed(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    writer = subprocess.Popen([sys.executable, "-c", _CLOSED_BETWEEN_ROOTS, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=subprocess_env())
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "closed\n"
        budget = gpu_budget("1MiB", name="late", backend="host", trace=str(path))
        with pytest.raises(TraceBusy, match=f"being written by process {writer.pid}"):
            budget.__enter__()
    finally:
        writer.communicate("\n", timeout=60)
    assert [e.name for e in read_trace(path).events if isinstance(e, Enter)] == ["done"]
    with gpu_budget("1MiB", name="later", backend="host", trace=str(path)):
        pass  # its writer has ended: an earlier trace, ours to replace


def test_a_trace_error_at_entry_is_a_budget_error(tmp_path: Path) -> None:
    (tmp_path / "dir.jsonl").mkdir()
    budget = gpu_budget("1MiB", name="x", backend="host", trace=str(tmp_path / "dir.jsonl"))
    with pytest.raises(BudgetError) as caught:
        budget.__enter__()
    assert isinstance(caught.value, TraceError) and isinstance(caught.value, ValueError)


def test_a_path_named_again_after_hundreds_of_others_is_still_appended_to(tmp_path: Path
                                                                            ) -> None:
    first = tmp_path / "first.jsonl"
    with gpu_budget("1MiB", name="early", backend="host", trace=str(first)):
        pass
    for job in range(2 * perpath._IDLE_KEPT):  # the writer of `first` is dropped meanwhile
        with gpu_budget("1MiB", name=f"job{job}", backend="host",
                        trace=str(tmp_path / f"job{job}.jsonl")):
            pass
    assert len(perpath._writers) <= 2 * perpath._IDLE_KEPT
    assert perpath._key(str(first)) not in perpath._writers
    with gpu_budget("1MiB", name="late", backend="host", trace=str(first)):
        pass
    trace = read_trace(first)
    assert [e.name for e in trace.events if isinstance(e, Enter)] == ["early", "late"]
    assert first.read_bytes().count(b'"format"') == 1  # one header: the same trace
    times = [event.t for event in trace.events]
    assert times == sorted(times)


_LATE_FREES = textwrap.dedent("""
    import sys
    from gpubudget import gpu_budget
    directory = sys.argv[1]
    with gpu_budget("1MiB", name="early", backend="host", trace=f"{directory}/a.jsonl") as a:
        blocks = [a.allocate(1000) for _ in range(2)]
    for job in range(600):  # a's writer leaves the cache: its root still has blocks
        with gpu_budget("1MiB", name="job", backend="host", trace=f"{directory}/{job}.jsonl"):
            pass
    for block in blocks:
        a.free(block)  # buffered (within 0.25 s of a flush, perhaps): written at exit
""")


def test_events_of_a_writer_dropped_from_the_cache_are_written_at_exit(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _LATE_FREES, str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env=subprocess_env(GPUBUDGET_LEDGER="0"))
    assert done.returncode == 0 and not done.stderr, done.stderr
    kinds = [type(event).__name__ for event in read_trace(tmp_path / "a.jsonl").events]
    assert kinds == ["Enter", "Alloc", "Alloc", "Exit", "Free", "Free"]
