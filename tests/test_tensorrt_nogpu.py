"""No crash on a machine without a GPU: TensorRT's lean runtime, by its real name, in a program
of its own (a crash fails the test instead of ending the test run).

Without a CUDA driver, NVIDIA's ``Runtime(logger)`` of the lean runtime logs "CUDA
initialization failure" and returns an object with no real C++ object behind it; touching it,
or destroying it, crashes. gpubudget recognises it before touching it, keeps it for good and
answers as any "needs a GPU" case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import bindings
from tests.helpers import subprocess_env

PROGRAM = textwrap.dedent("""
    import gc, json, sys
    sys.modules["tensorrt_rtx_bindings"] = None  # only the lean runtime can be imported
    import tensorrt_lean_bindings as trt
    from gpubudget import BackendError, gpu_budget
    from gpubudget import tensorrt as gbt
    from gpubudget.cli import main
    from gpubudget.tensorrt.vtable import unusable

    plan, out = sys.argv[1], {}
    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    own = trt.Runtime(logger)
    out["gpu"] = unusable(own) is None
    if out["gpu"]:  # a machine with a GPU TensorRT can use: nothing to check here
        print(json.dumps(out))
        sys.exit(0)
    from gpubudget.tensorrt import vtable
    vtable._MEM = "/nonexistent"  # where /proc/self/mem cannot be read: the memory map
    out["by map"] = unusable(own)
    vtable._MEM = "/proc/self/mem"
    out["found"] = gbt.load_module().__name__
    with gpu_budget("1MiB"):
        for name, make in (("Runtime", lambda: gbt.Runtime(logger)),
                           ("attach", lambda: gbt.attach(own))):
            try:
                make()
            except BackendError as exc:
                out[name] = str(exc)
        del own
        gc.collect()
    for deserialize in (False, True):
        needs = gbt.plan_needs(plan, room=1 << 20, trt_module="tensorrt_lean_bindings",
                               deserialize=deserialize)
        out[f"plan {deserialize}"] = needs.as_dict()
    sys.stdout.flush()
    for flags in (["--no-gpu"], [], ["--json"]):
        out[" ".join(flags) or "cli"] = main(["engine", plan, "--trt-module",
                                              "tensorrt_lean_bindings", *flags])
    out["default module"] = main(["engine", plan])  # found by itself: the lean runtime
    gc.collect()
    print(json.dumps(out))
""")


@pytest.mark.parametrize("binding", tuple(bindings.LEAN))
def test_no_gbt_call_and_no_engine_command_crashes_without_a_gpu(
        binding: str, tmp_path: Path) -> None:
    bindings.load(binding)  # skips (or fails, in CI) where it is not installed
    plan = tmp_path / "model.plan"
    # a plan's tag, then bytes a lean runtime cannot check without a GPU
    plan.write_bytes(b"ftrt" + b"\x01" * 4996)
    script = tmp_path / "nogpu.py"
    script.write_text(PROGRAM)
    env = subprocess_env(GPUBUDGET_BACKEND="host")
    env["PYTHONPATH"] = os.pathsep.join((str(bindings.path_of(binding)), env["PYTHONPATH"]))
    done = subprocess.run([sys.executable, str(script), str(plan)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    *printed, last = done.stdout.strip().splitlines()
    out = json.loads(last)
    if out["gpu"]:
        pytest.skip("TensorRT initialised CUDA here: this machine has a GPU it can use")
    assert out["by map"].startswith("its C++ pointer 0x")
    assert out["by map"].endswith("is not in readable memory")
    assert out["found"] == "tensorrt_lean_bindings"  # the bindings alone are found
    for name in ("Runtime", "attach"):
        assert f"{name}(): TensorRT could not initialise CUDA" in out[name]
        assert "keeps it alive for good" in out[name]
    quick, deep = out["plan False"], out["plan True"]
    for needs in (quick, deep):
        assert needs["plan_bytes"] == 5000 and needs["module"] == "tensorrt_lean_bindings"
        assert needs["weights"] is None and needs["fits"] is None
        assert needs["checked"] == ["plan size"]  # no header check in TensorRT 10/11
    assert "not deserialized" in quick["unknown"]
    assert "could not initialise CUDA" in deep["unknown"] and "CUDA initialization" in (
        deep["unknown"])
    assert (out["--no-gpu"], out["cli"], out["--json"], out["default module"]) == (0, 0, 0, 0)
    text = "\n".join(printed)
    assert text.count("4.88 KiB") >= 3 and "checked" in text and "plan size" in text
    # the command asks the CUDA driver first: with no device it never makes a Runtime
    assert text.count("no CUDA device here") >= 3
    assert "Traceback" not in done.stderr
