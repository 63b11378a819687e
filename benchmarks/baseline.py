"""The team's one CPU baseline, ``bare_bestfit.py``: a bare bisect best-fit in plain Python and
its churn trace. Every CPU ratio of these benchmarks is against it, measured in the same
process. It lives outside this repository: ``--baseline PATH`` (or ``GPUBUDGET_BASELINE``)
names the file, by default ``../shared/bench/bare_bestfit.py`` beside the checkout."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

DEFAULT = Path(__file__).resolve().parent.parent.parent / "shared" / "bench" / "bare_bestfit.py"


def load(path: str | None = None) -> ModuleType:
    """The baseline module (``BestFit``, ``churn_trace``, ``run``); exit 2 with one line when
    it cannot be read."""
    where = Path(path or os.environ.get("GPUBUDGET_BASELINE") or DEFAULT)
    spec = importlib.util.spec_from_file_location("bare_bestfit", where)
    if spec is None or spec.loader is None or not where.is_file():
        print(f"benchmark: no baseline at {where} (give --baseline PATH to bare_bestfit.py)",
              file=sys.stderr)
        raise SystemExit(2)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
