"""docs/costs.md says what the benchmarks measured: its generated tables are exactly what
``benchmarks/costs.py`` writes from ``benchmarks/results/costs-cpu.json``, every cost the page
promises is in that file, and its GPU table is BENCHMARKS.md's."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks import costs

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "costs.md"


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(costs.DEFAULT_JSON.read_text(encoding="utf-8"))
    return loaded


def test_the_page_says_what_the_measurements_say(data: dict[str, Any]) -> None:
    assert costs.generated(PAGE.read_text(encoding="utf-8")) == costs.render(data), \
        "docs/costs.md is stale: python -m benchmarks.costs --docs docs/costs.md"


def test_every_cost_is_measured(data: dict[str, Any]) -> None:
    pairs = data["pairs"]["best_us"]
    assert set(pairs) == {"plain", "tag=", "track_stacks=True", "trace=",
                          "trace= track_stacks=True", "through TensorRT's trampoline"}
    assert all(value > 0 for value in pairs.values())
    assert set(data["import"]["min_ms"]) >= {"bare start (python -c pass)", "import gpubudget"}
    assert data["traces"]["events"] >= 1_000_000
    for command in ("report", "fit"):
        assert data["traces"][command]["cpu_s_per_million"] > 0
    assert {"cpu", "cores", "python", "date", "commit"} <= set(data["machine"])


def test_the_measured_pairs_meet_the_targets(data: dict[str, Any]) -> None:
    """Issue 36: a traced pair at most 3x a plain one, with stacks at most 5x (the C core's
    figures, measured side by side in one run)."""
    from benchmarks.tracing import TARGETS

    assert data["machine"]["core"] == "C"
    best = data["pairs"]["best_us"]
    for name, most in TARGETS.items():
        assert best[name] / best["plain"] <= most, name


def test_the_rendering_follows_the_numbers(data: dict[str, Any]) -> None:
    changed = copy.deepcopy(data)
    changed["pairs"]["best_us"]["trace="] *= 2
    assert costs.render(changed) != costs.render(data)
    row = next(line for line in costs.render(changed).splitlines() if "`trace=PATH`" in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    best = changed["pairs"]["best_us"]
    assert cells[1] == f"{best['trace=']:.2f}"
    assert cells[3] == f"{best['trace='] / best['plain']:.1f}×"


def test_the_gpu_table_is_benchmarks_md(data: dict[str, Any]) -> None:
    page = PAGE.read_text(encoding="utf-8")
    measured = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    section = measured[measured.index("### H200 (`nvidia-h200`"):]
    gpu = page[page.index("## On a GPU"):]
    for name, value in (("gpubudget Budget.allocate/free", "0.95"), ("CuPy MemoryPool", "1.29"),
                        ("PyTorch caching_allocator_alloc/delete", "4.84"),
                        ("PyCUDA mem_alloc/free (cudaMalloc)", "23.84"),
                        ("CuPy arrays, CuPy's default pool", "1.76"),
                        ("CuPy arrays, routed into a budget", "1.80"),
                        ("PyTorch tensors, PyTorch's caching allocator", "2.01"),
                        ("PyTorch tensors, routed into a budget", "2.00")):
        assert re.search(rf"\| {re.escape(name)} \| {re.escape(value)} \|", section), name
        assert f"| {value} |" in gpu, name
