"""Trace reading, ``gpubudget report`` and ``gpubudget fit`` at scale: time and peak memory.

    python -m benchmarks.traces_cli [--events N] [--roots N] [--keep DIR]

Records two traces through real budgets (host memory mapped without reserving it):

- *churn*: one root with one child, 1,000 live blocks of log-uniform sizes (256 B-16 MiB),
  each step frees a random block and allocates another, tags cycling over 7 labels, until
  ``--events`` events are written (default 1,000,000: about 100 MB);
- *requests*: ``--roots`` short-lived roots (default 1,000), a root per request, each with
  a "model" child that allocates 8-24 blocks, frees them in random order, and is refused
  once in a while (a probe for ``fit``).

Then runs ``gpubudget report`` and ``gpubudget fit`` on them as subprocesses and prints wall
time and peak resident memory (``wait4``) of each, and the trace writer's cost per event.
Timings vary from machine to machine and run to run; compare rows of one run.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import subprocess
import sys
import tempfile
import time

from gpubudget import gpu_budget
from gpubudget.backends.host import HostBackend
from gpubudget.tracefile import TraceWriter, writer_for
from gpubudget.units import MiB

_BACKEND = HostBackend(noreserve=True)


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def record_churn(path: str, events: int, seed: int = 0) -> None:
    """The churn trace (see the module docstring): ``events`` events, give or take five."""
    rng = random.Random(seed)
    with gpu_budget("64GiB", name="pool", backend=_BACKEND, trace=path):
        with gpu_budget("40GiB", name="model") as model:
            live: list[int] = []
            for step in range((events - 4) // 2):
                if len(live) >= 1000:
                    model.free(live.pop(rng.randrange(len(live))))
                block = model.allocate(log_uniform(rng, 256, 16 * MiB), tag=f"t{step % 7}")
                if block is not None:
                    live.append(block)
            for block in live:
                model.free(block)
    writer_for(path).flush()


def record_requests(path: str, roots: int, seed: int = 0) -> None:
    """The requests trace (see the module docstring): ``roots`` roots in turn."""
    rng = random.Random(seed)
    for _ in range(roots):
        with gpu_budget("64MiB", name="request", backend=_BACKEND, trace=path):
            with gpu_budget("48MiB", name="model") as model:
                blocks = [model.allocate(log_uniform(rng, 4096, 4 * MiB))
                          for _ in range(rng.randrange(8, 25))]
                if rng.random() < 0.1:
                    model.allocate(60 * MiB)  # refused: a probe
                rng.shuffle(blocks)
                for block in blocks:
                    if block is not None:
                        model.free(block)
    writer_for(path).flush()


def measure(command: list[str]) -> tuple[float, float, int]:
    """Wall seconds, peak resident MiB and exit status of ``command``."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.stderr is not None
    error = process.stderr.read().decode(errors="replace").strip()
    process.stderr.close()
    if process.returncode:
        print(f"  {' '.join(command)}: exit {process.returncode}: {error}", file=sys.stderr)
    return wall, usage.ru_maxrss / 1024, process.returncode


def writer_cost(events: int = 200_000) -> float:
    """Microseconds per ``TraceWriter.alloc`` call, to a file on disk."""
    with tempfile.TemporaryDirectory() as folder:
        writer = TraceWriter(os.path.join(folder, "w.jsonl"))
        start = time.perf_counter()
        for index in range(events):
            writer.alloc(1, 4096 + index, 0, "tag", 0x7F0000000000 + index * 4096, 4096)
        elapsed = time.perf_counter() - start
        writer.close()
    return elapsed / events * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--roots", type=int, default=1_000)
    parser.add_argument("--keep", metavar="DIR", help="write the traces here and keep them")
    args = parser.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="gpubudget-traces-")
    os.makedirs(folder, exist_ok=True)
    churn = os.path.join(folder, "churn.jsonl")
    requests = os.path.join(folder, "requests.jsonl")
    start = time.perf_counter()
    record_churn(churn, args.events)
    record_requests(requests, args.roots)
    print(f"recorded in {time.perf_counter() - start:.1f} s: {churn} "
          f"({os.path.getsize(churn) / MiB:.1f} MiB), {requests} "
          f"({os.path.getsize(requests) / MiB:.1f} MiB)\n")
    gpubudget = [sys.executable, "-m", "gpubudget"]
    rows = [
        ("report, churn", gpubudget + ["report", churn]),
        ("report --json, churn", gpubudget + ["report", "--json", churn]),
        ("report, requests", gpubudget + ["report", requests]),
        ("fit, requests", gpubudget + ["fit", requests]),
    ]
    print("| command | lines | wall s | peak RSS MiB |\n| --- | --- | --- | --- |")
    for title, command in rows:
        lines = sum(1 for _ in open(command[-1], "rb"))
        wall, rss, _ = measure(command)
        print(f"| {title} | {lines:,} | {wall:.1f} | {rss:.0f} |")
    print(f"\ntrace writer: {writer_cost():.2f} µs per event")
    if not args.keep:
        for path in (churn, requests):
            os.remove(path)
        os.rmdir(folder)


if __name__ == "__main__":
    main()
