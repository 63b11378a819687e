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
"""Modules (and packages: any module under them) that ``import gpubudget`` must not import,
nor a budget entered, used and reported."""
AT_FIRST_USE = ("gpubudget.report", "gpubudget.jsontext", "gpubudget.tracefile",
                "gpubudget.hostledger", "gpubudget.door.records", "gpubudget.backends.virtual",
                "gpubudget.adapter", "gpubudget.numba", "gpubudget.cuda_core", "gpubudget.ray",
                "gpubudget.routing", "gpubudget.torchstate", "json", "dataclasses", "inspect",
                "argparse", "logging", "tomllib", "decimal", "datetime", "ctypes", "mmap",
                "fcntl")
"""What ``import gpubudget`` leaves for the first budget, report or trace that needs it: the
reports (with ``dataclasses`` and ``json``), the trace writer, the host ledger, the virtual
backends and ``ctypes``, the adapters and the command line's standard modules."""


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


def test_import_gpubudget_leaves_what_a_budget_loads_at_first_use() -> None:
    modules = _imported("import gpubudget")
    assert [name for name in AT_FIRST_USE if _found(modules, name)] == []


_END_TO_END = """
import sys
import gpubudget
loaded = sorted(m for m in sys.modules if m.startswith(("gpubudget.report",
                                                        "gpubudget.tracefile")))
from gpubudget import *
missing = [name for name in gpubudget.__all__ if name not in globals()]
listed = [name for name in gpubudget.__all__ if name not in dir(gpubudget)]
with gpu_budget("1MiB", name="pool", backend="host") as pool:
    block = pool.allocate(4096, tag="weights")
    report = pool.report()
    pool.free(block)
assert isinstance(report, BudgetReport), type(report)
assert [(b.size, b.tag) for b in report.live_blocks] == [(4096, "weights")]
assert isinstance(report.live_blocks[0], LiveBlock)
import gpubudget.report
assert (BudgetReport, Denial, LiveBlock) == (gpubudget.report.BudgetReport,
                                             gpubudget.report.Denial,
                                             gpubudget.report.LiveBlock)
assert gpubudget.tracefile.read_trace.__module__ == "gpubudget.tracefile.reader"
try:
    gpubudget.NoSuchName
except AttributeError as exc:
    unknown = str(exc)
print(loaded, missing, listed, unknown)
"""


def test_the_public_names_load_when_first_named_and_a_budget_works() -> None:
    done = subprocess.run([sys.executable, "-c", _END_TO_END], capture_output=True, text=True,
                          timeout=60, env=subprocess_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == (
        "[] [] [] module 'gpubudget' has no attribute 'NoSuchName'")


def test_the_doors_numbers_load_when_first_named() -> None:
    program = ("import sys, gpubudget.door as door\n"
               "print('gpubudget.door.records' in sys.modules, 'dataclasses' in sys.modules)\n"
               "print(door.DoorNumbers.__name__, 'DoorLibrary' in dir(door), door.numbers)\n"
               "print('gpubudget.door.records' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60, env=subprocess_env())
    assert done.returncode == 0, done.stderr
    first, second, third = done.stdout.splitlines()
    assert (first, third) == ("False False", "True")
    assert second.startswith("DoorNumbers True <function numbers")  # not the submodule


def test_gpubudget_trace_traces_and_a_free_at_exit_is_written(tmp_path: Path) -> None:
    # The trace writer loads at the first traced root's entry, but is still closed after the
    # exit handlers registered before then (an adapter's, freeing memory at exit).
    program = ("import atexit, sys, gpubudget\n"
               "assert 'gpubudget.tracefile' not in sys.modules\n"
               "pool = gpubudget.gpu_budget('1MiB', name='pool', backend='host')\n"
               "held = []\n"
               "atexit.register(lambda: pool.free(held.pop()))\n"
               "with pool:\n"
               "    held.append(pool.allocate(4096, tag='weights'))\n"
               "assert 'gpubudget.tracefile.writer' in sys.modules\n")
    path = tmp_path / "run.jsonl"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60, env=subprocess_env(GPUBUDGET_TRACE=str(path)))
    assert (done.returncode, done.stderr) == (0, "")
    from gpubudget.tracefile import read_trace

    assert [type(event).__name__ for event in read_trace(path).events] == [
        "Enter", "Alloc", "Exit", "Free"]


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


def test_a_roots_entry_loads_what_its_budgets_would_load_later() -> None:
    # once a root is open, allocate, free, report and a child's entry import nothing: CPython's
    # import system catches OSError while it looks for files, so a signal handler's
    # TimeoutError landing in an import could be lost (tests/test_interrupts.py's alarms)
    opened = _imported("import gpubudget\n"
                       "with gpubudget.gpu_budget('1MiB', backend='host'):\n"
                       "    import sys; before = set(sys.modules)\n")
    assert [name for name in ("gpubudget.report", "gpubudget.jsontext", "decimal",
                              "dataclasses", "gpubudget.door.records")
            if not _found(opened, name)] == []
    done = subprocess.run([sys.executable, "-c", (
        "import json, sys, gpubudget\n"
        "with gpubudget.gpu_budget('1MiB', backend='host') as pool:\n"
        "    before = set(sys.modules)\n"
        "    with gpubudget.gpu_budget('1.5KiB', name='child') as child:\n"
        "        child.free(child.allocate(512, tag='t'))\n"
        "        pool.report(); str(child.report()); pool.check()\n"
        "    print(json.dumps(sorted(set(sys.modules) - before)))\n")],
        capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []  # nothing imported inside the open root
