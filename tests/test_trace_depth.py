"""Deep trees: a chain of 10,000 nested budgets with a fragmenting leaf is reported and
fitted in time and memory proportional to the trace (the replay keeps no chain of ancestors
per budget; ``fit`` stops its yes/no replays at the first denial and skips the limits a
refusal shows to be short)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.trace_gen import write_chain
from gpubudget.cli import main
from gpubudget.replay import fit, replay
from gpubudget.units import MiB

from .helpers import finishes

DEPTH = 10_000


def test_a_chain_10000_deep_is_fitted_and_reported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "chain.jsonl"
    write_chain(str(path), DEPTH)
    found: list[object] = []
    steps: list[str] = []

    def work() -> None:
        found.extend(fit(path, progress=steps.append))
        (report,) = replay(path).reports
        found.append(report)

    finishes(work, 600)
    fits, report = found[:-1], found[-1]
    assert len(fits) == DEPTH
    root, leaf = fits[0], fits[-1]
    # The leaf peaks at 16 one-MiB blocks; its 2 MiB block fits in none of the 1 MiB holes
    # left, so the root's arena needs 18 MiB; every budget below it only counts bytes.
    assert (root.peak, root.limit) == (16 * MiB, 18 * MiB)  # type: ignore[attr-defined]
    assert {f.limit for f in fits[1:]} == {16 * MiB}  # type: ignore[attr-defined]
    assert leaf.name == f"level{DEPTH}"  # type: ignore[attr-defined]
    assert sum("replay" in step for step in steps) <= 8
    deepest = report.walk()[-1]  # type: ignore[attr-defined]
    assert deepest.name == f"level{DEPTH}" and deepest.used == 8 * MiB
    assert main(["fit", str(path)]) == 0
    out = capsys.readouterr().out
    assert len(out) < 400 * DEPTH  # lines indented no deeper than 24 levels (not ~DEPTH²)
    compile(out[out.index("import contextlib"):], "fit", "exec")  # the code runs as printed
