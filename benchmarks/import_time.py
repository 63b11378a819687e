"""How long ``import gpubudget`` takes, and what it imports: this checkout and any others
named, side by side (runs interleaved, so that a busy machine slows them alike).

    python benchmarks/import_time.py [OTHER_CHECKOUT ...] [--runs N]

Each run is a fresh interpreter started in the checkout (so that it imports that tree's
gpubudget) with ``-X importtime``; the table gives the median over the runs of what
``importtime`` counts for ``gpubudget`` (its modules and everything they import), of the
whole interpreter's wall time, and of a bare interpreter's (``-c pass``) for scale, and lists
the heavy modules each checkout's import pulls in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("asyncio", "ssl", "msgspec", "numpy", "matplotlib", "prometheus_client",
         "tensorrt", "torch", "cupy", "pycuda", "contextvars_extras", "dataclasses", "json",
         "decimal", "ctypes", "gpubudget.report", "gpubudget.tracefile.writer",
         "gpubudget.hostledger", "gpubudget.tracefile.reader", "gpubudget.replay",
         "gpubudget.viewer")
"""Modules ``import gpubudget`` should leave for later (what tests/test_import_cost.py
checks)."""
_LIST = ("import sys, gpubudget; print(' '.join(sorted(m for m in sys.modules if "
         "m.split('.')[0] in {heads} or m in {full})))")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the checkout's own tree, from the current directory
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode read, as an installed package's is
    return env


def _one(checkout: Path) -> tuple[float, float]:
    """(``importtime``'s cumulative microseconds for gpubudget, wall seconds)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import gpubudget"],
                          cwd=checkout, env=_env(), capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    for line in reversed(done.stderr.splitlines()):
        parts = [part.strip() for part in line.split("|")]
        if len(parts) == 3 and parts[2] == "gpubudget":
            return float(parts[1]), wall
    raise RuntimeError(f"{checkout}: no import time for gpubudget in:\n{done.stderr[-2000:]}")


def _bare() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=_env(), check=True)
    return time.perf_counter() - started


def _heavy(checkout: Path) -> str:
    heads = {name for name in HEAVY if "." not in name}
    full = {name for name in HEAVY if "." in name}
    done = subprocess.run([sys.executable, "-c", _LIST.format(heads=heads, full=full)],
                          cwd=checkout, env=_env(), capture_output=True, text=True, check=True)
    found = sorted({name if name in full else name.split(".")[0]
                    for name in done.stdout.split()})
    return ", ".join(found) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("others", nargs="*", type=Path, help="other checkouts to compare")
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    checkouts = [Path(__file__).resolve().parent.parent, *(p.resolve() for p in args.others)]
    times: dict[Path, list[float]] = {c: [] for c in checkouts}
    walls: dict[Path, list[float]] = {c: [] for c in checkouts}
    bare: list[float] = []
    for _ in range(args.runs):
        bare.append(_bare())
        for checkout in checkouts:
            cumulative, wall = _one(checkout)
            times[checkout].append(cumulative)
            walls[checkout].append(wall)
    print(f"python {sys.version.split()[0]}, {args.runs} runs each, interleaved; medians\n")
    print(f"| checkout | import gpubudget (-X importtime) | interpreter wall | heavy modules "
          f"imported |")
    print("| --- | ---: | ---: | --- |")
    print(f"| bare `python -c pass` | | {statistics.median(bare) * 1e3:.1f} ms | |")
    for checkout in checkouts:
        print(f"| {checkout} | {statistics.median(times[checkout]) / 1e3:.1f} ms | "
              f"{statistics.median(walls[checkout]) * 1e3:.1f} ms | {_heavy(checkout)} |")


if __name__ == "__main__":
    main()
