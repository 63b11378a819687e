"""Writing traces safely (``gpubudget.tracefile.files`` and the writer): ``{pid}``, one process
per file (real processes), no link followed, nothing clobbered that is not an earlier trace of
this user's, a ``GPUBUDGET_TRACE`` that cannot be written (one warning, budgets go on), an
explicit ``trace=`` that cannot (one line at entry), and every line written readable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import gpubudget
from gpubudget import GpuBudgetError, TraceError, gpu_budget
from gpubudget.replay import ReplayError, fit, replay
from gpubudget.tracefile import MAX_LINE_BYTES, MAX_TEXT, Alloc, Enter, read_trace, writer_for
from tests.helpers import subprocess_env

KiB = 1024
ENV = "GPUBUDGET_TRACE"

_HOLDER = textwrap.dedent("""
    import os, sys
    from gpubudget import gpu_budget
    trace = {} if sys.argv[1] == "-" else {"trace": sys.argv[1]}
    with gpu_budget("1MiB", name="holder", backend="host", **trace) as pool:
        pool.allocate(1024)
        print(os.getpid(), flush=True)
        sys.stdin.readline()  # until told
""")


@contextmanager
def holder(trace: str = "-", **env: str) -> Iterator[tuple[int, list[str]]]:
    """A real process with a root budget open (tracing to ``trace``, or as ``env`` says):
    its pid, and a list that holds what it printed on stderr once the block (and the
    process, which must succeed) has ended."""
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, trace], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=subprocess_env(**env))
    stderr: list[str] = []
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip().isdigit(), line
        yield int(line), stderr
    finally:
        _, err = child.communicate("\n", timeout=60)
        stderr.append(err)
    assert child.returncode == 0, err


def one_line(exc: BaseException) -> str:
    """The message of ``exc``, asserted to be one line raised without a chained cause."""
    message = str(exc)
    assert "\n" not in message and exc.__cause__ is None and exc.__suppress_context__
    return message


def recorded(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


# -- {pid}, and one process per file -------------------------------------------------------


def test_pid_in_trace_and_in_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with gpu_budget("1MiB", name="explicit", trace=str(tmp_path / "a.{pid}.jsonl")) as pool:
        pool.allocate(KiB)
    writer_for(tmp_path / "a.{pid}.jsonl").flush()
    mine = tmp_path / f"a.{os.getpid()}.jsonl"
    assert read_trace(mine).header.pid == os.getpid()
    monkeypatch.setenv(ENV, str(tmp_path / "env-{pid}.jsonl"))
    with gpu_budget("1MiB", name="from-env"):
        pass
    writer_for(tmp_path / "env-{pid}.jsonl").flush()
    trace = read_trace(tmp_path / f"env-{os.getpid()}.jsonl")
    assert [e.name for e in trace.events if isinstance(e, Enter)] == ["from-env"]


def test_two_processes_given_one_variable_write_a_file_each(tmp_path: Path) -> None:
    same = tmp_path / "same.jsonl"
    with holder(**{ENV: str(same)}) as (first, one), holder(**{ENV: str(same)}) as (second, two):
        pass
    # the holder keeps its block to the end on purpose (the trace ends at its exit): said
    assert one == ["gpubudget: 1 block(s) of budget 'holder' still live at exit (1.00 KiB: "
                   "(no tag) 1.00 KiB); gpu_budget(..., track_stacks=True) shows where each "
                   "was allocated\n"]
    warning = two[0]
    assert "RuntimeWarning" in warning and "Traceback" not in warning
    assert f"{ENV}: '{same}' is being written by process {first}; this process ({second}) " \
           f"writes its trace to '{tmp_path / f'same.{second}.jsonl'}'" in warning
    for path, pid in ((same, first), (tmp_path / f"same.{second}.jsonl", second)):
        trace = read_trace(path)  # each whole and valid: nothing interleaved
        assert trace.header.pid == pid
        assert [type(e).__name__ for e in trace.events] == ["Enter", "Alloc", "Exit"]


def test_an_explicit_trace_another_process_writes_is_refused_at_entry(tmp_path: Path) -> None:
    path = tmp_path / "busy.jsonl"
    with holder(str(path)) as (pid, _):
        budget = gpu_budget("1MiB", name="late", trace=str(path))
        with pytest.raises(TraceError) as caught:
            budget.__enter__()
        assert f"trace file '{path}' is being written by process {pid}" in one_line(caught.value)
        assert budget.state == "new" and gpubudget.current_budget() is None
    with gpu_budget("1MiB", name="later", trace=str(path)):  # the holder is gone: ours now
        pass
    writer_for(path).flush()
    trace = read_trace(path)
    assert trace.header.pid == os.getpid() and trace.events[0].name == "later"  # type: ignore[union-attr]


_FORKED = textwrap.dedent("""
    import os, sys
    from gpubudget import gpu_budget
    from gpubudget.tracefile import perpath
    with gpu_budget("1MiB", name="parent", backend="host", trace=sys.argv[1]) as pool:
        blocks = [pool.allocate(1024) for _ in range(3)]  # buffered, not yet written
        child = os.fork()
        if child == 0:  # uses the parent's budget and flushes as at exit: writes nothing
            pool.allocate(1024)
            perpath._close_all()
            os._exit(0)
        os.waitpid(child, 0)
""")


def test_a_forked_child_writes_nothing_into_its_parents_trace(tmp_path: Path) -> None:
    path = tmp_path / "forked.jsonl"
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _FORKED, str(path)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kinds = [type(e).__name__ for e in read_trace(path).events]
    assert kinds == ["Enter", "Alloc", "Alloc", "Alloc", "Exit"]


# -- GPUBUDGET_TRACE that cannot be written: one warning, budgets go on ----------------------


def test_a_variable_that_cannot_be_written_warns_once_and_budgets_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = str(tmp_path / "missing" / "t.jsonl")
    monkeypatch.setenv(ENV, bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("first", "second", "third"):
            with gpu_budget("1MiB", name=name) as pool:
                assert pool.allocate(KiB) is not None
    messages = recorded(caught)
    assert len(messages) == 1 and ENV in messages[0] and bad in messages[0]
    assert "No such file or directory" in messages[0] and "not traced" in messages[0]
    assert [w.filename for w in caught if issubclass(w.category, RuntimeWarning)] == [
        __file__]  # at the user's line
    assert pool.report().trace_error is not None and bad in pool.report().trace_error  # type: ignore[operator]


def test_a_bad_variable_prints_one_warning_and_no_traceback(tmp_path: Path) -> None:
    script = ("from gpubudget import gpu_budget\n"
              "for _ in range(3):\n"
              "    with gpu_budget('1MiB', backend='host') as b:\n"
              "        assert b.allocate(1024)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(**{ENV: str(tmp_path)}), timeout=60)  # a folder
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert done.stderr.count("RuntimeWarning") == 1 and "Is a directory" in done.stderr


def test_an_explicit_trace_that_cannot_be_written_fails_at_entry_in_one_line(
        tmp_path: Path) -> None:
    assert "TraceError" in gpubudget.__all__ and issubclass(TraceError, GpuBudgetError)
    budget = gpu_budget("1MiB", trace=str(tmp_path / "missing" / "t.jsonl"))
    with pytest.raises(TraceError, match=r"cannot write trace file .*t.jsonl': No such file "):
        budget.__enter__()
    one_line(pytest.raises(TraceError, gpu_budget("1MiB", trace=str(tmp_path)).__enter__).value)
    assert budget.state == "new"


def test_trace_false_writes_nothing_whatever_the_variable_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "t.jsonl"))
    with gpu_budget("1MiB", trace=False) as pool, gpu_budget("1KiB", trace=False):
        assert pool.allocate(KiB) is not None
    assert list(tmp_path.iterdir()) == []


# -- links, others' files, files that are not files -----------------------------------------


def test_a_link_is_never_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "trace.jsonl"
    link.symlink_to(victim)
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "created-through-the-link")
    for path in (link, dangling):
        with pytest.raises(TraceError, match="is a symbolic link: not followed") as caught:
            gpu_budget("1MiB", trace=str(path)).__enter__()
        one_line(caught.value)
    monkeypatch.setenv(ENV, str(link))
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        with gpu_budget("1MiB"):
            pass
    assert "symbolic link" in recorded(caught_warnings)[0]
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "created-through-the-link").exists()


def test_only_an_empty_file_or_an_earlier_trace_of_ours_is_overwritten(tmp_path: Path) -> None:
    other = tmp_path / "notes.jsonl"
    other.write_text('{"not": "a trace"}\n')
    with pytest.raises(TraceError, match="exists and is not a gpubudget trace of this user's: "
                                         "not overwritten"):
        gpu_budget("1MiB", trace=str(other)).__enter__()
    assert other.read_text() == '{"not": "a trace"}\n'
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text(json.dumps({"format": "gpubudget-trace", "version": 1, "pid": 1})
                       + "\n" + "x" * 10_000)
    for path in (empty, earlier):
        with gpu_budget("1MiB", name=path.stem, trace=str(path)):
            pass
        writer_for(path).flush()
        assert read_trace(path).events[0].name == path.stem  # type: ignore[union-attr]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_an_earlier_trace_of_another_user_is_not_overwritten(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs.jsonl"
    header = json.dumps({"format": "gpubudget-trace", "version": 1, "pid": 1}) + "\n"
    theirs.write_text(header)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(TraceError, match="not a gpubudget trace of this user's"):
        gpu_budget("1MiB", trace=str(theirs)).__enter__()
    assert theirs.read_text() == header


def test_what_is_not_a_regular_file_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path(os.devnull), "a character device")):
        with pytest.raises(TraceError, match=rf"is not a regular file \({kind}\)"):
            gpu_budget("1MiB", trace=str(path)).__enter__()


# -- every line written is read ---------------------------------------------------------------


def test_huge_names_tags_and_sizes_are_written_so_that_they_read_back(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    name, tag = "n" * (2 * MAX_LINE_BYTES), "\U0001f600" * MAX_LINE_BYTES  # 12 B each in JSON
    with gpu_budget("1MiB", name=name, trace=str(path)) as pool:
        with gpubudget.label(tag):
            block = pool.allocate(KiB)
        assert block is not None and pool.free(block)
        assert pool.allocate(2**70) is None and pool.allocate(10**5000, tag=tag) is None
    writer_for(path).flush()
    events = read_trace(path).events
    enter, granted, refused = events[0], events[1], events[3]
    assert isinstance(enter, Enter) and enter.name == name[: MAX_TEXT - 1] + "…"
    assert isinstance(granted, Alloc) and granted.tag == tag[: MAX_TEXT - 1] + "…"
    assert isinstance(refused, Alloc) and refused.size == 2**63 - 1
    assert max(len(line) for line in path.read_bytes().splitlines()) < 32 * KiB
    assert replay(path).reports[0].denied == 2
    with pytest.raises(ReplayError, match="host memory cannot map"):  # what it wanted: 8 EiB
        fit(path)


def test_what_is_buffered_at_exit_is_written(tmp_path: Path) -> None:
    path = tmp_path / "late.jsonl"
    script = textwrap.dedent("""
        import sys
        from gpubudget import gpu_budget
        with gpu_budget("1MiB", name="pool", backend="host", trace=sys.argv[1]) as pool:
            block = pool.allocate(1024)
        pool.free(block)  # after the root's exit, which flushed: buffered until exit
    """)
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [type(e).__name__ for e in read_trace(path).events] == ["Enter", "Alloc", "Exit",
                                                                     "Free"]
