"""Which core runs (``gpubudget._core``): the C extension where it was built, the pure-Python
core where it was not, where ``GPUBUDGET_PURE`` asks for it, or where a development
install's C source (any ``.c`` or ``.h`` file of ``_core/``) is newer than its build (then
with one warning)."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpubudget
from gpubudget._core import native
from tests.helpers import subprocess_env

REPO = Path(__file__).resolve().parent.parent
ASK = "import gpubudget, sys; print(gpubudget.compiled, gpubudget.Budget.allocate.__qualname__)"


def _run(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-W", "always", "-c", ASK], cwd=cwd, text=True,
                          capture_output=True, timeout=60, env=env or subprocess_env())


def _copy(tmp_path: Path, *, checkout: bool) -> Path:
    """The package in ``tmp_path/src`` with this run's extension (if any) beside its source,
    as a source checkout (``setup.py`` beside it) or as an installed package."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "gpubudget", src / "gpubudget",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if checkout:
        (src / "setup.py").write_text("# a source checkout\n")
    return src


def _env(src: Path, **extra: str) -> dict[str, str]:
    env = subprocess_env()
    elsewhere = [path for path in sys.path if path and Path(path).resolve() != REPO]
    env["PYTHONPATH"] = os.pathsep.join([str(src), *elsewhere])  # the copy first
    env.pop("GPUBUDGET_PURE", None)
    env.update(extra)
    return env


def test_compiled_says_which_core_runs() -> None:
    assert gpubudget.compiled == (native is not None)
    kind = type(gpubudget.Budget.__dict__["allocate"]).__name__
    assert kind == ("method_descriptor" if native is not None else "function")


@pytest.mark.skipif(native is None, reason="the C core is not built here")
def test_pure_asked_at_run_time_runs_python(tmp_path: Path) -> None:
    src = _copy(tmp_path, checkout=False)
    done = _run(tmp_path, _env(src, GPUBUDGET_PURE="1"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "Budget.allocate"]
    done = _run(tmp_path, _env(src, GPUBUDGET_PURE="0"))
    assert done.stdout.split()[0] == "True", done.stderr


@pytest.mark.skipif(native is None, reason="the C core is not built here")
def test_a_checkout_edited_since_its_build_runs_python_and_says_so(tmp_path: Path) -> None:
    src = _copy(tmp_path, checkout=True)
    source = src / "gpubudget" / "_core" / "_native.c"
    built = next(p for suffix in importlib.machinery.EXTENSION_SUFFIXES
                 for p in [src / "gpubudget" / "_core" / ("_native" + suffix)] if p.exists())
    os.utime(built, (1_000_000, 1_000_000))  # built long before the source was edited
    done = _run(tmp_path, _env(src))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "False"
    assert done.stderr.count("RuntimeWarning") == 1 and "_native.c is newer" in done.stderr
    assert "pip install -e ." in done.stderr
    installed = _copy(tmp_path / "wheel", checkout=False)  # the same, installed: it runs
    os.utime(installed / "gpubudget" / "_core" / built.name, (1_000_000, 1_000_000))
    assert source.exists()
    done = _run(tmp_path, _env(installed))
    assert done.stdout.split()[0] == "True" and "RuntimeWarning" not in done.stderr


@pytest.mark.skipif(native is None, reason="the C core is not built here")
@pytest.mark.parametrize("edited", ["arena.c", "native.h"])
def test_any_c_source_edited_since_the_build_runs_python(tmp_path: Path, edited: str) -> None:
    src = _copy(tmp_path, checkout=True)
    core = src / "gpubudget" / "_core"
    built = next(p for suffix in importlib.machinery.EXTENSION_SUFFIXES
                 for p in [core / ("_native" + suffix)] if p.exists())
    for source in [*core.glob("*.c"), *core.glob("*.h")]:
        os.utime(source, (1_000_000, 1_000_000))
    os.utime(built, (2_000_000, 2_000_000))  # built from them all
    done = _run(tmp_path, _env(src))
    assert done.stdout.split()[0] == "True" and "Warning" not in done.stderr, done.stderr
    os.utime(core / edited, (3_000_000, 3_000_000))  # one of them edited since
    done = _run(tmp_path, _env(src))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "False"
    assert done.stderr.count("RuntimeWarning") == 1, done.stderr
    assert f"{core / edited} is newer than its extension {built.name}" in done.stderr


def test_without_the_extension_the_python_core_runs_silently(tmp_path: Path) -> None:
    src = _copy(tmp_path, checkout=True)
    for built in (src / "gpubudget" / "_core").glob("_native.*"):
        if built.suffix != ".c":
            built.unlink()
    done = _run(tmp_path, _env(src))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "Budget.allocate"]
    assert "Warning" not in done.stderr


@pytest.mark.skipif(native is None, reason="the C core is not built here")
def test_a_source_tree_that_hides_a_built_install_says_so(tmp_path: Path) -> None:
    # `pip install .`, then Python started in the checkout: its directory comes first on
    # sys.path, and its gpubudget (never built) hides the installed one (built).
    installed = _copy(tmp_path / "site", checkout=False)
    checkout = _copy(tmp_path / "checkout", checkout=True)
    for built in (checkout / "gpubudget" / "_core").glob("_native.*"):
        if built.suffix != ".c":
            built.unlink()
    done = _run(checkout, _env(installed))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "Budget.allocate"]
    assert done.stderr.count("RuntimeWarning") == 1, done.stderr
    assert f"imported from the source tree {checkout}," in done.stderr
    assert f"the gpubudget it hides, {installed}, has it built" in done.stderr
    assert "Run from another directory" in done.stderr
    done = _run(tmp_path, _env(installed))  # from elsewhere: the installed one, built
    assert done.stdout.split()[0] == "True" and "Warning" not in done.stderr
    # an editable install that has its build: the checkout's own extension runs, silently
    shutil.rmtree(checkout)
    checkout = _copy(tmp_path / "checkout", checkout=True)
    done = _run(checkout, _env(installed))
    assert done.stdout.split()[0] == "True" and "Warning" not in done.stderr
    done = _run(checkout, _env(installed, GPUBUDGET_PURE="1"))  # asked for: no warning
    assert done.stdout.split()[0] == "False" and "Warning" not in done.stderr
