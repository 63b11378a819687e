"""The trace benchmarks run end to end on small inputs and print their tables (their
numbers are for BENCHMARKS.md, not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.trace_gen import write_chain
from gpubudget.replay import fit
from gpubudget.units import MiB

from .helpers import subprocess_env


def test_traces_speed_prints_every_table(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.traces_speed", "--events", "3000", "--depths",
         "30,40", "--blank-mib", "1", "--keep", str(tmp_path), "--repeat", "2", "--before",
         str(Path(__file__).resolve().parent.parent)],
        capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for row in ("TraceReader(parser='c')", "TraceReader(parser='msgspec')",
                "TraceReader(parser='json')", "`gpubudget report server.jsonl`",
                "GPUBUDGET_TRACE_PARSER=msgspec", "`gpubudget fit server.jsonl`",
                "`report` |", "`fit` |", "30 deep", "40 deep", "`gpubudget report blank.jsonl`",
                "medians of 2 runs"):
        assert row in out, out
    # the server trace keeps its kv pages to the end, on purpose: interpreter exit says so
    assert "exit" not in out and done.stderr.splitlines() == [
        "gpubudget: 200 block(s) of budget 'serve' still live at exit (400.00 MiB: kv 400.00 "
        "MiB); gpu_budget(..., track_stacks=True) shows where each was allocated"], done.stderr


def test_a_chain_trace_fragments_its_root(tmp_path: Path) -> None:
    path = tmp_path / "chain.jsonl"
    write_chain(str(path), 12, leaf_events=40)
    fits = fit(path)
    assert [f.name for f in fits] == [f"level{depth}" for depth in range(1, 13)]
    assert fits[0].limit == 18 * MiB and fits[-1].limit == 16 * MiB
