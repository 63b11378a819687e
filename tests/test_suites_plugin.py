"""The CuPy-suite plugin (scripts/suites/cupy_routed.py) on a stand-in suite, with the fake
CuPy of tests/fakes.py and host memory that says it is device 0's: each run is a pytest
subprocess; its outcome file is read back and compared (scripts/gpu-suites.sh runs CuPy's
own suite on a GPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from scripts.suites.compare import compare_outcomes, cupy_report, run_counts, tight_failures
from scripts.suites.outcomes import Run, load_run

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = '''
import sys
import types

from tests.fakes import DeviceHostBackend, fake_cupy

cp = fake_cupy()
PLANS = []  # stands for CuPy's FFT plan cache: it holds memory of the budget that made it
cp.fft = types.SimpleNamespace(config=types.SimpleNamespace(clear_plan_cache=PLANS.clear))
cp.cuda.alloc = cp.allocate
cp.PLANS = PLANS
sys.modules["cupy"] = cp

import scripts.suites.cupy_routed as plugin

plugin.BACKEND_FACTORY = lambda: DeviceHostBackend(0)
'''

SUITE = '''
import time
import traceback

import cupy as cp
import pytest

import gpubudget

HELD = []


def test_small():
    assert cp.allocate(1000) is not None


def test_big():
    assert cp.allocate(4 * 2**20) is not None


def test_big_inside_cupys_helpers():
    # what cupy.testing.numpy_cupy_* do with an error only CuPy raised: an AssertionError
    # holding its text, raised outside the except block
    error = None
    try:
        cp.allocate(4 * 2**20)
    except Exception as exc:
        error = "".join(traceback.TracebackException.from_exception(exc).format())
    if error is not None:
        raise AssertionError("Only cupy raises error\\n\\n" + error)


def test_fails_everywhere():
    assert 1 == 2


def test_skipped():
    pytest.skip("not here")


@pytest.mark.xfail(strict=True)
def test_expected_to_fail():
    assert False


def test_plan_cache_holds_a_chunk():
    cp.PLANS.append(cp.allocate(1000))


def test_corrupts_the_ledger():
    gpubudget.current_budget()._node.account.used += 256


def test_sleeps():
    time.sleep(30)


def test_zz_keeps_an_array():  # last: a chunk held past the test
    HELD.append(cp.allocate(1000))
'''


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite")
    (path / "conftest.py").write_text(CONFTEST, encoding="utf-8")
    (path / "test_fake_suite.py").write_text(SUITE, encoding="utf-8")
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p), **extra}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    return env


def _pytest(suite: Path, name: str, *args: str) -> tuple[subprocess.CompletedProcess[str], Run]:
    out = suite / f"{name}.json"
    env = _env()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "scripts.suites.cupy_routed", "-p",
         "no:cacheprovider", "-q", "--gpubudget-outcomes", str(out), "--gpubudget-label",
         name, *args], cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    return result, load_run(out)


RUNNABLE = ["-k", "not corrupts and not sleeps"]


@pytest.fixture(scope="module")
def runs(suite: Path) -> dict[str, Run]:
    found = {}
    for name, args in (("off", ["--gpubudget-off"]),
                       ("root", ["--gpubudget-limit", "64MiB"]),
                       ("child", ["--gpubudget-mode", "child", "--gpubudget-root-limit",
                                  "64MiB", "--gpubudget-limit", "16MiB"]),
                       ("tight", ["--gpubudget-limit", "1MiB"])):
        result, run = _pytest(suite, name, *args, *RUNNABLE)
        assert result.returncode == 1, result.stdout + result.stderr  # test_fails_everywhere
        found[name] = run
    return found


def test_unrouted_records_pytests_outcomes(runs: dict[str, Run]) -> None:
    off = runs["off"]
    outcomes = {nodeid.split("::")[1]: record["outcome"] for nodeid, record in off.tests.items()}
    assert outcomes == {
        "test_small": "passed", "test_big": "passed", "test_big_inside_cupys_helpers": "passed",
        "test_fails_everywhere": "failed", "test_skipped": "skipped",
        "test_expected_to_fail": "xfailed", "test_plan_cache_holds_a_chunk": "passed",
        "test_zz_keeps_an_array": "passed"}
    assert off.complete and off.meta["mode"] == "off" and off.meta["collected"] == 8
    assert all(record["gpubudget"] is None for record in off.tests.values())
    failure = off.tests["test_fake_suite.py::test_fails_everywhere"]["failure"]
    assert failure["exc_type"] == "AssertionError" and not failure["oom"]
    assert isinstance(off.meta["wall_s"], float)


@pytest.mark.parametrize("name", ["root", "child"])
def test_routed_runs_have_the_unrouted_outcomes(runs: dict[str, Run], name: str) -> None:
    routed = runs[name]
    same = compare_outcomes(runs["off"], routed)
    assert same["identical"], same
    info = {nodeid.split("::")[1]: record["gpubudget"] for nodeid, record in routed.tests.items()}
    assert all(i["check_error"] is None for i in info.values())
    assert info["test_small"]["released"] == "exit"
    assert info["test_small"]["budget"] == "test_small#main.1"
    # the plugin clears the FFT plan cache when it holds a budget (gpubudget may come to do
    # that itself at the budget's exit)
    assert info["test_plan_cache_holds_a_chunk"]["released"] in ("plan_cache", "exit")
    assert info["test_zz_keeps_an_array"]["released"] == "held"
    assert info["test_zz_keeps_an_array"]["held_bytes"] > 0
    assert all(i[phase] >= 0 for i in info.values()
               for phase in ("enter", "route", "unroute", "exit", "release", "check"))
    assert info["test_small"]["warmup"] > 0
    assert (info["test_small"]["session_root"] is not None) == (name == "child")
    counts = run_counts(routed)
    assert counts["released"]["exit"] + counts["released"]["plan_cache"] == 7
    assert counts["released"]["held"] == 1 and counts["released"]["gc"] == 0
    assert counts["check_failures"] == 0 and counts["hangs"] == 0


def test_a_tight_budget_fails_only_with_clean_out_of_memory_errors(runs: dict[str, Run]) -> None:
    tight = runs["tight"]
    records = {nodeid.split("::")[1]: record for nodeid, record in tight.tests.items()}
    direct = records["test_big"]["failure"]
    assert records["test_big"]["outcome"] == "failed"
    assert direct["oom_type"] and direct["oom"] and direct["names_budget"]
    assert direct["exc_type"].endswith("OutOfMemoryError")
    assert "test_big#main.2" in direct["message"]
    wrapped = records["test_big_inside_cupys_helpers"]["failure"]
    assert wrapped["exc_type"] == "AssertionError" and not wrapped["oom_type"]
    assert wrapped["oom"] and wrapped["names_budget"]
    assert "OutOfMemoryError" in wrapped["oom_line"]
    assert records["test_small"]["outcome"] == "passed"
    result = tight_failures(runs["off"], tight)
    assert (result["new_failures"], result["clean"], result["direct"], result["wrapped"],
            result["unclean"]) == (2, 2, 1, 1, 0)
    markdown, summary, ok = cupy_report(runs["off"], [runs["root"], runs["child"]], [tight])
    assert ok, markdown
    assert "| root | yes |" in markdown and "| tight | 2 | 2 | 1 | 1 | 0 |" in markdown


def test_a_broken_invariant_fails_the_teardown_and_is_counted(suite: Path) -> None:
    result, run = _pytest(suite, "corrupt", "-k", "corrupts")
    assert result.returncode == 1
    (record,) = run.tests.values()
    assert record["outcome"] == "error" and record["teardown_error"]
    assert record["failure"]["when"] == "teardown"
    assert record["failure"]["exc_type"] == "InvariantError"
    assert "LEDGER" in record["gpubudget"]["check_error"]
    assert run_counts(run)["check_failures"] == 1
    assert "InvariantError" in result.stdout


def test_under_xdist_a_hung_test_ends_its_worker_and_counts_as_a_hang(suite: Path) -> None:
    for plugin in ("xdist", "pytest_timeout"):
        if importlib.util.find_spec(plugin) is None:
            pytest.skip(f"needs {plugin}")
    result, run = _pytest(suite, "xdist", "-n", "2", "--timeout", "3", "--timeout-method",
                          "thread", "--gpubudget-limit", "1MiB", "-k", "not corrupts")
    records = {nodeid.split("::")[1]: record for nodeid, record in run.tests.items()}
    assert records["test_sleeps"]["outcome"] == "crashed", result.stdout + result.stderr
    assert run_counts(run)["hangs"] == 1
    assert records["test_big"]["failure"]["oom_type"]
    assert records["test_big"]["failure"]["names_budget"]
    assert records["test_small"]["gpubudget"]["worker"] in ("gw0", "gw1")
    assert run.meta["collected"] == 9 and run.meta["workers"] == 2


def test_the_device_script_runs_end_to_end_on_the_stand_in_suite(tmp_path: Path) -> None:
    tests = tmp_path / "suite" / "tests"
    tests.mkdir(parents=True)
    (tests / "conftest.py").write_text(CONFTEST, encoding="utf-8")
    (tests / "test_fake_suite.py").write_text(SUITE, encoding="utf-8")
    out = tmp_path / "out"
    env = _env(CUPY_TESTS=str(tests), OUT=str(out), TMPDIR=str(tmp_path), SKIP_OPINFO="1",
               SELECTION="test_fake_suite.py -k 'not corrupts and not sleeps'",
               WORKERS="2", TIGHT_WORKERS="2", LIMIT="64MiB", CUPY_SECONDS="300",
               PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                     os.environ.get("PATH", "")]))
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-suites.sh")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert sorted(path.name for path in out.iterdir()) == [
        "cupy-runs.tar.gz", "cupy-summary.json", "gpu-suites.log", "summary.md"]
    summary = (out / "summary.md").read_text(encoding="utf-8")
    assert "| tight | 2 | 2 | 1 | 1 | 0 | 0 | 0 |" in summary
    assert "| root | yes | 0 | 0 | 0 | 0 | 0 |" in summary
    assert "| child | yes |" in summary and "All criteria hold: yes" in summary
    assert "CuPy's pytest settings written" in (out / "gpu-suites.log").read_text()
    with tarfile.open(out / "cupy-runs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"cupy-{run}.{kind}" for run in ("tight", "off", "root", "child")
            for kind in ("json", "jsonl", "log")} <= names
