"""A fuzzer for ``gpubudget report`` and ``gpubudget fit``: malformed traces in, outcomes out.

    python -m benchmarks.fuzz_traces [--inputs 1000] [--seed 0] [--jobs 2] [--keep DIR]

Records a few real traces (several roots, children with reserves and alignments, granted and
denied allocations, resizes, frees, leaked blocks), then writes ``--inputs`` malformed
variants: lines dropped, repeated, swapped or cut; bytes flipped; fields removed or set to
values of every JSON type (``1e400``, ``NaN``, 2**64, booleans, null, strings, lists, nested
objects); parents pointing at themselves, at later or unknown budgets, as floats or booleans;
duplicate ids; junk, blank, very long, deeply nested or non-UTF-8 lines; headers removed,
repeated or of a newer version; traces concatenated; and special files (a directory, a FIFO,
``/dev/zero``, an empty file, a symbolic-link loop). Each input goes through ``gpubudget
report`` and ``gpubudget fit`` as subprocesses (60 s limit each); the table counts exit
statuses, and any traceback, multi-line error or time-out is listed: there should be none.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from gpubudget import gpu_budget
from gpubudget.tracefile import writer_for
from gpubudget.units import MiB

TIME_LIMIT = 60
VALUES: list[str] = ["1e400", "-1e400", "NaN", "Infinity", "-0.0", "1.5", str(2**63), str(2**64),
                     str(-(2**63) - 1), "9" * 5000, "true", "false", "null", '"1"', '""', "[]",
                     "{}", '{"a": [1, {"b": null}]}', '"\\u001b[2J"', '"\\ud800"', "0", "-1"]


def record_seeds(folder: str) -> list[bytes]:
    """Real traces to mutate."""
    paths = [os.path.join(folder, f"seed{index}.jsonl") for index in range(3)]
    with gpu_budget("16MiB", name="pool", trace=paths[0], backend="host"):
        with gpu_budget("8MiB", name="model", reserve="1MiB", align=512) as model:
            a, b = model.allocate(MiB, tag="a"), model.allocate(MiB, tag="b")
            assert a is not None and b is not None and model.free(a)
            c = model.allocate(2 * MiB, tag="c")
            assert c is not None and model.resize(c, 3 * MiB) is not None
            assert model.allocate(9 * MiB) is None and model.allocate(-5) is None
            assert model.free(b)
    for name in ("first", "second", "first"):
        with gpu_budget("1MiB", name=name, trace=paths[1], backend="host") as root:
            with gpu_budget("512KiB", name="model") as child:
                blocks = [child.allocate(1000 * (k + 1), tag=f"t{k}") for k in range(4)]
                for block in blocks[::2]:
                    assert block is not None and child.free(block)
            assert root.allocate(4096) is not None  # leaked
    with gpu_budget("4MiB", name="deep", trace=paths[2], backend="host"):
        chain = []
        for depth in range(5):
            budget = gpu_budget(4 * MiB - depth * 1024, name=f"level{depth}")
            budget.__enter__()
            chain.append(budget)
            assert budget.allocate(10_000 + depth) is not None
        for budget in reversed(chain):
            budget.__exit__(None, None, None)
    for path in paths:
        writer_for(path).flush()
    seeds = []
    for path in paths:
        with open(path, "rb") as handle:
            seeds.append(handle.read())
    return seeds


def parsed(line: bytes) -> dict[str, Any] | None:
    """``line`` as a JSON object, or ``None`` (not JSON, not an object, nested too deep)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def set_field(line: bytes, key: str, raw: str) -> bytes:
    """``line`` (a JSON object) with ``key`` set to the raw JSON text ``raw``."""
    record = parsed(line)
    if record is None:
        return line
    record[key] = "\x00PLACEHOLDER\x00"
    return json.dumps(record).replace('"\\u0000PLACEHOLDER\\u0000"', raw).encode()


def keys_of(line: bytes) -> list[str]:
    record = parsed(line)
    return sorted(record) if record is not None else []


def mutate(lines: list[bytes], seeds: list[bytes], rng: random.Random) -> list[bytes]:
    """One to four random mutations (see the module docstring)."""
    lines = list(lines)
    for _ in range(rng.randint(1, 4)):
        index = rng.randrange(len(lines)) if lines else 0
        kind = rng.choice(MUTATIONS)
        if not lines:
            lines = [b"{}"]
        lines = kind(lines, index, seeds, rng)
    return lines


def _drop(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    return lines[:i] + lines[i + 1:]


def _repeat(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    return lines[:i] + [lines[i]] + lines[i:]


def _swap(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    j = rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return lines


def _cut(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]
    return lines


def _flip(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    if lines[i]:
        at = rng.randrange(len(lines[i]))
        lines[i] = lines[i][:at] + bytes([rng.randrange(256)]) + lines[i][at + 1:]
    return lines


def _field(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    keys = keys_of(lines[i])
    if keys:
        lines[i] = set_field(lines[i], rng.choice(keys), rng.choice(VALUES))
    return lines


def _remove(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    record = parsed(lines[i])
    if record:
        del record[rng.choice(sorted(record))]
        lines[i] = json.dumps(record).encode()
    return lines


def _ids(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    """Parents and ids that break the tree: self, unknown, later, float, bool, duplicate."""
    key = rng.choice(["parent", "b"])
    record = parsed(lines[i])
    if record is None or key not in record:
        return lines
    own = record.get("b")
    if type(own) is not int:  # an earlier mutation changed it
        own = 1
    raw = rng.choice([str(own), str(own + 1), "999", f"{own}.0", "1.5", "true", "false",
                      "null", "-1"])
    lines[i] = set_field(lines[i], key, raw)
    return lines


def _insert(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    junk = rng.choice([
        b"", b"   ", b"\x00\x01\x02", os.urandom(rng.randrange(1, 200)), b"[" * 100_000,
        b"{" * 50_000, b'{"a":' * 30_000, b"x" * (2 * MiB), b"\xef\xbb\xbf{}", b"null",
        b'{"ev": "enter"}', b'{"format": "gpubudget-trace", "version": 1}',
        b'{"format": "gpubudget-trace", "version": 2}', b'"just a string"', b"12345",
    ])
    return lines[:i] + [junk] + lines[i:]


def _header(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    choice = rng.randrange(4)
    if choice == 0:
        return lines[1:]
    if choice == 1:
        return [set_field(lines[0], "version", rng.choice(["2", '"1"', "1.0", "true", "0"]))] + lines[1:]
    if choice == 2:
        return [set_field(lines[0], "format", rng.choice(['"other"', "null", "1"]))] + lines[1:]
    return lines + rng.choice(seeds).split(b"\n")  # another trace appended, header and all


def _endings(lines: list[bytes], i: int, seeds: list[bytes], rng: random.Random) -> list[bytes]:
    return [line + b"\r" for line in lines]


MUTATIONS: list[Callable[[list[bytes], int, list[bytes], random.Random], list[bytes]]] = [
    _drop, _repeat, _swap, _cut, _flip, _field, _field, _field, _remove, _ids, _ids, _insert,
    _header, _endings,
]


def special_inputs(folder: str) -> list[str]:
    """Inputs that are not plain malformed files."""
    made = []
    os.mkfifo(os.path.join(folder, "fifo"))
    made.append(os.path.join(folder, "fifo"))
    os.mkdir(os.path.join(folder, "directory"))
    made.append(os.path.join(folder, "directory"))
    os.symlink("loop", os.path.join(folder, "loop"))
    made.append(os.path.join(folder, "loop"))
    for name, data in (("empty", b""), ("blank", b"\n\n  \n"), ("binary", os.urandom(65536)),
                       ("nul", b"\x00" * 65536)):
        path = os.path.join(folder, name)
        with open(path, "wb") as handle:
            handle.write(data)
        made.append(path)
    made.append("/dev/zero")
    made.append(os.path.join(folder, "missing.jsonl"))
    return made


@dataclass
class Outcome:
    command: str
    path: str
    status: int | None  # None: timed out
    stderr: str


def run(command: str, path: str) -> Outcome:
    try:
        result = subprocess.run([sys.executable, "-m", "gpubudget", command, path],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                timeout=TIME_LIMIT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Outcome(command, path, None, "")
    return Outcome(command, path, result.returncode, result.stderr.decode(errors="replace"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--keep", metavar="DIR", help="write the inputs here and keep them")
    args = parser.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="gpubudget-fuzz-")
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(args.seed)
    seeds = record_seeds(folder)
    inputs = special_inputs(folder)
    while len(inputs) < args.inputs:
        seed = rng.choice(seeds).split(b"\n")[:-1]
        path = os.path.join(folder, f"mutated{len(inputs):05}.jsonl")
        with open(path, "wb") as handle:
            handle.write(b"\n".join(mutate(seed, seeds, rng)) + rng.choice([b"\n", b""]))
        inputs.append(path)
    jobs = [(command, path) for path in inputs for command in ("report", "fit")]
    with ThreadPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(lambda job: run(*job), jobs))
    table: collections.Counter[tuple[str, str]] = collections.Counter()
    problems: list[str] = []
    for outcome in outcomes:
        status = "timed out" if outcome.status is None else str(outcome.status)
        table[(outcome.command, status)] += 1
        if outcome.status is None:
            problems.append(f"{outcome.command} {outcome.path}: timed out")
        elif "Traceback" in outcome.stderr:
            problems.append(f"{outcome.command} {outcome.path}: traceback:\n{outcome.stderr}")
        elif outcome.status not in (0, 2):
            problems.append(f"{outcome.command} {outcome.path}: exit {outcome.status}")
        elif len([line for line in outcome.stderr.splitlines()
                  if line.startswith("gpubudget: error")]) > 1 or (
                outcome.status == 2 and not outcome.stderr.startswith("gpubudget: error: ")):
            problems.append(f"{outcome.command} {outcome.path}: stderr {outcome.stderr!r}")
    print(f"{len(inputs)} inputs, each through report and fit ({len(jobs)} runs)\n")
    statuses = sorted({status for _, status in table})
    print("| command | " + " | ".join(f"exit {s}" for s in statuses) + " |")
    print("| --- |" + " --- |" * len(statuses))
    for command in ("report", "fit"):
        print(f"| {command} | " + " | ".join(str(table[(command, s)]) for s in statuses) + " |")
    print(f"\nproblems (tracebacks, other statuses, several error lines, time-outs): {len(problems)}")
    for problem in problems[:20]:
        print(problem)
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
