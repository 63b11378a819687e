"""The viewer's page: one self-contained HTML file (its script, style and data inline; no
network at view time), written for a :class:`~gpubudget.html.model.ViewModel`.

The data travels as one JSON object; its numeric columns as little-endian typed arrays,
compressed with zlib and written in base64 (the page inflates them with the browser's
``DecompressionStream``), so a million events take a few megabytes.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import zlib
from array import array
from importlib import resources
from typing import Any

from .model import ViewModel

__all__ = ["page_html", "write_page"]

def _column(values: array[Any], kind: str) -> str:
    """``values`` as a base64 zlib stream of little-endian ``kind`` items (``d`` float64,
    ``i`` int32)."""
    packed = values if values.typecode == kind else array(kind, values)
    if sys.byteorder != "little":  # pragma: no cover - every platform gpubudget runs on
        packed = array(kind, packed)
        packed.byteswap()
    return base64.b64encode(zlib.compress(packed.tobytes(), 6)).decode("ascii")


def _data(model: ViewModel) -> dict[str, Any]:
    return {
        "title": model.title,
        "source": model.source,
        "end": model.end,
        "budgets": [[b.name, b.parent, b.limit, b.reserve, b.entered, b.exited, b.peak,
                     b.allocations, b.frees, b.denied] for b in model.budgets],
        "points": {"n": len(model.point_t), "t": _column(model.point_t, "d"),
                   "b": _column(model.point_budget, "i"),
                   "used": _column(model.point_used, "d"),
                   "own": _column(model.point_own, "d")},
        "blocks": {"n": len(model.block_budget), "b": _column(model.block_budget, "i"),
                   "size": _column(model.block_size, "d"),
                   "tag": _column(model.block_tag, "i"),
                   "addr": _column(model.block_address, "d"),
                   "t0": _column(model.block_start, "d"),
                   "t1": _column(model.block_end, "d"),
                   "stack": _column(model.block_stack, "i")},
        "denials": [list(d) for d in model.denials],
        "tags": model.tags,
        "frames": model.frames,
        "stacks": model.stacks,
    }


def _script_safe(text: str) -> str:
    """JSON that cannot end the ``<script>`` element it sits in."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _html_text(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def page_html(model: ViewModel, *, title: str | None = None) -> str:
    """The page for ``model``, as text."""
    folder = resources.files(__package__)
    template = folder.joinpath("viewer.html").read_text(encoding="utf-8")
    style = folder.joinpath("viewer.css").read_text(encoding="utf-8")
    script = folder.joinpath("viewer.js").read_text(encoding="utf-8")
    data = _script_safe(json.dumps(_data(model), allow_nan=False, separators=(",", ":")))
    shown = _html_text(f"gpubudget: {title or model.title}")
    parts = template.split("/*STYLE*/")
    page = parts[0] + style + parts[1]
    head, tail = page.split("/*SCRIPT*/")
    page = head + script.replace("</", "<\\/") + tail
    head, tail = page.split("/*DATA*/")
    page = head + data + tail
    return page.replace("<!--TITLE-->", shown)


def write_page(model: ViewModel, path: str | os.PathLike[str], *,
               title: str | None = None) -> None:
    """Write the page for ``model`` into ``path`` (replaced whole; ``OSError`` if it cannot
    be written)."""
    text = page_html(model, title=title)
    with open(path, "w", encoding="utf-8") as out:
        out.write(text)
