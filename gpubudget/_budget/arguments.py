"""``gpu_budget``'s arguments, checked once, before anything is entered.

:func:`checked` turns what the user passed into the numbers a budget keeps, or raises a
``TypeError``/``ValueError`` that quotes the bad input and names the argument.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import TYPE_CHECKING, Final, NamedTuple

from ..backends import Backend, validate_spec
from ..units import as_int, check_align, format_size, parse_size

if TYPE_CHECKING:
    from ..hostledger import Share

__all__ = ["Arguments", "checked"]


class Arguments(NamedTuple):
    """A budget's arguments, checked."""

    limit: int
    """Bytes; 0 when ``share`` decides it at entry."""
    share: Share | None
    align: int
    reserve: int
    device: int | None
    initial: int | None


_TRACE_TYPES: Final = (str, os.PathLike)
_CLAIMS: Final = "gpubudget.hostledger.claims"


@atexit.register  # here, at import: before the exit handlers that return device memory
def _release_claims_at_exit() -> None:
    """The host ledger's slots freed at exit, if it was loaded (a root was entered): after
    every other exit handler of gpubudget, as when the ledger was loaded at import."""
    claims = sys.modules.get(_CLAIMS)
    if claims is not None:
        claims.release_at_exit()


def _share(limit: object) -> Share | None:
    """``limit`` as a share of a device, if it is written as one; the host ledger, which
    reads it, is imported only then (a program that gives sizes loads it at a root's entry,
    not at ``import gpubudget``)."""
    if not isinstance(limit, str) or not (
            "%" in limit or limit.strip().lower().startswith("rest")):
        return None
    from ..hostledger import parse_share

    return parse_share(limit)


def checked(limit: int | str, align: int, name: str | None, reserve: int | str | None,
            backend: Backend | str | None, track_stacks: bool, trace: object,
            device: int | None, initial: int | str | None, trim_on_exit: bool) -> Arguments:
    """Every argument of ``gpu_budget`` but ``parent`` (which is the class's own), checked;
    see :class:`~gpubudget.budget.Budget`."""
    share = _share(limit)  # "50%", "rest - 2GiB": sized from the host ledger at entry
    nbytes = 0 if share is not None else parse_size(limit, what="limit")
    alignment = check_align(align, "align")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise (TypeError if not isinstance(name, str) else ValueError)(
            f"name must be a non-empty string, got {name!r}")
    floor = 0 if reserve is None else parse_size(reserve, what="reserve")
    if floor > nbytes and share is None:
        raise ValueError(f"reserve {reserve!r} ({format_size(floor)}) exceeds limit {limit!r} "
                         f"({format_size(nbytes)}) of budget {name!r}")
    validate_spec(backend)
    if not isinstance(track_stacks, bool):
        raise TypeError(f"track_stacks must be a bool, got {track_stacks!r}")
    if trace is not None and trace is not False and not isinstance(trace, _TRACE_TYPES):
        raise TypeError(f"trace must be a file path or False, got {trace!r}")
    if isinstance(trace, str) and not trace:
        raise ValueError("trace must be a file path, got ''")
    ordinal = None if device is None else as_int(device)
    if device is not None and (ordinal is None or ordinal < 0):
        raise (TypeError if ordinal is None else ValueError)(
            f"device must be a CUDA device ordinal (an int >= 0) or None, got {device!r}")
    if not isinstance(trim_on_exit, bool):
        raise TypeError(f"trim_on_exit must be a bool, got {trim_on_exit!r}")
    mapped = _initial(initial, None if share is not None else nbytes, limit)
    return Arguments(nbytes, share, alignment, floor, ordinal, mapped)


def _initial(initial: object, limit: int | None, given: object) -> int | None:
    """``initial=`` checked: ``None``, or bytes from 0 to the limit (``None``: a share,
    decided at entry, which bounds it then)."""
    if initial is None:
        return None
    zero = initial in (0, "0") and not isinstance(initial, bool)
    nbytes = 0 if zero else parse_size(initial, what="initial")  # type: ignore[arg-type]
    if limit is not None and nbytes > limit:
        raise ValueError(f"initial {initial!r} ({format_size(nbytes)}) exceeds limit "
                         f"{given!r} ({format_size(limit)})")
    return nbytes
