"""Helpers for tests that read and write host-backend blocks."""

from __future__ import annotations

import ctypes


def fill(address: int, size: int, byte: int) -> None:
    """Write ``byte`` into every byte of a host-backend block."""
    ctypes.memset(address, byte, size)


def holds(address: int, size: int, byte: int) -> bool:
    """Whether every byte of a host-backend block still holds ``byte``."""
    return ctypes.string_at(address, size) == bytes([byte]) * size
