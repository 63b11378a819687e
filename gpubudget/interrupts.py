"""Ctrl-C that cannot split an operation: ``KeyboardInterrupt`` deferred inside gpubudget.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Landing in
the middle of an allocation it could leave the arena, the live-block registry and ``used``
disagreeing. So, as Trio does, gpubudget marks the functions through which every operation
enters (:func:`protect`) and installs a SIGINT handler that, when the main thread is inside
one of them, only notes the interrupt. The operation then finishes, and the interrupt is
delivered where it is safe:

- a public method (``allocate``, ``free``, ``resize``, entering or leaving a ``with``) raises
  ``KeyboardInterrupt`` on its way out. ``allocate`` and ``__enter__`` first undo what they
  did, so the call is all-or-nothing; ``free``, ``resize`` and ``__exit__`` complete first.
- an allocator callback (TensorRT, CuPy, PyTorch) cannot raise into its C++ caller: it
  answers as if the request were denied (``None``; frees still complete) and the interrupt
  is raised again in the main thread once control is back in Python (:func:`redeliver`).
  If the program ends before that (within a millisecond or so), the interrupt is delivered
  at interpreter exit, once gpubudget's own exit handlers have run (traces flushed, ledger
  slots freed): "KeyboardInterrupt" on stderr and the process ends by SIGINT, as Python ends
  on an interrupt nobody caught (a shell sees exit status 130).

The handler is installed when the first root budget is entered in the main thread, and only
over Python's default SIGINT handler: a program with a handler of its own (a server that
stops gracefully, ``asyncio.run`` while it runs) keeps it, and gpubudget then relies on
that handler not raising in the middle of a call. Outside gpubudget's code the installed
handler behaves exactly like Python's default.
"""

from __future__ import annotations

import _thread
import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Final, TypeVar

__all__ = [
    "STATE",
    "callback",
    "defer",
    "install",
    "pass_on",
    "protect",
    "raise_here",
    "redeliver",
    "take",
]

F = TypeVar("F", bound=Callable[..., object])


class _State:
    __slots__ = ("pending", "installed", "redelivering", "exiting")

    def __init__(self) -> None:
        self.pending = False  # an interrupt arrived inside protected code, not yet delivered
        self.installed = False
        self.redelivering = 0  # interrupts passed on to the main thread, not yet sent to it
        self.exiting = False  # the interpreter exits: what is passed on is delivered then


STATE: Final = _State()
_PROTECTED: Final[set[CodeType]] = set()
_CALLBACKS: Final[set[CodeType]] = set()
_POLL_SECONDS: Final = 0.001
_POLLS: Final = 10_000  # give up waiting after about 10 s: deliver anyway
_delivery: Final = threading.Lock()  # the helper thread's sending, or the exit's, not both


def protect(function: F) -> F:
    """Mark ``function``: an interrupt arriving while it runs (in it, or anything it calls)
    is deferred. Compiled functions have no code object and need no mark: the interpreter
    cannot interrupt them between two of their operations."""
    code = getattr(function, "__code__", None)
    if isinstance(code, CodeType):
        _PROTECTED.add(code)
    return function


def callback(function: F) -> F:
    """Mark ``function`` as an allocator callback (and protect it): a public method called
    inside it leaves a pending interrupt to it rather than raise into C++ code."""
    code = getattr(function, "__code__", None)
    if isinstance(code, CodeType):
        _CALLBACKS.add(code)
    return protect(function)


def _within(frame: FrameType | None, codes: set[CodeType]) -> bool:
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _handler(signum: int, frame: FrameType | None) -> None:
    if _within(frame, _PROTECTED):
        STATE.pending = True
        return
    signal.default_int_handler(signum, frame)


def install() -> None:
    """Install the deferring SIGINT handler (main thread, over Python's default only)."""
    if STATE.installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _handler)
            STATE.installed = True
    except (ValueError, OSError):  # pragma: no cover - an embedded interpreter without signals
        pass


def defer() -> None:
    """Note an interrupt that was caught where it could not be raised."""
    STATE.pending = True


def raise_here() -> bool:
    """For a public method on its way out with an interrupt pending: ``True`` (and the
    interrupt taken) when it should raise ``KeyboardInterrupt`` now, ``False`` when it runs
    inside an allocator callback, which delivers it instead."""
    if _within(sys._getframe(1), _CALLBACKS):
        return False
    return take()


def take() -> bool:
    """Whether an interrupt is pending, clearing it."""
    pending, STATE.pending = STATE.pending, False
    return pending


def pass_on() -> None:
    """For a callback on its way out: an interrupt deferred while it ran goes on to the main
    thread (see :func:`redeliver`)."""
    if STATE.pending and take():
        redeliver()


def redeliver() -> None:
    """Raise a taken interrupt again in the main thread, once it is out of gpubudget's code.

    A helper thread waits until the main thread's Python stack holds no protected function
    (the callback that took the interrupt has returned to its C++ caller, or that caller has
    returned to Python), then sends SIGINT to the main thread, as a Ctrl-C would: the
    handler raises ``KeyboardInterrupt`` there, or defers it again if the main thread is
    back in a callback by then, which then passes it on again.
    """
    with _delivery:
        STATE.redelivering += 1  # delivered at exit if the helper thread cannot
    try:
        threading.Thread(target=_interrupt_main_when_out, name="gpubudget-interrupt",
                         daemon=True).start()
    except RuntimeError:  # interpreter shutting down: the exit handler delivers it
        pass


def _interrupt_main_when_out() -> None:
    main = threading.main_thread().ident
    for _ in range(_POLLS):
        frame = sys._current_frames().get(main) if main is not None else None
        if frame is None or STATE.exiting:
            return  # the main thread's program has ended: delivered at exit
        if not _within(frame, _PROTECTED):
            break
        time.sleep(_POLL_SECONDS)
    with _delivery:
        if STATE.exiting or not STATE.redelivering:
            return
        STATE.redelivering -= 1
        if hasattr(signal, "pthread_kill") and main is not None:
            signal.pthread_kill(main, signal.SIGINT)  # wakes a sleeping main thread, as Ctrl-C
        else:  # pragma: no cover - Windows
            _thread.interrupt_main()


def _deliver_at_exit() -> None:
    """Interpreter exit: an interrupt passed on to the main thread and not yet sent (the
    program ended first) ends the process by SIGINT, as an uncaught ``KeyboardInterrupt``
    does. Registered when this module is imported, before gpubudget's other exit handlers,
    so it runs after them (``atexit`` runs the last registered first)."""
    with _delivery:
        STATE.exiting = True
        due = STATE.redelivering
    if not due or os.getpid() != _PID:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    try:
        sys.stderr.write("KeyboardInterrupt\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except (ValueError, OSError):  # pragma: no cover - not the main thread, or no signals
        pass
    os._exit(130)  # pragma: no cover - SIGINT blocked: the same status a shell would show


def _forked() -> None:
    """In a forked child: the parent's interrupts are the parent's."""
    global _PID
    _PID = os.getpid()
    STATE.redelivering = 0
    STATE.exiting = False
    STATE.pending = False
    getattr(_delivery, "_at_fork_reinit")()


_PID = os.getpid()
atexit.register(_deliver_at_exit)
os.register_at_fork(after_in_child=_forked)
