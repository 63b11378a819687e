"""What an engine needs, before loading it (gpubudget.tensorrt.fit), and ``gpubudget engine``.

Plans are real: TensorRT-RTX's builder makes them without a GPU. Deserializing them needs a
GPU TensorRT-RTX supports; none is here, so the exact numbers are checked against fake engines
with TensorRT's method names, and no test claims that an engine was deserialized.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget import tensorrt as gbt
from gpubudget.cli import main
from gpubudget.tensorrt.fit import EngineNeeds
from tests import bindings
from tests.trt_fakes import KiB, FakeEngine, real_plan

trt: Any = pytest.importorskip("tensorrt_rtx_bindings")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "model.plan"
    path.write_bytes(real_plan(trt))
    return path


def deserializes_here(needs: EngineNeeds) -> bool:
    return needs.context_memory_max is not None


def test_a_plan_without_a_gpu_gives_its_size_and_names_what_needs_one(plan_file: Path) -> None:
    needs = gbt.plan_needs(plan_file, room=4 << 20, trt_module=trt)
    assert needs.plan_bytes == plan_file.stat().st_size and needs.module == trt.__name__
    assert needs.weights is None and needs.context_memory_max is None
    assert needs.streamable_weights is None and needs.fits is None
    assert needs.weights_bound == needs.plan_bytes  # the plan bounds the weights
    text = needs.text()
    for row in ("weights", "context (largest)", "streamable weights"):
        assert f"{row}" in text
    assert text.count("needs a GPU") == 3 and "cannot tell" in text
    assert gbt.plan_needs(plan_file.read_bytes(), trt_module=trt).plan_bytes == needs.plan_bytes


def test_deserializing_where_no_gpu_can_says_why(plan_file: Path) -> None:
    needs = gbt.plan_needs(plan_file, room=4 << 20, trt_module=trt, deserialize=True)
    if deserializes_here(needs):
        pytest.skip("this machine deserialized the plan: its GPU is one TensorRT-RTX supports")
    assert needs.unknown is not None and "could not deserialize it here" in needs.unknown
    assert needs.fits is None


@pytest.mark.parametrize(("content", "why"), [
    (b"", "empty"),
    (b"vtrt", "shorter than"),
    (os.urandom(4096), "malformed engine"),
    (b"ftrt" + b"\0" * 4092, "malformed engine"),
])
def test_what_is_not_a_plan_is_a_plan_error(content: bytes, why: str) -> None:
    with pytest.raises(gbt.PlanError, match=why):
        gbt.plan_needs(content, trt_module=trt)


def test_files_that_cannot_be_plans(tmp_path: Path) -> None:
    with pytest.raises(gbt.PlanError, match="directory"):
        gbt.plan_needs(tmp_path, trt_module=trt)
    with pytest.raises(FileNotFoundError):
        gbt.plan_needs(tmp_path / "missing.plan", trt_module=trt)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(gbt.PlanError, match="not a regular file"):
        gbt.plan_needs(fifo, trt_module=trt)  # never waits for a writer
    with pytest.raises(TypeError, match="plan"):
        gbt.plan_needs(42, trt_module=trt)  # type: ignore[arg-type]


def test_exact_numbers_of_an_engine_and_the_verdicts() -> None:
    engine = FakeEngine(trt, per_batch=4 * KiB, max_batch=16, profiles=2, streamable=96 * KiB,
                        weights=200 * KiB)
    needs = gbt.engine_needs(engine, room=400 * KiB, contexts=2)
    assert needs.weights == 200 * KiB and needs.context_memory == (64 * KiB, 32 * KiB)
    assert needs.context_memory_max == 64 * KiB and needs.streamable_weights == 96 * KiB
    assert needs.upper == needs.lower == 328 * KiB and needs.fits is True
    assert gbt.engine_needs(engine, room=300 * KiB, contexts=2).fits is False
    with gpu_budget("1MiB", backend="host") as budget:
        budget.allocate(900 * KiB)
        assert gbt.engine_needs(engine, budget=budget).fits is False  # 124 KiB of room
    text = needs.text()
    assert "context, profile 1" in text and "fits" in text
    assert needs.as_dict()["context_memory"] == [64 * KiB, 32 * KiB]


def test_bounds_decide_only_what_they_can() -> None:
    def needs(plan: int | None, weights: int | None, context: int | None,
              room: int) -> EngineNeeds:
        return EngineNeeds(plan, weights, None, context, None, 1, room, "m")

    assert needs(100, None, 50, 150).fits is True  # the plan's size bounds the weights
    assert needs(100, None, 50, 120).fits is None  # weights may be less than the plan
    assert needs(100, 90, 50, 120).fits is False  # exact numbers decide
    assert needs(100, None, None, 10**9).fits is None  # context memory needs a GPU
    assert needs(100, 200, None, 150).fits is False  # exact weights alone are too much
    with pytest.raises(ValueError, match="room"):
        gbt.engine_needs(FakeEngine(trt), room=-1)
    with pytest.raises(ValueError, match="contexts"):
        gbt.engine_needs(FakeEngine(trt), contexts=0)


# -- gpubudget engine ----------------------------------------------------------------------

def run(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["engine", *args])
    out, err = capfd.readouterr()
    return status, out, err


def test_the_command_reports_a_plan_and_says_what_needs_a_gpu(
        plan_file: Path, capfd: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capfd, str(plan_file), "--trt-module", trt.__name__, "--no-gpu")
    assert status == 0 and err == ""
    assert f"{plan_file.stat().st_size / 1024:.2f} KiB" in out and "needs a GPU" in out
    here = gbt.plan_needs(plan_file, trt_module=trt, deserialize=True)
    status, out, _ = run(capfd, str(plan_file), "--trt-module", trt.__name__, "--limit",
                         "1GiB")
    if not deserializes_here(here):  # a gate never passes on numbers it does not have
        assert status == 1 and "cannot tell" in out
        assert "could not deserialize" in out or "no CUDA device here" in out
    status, out, _ = run(capfd, str(plan_file), "--trt-module", trt.__name__, "--json",
                         "--no-gpu", "--contexts", "3")
    document = json.loads(out)
    assert status == 0 and document["plan_bytes"] == plan_file.stat().st_size
    assert document["contexts"] == 3 and document["fits"] is None


@pytest.mark.parametrize("make", ["missing", "directory", "empty", "garbage", "short", "fifo"])
def test_a_bad_plan_file_is_one_line_and_exit_2(
        make: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.plan"
    if make == "directory":
        path.mkdir()
    elif make == "empty":
        path.write_bytes(b"")
    elif make == "garbage":
        path.write_bytes(os.urandom(10_000))
    elif make == "short":
        path.write_bytes(b"vtrt\0\0")
    elif make == "fifo":
        os.mkfifo(path)
    status, out, err = run(capfd, str(path), "--trt-module", trt.__name__)
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("gpubudget: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["--limit", "lots"], ["--contexts", "0"], []])
def test_bad_arguments_exit_2(args: list[str], plan_file: Path,
                              capfd: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capfd, *([str(plan_file)] if args else []), *args)
    assert status == 2 and len(err.splitlines()) == 1


def test_a_huge_plan_is_sized_without_reading_it_whole(plan_file: Path, tmp_path: Path) -> None:
    """The plan's size and header need neither the whole file in memory nor a GPU: an 8 GiB
    plan (sparse here) is sized by a process that may map at most 2 GiB."""
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    huge = tmp_path / "huge.plan"
    with open(huge, "wb") as file:
        file.write(plan_file.read_bytes()[:4096])  # a real plan's header
        file.truncate(8 << 30)
    script = ("import resource, sys\n"
              "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
              "from gpubudget.cli import main\n"
              f"sys.exit(main(['engine', {str(huge)!r}, '--no-gpu', '--trt-module', "
              f"{trt.__name__!r}]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert "8.00 GiB" in done.stdout
    garbage = tmp_path / "garbage.plan"  # a bad header is refused before the rest is read
    with open(garbage, "wb") as file:
        file.write(b"\x01" * 4096)
        file.truncate(8 << 30)
    done = subprocess.run([sys.executable, "-c", script.replace(str(huge), str(garbage))
                           .replace(", '--no-gpu'", "")], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert done.returncode == 2 and "malformed" in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("name", ["no_such_tensorrt", "os"])
def test_a_trt_module_that_cannot_be_used_is_one_line_and_exit_2(
        name: str, plan_file: Path, capfd: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capfd, str(plan_file), "--trt-module", name, "--no-gpu")
    assert status == 2 and out == "", out
    assert len(err.splitlines()) == 1 and name in err and "internal error" not in err, err


def test_the_binding_extension_itself_is_a_trt_module(
        plan_file: Path, capfd: pytest.CaptureFixture[str]) -> None:
    extension = trt.Runtime.__module__  # tensorrt_rtx_bindings.tensorrt_rtx: no __version__
    status, out, err = run(capfd, str(plan_file), "--trt-module", extension, "--no-gpu")
    assert (status, err) == (0, "") and "needs a GPU" in out
    status, out, err = run(capfd, str(plan_file) + "-missing", "--trt-module", extension)
    assert status == 2 and "internal error" not in err
    with pytest.raises(gbt.PlanError, match=r"not a plan of this .*\(version unknown\)"):
        gbt.plan_needs(b"\x01" * 4096, trt_module=extension)


def test_what_was_checked_is_said(plan_file: Path) -> None:
    """TensorRT-RTX checks a plan's header length and its header without a GPU; an engine's
    numbers are its own."""
    needs = gbt.plan_needs(plan_file, trt_module=trt)
    assert needs.checked == ("plan size", "header size", "header")
    assert "checked             plan size, header size, header" in needs.text()
    assert needs.as_dict()["checked"] == ("plan size", "header size", "header")
    exact = gbt.engine_needs(FakeEngine(trt))
    assert exact.checked == ("deserialized",)
    assert gbt.engine_needs(FakeEngine(trt), plan_bytes=10).checked == ("plan size",
                                                                        "deserialized")


@pytest.mark.parametrize("binding", tuple(bindings.LEAN))
def test_a_lean_runtime_checks_only_the_plans_size_without_a_gpu(binding: str) -> None:
    """TensorRT 10 and 11 have no get_engine_validity (nor engine_header_size): without
    deserializing, no Runtime is even made (making one without a GPU gives an unusable one)."""
    module = bindings.load(binding)
    assert not hasattr(module.Runtime, "get_engine_validity")
    needs = gbt.plan_needs(b"\x01" * 3000, trt_module=module)
    assert (needs.plan_bytes, needs.checked, needs.module) == (3000, ("plan size",),
                                                               module.__name__)
    assert needs.unknown is not None and "not deserialized" in needs.unknown


def test_an_engine_of_a_tensorrt_older_than_10_1_is_one_line_naming_what_it_lacks() -> None:
    class Engine10_0:  # noqa: N801 - TensorRT 10.0's ICudaEngine has the sizes without _v2
        num_optimization_profiles = 1
        device_memory_size = 4096

    for call, what in ((lambda: gbt.engine_needs(Engine10_0()), "engine_needs()"),
                       (lambda: gbt.stream_weights(Engine10_0()), "stream_weights()"),
                       (lambda: gbt.ContextMemory(Engine10_0()), "ContextMemory()")):
        with gpu_budget("1MiB", backend="host"), pytest.raises(TypeError) as raised:
            call()
        message = str(raised.value)
        assert message.startswith(f"{what}: Engine10_0 lacks ") and "\n" not in message
        assert "device_memory_size_v2" in message and "older than 10.1" in message
