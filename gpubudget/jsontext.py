"""JSON text of plain data (dicts, lists, strings, numbers) nested to any depth: what
``json.dumps`` writes, with a loop instead of recursion where reports nest (a budget tree a
thousand deep), and ``json.dumps`` itself for the rest (fast)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["dumps"]


def _deep(item: Any) -> bool:
    """Whether ``item`` holds reports' ``children`` (nested to any depth) or other
    containers of unknown depth: those are written by the loop below; anything else (a
    timeline, a list of live blocks) by ``json.dumps`` at once."""
    if isinstance(item, dict):
        return "children" in item
    if isinstance(item, (list, tuple)):
        return any(isinstance(x, dict) and "children" in x
                   or isinstance(x, (list, tuple)) for x in item)
    return False


def dumps(value: Any, indent: int | None) -> str:
    """``json.dumps(value, indent=indent)`` for plain data, with a loop instead of recursion."""
    parts: list[str] = []
    item_separator = "," if indent is not None else ", "
    frames: list[list[Any]] = []  # [iterator of (key or None, item), closer, level, first]

    def newline(level: int) -> str:
        return "" if indent is None else "\n" + " " * (indent * level)

    def emit(item: Any, level: int) -> None:
        if not _deep(item):  # no "children" inside: json.dumps, indented to this level
            text = json.dumps(item, indent=indent)
            parts.append(text if indent is None else text.replace("\n", newline(level)))
        elif isinstance(item, dict) and item:
            parts.append("{")
            frames.append([iter(item.items()), "}", level + 1, True])
        elif isinstance(item, (list, tuple)) and item:
            parts.append("[")
            frames.append([((None, x) for x in item), "]", level + 1, True])
        else:
            parts.append(json.dumps(item))

    emit(value, 0)
    while frames:
        frame = frames[-1]
        step = next(frame[0], None)
        if step is None:
            frames.pop()
            parts.append(newline(frame[2] - 1) + frame[1])
            continue
        key, item = step
        if not frame[3]:
            parts.append(item_separator)
        frame[3] = False
        parts.append(newline(frame[2]))
        if key is not None:
            parts.append(json.dumps(key) + ": ")
        emit(item, frame[2])
    return "".join(parts)
