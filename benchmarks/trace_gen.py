"""Traces to measure the trace commands on, written to a file.

    python -m benchmarks.trace_gen server -o server.jsonl [--events N] [--seed S]
    python -m benchmarks.trace_gen chain -o chain.jsonl --depth N [--leaf-events N]
    python -m benchmarks.trace_gen blank -o blank.jsonl --mib N

- *server* (recorded through real budgets, host memory mapped without reserving it): a
  large root ``serve`` (24 GiB) holding ``weights`` (60 blocks of 1-256 MiB, live to the
  end), ``kv-cache`` (a child ``pages`` under it: pages of 2 MiB, half of them freed on
  a stream and reused at once by the next allocations on it) and ``activations``
  (blocks of 4 KiB-64 MiB, log-uniform, 400 live at once, freed at random, tags cycling
  over 12 layer names, a request over its 4 GiB limit now and then: a denial, a probe for
  ``fit``), until about ``--events`` events; then two small roots ``warmup`` and ``eval``
  (a few thousand events each). The first root's events are almost all of the file.
- *chain*: ``--depth`` budgets each entered inside the one before (64 MiB each), written
  directly (recording it through budgets costs the core's own chain), then a leaf that
  fragments: 16 blocks of 1 MiB with every other one freed, then a 2 MiB block, which fits
  in no hole, allocated and freed again and again. No exits (the process was killed):
  ``--depth`` + ``--leaf-events`` events.
- *blank*: a header, ``--mib`` MiB of empty lines, then one root with one block.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

from gpubudget import Budget, gpu_budget
from gpubudget.backends.host import HostBackend
from gpubudget.tracefile import TraceWriter, writer_for
from gpubudget.units import KiB, MiB

_BACKEND = HostBackend(noreserve=True)
_LAYERS = tuple(f"layer{index}" for index in range(12))


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def record_server(path: str, events: int = 1_000_000, seed: int = 0) -> None:
    """The server trace (see the module docstring)."""
    rng = random.Random(seed)
    with gpu_budget("24GiB", name="serve", backend=_BACKEND, trace=path) as serve:
        _serve(serve, rng, events)
    for name, count in (("warmup", 2000), ("eval", 3000)):
        with gpu_budget("2GiB", name=name, backend=_BACKEND, trace=path):
            with gpu_budget("1GiB", name="model") as model:
                _churn(model, rng, count, live=64, high=16 * MiB)
    writer_for(path).flush()


def _serve(serve: Budget, rng: random.Random, events: int) -> None:
    with gpu_budget("8GiB", name="weights", parent=serve) as weights:
        kept = [weights.allocate(_log_uniform(rng, MiB, 256 * MiB), tag="weights")
                for _ in range(60)]
        with gpu_budget("4GiB", name="kv-cache", parent=serve) as cache, \
                gpu_budget("3GiB", name="pages", parent=cache) as pages:
            for _ in range(200):
                pages.allocate(2 * MiB, tag="kv", stream=1)
            with gpu_budget("4GiB", name="activations", parent=serve) as activations:
                _churn(activations, rng, events - 800, live=400, high=64 * MiB,
                       pages=pages, deny=1600 * MiB)
        for block in kept:
            if block is not None:
                weights.free(block)


def _churn(budget: Budget, rng: random.Random, events: int, *, live: int, high: int,
           pages: Budget | None = None, deny: int = 0) -> None:
    """About ``events`` events of free-one/allocate-one on ``budget``; every 500th step
    frees a kv page on a stream and takes one again, every 997th asks ``deny`` bytes."""
    allocate = budget.allocate
    free = budget.free
    blocks: list[int] = []
    step = written = 0
    while written < events:
        step += 1
        if len(blocks) >= live:
            free(blocks.pop(rng.randrange(len(blocks))))
            written += 1
        block = allocate(_log_uniform(rng, 4 * KiB, high), tag=_LAYERS[step % len(_LAYERS)])
        written += 1
        if block is not None:
            blocks.append(block)
        if deny and step % 997 == 0:
            batch = allocate(deny, tag="batch")  # refused when too much is live
            written += 1
            if batch is not None:
                free(batch)
                written += 1
        if pages is not None and step % 500 == 0:
            page = pages.allocate(2 * MiB, tag="kv", stream=1)
            if page is not None:
                pages.free(page, stream=1)
                written += 2
    for block in blocks:
        free(block)


def write_chain(path: str, depth: int, leaf_events: int = 200) -> None:
    """The chain trace (see the module docstring)."""
    if os.path.exists(path):
        os.remove(path)
    writer = TraceWriter(path)
    for budget in range(1, depth + 1):
        writer.enter(budget, f"level{budget}", budget - 1 or None, 64 * MiB, 256, 0, "host")
    base = 1 << 40
    for index in range(16):  # 1 MiB blocks side by side
        writer.alloc(depth, MiB, 0, "small", base + index * MiB, MiB)
    for index in range(0, 16, 2):  # every other one freed: 1 MiB holes
        writer.free(depth, base + index * MiB)
    large = base + 16 * MiB
    for index in range(max(0, leaf_events - 24) // 2):  # fits in no hole, again and again
        writer.alloc(depth, 2 * MiB, 0, "large", large, 2 * MiB)
        writer.free(depth, large)
    writer.close()


def write_blank(path: str, mib: int) -> None:
    """The blank trace (see the module docstring)."""
    with open(path, "wb") as out:
        out.write(b'{"format": "gpubudget-trace", "version": 1}\n')
        chunk = b"\n" * MiB
        for _ in range(mib):
            out.write(chunk)
        out.write(b'{"ev": "enter", "t": 0.0, "b": 1, "name": "pool", "parent": null, '
                  b'"limit": 1048576, "align": 256, "reserve": 0}\n'
                  b'{"ev": "alloc", "t": 0.1, "b": 1, "size": 4096, "align": 0, "ptr": 0, '
                  b'"bytes": 4096}\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("server", "chain", "blank"))
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depth", type=int, default=4000)
    parser.add_argument("--leaf-events", type=int, default=200)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    start = time.perf_counter()
    if args.kind == "server":
        record_server(args.output, args.events, args.seed)
    elif args.kind == "chain":
        write_chain(args.output, args.depth, args.leaf_events)
    else:
        write_blank(args.output, args.mib)
    lines = sum(1 for _ in open(args.output, "rb"))
    print(f"{args.output}: {lines:,} lines, {os.path.getsize(args.output) / MiB:.1f} MiB, "
          f"in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
