"""The command line: demo, report and fit, in-process (fast) and as subprocesses (real exit
statuses, closed pipes, standard input, mutated traces)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget.cli import output as cli_output
from gpubudget.cli import traces as cli_traces
from gpubudget.cli import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, Progress, main
from gpubudget.tracefile import writer_for

from tests.helpers import subprocess_env

MiB = 2**20
HEADER = {"format": "gpubudget-trace", "version": 1}


def record_abc(path: Path) -> Path:
    """One root and one child; the child is refused 9 MiB once (see test_replay)."""
    with gpu_budget("16MiB", name="pool", trace=str(path)):
        with gpu_budget("8MiB", name="model") as model:
            a, b = model.allocate(MiB, tag="a"), model.allocate(MiB, tag="b")
            assert a is not None and b is not None and model.free(a)
            c = model.allocate(2 * MiB, tag="c")
            assert model.allocate(9 * MiB) is None
            assert c is not None and model.free(b) and model.free(c)
    writer_for(path).flush()
    return path


def record_roots(path: Path, *names: str, blocks: int = 3) -> Path:
    for name in names:
        with gpu_budget("1MiB", name=name, trace=str(path)) as root:
            with gpu_budget("512KiB", name="model") as model:
                for k in range(blocks):
                    block = model.allocate(1000 * (k + 1), tag=f"t{k}")
                    assert block is not None and model.free(block)
            assert root.allocate(4096) is not None  # left live
    writer_for(path).flush()
    return path


def cli_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``main`` in this process: (status, stdout, stderr)."""
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def run_cli(*args: str, stdin: bytes | None = None, stdout: Any = subprocess.PIPE,
            env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m gpubudget`` as a subprocess."""
    environment = {**subprocess_env(), "GPUBUDGET_BACKEND": "host",
                   **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpubudget", *args], input=stdin,
                          stdout=stdout, stderr=subprocess.PIPE, env=environment, timeout=120,
                          cwd=cwd)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- help, version --------------------------------------------------------------------


def test_help_for_every_command_and_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    for args in ((), ("demo",), ("report",), ("fit",)):
        status, out, _ = cli_run(capsys, *args, "--help")
        assert status == 0 and out.startswith("usage: gpubudget")
    status, out, _ = cli_run(capsys, "--version")
    assert status == 0 and re.fullmatch(r"gpubudget \d+\.\d+\.\d+\n", out)


@pytest.mark.parametrize(("args", "message"), [
    (("frobnicate",), "invalid choice"),
    (("report",), "required"),
    (("fit",), "required"),
    (("report", "--max-size", "banana", "x"), "--max-size 'banana' is not a size"),
])
def test_usage_errors_are_one_line_and_status_2(capsys: pytest.CaptureFixture[str],
                                                args: tuple[str, ...], message: str) -> None:
    status, _, err = cli_run(capsys, *args)
    assert status == EXIT_BAD_INPUT and message in one_error_line(err)


# -- report ---------------------------------------------------------------------------


def test_report_prints_the_replayed_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record_abc(tmp_path / "abc.jsonl")
    status, out, err = cli_run(capsys, "report", str(path))
    assert status == 0 and err == ""
    assert out.startswith("pool [host] (released)") and "└─ model" in out
    assert "denied 1x, over the limit of 'model' (largest 9.00 MiB)" in out


def test_report_json_is_one_document_whatever_the_number_of_roots(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = record_abc(tmp_path / "abc.jsonl")
    status, out, _ = cli_run(capsys, "report", "--json", str(one))
    document = json.loads(out)
    assert status == 0 and document["trace"] == str(one) and document["cut_short"] is None
    assert [r["name"] for r in document["roots"]] == ["pool"]
    assert document["roots"][0]["children"][0]["name"] == "model"
    three = record_roots(tmp_path / "three.jsonl", "first", "second", "first")
    status, out, _ = cli_run(capsys, "report", "--json", str(three))
    assert [r["name"] for r in json.loads(out)["roots"]] == ["first", "second", "first"]


def test_root_picks_roots_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record_roots(tmp_path / "three.jsonl", "first", "second", "first")
    status, out, _ = cli_run(capsys, "report", "--json", "--root", "first", str(path))
    assert status == 0 and [r["name"] for r in json.loads(out)["roots"]] == ["first", "first"]
    status, out, _ = cli_run(capsys, "report", "--root", "second", str(path))
    assert status == 0 and out.startswith("second [host]") and "first" not in out
    status, out, _ = cli_run(capsys, "report", "--json", "--root", "first#2", str(path))
    (second_first,) = json.loads(out)["roots"]
    status, out, _ = cli_run(capsys, "report", "--json", str(path))
    assert second_first == json.loads(out)["roots"][2]
    status, _, err = cli_run(capsys, "report", "--root", "third", str(path))
    assert status == EXIT_BAD_INPUT
    assert "--root 'third': no root budget of that name" in one_error_line(err)
    assert "its roots: 'first', 'second', 'first'" in err
    status, _, err = cli_run(capsys, "report", "--root", "first#3", str(path))
    assert "there are 2 roots named 'first'" in one_error_line(err)


def test_plot_draws_one_root_and_says_which(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = record_roots(tmp_path / "three.jsonl", "first", "second", "first")
    svg = tmp_path / "out.svg"
    status, out, err = cli_run(capsys, "report", "--plot", str(svg), str(path))
    assert status == 0 and f"plot written to {svg}" in out
    assert "<svg" in svg.read_text() and "first" in svg.read_text()
    assert ("the trace has 3 root budgets ('first', 'second', 'first'); the plot shows the "
            "first, 'first'; pick another with --root NAME") in one_error_line(err)
    status, _, err = cli_run(capsys, "report", "--plot", str(svg), "--root", "second", str(path))
    assert status == 0 and err == "" and "second" in svg.read_text()
    status, _, err = cli_run(capsys, "report", "--plot", str(svg), "--root", "first", str(path))
    assert "2 root budgets are named 'first'; the plot shows the first; pick another with " \
           "--root 'first#2'" in one_error_line(err)
    pdf = tmp_path / "out.pdf"
    assert cli_run(capsys, "report", "--plot", str(pdf), "--root", "second", str(path))[0] == 0
    assert pdf.read_bytes().startswith(b"%PDF")


def test_plot_to_an_unknown_format_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = cli_run(capsys, "report", "--plot", "out.jpg", str(tmp_path / "missing"))
    assert status == EXIT_BAD_INPUT
    assert "cannot plot to 'out.jpg': the format follows the file's suffix, one of .png, " \
           ".svg, .pdf" in one_error_line(err)
    status, _, err = cli_run(capsys, "demo", "--plot", "demo.gif")
    assert status == EXIT_BAD_INPUT and "cannot plot to 'demo.gif'" in one_error_line(err)


def test_plot_into_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = record_abc(tmp_path / "abc.jsonl")
    status, _, err = cli_run(capsys, "report", "--plot", str(tmp_path / "no" / "x.png"), str(path))
    assert status == EXIT_BAD_INPUT and "No such file or directory" in one_error_line(err)


def test_names_and_tags_are_printed_without_terminal_escapes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evil = "\x1b]0;owned\x07\x1b[2J\nfake line\u202e"
    path = tmp_path / "evil.jsonl"
    with gpu_budget("1MiB", name=evil, trace=str(path)) as root:
        with gpu_budget("512KiB", name=evil + "child") as child:
            assert child.allocate(1000, tag=evil) is not None
            assert child.allocate(10 * MiB, tag=evil) is None
    assert root.state == "exited"
    writer_for(path).flush()
    for args in (("report", str(path)), ("fit", str(path)), ("report", "--root", evil, str(path)),
                 ("report", "--root", "x\x1b", str(path))):
        _, out, err = cli_run(capsys, *args)
        for text in (out, err):
            assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
        assert "\nfake line" not in out
    _, out, _ = cli_run(capsys, "report", str(path))
    assert "\\x1b]0;owned\\x07\\x1b[2J\\nfake line\\u202e" in out
    _, out, _ = cli_run(capsys, "report", "--json", str(path))
    assert json.loads(out)["roots"][0]["name"] == evil  # JSON keeps the name, escaped


def test_a_trace_cut_short_is_reported_with_a_warning(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = record_abc(tmp_path / "abc.jsonl")
    text = path.read_text()
    path.write_text(text[: text.index('"ev": "exit"') - 1] + '{"ev": "fr')
    status, out, err = cli_run(capsys, "report", str(path))
    assert status == 0 and "pool [host] (open)" in out
    assert re.fullmatch(r"gpubudget: warning: .*abc.jsonl:\d+: the last line is cut short "
                        r"\(the writing process was killed\?\); skipped\n", err)


def test_fit_says_a_trace_is_cut_short_as_report_does(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    whole = record_abc(tmp_path / "whole.jsonl")
    cut = tmp_path / "cut.jsonl"
    text = whole.read_text()
    cut.write_text(text[: text.index('"ev": "exit"') - 1] + '{"ev": "fr')
    status, out, err = cli_run(capsys, "fit", str(whole), str(cut))
    assert status == 0 and out.count("1 root, 2 budgets") == 2
    assert re.fullmatch(r"gpubudget: warning: .*cut.jsonl:\d+: the last line is cut short "
                        r"\(the writing process was killed\?\); skipped\n", err)


def test_allocations_after_a_release_are_said(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "late.jsonl"
    events = [HEADER,
              {"ev": "enter", "t": 0.0, "b": 1, "name": "pool", "parent": None, "limit": MiB,
               "align": 256, "reserve": 0},
              {"ev": "exit", "t": 0.5, "b": 1},
              {"ev": "alloc", "t": 1.0, "b": 1, "size": 10, "align": 0, "ptr": 4096}]
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    status, _, err = cli_run(capsys, "report", str(path))
    assert status == 0 and "1 allocation(s) came after their budget was released in this " \
        "replay" in one_error_line(err)


def test_a_trace_with_no_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(HEADER) + "\n")
    status, _, err = cli_run(capsys, "report", str(path))
    assert status == EXIT_BAD_INPUT and "t.jsonl: the trace holds no budget" in one_error_line(err)
    status, _, err = cli_run(capsys, "fit", str(path))
    assert status == EXIT_BAD_INPUT and "the trace holds no budget" in one_error_line(err)


def test_max_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record_abc(tmp_path / "abc.jsonl")
    status, _, err = cli_run(capsys, "report", "--max-size", "1KiB", str(path))
    assert status == EXIT_BAD_INPUT and "over the limit of 1.00 KiB" in one_error_line(err)
    assert cli_run(capsys, "fit", "--max-size", "1MiB", str(path))[0] == 0


def file_with(name: str, data: bytes) -> Callable[[Path], str]:
    def make(folder: Path) -> str:
        (folder / name).write_bytes(data)
        return str(folder / name)
    return make


def fifo(folder: Path) -> str:
    os.mkfifo(folder / "fifo")  # reading it would wait for a writer
    return str(folder / "fifo")


HEADER_LINE = (json.dumps(HEADER) + "\n").encode()
BAD_INPUTS: list[tuple[str, Callable[[Path], str], str]] = [
    ("missing", lambda d: str(d / "nope.jsonl"), "nope.jsonl: no such file"),
    ("directory", str, "is a directory, not a trace file"),
    ("fifo", fifo, "not a regular file (a FIFO)"),
    ("/dev/zero", lambda d: "/dev/zero", "/dev/zero: not a regular file (a character device)"),
    ("empty", file_with("e", b""), "the file is empty"),
    ("blank lines", file_with("b", b"\n \n"), "holds only blank lines"),
    ("binary", file_with("j", bytes(range(256)) * 16), "j:1: not a gpubudget trace"),
    ("1e400", file_with("i", HEADER_LINE + b'{"ev": "enter", "t": 1e400}\n'),
     "i:2: enter event: 't' must be a finite number"),
    ("deep", file_with("d", HEADER_LINE + b"[" * 50_000 + b"\n"), "d:2: JSON nested too deeply"),
]


@pytest.mark.parametrize(("what", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("command", ["report", "fit"])
def test_bad_input_is_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            command: str, what: str,
                                            make: Callable[[Path], str], message: str) -> None:
    if command == "fit" and what == "directory":
        message = "a directory with no .jsonl trace in it"  # fit reads a directory's traces
    status, out, err = cli_run(capsys, command, make(tmp_path))
    assert status == EXIT_BAD_INPUT and out == ""
    assert one_error_line(err).startswith("gpubudget: error: ") and message in err


def test_an_internal_error_is_one_line_unless_debugging(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = record_abc(tmp_path / "abc.jsonl")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug\nsecond line")

    monkeypatch.setattr(cli_traces, "replay", broken)
    status, _, err = cli_run(capsys, "report", str(path))
    assert status == EXIT_BAD_INPUT
    assert one_error_line(err) == ("gpubudget: internal error: RuntimeError: bug\\nsecond line "
                                   "(set GPUBUDGET_DEBUG=1 to see the traceback, and please "
                                   "report it)")
    monkeypatch.setenv("GPUBUDGET_DEBUG", "1")
    with pytest.raises(RuntimeError, match="bug"):
        main(["report", str(path)])


def test_ctrl_c_ends_with_status_130(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_traces, "fit", interrupted)
    status, _, err = cli_run(capsys, "fit", str(tmp_path))
    assert status == EXIT_INTERRUPTED or "no .jsonl" in err
    record_abc(tmp_path / "abc.jsonl")
    status, _, err = cli_run(capsys, "fit", str(tmp_path))
    assert status == EXIT_INTERRUPTED and one_error_line(err) == "gpubudget: interrupted"


# -- fit ------------------------------------------------------------------------------


def code_of(out: str) -> str:
    """The pasteable part of fit's output."""
    return out[out.index("# Smallest limits"):]


def test_fit_prints_a_table_and_nested_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record_abc(tmp_path / "abc.jsonl")
    status, out, err = cli_run(capsys, "fit", str(path))
    assert status == 0 and err == ""
    table = out.splitlines()[2:5]
    assert re.split(r"\s{2,}", table[0]) == ["budget", "recorded", "peak", "denied", "fits in"]
    assert re.split(r"\s{2,}", table[1]) == ["pool", "16.00 MiB", "3.00 MiB", "-", "13.00 MiB"]
    assert re.split(r"\s{2,}", table[2]) == ["└─ model", "8.00 MiB", "3.00 MiB", "9.00 MiB",
                                             "12.00 MiB"]
    assert code_of(out).splitlines()[1:] == [
        "with gpu_budget(\"13MiB\", align=256, name='pool'):",
        "    with gpu_budget(\"12MiB\", align=256, name='model'):",
        "        ...",
    ]


def test_the_code_fit_prints_runs_and_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tree.jsonl"
    with gpu_budget("64MiB", name="server", align=512, trace=str(path)):
        with gpu_budget("16MiB", name="det", reserve="3MiB") as det:
            block = det.allocate(5 * MiB + 3)
            assert block is not None and det.free(block)
        with gpu_budget("16MiB", name="cls") as cls:
            with gpu_budget("8MiB", name="head") as head:
                assert head.allocate(MiB) is not None
            assert cls.allocate(100) is not None
    writer_for(path).flush()
    status, out, _ = cli_run(capsys, "fit", str(path))
    code = code_of(out)
    assert "reserve=\"3MiB\"" in code and "align=512" in code
    assert [line.index("with") for line in code.splitlines() if "with gpu_budget" in line] == [
        0, 4, 4, 8]
    namespace: dict[str, Any] = {"gpu_budget": gpu_budget}
    exec(compile(code, "<fit>", "exec"), namespace)  # the pasted code runs as it is


def test_fit_groups_roots_of_the_same_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.jsonl"
    for blocks in (1, 5, 3):
        record_roots(path, "request", blocks=blocks)
    status, out, _ = cli_run(capsys, "fit", str(path))
    assert status == 0 and "3 roots, 6 budgets" in out
    assert "request (×3)" in out and "└─ model (×3)" in out
    assert "name='request'):  # the largest of 3" in out or "the largest of 3" in code_of(out)


def test_fit_of_several_traces_and_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "replicas"
    folder.mkdir()
    record_abc(folder / "a.jsonl")
    record_roots(folder / "b.jsonl", "pool")
    (folder / "c.jsonl").write_text("{oops\n")
    (folder / "notes.txt").write_text("not a trace")
    status, out, err = cli_run(capsys, "fit", str(folder))
    assert status == EXIT_BAD_INPUT
    assert f"{folder / 'a.jsonl'}: 1 root, 2 budgets" in out and f"{folder / 'b.jsonl'}: 1 root" in out
    assert "c.jsonl:1: not a gpubudget trace" in one_error_line(err) and "notes" not in err
    assert "# Smallest limits under which all 2 traces replay without a denial (1 more could " \
           "not be read: see above):" in out
    assert "with gpu_budget(\"13MiB\", align=256, name='pool'):" in out  # the larger of the two
    status, out, _ = cli_run(capsys, "fit", str(folder / "a.jsonl"), str(folder / "b.jsonl"))
    assert status == 0 and out.count("budget ") == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    status, _, err = cli_run(capsys, "fit", str(empty))
    assert status == EXIT_BAD_INPUT and "a directory with no .jsonl trace in it" in one_error_line(err)


# -- demo -----------------------------------------------------------------------------


def test_demo_backend_flag_and_environment_agree(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    status, by_flag, _ = cli_run(capsys, "demo", "--backend", "host", "--no-plot")
    assert status == 0 and "gpubudget demo on host memory (--backend host;" in by_flag
    monkeypatch.setenv("GPUBUDGET_BACKEND", "host")
    status, by_env, _ = cli_run(capsys, "demo", "--no-plot")
    assert status == 0 and "gpubudget demo on host memory (GPUBUDGET_BACKEND=host;" in by_env
    summary = [line for line in by_flag.splitlines() if line.startswith(("pool:", "classifier asks"))]
    assert summary == [line for line in by_env.splitlines()
                       if line.startswith(("pool:", "classifier asks"))] and len(summary) == 3
    monkeypatch.setenv("GPUBUDGET_BACKEND", "pycuda")
    if not importlib.util.find_spec("pycuda"):
        status, _, by_env_err = cli_run(capsys, "demo", "--no-plot")
        monkeypatch.delenv("GPUBUDGET_BACKEND")
        status_flag, _, by_flag_err = cli_run(capsys, "demo", "--backend", "pycuda", "--no-plot")
        assert status == status_flag == EXIT_BAD_INPUT
        assert one_error_line(by_env_err) == one_error_line(by_flag_err)
        assert "the 'pycuda' backend is not usable here" in by_env_err
    monkeypatch.setenv("GPUBUDGET_BACKEND", "bogus")
    status, _, err = cli_run(capsys, "demo", "--no-plot")
    assert status == EXIT_BAD_INPUT
    assert "environment variable GPUBUDGET_BACKEND 'bogus' is unknown" in one_error_line(err)


def test_demo_writes_the_plot_in_the_format_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "demo.svg"
    status, out, _ = cli_run(capsys, "demo", "--backend", "host", "--plot", str(plot))
    assert status == 0 and "├─ detector" in out and "over the limit of 'classifier'" in out
    assert "<svg" in plot.read_text() and "classifier" in plot.read_text()


# -- progress -------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_after_its_delay_and_clears() -> None:
    now = [0.0]
    stream = Terminal()
    progress = Progress(stream, delay=1.0, interval=0.25, clock=lambda: now[0])
    progress("early")
    assert stream.getvalue() == ""
    now[0] = 1.0
    progress("reading 1")
    progress("too soon")
    now[0] = 1.3
    progress("reading 22\x1b")
    progress.clear()
    shown = "reading 22\\x1b"
    assert stream.getvalue() == "\rreading 1" + "\r" + shown + "\r" + " " * len(shown) + "\r"
    quiet = io.StringIO()
    Progress(quiet, delay=0.0)("anything")
    assert quiet.getvalue() == ""


def test_report_and_fit_show_progress_on_a_terminal_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = record_roots(tmp_path / "many.jsonl", *["request"] * 2000)  # 20,000+ lines
    monkeypatch.setattr(cli_output, "PROGRESS_DELAY", 0.0)
    status, _, err = cli_run(capsys, "report", str(path))
    assert status == 0 and err == ""  # captured stderr is no terminal
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["report", str(path)]) == 0
    assert "\rreplaying " in terminal.getvalue() and "lines" in terminal.getvalue()
    assert terminal.getvalue().endswith("\r")  # cleared before the report was printed
    terminal.seek(0)
    terminal.truncate()
    assert main(["fit", str(path)]) == 0
    assert "fitting root " in terminal.getvalue()


# -- as a real process: pipes, standard input, mutated traces -------------------------


def test_standard_input(tmp_path: Path) -> None:
    data = record_abc(tmp_path / "abc.jsonl").read_bytes()
    result = run_cli("report", "-", stdin=data)
    assert result.returncode == 0 and result.stdout.startswith(b"pool [host]")
    result = run_cli("fit", "-", stdin=data)
    assert result.returncode == 0 and b"-: 1 root, 2 budgets" in result.stdout
    result = run_cli("report", "-", stdin=b"")
    assert result.returncode == 2 and result.stderr == b"gpubudget: error: -: the file is empty\n"


def endless(first: bytes, line: bytes) -> subprocess.Popen[bytes]:
    """A process that writes ``first``, then ``line`` for ever, into a pipe."""
    script = ("import sys; out = sys.stdout.buffer; out.write(bytes.fromhex(sys.argv[1]))\n"
              "line = bytes.fromhex(sys.argv[2])\n"
              "try:\n    while True: out.write(line)\nexcept OSError: pass")
    return subprocess.Popen([sys.executable, "-c", script, first.hex(), line.hex()],
                            stdout=subprocess.PIPE)


@pytest.mark.parametrize(("first", "line", "args", "message"), [
    (HEADER_LINE, b'{"ev": "enter", "t": 0.0, "b": 1, "name": "p", "parent": null, '
                  b'"limit": 1024, "align": 256, "reserve": 0}\n',
     ("--max-size", "64KiB"), "budget id 1 was already entered"),
    (HEADER_LINE, b"\n", ("--max-size", "64KiB"), "the trace passes the limit of 64.00 KiB"),
    (b"", b"\x00" * 4096, (), "-:1: not a gpubudget trace: line longer than 1.00 MiB"),
])
def test_an_endless_stream_stops_at_a_limit(first: bytes, line: bytes, args: tuple[str, ...],
                                             message: str) -> None:
    source = endless(first, line)
    try:
        environment = subprocess_env()
        result = subprocess.run([sys.executable, "-m", "gpubudget", "report", *args, "-"],
                                stdin=source.stdout, capture_output=True, timeout=120,
                                env=environment)
    finally:
        assert source.stdout is not None
        source.stdout.close()
        source.kill()
        source.wait()
    assert result.returncode == EXIT_BAD_INPUT
    assert message in one_error_line(result.stderr.decode())


@pytest.mark.parametrize("args", [
    ("--help",), ("--version",), ("demo", "--no-plot"), ("report", "{trace}"),
    ("report", "--json", "{trace}"), ("fit", "{trace}"),
])
def test_output_closed_early_ends_quietly(tmp_path: Path, args: tuple[str, ...]) -> None:
    trace = record_roots(tmp_path / "t.jsonl", *["request"] * 40)
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: the first write fails with EPIPE
    try:
        result = run_cli(*(a.format(trace=trace) for a in args), stdout=write_end)
    finally:
        os.close(write_end)
    assert result.stderr == b""
    # argparse itself drops a failed write of --help or --version: then the status is 0
    assert result.returncode == (0 if args[0].startswith("--") else EXIT_BROKEN_PIPE)


def test_piped_into_head(tmp_path: Path) -> None:
    trace = record_roots(tmp_path / "t.jsonl", *["request"] * 300)
    script = f"set -o pipefail; {sys.executable} -m gpubudget report {trace} | head -n 2"
    result = subprocess.run(["bash", "-c", script], capture_output=True, timeout=120,
                            env=subprocess_env())
    assert result.stdout.decode().startswith("request [host]") and result.stderr == b""
    assert result.returncode in (0, EXIT_BROKEN_PIPE)


def mutate(lines: list[bytes], rng: random.Random) -> list[bytes]:
    """One to three random mutations: lines dropped, repeated, swapped, cut, a byte
    changed, a field changed to another JSON value or removed."""
    lines = list(lines)
    values: list[Any] = [None, True, -1, 0, 1.5, 1e308, 2**64, "x", [], {"a": 1}, "\x1b[2J"]
    for _ in range(rng.randint(1, 3)):
        index = rng.randrange(len(lines))
        kind = rng.choice(["drop", "repeat", "swap", "cut", "byte", "field", "field", "remove"])
        if kind == "drop" and len(lines) > 1:
            del lines[index]
        elif kind == "repeat":
            lines.insert(index, lines[index])
        elif kind == "swap":
            other = rng.randrange(len(lines))
            lines[index], lines[other] = lines[other], lines[index]
        elif kind == "cut":
            lines[index] = lines[index][: rng.randrange(len(lines[index]) + 1)]
        elif kind == "byte" and lines[index]:
            at = rng.randrange(len(lines[index]))
            lines[index] = lines[index][:at] + bytes([rng.randrange(256)]) + lines[index][at + 1:]
        elif kind in ("field", "remove"):
            record = json.loads(lines[index])
            key = rng.choice(sorted(record))
            if kind == "remove":
                del record[key]
            else:
                record[key] = rng.choice(values)
            lines[index] = json.dumps(record).encode()
    return [line.replace(b"\n", b" ") for line in lines]


def test_cli_on_mutated_traces(tmp_path: Path) -> None:
    source = record_abc(tmp_path / "abc.jsonl").read_bytes().splitlines()
    rng = random.Random(9)
    files = []
    for index in range(60):
        path = tmp_path / f"m{index:02}.jsonl"
        path.write_bytes(b"\n".join(mutate(source, rng)) + b"\n")
        files.append(path)
    result = run_cli("fit", *map(str, files))
    errors = [line for line in result.stderr.decode(errors="replace").splitlines()
              if not line.startswith(cli_output.PROGRESS_LOG_PREFIX)]  # a slow machine's
    assert result.returncode in (0, EXIT_BAD_INPUT) and b"Traceback" not in result.stderr
    assert all(re.match(r"gpubudget: (error|warning): .*m\d\d\.jsonl", line) for line in errors), errors
    fitted = len(re.findall(rb"m\d\d\.jsonl: \d+ roots?, ", result.stdout))
    failed = sum(1 for line in errors if line.startswith("gpubudget: error"))
    assert fitted + failed == len(files) and failed > 10 and fitted > 3
    for path in files[:8]:
        single = run_cli("report", "--json", str(path))
        assert single.returncode in (0, EXIT_BAD_INPUT) and b"Traceback" not in single.stderr
        if single.returncode == 0:
            assert json.loads(single.stdout)["roots"]
        else:
            assert len(single.stderr.splitlines()) == 1


def test_the_module_runs_as_a_script() -> None:
    script = textwrap.dedent("""
        import runpy, sys
        sys.argv = ["gpubudget", "--version"]
        runpy.run_module("gpubudget", run_name="__main__")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60,
                            env=subprocess_env())
    assert result.returncode == 0 and result.stdout.startswith(b"gpubudget ")


def test_a_warning_of_the_library_names_gpubudget_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The library's warnings begin with 'gpubudget: ' (a ledger it cannot use, no GPU):
    the command line prints 'gpubudget: warning: ...', not 'gpubudget: warning: gpubudget:'
    (what it printed before)."""
    cli_output.show_warning(RuntimeWarning("gpubudget: root budgets are not registered"),
                            RuntimeWarning, "x.py", 1)
    cli_output.show_warning(UserWarning("something else"), UserWarning, "x.py", 1)
    assert capsys.readouterr().err.splitlines() == [
        "gpubudget: warning: root budgets are not registered",
        "gpubudget: warning: something else"]


def test_the_demo_speaks_in_one_kind_of_unit(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = cli_run(capsys, "demo", "--backend", "host", "--no-plot")
    assert status == 0 and "4.00 GiB" in out
    assert re.findall(r"\d ?(?:KB|MB|GB|TB)\b", out) == []  # GiB throughout, never GB beside it


def test_progress_in_a_log_is_a_line_now_and_then() -> None:
    now = [0.0]
    log = io.StringIO()  # no terminal: a CI log
    progress = Progress(log, clock=lambda: now[0], log=True)
    progress("fitting root a")
    now[0] = cli_output.PROGRESS_LOG_DELAY - 0.5
    progress("still too early")
    assert log.getvalue() == ""
    now[0] = cli_output.PROGRESS_LOG_DELAY
    progress("fitting root b\x1b")
    for step in range(1, 100):  # calls as often as a fit makes them
        now[0] = cli_output.PROGRESS_LOG_DELAY + step * cli_output.PROGRESS_LOG_INTERVAL / 50
        progress(f"fitting root c{step}")
    progress.clear()  # nothing to erase in a log
    assert log.getvalue().splitlines() == ["gpubudget: progress: fitting root b\\x1b",
                                           "gpubudget: progress: fitting root c50"]
    terminal = Terminal()
    Progress(terminal, delay=0.0, log=True)("on a terminal")  # in place, as without log
    assert terminal.getvalue() == "\ron a terminal"
    said = (Path(__file__).resolve().parent.parent / "docs" / "traces.md").read_text()
    assert f"after {cli_output.PROGRESS_LOG_DELAY:g} seconds and then at most one every " \
           f"{cli_output.PROGRESS_LOG_INTERVAL:g}\nseconds" in said


def test_fit_tells_a_log_it_is_running(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = record_roots(tmp_path / "many.jsonl", *["request"] * 200)
    monkeypatch.setattr(cli_output, "PROGRESS_LOG_DELAY", 0.0)
    status, out, err = cli_run(capsys, "fit", str(path))
    assert status == 0 and "Smallest limits" in out
    lines = err.splitlines()
    assert lines and all(line.startswith("gpubudget: progress: ") for line in lines)
    assert "fitting root " in lines[0] or "lines" in lines[0]
