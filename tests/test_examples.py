"""Every example runs, on a fresh interpreter, and prints what it promises."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
EXPECTED = {
    "two_models.py": ["over its 1.5 GiB cap", "├─ detector", "└─ classifier", "denied 1x"],
    "nested_report.py": ["model-b asks for 800 KiB: None", "reserve 256.00 KiB", "never-freed"],
    "tensorrt_two_models.py": ["two_models"],
    "ray_two_models.py": [
        "classifier: 3.00 GiB of activations refused (over its 3.00 GiB cap)",
        "GPU 0 (simulated, 8.00 GiB): 2 actors alive, limits 6.00 GiB, used 1.50 GiB",
        "denied 1x, over the limit of 'classifier'",
    ] if importlib.util.find_spec("ray") else ["Ray is not installed, so no cluster can start"],
}


def test_every_example_is_listed() -> None:
    assert {path.name for path in EXAMPLES} <= set(EXPECTED)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: Path) -> None:
    env = {**os.environ, "GPUBUDGET_BACKEND": "host", "PYTHONPATH": str(path.parent.parent)}
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for needle in EXPECTED.get(path.name, []):
        assert needle in result.stdout, result.stdout
