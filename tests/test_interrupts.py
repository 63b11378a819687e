"""Ctrl-C at every step of an operation: the bookkeeping always agrees, and the call either
happened whole or not at all.

A tracer raises SIGINT (as a real Ctrl-C does) at the n-th line that gpubudget executes
during an operation, for every n; Python then runs the signal handler at its next check.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import gpubudget
from gpubudget import gpu_budget, interrupts
from gpubudget.units import KiB
from tests.helpers import consistent, python_paths, subprocess_env

PACKAGE = os.path.dirname(gpubudget.__file__)


@pytest.fixture(autouse=True)
def _ledger_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Entering a root reads the host ledger: a Ctrl-C at each of its lines runs the entry
    once per line, so the roots other tests left there would make this quadratic."""
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))


@pytest.fixture(autouse=True)
def _handler_installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(interrupts.STATE, "installed", False)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal
    interrupts.install()
    assert signal.getsignal(signal.SIGINT) is interrupts._handler
    yield
    interrupts.take()
    signal.signal(signal.SIGINT, previous)  # as it was: later tests set what they need


@contextmanager
def sigint_at(line: int) -> Iterator[list[int]]:
    """Raise SIGINT at the ``line``-th line executed in gpubudget (0: never); yields a list
    that ends up holding how many such lines ran."""
    seen = [0]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename.startswith(PACKAGE):
            if event == "line":
                seen[0] += 1
                if seen[0] == line:
                    signal.raise_signal(signal.SIGINT)
            return tracer
        return None

    sys.settrace(tracer)
    try:
        yield seen
    finally:
        sys.settrace(None)


def raised_inside_gpubudget(exc: BaseException) -> bool:
    """Whether gpubudget raised ``exc`` itself (rather than the signal handler, in the
    frame it interrupted)."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    if frames and frames[-1].f_code is interrupts._handler.__code__:
        frames.pop()  # the handler raised it in the frame below: that is where it landed
    return bool(frames) and frames[-1].f_code.co_filename.startswith(PACKAGE)


def as_at_a_terminal(script: str) -> str:
    """``script`` run as from a terminal, where Ctrl-C raises ``KeyboardInterrupt``: a
    process started in the background by a non-interactive shell (a CI job's ``&``)
    inherits SIGINT ignored, and then Python installs no handler for it."""
    return ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            + textwrap.dedent(script))


def every_step(operation: Callable[[], object], after: Callable[[bool, bool], None]) -> int:
    """Run ``operation`` with a Ctrl-C at each of its lines in turn; ``after(interrupted,
    inside)`` checks each run. Returns the number of lines."""
    with sigint_at(0) as seen:
        operation()
    after(False, False)
    total = seen[0]
    assert total > 3
    for line in range(1, total + 1):
        interrupted = inside = False
        try:
            with sigint_at(line):
                operation()
            time.sleep(0)  # a Ctrl-C still pending is raised here at the latest
        except KeyboardInterrupt as exc:
            interrupted, inside = True, raised_inside_gpubudget(exc)
        if interrupts.take():
            # Noted after the method's last look, as it returned: only the tracer's own calls
            # make that window (the interpreter checks for signals at calls), and the next
            # gpubudget call would raise it. Count it as landing after the call.
            interrupted = True
        after(interrupted, inside)
    return total


def test_allocate_is_all_or_nothing_under_ctrl_c() -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        python_paths(pool)
        with gpu_budget("512KiB", name="model") as model:
            kept = model.allocate(KiB)
            got: list[int | None] = []

            def operation() -> None:
                got.append(model.allocate(3 * KiB, tag="t"))

            def after(interrupted: bool, inside: bool) -> None:
                consistent(pool)
                if interrupted and inside:  # raised by allocate: it was undone
                    assert model.used == KiB
                for block in got:
                    if block is not None:
                        assert model.free(block)
                got.clear()
                for live in model.report().live_blocks:  # granted, then lost in test code
                    if live.address != kept:
                        assert model.free(live.address)
                assert model.used == KiB

            lines = every_step(operation, after)
            assert lines > 3
            assert interrupts.STATE.pending is False
            assert kept is not None and model.free(kept)


def test_free_and_resize_complete_under_ctrl_c() -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        python_paths(pool)
        blocks: list[int] = []

        def free_one() -> None:
            address = blocks.pop()
            pool.free(address)

        def after_free(interrupted: bool, inside: bool) -> None:
            consistent(pool)
            assert pool.used == 0  # the free completed, interrupted or not
            refill()

        def refill() -> None:
            block = pool.allocate(2 * KiB)
            assert block is not None
            blocks.append(block)

        refill()
        every_step(free_one, after_free)

        def grow() -> None:
            pool.resize(blocks[-1], 4 * KiB)

        def after_grow(interrupted: bool, inside: bool) -> None:
            consistent(pool)
            assert pool.used == 4 * KiB and pool.size_of(blocks[-1]) == 4 * KiB
            assert pool.free(blocks.pop())
            refill()

        every_step(grow, after_grow)


def test_entering_and_leaving_under_ctrl_c() -> None:
    entered: list[gpubudget.Budget] = []

    def enter_and_leave() -> None:
        with gpu_budget("64KiB", name="short") as budget:
            entered.append(budget)

    def after(interrupted: bool, inside: bool) -> None:
        assert gpubudget.current_budget() is None  # never left active
        budget = entered.pop() if entered else None
        if budget is not None:
            assert budget.state == "released"  # its reservation went back

    every_step(enter_and_leave, after)


def test_a_ctrl_c_in_a_callback_is_answered_and_raised_again_in_python(tmp_path: Path) -> None:
    pytest.importorskip("tensorrt_rtx_bindings")
    script = tmp_path / "callback.py"
    script.write_text(as_at_a_terminal("""
        import signal, sys, time
        import tensorrt_rtx_bindings as trt
        from gpubudget import gpu_budget
        from gpubudget import tensorrt as gbt
        from tests.trampoline import Trampoline

        with gpu_budget("1MiB", name="pool", backend="host") as pool:
            allocator = gbt.allocator(trt_module=trt)
            cpp = Trampoline(allocator)

            def ctrl_c(frame, event, arg):  # a Ctrl-C as the callback starts
                if event == "call" and frame.f_code.co_name == "allocate_async":
                    signal.raise_signal(signal.SIGINT)
                return None

            sys.settrace(ctrl_c)
            block = cpp.allocate(4096)
            sys.settrace(None)
            print("callback answered", block is not None, flush=True)
            try:
                time.sleep(60)  # it ends at the delivery
                print("no interrupt")
            except KeyboardInterrupt:
                print("interrupt raised again in python")
            pool.check()
            print("used", pool.used)
    """))
    env = subprocess_env(GPUBUDGET_BACKEND="host")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "callback answered True"  # the allocation itself completed
    assert lines[1] == "interrupt raised again in python"
    assert lines[2] == "used 4096"


_ENDS_AT_ONCE = """
    import signal, sys
    from gpubudget import gpu_budget
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        if sys.argv[1] == "tensorrt":
            import tensorrt_rtx_bindings as trt
            from gpubudget import tensorrt as gbt
            from tests.trampoline import Trampoline

            call = Trampoline(gbt.allocator(trt_module=trt)).allocate
        else:  # a callback of our own, called as C code would: nothing can raise out of it
            from gpubudget import interrupts

            @interrupts.callback
            def allocate_async(size):
                try:
                    return pool.allocate(size)
                finally:
                    if interrupts.STATE.pending:
                        interrupts.pass_on()

            call = allocate_async

        def ctrl_c(frame, event, arg):  # a Ctrl-C as the callback starts
            if event == "call" and frame.f_code.co_name == "allocate_async":
                signal.raise_signal(signal.SIGINT)
            return None

        sys.settrace(ctrl_c)
        block = call(4096)
        sys.settrace(None)
        print("callback answered", block is not None, flush=True)
    print("the program ends", flush=True)  # within a millisecond of the callback
"""


@pytest.mark.parametrize("caller", ["python", "tensorrt"])
def test_a_ctrl_c_in_a_callback_is_not_lost_when_the_program_ends_at_once(caller: str) -> None:
    if caller == "tensorrt":
        pytest.importorskip("tensorrt_rtx_bindings")
    for _ in range(5):
        result = subprocess.run([sys.executable, "-c", as_at_a_terminal(_ENDS_AT_ONCE), caller],
                                capture_output=True, text=True, timeout=60,
                                env=subprocess_env(GPUBUDGET_BACKEND="host"))
        assert result.returncode in (-signal.SIGINT, 130), (result.returncode, result.stderr)
        # raised again in Python code (perhaps inside the print), or delivered at exit
        assert result.stdout.startswith("callback answered")
        assert "KeyboardInterrupt" in result.stderr


_IN_AN_EXIT_HANDLER = """
    import atexit, signal, sys, threading
    from gpubudget import gpu_budget, interrupts

    @interrupts.callback
    def allocate_async(pool, size):  # called as C code would: nothing can raise out of it
        try:
            return pool.allocate(size)
        finally:
            if interrupts.STATE.pending:
                interrupts.pass_on()

    def ctrl_c(frame, event, arg):  # a Ctrl-C as the callback starts
        if event == "call" and frame.f_code.co_name == "allocate_async":
            signal.raise_signal(signal.SIGINT)
        return None

    def exit_handler():  # the program has ended: its exit handler frees, say, an engine
        with gpu_budget("1MiB", name="pool", backend="host") as pool:
            sys.settrace(ctrl_c)
            block = allocate_async(pool, 4096)
            sys.settrace(None)
            print("callback answered", block is not None, flush=True)
            pool.free(block)
        for thread in threading.enumerate():  # what gpubudget started to pass it on
            if thread is not threading.current_thread():
                thread.join(60)
        print("the exit handler ends", flush=True)

    if sys.argv[1] == "atexit":
        atexit.register(exit_handler)  # runs before gpubudget's own exit handlers
    else:  # as the interpreter waits for the program's threads
        threading._register_atexit(exit_handler)
    print("the program ends", flush=True)
"""


@pytest.mark.parametrize("phase", ["atexit", "threading"])
def test_a_ctrl_c_taken_by_a_callback_in_an_exit_handler_ends_the_process(phase: str) -> None:
    """Raised in an exit handler (or as the interpreter waits for the program's threads),
    Python would print the interrupt and go on: it is delivered once the exit handlers ran."""
    if phase == "threading" and not hasattr(__import__("threading"), "_register_atexit"):
        pytest.skip("this Python's threading has no exit hooks")
    result = subprocess.run([sys.executable, "-c", as_at_a_terminal(_IN_AN_EXIT_HANDLER), phase],
                            capture_output=True, text=True, timeout=120,
                            env=subprocess_env(GPUBUDGET_BACKEND="host"))
    assert result.stdout.splitlines() == ["the program ends", "callback answered True",
                                          "the exit handler ends"], result.stderr
    assert result.returncode in (-signal.SIGINT, 130), (result.returncode, result.stderr)
    assert "KeyboardInterrupt" in result.stderr and "Exception ignored" not in result.stderr


def test_a_handler_of_the_programs_own_is_left_alone() -> None:
    calls: list[int] = []

    def mine(signum: int, frame: object) -> None:
        calls.append(signum)

    signal.signal(signal.SIGINT, mine)
    interrupts.STATE.installed = False
    with gpu_budget("64KiB", name="pool"):
        pass
    assert signal.getsignal(signal.SIGINT) is mine
    signal.raise_signal(signal.SIGINT)
    assert calls == [signal.SIGINT]


def test_outside_gpubudget_the_handler_raises_at_once() -> None:
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        time.sleep(1)
    assert interrupts.STATE.pending is False
