"""A record's bytes (a snapshot, a report), read within a limit: a regular file or standard
input, never waiting on a FIFO, never asking for more memory than the file holds; and a
value read from one described in a few characters (never its whole ``repr``, which a
shared-reference bomb or a 200,000-deep list makes endless or impossible)."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable

from ..errors import TraceError
from ..text import printable
from ..units import format_size

__all__ = ["read_bounded", "shown"]

_CHUNK = 1 << 20


def _chunks(read: Callable[[int], bytes], max_bytes: int) -> bytes:
    """Up to ``max_bytes + 1`` bytes, a megabyte at a time: memory grows with what the file
    really holds, not with the limit."""
    parts: list[bytes] = []
    total = 0
    while total <= max_bytes:
        part = read(min(_CHUNK, max_bytes + 1 - total))
        if not part:
            break
        parts.append(part)
        total += len(part)
    return b"".join(parts)


def shown(value: object) -> str:
    """``value`` for a message, in at most about 60 characters: a number's or a short
    string's text, else what it is (``a list``, ``a dictionary of 3``), never its contents.

    >>> shown(12), shown("x" * 100)[:12], shown([[1]] * 3), shown(10**5000)
    ('12', "'xxxxxxxxxxx", 'a list of 3', 'a number of 16610 bits')
    """
    if value is None or isinstance(value, (bool, float)):
        return repr(value)[:40]
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 128 else f"a number of {value.bit_length()} bits"
    if isinstance(value, str):
        return repr(printable(value[:40])) + ("..." if len(value) > 40 else "")
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        kind = ("a dictionary" if isinstance(value, dict) else "a list"
                if isinstance(value, list) else "a tuple" if isinstance(value, tuple) else "a set")
        return f"{kind} of {len(value)}"
    return f"a {type(value).__name__}"


def read_bounded(path: str, max_bytes: int, what: str,
                 error: type[TraceError] = TraceError) -> bytes:
    """The bytes of the file at ``path`` (``-``: standard input), ``error`` in one line naming
    it when it cannot be read, is not a regular file, or holds more than ``max_bytes``."""
    name = printable(path)
    try:
        if path == "-":
            data = _chunks(sys.stdin.buffer.read, max_bytes)
        else:  # opened without waiting (a FIFO), then refused unless a regular file
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise error(f"{name}: not a regular file")
                if info.st_size > max_bytes:
                    raise error(f"{name}: longer than {format_size(max_bytes)} (--max-size)")
                data = _chunks(lambda size: os.read(fd, size), max_bytes)
            finally:
                os.close(fd)
    except OSError as exc:
        raise error(f"cannot read {what} {name}: "
                    f"{printable(exc.strerror or str(exc))}") from None
    if len(data) > max_bytes:
        raise error(f"{name}: longer than {format_size(max_bytes)} (--max-size)")
    return data
