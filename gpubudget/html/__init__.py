"""The memory viewer: one self-contained HTML page drawn from a trace
(``gpubudget view TRACE -o view.html``) or a report (``report().to_html(path)``).

:mod:`~gpubudget.html.model` reads what to draw; :mod:`~gpubudget.html.page` writes the page
(``viewer.html``, ``viewer.css`` and ``viewer.js`` beside them, inlined).
"""

from __future__ import annotations

from .model import ViewBudget, ViewModel, model_from_report, model_from_trace
from .page import page_html, write_page

__all__ = ["ViewBudget", "ViewModel", "model_from_report", "model_from_trace", "page_html",
           "write_page"]
