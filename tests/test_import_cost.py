"""``import gpubudget`` imports what a budget needs and leaves the rest for when it is used:
no asyncio or ssl (through contextvars_extras, needed by ``bind`` alone), no trace reading
(msgspec), no frameworks, no plotting, no command line. Checked by what a fresh interpreter
has imported, never by a timing (``benchmarks/import_time.py`` measures the time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    """What running ``code`` in a fresh interpreter imports beyond what the interpreter's own
    start imports (a ``.pth`` file of an installed package, such as numba-cuda's, may import
    ``tempfile`` before any code runs)."""
    return _loaded(code) - _loaded("pass")


def _loaded(code: str) -> set[str]:
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


def test_the_host_ledger_loads_at_a_roots_entry_not_at_import() -> None:
    assert not _found(_imported("import gpubudget\n"
                                "gpubudget.gpu_budget('1MiB', backend='host')"),
                      "gpubudget.hostledger")
    assert _found(_imported("import gpubudget\n"
                            "with gpubudget.gpu_budget('1MiB', backend='host'):\n"
                            "    pass"), "gpubudget.hostledger.claims")


def test_a_slot_held_at_exit_is_freed_though_the_ledger_loaded_late(tmp_path: Path) -> None:
    program = ("import gpubudget\n"
               "root = gpubudget.gpu_budget('1MiB', name='held', backend='host')\n"
               "root.__enter__()\n"
               "from gpubudget.hostledger import host_view\n"
               "assert [e.name for e in host_view(nvml=False).entries] == ['held']\n")
    ledger = str(tmp_path / "ledger")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(GPUBUDGET_LEDGER_DIR=ledger))
    assert done.returncode == 0, done.stderr
    from gpubudget.hostledger import host_view

    (device,) = host_view(ledger, nvml=False, idle=True).devices
    assert (device.entries, device.ended) == ((), 0)  # released at exit, not left to the dead
