"""Where user code called gpubudget from: stacks for leak reports, levels for warnings."""

from __future__ import annotations

import os
import sys
from types import CodeType, FrameType
from typing import Final

__all__ = ["frame_text", "user_stack", "user_stacklevel"]

_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CACHED: Final = 4096
"""Entries each cache below holds at most (then it starts again): code is finite in most
programs, but not in one that makes code as it runs."""
_ours_by_name: dict[str, bool] = {}
"""Whether a file is gpubudget's, by its absolute name (a relative one depends on the
directory current when it is asked, and is not kept)."""
_frames: dict[tuple[CodeType, int | None], str] = {}
"""Each frame's line of a stack, by its code and line: made once."""


def _ours(filename: str) -> bool:
    known = _ours_by_name.get(filename)
    if known is not None:
        return known
    ours = os.path.abspath(filename).startswith(_PACKAGE_DIR)
    if os.path.isabs(filename):
        if len(_ours_by_name) >= _CACHED:
            _ours_by_name.clear()
        _ours_by_name[filename] = ours
    return ours


def user_stack() -> tuple[str, ...]:
    """``"file:line in function"`` for every frame of the calling stack outside gpubudget,
    outermost first (what ``traceback.extract_stack`` gives, without importing it). Each
    frame's text is made once per code and line, and whether a file is gpubudget's decided
    once per file: a stack costs a walk and a lookup per frame."""
    found = []
    frames, ours_by_name = _frames, _ours_by_name
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        key = (code, frame.f_lineno)
        text = frames.get(key)
        if text is None:
            ours = ours_by_name.get(code.co_filename)
            if ours is None:
                ours = _ours(code.co_filename)
            if not ours:
                text = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
                if len(frames) >= _CACHED:
                    frames.clear()
                frames[key] = text
                found.append(text)
        else:
            found.append(text)
        frame = frame.f_back
    found.reverse()
    return tuple(found)


def frame_text(code: CodeType, line: int | None) -> str | None:
    """A frame's line of a stack, ``"file:line in function"``, as :func:`user_stack` gives
    it (the same text, made once); ``None`` for a frame of gpubudget's own code. What the C
    core's stack walk asks of each frame it has not seen before (``_core/callers.c``)."""
    ours = _ours_by_name.get(code.co_filename)
    if ours is None:
        ours = _ours(code.co_filename)
    if ours:
        return None
    key = (code, line)
    text = _frames.get(key)
    if text is None:
        text = f"{code.co_filename}:{line} in {code.co_name}"
        if len(_frames) >= _CACHED:
            _frames.clear()
        _frames[key] = text
    return text


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the caller of this
    function, point at the first frame outside gpubudget (the user's ``with`` line)."""
    level = 1
    frame = sys._getframe(1)  # the function that will call warnings.warn
    while frame is not None and _ours(frame.f_code.co_filename):
        level += 1
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
    return level
