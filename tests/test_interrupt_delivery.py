"""What a callback passes on to the main thread reaches it, once each, whatever else arrives.

A callback cannot raise into its C++ caller: a Ctrl-C, or a signal handler's exception, that
lands in one is raised again in the main thread by a SIGINT that gpubudget sends once the
main thread is out of its code. Each script here runs in a process of its own and makes the
moment that matters happen on purpose: the main thread stays in a protected function of the
script (gpubudget sends nothing while it runs) until SIGINT is blocked or the script holds
what the sending waits for; every wait is for an event, with a generous limit that fails
loudly. Each failed before the fix it was written for.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import subprocess_env

_PRELUDE = """
    import signal, sys, threading, time
    # as from a terminal: a background job of a script (a CI's) inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from gpubudget import gpu_budget, interrupts

    def within(seconds, done, what):  # wait for a condition another thread makes true
        deadline = time.monotonic() + seconds
        while not done():
            if time.monotonic() > deadline:
                print("never:", what, flush=True)
                sys.exit(3)
            time.sleep(0.001)
"""

_PYTHON_CALLBACK = """
    def ask(pool, size):
        return pool.allocate(size)

    @interrupts.callback
    def allocate_async(pool, size):  # called as C code would: nothing can raise out of it
        try:
            return ask(pool, size)
        except KeyboardInterrupt as exc:  # raised into this thread from outside
            interrupts.defer(exc)
            return None
        finally:
            if interrupts.STATE.pending:
                interrupts.pass_on()

    def ctrl_c(frame, event, arg):  # a Ctrl-C as the callback starts
        if event == "call" and frame.f_code.co_name == "allocate_async":
            signal.raise_signal(signal.SIGINT)
        return None
"""

_TENSORRT_CALLBACK = """
    import tensorrt_rtx_bindings as trt
    from gpubudget import tensorrt as gbt
    from tests.trampoline import Trampoline

    def timeout(signum, frame):
        raise TimeoutError("the program's timeout")

    signal.signal(signal.SIGALRM, timeout)
    fired = []

    def alarm(frame, event, arg):  # the timeout fires as the callback asks for the budget
        if event == "call" and frame.f_code.co_name == "current_budget" and not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGALRM)
            return None
        return alarm

    def alarm_and_ctrl_c(frame, event, arg):  # and the user's Ctrl-C as the callback starts
        if (event == "call" and frame.f_code.co_name == "allocate_async"
                and "tensorrt" in frame.f_code.co_filename and not fired):
            signal.raise_signal(signal.SIGINT)
        return alarm(frame, event, arg)

    def caught(got, step):  # what reaches the program: at once, or in a minute's sleep
        try:
            step()
            time.sleep(60)
            got.append("nothing")
        except TimeoutError:
            got.append("TimeoutError")
        except KeyboardInterrupt:
            got.append("KeyboardInterrupt")
"""


def _run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(GPUBUDGET_BACKEND="host"))


_OWN_HANDLER = _PRELUDE + _PYTHON_CALLBACK + """
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        @interrupts.protect
        def in_gpubudget():
            sys.settrace(ctrl_c)
            block = allocate_async(pool, 4096)
            sys.settrace(None)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # a critical section
            return block

        block = in_gpubudget()
        within(60, lambda: signal.SIGINT in signal.sigpending(), "the Ctrl-C sent")
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda signum, frame: stop.set())  # a graceful stop
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        print("the program's handler ran:", stop.wait(60), flush=True)
        pool.free(block)
    print("the program ends", flush=True)
"""


def test_a_ctrl_c_the_programs_own_handler_took_is_not_delivered_again_at_exit() -> None:
    """The SIGINT sent for a Ctrl-C passed on reaches the program's own handler, installed
    meanwhile: the program handled it, and ends normally (before: killed by SIGINT at exit,
    the count of SIGINTs sent still set)."""
    result = _run(_OWN_HANDLER)
    assert result.stdout.splitlines() == ["the program's handler ran: True",
                                          "the program ends"], result.stderr
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert "KeyboardInterrupt" not in result.stderr


_WAITING_FOR_A_THREAD = _PRELUDE + _PYTHON_CALLBACK + """
    with gpu_budget("1MiB", name="pool", backend="host"):
        pass  # gpubudget's handler installed
    main, never = threading.main_thread(), threading.Event()

    def waits_for_the_threads():
        frame = sys._current_frames().get(main.ident)
        return frame is not None and frame.f_code is threading._shutdown.__code__

    def worker():
        within(60, waits_for_the_threads, "the interpreter waiting for this thread")
        with gpu_budget("1MiB", name="worker's", backend="host") as pool:
            print("worker: a Ctrl-C lands in a callback", flush=True)

            def raised_into(frame, event, arg):  # as PyThreadState_SetAsyncExc would
                if event == "call" and frame.f_code.co_name == "ask":
                    raise KeyboardInterrupt
                return raised_into

            sys.settrace(raised_into)
            allocate_async(pool, 4096)
            sys.settrace(None)
        if not never.wait(120):
            print("worker: still waiting after 120 s", flush=True)

    threading.Thread(target=worker).start()  # not a daemon: the interpreter waits for it
    print("the program ends", flush=True)
"""


def test_a_ctrl_c_passed_on_while_the_interpreter_waits_for_threads_stops_the_wait() -> None:
    """As a Ctrl-C pressed there does (before: held until the threads ended, here 120 s;
    forever for a thread that never ends); the process still ends by SIGINT."""
    result = _run(_WAITING_FOR_A_THREAD, timeout=300)
    assert result.stdout.splitlines() == ["the program ends",
                                          "worker: a Ctrl-C lands in a callback"], (
        result.stdout, result.stderr)
    assert result.returncode in (-signal.SIGINT, 130), (result.returncode, result.stderr)
    assert "KeyboardInterrupt" in result.stderr


_CTRL_C_WHILE_AN_EXCEPTION_WAITS = _PRELUDE + _TENSORRT_CALLBACK + """
    where = sys.argv[1]
    got = []
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        cpp = Trampoline(gbt.allocator(trt_module=trt))

        @interrupts.protect
        def in_gpubudget():  # gpubudget sends nothing while the main thread is here
            sys.settrace(alarm)
            cpp.allocate(4096)  # the timeout is passed on to the main thread
            sys.settrace(None)
            if where == "inside":  # the main thread in gpubudget's code: the Ctrl-C noted
                signal.raise_signal(signal.SIGINT)
                pool.allocate(1024)  # which raises it on its way out
            else:
                interrupts._delivery.acquire()  # gpubudget's sending waits for this

        def step():
            try:
                in_gpubudget()
                if where == "outside":  # the user's Ctrl-C before the timeout was sent
                    signal.raise_signal(signal.SIGINT)
            finally:
                if where == "outside":
                    interrupts._delivery.release()

        caught(got, step)
        caught(got, lambda: None)
    print(got, flush=True)
"""


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_a_ctrl_c_while_an_exception_waits_to_be_sent_is_raised_too(where: str) -> None:
    """A signal handler's exception passed on to the main thread waits to be sent when the
    user presses Ctrl-C, the main thread still in gpubudget's code or out of it: both reach
    the program (before: the exception was raised in place of the Ctrl-C)."""
    pytest.importorskip("tensorrt_rtx_bindings")
    result = _run(_CTRL_C_WHILE_AN_EXCEPTION_WAITS, where)
    assert result.stdout.splitlines() == ["['KeyboardInterrupt', 'TimeoutError']"], (
        result.stdout, result.stderr)
    assert result.returncode == 0, (result.returncode, result.stderr)


_MERGED = _PRELUDE + _TENSORRT_CALLBACK + """
    got = []
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        cpp = Trampoline(gbt.allocator(trt_module=trt))

        @interrupts.protect
        def in_gpubudget():  # gpubudget sends nothing while the main thread is here
            sys.settrace(alarm_and_ctrl_c)
            cpp.allocate(4096)  # a Ctrl-C and the timeout land in one callback
            sys.settrace(None)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

        in_gpubudget()  # both are sent now, and merge: one SIGINT waits
        within(60, lambda: interrupts.STATE.sent == 2, "both sent")
        caught(got, lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}))
        caught(got, lambda: None)
    print(got, flush=True)
"""


def test_two_things_passed_on_whose_sigints_merge_are_both_raised() -> None:
    """A Ctrl-C and a signal handler's exception passed on from one callback: their two
    SIGINTs merge into one run of the handler, which raises one; the other is sent again
    (before: lost)."""
    pytest.importorskip("tensorrt_rtx_bindings")
    result = _run(_MERGED)
    assert result.stdout.splitlines() == ["['TimeoutError', 'KeyboardInterrupt']"], (
        result.stdout, result.stderr)
    assert result.returncode == 0, (result.returncode, result.stderr)


_INTERRUPTED_WHILE_PASSING_ON = _PRELUDE + """
    import tensorrt_rtx_bindings as trt
    from gpubudget import tensorrt as gbt
    from tests.trampoline import Trampoline

    first, where = sys.argv[1], sys.argv[2]

    def timeout(signum, frame):
        raise TimeoutError("the program's timeout")

    signal.signal(signal.SIGALRM, timeout)
    state = []
    asked = gbt.callbacks.current_budget

    def current_budget():  # inside the callback's try: the first thing lands
        if not state:
            state.append(first)
            signal.raise_signal(signal.SIGINT if first == "ctrl-c" else signal.SIGALRM)
        return asked()

    gbt.callbacks.current_budget = current_budget

    def tracer(frame, event, arg):  # the second lands as the callback passes on the first
        code = frame.f_code
        if (event == "call" and len(state) == 1 and code.co_name == where
                and code.co_filename.endswith(("interrupts.py", "threading.py"))):
            state.append(where)
            if first == "ctrl-c":
                signal.raise_signal(signal.SIGALRM)  # the program's timeout fires there
            raise KeyboardInterrupt  # as PyThreadState_SetAsyncExc would
        return tracer

    def caught(got, step):
        try:
            step()
            time.sleep(60)
            got.append("nothing")
        except TimeoutError:
            got.append("TimeoutError")
        except KeyboardInterrupt:
            got.append("KeyboardInterrupt")

    got, addresses = [], []
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        cpp = Trampoline(gbt.allocator(trt_module=trt))

        @interrupts.protect
        def in_gpubudget():  # gpubudget sends nothing while the main thread is here
            sys.settrace(tracer)
            try:
                addresses.append(cpp.allocate(4096))
            finally:
                sys.settrace(None)

        caught(got, in_gpubudget)
        caught(got, lambda: None)
        print(state, sorted(got), "answered", addresses != [None], flush=True)
        for address in addresses:
            if address is not None:
                cpp.deallocate(address)
"""


@pytest.mark.parametrize(("first", "where"), [
    ("ctrl-c", "redeliver"), ("ctrl-c", "_helper"), ("ctrl-c", "start"),
    ("timeout", "_pass_exception"), ("timeout", "_helper")])
def test_an_exception_raised_while_a_callback_passes_on_is_passed_on_too(
        first: str, where: str) -> None:
    """A Ctrl-C, or a signal handler's exception, taken by a TensorRT callback; as the
    callback passes it on (queues it, starts the thread that sends it), a second exception
    lands: both reach the program, the callback still answers with its block (denied, when
    the first ended the allocation), and nothing crosses into C++ (before: the second escaped into TensorRT's caller, which printed it,
    and the first, or the block, was lost)."""
    pytest.importorskip("tensorrt_rtx_bindings")
    result = _run(_INTERRUPTED_WHILE_PASSING_ON, first, where)
    assert result.stdout.splitlines() == [
        f"['{first}', '{where}'] ['KeyboardInterrupt', 'TimeoutError'] answered "
        f"{first == 'ctrl-c'}"], (
        result.stdout, result.stderr)
    assert "Exception caught" not in result.stderr and "still live" not in result.stderr, (
        result.stderr)
    assert result.returncode == 0, (result.returncode, result.stderr)


_WAITING_FOR_A_POOL_WORKER = _WAITING_FOR_A_THREAD.replace("""
        return frame is not None and frame.f_code is threading._shutdown.__code__
""", """
        while frame is not None:  # concurrent.futures joins its workers in an exit hook
            if frame.f_code is threading._shutdown.__code__:
                return True
            frame = frame.f_back
        return False
""").replace("""
    threading.Thread(target=worker).start()  # not a daemon: the interpreter waits for it
""", """
    from concurrent.futures import ThreadPoolExecutor

    ThreadPoolExecutor(1).submit(worker)  # the interpreter waits for its worker
""")


def test_a_ctrl_c_passed_on_while_the_interpreter_waits_for_an_executors_worker_stops_it(
        ) -> None:
    """As the above, the thread waited for being a ``ThreadPoolExecutor``'s worker, which
    the interpreter joins in an exit hook (before: not taken for a wait, the Ctrl-C held
    until the worker ended, here 120 s)."""
    assert _WAITING_FOR_A_POOL_WORKER.count("ThreadPoolExecutor") == 2
    result = _run(_WAITING_FOR_A_POOL_WORKER, timeout=300)
    assert result.stdout.splitlines() == ["the program ends",
                                          "worker: a Ctrl-C lands in a callback"], (
        result.stdout, result.stderr)
    assert result.returncode in (-signal.SIGINT, 130), (result.returncode, result.stderr)
    assert "KeyboardInterrupt" in result.stderr


_TEMPORARY_HANDLER = _PRELUDE + _PYTHON_CALLBACK + """
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        @interrupts.protect
        def in_gpubudget():
            sys.settrace(ctrl_c)
            block = allocate_async(pool, 4096)
            sys.settrace(None)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # a critical section
            return block

        block = in_gpubudget()
        within(60, lambda: signal.SIGINT in signal.sigpending(), "the Ctrl-C sent")
        got = []
        old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # the program takes it
        signal.signal(signal.SIGINT, old)  # and puts gpubudget's handler back
        print("the program's handler ran:", got == [signal.SIGINT], flush=True)
        pool.free(block)
    print("the program ends", flush=True)
"""


def test_a_ctrl_c_a_temporary_handler_took_is_not_delivered_again_at_exit() -> None:
    """The SIGINT sent for a Ctrl-C passed on reaches a handler the program installs for a
    while and then swaps gpubudget's back: the program handled it, and ends normally
    (before: ended by SIGINT at exit, as if the Ctrl-C had not reached it)."""
    result = _run(_TEMPORARY_HANDLER)
    assert result.stdout.splitlines() == ["the program's handler ran: True",
                                          "the program ends"], (result.stdout, result.stderr)
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert "KeyboardInterrupt" not in result.stderr


_ANOTHER_THREADS_OPERATION = _PRELUDE + """
    go, done = threading.Event(), threading.Event()
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        def worker():
            go.wait(60)
            try:
                pool.free(pool.allocate(1024))
                print("worker: nothing raised", flush=True)
            except KeyboardInterrupt:
                print("worker: KeyboardInterrupt", flush=True)
            done.set()

        thread = threading.Thread(target=worker)
        thread.start()

        @interrupts.protect
        def in_gpubudget():  # a long operation of the main thread
            signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C: noted
            go.set()
            print("worker done:", done.wait(60), flush=True)
            return pool.allocate(1024)  # the main thread's operation ends

        try:
            pool.free(in_gpubudget())
            time.sleep(60)
            print("main: nothing raised", flush=True)
        except KeyboardInterrupt:
            print("main: KeyboardInterrupt", flush=True)
        thread.join(60)
"""


def test_a_ctrl_c_noted_for_the_main_thread_is_not_raised_in_another_thread() -> None:
    """A Ctrl-C lands in an operation of the main thread; another thread's operation ends
    first: the main thread raises it, not the other thread (before: the other thread's
    method raised the main thread's Ctrl-C)."""
    result = _run(_ANOTHER_THREADS_OPERATION)
    assert result.stdout.splitlines() == ["worker: nothing raised", "worker done: True",
                                          "main: KeyboardInterrupt"], (
        result.stdout, result.stderr)
    assert result.returncode == 0, (result.returncode, result.stderr)
