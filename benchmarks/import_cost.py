"""What ``import gpubudget`` costs in CPU time (user + system), against a bare interpreter's
start, side by side: every round starts each command once, in turn, in a fresh interpreter of
this Python, so a busy machine slows them alike.

    python -m benchmarks.import_cost [--runs N] [--json PATH] [--before CHECKOUT]

Rows: ``python -c pass`` (the bare start, the unit of the ratio); ``import gpubudget``; a
first budget entered and used on host memory (what a program pays before its first
allocation); with ``--before CHECKOUT``, ``import gpubudget`` from another checkout (an
earlier commit, its C extension built in place) in the same rounds. The table gives the
minimum and the median over the runs of the child's ``ru_utime + ru_stime``
(``os.wait4``), and the minimum's ratio to the bare start's minimum: the minimum is what
the work costs when nothing else runs. The target: ``import gpubudget``
at most 2x the bare start.

Each interpreter reads bytecode, as an installed package's does (``pip`` writes the ``.pyc``
files at install): ``PYTHONDONTWRITEBYTECODE`` is left out of the children's environment, so
that the warm-up round writes them (``__pycache__``, ignored by git); with it set, every run
would compile gpubudget's sources anew, which no user pays.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROWS: dict[str, str] = {
    "bare start (python -c pass)": "pass",
    "import gpubudget": "import gpubudget",
    "a first budget used (host memory)": (
        "from gpubudget import gpu_budget\n"
        "with gpu_budget('1MiB', backend='host') as pool:\n"
        "    pool.free(pool.allocate(4096))"),
}
"""Each row's name and the code its interpreter runs."""
TARGET = 2.0
"""``import gpubudget`` at most this many bare starts."""


def cpu_seconds(code: str, cwd: Path) -> float:
    """User + system CPU seconds of a fresh interpreter running ``code``."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    child = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.stderr is not None
    errors = child.stderr.read().decode(errors="replace")
    child.stderr.close()
    if child.returncode != 0:
        raise RuntimeError(f"{code!r} failed ({child.returncode}):\n{errors[-2000:]}")
    return usage.ru_utime + usage.ru_stime


def measure(runs: int, cwd: Path, before: Path | None = None) -> dict[str, list[float]]:
    """Each row's CPU seconds, ``runs`` rounds of every row in turn (and ``import
    gpubudget`` in the checkout ``before``, if given)."""
    rows = [(name, code, cwd) for name, code in ROWS.items()]
    if before is not None:
        rows.append((f"import gpubudget, {before}", "import gpubudget", before))
    found: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for name, code, where in rows:  # one warm-up each: the page cache, .pyc files written
        cpu_seconds(code, where)
    for _ in range(runs):
        for name, code, where in rows:
            found[name].append(cpu_seconds(code, where))
    return found


def table(found: dict[str, list[float]]) -> list[str]:
    bare = min(found["bare start (python -c pass)"])
    lines = ["| what | CPU ms, min | CPU ms, median | min vs bare start |",
             "| --- | ---: | ---: | ---: |"]
    for name, times in found.items():
        lines.append(f"| {name} | {min(times) * 1e3:.1f} | {statistics.median(times) * 1e3:.1f} "
                     f"| {min(times) / bare:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--before", type=Path, metavar="CHECKOUT",
                        help="another checkout whose import to time in the same rounds")
    args = parser.parse_args()
    checkout = Path(__file__).resolve().parent.parent
    found = measure(args.runs, checkout, args.before.resolve() if args.before else None)
    import gpubudget

    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"C core {'built' if gpubudget.compiled else 'absent'}; {args.runs} interleaved "
          f"rounds, user + system CPU time of each interpreter\n")
    print("\n".join(table(found)))
    ratio = min(found["import gpubudget"]) / min(found["bare start (python -c pass)"])
    print(f"\nimport gpubudget: {ratio:.2f}x a bare start (target: at most {TARGET:g}x): "
          f"{'met' if ratio <= TARGET else 'missed'}")
    if args.json is not None:
        args.json.write_text(json.dumps({name: times for name, times in found.items()}))


if __name__ == "__main__":
    main()
