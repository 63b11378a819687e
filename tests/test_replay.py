"""Trace files, replay, fit, and the command line (run as a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpubudget import gpu_budget
from gpubudget.replay import fit, replay
from gpubudget.tracefile import TraceError, read_trace, writer_for

MiB = 2**20


def record_abc(path: Path) -> None:
    """A child allocates A and B (1 MiB each), frees A, allocates C (2 MiB): 3 MiB are live
    at the peak, but the root needs 4 MiB (C cannot use A's hole). Known by construction:
    the child fits in 3 MiB, the root in 4 MiB."""
    with gpu_budget("16MiB", name="pool", trace=str(path)):
        with gpu_budget("8MiB", name="model") as model:
            a, b = model.allocate(MiB, tag="a"), model.allocate(MiB, tag="b")
            assert a is not None and b is not None and model.free(a)
            c = model.allocate(2 * MiB, tag="c")
            assert model.allocate(9 * MiB) is None  # recorded as a denial: a probe in replay
            assert c is not None and model.free(b) and model.free(c)
    writer_for(path).flush()


def test_trace_file_has_a_versioned_header_and_every_event(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    record_abc(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["format"] == "gpubudget-trace" and lines[0]["version"] == 1
    assert [e["ev"] for e in lines[1:]] == [
        "enter", "enter", "alloc", "alloc", "free", "alloc", "alloc", "free", "free", "exit", "exit"
    ]
    assert lines[7]["ptr"] is None and lines[7]["reason"] == "over_limit"
    assert read_trace(path).events == lines[1:]


def test_replay_reproduces_the_run(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    record_abc(path)
    result = replay(path)
    (report,) = result.reports
    assert report.name == "pool" and report.children[0].name == "model"
    assert report.peak == 3 * MiB and report.children[0].allocations == 3
    assert report.children[0].denied == 1  # the recorded denial, denied again by 8 MiB
    assert result.denials == {next(b for b, r in result.budgets.items() if r.name == "model"): 1}
    tags = {u.tag: u.peak for u in report.children[0].by_tag}
    assert tags == {"a": MiB, "b": MiB, "c": 2 * MiB}


def test_fit_finds_the_limits_known_by_construction(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    record_abc(path)
    found = {f.name: f for f in fit(path)}
    # The denied 9 MiB request is replayed as a probe: B and C are live then, so the model
    # needs 1 + 2 + 9 = 12 MiB, and the pool 13 MiB: A's 1 MiB hole before B stays unused.
    assert found["model"].limit == 12 * MiB and found["model"].peak == 12 * MiB
    assert found["pool"].limit == 13 * MiB
    limits = {f.budget: f.limit for f in found.values()}
    assert not replay(path, limits=limits).denials
    smaller = {**limits, found["pool"].budget: found["pool"].limit - 256}
    assert replay(path, limits=smaller).denials


def test_fit_of_a_trace_without_denials(tmp_path: Path) -> None:
    path = tmp_path / "clean.jsonl"
    with gpu_budget("16MiB", name="pool", trace=str(path)):
        with gpu_budget("8MiB", name="model") as model:
            a, b = model.allocate(MiB), model.allocate(MiB)
            assert a is not None and b is not None and model.free(a)
            c = model.allocate(2 * MiB)
            assert c is not None and model.free(b) and model.free(c)
    writer_for(path).flush()
    found = {f.name: f.limit for f in fit(path)}
    assert found == {"pool": 4 * MiB, "model": 3 * MiB}


def test_environment_variable_traces_every_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("GPUBUDGET_TRACE", str(path))
    for name in ("first", "second"):
        with gpu_budget("1MiB", name=name) as budget:
            block = budget.allocate(100)
            assert block is not None and budget.free(block)
    writer_for(path).flush()
    names = [e["name"] for e in read_trace(path).events if e["ev"] == "enter"]
    assert names == ["first", "second"]
    assert len(replay(path).reports) == 2


def test_trace_only_on_roots_and_bad_paths(tmp_path: Path) -> None:
    with gpu_budget("1MiB"):
        with pytest.raises(ValueError, match="only a root budget writes a trace"):
            with gpu_budget("1KiB", trace=str(tmp_path / "x.jsonl")):
                pass  # pragma: no cover
    with pytest.raises(TypeError, match="trace"):
        gpu_budget("1MiB", trace=3)  # type: ignore[arg-type]
    with pytest.raises(TraceError, match="cannot write"):
        with gpu_budget("1MiB", trace=str(tmp_path / "missing" / "x.jsonl")):
            pass  # pragma: no cover


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("", "is empty"),
        ("{not json\n", "not JSON"),
        ('{"format": "other"}\n', "not a gpubudget trace"),
        ('{"format": "gpubudget-trace", "version": 99}\n', "version 99 is newer"),
        ('{"format": "gpubudget-trace", "version": 1}\n{"ev": "boom", "t": 0, "b": 1}\n', "unknown event"),
        ('{"format": "gpubudget-trace", "version": 1}\n{"ev": "free", "t": 0}\n', "missing"),
    ],
)
def test_bad_trace_files_are_one_clear_error(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "GPUBUDGET_BACKEND": "host"}
    return subprocess.run([sys.executable, "-m", "gpubudget", *args], capture_output=True,
                          text=True, env=env, timeout=120, cwd=cwd)


def test_cli_help_for_every_command() -> None:
    for args in ((), ("demo",), ("report",), ("fit",)):
        result = run_cli(*args, "--help")
        assert result.returncode == 0 and "usage: gpubudget" in result.stdout


def test_cli_demo_prints_the_report_and_writes_the_plot(tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    result = run_cli("demo", "--backend", "host", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    assert "gpubudget demo on host memory" in result.stdout
    assert "├─ detector" in result.stdout and "over the limit of 'classifier'" in result.stdout
    assert "detector/weights" in result.stdout
    if "no plot" not in result.stdout:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_report_and_fit(tmp_path: Path) -> None:
    path = tmp_path / "abc.jsonl"
    record_abc(path)
    report = run_cli("report", str(path))
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith("pool [host]") and "└─ model" in report.stdout
    as_json = run_cli("report", "--json", str(path))
    assert json.loads(as_json.stdout)["children"][0]["name"] == "model"
    fitted = run_cli("fit", str(path))
    assert fitted.returncode == 0, fitted.stderr
    assert "gpu_budget(12582912, name='model')  # 12.00 MiB" in fitted.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("report", "nope.jsonl"), "does not exist"),
        (("fit", "bad.jsonl"), "not JSON"),
        (("fit", "new.jsonl"), "newer than this gpubudget reads"),
        (("frobnicate",), "invalid choice"),
        (("report",), "required"),
    ],
)
def test_cli_bad_input_is_one_line_and_status_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    (tmp_path / "new.jsonl").write_text('{"format": "gpubudget-trace", "version": 2}\n')
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
