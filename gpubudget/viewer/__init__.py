"""The memory viewer: one self-contained HTML page drawn from a trace
(``gpubudget view TRACE -o view.html``), a report (``report().to_html(path)``) or a PyTorch
memory snapshot (``gpubudget view snapshot.pickle -o view.html``); see docs/viewer.md.

:mod:`~gpubudget.viewer.model` reads what to draw from a trace or a report,
:mod:`~gpubudget.viewer.torchsnap` from a PyTorch snapshot (read by
:mod:`~gpubudget.viewer.plainpickle`, which refuses any pickle that is not plain data);
:mod:`~gpubudget.viewer.page` writes the page (``viewer.html``, ``viewer.css`` and the
``viewer-*.js`` parts beside them, inlined) with the summary of
:mod:`~gpubudget.viewer.overview`.
"""

from __future__ import annotations

from .model import ViewBudget, ViewModel, model_from_report
from .page import page_html, write_page
from .plainpickle import SnapshotError
from .tracemodel import model_from_trace
from .torchsnap import model_from_torch_data, model_from_torch_snapshot

__all__ = ["SnapshotError", "ViewBudget", "ViewModel", "model_from_report", "model_from_trace",
           "model_from_torch_data", "model_from_torch_snapshot", "page_html", "write_page"]
