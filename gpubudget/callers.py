"""Where user code called gpubudget from: stacks for leak reports, levels for warnings."""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Final

__all__ = ["user_stack", "user_stacklevel"]

_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


def user_stack() -> tuple[str, ...]:
    """``"file:line in function"`` for every frame of the calling stack outside gpubudget,
    outermost first (what ``traceback.extract_stack`` gives, without importing it)."""
    found = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not _ours(code.co_filename):
            found.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    found.reverse()
    return tuple(found)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the caller of this
    function, point at the first frame outside gpubudget (the user's ``with`` line)."""
    level = 1
    frame = sys._getframe(1)  # the function that will call warnings.warn
    while frame is not None and _ours(frame.f_code.co_filename):
        level += 1
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
    return level
