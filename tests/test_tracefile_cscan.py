"""The C scanner (``tracefile/_scan.c``) against the plain path: it takes the writer's lines,
reads every number, string, space and key order as ``json`` does (or leaves the line to
it), keeps the reader's line and byte counts, progress calls and size limit exact across its
buffers; and a replay that lets it replay granted allocations and frees itself gives the
same result, report for report and number for number, as the replay's Python loop."""

from __future__ import annotations

import importlib.machinery
import json
import math
import os
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.fuzz_traces import mutate, record_seeds
from benchmarks.trace_gen import record_server
from gpubudget import gpu_budget, label
from gpubudget.replay import ReplayResult, replay
from gpubudget.replay.run import Replayer
from gpubudget.tracefile import MAX_LINE_BYTES, TraceError, TraceReader, writer_for
from gpubudget.tracefile.checks import Validator
from gpubudget.tracefile.cscan import NATIVE, scanner
from gpubudget.adapter import hooks

from .helpers import subprocess_env
from .test_extensions import _copy, _env
from .test_tracefile_fastparse import HEADER, ROOT, alike, alloc

pytestmark = pytest.mark.skipif(not NATIVE, reason="the C scanner is not built (no C "
                                "compiler at install, or GPUBUDGET_PURE=1)")

MiB = 2**20
FRAMES = (b'{"ev": "frame", "id": 0, "at": "a.py:1 in f"}\n'
          b'{"ev": "frame", "id": 1, "at": "b.py:2 in g"}\n')
CHILD = (b'{"ev": "enter", "t": 0.0, "b": 2, "name": "model", "parent": 1, "limit": 524288, '
         b'"align": 256, "reserve": 0}\n')


def test_the_scanner_takes_the_writers_allocations_and_frees(tmp_path: Path) -> None:
    """A recorded trace: every line but the entries, exits and denials is taken in C."""
    path = tmp_path / "run.jsonl"
    with gpu_budget("64MiB", name="pool", backend="host", trace=str(path)) as pool:
        with gpu_budget("32MiB", name="model") as model, label("weights"):
            blocks = [model.allocate(1000 * (k + 1), tag=f"t{k}") for k in range(50)]
            blocks += [model.allocate(4096) for _ in range(10)]  # the label's tag
            assert model.allocate(64 * MiB) is None  # a denial: the plain path's
            for block in blocks:
                assert block is not None and model.free(block)
        assert pool.allocate(1) is not None
    writer_for(str(path)).flush()
    data = path.read_bytes()
    plain = sum(1 for line in data.splitlines()[1:]
                if b'"enter"' in line or b'"exit"' in line or b'"ptr": null' in line)
    scanned = 0
    validator = Validator()
    scan = scanner(validator)
    assert scan is not None
    position, lines = data.index(b"\n") + 1, 0
    while position < len(data):
        scan.scan(data, position, lines, position, 1 << 62, 1 << 62)
        scanned += scan.lines - lines
        lines, position = scan.lines, scan.position
        if position < len(data):
            end = data.index(b"\n", position) + 1
            record = json.loads(data[position:end])
            assert record["ev"] in ("enter", "exit") or record["ptr"] is None, record
            validator.handlers[record["ev"]](record)
            lines, position = lines + 1, end
    assert scanned == data.count(b"\n") - 1 - plain and scanned == 50 + 10 + 60 + 1


def variant_lines(rng: random.Random) -> list[bytes]:
    """Lines of every shape the scanner meets or must leave: numbers, strings, spaces,
    key orders, duplicates, unknown keys, stacks, frees."""
    numbers = ["0", "1", "2", "7", "4096", "01", "-0", "-1", "1.", ".5", "1e", "1e+", "1.5",
               str(2**53 + 1), str(2**63 - 1), str(2**63), str(10**19 - 1), str(10**19),
               str(2**64), "9" * 20, "1e5", "1E5", "1e-05", "2.5e+3", "1e308", "2e308",
               "1e-400", "4.9e-324", "0.1", "0.30000000000000004", "123456789012345.6",
               "12345678901234.56", "9007199254740993.0", "0.000000001", "1.0000000000000002",
               "-0.0", "true", "null", '"1"', "[]", "[1]", "{}"]
    texts = ['"w"', '""', '"\\u00e9"', '"\\n"', '"caf\xc3\xa9"', '"\xe4\xb8\xad"',
             '"\xf0\x9f\x98\x80"', '"\xff"', '"\xc0\x80"', '"\xed\xa0\x80"', '"a\tb"',
             "null", "true", "5", "[]"]
    spaces = [" ", "", "  ", "\t", " \t", "\r", " \r "]
    keys = {"ev": '"alloc"', "t": "0.5", "b": "1", "size": "4096", "align": "0",
            "tag": '"w"', "ptr": "8192", "bytes": "4096", "reason": "null"}
    lines: list[bytes] = []
    for _ in range(600):
        fields = dict(keys)
        kind = rng.random()
        if kind < 0.3:
            fields = {"ev": '"free"', "t": "0.5", "b": "1", "ptr": "4096"}
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            key = rng.choice([*fields, "stack", "extra", "tag"])
            if key in ("tag", "ev", "reason") and rng.random() < 0.7:
                value = rng.choice(texts + ['"free"', '"alloc"', '"fragmented"'])
            elif key == "stack":
                value = rng.choice(["[0]", "[0, 1]", "[ 1 ,0 ]", "[]", "[2]", "[-1]",
                                    "[1.0]", "[0,]", "null", '"x"', str([0] * 513)])
            else:
                value = rng.choice(numbers + texts)
            fields[key] = value
        items = list(fields.items())
        if rng.random() < 0.2:
            rng.shuffle(items)
        if rng.random() < 0.05:
            items.append(rng.choice(items))  # a key twice
        gap = rng.choice(spaces) if rng.random() < 0.3 else " "
        body = ("," + gap).join(f'"{key}":{gap}{value}' for key, value in items)
        tail = rng.choice(["", "", "", " ", "\r", " \t"])
        lines.append(("{" + body + "}" + tail + "\n").encode("latin-1"))
    return lines


def test_every_shape_of_line_reads_as_json_reads_it(tmp_path: Path) -> None:
    rng = random.Random(5)
    kinds = {"read": 0, "refused": 0}
    for number, line in enumerate(variant_lines(rng)):
        path = tmp_path / f"v{number}.jsonl"
        before = alloc(ptr=4096) if rng.random() < 0.8 else b""
        after = b'{"ev": "free", "t": 0.75, "b": 1, "ptr": 8192}\n' if rng.random() < 0.5 else b""
        path.write_bytes(HEADER + ROOT + CHILD + FRAMES + before + line + after)
        kinds[alike(path)[0]] += 1
    assert kinds["read"] > 150 and kinds["refused"] > 150, kinds


def test_times_read_exactly_as_float_reads_them(tmp_path: Path) -> None:
    """Random doubles, and the writer's times rounded to nanoseconds: the scanner's quick
    division agrees with ``float()`` on every one (compared through the plain path)."""
    rng = random.Random(3)
    values = [rng.uniform(0, 10) for _ in range(3000)]
    values += [round(rng.uniform(0, 100_000), 9) for _ in range(3000)]
    values += [struct.unpack("d", struct.pack("Q", rng.getrandbits(62)))[0] for _ in range(500)]
    values += [v for v in (0.1, 0.2, 0.3, 1e-9, 123456.123456789, 2**53 - 1.0) if v >= 0]
    body = b"".join(json.dumps({"ev": "alloc", "t": v, "b": 1, "size": 16, "align": 0,
                                "tag": None, "ptr": 4096 * (k + 1), "bytes": 16,
                                "reason": None}).encode() + b"\n"
                    for k, v in enumerate(value for value in values if math.isfinite(value)))
    path = tmp_path / "times.jsonl"
    path.write_bytes(HEADER + ROOT + body)
    with TraceReader(path, parser="c") as reader:
        times = [event.t for event in reader][1:]  # after the entry
    expected = [float(json.dumps(v)) for v in values if math.isfinite(v)]
    assert [struct.pack("d", t) for t in times] == [struct.pack("d", t) for t in expected]
    assert alike(path)[0] == "read"


def test_counts_progress_and_limits_hold_across_buffers(tmp_path: Path) -> None:
    """A trace of 3 MiB (the reader's buffer is 1 MiB): lines cut by every buffer's end,
    blank lines, a denial now and then, progress every 16,384 lines; read whole, and cut by
    the size limit at many places (at a line's end, inside a line)."""
    rng = random.Random(8)
    parts = [HEADER, ROOT]
    live: list[int] = []
    ptr = 0
    while sum(map(len, parts)) < 3 * MiB:
        if live and rng.random() < 0.45:
            parts.append(json.dumps({"ev": "free", "t": 1.5, "b": 1,
                                     "ptr": live.pop(rng.randrange(len(live)))}).encode()
                         + b"\n")
        elif rng.random() < 0.01:
            parts.append(alloc(ptr=None, reason="over_limit", size=2**40))
        elif rng.random() < 0.01:
            parts.append(b"\n" * rng.randrange(1, 4))
        else:
            ptr += 4096
            live.append(ptr)
            parts.append(alloc(ptr=ptr, tag="x" * rng.randrange(0, 300), t=rng.random()))
    path = tmp_path / "big.jsonl"
    data = b"".join(parts)
    path.write_bytes(data)
    assert alike(path)[0] == "read"
    ends = [index + 1 for index in range(len(data)) if data[index] == 10]
    for limit in [*rng.sample(ends, 6), *rng.sample(range(len(data)), 6), MiB, MiB + 1]:
        assert alike(path, max_bytes=limit)[0] == ("read" if limit >= len(data) else "refused")


def test_a_line_over_the_limit_among_scanned_lines(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_bytes(HEADER + ROOT + alloc(ptr=4096) * 1 + alloc(ptr=8192, tag="x" * MAX_LINE_BYTES)
                     + alloc(ptr=12288))
    found = alike(path)
    assert found[0] == "refused" and "line longer than" in found[1]


def test_a_stream_is_scanned_too() -> None:
    """Standard input (a pipe: no seeking) reads as a file does."""
    body = HEADER + ROOT + b"".join(alloc(ptr=4096 * (k + 1)) for k in range(5000))
    code = ("import sys; from gpubudget.tracefile import TraceReader\n"
            "r = TraceReader('-', parser=sys.argv[1]); print(repr(list(r)), r.lines)")
    outputs = {parser: subprocess.run([sys.executable, "-c", code, parser], input=body,
                                      capture_output=True, env=subprocess_env(), timeout=120)
               for parser in ("c", "json")}
    assert outputs["c"].returncode == 0, outputs["c"].stderr
    assert outputs["c"].stdout == outputs["json"].stdout and b"5003" in outputs["c"].stdout


def test_the_pure_build_leaves_the_scanner_out() -> None:
    code = ("from gpubudget.tracefile.cscan import NATIVE; from gpubudget.tracefile import "
            "TraceReader; import sys; print(NATIVE)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**subprocess_env(), "GPUBUDGET_PURE": "1"}, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_a_checkout_edited_since_its_build_reads_without_the_scanner(tmp_path: Path) -> None:
    """As the C core does: a source checkout whose ``_scan.c`` is newer than its build runs
    without it and says how to rebuild; an installed package runs what was built."""
    ask = ("from gpubudget.tracefile.cscan import NATIVE; from gpubudget.tracefile import "
           "TraceReader; print(NATIVE)")
    for checkout, expected in ((True, "False"), (False, "True")):
        src = _copy(tmp_path / str(checkout), checkout=checkout)
        built = next(path for suffix in importlib.machinery.EXTENSION_SUFFIXES
                     for path in [src / "gpubudget" / "tracefile" / ("_scan" + suffix)]
                     if path.exists())
        os.utime(built, (1_000_000, 1_000_000))  # built long before the source was edited
        done = subprocess.run([sys.executable, "-W", "always", "-c", ask], cwd=tmp_path,
                              text=True, capture_output=True, timeout=60, env=_env(src))
        assert done.returncode == 0 and done.stdout.split() == [expected], done.stderr
        warned = done.stderr.count("RuntimeWarning")
        assert warned == (checkout and 1), done.stderr
        if checkout:
            assert "_scan.c is newer" in done.stderr and "build_ext --inplace" in done.stderr


# -- a replay through the scanner is the replay's Python loop ----------------------------


def outcome(result: ReplayResult) -> tuple[Any, ...]:
    """Everything a replay answers: every report with its timeline, every budget."""
    return (tuple(report.as_dict(timeline=True) for report in result.reports), result.roots,
            result.budgets, result.cut_short, result.after_release)


def replayed(path: Path, parser: str, **options: Any) -> Any:
    try:
        with TraceReader(path, parser=parser) as reader:
            return outcome(replay(reader, **options)), reader.lines, reader.bytes_read
    except TraceError as exc:
        return str(exc)


def recorded_programs(folder: Path) -> list[Path]:
    """Traces with what the scanner hands back to Python: allocations without a tag (the
    label of their context), blocks of exited and released budgets, stacks, resizes,
    leaks, denials; and a server trace."""
    paths = []
    for index, seed in enumerate(record_seeds(str(folder))):
        paths.append(folder / f"seed{index}.jsonl")
        paths[-1].write_bytes(seed)
    path = folder / "mixed.jsonl"
    with gpu_budget("64MiB", name="pool", backend="host", trace=str(path)) as pool:
        model = gpu_budget("16MiB", name="model", track_stacks=True)
        with model:
            kept = [model.allocate(100_000 * (k + 1)) for k in range(8)]  # no tag
            with label("labelled"):
                kept.append(model.allocate(4096))
            assert model.allocate(32 * MiB) is None
        for block in kept[:4]:  # after the scope: the budget is exited, still serving
            assert block is not None and model.free(block)
        late = model.allocate(8192, tag="late")
        for block in (*kept[4:], late):
            assert block is not None and model.free(block)  # the last one releases it
        engine = gpu_budget("8MiB", name="engine")
        with engine:
            hooks(engine).pin()  # as a TensorRT engine keeps its budget: not in the trace
            first = engine.allocate(4096, tag="weights")
        assert first is not None and engine.free(first)  # released here in a replay
        again = engine.allocate(8192, tag="context")  # so replayed after its release
        assert again is not None and engine.free(again)
        hooks(engine).unpin()
        assert pool.allocate(MiB, tag="leak") is not None
    writer_for(str(path)).flush()
    paths.append(path)
    server = folder / "server.jsonl"
    record_server(str(server), 20_000, seed=4)
    paths.append(server)
    return paths


def test_a_free_by_another_budget_is_refused_alike(tmp_path: Path) -> None:
    path = tmp_path / "other.jsonl"
    path.write_bytes(HEADER + ROOT + CHILD + alloc(ptr=4096)
                     + b'{"ev": "free", "t": 0.6, "b": 2, "ptr": 4096}\n')
    found = alike(path)
    assert found[0] == "refused" and "is held by budget 1" in found[1], found


def test_a_replay_through_the_scanner_is_the_python_replay(tmp_path: Path) -> None:
    """Every recorded program, replayed as recorded, with its root's limit halved (denials
    in the replay), and inside a label (which allocations without a tag must not take: they
    replay in their budget's own context)."""
    for path in recorded_programs(tmp_path):
        plain = replayed(path, "json")
        assert replayed(path, "c") == plain, path
        with label("outside"):
            assert replayed(path, "c") == plain, path
        root = next(iter(plain[0][2]))  # the first budget: a root
        tight = {root: plain[0][2][root].peak // 2 or 1}  # denials in the replay
        assert replayed(path, "c", limits=tight) == replayed(path, "json", limits=tight), path


def test_mutated_traces_replay_alike(tmp_path: Path) -> None:
    seeds = [path.read_bytes() for path in recorded_programs(tmp_path)[:4]]
    rng = random.Random(2)
    compared = 0
    for number in range(400):
        seed = rng.choice(seeds).split(b"\n")[:-1]
        path = tmp_path / f"m{number}.jsonl"
        path.write_bytes(b"\n".join(mutate(seed, [s for s in seeds], rng)) + b"\n")
        plain = replayed(path, "json")
        assert replayed(path, "c") == plain, path.read_bytes()
        compared += not isinstance(plain, str)
    # how many mutations still read depends on the ids the recordings got (budgets made
    # earlier in the process): about 20 of 300 alone, fewer in the whole suite
    assert compared > 8  # traces that read, and replay, compared whole


def test_allocations_after_a_release_are_skipped_alike(tmp_path: Path) -> None:
    path = recorded_programs(tmp_path)[3]
    assert replay(TraceReader(path, parser="c")).after_release == 1


def test_a_replay_stopped_at_its_first_denial_stops_alike(tmp_path: Path) -> None:
    """``fit``'s question (is anything denied?) raised out of the scanner's loop: the same
    answer, the same shortfall, the reader at the same line."""
    path = recorded_programs(tmp_path)[-1]
    budgets = replay(path).budgets
    answers = set()
    for limit in (64 * MiB, 512 * MiB, 4 << 30, 64 << 30):
        seen = []
        for parser in ("c", "json"):
            with TraceReader(path, parser=parser) as reader:
                run = Replayer(dict.fromkeys(budgets, limit))
                denied = run.denied(reader.events(sink=run.sink()))
                seen.append((denied, run.shortfall, reader.lines, reader.bytes_read))
        assert seen[0] == seen[1], limit
        answers.add(seen[0][0])
    assert answers == {True, False}
