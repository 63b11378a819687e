"""examples/tensorrt_full.py: it runs here up to the first call that needs a GPU (with real
TensorRT-RTX: the plan is built and sized, the runtime made); past that point its code is
checked against fake engines, and no test claims that an engine ran. docs/tensorrt.md shows
that code: the page's listing is checked to be the example's own text."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from tests.helpers import subprocess_env
from tests.trt_fakes import KiB, FakeEngine

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "tensorrt_full.py"
trt: Any = pytest.importorskip("tensorrt_rtx_bindings")


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("tensorrt_full", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_runs_up_to_the_first_call_that_needs_a_gpu() -> None:
    from gpubudget.backends import cuda_usable

    if cuda_usable():
        pytest.skip("a CUDA device is here: how far it gets depends on TensorRT's support")
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                            env=subprocess_env(GPUBUDGET_BACKEND="host"), timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^plan +\d+\.\d\d KiB \(weights on the device: at most this, unless "
                     r"the plan is weight-stripped\)$", out,
                     re.MULTILINE), out
    assert "room                 1.00 GiB" in out
    assert "could not deserialize the engine here; stopping before the first call" in out
    assert "context memory for batch" not in out and "output y" not in out  # nothing ran


def test_after_deserialization_on_a_fake_engine() -> None:
    """The part a GPU would run, on a fake engine with TensorRT's names (not an engine)."""
    example = load_example()
    engine = FakeEngine(trt, per_batch=KiB, max_batch=64, streamable=256 * KiB)
    with gpu_budget("1MiB", name="model", backend="host") as budget:
        context, outputs = example.prepare(engine, budget, trt)
        assert engine.weight_streaming_budget_v2 == 256 * KiB  # room for every weight
        assert context.memory[1] == context.update_device_memory_size_for_shapes()  # exact
        assert context.get_output_allocator("y") is outputs
        assert budget.used == context.memory[1]
        assert context.execute_async_v3(0, found=10, budget=budget, trt=trt)
        assert outputs.shape("y") == (10,)
        del context, outputs


@pytest.mark.parametrize("page", ["docs/tensorrt.md", "README.md"])
def test_the_page_shows_the_examples_own_code(page: str) -> None:
    text = (ROOT / page).read_text()
    listings = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    shown = [block for block in listings if "def prepare" in block]
    assert len(shown) == 1, f"{page} shows the full example once"
    assert shown[0] in EXAMPLE.read_text()
