"""scripts/suites/opinfo.py's loop on stand-ins: the fake PyTorch of tests/fakes.py (whose
pools gpubudget.torch routes into budgets of host memory said to be device 0's) and a few
fake OpInfos (the real op_db on CUDA is scripts/gpu-suites.sh's)."""

from __future__ import annotations

import gc
import json
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.suites import opinfo
from tests.fakes import DeviceHostBackend, fake_torch

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11),
                                reason="PyTorch's out-of-memory note needs Python 3.11")

KEPT: list[Any] = []  # an op that keeps what it made: its budget stays held


def _opinfo_torch() -> Any:
    """The fake PyTorch, plus what opinfo.py uses: tensors with values, seeds, a pytree,
    assert_close, and the CUDA questions."""
    torch = fake_torch()
    allocate = torch.empty
    draws = {"next": 0, "unseeded": 0}

    class Tensor:
        def __init__(self, value: float, nbytes: int = 0, requires_grad: bool = False) -> None:
            self.value, self.requires_grad = value, requires_grad
            self.handle = None
            if nbytes:
                try:
                    self.handle = allocate(nbytes)  # inside a pool: the budget's memory
                except AssertionError:
                    pass  # outside any pool: PyTorch's own

        def detach(self) -> Tensor:
            return self

        def to(self, device: str, copy: bool = False) -> Tensor:
            return Tensor(self.value)

        def is_floating_point(self) -> bool:
            return True

        def is_complex(self) -> bool:
            return False

        def sum(self) -> Loss:
            return Loss(self.value)

    class Loss:
        def __init__(self, value: float) -> None:
            self.value = value

        def __radd__(self, other: object) -> Loss:  # sum() starts from 0
            return self

        def backward(self) -> None:
            if self.value < 0:
                raise RuntimeError("no gradient for negative values")

    def assert_close(actual: Tensor, expected: Tensor, **kw: Any) -> None:
        if actual.value != expected.value:
            raise AssertionError(f"{actual.value} != {expected.value}")

    def seed(value: int) -> None:
        draws["next"] = 0

    def draw() -> float:  # a random op: the same in every mode, each seeded alike
        draws["next"] += 1
        return float(draws["next"] * 7 % 5)

    def nondeterministic() -> float:  # atomics, say: differs from run to run
        draws["unseeded"] += 1
        return float(draws["unseeded"])

    torch.Tensor, torch.tensor, torch.manual_seed = Tensor, Tensor, seed
    torch.draw, torch.nondeterministic = draw, nondeterministic
    torch.float32, torch.int64 = "float32", "int64"
    torch.testing = types.SimpleNamespace(assert_close=assert_close)
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda: None
    torch.cuda.get_device_name = lambda: "fake device"
    return torch


def _flatten(out: Any) -> tuple[list[Any], None]:
    return (list(out) if isinstance(out, (list, tuple)) else [out]), None


class FakeOp:
    """What opinfo.py asks of an OpInfo."""

    def __init__(self, name: str, fn: Callable[..., Any], torch: Any, *,
                 values: tuple[float, ...] = (1.0, 2.0), dtypes: tuple[str, ...] = ("float32",),
                 nbytes: int = 4096, bad_samples: bool = False) -> None:
        self.name, self.variant_test_name, self.fn, self.torch = name, "", fn, torch
        self.values, self.dtypes, self.nbytes, self.bad_samples = values, dtypes, nbytes, bad_samples
        self.supports_autograd = True

    def supported_dtypes(self, device: str) -> set[str]:
        return set(self.dtypes)

    def supported_backward_dtypes(self, device: str) -> set[str]:
        return {"float32"}

    def sample_inputs(self, device: str, dtype: str, requires_grad: bool = False) -> Iterator[Any]:
        if self.bad_samples:
            raise RuntimeError("cannot make samples")
        for value in self.values:
            yield types.SimpleNamespace(
                input=self.torch.tensor(value, self.nbytes, requires_grad), args=(), kwargs={})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    fake = _opinfo_torch()
    T = fake.Tensor

    def keep(x: Any) -> Any:
        KEPT.append(T(x.value, 8192))
        return T(x.value)

    def unknown(x: Any) -> Any:
        raise ValueError("unsupported")

    ops = [
        FakeOp("add", lambda x: T(x.value + 1, 8192, x.requires_grad), fake),
        FakeOp("view", lambda x: T(x.value, 0, x.requires_grad), fake),
        FakeOp("broken", unknown, fake),
        FakeOp("samples", lambda x: x, fake, bad_samples=True),
        FakeOp("backward", lambda x: T(x.value, 0, x.requires_grad), fake, values=(-1.0, 1.0)),
        FakeOp("empty_like", lambda x: T(fake.draw()), fake),
        FakeOp("random", lambda x: T(fake.draw()), fake),
        FakeOp("atomics", lambda x: T(fake.nondeterministic()), fake),
        FakeOp("keeps", keep, fake),
        FakeOp("int_only", lambda x: T(x.value + 1, 8192), fake, dtypes=("int64",)),
    ]
    pytree = types.ModuleType("torch.utils._pytree")
    pytree.tree_flatten = _flatten  # type: ignore[attr-defined]
    database = types.ModuleType("torch.testing._internal.common_methods_invocations")
    database.op_db = ops  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setitem(sys.modules, "torch.utils._pytree", pytree)
    monkeypatch.setitem(sys.modules, "torch.testing._internal.common_methods_invocations",
                        database)
    monkeypatch.setattr(opinfo, "BACKEND_FACTORY", lambda: DeviceHostBackend(0))
    monkeypatch.setattr(sys, "argv", ["opinfo.py"])
    yield fake
    KEPT.clear()
    gc.unfreeze()  # opinfo.main froze everything alive, this suite's objects too


def _run(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "opinfo.json"
    status = opinfo.main(["--out", str(out), "--md", str(tmp_path / "opinfo.md"),
                          "--limit", "64MiB", "--root-limit", "64MiB", "--tight", "1MiB",
                          "--dtypes", "float32,int64", *args])
    return status, json.loads(out.read_text()), (tmp_path / "opinfo.md").read_text()


def test_each_sample_runs_unrouted_routed_and_tight(torch: Any, tmp_path: Path) -> None:
    status, document, markdown = _run(tmp_path)
    pairs = {(p["op"], p["dtype"]): p for p in document["pairs"]}
    assert set(pairs) == {(name, "float32") for name in (
        "add", "view", "broken", "samples", "backward", "empty_like", "random", "atomics",
        "keeps")} | {("int_only", "int64")}
    rows = {key: {s["sample"]: s for s in pair["samples"]} for key, pair in pairs.items()}
    add = rows[("add", "float32")]
    assert [add[i]["a"] for i in (0, 1)] == ["ok", "ok"] == [add[i]["b"] for i in (0, 1)]
    assert add[0]["c"] == "fwd:OutOfMemoryError" and add[0]["c_clean"]  # a 2 MiB segment
    assert "c_message" not in add[0]  # kept for failures that are not clean only
    assert pairs[("add", "float32")]["backward"] and not pairs[("int_only", "int64")]["backward"]
    assert pairs[("add", "float32")]["released"] == {"b": "exit", "c": "exit"}
    assert pairs[("add", "float32")]["peak_b"] > 0
    assert pairs[("add", "float32")]["outside_growth"]["reserved"] == 0
    assert [rows[("view", "float32")][0][m] for m in "abc"] == ["ok", "ok", "ok"]
    assert [rows[("broken", "float32")][0][m] for m in "abc"] == ["fwd:ValueError"] * 3
    assert not rows[("broken", "float32")][0]["c_clean"]
    assert rows[("broken", "float32")][0]["c_message"] == "unsupported"
    assert [rows[("samples", "float32")][-1][m] for m in "abc"] == ["gen:RuntimeError"] * 3
    backward = rows[("backward", "float32")]
    assert [backward[0][m] for m in "abc"] == ["bwd:RuntimeError"] * 3
    assert [backward[1][m] for m in "abc"] == ["ok"] * 3
    assert "value_mismatch" not in rows[("empty_like", "float32")][0]  # not compared
    assert "value_mismatch" not in rows[("random", "float32")][0]  # seeded alike
    assert rows[("atomics", "float32")][0]["value_mismatch"] == "3.0 != 1.0"
    assert pairs[("keeps", "float32")]["released"]["b"] == "held"
    assert all(p["check_error"] is None for p in pairs.values())
    assert document["meta"]["ops_total"] == 10 and not document["meta"]["cut_short"]
    assert status == 0, markdown  # (c)'s only new failures are clean; (a) = (b)
    assert "| float32 | 9 | 9 | 17 |" in markdown and "All criteria hold: yes" in markdown
    assert "b:held 1" in markdown
    assert "values of (b) differ from (a) (informational) (2; first 20)" in markdown


def test_only_the_ops_asked_for(torch: Any, tmp_path: Path) -> None:
    status, document, _ = _run(tmp_path, "--ops", "^(add|view)$", "--skip", "view",
                               "--max-samples", "1")
    assert [(p["op"], len(p["samples"])) for p in document["pairs"]] == [("add", 1)]
    assert status == 0


def test_a_failure_of_the_harness_itself_is_recorded_and_the_loop_goes_on(
        torch: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = opinfo.Harness.pair

    def pair(self: opinfo.Harness, op: Any, name: str, dtype: Any, dtype_name: str) -> Any:
        if name == "view":
            raise KeyError("a bug of the harness")
        return real(self, op, name, dtype, dtype_name)

    monkeypatch.setattr(opinfo.Harness, "pair", pair)
    status, document, markdown = _run(tmp_path, "--ops", "^(add|view)$")
    assert [p["op"] for p in document["pairs"]] == ["add", "view"]
    assert document["pairs"][1]["harness_error"] == "KeyError: 'a bug of the harness'"
    assert status == 1 and "The harness failed (not the op) (1;" in markdown


def test_the_time_limit_stops_starting_ops(torch: Any, tmp_path: Path) -> None:
    status, document, markdown = _run(tmp_path, "--max-seconds", "0")
    assert document["pairs"] == [] and document["meta"]["cut_short"]
    assert status == 1 and "by the time limit" in markdown


def test_without_cuda_it_says_so(torch: Any, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    torch.cuda.is_available = lambda: False
    assert opinfo.main(["--out", str(tmp_path / "o.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
