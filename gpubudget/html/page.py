"""The viewer's page: one self-contained HTML file (its script, style and data inline; no
network at view time), written for a :class:`~gpubudget.html.model.ViewModel`.

The data travels as one JSON object; its numeric columns as little-endian typed arrays,
compressed with zlib and written in base64 (the page inflates them with the browser's
``DecompressionStream``), so a million events take a few megabytes. Times travel once, in
the model's event order; points and blocks name their events by index. A summary of the
budgets is written as plain HTML (:mod:`~gpubudget.html.overview`), so the page shows it
before, or without, its script.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import zlib
from array import array
from importlib import resources
from typing import Any, Final

from .model import ViewModel
from .overview import overview_html

__all__ = ["page_html", "write_page"]

_SCRIPTS: Final = ("viewer-data.js", "viewer-lanes.js", "viewer-address.js",
                   "viewer-flame.js", "viewer-panels.js", "viewer-app.js")
"""The page's script, in the order it is inlined (each file one part, see its header)."""


def _column(values: array[Any], kind: str) -> str:
    """``values`` as a base64 zlib stream of little-endian ``kind`` items (``d`` float64,
    ``i`` int32)."""
    packed = values if values.typecode == kind else array(kind, values)
    if sys.byteorder != "little":  # pragma: no cover - every platform gpubudget runs on
        packed = array(kind, packed)
        packed.byteswap()
    return base64.b64encode(zlib.compress(packed.tobytes(), 1)).decode("ascii")


def _data(model: ViewModel) -> dict[str, Any]:
    return {
        "title": model.title,
        "source": model.source,
        "end": model.end,
        "timeUnit": model.time_unit,
        "notes": model.notes,
        "budgets": [[b.name, b.parent, b.limit, b.reserve, b.entered, b.exited, b.peak,
                     b.allocations, b.frees, b.denied] for b in model.budgets],
        "times": {"n": len(model.times), "t": _column(model.times, "d")},
        "points": {"n": len(model.point_at), "at": _column(model.point_at, "i"),
                   "b": _column(model.point_budget, "i"),
                   "used": _column(model.point_used, "d"),
                   "own": _column(model.point_own, "d")},
        "blocks": {"n": len(model.block_budget), "b": _column(model.block_budget, "i"),
                   "size": _column(model.block_size, "d"),
                   "tag": _column(model.block_tag, "i"),
                   "addr": _column(model.block_address, "d"),
                   "from": _column(model.block_from, "i"),
                   "to": _column(model.block_to, "i"),
                   "stack": _column(model.block_stack, "i")},
        "denials": [list(d) for d in model.denials],
        "regions": [list(r) for r in model.regions],
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


def page_html(model: ViewModel, *, title: str | None = None,
              compare: ViewModel | None = None) -> str:
    """The page for ``model``, as text; with ``compare``, a second record (before a change)
    that the page's compare panel sets against it.

    Examples
    --------
    >>> from gpubudget import gpu_budget
    >>> from gpubudget.html import model_from_report
    >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
    ...     block = pool.allocate(1000, tag="weights")
    >>> page = page_html(model_from_report(pool.report()))
    >>> page.startswith("<!DOCTYPE html>"), "weights" in page
    (True, True)
    """
    folder = resources.files(__package__)
    template = folder.joinpath("viewer.html").read_text(encoding="utf-8")
    style = folder.joinpath("viewer.css").read_text(encoding="utf-8")
    script = "\n".join(folder.joinpath(name).read_text(encoding="utf-8")
                       for name in _SCRIPTS)
    payload = {"main": _data(model), "other": None if compare is None else _data(compare)}
    data = _script_safe(json.dumps(payload, allow_nan=False, separators=(",", ":")))
    shown = _html_text(f"gpubudget: {title or model.title}")
    parts = template.split("/*STYLE*/")
    page = parts[0] + style + parts[1]
    head, tail = page.split("/*SCRIPT*/")
    page = head + script.replace("</", "<\\/") + tail
    head, tail = page.split("/*DATA*/")
    page = head + data + tail
    page = page.replace("<!--OVERVIEW-->", overview_html(model, compare))
    return page.replace("<!--TITLE-->", shown)


def write_page(model: ViewModel, path: str | os.PathLike[str], *,
               title: str | None = None, compare: ViewModel | None = None) -> None:
    """Write the page for ``model`` (and ``compare``, see :func:`page_html`) into ``path``
    (replaced whole; ``OSError`` if it cannot be written)."""
    text = page_html(model, title=title, compare=compare)
    with open(path, "w", encoding="utf-8") as out:
        out.write(text)
