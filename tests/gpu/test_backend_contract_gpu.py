"""The Backend contract suite (``tests/test_backend_contract.py``) on CUDA device 0: PyCUDA's
reservations (``cuMemAlloc``), its CUDA virtual memory ranges (``cuMemAddressReserve`` and
``cuMemCreate``/``cuMemMap`` granule by granule), and budgets on both, reserved and growable.
Every test of the suite runs here once with this module's ``case``; the driver's failures are
injected through a stand-in for the range's driver that answers one call with an error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.test_backend_contract import *  # noqa: F403 - the suite, run with this case
from tests.test_backend_contract import Case

_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
_INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE


class _Refusing:
    """A driver whose ``call`` answers ``status`` and does nothing; every other call is the
    real driver's."""

    def __init__(self, driver: Any, call: str, status: int) -> None:
        self._driver, self._call, self._status = driver, call, status

    def __getattr__(self, name: str) -> Any:
        if name == self._call:
            return lambda *args: self._status
        return getattr(self._driver, name)


def refusing(call: str, status: int) -> Callable[[Any], Callable[[], None]]:
    """Makes a CUDA virtual range's ``call`` fail with ``status`` until undone."""
    def inject(memory: Any) -> Callable[[], None]:
        real = memory._driver
        memory._driver = _Refusing(real, call, status)

        def undo() -> None:
            memory._driver = real

        return undo

    return inject


@pytest.fixture
def case() -> Iterator[Case]:
    import pycuda.driver as cuda

    from gpubudget.backends.pycuda import PyCudaBackend

    backend = PyCudaBackend(0)
    stream = cuda.Stream()  # a real stream to record events on

    def write(address: int, data: bytes) -> None:
        with backend.active():  # in any thread, with or without a current context
            cuda.memcpy_htod(address, data)

    def read(address: int, nbytes: int) -> bytes:
        found = bytearray(nbytes)
        with backend.active():
            cuda.memcpy_dtoh(found, address)
        return bytes(found)

    # The map fails after its memory was created and mapped (at cuMemSetAccess): what it
    # took on the way must be given back, to the byte (exact_free).
    yield Case("pycuda", backend, write, read, limit=256 * 2**20,
               fail_map=refusing("cuMemSetAccess", _OUT_OF_MEMORY),
               fail_unmap=refusing("cuMemUnmap", _INVALID_VALUE), stream=stream.handle,
               exact_free=True)
    stream.synchronize()
