"""``gpubudget engine`` (gpubudget/cli/engine.py) on what is not a plan, on a bad module name,
and on a machine without a GPU: what it reads and what it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpubudget.cli import main
from gpubudget.cli.engine import _cuda_devices
from tests.helpers import subprocess_env
from tests.trt_fakes import real_plan

trt: Any = pytest.importorskip("tensorrt_rtx_bindings")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "model.plan"
    path.write_bytes(real_plan(trt))
    return path


def run(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["engine", *args])
    out, err = capfd.readouterr()
    return status, out, err


@pytest.mark.parametrize("name", ["../x", "a b", "", "x.", ".x", "tensorrt;rm"])
def test_a_trt_module_that_is_no_module_name_is_one_line(
        name: str, plan_file: Path, capfd: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capfd, str(plan_file), "--trt-module", name)
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and "is not a module name" in err, err
    assert "internal error" not in err


@pytest.mark.parametrize("content", [b"GIF89a" + b"\0" * 100, b"\x7fELF" + b"\1" * 60,
                                     b"FTRT" + b"\0" * 60, b"tr"])
def test_a_file_without_a_plans_tag_is_not_a_plan_even_where_no_tensorrt_checks(
        content: bytes, tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gpubudget.tensorrt.fit as fit

    def no_tensorrt(trt_module: object = None) -> Any:
        raise ImportError("no TensorRT here")

    monkeypatch.setattr(fit, "load_module", no_tensorrt)
    path = tmp_path / "model.plan"
    path.write_bytes(content)
    status, out, err = run(capfd, str(path), "--no-gpu")
    assert status == 2 and out == ""
    assert err.startswith(f"gpubudget: error: {path}: not a TensorRT plan: it begins with ")
    assert len(err.splitlines()) == 1


def test_a_real_plans_tag_passes_where_no_tensorrt_checks(
        plan_file: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gpubudget.tensorrt.fit as fit

    def no_tensorrt(trt_module: object = None) -> Any:
        raise ImportError("no TensorRT here")

    monkeypatch.setattr(fit, "load_module", no_tensorrt)
    assert plan_file.read_bytes()[:4] == b"vtrt"  # TensorRT-RTX's tag
    status, out, err = run(capfd, str(plan_file))
    assert (status, err) == (0, "") and "no TensorRT module can be imported here" in out


@pytest.mark.skipif(_cuda_devices() > 0, reason="a CUDA device is here: the plan is read "
                    "whole to be deserialized, as it should be")
def test_without_a_gpu_a_huge_plan_is_never_read_whole(plan_file: Path, tmp_path: Path) -> None:
    huge = tmp_path / "huge.plan"
    with open(huge, "wb") as file:
        file.write(plan_file.read_bytes())  # a real plan, then 1 GiB more (sparse)
        file.truncate(1 << 30)
    script = ("import resource, sys\n"
              "from gpubudget.cli import main\n"
              f"status = main(['engine', {str(huge)!r}, '--trt-module', {trt.__name__!r}])\n"
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
              "sys.exit(status)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout and "1.00 GiB" in done.stdout
    peak_kib = int(done.stderr.split()[-1])  # TensorRT's libraries alone: 0.2-0.75 GiB
    assert peak_kib < 1 << 20, f"{peak_kib} KiB resident, the plan's size: the plan was read"
