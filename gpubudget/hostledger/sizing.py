"""How much a root may claim: shares of what is unclaimed, the device cap, and the decision.

A root's limit may be a share of the device memory that no root of the host has claimed,
instead of a number: ``"50%"`` (half of it), ``"rest"`` (all of it, same as ``"100%"``), each
optionally less a margin (``"rest - 2GiB"``, ``"30% - 512MiB"``). The decision is taken
under the ledger's lock (:mod:`gpubudget.hostledger.claims`), so two processes that size
themselves at the same instant take their shares one after the other, never of the same
memory.

On a device that reports its free memory (a GPU), a share is of that free memory less a
*headroom* (:data:`HEADROOM`, ``GPUBUDGET_HEADROOM``): the driver cannot hand out all of what
it calls free in one allocation (on an H200 the largest ``cuMemAlloc`` was the free memory
less 3 to 4 MiB), and the process needs room afterwards for what no allocator sees (a
framework's CUDA context and kernels, cuBLAS handles: PyTorch's context alone took about
94 MiB there).

:func:`decide` is the whole rule, a pure function of what the ledger and the device say.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Final

from ..units import MiB, format_size, parse_size

__all__ = ["CAP_ENV", "HEADROOM", "HEADROOM_ENV", "MIN_HEADROOM", "Decision", "Share",
           "decide", "headroom", "parse_cap", "parse_share"]

CAP_ENV: Final = "GPUBUDGET_DEVICE_CAP"
"""Environment variable: the most that the roots of the host may claim on each device, in
all (``120GiB``, or ``90%`` of the device's memory)."""
HEADROOM_ENV: Final = "GPUBUDGET_HEADROOM"
"""Environment variable: the headroom a share leaves on a GPU (a size, at least
:data:`MIN_HEADROOM`), instead of :data:`HEADROOM`."""
HEADROOM: Final = 256 * MiB
"""What a share leaves of a GPU's free memory: 4 MiB that one allocation of the rest needs
(measured on an H200: free less 3 to 4 MiB was the most one ``cuMemAlloc`` got), about
94 MiB for a framework's CUDA context and kernels made afterwards (PyTorch's, measured
there), and the rest for cuBLAS handles and kernels loaded lazily."""
MIN_HEADROOM: Final = 8 * MiB
"""The least headroom ``GPUBUDGET_HEADROOM`` may ask: twice what one allocation needs."""
_SHARE: Final = re.compile(
    r"\s*(?:(?P<rest>rest)|(?P<percent>[0-9]*\.?[0-9]*)\s*%)\s*(?:-\s*(?P<margin>.*?))?\s*",
    re.IGNORECASE)


@dataclass(frozen=True)
class Share:
    """A root's limit given as ``fraction`` of the device memory unclaimed at its entry,
    less ``margin`` bytes; ``text`` is how it was written.

    >>> parse_share("50%")
    Share(fraction=0.5, margin=0, text='50%')
    >>> parse_share("rest - 2GiB").margin == 2 * 2**30
    True
    >>> parse_share("4GiB") is None                     # a plain size
    True
    """

    fraction: float
    margin: int
    text: str


def parse_share(value: object, what: str = "limit") -> Share | None:
    """``value`` as a :class:`Share` if it is written as one (a string with ``%`` or
    starting with ``rest``); ``None`` for anything else (a size, checked elsewhere).
    ``ValueError`` quoting ``value`` if it is a share written wrong: no number, a
    percentage outside (0, 100], a margin that is not a size.

    >>> parse_share("30% - 1GiB").fraction
    0.3
    >>> parse_share("150%")
    Traceback (most recent call last):
    ...
    ValueError: limit '150%': a share must be more than 0% and at most 100% of the unclaimed memory
    """
    if not isinstance(value, str):
        return None
    looks = "%" in value or value.strip().lower().startswith("rest")
    if not looks:
        return None
    match = _SHARE.fullmatch(value)
    if match is None:
        raise ValueError(f"{what} {value!r} is not a share: write a percentage of the "
                         f"unclaimed device memory such as '50%', or 'rest', optionally "
                         f"less a margin ('rest - 2GiB')")
    fraction = 1.0
    if match["percent"] is not None:
        try:
            percent = Decimal(match["percent"])
        except InvalidOperation:
            raise ValueError(f"{what} {value!r} is not a share: {match['percent']!r} before "
                             f"'%' is not a number") from None
        if not 0 < percent <= 100:
            raise ValueError(f"{what} {value!r}: a share must be more than 0% and at most "
                             f"100% of the unclaimed memory")
        fraction = float(percent / 100)
    margin = 0
    if match["margin"] is not None:
        try:
            margin = parse_size(match["margin"], what=f"the margin of {what} {value!r}")
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None
    return Share(fraction, margin, value)


def parse_cap(text: str, total: int, what: str = CAP_ENV) -> int:
    """A cap written as a size (``120GiB``) or a percentage of the device's ``total``
    (``90%``), in bytes; ``ValueError`` naming ``what`` and quoting ``text`` otherwise.

    >>> parse_cap("90%", 10 * 2**30) == 9 * 2**30, parse_cap("8GiB", 10 * 2**30) == 8 * 2**30
    (True, True)
    """
    written = text.strip()
    if written.endswith("%"):
        try:
            percent = Decimal(written[:-1].strip())
        except InvalidOperation:
            percent = Decimal("NaN")
        if not percent.is_finite() or not 0 < percent <= 100:
            raise ValueError(f"{what}={text!r} is not a cap: a percentage must be a number "
                             f"more than 0 and at most 100, such as '90%'")
        return int(total * percent / 100)
    try:
        return parse_size(written, what=f"{what}={text!r}")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{exc} (a cap is a size such as '120GiB' or a percentage of the "
                         f"device's memory such as '90%')") from None


def headroom() -> int:
    """The headroom a share leaves on a GPU: ``GPUBUDGET_HEADROOM`` if set, else
    :data:`HEADROOM`; ``ValueError`` naming the variable if it is not a size of at least
    :data:`MIN_HEADROOM`.

    >>> import os
    >>> from unittest import mock
    >>> headroom() == HEADROOM
    True
    >>> with mock.patch.dict(os.environ, GPUBUDGET_HEADROOM="1GiB"):
    ...     headroom() == 2**30
    True
    """
    text = os.environ.get(HEADROOM_ENV, "").strip()
    if not text:
        return HEADROOM
    try:
        value = parse_size(text, what=f"{HEADROOM_ENV}={text!r}")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{exc} (the headroom a share leaves on a GPU is a size such as "
                         f"'512MiB')") from None
    if value < MIN_HEADROOM:
        raise ValueError(f"{HEADROOM_ENV}={text!r} is less than {format_size(MIN_HEADROOM)}: "
                         f"a GPU needs about 4 MiB free for one allocation of the rest")
    return value


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` answers: ``nbytes`` granted, or ``None`` and why not."""

    nbytes: int | None
    reason: str = ""
    """Why not, in words, with the numbers (for the error that names the holders)."""


def decide(request: int | Share, *, granularity: int, held: int, total: int,
           cap: int | None, hard: bool, free: int | None, unsettled: int,
           headroom: int = 0, cap_name: str = "the device cap",
           cap_held: int | None = None) -> Decision:
    """How many bytes a new root may claim.

    ``request``: its limit (bytes, already rounded up to ``granularity``) or a share;
    ``held``: bytes claimed on the device by the roots of live processes; ``total``: the
    device's memory; ``cap``: the most all roots may claim; ``hard``: claims must fit
    ``total``; ``free``: the device's free memory as read just before (``None``: unknown);
    ``unsettled``: bytes of claims whose memory that reading may not show yet;
    ``headroom``: what a share leaves of the free memory; ``cap_name``: what set ``cap``, for
    the reason (a limit set from outside, :mod:`gpubudget.hostledger.limits`, is a cap);
    ``cap_held``: the bytes claimed against ``cap``, when not ``held`` (a limit on one
    process counts only that process's claims).

    A share is of what is unclaimed: the room under the cap (or the total), and no more than
    the free memory less the unsettled claims and ``headroom``; it is rounded down to a MiB,
    then to ``granularity``. A limit is refused above the cap's room, above the total's room
    on a hard device, and above the free memory less the unsettled claims (the headroom is
    not taken from a limit: the device answers for it).

    >>> from gpubudget.units import GiB
    >>> decide(Share(0.5, 0, "50%"), granularity=256, held=2 * GiB, total=8 * GiB,
    ...        cap=None, hard=True, free=None, unsettled=0).nbytes == 3 * GiB
    True
    >>> decide(6 * GiB, granularity=256, held=4 * GiB, total=16 * GiB, cap=8 * GiB,
    ...        hard=False, free=None, unsettled=0).reason
    'the device cap is 8.00 GiB, 4.00 GiB of it claimed, 4.00 GiB left'
    >>> rest = decide(Share(1.0, 0, "rest"), granularity=256, held=0, total=16 * GiB,
    ...               cap=None, hard=False, free=10 * GiB, unsettled=0, headroom=HEADROOM)
    >>> (10 * GiB - rest.nbytes) // MiB
    256
    """
    rooms: list[tuple[int, str]] = []
    if cap is not None:
        against = held if cap_held is None else cap_held
        rooms.append((cap - against, f"{cap_name} is {format_size(cap)}, "
                                     f"{format_size(against)} of it claimed"))
    if hard or isinstance(request, Share):  # a share is never more than the device has
        rooms.append((total - held, f"the device has {format_size(total)}, "
                                    f"{format_size(held)} of it claimed"))
    if free is not None:
        kept = headroom if isinstance(request, Share) else 0
        rooms.append((free - unsettled - kept, f"the device has {format_size(free)} free of "
                                               f"{format_size(total)} total"
                      + (f", {format_size(unsettled)} of it claimed by roots still reserving"
                         if unsettled else "")
                      + (f", less {format_size(kept)} of headroom" if kept else "")))
    room, why = min(rooms, default=(math.inf, ""), key=lambda pair: pair[0])
    room = max(int(room), 0) if room != math.inf else 0
    if isinstance(request, Share):
        nbytes = int(room * request.fraction) - request.margin
        nbytes = nbytes // MiB * MiB if nbytes >= MiB else nbytes
        nbytes -= nbytes % granularity
        if nbytes <= 0:
            margin = f" less {format_size(request.margin)}" if request.margin else ""
            return Decision(None, f"{why}, {format_size(room)} left: {request.text!r} is "
                                  f"{request.fraction:.0%} of it{margin}, nothing")
        return Decision(nbytes)
    if rooms and request > room:
        return Decision(None, f"{why}, {format_size(room)} left")
    return Decision(request)
