"""Names chosen by other code reach no terminal raw: every command that prints them escapes
them as the trace commands do (``gpubudget.tracefile.printable``), checked on the bytes
written."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
import pytest

from gpubudget import gpu_budget, label
from gpubudget.ray import ActorEntry, ActorInfo, ClusterReport, FlatReport, ray_command
from gpubudget.units import GiB
from tests.helpers import subprocess_env

HOSTILE = "model\x1b]0;PWNED\x07\x1b[2J\u202e"
"""A name that sets a terminal's title, clears its screen and reverses the text after it."""
RAW = (b"\x1b", b"\x07", "\u202e".encode())


def _raw_bytes(data: bytes) -> int:
    return sum(data.count(raw) for raw in RAW)


def _hostile_report() -> FlatReport:
    with gpu_budget("1MiB", name=HOSTILE, backend="host") as root:
        with label(HOSTILE):
            block = root.allocate(1000)
            assert block is not None
            root.allocate(10 ** 7)  # denied: the refusing budget is named too
        with gpu_budget("64KiB", name=HOSTILE + "-child") as child:
            child.allocate(100_000)
        report = FlatReport.of(root.report())
        root.free(block)
    return report


def _cluster() -> ClusterReport:
    info = ActorInfo(
        actor_id="a" * 32, class_name="Model", actor_name=HOSTILE, application=HOSTILE,
        deployment=HOSTILE, replica=HOSTILE, node_id="n" * 56, node_ip=HOSTILE, gpu_id=HOSTILE,
        ordinal=0, share=0.5, device_memory=8 * GiB, simulated=False, limit=GiB, pid=1,
        trace=HOSTILE)
    flat = _hostile_report()
    return ClusterReport((
        ActorEntry(info, "alive", flat, fresh=True),
        ActorEntry(ActorInfo(**{**info.__dict__, "actor_id": "b" * 32, "deployment": None}),
                   "dead", flat, fresh=False, death=HOSTILE),
        ActorEntry(ActorInfo(**{**info.__dict__, "actor_id": "c" * 32, "limit": 16 * GiB}),
                   "alive", flat, fresh=True),  # overcommits the GPU: a warning names it
    ), "gpubudget/gpubudget-registry")


@pytest.mark.parametrize("as_json", [False, True])
def test_gpubudget_ray_prints_actor_names_tags_and_budgets_escaped(
        monkeypatch: pytest.MonkeyPatch, capfdbinary: pytest.CaptureFixture[bytes],
        as_json: bool) -> None:
    report = _cluster()
    fake_ray = types.SimpleNamespace(is_initialized=lambda: True)  # "connected already"
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr("gpubudget.ray.command.cluster_report", lambda timeout: report)
    assert ray_command(None, as_json) == 0
    out, err = capfdbinary.readouterr()
    assert _raw_bytes(out + err) == 0
    text = out.decode()
    if as_json:  # JSON escapes them itself, and reads back as they were
        data = json.loads(text)
        actor = data["nodes"][0]["devices"][0]["actors"][0]
        assert actor["actor_name"] == HOSTILE and actor["report"]["name"] == HOSTILE
    else:
        escaped = "model\\x1b]0;PWNED\\x07\\x1b[2J\\u202e"
        assert f"    Serve {escaped}/{escaped} replica {escaped}" in text
        assert f"DEAD ({escaped})" in text and f"trace {escaped}" in text
        assert f"      {escaped} [host] (open)" in text  # the budget, in the actor's report
        assert f"warning: node {escaped} GPU {escaped}:" in text
        assert text.count(escaped) > 20  # tags, denials, children: all of them


def test_ray_command_errors_are_escaped(monkeypatch: pytest.MonkeyPatch,
                                        capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    def unreachable(timeout: float) -> ClusterReport:
        raise RuntimeError(f"actor {HOSTILE} died")

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setattr("gpubudget.ray.command.cluster_report", unreachable)
    assert ray_command(None, False) == 2
    out, err = capfdbinary.readouterr()
    assert _raw_bytes(out + err) == 0 and b"model\\x1b]0;PWNED" in err


_WRITE_TRACE = f"""
import sys
from gpubudget import gpu_budget, label
bad = {HOSTILE!r}
with gpu_budget("1MiB", backend="host", name=bad, trace=sys.argv[1]) as root:
    with label(bad):
        root.allocate(1000)
        root.allocate(10 ** 7)
    with gpu_budget("64KiB", name=bad + "-child") as child:
        child.allocate(100_000)
    if len(sys.argv) > 2:  # the ledger holds the root while another command looks
        import subprocess
        done = subprocess.run(sys.argv[2:], capture_output=True)
        sys.stdout.buffer.write(done.stdout + done.stderr)
"""


@pytest.mark.parametrize("command", [["report"], ["report", "--json"], ["fit"]])
def test_trace_commands_print_names_escaped(tmp_path: Path, command: list[str]) -> None:
    trace = tmp_path / "t.jsonl"
    subprocess.run([sys.executable, "-c", _WRITE_TRACE, str(trace)], check=True,
                   env=subprocess_env())
    done = subprocess.run([sys.executable, "-m", "gpubudget", *command, str(trace)],
                          capture_output=True, env=subprocess_env())
    assert done.returncode == 0, done.stderr
    assert _raw_bytes(done.stdout + done.stderr) == 0
    assert b"PWNED" in done.stdout


@pytest.mark.parametrize("command", [["top", "--once", "--all"], ["top", "--json", "--all"]])
def test_top_prints_the_budgets_of_other_processes_escaped(tmp_path: Path,
                                                           command: list[str]) -> None:
    env = subprocess_env(GPUBUDGET_LEDGER_DIR=str(tmp_path / "ledger"))
    done = subprocess.run([sys.executable, "-c", _WRITE_TRACE, str(tmp_path / "t.jsonl"),
                           sys.executable, "-m", "gpubudget", *command],
                          capture_output=True, env=env)
    assert done.returncode == 0, done.stderr
    assert _raw_bytes(done.stdout + done.stderr) == 0
    assert b"PWNED" in done.stdout
