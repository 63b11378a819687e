"""docs/gate.md says what the gate does: its TOML and Python limits check the demo's run as
the page shows, and its marker errors are the plugin's."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpubudget.cli import main
from gpubudget.cli.gate import EXIT_OVER
from gpubudget.pytest_plugin import marker_options
from gpubudget.tracefile import writer_for

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "gate.md").read_text()


def _blocks(language: str) -> list[str]:
    """The page's fenced blocks of ``language`` (``""``: those that name none)."""
    found: list[str] = []
    fence: str | None = None  # the language of the block the line is in, if any
    lines: list[str] = []
    for line in PAGE.splitlines():
        if fence is None and line.startswith("```"):
            fence, lines = line[3:], []
        elif fence is not None and line == "```":
            if fence == language:
                found.append("\n".join(lines) + "\n")
            fence = None
        elif fence is not None:
            lines.append(line)
    return found


@pytest.fixture
def demo_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture[str]) -> Path:
    trace = tmp_path / "demo.jsonl"
    monkeypatch.setenv("GPUBUDGET_TRACE", str(trace))
    assert main(["demo", "--no-plot", "--backend", "host"]) == 0
    monkeypatch.delenv("GPUBUDGET_TRACE")
    writer_for(str(trace)).flush()
    capsys.readouterr()
    return trace


def test_the_demo_fits_its_limits_as_the_page_shows_with_its_denials_expected(
        tmp_path: Path, demo_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = _blocks("toml")[0]
    limits = tmp_path / "demo-limits.toml"
    limits.write_text(toml)
    assert main(["fit", "--check", str(limits), str(demo_trace)]) == 0
    (shown,) = [block.splitlines() for block in _blocks("") if "GPUBUDGET_TRACE" in block]
    printed = capsys.readouterr().out.replace(str(limits), "demo-limits.toml")
    assert printed.splitlines() == [line for line in shown[2:] if line]
    limits.write_text(toml.replace('denials = "expected"', ""))
    assert main(["fit", "--check", str(limits), str(demo_trace)]) == EXIT_OVER
    assert "shared/classifier was refused 1 request(s)" in capsys.readouterr().out


def test_the_python_limits_with_a_setting_in_a_comment_check_the_same(
        tmp_path: Path, demo_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (code,) = _blocks("python")[:1]
    limits = tmp_path / "limits.py"
    limits.write_text(code)
    assert main(["fit", "--check", str(limits), str(demo_trace)]) == 0
    assert "1 denial(s) expected" in capsys.readouterr().out


def test_the_marker_errors_shown_are_the_plugins() -> None:
    shown = [line.split(": ", 2)[2] for line in PAGE.splitlines() if line.startswith("ERROR: ")]
    asked = [(("2GiB",), {"peek": "1GiB"}), ((), {}), (("2GiB",), {"peak": "3GiB"})]
    found = []
    for args, kwargs in asked:
        with pytest.raises(ValueError) as caught:
            marker_options(args, kwargs, "test")
        found.append(str(caught.value))
    assert shown == found
