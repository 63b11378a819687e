"""The trace commands at scale: reading, ``report`` and ``fit`` of a 1e6-event server trace,
of chains thousands of budgets deep, and of a file of empty lines.

    python -m benchmarks.traces_speed [--events N] [--depths 4000,6000,9000,10000]
                                      [--blank-mib N] [--keep DIR] [--repeat N]
                                      [--before CHECKOUT]

Writes the traces with :mod:`benchmarks.trace_gen`, then runs each command as a subprocess
and prints wall seconds, CPU seconds (user + system: what the command itself spent, less
sensitive than wall time to other work on a shared machine), peak resident memory
(``wait4``) and events per second of wall time and of CPU time. Reading alone is timed in
this process, with each parser there (c, the scanner built with the package; msgspec, the
``traces`` extra; json, the standard library). ``report`` runs with each parser too: with
``c`` the scanner replays the granted allocations and frees itself, with the others the
replay's Python loop does. ``--repeat N`` runs every row N times, the rows taking turns,
and prints the medians (and the largest peak memory). ``--before CHECKOUT`` adds ``report``
and ``fit`` run from another checkout of gpubudget (an earlier commit, its extensions built
in place), in the same turns: before and after side by side. Compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.trace_gen import record_server, write_blank, write_chain
from gpubudget.tracefile import PARSER_ENV, TraceReader
from gpubudget.tracefile.cscan import NATIVE
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


Row = tuple[str, int, list[str], dict[str, str]]
"""A command to time: its title, its events (for the rate), the command, its environment."""


def timed(rows: list[Row], repeat: int) -> None:
    """Run ``rows`` ``repeat`` times, taking turns; print each row's medians."""
    found: list[list[tuple[float, float, float, int]]] = [[] for _ in rows]
    for _ in range(repeat):
        for index, (_, _, command, env) in enumerate(rows):
            found[index].append(measure(command, env))
    for (title, events, _, _), runs in zip(rows, found):
        wall = statistics.median(run[0] for run in runs)
        cpu = statistics.median(run[1] for run in runs)
        rss = max(run[2] for run in runs)
        codes = {run[3] for run in runs} - {0}
        status = f" (exit {', '.join(map(str, sorted(codes)))})" if codes else ""
        print(f"| {title}{status} | {events:,} | {wall:.2f} | {cpu:.2f} | {rss:.0f} | "
              f"{events / wall:,.0f} | {events / cpu:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--depths", default="4000,6000,9000,10000")
    parser.add_argument("--blank-mib", type=int, default=1024)
    parser.add_argument("--keep", metavar="DIR", help="write the traces here and keep them")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row (medians)")
    parser.add_argument("--before", metavar="CHECKOUT",
                        help="also run report and fit from this checkout of gpubudget")
    args = parser.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="gpubudget-traces-")
    os.makedirs(folder, exist_ok=True)
    gpubudget = [sys.executable, "-m", "gpubudget"]
    repeat = max(1, args.repeat)
    head = ("| command | events | wall s | CPU s | peak RSS MiB | events/s (wall) | "
            "events/s (CPU) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")

    server = os.path.join(folder, "server.jsonl")
    if not os.path.exists(server):
        record_server(server, args.events)
    count = events_in(server)
    print(f"server trace: {count:,} events, {os.path.getsize(server) / MiB:.1f} MiB"
          + (f"; medians of {repeat} runs, rows taking turns" if repeat > 1 else "") + "\n")
    print("| reading alone (in process) | events | s | events/s |\n| --- | ---: | ---: | ---: |")
    there = {"c": NATIVE, "msgspec": AVAILABLE, "json": True}
    for name, present in there.items():
        if not present:
            print(f"| TraceReader(parser={name!r}) | not here | | |")
            continue
        runs = [read_rate(server, name) for _ in range(repeat)]
        seconds, events = statistics.median(run[0] for run in runs), runs[0][1]
        print(f"| TraceReader(parser={name!r}) | {events:,} | {seconds:.2f} | "
              f"{events / seconds:,.0f} |")
    print("\n" + head)
    rows: list[Row] = [("`gpubudget report server.jsonl`", count, gpubudget + ["report", server],
                        {})]
    rows += [(f"the same, {PARSER_ENV}={name}", count, gpubudget + ["report", server],
              {PARSER_ENV: name}) for name in ("msgspec", "json") if there[name]]
    rows += [("`gpubudget report --json server.jsonl`", count,
              gpubudget + ["report", "--json", server], {}),
             ("`gpubudget fit server.jsonl`", count, gpubudget + ["fit", server], {})]
    if args.before:
        before = {"PYTHONPATH": os.path.abspath(args.before)}
        rows += [(f"before ({args.before}): `{command}`", count,  # -P: not this directory
                  [sys.executable, "-P", "-m", "gpubudget", command, server], before)
                 for command in ("report", "fit")]
    timed(rows, repeat)

    chains: list[Row] = []
    for depth in (int(text) for text in args.depths.split(",") if text):
        chain = os.path.join(folder, f"chain{depth}.jsonl")
        write_chain(chain, depth)
        size = os.path.getsize(chain) / MiB
        chains += [(f"{depth:,} deep ({size:.1f} MiB), `{command}`", events_in(chain),
                    gpubudget + [command, chain], {}) for command in ("report", "fit")]
    if chains:
        print("\n" + head.replace("| command |", "| chain depth, command |"))
        timed(chains, repeat)
    if not args.keep:
        for _, _, command, _ in chains:
            if os.path.exists(command[-1]):
                os.remove(command[-1])

    if args.blank_mib:
        blank = os.path.join(folder, "blank.jsonl")
        write_blank(blank, args.blank_mib)
        lines = args.blank_mib * MiB + 3
        print(f"\n| {args.blank_mib} MiB of empty lines | lines | wall s | CPU s | "
              f"peak RSS MiB | lines/s (wall) | lines/s (CPU) |\n"
              f"| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        timed([("`gpubudget report blank.jsonl`", lines, gpubudget + ["report", blank], {})],
              repeat)
        os.remove(blank)
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
