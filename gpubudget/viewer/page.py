"""The viewer's page: one self-contained HTML file (its script, style and data inline; no
network at view time), written for a :class:`~gpubudget.viewer.model.ViewModel`.

The data travels as one JSON object; its numeric columns as little-endian typed arrays,
each in the narrowest width that holds its values, compressed with zlib and written in
base64 (the page inflates them with the browser's ``DecompressionStream``, which takes
longer the more bytes come out), so a million events take a few megabytes. Times travel
once, in the model's event order (as nanoseconds from one to the next where they are whole
nanoseconds); points as the steps from one's event to the next's, their budget and
``used`` (a budget's own bytes do not travel: its blocks say them); blocks name their events
by index. A summary of the
budgets is written as plain HTML (:mod:`~gpubudget.viewer.overview`), so the page shows it
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
from itertools import chain, repeat
from operator import eq, mul, sub, truediv
from typing import TYPE_CHECKING, Any, Final

from .model import ViewModel
from .overview import overview_html

if TYPE_CHECKING:
    from ..report import DoorUsage

__all__ = ["page_html", "write_page"]

_SCRIPTS: Final = ("viewer-data.js", "viewer-lanes.js", "viewer-address.js",
                   "viewer-flame.js", "viewer-panels.js", "viewer-app.js")
"""The page's script, in the order it is inlined (each file one part, see its header)."""


_WIDTHS: Final = (("u8", "B", 0, 2**8), ("i8", "b", -(2**7), 2**7), ("u16", "H", 0, 2**16),
                  ("i16", "h", -(2**15), 2**15), ("u32", "I", 0, 2**32),
                  ("i32", "i", -(2**31), 2**31))
"""The integer widths a column may travel in (its name for the page, ``array`` typecode,
range), narrowest first."""


def _packed(values: array[Any], code: str, name: str) -> dict[str, str]:
    packed = values if values.typecode == code else array(code, values)
    if sys.byteorder != "little":  # pragma: no cover - every platform gpubudget runs on
        packed = array(code, packed)
        packed.byteswap()
    return {"type": name, "data": base64.b64encode(zlib.compress(packed.tobytes(), 1))
            .decode("ascii")}


def _integers(values: array[Any]) -> dict[str, str]:
    """Whole numbers (kept as ints or as floats) in the narrowest width that holds them
    all: what the browser has to inflate is what it has to wait for."""
    low, high = (min(values), max(values)) if len(values) else (0, 0)
    for name, code, first, beyond in _WIDTHS:
        if first <= low and high < beyond:
            return _packed(values if values.typecode in "bBhHiIlLqQ" else
                           array(code, map(int, values)), code, name)
    return _packed(values, "d", "f64")


def _times(values: array[float]) -> dict[str, Any]:
    """The events' times: where every one is a whole number of nanoseconds (a trace's, a
    snapshot's, as written: nine decimals at most), the nanoseconds from one to the next as
    integers (a quarter of the bytes, and they compress), which the page adds up; else
    little-endian float64 (so too where the times reach beyond 2**63 nanoseconds, 292 years:
    a snapshot's odd clock)."""
    if len(values) and not 0 <= max(values) < 2**63 / 1e9:
        return _packed(values, "d", "f64")
    nanoseconds = array("q", map(round, map(mul, values, repeat(1e9))))
    if all(map(eq, map(truediv, nanoseconds, repeat(1e9)), values)):
        steps = array("q", map(sub, nanoseconds, chain((0,), nanoseconds)))
        if not steps or max(steps) < 2**32:
            return {"steps": "ns", **_integers(steps)}
    return _packed(values, "d", "f64")


def _steps(values: array[int]) -> dict[str, str]:
    """Non-decreasing integers (each point's event) as the steps from one to the next: mostly
    0 and 1, a byte each, which the page adds up."""
    return _integers(array("l", map(sub, values, chain((0,), values))))


def _rounding(sizes: array[float], requested: array[float]) -> array[float]:
    """What rounding added to each block (its size less its request; -1 where the request is
    not known): small numbers, where requests are as random as sizes, so they travel in a
    byte or two and compress."""
    if not len(requested) or min(requested) >= 0:  # every request known: in C
        return array("d", map(sub, sizes, requested))
    return array("d", (size - asked if asked >= 0 else -1
                       for size, asked in zip(sizes, requested)))


def _stream_names(streams: array[int]) -> list[str]:
    """The distinct streams of the blocks, in order of value, as the page names them."""
    return [f"stream {value:#x}" if value > 9 else f"stream {value}"
            for value in sorted(set(streams))]


def _stream_numbers(streams: array[int]) -> array[int]:
    """Each block's stream as its index in :func:`_stream_names`' list."""
    index = {value: i for i, value in enumerate(sorted(set(streams)))}
    return array("l", (index[value] for value in streams))


def _door(door: DoorUsage | None) -> list[Any] | None:
    """A budget's driver-door numbers for the page: ``[held, refusals, last refused, by
    whom, [[library, live, refusals], ...]]``, or ``None`` (no door)."""
    if door is None:
        return None
    return [door.held, door.refusals, door.last_refused, door.last_refused_by,
            [[lib.name, lib.live, lib.refusals] for lib in door.libraries]]


def _data(model: ViewModel) -> dict[str, Any]:
    streams = _stream_names(model.block_stream)  # one (a trace's): no column, the page knows
    return {
        "title": model.title,
        "source": model.source,
        "end": model.end,
        "timeUnit": model.time_unit,
        "notes": model.notes,
        "budgets": [[b.name, b.parent, b.limit, b.reserve, b.entered, b.exited, b.peak,
                     b.allocations, b.frees, b.denied, _door(b.door)] for b in model.budgets],
        "times": {"n": len(model.times), "t": _times(model.times)},
        "points": {"n": len(model.point_at), "at": _steps(model.point_at),
                   "b": _integers(model.point_budget), "used": _integers(model.point_used)},
        "blocks": {"n": len(model.block_budget), "b": _integers(model.block_budget),
                   "size": _integers(model.block_size),
                   "tag": _integers(model.block_tag),
                   "addr": _integers(model.block_address),
                   "from": _integers(model.block_from),
                   "to": _integers(model.block_to),
                   "stack": _integers(model.block_stack),
                   "lost": _integers(_rounding(model.block_size, model.block_requested)),
                   **({"stream": _integers(_stream_numbers(model.block_stream))}
                      if len(streams) > 1 else {})},
        "streams": streams,
        "denials": [list(d) for d in model.denials],
        "regions": [list(r) for r in model.regions],
        "mappings": [list(m) for m in model.mappings],
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
    >>> from gpubudget.viewer import model_from_report
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
