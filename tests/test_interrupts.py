"""What happens to an exception that a callback cannot raise, and to a Ctrl-C or a signal
handler's exception anywhere in gpubudget (:mod:`gpubudget.interrupts`).

Each program runs in a process of its own: signals, exit handlers and exit statuses are the
process's. A Ctrl-C is made to land inside a callback by a trace function that raises it (or
sends the signal) as a function the callback calls starts, which is where Python runs a
signal handler; nothing waits for a time to pass but a bound on a wait that ends sooner.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget import interrupts
from tests.helpers import subprocess_env

_CALLBACK = """
    import signal, sys, threading, time
    from gpubudget import gpu_budget
    from gpubudget import tensorrt as gbt

    def landing(what):
        '''A trace function raising ``what()`` as the callback asks for its label.'''
        def trace(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "current_label":
                sys.settrace(None)
                what()
            return None
        return trace

    def callback_of(pool):
        import tensorrt_rtx_bindings as trt
        from tests.trampoline import Trampoline
        return Trampoline(gbt.allocator(trt_module=trt))
"""


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    source = textwrap.dedent(_CALLBACK) + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", source, *args], capture_output=True,
                          text=True, timeout=180, env=subprocess_env(**env))


def _ctrl_c() -> None:
    signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("thread", ["main thread", "another thread"])
def test_a_ctrl_c_in_a_callback_is_denied_and_raised_once_in_the_main_thread(
        thread: str) -> None:
    pytest.importorskip("tensorrt_rtx_bindings")
    result = _run("""
        import _thread
        signal.signal(signal.SIGINT, signal.default_int_handler)
        on_main = sys.argv[1] == "main thread"
        with gpu_budget("1MiB", name="pool", backend="host") as pool:
            cpp = callback_of(pool)
            answers = []

            def call():
                # a Ctrl-C lands in the callback: in the main thread by the signal, elsewhere
                # raised as Python raises one there (what Python's own handler raises)
                sys.settrace(landing(lambda: signal.raise_signal(signal.SIGINT) if on_main
                                     else (_ for _ in ()).throw(KeyboardInterrupt())))
                answers.append(cpp.allocate(4096))

            raised = 0
            try:
                if on_main:
                    call()
                else:
                    worker = threading.Thread(target=call)
                    worker.start()
                    worker.join(120)
                time.sleep(120)  # ends at once if the interrupt was armed again
            except KeyboardInterrupt:
                raised += 1
            try:
                for _ in range(20):
                    time.sleep(0.01)  # a second one would land here
            except KeyboardInterrupt:
                raised += 1
            # in the main thread the first Python code after the call raises it: nothing
            # was appended; elsewhere the callback's denial is the answer
            print("answers", answers, "raised", raised, flush=True)
            report = pool.report()
            print("denied", report.denied, "used", pool.used, flush=True)
            pool.check()
    """, thread)
    assert result.returncode == 0, result.stderr
    answers = "[]" if thread == "main thread" else "[None]"
    assert result.stdout.splitlines() == [f"answers {answers} raised 1", "denied 1 used 0"]
    assert "Exception caught" not in result.stderr  # nothing reached NVIDIA's binding


def test_any_other_exception_in_a_callback_goes_to_the_unraisable_hook() -> None:
    pytest.importorskip("tensorrt_rtx_bindings")
    result = _run("""
        seen = []
        sys.unraisablehook = seen.append
        with gpu_budget("1MiB", name="pool", backend="host") as pool:
            cpp = callback_of(pool)

            def fail():
                raise LookupError("in the label")

            sys.settrace(landing(fail))
            print("answer", cpp.allocate(4096), flush=True)
            (args,) = seen
            print(type(args.exc_value).__name__, args.exc_value, flush=True)
            print(args.err_msg, flush=True)
            print(pool.report().callback_errors, flush=True)
            pool.check()
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "answer None"
    assert lines[1] == "LookupError in the label"
    assert "allocate_async" in lines[2] and "'pool'" in lines[2]
    assert "LookupError" in lines[3]
    assert "Exception caught" not in result.stderr


def test_a_ctrl_c_raised_by_another_signals_handler_is_raised_again_with_sigint_ignored(
        ) -> None:
    pytest.importorskip("tensorrt_rtx_bindings")
    result = _run("""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job, nohup
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # "stop like a Ctrl-C"
        with gpu_budget("1MiB", name="pool", backend="host") as pool:
            cpp = callback_of(pool)
            sys.settrace(landing(lambda: signal.raise_signal(signal.SIGTERM)))
            try:
                answer = cpp.allocate(4096)
                time.sleep(120)
                print("not raised", answer, flush=True)
            except KeyboardInterrupt:
                print("raised again", flush=True)
            pool.check()
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["raised again"]


_AT_EXIT = """
    import atexit, logging, logging.handlers, _thread
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = logging.StreamHandler(sys.stdout)
    buffered = logging.handlers.MemoryHandler(capacity=100, target=out)
    logging.getLogger("program").addHandler(buffered)
    logging.getLogger("program").warning("a buffered record")  # flushed at exit, by logging
    atexit.register(lambda: print("program's cleanup ran", flush=True))
    gpubudget = sys.argv[1] == "gpubudget"
    if gpubudget:
        pool = gpu_budget("1MiB", name="pool", backend="host").__enter__()
        cpp = callback_of(pool)
    ending = threading.Event()

    def in_shutdown():
        frames = sys._current_frames().get(threading.main_thread().ident)
        while frames is not None:
            if frames.f_code.co_name == "_shutdown":
                return True
            frames = frames.f_back
        return False

    def late_callback():
        ending.wait()
        while not in_shutdown():  # the main thread waits for this one, as Python ends
            time.sleep(0.001)
        if gpubudget:  # a Ctrl-C lands in the callback, on this thread
            sys.settrace(landing(lambda: (_ for _ in ()).throw(KeyboardInterrupt())))
            cpp.allocate(4096)
        else:  # the same Ctrl-C, from plain Python
            _thread.interrupt_main()

    threading.Thread(target=late_callback).start()
    print("the program ends", flush=True)
    ending.set()
"""


def test_a_ctrl_c_in_a_callback_as_the_program_ends_runs_every_exit_handler() -> None:
    pytest.importorskip("tensorrt_rtx_bindings")
    plain = _run(_AT_EXIT, "plain")
    budgeted = _run(_AT_EXIT, "gpubudget")
    for result in (plain, budgeted):
        lines = result.stdout.splitlines()
        assert lines[0] == "the program ends", result.stderr
        assert "program's cleanup ran" in lines and "a buffered record" in lines, result
    assert budgeted.returncode == plain.returncode, (plain, budgeted)
    assert "KeyboardInterrupt" in budgeted.stderr  # Python said it, as for plain Python


_ALARMS = """
    import os, random, signal, sys
    from gpubudget import current_budget, gpu_budget
    import gpubudget

    def alarm(signum, frame):
        raise TimeoutError("alarm")

    elsewhere = []  # where Python itself sends it: raised in a weakref callback, a finalizer

    def unraisable(args):
        elsewhere.append(type(args.exc_value).__name__)

    signal.signal(signal.SIGALRM, alarm)
    sys.unraisablehook = unraisable
    trace = sys.argv[1] if sys.argv[1] != "-" else None
    random.seed(7)
    raised = inside = in_flight = stranded = missing = 0
    with gpu_budget("4MiB", name="pool", backend="host", trace=trace) as pool:
        for trial in range(200):
            blocks = []
            before = len(elsewhere)
            try:
                signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0001, 0.003))
                for step in range(5_000):  # far more than the alarm leaves time for
                    if step % 7 == 6:
                        with gpu_budget("1MiB", name="child") as child:
                            blocks.append(child.allocate(512, tag="c"))
                    elif len(blocks) > 40:
                        pool.free(blocks.pop(random.randrange(len(blocks))))
                    else:
                        blocks.append(pool.allocate(random.choice((256, 4096, 65536))))
                    if step % 50 == 0:
                        pool.report()
                missing += elsewhere[before:] != ["TimeoutError"]  # then it was swallowed
            except TimeoutError:
                raised += 1
                tb = sys.exc_info()[2]
                while tb is not None and "gpubudget" not in tb.tb_frame.f_code.co_filename:
                    tb = tb.tb_next
                inside += tb is not None
            signal.setitimer(signal.ITIMER_REAL, 0)
            if current_budget() is not pool:  # it landed as a child's __exit__ began
                stranded += 1
                current_budget().__exit__(None, None, None)
            pool.check()
            for block in blocks:
                if block is not None:
                    pool.free(block)
            pool.check()
            # an allocation the alarm cut short is undone; one it hit after the block was
            # returned, before the loop stored it, is the program's: live, and listed
            lost = list(pool._node.tree.live)
            assert len(lost) <= 1, lost
            for address in lost:
                in_flight += 1
                assert pool.free(address)
            assert pool.used == 0, pool.used
    rare = in_flight < 20 and stranded < 20 and len(elsewhere) < 20
    print(gpubudget.compiled, raised, len(elsewhere), missing, inside > 0, rare, flush=True)
"""


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
@pytest.mark.parametrize("core", ["C", "pure"])
def test_a_signal_handlers_timeout_propagates_from_the_public_api_and_leaves_it_whole(
        core: str, traced: bool, tmp_path: Path) -> None:
    import gpubudget

    if core == "C" and not gpubudget.compiled:
        pytest.skip("the C core is not built here")
    trace = str(tmp_path / "run.jsonl") if traced else "-"
    result = _run(_ALARMS, trace, GPUBUDGET_PURE="1" if core == "pure" else "0")
    assert result.returncode == 0, result.stderr
    compiled, raised, elsewhere, missing, inside, rare = result.stdout.split()
    assert compiled == str(core == "C")
    # each alarm propagated, or Python itself sent it to sys.unraisablehook (it landed in a
    # weakref callback or a finalizer, where no code can raise); none was swallowed
    assert (int(raised) + int(elsewhere), int(missing), rare) == (200, 0, "True"), result
    if core == "pure" or traced:
        assert inside == "True"  # and some landed inside gpubudget's own code


def test_no_signal_handler_is_installed_and_asyncio_keeps_its_own() -> None:
    result = _run("""
        import asyncio
        with gpu_budget("1MiB", name="pool", backend="host"):
            pass
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
        seen = []

        async def main():
            with gpu_budget("1MiB", name="served", backend="host") as pool:
                asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGINT)
                try:
                    while True:
                        pool.free(pool.allocate(256))
                        await asyncio.sleep(0.001)
                except asyncio.CancelledError:
                    seen.append("cancelled")
                    raise

        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            print(seen, flush=True)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True", "['cancelled']"]


def test_a_ctrl_c_is_raised_at_once_while_other_threads_allocate() -> None:
    result = _run("""
        import _thread
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with gpu_budget("4MiB", name="pool", backend="host") as pool:
            stop = threading.Event()
            sent = []

            def churn():
                while not stop.is_set():
                    block = pool.allocate(4096)
                    if block is not None:
                        pool.free(block)

            others = [threading.Thread(target=churn) for _ in range(3)]
            for other in others:
                other.start()
            after = 0
            try:
                for step in range(10_000_000):
                    if sent:
                        after += 1
                    pool.free(pool.allocate(4096))
                    if step == 1000:
                        threading.Thread(target=lambda: (sent.append(1),
                                                         _thread.interrupt_main())).start()
            except KeyboardInterrupt:
                print("raised after", min(after, 10), "steps", flush=True)
            stop.set()
            for other in others:
                other.join()
            pool.check()
    """, GPUBUDGET_PURE="1")
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith("raised after") and int(line.split()[2]) <= 1, line


def test_pass_on_answers_and_arms_the_interrupt_only_as_the_answer_is_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    armed: list[int] = []
    monkeypatch.setattr(interrupts, "_carrier", interrupts._carrier.__wrapped__)
    import _thread

    monkeypatch.setattr(_thread, "interrupt_main", armed.append)
    monkeypatch.setattr(signal, "getsignal", lambda signum: (
        signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL))
    answer = interrupts.pass_on(KeyboardInterrupt(), "test", 0)
    assert answer == 0 and isinstance(answer, int) and armed == []
    del answer
    assert armed == [signal.SIGINT]


def test_an_exception_that_cannot_propagate_is_printed_as_python_prints_it(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    try:
        raise ValueError("broken")
    except ValueError as exc:
        interrupts.unraisable(exc, "Exception ignored in a callback", "obj")
    err = capsys.readouterr().err
    assert err.startswith("Exception ignored in a callback: 'obj'\nTraceback")
    assert err.rstrip().endswith("ValueError: broken")


def test_a_budget_leaves_the_signal_handlers_alone() -> None:
    before: dict[int, Any] = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    with gpu_budget("1MiB", backend="host") as pool:
        pool.free(pool.allocate(256, raise_on_denial=True))
    assert {n: signal.getsignal(n) for n in before} == before
