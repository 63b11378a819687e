"""Budgets across ``fork()``: in the child, every budget inherited from the parent is closed
(allocations denied ``forked``, nothing traced, nothing published), its tree's lock is made
anew, and budgets the child enters itself work as in any process. Each test runs real
``os.fork()`` in a subprocess, with the compiled core (where built) and the pure-Python one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpubudget.tracefile import Enter, Exit, read_trace
from tests.helpers import subprocess_env

CORES = ["0", "1"]
"""``GPUBUDGET_PURE``: the core as installed, and the pure-Python one."""


def _run(script: str, *args: str, pure: str, timeout: float = 120) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(GPUBUDGET_PURE=pure, GPUBUDGET_BACKEND="host"))
    assert done.returncode == 0, done.stdout + done.stderr
    # Python 3.12 warns of every fork in a process with threads (DeprecationWarning): these
    # scripts fork with threads on purpose; any other warning still fails the test
    stderr = "\n".join(line for line in done.stderr.splitlines()
                       if "is multi-threaded, use of fork() may lead to deadlocks" not in line)
    assert "Traceback" not in stderr and "Warning" not in stderr, done.stderr
    assert "still live at exit" not in done.stderr, done.stderr  # the parent's, not listed
    return done.stdout


_TRACED = """
    import os, sys
    from gpubudget import gpu_budget
    from gpubudget.tracefile import writer_for
    parent_trace, child_trace = sys.argv[1], sys.argv[2]
    with gpu_budget("1MiB", name="parent", backend="host", trace=parent_trace) as pool:
        with gpu_budget("256KiB", name="inner") as inner:
            blocks = [inner.allocate(1024) for _ in range(3)]  # buffered, not yet written
            pid = os.fork()
            if pid == 0:  # the child: uses the inherited budgets, then one of its own
                status = 0
                try:
                    denied = [inner.allocate(1024), pool.allocate(1024)]
                    print("child", denied, inner.used, pool.used, inner.report().trace_error,
                          flush=True)
                    writer_for(parent_trace).flush()  # nothing of the parent's to write
                finally:
                    os._exit(status)
            assert os.waitpid(pid, 0)[1] == 0
            for block in blocks:
                inner.free(block)
    pid = os.fork()  # outside the inherited blocks: the child's own roots and traces work
    if pid == 0:
        with gpu_budget("1MiB", name="child-root", backend="host", trace=child_trace) as own:
            block = own.allocate(1024)
            own.free(block)
        print("child-root", block is not None, flush=True)
        sys.exit(0)  # a normal exit: the exit handlers flush (and must not touch the parent's)
    assert os.waitpid(pid, 0)[1] == 0
    print("parent", pool.report().allocations, inner.report().allocations)
"""


@pytest.mark.parametrize("pure", CORES)
def test_a_traced_root_used_across_fork_keeps_a_valid_trace(tmp_path: Path, pure: str) -> None:
    parent, child = tmp_path / "parent.jsonl", tmp_path / "child.jsonl"
    out = _run(_TRACED, str(parent), str(child), pure=pure).splitlines()
    assert out[0].startswith("child [None, None] 3072 3072 not traced in process "), out
    assert out[1:] == ["child-root True", "parent 0 3"]
    events = read_trace(parent).events
    assert [e.name for e in events if isinstance(e, Enter)] == ["parent", "inner"]
    assert sum(isinstance(e, Exit) for e in events) == 2
    assert [type(e).__name__ for e in events].count("Alloc") == 3  # nothing from the child
    assert [e.name for e in read_trace(child).events if isinstance(e, Enter)] == ["child-root"]
    for trace in (parent, child):
        report = subprocess.run([sys.executable, "-m", "gpubudget", "report", str(trace)],
                                capture_output=True, text=True, env=subprocess_env())
        assert report.returncode == 0, report.stderr
        assert "(released): used 0 B" in report.stdout


_FORK_WHILE_ALLOCATING = """
    import contextvars, os, sys, threading, time
    from gpubudget import gpu_budget
    tries, hung, failed = int(sys.argv[1]), 0, 0
    pool = gpu_budget("64MiB", name="busy", backend="host")
    elsewhere = contextvars.Context()  # active there only: the forking code is in no budget
    elsewhere.run(pool.__enter__)
    if True:
        stop = threading.Event()

        def churn():
            while not stop.is_set():
                block = pool.allocate(4096)
                if block is not None:
                    pool.free(block)

        worker = threading.Thread(target=churn)
        worker.start()
        for attempt in range(tries):
            time.sleep(0.002)
            pid = os.fork()
            if pid == 0:  # inside allocate in the other thread, perhaps: its lock was held
                status = 1
                try:
                    assert pool.allocate(4096) is None  # denied, at once
                    with gpu_budget("1MiB", name="own", backend="host") as own:
                        assert own.allocate(4096) is not None
                    status = 0
                finally:
                    os._exit(status)
            deadline = time.monotonic() + 60  # the watchdog: a child takes milliseconds
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    failed += status != 0
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    hung += 1
                    break
            if hung:
                break
                time.sleep(0.005)
        stop.set()
        worker.join()
    elsewhere.run(pool.__exit__, None, None, None)
    print("hung", hung, "failed", failed, "of", tries)
"""


@pytest.mark.parametrize("pure", CORES)
def test_fork_while_another_thread_allocates_never_hangs_the_child(pure: str) -> None:
    out = _run(_FORK_WHILE_ALLOCATING, "30", pure=pure, timeout=600)
    assert out.split() == ["hung", "0", "failed", "0", "of", "30"]


_USED_IN_CHILD = """
    import os, sys
    from gpubudget import AllocationDenied, BudgetNestingError, gpu_budget
    from gpubudget.hostledger import host_view

    def entries():
        return [e for e in host_view(nvml=False).entries if e.pid == os.getpid()]

    with gpu_budget("64MiB", name="limited", backend="host", track_stacks=True) as pool:
        block = pool.allocate("1MiB")
        (slot,) = entries()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            granted, reasons = 0, set()
            for _ in range(240):  # 240 MiB asked of a 64 MiB budget
                try:
                    pool.allocate("1MiB", raise_on_denial=True)
                    granted += 1
                except AllocationDenied as denied:
                    reasons.add(denied.reason)
            try:  # inside an inherited budget: refused, or a root of the child's own
                with gpu_budget("8MiB", name="inside") as inside:
                    own = inside.parent is None and inside.root is inside
                    granted_own = inside.free(inside.allocate("1MiB") or 0)  # no leak
                    nested = "own root" if own and granted_own else "granted"
            except BudgetNestingError:
                nested = "refused"
            os.write(write, repr((granted, sorted(reasons), nested, pool.used,
                                  pool.report().denied)).encode())
            sys.exit(0)  # through the with blocks and the exit handlers, as a program ends
        os.close(write)
        with os.fdopen(read) as pipe:
            answer = pipe.read()
        assert os.waitpid(pid, 0)[1] == 0
        (after,) = entries()
        print(answer)
        print(pool.used, pool.report().denied, slot.denials == after.denials, after.used)
        pool.free(block)
"""


@pytest.mark.parametrize("pure", CORES)
def test_a_budget_used_in_a_forked_child_grants_nothing(pure: str) -> None:
    child, parent = _run(_USED_IN_CHILD, pure=pure).splitlines()
    granted, reasons, nested, used, denied = eval(child)  # noqa: S307 - our own repr
    assert (granted, reasons) == (0, ["forked"])
    assert nested == "own root" and used == 1 << 20 and denied >= 240
    assert parent == f"{1 << 20} 0 True {1 << 20}"  # the parent's slot: as it was


_FREED_IN_CHILD = """
    import os
    from gpubudget import gpu_budget
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        block = pool.allocate(4096)
        pid = os.fork()
        if pid == 0:
            print(pool.free(block), pool.used, pool.report().invalid_frees, flush=True)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        pool.free(block)
"""


@pytest.mark.parametrize("pure", CORES)
def test_a_forked_child_cannot_free_its_parents_blocks(pure: str) -> None:
    assert _run(_FREED_IN_CHILD, pure=pure).split() == ["False", "4096", "1"]
