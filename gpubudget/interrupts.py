"""What a callback does with an exception it cannot raise: the one place where gpubudget
stands between Python and a framework's C or C++ code.

An allocator callback (TensorRT's, PyTorch's, CuPy's, anything calling gpubudget from C)
must never let an exception cross into its caller: it catches everything, records it on
its budget's report, answers as a denial and hands the exception here (:func:`pass_on`):

- a ``KeyboardInterrupt`` (a Ctrl-C, or a handler of another signal raising it, such as
  ``signal.default_int_handler`` installed for ``SIGTERM``) is armed again, with
  ``_thread.interrupt_main()``, Python's own way to simulate the signal: the main thread
  raises it once it runs Python code again, once. A callback running in the main thread
  cannot arm it itself (the handler would run at its next instruction, inside the
  callback): its answer carries it instead, an ``int`` that arms the interrupt as the
  framework lets go of it, after the last instruction of the callback;
- any other exception goes to :data:`sys.unraisablehook`, as CPython sends an exception
  that a ``ctypes`` callback or a destructor cannot raise, naming the callback and its
  budget.

Nothing else: gpubudget installs no signal handler, starts no thread, sends no signal and
does nothing at exit for interrupts. Everywhere else (``with gpu_budget(...)``,
``allocate``, ``free``, the reports, the trace writer) an exception propagates as in any
Python code, and every operation stays whole (see the tree in
:mod:`gpubudget._core.tree`).

What is not promised: a signal whose handler raises while the framework's C++ runs is
raised at the first instruction of the next Python function that runs; when that is a
callback, before any of its code, and the framework's binding then sees it (NVIDIA's prints
``Exception caught in allocate()`` and denies). An exception raised into a thread at an
arbitrary instruction (``PyThreadState_SetAsyncExc``) may leave a lock held, as it may
with CPython's own ``with lock:``.
"""

from __future__ import annotations

import _thread
import functools
import signal
import sys
import threading
import traceback
from typing import Final, NamedTuple

__all__ = ["pass_on", "unraisable"]


class _Unraisable(NamedTuple):
    """What :data:`sys.unraisablehook` is given (the fields of ``sys.UnraisableHookArgs``,
    a type Python does not let code make)."""

    exc_type: type[BaseException]
    exc_value: BaseException
    exc_traceback: object
    err_msg: str
    object: object


def unraisable(exc: BaseException, message: str, obj: object = None) -> None:
    """Send ``exc``, which cannot propagate, where Python sends such exceptions: the
    program's :data:`sys.unraisablehook`, or, with Python's own hook, standard error in
    its format (``message``, then the traceback)."""
    hook = sys.unraisablehook
    if hook is not sys.__unraisablehook__:
        hook(_Unraisable(type(exc), exc, exc.__traceback__, message, obj))  # type: ignore[arg-type]
        return
    stderr = sys.stderr
    if stderr is None:
        return
    head = message if obj is None else f"{message}: {obj!r}"
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    stderr.write(head + "\n" + "".join(lines))
    stderr.flush()


def pass_on(exc: BaseException, where: str, answer: int) -> int:
    """In a callback that caught ``exc`` and answers ``answer`` (a denial): arm a
    ``KeyboardInterrupt`` again for the main thread, or send anything else to
    :func:`unraisable` naming ``where``; what the callback returns (``answer``, or in the
    main thread an equal ``int`` that arms the interrupt once the caller drops it)."""
    if isinstance(exc, KeyboardInterrupt):
        signum = _interrupting_signal()
        if signum is not None:
            if threading.get_ident() == threading.main_thread().ident:
                return _carrier(signum)(answer)
            _thread.interrupt_main(signum)
            return answer
        where = f"{where} (no signal handler left to raise it)"
    unraisable(exc, f"Exception ignored in gpubudget's {where}")
    return answer


def _interrupting_signal() -> signal.Signals | None:
    """The signal whose Python handler raises the Ctrl-C again: SIGINT when Python handles
    it, else one whose handler is ``signal.default_int_handler`` (``SIGTERM`` made to stop
    like a Ctrl-C, with SIGINT ignored in a background job); ``None`` if none."""
    if callable(signal.getsignal(signal.SIGINT)):
        return signal.SIGINT
    for signum in sorted(signal.valid_signals()):
        try:
            if signal.getsignal(signum) is signal.default_int_handler:
                return signal.Signals(signum)
        except ValueError:  # pragma: no cover - a number the platform cannot ask about
            continue
    return None


@functools.cache
def _carrier(signum: signal.Signals) -> type[int]:
    """An ``int`` type whose instances arm ``signum`` as they are destroyed: by C code
    (``functools.partial`` over ``_thread.interrupt_main``), so that no Python instruction
    of the callback can run the handler before the framework has its answer."""
    arm: Final = functools.partial(_thread.interrupt_main, signum)
    return type("InterruptingAnswer", (int,), {
        "__slots__": (), "__del__": staticmethod(arm),
        "__doc__": "A callback's answer that arms an interrupt once its caller drops it."})
