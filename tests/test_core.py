"""Which allocation core runs (``gpubudget.core``): from source when asked at run time, or when
a development install's sources are newer than its build or the build is incomplete, then
all of it and with one warning; compiled otherwise. And the public names keep their
docstrings under both cores (CI runs the suite with each)."""

from __future__ import annotations

import importlib.machinery
import inspect
import os
import pydoc
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpubudget
from gpubudget import units
from gpubudget.core import CORE
from tests.helpers import subprocess_env

REPO = Path(__file__).resolve().parent.parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
REPORT = ("import sys, gpubudget\n"
          "print(gpubudget.compiled)\n"
          "print(' '.join(sys.modules['gpubudget.' + n].__file__.rsplit('.', 1)[-1]"
          " for n in gpubudget.core.CORE))\n"
          "print(getattr(gpubudget.ledger, 'EDITED', False))\n")


def checkout(tmp_path: Path, *, setup: bool = True, without: str = "") -> Path:
    """A copy of the package in ``tmp_path/src`` (with ``setup.py`` beside it unless not
    ``setup``), whose core has extensions older than its sources: this run's own when it
    is compiled, else empty stand-ins (never imported when the sources run) -- none for
    the module ``without``."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "gpubudget", src / "gpubudget",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    if setup:
        (src / "setup.py").write_text("# a source checkout\n")
    for group in REPO.glob("*__mypyc*.so"):  # the compiled core's shared library
        shutil.copy2(group, src / group.name)
    for name in CORE:
        if name == without:
            continue
        built = Path(getattr(sys.modules[f"gpubudget.{name}"], "__file__", ""))
        target = src / "gpubudget" / (name + SUFFIX)
        if gpubudget.compiled:
            shutil.copy2(built, target)
        else:
            target.write_bytes(b"")
        os.utime(src / "gpubudget" / f"{name}.py", (1_000_000_000, 1_000_000_000))
        os.utime(target, (1_000_000_100, 1_000_000_100))  # built after the last edit
    return src


def run_from(src: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Import the package of ``src`` in a fresh interpreter and print :data:`REPORT`."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("PYTHONPATH", "GPUBUDGET_PURE")}
    return subprocess.run([sys.executable, "-c", REPORT], cwd=src, capture_output=True,
                          text=True, timeout=120, env={**environment, "PYTHONPATH": str(src),
                                                       **env})


def test_pure_asked_at_run_time_runs_every_core_module_from_source() -> None:
    done = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(GPUBUDGET_PURE="1"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == ["False", " ".join(["py"] * len(CORE))]
    assert done.stderr == ""


def test_a_source_edited_since_the_build_runs_all_from_source_with_one_warning(
        tmp_path: Path) -> None:
    src = checkout(tmp_path)
    ledger = src / "gpubudget" / "ledger.py"
    ledger.write_text(ledger.read_text() + "\nEDITED = True\n")  # now newer than its build
    done = run_from(src)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False", " ".join(["py"] * len(CORE)), "True"]
    assert done.stderr.count("RuntimeWarning") == 1
    assert f"{ledger} is newer than its compiled extension ledger{SUFFIX}" in done.stderr
    assert "Rebuild it with `pip install -e .`" in done.stderr and "<string>:1" in done.stderr


def test_an_incomplete_build_runs_all_from_source_with_one_warning(tmp_path: Path) -> None:
    done = run_from(checkout(tmp_path, without="arena"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == ["False", " ".join(["py"] * len(CORE))]
    assert "incomplete (no extension for arena)" in done.stderr


@pytest.mark.skipif(not gpubudget.compiled, reason="needs the compiled core")
def test_a_build_newer_than_its_sources_runs_compiled(tmp_path: Path) -> None:
    done = run_from(checkout(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "True" and done.stderr == ""


@pytest.mark.skipif(not gpubudget.compiled, reason="needs the compiled core")
def test_outside_a_source_checkout_the_extensions_run_whatever_their_times(
        tmp_path: Path) -> None:
    src = checkout(tmp_path, setup=False)  # as installed from a wheel
    os.utime(src / "gpubudget" / "ledger.py")  # a source newer than the extension
    done = run_from(src)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "True" and done.stderr == ""


def test_setup_compiles_the_one_list_of_core_modules() -> None:
    import runpy

    assert runpy.run_path(str(REPO / "gpubudget" / "core.py"))["CORE"] == CORE
    assert "gpubudget.core" not in [f"gpubudget.{name}" for name in CORE]


def _documented(obj: object) -> bool:
    return bool(inspect.getdoc(obj))


def test_public_names_keep_their_docstrings_under_either_core() -> None:
    undocumented = []
    for module in (gpubudget, units):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isroutine(obj) and not _documented(obj):
                undocumented.append(f"{module.__name__}.{name}")
            if not inspect.isclass(obj):
                continue
            if not _documented(obj):
                undocumented.append(f"{module.__name__}.{name}")
            for klass in obj.__mro__:
                if not klass.__module__.startswith("gpubudget"):
                    continue
                for attribute, member in vars(klass).items():
                    target = member.fget if isinstance(member, property) else member
                    if isinstance(target, (staticmethod, classmethod)):
                        target = target.__func__
                    if (not attribute.startswith("_") and inspect.isroutine(target)
                            and not _documented(target)):
                        undocumented.append(f"{klass.__name__}.{attribute}")
    assert undocumented == []
    assert "Return the number of bytes that ``value`` names" in pydoc.render_doc(
        gpubudget.parse_size)
    assert "binary units with two decimals" in pydoc.render_doc(gpubudget.format_size)
