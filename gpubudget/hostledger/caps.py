"""The host-wide cap of a device: the most that the root budgets of every process on the
host may claim there together, kept in the device's ledger file."""

from __future__ import annotations

from ..backends import Backend, get_backend
from ..units import parse_size
from .claims import book_for, ledger_enabled
from .devices import LedgerDevice, device_for
from .errors import LedgerError
from .sizing import parse_cap

__all__ = ["device_cap", "set_device_cap"]


def _device(backend: Backend | str | None, device: int | None) -> LedgerDevice:
    chosen = get_backend(backend, device=device)
    found = device_for(chosen)
    if found is None:
        raise ValueError(f"backend {chosen!r} does not allocate on a device the host ledger "
                         f"knows (a GPU through PyCUDA, the host backend, a simulated GPU)")
    if not ledger_enabled():
        raise LedgerError("the host ledger is turned off (GPUBUDGET_LEDGER=0)")
    return found


def set_device_cap(cap: int | str | None, *, backend: Backend | str | None = None,
                   device: int | None = None) -> int | None:
    """Cap what the root budgets of all processes of this host may claim on a device.

    ``cap``: bytes, a size (``"120GiB"``) or a percentage of the device's memory
    (``"90%"``); ``None`` removes the cap. The device is the one a root budget with these
    ``backend`` and ``device`` arguments would reserve on. The cap is kept in the device's
    ledger file, so it holds for every process of the host (that uses this ledger
    directory) from their next root on, until changed; roots already entered keep their
    memory. ``GPUBUDGET_DEVICE_CAP`` in a process's environment caps its own claims too:
    the smaller cap applies. Returns the cap in bytes.

    Examples
    --------
    >>> import os, tempfile
    >>> from unittest import mock
    >>> from gpubudget import BudgetError, gpu_budget
    >>> from gpubudget.hostledger import set_device_cap
    >>> with mock.patch.dict(os.environ, GPUBUDGET_LEDGER_DIR=tempfile.mkdtemp()):
    ...     print(set_device_cap("1GiB", backend="host") == 2**30)
    ...     try:
    ...         gpu_budget("2GiB", name="big", backend="host").__enter__()
    ...     except BudgetError as denied:
    ...         print(denied)
    True
    budget 'big' cannot claim 2.00 GiB on host memory: the device cap is 1.00 GiB, ...
    """
    found = _device(backend, device)
    if cap is None:
        value = None
    elif isinstance(cap, str):
        value = parse_cap(cap, found.total, what="cap")
    else:
        value = parse_size(cap, what="cap")
    book = book_for(found)
    with book.locked():
        book.set_cap(value)
    return value


def device_cap(*, backend: Backend | str | None = None, device: int | None = None
               ) -> int | None:
    """The host-wide cap of the device (see :func:`set_device_cap`), ``None`` if none.

    >>> import os, tempfile
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, GPUBUDGET_LEDGER_DIR=tempfile.mkdtemp()):
    ...     print(device_cap(backend="host"))
    None
    """
    book = book_for(_device(backend, device))
    with book.locked():
        return book.header().cap
