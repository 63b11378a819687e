"""The fast path of reading a trace: msgspec (the ``traces`` extra) decodes a granted
``alloc`` or a ``free`` line straight into a typed struct, checking in C the types and the
ranges of its fields, and :func:`fast_lines` finishes the checks that span lines.

It accepts only lines that the plain path (:mod:`json` and :mod:`.checks`) accepts, and
yields the very same events: a line it does not take (any other event, a denial, a wrong
type or range, a key it does not know (msgspec would skip the value without the checks
:mod:`json` makes: its UTF-8, an integer of 4,300 digits), a line msgspec will not parse,
a problem of any kind) goes to the plain path,
which accepts it or names what is wrong in the words it always used. So results and error
messages do not depend on whether msgspec is installed; only the speed does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Final, Optional, Union

from .checks import Validator
from .events import Alloc, Free, TraceEvent
from .format import MAX_FRAMES

__all__ = ["AVAILABLE", "fast_lines"]

try:
    import msgspec
except ImportError:  # the plain path alone: same results, slower
    msgspec = None  # type: ignore[assignment]

AVAILABLE: Final = msgspec is not None
"""Whether msgspec is installed (``pip install 'gpubudget[traces]'``)."""

_INT_RANGE: Final = 1 << 63
_INFINITY: Final = math.inf
_make: Final = tuple.__new__  # what the NamedTuple constructors call, without their frame

FastLine = Callable[[bytes], Union[TraceEvent, None]]
"""Checks one line: its event, or ``None`` for the plain path to read it."""


def fast_lines(validator: Validator) -> FastLine | None:
    """A function that reads a line the fast way, sharing ``validator``'s state with the
    plain path; ``None`` without msgspec."""
    if msgspec is None:
        return None
    decode = _DECODER.decode
    failed = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
    budgets, live = validator.budgets, validator.live
    frames = validator.frames

    def line(raw: bytes) -> TraceEvent | None:
        try:
            found: Any = decode(raw)
        except failed:
            return None
        t = found.t
        if type(t) is int:
            if t >= _INT_RANGE:
                return None
            t = float(t)
        elif not 0.0 <= t < _INFINITY:  # msgspec refuses NaN; -0.0 passes, as in the checks
            return None
        if type(found) is _Free:
            ptr, budget = found.ptr, found.b
            if live.get(ptr) != budget:
                return None
            del live[ptr]
            return _make(Free, (t, budget, ptr))
        budget, ptr, size, align = found.b, found.ptr, found.size, found.align
        if (budget not in budgets or ptr in live or found.bytes < size
                or align & (align - 1)):
            return None
        stack = found.stack
        if stack is not None:
            try:
                stack = tuple([frames[frame] for frame in stack])
            except KeyError:
                return None
        live[ptr] = budget
        return _make(Alloc, (t, budget, size, align, found.tag, ptr, found.bytes, None, stack))

    return line


if msgspec is not None:
    from msgspec import Meta, Struct

    _Time = Union[Annotated[int, Meta(ge=0)], Annotated[float, Meta(ge=0.0)]]
    _Count = Annotated[int, Meta(ge=0, le=_INT_RANGE - 1)]
    _Size = Annotated[int, Meta(ge=1, le=_INT_RANGE - 1)]

    class _Alloc(Struct, tag_field="ev", tag="alloc", forbid_unknown_fields=True):
        """A granted allocation; a denial (``ptr`` null) fails here and goes the plain way."""

        t: _Time
        b: _Count
        size: _Size
        align: _Count
        ptr: _Count
        bytes: _Size
        tag: Optional[str] = None  # noqa: UP007 - msgspec reads the annotation at run time
        reason: None = None
        stack: Optional[Annotated[tuple[_Count, ...], Meta(max_length=MAX_FRAMES)]] = None  # noqa: UP007

    class _Free(Struct, tag_field="ev", tag="free", forbid_unknown_fields=True):
        t: _Time
        b: _Count
        ptr: _Count

    _DECODER: Final = msgspec.json.Decoder(Union[_Alloc, _Free])
