"""Helpers for tests that read and write host-backend blocks."""

from __future__ import annotations

import ctypes

from gpubudget.backends.host import HostBackend, HostReservation


def fill(address: int, size: int, byte: int) -> None:
    """Write ``byte`` into every byte of a host-backend block."""
    ctypes.memset(address, byte, size)


def holds(address: int, size: int, byte: int) -> bool:
    """Whether every byte of a host-backend block still holds ``byte``."""
    return ctypes.string_at(address, size) == bytes([byte]) * size


class RecordingBackend(HostBackend):
    """Host memory that remembers the reservations it handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.reservations: list[HostReservation] = []

    def reserve(self, nbytes: int) -> HostReservation:
        reservation = super().reserve(nbytes)
        self.reservations.append(reservation)
        return reservation
