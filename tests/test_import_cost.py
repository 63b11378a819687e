"""``import gpubudget`` imports what a budget needs and leaves the rest for when it is used:
no asyncio or ssl (through contextvars_extras, needed by ``bind`` alone), no trace reading
(msgspec), no frameworks, no plotting, no command line. Checked by what a fresh interpreter
has imported, never by a timing (``benchmarks/import_time.py`` measures the time)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import subprocess_env

LATER = ("asyncio", "ssl", "numpy", "matplotlib", "msgspec", "contextvars_extras",
         "prometheus_client", "torch", "cupy", "tensorrt", "tensorrt_rtx", "pycuda", "ray",
         "selenium", "subprocess", "tempfile", "secrets", "traceback",
         "gpubudget.tracefile.reader", "gpubudget.replay", "gpubudget.viewer", "gpubudget.cli",
         "gpubudget.plot", "gpubudget.perfetto", "gpubudget.metrics", "gpubudget.torch",
         "gpubudget.cupy", "gpubudget.tensorrt")
"""Modules (and packages: any module under them) that ``import gpubudget`` must not import."""


def _imported(code: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def _found(modules: set[str], wanted: str) -> bool:
    return wanted in modules or any(name.startswith(wanted + ".") for name in modules)


def test_import_gpubudget_leaves_the_heavy_modules_for_later() -> None:
    modules = _imported("import gpubudget")
    assert "gpubudget.budget" in modules  # the import did happen, here
    assert [name for name in LATER if _found(modules, name)] == []


def test_a_budget_entered_and_used_imports_none_of_them_either() -> None:
    modules = _imported("from gpubudget import gpu_budget\n"
                        "with gpu_budget('1MiB', backend='host') as pool:\n"
                        "    pool.free(pool.allocate(4096))\n"
                        "    pool.report()")
    assert [name for name in LATER if _found(modules, name)] == []


@pytest.mark.parametrize("code, needs", [
    ("import gpubudget; gpubudget.bind(print)", "contextvars_extras"),
    ("from gpubudget.tracefile import TraceReader", "gpubudget.tracefile.reader"),
])
def test_what_is_left_for_later_comes_when_it_is_used(code: str, needs: str) -> None:
    assert _found(_imported(code), needs)
