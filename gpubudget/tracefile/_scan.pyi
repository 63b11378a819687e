"""Types of the C scanner (``_scan.c``)."""

from collections.abc import Callable
from typing import Any

from .events import TraceEvent

class Scanner:
    position: int
    lines: int
    bytes_read: int
    stopped: int
    def __init__(self, budgets: dict[int, Any], live: dict[int, int], frames: dict[int, str],
                 alloc: type, free: type, line_limit: int, max_frames: int,
                 sink: tuple[dict[int, Any], dict[int, Any], dict[int, Any], Any,
                             Callable[[Any, int], None]] | None = None) -> None: ...
    def scan(self, buffer: bytes, position: int, lines: int, bytes_read: int,
             stop_lines: int, max_bytes: int) -> list[TraceEvent]: ...
