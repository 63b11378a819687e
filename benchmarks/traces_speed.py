"""The trace commands at scale: reading, ``report`` and ``fit`` of a 1e6-event server trace,
of chains thousands of budgets deep, and of a file of empty lines.

    python -m benchmarks.traces_speed [--events N] [--depths 4000,6000,9000,10000]
                                      [--blank-mib N] [--keep DIR]

Writes the traces with :mod:`benchmarks.trace_gen`, then runs each command as a subprocess
and prints wall seconds, CPU seconds (user + system: what the command itself spent, less
sensitive than wall time to other work on a shared machine), peak resident memory
(``wait4``) and events per second of wall time. Reading alone is timed in this process,
with each parser (msgspec, the ``traces`` extra; json, the standard library). Compare rows
of one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.trace_gen import record_server, write_blank, write_chain
from gpubudget.tracefile import PARSER_ENV, TraceReader
from gpubudget.tracefile.fastparse import AVAILABLE
from gpubudget.units import MiB


def measure(command: list[str], env: dict[str, str] | None = None
            ) -> tuple[float, float, float, int]:
    """Wall seconds, CPU seconds, peak resident MiB and exit status of ``command``."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, **(env or {})})
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    assert process.stderr is not None
    error = process.stderr.read().decode(errors="replace").strip()
    process.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code:
        print(f"  {' '.join(command)}: exit {code}: {error[-300:]}", file=sys.stderr)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, code


def events_in(path: str) -> int:
    with TraceReader(path) as reader:
        return sum(1 for _ in reader)


def read_rate(path: str, parser: str) -> tuple[float, int]:
    """Seconds to read and check every event of ``path`` with ``parser``, and the events."""
    start = time.perf_counter()
    with TraceReader(path, parser=parser) as reader:
        count = sum(1 for _ in reader)
    return time.perf_counter() - start, count


def row(title: str, events: int, command: list[str], env: dict[str, str] | None = None) -> None:
    wall, cpu, rss, code = measure(command, env)
    status = "" if code == 0 else f" (exit {code})"
    print(f"| {title}{status} | {events:,} | {wall:.1f} | {cpu:.1f} | {rss:.0f} | "
          f"{events / wall:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--depths", default="4000,6000,9000,10000")
    parser.add_argument("--blank-mib", type=int, default=1024)
    parser.add_argument("--keep", metavar="DIR", help="write the traces here and keep them")
    args = parser.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="gpubudget-traces-")
    os.makedirs(folder, exist_ok=True)
    gpubudget = [sys.executable, "-m", "gpubudget"]
    head = ("| command | events | wall s | CPU s | peak RSS MiB | events/s (wall) |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: |")

    server = os.path.join(folder, "server.jsonl")
    if not os.path.exists(server):
        record_server(server, args.events)
    count = events_in(server)
    print(f"server trace: {count:,} events, {os.path.getsize(server) / MiB:.1f} MiB\n")
    print("| reading alone (in process) | events | s | events/s |\n| --- | ---: | ---: | ---: |")
    for name in ("msgspec", "json"):
        if name == "msgspec" and not AVAILABLE:
            print("| TraceReader(parser='msgspec') | msgspec not installed | | |")
            continue
        seconds, events = read_rate(server, name)
        print(f"| TraceReader(parser={name!r}) | {events:,} | {seconds:.2f} | "
              f"{events / seconds:,.0f} |")
    print("\n" + head)
    row("`gpubudget report server.jsonl`", count, gpubudget + ["report", server])
    row(f"the same, {PARSER_ENV}=json", count, gpubudget + ["report", server],
        {PARSER_ENV: "json"})
    row("`gpubudget report --json server.jsonl`", count,
        gpubudget + ["report", "--json", server])
    row("`gpubudget fit server.jsonl`", count, gpubudget + ["fit", server])

    print("\n" + head.replace("| command |", "| chain depth, command |"))
    for depth in (int(text) for text in args.depths.split(",") if text):
        chain = os.path.join(folder, f"chain{depth}.jsonl")
        write_chain(chain, depth)
        events = events_in(chain)
        size = os.path.getsize(chain) / MiB
        for command in ("report", "fit"):
            row(f"{depth:,} deep ({size:.1f} MiB), `{command}`", events,
                gpubudget + [command, chain])
        if not args.keep:
            os.remove(chain)

    if args.blank_mib:
        blank = os.path.join(folder, "blank.jsonl")
        write_blank(blank, args.blank_mib)
        lines = args.blank_mib * MiB + 3
        print(f"\n| {args.blank_mib} MiB of empty lines | lines | wall s | CPU s | "
              f"peak RSS MiB | lines/s (wall) |\n| --- | ---: | ---: | ---: | ---: | ---: |")
        row("`gpubudget report blank.jsonl`", lines, gpubudget + ["report", blank])
        os.remove(blank)
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
