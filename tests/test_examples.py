"""Every example runs, on a fresh interpreter, and prints what it promises."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from gpubudget.tensorrt import MODULE_NAMES
from tests.helpers import subprocess_env

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
EXPECTED = {
    "two_models.py": ["over its 1.5 GiB cap", "├─ detector", "└─ classifier", "denied 1x"],
    "nested_report.py": ["model-b asks for 800 KiB: None", "reserve 256.00 KiB", "never-freed"],
    "tensorrt_two_models.py": [],  # see test_the_tensorrt_example_says_what_happened_here
    "tensorrt_full.py": [],  # see tests/test_tensorrt_example.py
    "ray_two_models.py": [
        "classifier: 3.00 GiB of activations refused (over its 3.00 GiB cap)",
        "GPU 0 (simulated, 8.00 GiB): 2 actors alive, limits 6.00 GiB, used 1.50 GiB",
        "denied 1x, over the limit of 'classifier'",
    ] if importlib.util.find_spec("ray") else ["Ray is not installed, so no cluster can start"],
}


def run(path: Path) -> subprocess.CompletedProcess[str]:
    env = subprocess_env(GPUBUDGET_BACKEND="host")
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=120
    )


def test_every_example_is_listed() -> None:
    assert {path.name for path in EXAMPLES} <= set(EXPECTED)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: Path) -> None:
    result = run(path)
    assert result.returncode == 0, result.stderr
    for needle in EXPECTED.get(path.name, []):
        assert needle in result.stdout, result.stdout


def test_the_tensorrt_example_says_what_happened_here() -> None:
    """Without TensorRT it says so; with TensorRT but no CUDA device (this CI) it says that
    TensorRT refused, and never claims that an engine ran."""
    result = run(Path(__file__).parent.parent / "examples" / "tensorrt_two_models.py")
    assert result.returncode == 0, result.stderr
    if not any(importlib.util.find_spec(name) for name in MODULE_NAMES):
        assert "TensorRT is not installed" in result.stdout
        return
    from gpubudget.backends import cuda_usable

    if cuda_usable():
        pytest.skip("a CUDA device is here: the outcome depends on TensorRT's support of it")
    assert "deserialized" not in result.stdout.replace("refused to deserialize", "")
    assert any(why in result.stdout for why in (
        "cannot build engines here", "could not build", "refused to deserialize")), result.stdout
