"""What the command line prints besides results: the exit statuses, one-line errors and
warnings, and a progress line on a terminal."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Final, TextIO

from ..text import printable

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_BROKEN_PIPE",
    "EXIT_INTERRUPTED",
    "PROGRESS_DELAY",
    "PROGRESS_LOG_DELAY",
    "PROGRESS_LOG_INTERVAL",
    "PROGRESS_LOG_PREFIX",
    "Failure",
    "Progress",
    "say",
    "show_warning",
]

EXIT_BAD_INPUT: Final = 2
EXIT_INTERRUPTED: Final = 130
EXIT_BROKEN_PIPE: Final = 141


class Failure(Exception):
    """Ends a command with one line on stderr and exit status 2."""


def say(message: str) -> None:
    """One line on stderr, prefixed with the program's name."""
    print(f"gpubudget: {printable(message)}", file=sys.stderr)


def show_warning(message: Warning | str, category: type[Warning], filename: str,
                  lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
    text = str(message)  # the library's warnings name gpubudget already: say it once
    say(f"warning: {text.removeprefix('gpubudget: ')}")


# -- progress ------------------------------------------------------------------------------


PROGRESS_DELAY: Final = 1.0
"""Seconds a command runs before its progress line shows."""
PROGRESS_LOG_DELAY: Final = 10.0
"""Seconds a command runs before its first progress line where stderr is no terminal (a CI
log), with ``Progress(..., log=True)``."""
PROGRESS_LOG_INTERVAL: Final = 30.0
"""Seconds between two progress lines where stderr is no terminal: a log stays short."""
PROGRESS_LOG_PREFIX: Final = "gpubudget: progress: "
"""How a progress line in a log begins (a tool reading the log can leave them out)."""


class Progress:
    """A progress line on a terminal, rewritten in place; with ``log=True``, elsewhere (a CI
    log) a line now and then.

    Calls are cheap and may come often: a message is shown only when ``stream`` is a
    terminal, once ``delay`` seconds (default :data:`PROGRESS_DELAY`) have passed since the
    start, and at most every ``interval`` seconds. :meth:`clear` erases it before other
    output. With ``log=True`` and a stream that is no terminal, a message is a line of its
    own (:data:`PROGRESS_LOG_PREFIX` first) after :data:`PROGRESS_LOG_DELAY` seconds, then
    at most every :data:`PROGRESS_LOG_INTERVAL`: a long run is not silent, and its log stays
    short.
    """

    def __init__(self, stream: TextIO, *, delay: float | None = None, interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic, log: bool = False) -> None:
        self.stream = stream
        terminal = _is_terminal(stream)
        self.lines = log and not terminal
        """Each message a line of its own, at a low rate."""
        self.enabled = terminal or self.lines
        self.interval = PROGRESS_LOG_INTERVAL if self.lines else interval
        self.clock = clock
        wait = PROGRESS_LOG_DELAY if self.lines else PROGRESS_DELAY if delay is None else delay
        self.next_at = clock() + wait
        self.width = 0  # characters on the line now

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now < self.next_at:
            return
        self.next_at = now + self.interval
        text = printable(message)[:79]
        if self.lines:
            self.stream.write(f"{PROGRESS_LOG_PREFIX}{text}\n")
            self.stream.flush()
            return
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def clear(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
