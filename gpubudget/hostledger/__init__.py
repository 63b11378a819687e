"""The host ledger: what every root budget of every process on the host reserved, per device.

Each device has a small file (in ``/dev/shm/gpubudget-ledger-<uid>/``, or
``GPUBUDGET_LEDGER_DIR``) with one fixed-size slot per root budget of a live process: its
pid and start time, name, limit, reservation, ``used``, ``peak`` and denials, which the
owning process keeps current with plain stores, and pages of rows for the roots' child
budgets, kept current in the same way (:mod:`~gpubudget.hostledger.children`). A root claims
its slot at entry under the
file's lock (held for microseconds, never across a device call), which is also where a root
asking for a share of the unclaimed memory (``gpu_budget("50%")``) is sized and where the
device cap (``GPUBUDGET_DEVICE_CAP``, :func:`set_device_cap`) is enforced; on a GPU a share
leaves a headroom free (:data:`HEADROOM`, ``GPUBUDGET_HEADROOM``). Slots of
processes that have ended, however they ended, are cleared by the next claim and never
counted. :func:`host_view` reads everything; ``gpubudget top`` and ``gpubudget metrics``
show it.

>>> import os, tempfile
>>> from unittest import mock
>>> from gpubudget import gpu_budget
>>> from gpubudget.hostledger import host_view
>>> with mock.patch.dict(os.environ, GPUBUDGET_LEDGER_DIR=tempfile.mkdtemp()):
...     with gpu_budget("64MiB", name="model", backend="host") as model:
...         block = model.allocate(2**20)
...         print([(entry.name, entry.limit, entry.used) for entry in host_view().entries])
...         model.free(block)
...     print(host_view().entries)
[('model', 67108864, 1048576)]
True
()
"""

from __future__ import annotations

from .caps import device_cap, set_device_cap
from .claims import LEDGER_ENV, SETTLE_SECONDS, device_claims, ledger_enabled
from .devices import DEVICE_MEMORY_ENV, LedgerDevice, device_for
from .errors import LedgerDamaged, LedgerError, LedgerFull, LedgerLocked, LedgerUnusable
from .files import LEDGER_DIR_ENV, default_directory, ledger_directory
from .children import ChildBudget
from .layout import Entry
from .sizing import CAP_ENV, HEADROOM, HEADROOM_ENV, Share, parse_share
from .view import DeviceView, HostView, host_view

__all__ = [
    "CAP_ENV",
    "DEVICE_MEMORY_ENV",
    "HEADROOM",
    "HEADROOM_ENV",
    "LEDGER_DIR_ENV",
    "LEDGER_ENV",
    "SETTLE_SECONDS",
    "ChildBudget",
    "DeviceView",
    "Entry",
    "HostView",
    "LedgerDamaged",
    "LedgerDevice",
    "LedgerError",
    "LedgerFull",
    "LedgerLocked",
    "LedgerUnusable",
    "Share",
    "default_directory",
    "device_cap",
    "device_claims",
    "device_for",
    "host_view",
    "ledger_directory",
    "ledger_enabled",
    "parse_share",
    "set_device_cap",
]
