"""gpubudget fit --check: exit 1 with a table when a run needs more than the limits, 0 when it
fits, 2 with one line for a bad limits file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gpubudget import gpu_budget
from gpubudget.cli import EXIT_BAD_INPUT, main
from gpubudget.cli.gate import EXIT_OVER, read_limits
from gpubudget.tracefile import writer_for

MiB = 2**20


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """A pool whose model holds 3 MiB and is refused 6 MiB more (over its 8 MiB): the run
    needs 9 MiB for the model."""
    path = tmp_path / "run.jsonl"
    with gpu_budget("16MiB", name="pool", trace=str(path)):
        with gpu_budget("8MiB", name="model") as model:
            held = model.allocate(3 * MiB, tag="weights")
            assert model.allocate(6 * MiB) is None  # 9 MiB wanted: over 8 MiB
            assert held is not None and model.free(held)
    writer_for(path).flush()
    return path


def check(capsys: pytest.CaptureFixture[str], limits: Path, trace: Path) -> tuple[int, str, str]:
    status = main(["fit", "--check", str(limits), str(trace)])
    out, err = capsys.readouterr()
    return status, out, err


def test_python_limits_that_are_too_small_fail_with_a_table(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    limits = tmp_path / "limits.py"
    limits.write_text(textwrap.dedent("""
        from gpubudget import gpu_budget

        with gpu_budget("16MiB", align=256, name='pool'):
            with gpu_budget("8MiB", name="model"):
                ...
    """))
    status, out, err = check(capsys, limits, trace)
    assert status == EXIT_OVER and err == ""
    lines = out.splitlines()
    assert lines[0] == f"gpubudget fit --check: 1 budget(s) need more than {limits} allows"
    assert lines[2].split() == ["-", "pool/model", "8.00", "MiB", "9.00", "MiB", "+1.00", "MiB",
                                "over"]
    assert lines[3].split()[:2] == ["pool", "16.00"] and lines[3].endswith("ok")
    assert lines[4:6] == ["to fit, change:", '  pool/model: "8MiB" -> "9MiB"']


def test_the_same_run_passes_when_the_limit_is_raised(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    limits = tmp_path / "limits.toml"
    limits.write_text('[pool]\nlimit = "16MiB"\n\n[pool.model]\nlimit = "9MiB"\n')
    status, out, _ = check(capsys, limits, trace)
    assert status == 0 and out.startswith("gpubudget fit --check: the run fits in")
    limits.write_text('[pool]\nlimit = "16MiB"\n\n[pool.model]\nlimit = "8.5MiB"\n')
    assert check(capsys, limits, trace)[0] == EXIT_OVER


def test_the_code_fit_prints_is_a_limits_file(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", str(trace)]) == 0
    printed = capsys.readouterr().out
    code = printed[printed.index("with gpu_budget("):]
    limits = tmp_path / "fitted.py"
    limits.write_text(code)
    assert read_limits(str(limits)) == {("pool",): 9 * MiB, ("pool", "model"): 9 * MiB}
    assert check(capsys, limits, trace)[0] == 0


@pytest.mark.parametrize("name, text, message", [
    ("a.py", "with gpu_budget(size, name='pool'): pass", "the limit is not written out"),
    ("b.py", "with gpu_budget('1MiB'): pass", "without a name="),
    ("c.py", "with open('x'): pass", "no 'with gpu_budget(..., name=...)' block"),
    ("d.py", "with gpu_budget('lots', name='pool'): pass", "the limit"),
    ("e.py", "def (:", "not Python"),
    ("f.toml", "[pool\n", "not valid TOML"),
    ("g.toml", "limit = 3\n", "every top-level key must be a [table]"),
    ("h.toml", "[pool]\nlimt = '1MiB'\n", "only 'limit' and tables"),
    ("i.toml", "[other]\nlimit = '1MiB'\n", "none of the budgets of"),
    ("j.py", b"\xff\xfe", "not UTF-8"),
])
def test_a_bad_limits_file_is_one_line_and_exit_2(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str], name: str,
        text: str | bytes, message: str) -> None:
    limits = tmp_path / name
    if isinstance(text, bytes):
        limits.write_bytes(text)
    else:
        limits.write_text(text)
    status, out, err = check(capsys, limits, trace)
    assert status == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_a_missing_limits_file_or_trace_is_exit_2(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(capsys, tmp_path / "nowhere.py", trace)[0] == EXIT_BAD_INPUT
    limits = tmp_path / "l.toml"
    limits.write_text('[pool]\nlimit = "16MiB"\n')
    status, _, err = check(capsys, limits, tmp_path / "nowhere.jsonl")
    assert status == EXIT_BAD_INPUT and "nowhere.jsonl" in err
