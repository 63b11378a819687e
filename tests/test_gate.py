"""gpubudget fit --check: exit 1 with a table when a run needs more than the limits, 0 when it
fits, 2 with one line for a bad limits file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpubudget import gpu_budget
from gpubudget.cli import EXIT_BAD_INPUT, main
from gpubudget.cli.gate import EXIT_OVER
from gpubudget.cli.limits import read_limits
from gpubudget.tracefile import writer_for
from tests.helpers import subprocess_env

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
    assert read_limits(str(limits)).limits == {("pool",): 9 * MiB, ("pool", "model"): 9 * MiB}
    assert check(capsys, limits, trace)[0] == 0


@pytest.mark.parametrize("name, text, message", [
    ("a.py", "with gpu_budget(size, name='pool'): pass", "the limit is not written out"),
    ("b.py", "with gpu_budget('1MiB'): pass", "without a name="),
    ("c.py", "with open('x'): pass", "no 'with gpu_budget(..., name=...)' block"),
    ("d.py", "with gpu_budget('lots', name='pool'): pass", "the limit"),
    ("e.py", "def (:", "not Python"),
    ("f.toml", "[pool\n", "not valid TOML"),
    ("g.toml", "limit = 3\n", "every top-level key must be a [table]"),
    ("h.toml", "[pool]\nlimt = '1MiB'\n", "has 'limt' (did you mean 'limit'?)"),
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


# -- a gate that cannot pass by mistake -----------------------------------------------------


def toml(tmp_path: Path, text: str, name: str = "limits.toml") -> Path:
    limits = tmp_path / name
    limits.write_text(textwrap.dedent(text))
    return limits


def test_a_misspelt_budget_fails_and_names_the_budget_of_the_run_it_resembles(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    limits = toml(tmp_path, """
        [pool]
        limit = "16MiB"

        [pool.modle]
        limit = "9MiB"
    """)
    status, out, err = check(capsys, limits, trace)
    assert status == EXIT_OVER and err == ""
    lines = out.splitlines()
    assert lines[0] == (f"gpubudget fit --check: 1 budget(s) of {limits} not in the run; 1 "
                        f"budget(s) of the run without a limit in {limits}")
    assert "- pool/modle (misspelt? the run has pool/model)" in lines
    assert '- pool/model: needs 9.00 MiB, limit = "9MiB"' in lines


def test_a_budget_of_the_run_without_a_limit_fails_unless_said_unchecked(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    only_root = toml(tmp_path, '[pool]\nlimit = "16MiB"\n')
    status, out, _ = check(capsys, only_root, trace)
    assert status == EXIT_OVER
    assert out.splitlines()[0].endswith("1 budget(s) of the run without a limit in "
                                        f"{only_root}")
    unchecked = toml(tmp_path, '[pool]\nlimit = "16MiB"\nunlisted = "unchecked"\n')
    status, out, _ = check(capsys, unchecked, trace)
    assert status == 0 and f"not in {unchecked} (not checked): pool/model" in out
    assert main(["fit", "--check", str(only_root), "--allow", "unlisted", str(trace)]) == 0
    assert "(not checked): pool/model" in capsys.readouterr().out
    # a table with no limit of its own stands for its budget: unchecked only when said so
    bare = toml(tmp_path, '[pool.model]\nlimit = "9MiB"\n')
    status, out, _ = check(capsys, bare, trace)
    assert status == EXIT_OVER and '- pool: needs 9.00 MiB, limit = "9MiB"' in out
    bare = toml(tmp_path, '[pool]\nunlisted = "unchecked"\n[pool.model]\nlimit = "9MiB"\n')
    assert check(capsys, bare, trace)[0] == 0


def test_a_budget_that_a_run_may_lack_says_so(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = '[pool]\nlimit = "16MiB"\n[pool.model]\nlimit = "9MiB"\n[pool.other]\nlimit = "1MiB"\n'
    strict = toml(tmp_path, text)
    status, out, _ = check(capsys, strict, trace)
    assert status == EXIT_OVER and "- pool/other" in out.splitlines()
    assert main(["fit", "--check", str(strict), "--allow", "absent", str(trace)]) == 0
    assert "but not in the run (absent allowed): pool/other" in capsys.readouterr().out
    relaxed = toml(tmp_path, text + 'absent = "ok"\n')
    status, out, _ = check(capsys, relaxed, trace)
    assert status == 0 and "(absent allowed): pool/other" in out
    # a missing subtree is named once, by its outermost budget
    deep = toml(tmp_path, text.replace("[pool.other]", "[pool.other.inner]"))
    status, out, _ = check(capsys, deep, trace)
    assert status == EXIT_OVER and "- pool/other" in out.splitlines()
    assert "pool/other/inner" not in out


def test_roots_the_file_does_not_name_are_listed_not_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "two.jsonl"
    with gpu_budget("4MiB", name="pool", trace=str(path)) as pool:
        assert pool.allocate(MiB) is not None
    with gpu_budget("4MiB", name="library", trace=str(path)):
        with gpu_budget("1MiB", name="scratch") as scratch:
            assert scratch.allocate(MiB) is not None
    writer_for(path).flush()
    status, out, _ = check(capsys, toml(tmp_path, '[pool]\nlimit = "4MiB"\n'), path)
    assert status == 0
    assert out.splitlines()[-1].endswith("(not checked): library, library/scratch")


def test_expected_denials_leave_the_refused_requests_out_of_the_fit(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The model was refused 6 MiB over its 8 MiB; it was granted 3 MiB. With its denials
    # expected, neither it nor the pool above it must fit the refused request.
    text = '[pool]\nlimit = "4MiB"\n[pool.model]\nlimit = "8MiB"\n'
    strict = toml(tmp_path, text)
    status, out, _ = check(capsys, strict, trace)
    assert status == EXIT_OVER
    assert ("  (pool/model was refused 1 request(s) in the run: if the program handles "
            "them, say denials = \"expected\" in its table, and it need only fit what it was "
            "granted)") in out.splitlines()
    expected = toml(tmp_path, text + 'denials = "expected"\n')
    status, out, _ = check(capsys, expected, trace)
    assert status == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:4]}
    assert rows["pool"][1:5] == ["4.00", "MiB", "3.00", "MiB"]
    assert rows["pool/model"][3:] == ["3.00", "MiB", "ok", "(1", "denial(s)", "expected,",
                                      "left", "out)"]
    assert main(["fit", "--check", str(strict), "--allow", "denials", str(trace)]) == 0
    capsys.readouterr()
    # expected denials do not excuse a limit below what the run was granted
    tight = toml(tmp_path, text.replace('"8MiB"', '"2MiB"') + 'denials = "expected"\n')
    status, out, _ = check(capsys, tight, trace)
    assert status == EXIT_OVER and '  pool/model: "2MiB" -> "3MiB"' in out.splitlines()


def test_settings_in_a_python_limits_file_are_comments_on_the_budget_line(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    limits = tmp_path / "limits.py"
    limits.write_text(textwrap.dedent("""
        from gpubudget import gpu_budget

        with gpu_budget("4MiB", name="pool"):
            with gpu_budget("8MiB",  # gpubudget: denials=expected
                            name="model"):
                with gpu_budget("1MiB", name="gone"):  # gpubudget: absent=ok
                    pass
    """))
    assert read_limits(str(limits)).settings(("pool", "model")).denials
    status, out, _ = check(capsys, limits, trace)
    assert status == 0 and "(absent allowed): pool/model/gone" in out


@pytest.mark.parametrize("name, text, message", [
    ("a.toml", '[pool]\nlimit = "1MiB"\ndenials = "sometimes"\n',
     "denials must be 'expected' or 'fail', not 'sometimes'"),
    ("b.toml", '[pool]\nlimit = "1MiB"\nabsent = true\n', "absent must be 'ok' or 'fail'"),
    ("c.py", "with gpu_budget('1MiB', name='pool'):  # gpubudget: denial=expected\n  pass\n",
     "unknown setting 'denial'"),
    ("d.py", "# gpubudget: absent=ok\nwith gpu_budget('1MiB', name='pool'): pass\n",
     "belongs on the line of a gpu_budget(...) call"),
    ("e.py", "with gpu_budget('1MiB', name='a'), gpu_budget('1MiB', name='b'):  "
     "# gpubudget: absent=ok\n  pass\n", "several gpu_budget(...) calls"),
    ("f.py", "with gpu_budget('1MiB', name='pool'):  # gpubudget: expected\n  pass\n",
     "is not key=value"),
])
def test_a_bad_setting_is_one_line_and_exit_2(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str], name: str,
        text: str, message: str) -> None:
    limits = tmp_path / name
    limits.write_text(text)
    status, out, err = check(capsys, limits, trace)
    assert status == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and message in err, err


def test_allow_goes_with_check_and_takes_known_words(
        trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--allow", "absent", str(trace)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == "gpubudget: error: --allow goes with --check LIMITS\n"
    assert main(["fit", "--check", "x.toml", "--allow", "everything", str(trace)]) == \
        EXIT_BAD_INPUT
    assert "argument --allow: invalid choice: 'everything'" in capsys.readouterr().err


# -- runs that did not end, limits given twice, hostile limits files ------------------------


def test_a_run_killed_midway_is_refused_not_passed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "killed.jsonl"
    program = textwrap.dedent(f"""
        import os, signal
        from gpubudget import gpu_budget
        from gpubudget.tracefile import writer_for
        pool = gpu_budget("16MiB", name="pool", backend="host", trace={str(path)!r})
        pool.__enter__()
        pool.allocate(MiB := 1 << 20)
        writer_for({str(path)!r}).flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", program], env=subprocess_env(), timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    limits = toml(tmp_path, '[pool]\nlimit = "16MiB"\n')
    assert main(["report", str(path)]) == 0 and "(open)" in capsys.readouterr().out
    status, out, err = check(capsys, limits, path)
    assert status == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and "the run did not end" in err and "'pool' never exited" in err


def test_a_trace_whose_last_line_is_cut_is_refused(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    limits = toml(tmp_path, '[pool]\nlimit = "16MiB"\n[pool.model]\nlimit = "9MiB"\n')
    assert check(capsys, limits, trace)[0] == 0  # whole, it fits
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(trace.read_bytes()[:-10])  # the root's exit, cut short
    status, out, err = check(capsys, limits, cut)
    assert status == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and "last line is cut short: the run did not end" in err


def test_a_budget_given_two_limits_is_one_line_and_exit_2(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    limits = tmp_path / "twice.py"
    limits.write_text(textwrap.dedent("""
        with gpu_budget("16MiB", name="pool"):
            with gpu_budget("9MiB", name="model"):
                ...
        with gpu_budget("16MiB", name="pool"):
            with gpu_budget("1MiB", name="model"):
                ...
    """))
    status, out, err = check(capsys, limits, trace)
    assert status == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and "twice.py:5: a second limit for budget 'pool'" in err


HOSTILE = [
    ("digits.toml", "[pool]\nlimit = " + "9" * 5000 + "\n", "a value that cannot be read"),
    ("expression.py", "with gpu_budget(" + "1+" * 50_000 + "1, name='pool'): pass\n",
     "nested too deeply"),
    ("nested.toml", "[pool]\nx = " + "[" * 20_000 + "]" * 20_000 + "\n", "nested too deeply"),
    ("inline.toml", "[pool]\nx = " + "{a=" * 5_000 + "1" + "}" * 5_000 + "\n",
     "nested too deeply"),
    ("dotted.toml", "[pool]\nlimit = '16MiB'\n" + ".".join(["a"] * 40_000) + " = 1\n",
     "dotted.toml:3: a key of 40,000 dotted names"),
    ("header.toml", "[" + ".".join(["a"] * 40_000) + "]\n", "a key of 40,000 dotted names"),
    ("keys.toml", "".join(f"[{'.'.join(['p'] * 100)}{i}]\n" for i in range(600)),
     "more than 50,000 key names"),
    ("huge.toml", "[pool]\nlimit = '" + "9" * 400 + "GiB'\n", "is too large: more than 16 EiB"),
    ("huge.py", "with gpu_budget('" + "9" * 400 + "GiB', name='pool'): pass\n",
     "is too large: more than 16 EiB"),
]


@pytest.mark.parametrize("name, text, message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_limits_files_are_one_line_naming_the_file(
        tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str], name: str,
        text: str, message: str) -> None:
    limits = tmp_path / name
    limits.write_text(text)
    status, out, err = check(capsys, limits, trace)
    assert status == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and err.startswith(f"gpubudget: error: {limits}")
    assert message in err and len(err) < 400, err


@pytest.mark.parametrize("name", ["pipe.toml", "pipe.py"])
def test_a_fifo_as_the_limits_file_is_refused_without_waiting(
        tmp_path: Path, trace: Path, name: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)  # nobody will ever write into it: opening it to read would wait forever
    done = subprocess.run([sys.executable, "-m", "gpubudget", "fit", "--check", str(fifo),
                           str(trace)], env=subprocess_env(), timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == EXIT_BAD_INPUT and done.stdout == ""
    assert done.stderr == f"gpubudget: error: {fifo}: not a regular file (a pipe or a " \
                          f"device); a limits file is read from a file\n"
