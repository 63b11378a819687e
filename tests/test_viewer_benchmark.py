"""benchmarks/viewer.py runs end to end on a small trace and prints every row of its table
(what it measures is read from its output, never asserted: a benchmark prints, it does not
judge), measuring a second viewer side by side with --against."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import subprocess_env
from tests.test_viewer_browser import chromium


def test_the_viewer_benchmark_prints_its_table(tmp_path: Path) -> None:
    pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chromium()  # skips without a browser
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.viewer", "--events", "3000", "--keep",
         str(tmp_path / "out"), "--against", str(root)],
        cwd=root, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = dict(line.split("  ", 1) for line in done.stdout.splitlines()[1:])
    assert rows["events recorded"].strip().startswith("3,000 (")
    for name in ("browser: load until drawn", "browser: redraw, whole run",
                 "browser: redraw, zoomed 1000x",
                 "browser: choose a moment (blocks, flame graph, addresses)"):
        assert "(against " in rows[name] and ": x" in rows[name], (name, rows[name])
    assert (tmp_path / "out" / "churn.html").exists()
    assert (tmp_path / "out" / "churn-against.html").exists()
