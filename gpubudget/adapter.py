"""What adapters (``tensorrt/``, ``cupy.py``, ``torch.py``, ``routing.py``, ``ray/``) and tools
(``replay/``, ``cli/``, ``metrics.py``) use of gpubudget besides its public API (``Budget``
and the names of ``gpubudget``, ``gpubudget.backends``, ``gpubudget.tracefile``,
``gpubudget.hostledger``): one small interface, so that the core (``gpubudget._core``) and the
plumbing around it stay free to change. ``tests/test_layers.py`` checks that adapters and
tools import nothing else.

Callbacks, which a framework calls from C or C++ and which must never raise, catch
everything; :func:`callback_failed` then records what went wrong on the budget's report and
gives the callback its answer (a ``KeyboardInterrupt`` armed again for the main thread,
anything else sent to ``sys.unraisablehook``: see :mod:`gpubudget.interrupts`).

Devices, threads, contexts:

- :func:`current_device`: the CUDA device current in the calling thread (else 0);
- :func:`by_device`: a framework's allocator function that serves one device from a budget
  and passes the others on (in C where the C core runs: CuPy calls it for every array);
- :func:`separate_roots`: in the current context, root budgets are separate on purpose (a
  replay's), so entering one in a thread while another is open is not warned about;
- :func:`holder`: the budget of this process holding the live block at an address;
- :func:`hand_clock`: a clock set by hand (a replay's, on the recorded times), which the C
  core reads without calling Python.

Usage probes (what an adapter holds of a budget, for its report) are methods of ``Budget``
itself: ``report_usage``, ``pin``/``unpin``, ``record_denial``, ``record_error``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from . import interrupts
from ._budget import holder
from ._core import native
from .backends import current_device
from .context import SEPARATE_ROOTS

if TYPE_CHECKING:
    from .budget import Budget

__all__ = ["HandClock", "by_device", "callback_failed", "current_device", "hand_clock",
           "holder", "separate_roots"]

R = TypeVar("R")


def callback_failed(budget: Budget, where: str, exc: BaseException, answer: int = 0) -> int:
    """Inside a callback that caught ``exc``: what it returns (``answer``, its denial).

    A ``KeyboardInterrupt`` counts as a denial with reason ``interrupted`` and is armed again
    for the main thread; anything else is kept for ``budget``'s report as an error naming
    ``where`` and sent to ``sys.unraisablehook`` (see :func:`gpubudget.interrupts.pass_on`).
    In the main thread the answer carries the interrupt: return it as it is, as the
    callback's last step. Never raises."""
    try:
        if isinstance(exc, KeyboardInterrupt):
            budget.record_denial(0, "interrupted")
        else:
            budget.record_error(f"{where}: {type(exc).__name__}: {exc}")
    except BaseException as late:  # noqa: BLE001 - nothing may leave a callback
        interrupts.unraisable(late, f"Exception ignored in gpubudget's {where} (recording "
                                    f"{type(exc).__name__})")
    try:
        return interrupts.pass_on(exc, f"{where} callback of budget {budget.name!r}", answer)
    except BaseException as late:  # noqa: BLE001 - another signal meanwhile: passed on too
        return interrupts.pass_on(late, where, answer)


def separate_roots() -> None:
    """In the current context, root budgets are separate on purpose (a replay's): entering
    one in a thread while another root is open gives no warning."""
    SEPARATE_ROOTS.set(True)


class _ByDevice:
    """The Python :func:`by_device` (where the C core is not built)."""

    __slots__ = ("current", "device", "here", "elsewhere")

    def __init__(self, current: Callable[[], object], device: object,
                 here: Callable[..., Any], elsewhere: Callable[..., Any]) -> None:
        self.current, self.device, self.here, self.elsewhere = current, device, here, elsewhere

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.current() == self.device:
            return self.here(*args, **kwargs)
        return self.elsewhere(*args, **kwargs)


def by_device(current: Callable[[], object], device: object, here: Callable[..., R],
              elsewhere: Callable[..., R]) -> Callable[..., R]:
    """A callable that calls ``here`` with its arguments while ``current()`` returns
    ``device``, else ``elsewhere``.

    Examples
    --------
    >>> device = [0]
    >>> route = by_device(lambda: device[0], 0, lambda n: ("budget", n), lambda n: ("old", n))
    >>> route(256), device.__setitem__(0, 1), route(512)
    (('budget', 256), None, ('old', 512))
    """
    kind: Any = native.Router if native is not None else _ByDevice
    route: Callable[..., R] = kind(current, device, here, elsewhere)
    return route


class HandClock:
    """A clock set by hand: ``clock.now = t``; ``clock()`` answers ``t`` (seconds)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hand_clock() -> HandClock:
    """A :class:`HandClock` (the C core's ``Clock`` where it runs: its fast path reads it
    without calling Python, and a backend's ``clock`` of any other kind sends every call
    through the Python methods).

    >>> clock = hand_clock()
    >>> clock.now = 1.5
    >>> clock()
    1.5
    """
    made: HandClock = native.Clock() if native is not None else HandClock()
    return made
