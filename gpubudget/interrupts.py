"""What may not split an operation: Ctrl-C, and every exception raised into gpubudget from
outside, held while an operation runs and delivered where it is safe.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread; so does a
signal handler of the program (a ``SIGALRM`` timeout raising ``TimeoutError``), and, in any
thread, ``PyThreadState_SetAsyncExc`` or a trace function. Landing in the middle of an
allocation such an exception could leave the arena, the live-block registry and ``used``
disagreeing, or, caught by code that must not raise, be lost. So, as Trio does, gpubudget
marks the functions through which every operation enters (:func:`protect`), and:

- installs a SIGINT handler that, when the main thread is inside one of them, only notes the
  interrupt;
- where its own code catches everything (the trace writer, the clock of the timeline, a
  backend's event or copy, an adapter's exit hook, a callback's never-raise wrapper), it
  keeps any exception that came from outside (:func:`foreign`) rather than swallow it:
  :func:`hold` keeps it for the thread it landed in.

The operation then finishes, and what was noted or held is delivered where it is safe:

- a public method (``allocate``, ``free``, ``resize``, entering or leaving a ``with``, a
  growable root's ``trim``, ``offload``, ``restore``) raises it on its way out
  (:func:`due`). ``allocate`` and ``__enter__`` first undo what they did, so the call is
  all-or-nothing; ``free``, ``resize`` and ``__exit__`` complete first.
- an allocator callback (TensorRT, CuPy, PyTorch) cannot raise into its C++ caller: it
  answers as if the request were denied (``None``; frees still complete) and the exception
  is raised again once control is back in Python (:func:`pass_on`): a Ctrl-C, or an
  exception of a signal handler (they run in the main thread), in the main thread; another
  in the thread it landed in (the main thread when that is not a Python thread). What is
  passed on to the main thread is raised there one at a time, oldest first, each by a
  SIGINT of its own (a Ctrl-C the user presses meanwhile is raised as well, not in place of
  it). If the program ends before that (within a millisecond or so; or the callback ran in
  an exit handler, where Python would print an exception raised and go on), it is delivered
  at interpreter exit, once gpubudget's own exit handlers have run (traces flushed, ledger
  slots freed): a Ctrl-C as Python ends on an interrupt nobody caught ("KeyboardInterrupt"
  on stderr, the process ended by SIGINT: a shell sees exit status 130), any other
  exception with its traceback on stderr and exit status 1. While the interpreter waits for
  the program's threads, a Ctrl-C passed on stops the wait, as one pressed there does, and
  the process still ends by SIGINT. A SIGINT that gpubudget sent and a SIGINT handler the
  program installed meanwhile took: a Ctrl-C is then the program's, and nothing of it is
  left for the exit; an exception is sent again.

A handler that the program installs for a while and then swaps back (``old =
signal.signal(SIGINT, mine)`` ... ``signal.signal(SIGINT, old)``) must call ``old`` for a
SIGINT it takes, as chained handlers do. gpubudget cannot tell a SIGINT it sent that such a
handler took from one that is only late (the main thread blocks SIGINT, or runs a long call
in C), and a guess would, when wrong, raise a Ctrl-C nobody pressed or an exception twice.
If the handler does not call ``old``, a Ctrl-C it took is not delivered again at exit (a
SIGINT sent, neither answered nor pending, went to someone else), but an exception passed on
waits: the next SIGINT raises it (the user's next Ctrl-C would raise it in its place), else
the exit prints it.

The handler is installed when the first root budget is entered in the main thread, and only
over Python's default SIGINT handler: a program with a handler of its own (a server that
stops gracefully, ``asyncio.run`` while it runs) keeps it, and gpubudget then relies on
that handler not raising in the middle of a call. Outside gpubudget's code the installed
handler behaves exactly like Python's default. A program's other handlers run where Python
runs them: their exceptions are the ones :func:`hold` keeps.
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
from types import CodeType, FrameType, TracebackType
from typing import Final, TypeVar

__all__ = [
    "STATE",
    "callback",
    "defer",
    "due",
    "foreign",
    "hold",
    "install",
    "pass_on",
    "protect",
    "raise_here",
    "redeliver",
    "take",
    "undelivered",
    "undone",
]

F = TypeVar("F", bound=Callable[..., object])


class _State:
    __slots__ = ("pending", "interrupted", "installed", "sent", "answers", "exiting",
                 "interrupt_at_exit")

    def __init__(self) -> None:
        # something is due: a Ctrl-C, or an exception held for some thread (what the checks
        # on every operation's way out read; the C core reads it too)
        self.pending = False
        self.interrupted = False  # a Ctrl-C arrived inside protected code, not yet delivered
        self.installed = False
        self.sent = 0  # of what is passed on to the main thread, the first ones sent a SIGINT
        self.answers = 0  # runs of the handler for SIGINTs that gpubudget sent
        self.exiting = False  # the interpreter exits: what is passed on is delivered then
        self.interrupt_at_exit = False  # raised where Python dropped it: the exit ends by SIGINT


STATE: Final = _State()
_PROTECTED: Final[set[CodeType]] = set()
_CALLBACKS: Final[set[CodeType]] = set()
_POLL_SECONDS: Final = 0.001
_POLLS: Final = 10_000  # give up waiting after about 10 s: deliver anyway
_POLL_LONGEST: Final = 0.05  # a SIGINT's answer is waited for as long as it takes
_delivery: Final = threading.Lock()  # the helper thread's sending, or the exit's, not both
_held: Final[dict[int, BaseException]] = {}  # thread ident -> exception held for it
# passed on to the main thread, not yet raised, oldest first (None: a Ctrl-C); a SIGINT has
# been sent for each of the first STATE.sent of them, which the handler has not answered yet
_to_main: Final[list[BaseException | None]] = []
# passed on to other threads, each raised there by a helper thread that takes it
_to_threads: Final[list[tuple[BaseException, int]]] = []
_carried: Final[dict[int, BaseException]] = {}  # id -> an exception gpubudget passes on
_CARRIED_KEPT: Final = 64  # the most recent ones
_CO_VARARGS: Final = 0x04
_SIGNALS: Final = frozenset(signal.valid_signals())


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
    inside it leaves what is due to it rather than raise into C++ code."""
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
    # SIGINTs merge: one run answers every SIGINT sent since the last (read and reset with no
    # call between: no other thread runs meanwhile); one that nobody sent is the user's
    sent, STATE.sent = STATE.sent, 0
    if not sent or not _to_main:  # a Ctrl-C: what is passed on waits for its own SIGINT
        if _within(frame, _PROTECTED):
            STATE.interrupted = True
            STATE.pending = True
            return
        signal.default_int_handler(signum, frame)
    STATE.answers += 1  # one thing is delivered; the helper threads send the rest again
    if _within(frame, _PROTECTED):  # back in gpubudget's code: raised on its way out
        _note_first()
        return
    if _ended(frame):  # raised here, Python would print it and go on: delivered at exit
        if _waiting_for_threads(frame) and None in _to_main:
            # but waiting for the program's threads, a Ctrl-C stops the wait (Python prints
            # it there and goes on; the exit then ends by SIGINT)
            _to_main.remove(None)
            STATE.interrupt_at_exit = True
            signal.default_int_handler(signum, frame)
        return
    first = _to_main.pop(0)
    if first is None:
        signal.default_int_handler(signum, frame)
    raise first


def _note_first() -> None:
    """The handler's, in protected code: the first thing passed on to the main thread is
    noted (a Ctrl-C) or held for it (an exception, while none is: an operation raises one
    exception, and the next one is sent again once the main thread is out)."""
    first = _to_main[0]
    if first is None:
        del _to_main[0]
        defer()
    elif threading.get_ident() not in _held:
        del _to_main[0]
        defer(first)


_SHUTDOWN: Final = getattr(getattr(threading, "_shutdown", None), "__code__", None)
_HANDLING: Final = {_handler.__code__}


def _ended(frame: FrameType | None) -> bool:
    """Whether the main thread, at ``frame``, has left the program: the interpreter shuts
    down (it waits for the program's threads, or runs the exit handlers), where an exception
    raised is printed and dropped."""
    if STATE.exiting or not threading.main_thread().is_alive():
        return True  # the exit handlers run
    while frame is not None:
        if frame.f_code is _SHUTDOWN:  # threading's exit: it waits for the threads
            return True
        frame = frame.f_back
    return False


def _waiting_for_threads(frame: FrameType | None) -> bool:
    """Whether the main thread, at ``frame``, is in threading's exit: it waits for the
    program's threads, in ``threading._shutdown`` itself or in an exit hook that it runs
    (``concurrent.futures`` joins its workers there), before the exit handlers. A SIGINT
    there stops the wait. (A callback that runs in such a hook, in the main thread, passes
    on what it took for the exit: see :func:`_start_helpers`.)"""
    return not STATE.exiting and _SHUTDOWN is not None and _within(frame, {_SHUTDOWN})


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


# -- noting, holding, taking ---------------------------------------------------------------


def _refresh() -> None:
    """``pending`` again from what is due (cleared first, so that a Ctrl-C or an exception
    noted meanwhile, which sets it after its own mark, is never missed)."""
    STATE.pending = False
    if STATE.interrupted or _held:
        STATE.pending = True


def defer(exc: BaseException | None = None) -> None:
    """Note an exception caught where it could not be raised: a Ctrl-C (``None`` or a
    ``KeyboardInterrupt``), or ``exc``, held for this thread.

    One exception is held per thread, the first: the operation it cut short raises it on its
    way out, and another landing in the same operation (a second signal handler's, while
    the first is held) is dropped, as :func:`undone` drops one its undoing caught. Those
    passed on to the main thread are never dropped: one that arrives while another is held
    there waits to be sent again (see :func:`pass_on`)."""
    if exc is None or isinstance(exc, KeyboardInterrupt):
        STATE.interrupted = True
    else:
        _held.setdefault(threading.get_ident(), exc)
    STATE.pending = True


def hold(exc: BaseException) -> None:
    """For code that must not raise, which caught ``exc`` from outside: inside an operation
    (a protected function runs in this thread) keep it for delivery once the operation is
    whole (:func:`defer`); elsewhere raise it at once."""
    if not _within(sys._getframe(1), _PROTECTED):
        raise exc
    defer(exc)


def foreign(exc: BaseException) -> bool:
    """Whether ``exc`` was raised into gpubudget's code from outside rather than by what that
    code called: a Ctrl-C; an exception that is no ``Exception`` (``SystemExit``, one given
    to ``PyThreadState_SetAsyncExc``); one a signal handler or a trace function raised; one
    that gpubudget holds or passes on."""
    if not isinstance(exc, Exception) or id(exc) in _carried:
        return True
    return any(exc is held for held in _held.values()) or _interrupting(exc, signals=False)


def _interrupting(exc: BaseException, signals: bool = True) -> bool:
    """Whether a function that interrupted Python code raised ``exc``: a signal handler
    (Python calls it as ``handler(signum, frame)`` with the frame it interrupted, which is
    the frame before it in the traceback; or it is a handler installed now), or, unless
    ``signals``, a trace function (``tracer(frame, event, arg)``, likewise)."""
    handlers = {getattr(getattr(h, "__func__", h), "__code__", None)
                for h in map(signal.getsignal, _SIGNALS) if callable(h)}
    numbers = _SIGNALS
    below: TracebackType | None = exc.__traceback__
    while below is not None and below.tb_next is not None:
        frame = below.tb_next.tb_frame
        code = frame.f_code
        if code in handlers:
            return True
        count = code.co_argcount + bool(code.co_flags & _CO_VARARGS)
        given = [frame.f_locals.get(name) for name in code.co_varnames[:count]]
        given += [item for value in given if isinstance(value, tuple) for item in value]
        if any(value is below.tb_frame for value in given) and (not signals or any(
                type(value) is int and value in numbers for value in given)):
            return True
        below = below.tb_next
    return False


def take() -> bool:
    """Whether a Ctrl-C is pending, clearing it: in the main thread only (``False`` in any
    other, which leaves it to the main thread: see :func:`due`)."""
    if threading.get_ident() != threading.main_thread().ident:
        return False
    interrupted, STATE.interrupted = STATE.interrupted, False
    _refresh()
    return interrupted


def raise_here() -> bool:
    """For a public method on its way out: ``True`` (and the interrupt taken) when it should
    raise ``KeyboardInterrupt`` now, ``False`` when no Ctrl-C is pending, or it runs inside
    an allocator callback, which delivers it instead, or in a thread other than the main
    thread, which passes it on to the main thread (:func:`redeliver`). (:func:`due` answers
    for every exception held, not only a Ctrl-C.)"""
    if _within(sys._getframe(1), _CALLBACKS):
        return False
    if threading.get_ident() != threading.main_thread().ident:
        if STATE.interrupted:
            redeliver()
        return False
    return take()


def due() -> BaseException | None:
    """For a public method on its way out: the exception to raise now, taken (an exception
    held for this thread first, else, in the main thread, a pending Ctrl-C as
    ``KeyboardInterrupt``); ``None`` when nothing is due, or inside an allocator callback,
    which passes it on instead.

    A Ctrl-C is the main thread's: another thread's method never raises it (it may have
    landed in an operation of the main thread, which raises it itself), and passes on one
    that waits to the main thread (:func:`redeliver`; a ``KeyboardInterrupt`` given to this
    thread by ``PyThreadState_SetAsyncExc`` is taken for a Ctrl-C, as everywhere here)."""
    if _within(sys._getframe(1), _CALLBACKS):
        return None
    here = threading.get_ident()
    exc = _held.pop(here, None)
    if exc is None:
        if here != threading.main_thread().ident:
            if STATE.interrupted:
                redeliver()
        elif take():
            return KeyboardInterrupt()
    _refresh()
    if exc is not None:
        _carried.pop(id(exc), None)
    return exc


def undone() -> None:
    """After undoing an operation whose exception is about to be raised (:func:`due`): an
    exception that the undoing held for this thread belongs to the same operation, and the
    program gets the first one: the later one is dropped."""
    if _held.pop(threading.get_ident(), None) is not None:
        _refresh()


# -- passing on, from a callback -------------------------------------------------------------


def pass_on() -> None:
    """For a callback on its way out: what was deferred or held while it ran goes on to be
    raised once control is back in Python (a Ctrl-C in the main thread, see
    :func:`redeliver`; an exception held for this thread where :func:`_pass_exception`
    says).

    Never raises, and loses nothing: an exception raised into it while it works (a signal
    handler's, one given to ``PyThreadState_SetAsyncExc``, a trace function's) is deferred
    in turn and passed on with the rest; each thing is queued for delivery before it stops
    being held, so one raised in between is passed on again rather than lost (at worst
    delivered twice, where one lands between the two steps). After ``_RETRIES`` such
    exceptions in one call, what is left stays due: this thread's next operation or
    callback delivers it."""
    for _ in range(_RETRIES):
        try:
            if STATE.pending:
                _pass_on()
            return
        except BaseException as late:  # noqa: BLE001 - nothing may leave a callback
            defer(late)


_RETRIES: Final = 8


def _pass_on() -> None:
    here = threading.get_ident()
    exc = _held.get(here)
    if exc is not None:
        _pass_exception(exc, here)  # queued first, ...
        if _held.get(here) is exc:
            del _held[here]  # ... then no longer held
        _refresh()
        _start_helpers()  # (one thing, one helper: what is passed on goes at once)
    if STATE.interrupted:
        redeliver()
    elif exc is None:  # (called again, after an exception landed: perhaps none started)
        _start_helpers()


def redeliver() -> None:
    """Pass a Ctrl-C noted for the main thread on to it: raise it there once the main
    thread is out of gpubudget's code.

    A helper thread waits until the main thread's Python stack holds no protected function
    (the callback that took the interrupt has returned to its C++ caller, or that caller has
    returned to Python), then sends SIGINT to the main thread, as a Ctrl-C would: the
    handler raises ``KeyboardInterrupt`` there, or defers it again if the main thread is
    back in a callback by then, which then passes it on again. Called in the main thread
    when it has left the program (an exit handler), it is delivered at exit.
    """
    with _delivery:
        _to_main.append(None)  # queued first (delivered at exit if no helper thread can) ...
        STATE.interrupted = False  # ... then no longer noted
    _refresh()
    _start_helpers()


def undelivered() -> bool:
    """Whether a Ctrl-C or an exception passed on to the main thread is yet to be raised
    there (or, the program having ended, at exit)."""
    sent = 0 if signal.getsignal(signal.SIGINT) is _handler else STATE.sent
    return (STATE.interrupt_at_exit or len(_to_main) > sent
            or any(item is not None for item in _to_main[:sent]))


def _start_helpers() -> None:
    """Start the helper threads that deliver what waits: to the main thread, unless this is
    the main thread and it has left the program (what it passes on then is delivered at
    exit); to other threads, one helper for each (a helper finding nothing left is done)."""
    if _to_main and not (threading.current_thread() is threading.main_thread()
                         and _ended(sys._getframe())):
        _helper(_send_to_main)
    for _ in _to_threads:
        _helper(_deliver_to_thread)


def _helper(target: Callable[[], None]) -> None:
    try:
        threading.Thread(target=target, name="gpubudget-interrupt", daemon=True).start()
    except RuntimeError:  # interpreter shutting down: the exit handler delivers it
        pass


def _pass_exception(exc: BaseException, here: int) -> None:
    """Queue ``exc`` (once: again for the same exception does nothing) to be raised once out
    of gpubudget's code: in this thread if Python code called into the callback here and no
    signal handler raised it, else in the main thread; there through the SIGINT handler when
    it is installed (which wakes a sleeping main thread), else as
    ``PyThreadState_SetAsyncExc`` does (at the thread's next Python instruction)."""
    _carried[id(exc)] = exc
    for old in list(_carried)[:-_CARRIED_KEPT]:
        del _carried[old]
    if here != threading.main_thread().ident and _python_below() and not _interrupting(exc):
        with _delivery:
            if not any(item is exc for item, _ in _to_threads):
                _to_threads.append((exc, here))
        return
    with _delivery:
        if not any(item is exc for item in _to_main):
            _to_main.append(exc)  # delivered at exit if the helper thread cannot


def _python_below() -> bool:
    """Whether this thread's stack holds Python code below gpubudget's protected functions:
    a callback called by C++ code that Python called (else by a thread of a framework's
    own, which runs no Python code of the program)."""
    frame: FrameType | None = sys._getframe()
    inside = False
    while frame is not None:
        if frame.f_code in _PROTECTED:
            inside = True
        elif inside:
            return True
        frame = frame.f_back
    return False


def _deliver_to_thread() -> None:
    """A helper thread's: raise the oldest exception queued for a thread other than the main
    thread in that thread, once it is out of gpubudget's code."""
    with _delivery:
        if not _to_threads:
            return
        exc, target = _to_threads.pop(0)
    if not _wait_until_out(target):
        if not STATE.exiting:  # a thread that ended first: said, as Python would
            _print(exc, f"in thread {target}, which ended before it could be raised there")
        return
    _set_async(target, exc)


def _send_to_main() -> None:
    """A helper thread's: once the main thread is out of gpubudget's code, send it a SIGINT
    for the next thing passed on to it; when the handler has answered it, again while
    something waits (SIGINTs merge: one run of the handler raises one thing, and leaves
    the rest to be sent again)."""
    main = threading.main_thread().ident
    while main is not None and _wait_until_out(main):
        with _delivery:
            if STATE.exiting:
                return
            if signal.getsignal(signal.SIGINT) is not _handler:
                _answered_elsewhere()
            if STATE.sent == len(_to_main):
                return  # nothing waits: what is sent has a helper waiting for its answer
            frame = sys._current_frames().get(main)
            if _waiting_for_threads(frame) and None not in _to_main:
                return  # waiting for the program's threads: an exception is raised at exit
            answers = STATE.answers
            if not _send(main):
                continue
        if not _answered(answers):
            return


def _send(main: int) -> bool:
    """Under ``_delivery``: send the next thing passed on to the main thread; ``True`` if it
    went as a SIGINT to gpubudget's handler, which will answer it."""
    kill = getattr(signal, "pthread_kill", None)
    if STATE.installed and signal.getsignal(signal.SIGINT) is _handler:
        # the count and the signal with no call between: the interpreter switches threads
        # at calls, so the handler never counts a SIGINT that is yet to come
        STATE.sent += 1
        if kill is not None:
            kill(main, signal.SIGINT)  # wakes a sleeping main thread, as Ctrl-C does
        else:  # pragma: no cover - Windows
            _thread.interrupt_main()
        return True
    item = _to_main.pop(STATE.sent)
    if item is not None:
        _set_async(main, item)
    elif kill is not None:
        kill(main, signal.SIGINT)  # the program's own handler: a Ctrl-C, as from a terminal
    else:  # pragma: no cover - Windows
        _thread.interrupt_main()
    return False


def _answered(answers: int) -> bool:
    """Wait until the handler has answered a SIGINT sent (its runs no longer ``answers``);
    ``False`` if the interpreter exits first. Also ``True`` when the program has replaced
    the handler: its own then takes the SIGINT."""
    delay = _POLL_SECONDS
    while STATE.answers == answers and signal.getsignal(signal.SIGINT) is _handler:
        if STATE.exiting:
            return False
        time.sleep(delay)
        delay = min(2 * delay, _POLL_LONGEST)
    return True


def _answered_elsewhere() -> None:
    """Under ``_delivery``, when gpubudget's handler is no longer installed: the SIGINTs it
    was sent went to the program's own handler. A Ctrl-C among what they were sent for
    reached the program: done; an exception did not: it waits to be sent again."""
    sent, STATE.sent = STATE.sent, 0
    _to_main[:sent] = [item for item in _to_main[:sent] if item is not None]


def _print(exc: BaseException, where: str) -> None:
    """Say ``exc`` on stderr as Python says an exception nobody caught."""
    try:
        sys.stderr.write(f"gpubudget: an exception that landed in its code was to be raised "
                         f"{where}:\n")
        import traceback  # only here: not paid by `import gpubudget`

        traceback.print_exception(exc, file=sys.stderr)
        sys.stderr.flush()
    except (AttributeError, ImportError, OSError, ValueError):  # no stderr, or at teardown
        pass


def _set_async(target: int, exc: BaseException) -> None:
    """Have thread ``target`` raise ``exc`` itself at its next Python instruction."""
    import ctypes  # only here: rarely needed

    # The interpreter makes the exception by calling the class it is given: this one
    # answers the exception itself, which is then raised as it is (its type, its message).
    carrier = type(type(exc).__name__, (BaseException,), {"__new__": lambda cls, *a: exc})
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async.argtypes = [ctypes.c_ulong, ctypes.py_object]
    set_async(target, carrier)


def _wait_until_out(target: int) -> bool:
    """Wait until thread ``target``'s Python stack holds no protected function, nor
    gpubudget's SIGINT handler (a SIGINT sent while it runs would run it again inside
    itself); ``False`` if it ended, or the interpreter exits, first. The main thread has
    ended when it runs the exit handlers, not while it waits for the program's threads
    (:func:`_waiting_for_threads`: a SIGINT stops that wait), nor on its way there, when it
    runs no Python code."""
    main = threading.main_thread().ident
    for _ in range(_POLLS):
        frame = sys._current_frames().get(target)
        if STATE.exiting or (frame is None and target != main) or (
                frame is not None and target == main and not _waiting_for_threads(frame)
                and _ended(frame)):
            return False
        if frame is not None and not _within(frame, _PROTECTED) and not _within(
                frame, _HANDLING):
            return True
        time.sleep(_POLL_SECONDS)
    return True


def _deliver_at_exit() -> None:
    """Interpreter exit: an interrupt passed on to the main thread and not yet raised (the
    program ended first) ends the process by SIGINT, as an uncaught ``KeyboardInterrupt``
    does; another exception passed on to it, or still held for it, is printed as Python
    prints an uncaught one, and the process ends with status 1. A SIGINT sent that the
    program's own handler took has reached the program: a Ctrl-C it was sent for is no
    longer due. That handler may be installed now, or have been for a while and put
    gpubudget's back (``old = signal.signal(SIGINT, mine)``, then ``signal.signal(SIGINT,
    old)``): a SIGINT sent that gpubudget's handler has not answered and that is not
    pending (blocked) in this thread went to someone else. Registered when this module is imported, before
    gpubudget's other exit handlers, so it runs after them (``atexit`` runs the last
    registered first)."""
    waiting = _sigint_pending()  # (a call: a SIGINT already arrived is answered first)
    with _delivery:
        STATE.exiting = True
        if signal.getsignal(signal.SIGINT) is not _handler or (STATE.sent and not waiting):
            _answered_elsewhere()
        # passed on, raised where Python dropped it, or noted in an exit handler
        shown = None in _to_main or STATE.interrupted
        interrupted = shown or STATE.interrupt_at_exit
        left = [*filter(None, _to_main), *filter(None, [_held.get(threading.get_ident())])]
    if (not interrupted and not left) or os.getpid() != _PID:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    try:
        for exc in left:
            _print(exc, "in the main thread, which ended before it could be raised there")
        if shown:  # (raised where Python dropped it, Python has printed it)
            sys.stderr.write("KeyboardInterrupt\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass
    if not interrupted:
        os._exit(1)
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except (ValueError, OSError):  # pragma: no cover - not the main thread, or no signals
        pass
    os._exit(130)  # pragma: no cover - SIGINT blocked: the same status a shell would show


def _sigint_pending() -> bool:
    """Whether a SIGINT waits, blocked, for this thread (or the process)."""
    try:
        return signal.SIGINT in signal.sigpending()
    except (AttributeError, OSError):  # pragma: no cover - Windows: no signal masks
        return False


def _forked() -> None:
    """In a forked child: the parent's interrupts are the parent's."""
    global _PID
    _PID = os.getpid()
    STATE.sent = STATE.answers = 0
    STATE.exiting = STATE.interrupt_at_exit = False
    STATE.interrupted = False
    STATE.pending = False
    _held.clear()
    _to_main.clear()
    _to_threads.clear()
    _carried.clear()
    getattr(_delivery, "_at_fork_reinit")()


_PID = os.getpid()
atexit.register(_deliver_at_exit)
os.register_at_fork(after_in_child=_forked)
