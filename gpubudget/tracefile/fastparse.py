"""The msgspec path of reading a trace: msgspec (the ``traces`` extra) decodes a granted
``alloc`` or a ``free`` line straight into a typed struct, checking in C the types and the
ranges of its fields, and :func:`fast_lines` finishes the checks that span lines.

It accepts only lines that the plain path (:mod:`json` and :mod:`.checks`) accepts, and
yields the very same events: a line it does not take (any other event, a denial, a wrong
type or range, a key it does not know (msgspec would skip the value without the checks
:mod:`json` makes: its UTF-8, an integer of 4,300 digits), a line msgspec will not parse,
a problem of any kind) goes to the plain path, which accepts it or names what is wrong in the
words it always used. So results and error messages do not depend on whether msgspec is
installed; only the speed does. (The C scanner, :mod:`.cscan`, is the other fast path.)
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from typing import Annotated, Any, Final, Optional, Union

from .checks import Validator
from .events import Alloc, Free, TraceEvent
from .format import MAX_FRAMES

__all__ = ["AVAILABLE", "fast_lines"]

AVAILABLE: Final = importlib.util.find_spec("msgspec") is not None
"""Whether msgspec is installed (``pip install 'gpubudget[traces]'``). It is imported when a
reader first uses it, not with gpubudget."""

_INT_RANGE: Final = 1 << 63
_INFINITY: Final = math.inf
_make: Final = tuple.__new__  # what the NamedTuple constructors call, without their frame

FastLine = Callable[[bytes], Union[TraceEvent, None]]
"""Checks one line: its event, or ``None`` for the plain path to read it."""


def fast_lines(validator: Validator) -> FastLine | None:
    """A function that reads a line the fast way, sharing ``validator``'s state with the
    plain path; ``None`` without msgspec."""
    found_types = _msgspec_types()
    if found_types is None:
        return None
    decode, free_type, failed = found_types
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
        if type(found) is free_type:
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


@functools.lru_cache(maxsize=None)
def _msgspec_types() -> tuple[Callable[[bytes], Any], type[Any],
                           tuple[type[BaseException], ...]] | None:
    """msgspec's decoder of the two lines it takes (a granted allocation, a free), the type
    of a free, and the errors it raises; ``None`` without msgspec. Made at the first use."""
    try:
        import msgspec
    except ImportError:  # the plain path alone: same results, slower
        return None
    from msgspec import Meta

    time = Union[Annotated[int, Meta(ge=0)], Annotated[float, Meta(ge=0.0)]]
    count = Annotated[int, Meta(ge=0, le=_INT_RANGE - 1)]
    size = Annotated[int, Meta(ge=1, le=_INT_RANGE - 1)]
    frames = Optional[Annotated[tuple[count, ...], Meta(max_length=MAX_FRAMES)]]  # noqa: UP007
    # A granted allocation; a denial (``ptr`` null) fails here and goes the plain way.
    granted = msgspec.defstruct(
        "_Alloc", [("t", time), ("b", count), ("size", size), ("align", count),
                   ("ptr", count), ("bytes", size),
                   ("tag", Optional[str], None),  # noqa: UP007 - read at run time
                   ("reason", None, None), ("stack", frames, None)],
        tag_field="ev", tag="alloc", forbid_unknown_fields=True)
    freed = msgspec.defstruct("_Free", [("t", time), ("b", count), ("ptr", count)],
                              tag_field="ev", tag="free", forbid_unknown_fields=True)
    decoder = msgspec.json.Decoder(Union[granted, freed])
    return (decoder.decode, freed,
            (msgspec.DecodeError, msgspec.ValidationError, RecursionError))
