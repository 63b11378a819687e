"""Many models in one process on a real GPU, each in its own budget under one pool, loaded and
served from threads at once (``tests/gpu/many_models.py``, in a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.gpu.conftest import torch_or_skip


def run(*args: str) -> dict[str, Any]:
    """Run ``tests/gpu/many_models.py`` with PyTorch's deterministic cuBLAS; its summary."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "tests.gpu.many_models",
                             *args], capture_output=True, text=True, env=env, timeout=900)
    tail = (result.stdout[-4000:] + result.stderr[-4000:])
    assert result.returncode == 0, f"exit {result.returncode} (negative: a signal)\n{tail}"
    line = next(line for line in result.stdout.splitlines() if line.startswith("MANY_MODELS "))
    summary: dict[str, Any] = json.loads(line.removeprefix("MANY_MODELS "))
    print(json.dumps(summary, indent=1))  # shown with -s, and in the GPU script's log on failure
    return summary


def test_models_side_by_side_match_an_unbudgeted_run_bit_for_bit() -> None:
    """Four TransformerEncoders of different widths and depths load and serve at once, each in
    its own budget under one pool; a fifth, with too small a limit, fails meanwhile (its
    OutOfMemoryError names its budget) and the others serve on. Their outputs equal an
    unbudgeted run's bit for bit; nothing lands in PyTorch's default pool; once the models are
    gone and ``release_cached()`` ran, the pool is back to 0."""
    torch_or_skip()
    summary = run()
    assert summary["problems"] == [] and summary["hung"] == []
    assert summary["bitwise_equal"] == ["deep", "medium", "small", "wide"]
    assert list(summary["refused"]) == ["starved"]
    assert "budget 'starved'" in summary["refused"]["starved"]
    assert summary["default_pool_after"] == summary["default_pool_before"]
    assert summary["pool_used_after_release"] == 0
    assert set(summary["states"].values()) == {"released"}, summary["states"]
    assert summary["release_lock_on_cudamalloc"] is True


def test_the_many_models_issues_workers_finish() -> None:
    """The issue's four workers (one 16 GiB pool, 3 GiB each, TransformerEncoders), which
    aborted the process within seconds before."""
    torch_or_skip()
    summary = run("--issue")
    assert summary == {"problems": [], "hung": [], "pool_used_after_release": 0}
