"""An exception raised into gpubudget from outside reaches the program, and never splits an
operation.

A program's signal handler (a ``SIGALRM`` timeout raising ``TimeoutError``),
``PyThreadState_SetAsyncExc`` or a trace function can raise between any two instructions.
Where gpubudget's code catches everything (the trace writer, the timeline's clock), such an
exception used to be lost: the trace stopped with a warning, the event's time became ``nan``.
Here an injector raises at the n-th instruction executed in the clock's or the trace
writer's code (and whatever they call), for every n in turn, with the exception a signal
handler raises or one raised directly (as ``PyThreadState_SetAsyncExc`` would), and counts
the runs in which the exception did not reach the caller: none may. Each run's operation is
whole: an allocation raised is undone, a free raised is done, the bookkeeping agrees, the
trace goes on, nothing stays held. The same in allocator callbacks, where the exception is
raised again once control is back in Python.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest

import gpubudget
from gpubudget import Budget, gpu_budget, interrupts
from gpubudget.backends import Backend
from gpubudget.backends.host import HostBackend
from gpubudget.tracefile import files, perpath, read_trace, writer
from gpubudget.units import KiB
from tests.helpers import (consistent, forget_stale_handled_exception, free_elsewhere,
                           subprocess_env)
from tests.test_tree import _scenarios as tree_scenarios

PACKAGE = os.path.dirname(gpubudget.__file__)


class Cancelled(BaseException):
    """What an injector raises directly, as ``PyThreadState_SetAsyncExc`` would."""


class Timeout(TimeoutError):
    """What the test's ``SIGALRM`` handler raises."""


class PythonClock(HostBackend):
    """Host memory whose timeline clock is Python code (as a replay's)."""

    def clock(self) -> float:
        now = time.perf_counter()
        return now


def _codes_of(module: Any) -> set[CodeType]:
    """Every code object defined in ``module`` (functions, methods, nested ones)."""
    found: set[CodeType] = set()

    def collect(code: CodeType) -> None:
        found.add(code)
        for constant in code.co_consts:
            if isinstance(constant, CodeType):
                collect(constant)

    for value in list(vars(module).values()):
        for member in [value, *vars(value).values()] if isinstance(value, type) else [value]:
            function = getattr(member, "fget", member)  # properties too
            code = getattr(function, "__code__", None)
            if isinstance(code, CodeType) and code.co_filename == module.__file__:
                collect(code)
    return found


WRITER_CODE = _codes_of(writer) | _codes_of(perpath) | _codes_of(files)
CLOCK_CODE = {PythonClock.clock.__code__}


@pytest.fixture(autouse=True)
def _alarm_handler() -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise Timeout("the program's timeout")

    previous = signal.signal(signal.SIGALRM, handler)
    yield
    signal.signal(signal.SIGALRM, previous)
    assert not interrupts.STATE.pending, "an exception was left held"


@pytest.fixture(autouse=True)
def _every_event_flushed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each event written at once: the writer's whole path (its flush too) runs every time."""
    monkeypatch.setattr(writer, "FLUSH_EVERY", 1)


def _raise_at(index: int, zone: set[CodeType], kind: str, operation: Callable[[], object],
              own_code_only: bool = False) -> tuple[bool, BaseException | None]:
    """Run ``operation``, raising before the ``index``-th instruction executed in a frame of
    ``zone`` or called from one (``own_code_only``: of gpubudget's code), counted across
    them: from a ``SIGALRM`` handler (``kind`` ``"signal"``) or directly (``"async"``).
    Whether it was raised, and what ``operation`` raised."""
    seen = 0
    inside: set[FrameType] = set()

    def opcodes(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal seen
        if event == "opcode":
            seen += 1
            if seen == index + 1:
                if kind == "signal":
                    signal.raise_signal(signal.SIGALRM)  # the handler raises here
                raise Cancelled  # and Python unsets the trace function: one per run
        elif event == "return":
            inside.discard(frame)
        return opcodes

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code not in zone and (frame.f_back not in inside or _unraisable(frame) or (
                own_code_only and not frame.f_code.co_filename.startswith(PACKAGE))):
            return None
        inside.add(frame)
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return opcodes

    previous = sys.gettrace()
    raised: BaseException | None = None
    collecting = gc.isenabled()
    gc.disable()  # no collection (its callbacks, finalizers) starts inside: see _unraisable
    sys.settrace(calls)
    try:
        operation()
    except (Timeout, Cancelled) as exc:
        raised = exc
    finally:
        sys.settrace(previous)
        if collecting:
            gc.enable()
    forget_stale_handled_exception()  # (a tracer's fault at the end of an except block)
    return seen > index, raised


def _unraisable(frame: FrameType) -> bool:
    """Whether ``frame`` runs where Python itself drops what is raised ("Exception ignored
    in"), whatever the program does: a weak reference's callback or a finalizer, run when an
    object dies, or a callback of the collector's."""
    code = frame.f_code
    return (code.co_name == "__del__"
            or os.path.basename(code.co_filename) in ("_weakrefset.py", "weakref.py")
            or any(code is getattr(hook, "__code__", None) for hook in gc.callbacks))


# -- the scenarios: an operation, and what must hold after it ------------------------------

Run = Callable[[Callable[[Callable[[], object]], None]], None]
"""A scenario: sets budgets up, calls ``inject(operation)`` once, checks, cleans up."""


def _scenarios(tmp_path: Path) -> dict[str, tuple[set[CodeType], Run]]:
    trace = tmp_path / "trace.jsonl"

    def pool(backend: Backend | None = None, traced: bool = True, stacks: bool = False) -> Budget:
        return gpu_budget("64KiB", name="pool", backend=backend, track_stacks=stacks,
                          trace=str(trace) if traced else False)

    def allocate(backend: Backend | None = None, traced: bool = True, stacks: bool = False) -> Run:
        def run(inject: Callable[[Callable[[], object]], None]) -> None:
            with pool(backend, traced, stacks) as root, gpu_budget("32KiB", name="c") as child:
                kept = child.allocate(KiB)
                got: list[int | None] = []
                raised = _inject_and_see(inject, lambda: got.append(child.allocate(KiB)))
                consistent(root)
                if raised:  # all or nothing: undone
                    assert got == [] and child.used == KiB and len(child.report().live_blocks) == 1
                else:
                    assert got[0] is not None and child.used == 2 * KiB
                    assert child.free(got[0])
                assert kept is not None and child.free(kept)
                assert root.report().trace_error is None  # the trace went on
        return run

    def free(backend: Backend | None = None, traced: bool = True) -> Run:
        def run(inject: Callable[[Callable[[], object]], None]) -> None:
            with pool(backend, traced) as root, gpu_budget("32KiB", name="c") as child:
                block = child.allocate(KiB)
                assert block is not None
                _inject_and_see(inject, lambda: child.free(block))
                consistent(root)
                assert child.used == 0 and child.size_of(block) == 0  # done, raised or not
                assert root.report().trace_error is None
        return run

    def resize(backend: Backend | None = None, traced: bool = True) -> Run:
        def run(inject: Callable[[Callable[[], object]], None]) -> None:
            with pool(backend, traced) as root:
                block = root.allocate(KiB)
                assert block is not None
                _inject_and_see(inject, lambda: root.resize(block, 2 * KiB))
                consistent(root)
                assert root.size_of(block) == 2 * KiB  # in place: done, raised or not
                assert root.free(block) and root.report().trace_error is None
        return run

    def enter_and_exit(inject: Callable[[Callable[[], object]], None]) -> None:
        with pool() as root:
            entered: list[Budget] = []

            def operation() -> None:
                with gpu_budget("8KiB", name="short") as short:
                    entered.append(short)

            _inject_and_see(inject, operation)
            assert gpubudget.current_budget() is root  # never left active
            assert all(short.state == "released" for short in entered)
            consistent(root)
            assert root.report().trace_error is None

    def free_after_the_root(inject: Callable[[Callable[[], object]], None]) -> None:
        with pool() as root:
            block = root.allocate(KiB)
        states = [root.state]  # exited: the trace file is closed now
        assert block is not None
        _inject_and_see(inject, lambda: root.free(block))  # the writer opens it again
        states.append(root.state)
        assert states == ["exited", "released"] and root.report().trace_error is None

    clock = PythonClock
    return {
        "allocate, traced": (WRITER_CODE, allocate()),
        "allocate with a stack, traced": (WRITER_CODE, allocate(stacks=True)),
        "free, traced": (WRITER_CODE, free()),
        "resize, traced": (WRITER_CODE, resize()),
        "enter and exit, traced": (WRITER_CODE, enter_and_exit),
        "free after the root exited, traced": (WRITER_CODE, free_after_the_root),
        "allocate, a Python clock": (CLOCK_CODE, allocate(clock(), traced=False)),
        "free, a Python clock": (CLOCK_CODE, free(clock(), traced=False)),
        "resize, a Python clock": (CLOCK_CODE, resize(clock(), traced=False)),
    }


_outcomes: list[tuple[bool, bool]] = []  # (fired, reached the caller) of the current run


def _inject_and_see(inject: Callable[[Callable[[], object]], None],
                    operation: Callable[[], object]) -> bool:
    """Inject into ``operation``; whether it raised the injected exception."""
    inject(operation)
    return _outcomes[-1][1]


SCENARIO_NAMES = list(_scenarios(Path("/nonexistent")))


@pytest.mark.parametrize("kind", ["signal", "async"])
@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_an_exception_at_any_instruction_of_the_clock_or_the_writer_is_never_lost(
        name: str, kind: str, tmp_path: Path) -> None:
    zone, scenario = _scenarios(tmp_path)[name]
    expected = Timeout if kind == "signal" else Cancelled
    held_locks: list[int] = []

    def inject_at(index: int) -> Callable[[Callable[[], object]], None]:
        def inject(operation: Callable[[], object]) -> None:
            fired, raised = _raise_at(index, zone, kind, operation)
            _outcomes.append((fired, isinstance(raised, expected)))
            assert raised is None or fired, f"{name}: {raised!r} raised with no injection"
            for each in list(writer._every):
                if not free_elsewhere(each._lock):
                    held_locks.append(index)
        return inject

    scenario(inject_at(-1))  # one run without a fault first (3.12 starts opcode events late)
    index, lost = 0, []
    while True:
        _outcomes.clear()
        scenario(inject_at(index))
        fired, reached = _outcomes[-1]
        if not fired:
            break
        if not reached:
            lost.append(index)
        index += 1
    assert index > 5, f"{name}: only {index} instructions traced"
    assert lost == [], f"{name}: {len(lost)} of {index} exceptions lost, at {lost[:20]}"
    assert held_locks == [], f"{name}: the writer's lock left held at {held_locks[:20]}"
    if "traced" in name:  # every event written once: the trace reads back whole
        events = read_trace(tmp_path / "trace.jsonl").events
        assert len(events) > index


# -- callbacks: answered, then raised again in Python -----------------------------------------

_CALLBACK = """
    import signal, sys, time
    import tensorrt_rtx_bindings as trt
    from gpubudget import gpu_budget
    from gpubudget import tensorrt as gbt
    from tests.trampoline import Trampoline

    where, then = sys.argv[1], sys.argv[2]
    # as from a terminal: a background job of a script (a CI's) inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def timeout(signum, frame):
        raise TimeoutError("the program's timeout")

    signal.signal(signal.SIGALRM, timeout)
    if then == "own-sigint":
        signal.signal(signal.SIGINT, lambda signum, frame: print("SIGINT handler ran"))
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        cpp = Trampoline(gbt.allocator(trt_module=trt))

        def alarm(frame, event, arg):  # the timeout fires as the callback starts, or deeper
            if event == "call" and frame.f_code.co_name == where:
                signal.raise_signal(signal.SIGALRM)
                return None
            return alarm

        answered = "?"  # raised again before the answer was seen
        try:  # raised again once control is back in Python: at once, or in the sleep
            sys.settrace(alarm)
            block = cpp.allocate(4096)
            sys.settrace(None)
            answered = str(block is not None)
            if then == "ends":
                print("the program ends", flush=True)
                sys.exit(0)
            for _ in range(6000):  # a minute at most: it ends at the delivery
                time.sleep(0.01)
            print("no timeout")
        except TimeoutError as exc:
            sys.settrace(None)
            print("timeout raised again in python:", exc)
        print("callback answered", answered)
        pool.check()
        print("used", pool.used)
"""


@pytest.mark.parametrize(("where", "answered", "used"), [
    ("current_budget", False, 0),  # in what the callback calls first: answered as denied
    ("alloc", True, 4096),  # in the trace writer under it: the allocation completes
])
@pytest.mark.parametrize("sigint", ["ours", "own-sigint"])
def test_a_signal_handlers_exception_in_a_callback_is_raised_again_in_python(
        where: str, answered: bool, used: int, sigint: str, tmp_path: Path) -> None:
    pytest.importorskip("tensorrt_rtx_bindings")
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_CALLBACK), where, sigint],
                            capture_output=True, text=True, timeout=60,
                            env=subprocess_env(GPUBUDGET_BACKEND="host",
                                               GPUBUDGET_TRACE=str(tmp_path / "t.jsonl")))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "timeout raised again in python: the program's timeout", lines
    assert lines[1] in (f"callback answered {answered}", "callback answered ?"), lines
    assert lines[-1] == f"used {used}"  # answered as denied, or the allocation completed
    assert "SIGINT handler ran" not in lines  # a program's own handler is left alone


def test_a_signal_handlers_exception_in_a_callback_is_not_lost_when_the_program_ends(
        tmp_path: Path) -> None:
    pytest.importorskip("tensorrt_rtx_bindings")
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_CALLBACK), "current_budget", "ends"],
            capture_output=True, text=True, timeout=60,
            env=subprocess_env(GPUBUDGET_BACKEND="host"))
        # raised again in Python code before the program ended (then caught), or printed
        # at exit with status 1: never silent
        caught = "timeout raised again in python" in result.stdout
        assert caught or result.returncode == 1, (result.returncode, result.stderr)
        assert caught or "TimeoutError: the program's timeout" in result.stderr


# -- the core itself: every instruction under the tree's lock ---------------------------------

def _core_code() -> set[CodeType]:
    from gpubudget._core import arena, ledger, memory, node, recorder, streams, tree

    return set().union(*(_codes_of(module) for module in
                         (arena, ledger, memory, node, recorder, streams, tree)))


@pytest.mark.parametrize("name", list(tree_scenarios()))
def test_an_exception_at_any_instruction_of_the_core_leaves_the_tree_whole(name: str) -> None:
    """Anywhere in the tree's code and what it calls (the arena's and the ledger's loops in
    the pure-Python core, between two steps of a commit in either): the operation happens
    whole or not at all, the lock is free, and the exception reaches the caller."""
    scenario, zone = tree_scenarios()[name], _core_code()
    scenario(lambda operation: _raise_at(-1, zone, "async", operation, True))  # no fault
    index, lost, broken = 0, [], []
    while True:
        fired = False

        def inject(operation: Callable[[], object]) -> None:
            nonlocal fired
            budget = gpubudget.current_budget()
            assert budget is not None
            lock = budget._node.tree.lock  # type: ignore[union-attr]
            fired, raised = _raise_at(index, zone, "async", operation, True)
            if fired and raised is None:
                lost.append(index)
            if not free_elsewhere(lock):
                lock.release()
                broken.append(f"{index}: the lock is held")
            try:
                consistent(budget.root)
            except (AssertionError, gpubudget.InvariantError) as exc:
                broken.append(f"{index}: {exc}")

        scenario(inject)
        if not fired:
            break
        index += 1
    assert index > 10, f"{name}: only {index} instructions traced"
    assert lost == [] and broken == [], (f"{name}: of {index} faults, lost at {lost[:10]}, "
                                         f"left the tree broken at {broken[:5]}")
