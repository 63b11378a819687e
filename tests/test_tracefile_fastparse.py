"""The fast paths (the C scanner, msgspec) and the plain path (json) read every input alike:
the same events, the same last line cut short, the same progress calls, or the same error,
word for word; on real traces, on hand-made edge cases and on the fuzzer's mutations. And
runs of empty lines are skipped a buffer at a time, lines counted."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.fuzz_traces import mutate, record_seeds
from gpubudget.tracefile import PARSER_ENV, TraceError, TraceReader, read_trace
from gpubudget.tracefile.cscan import NATIVE
from gpubudget.tracefile.fastparse import AVAILABLE

from .helpers import finishes, subprocess_env

FAST = [name for name, there in (("c", NATIVE), ("msgspec", AVAILABLE)) if there]
"""The fast paths built or installed here, each compared with the plain path."""
if not FAST:
    pytest.skip("neither fast path is here: no C scanner built, no msgspec (the traces extra)",
                allow_module_level=True)

HEADER = b'{"format": "gpubudget-trace", "version": 1}\n'
ROOT = (b'{"ev": "enter", "t": 0.0, "b": 1, "name": "pool", "parent": null, '
        b'"limit": 1048576, "align": 256, "reserve": 0}\n')


def outcome(path: Path, parser: str, max_bytes: int = 4 << 30) -> tuple[Any, ...]:
    """What reading ``path`` gives: the events and what else the reader says (its progress
    calls too), or the error's message and the progress calls before it."""
    told: list[tuple[int, int]] = []
    try:
        with TraceReader(path, parser=parser, max_bytes=max_bytes,
                         progress=lambda *at: told.append(at)) as reader:
            events = list(reader)  # their repr: an int for a float, a bool for an int differ
            return ("read", reader.header, repr(events), reader.cut_short, reader.lines,
                    reader.bytes_read, told)
    except TraceError as exc:
        return ("refused", str(exc), told)


def alike(path: Path, max_bytes: int = 4 << 30) -> tuple[Any, ...]:
    """The plain path's outcome of ``path``, after checking that every fast path's is the
    same."""
    plain = outcome(path, "json", max_bytes)
    for parser in FAST:
        assert outcome(path, parser, max_bytes) == plain, (parser, path.read_bytes()[-300:])
    return plain


def alloc(**fields: Any) -> bytes:
    record = {"ev": "alloc", "t": 0.5, "b": 1, "size": 4096, "align": 0, "tag": "w",
              "ptr": 8192, "bytes": 4096, "reason": None, **fields}
    return json.dumps(record).encode() + b"\n"


EDGE_LINES: list[bytes] = [
    alloc(), alloc(t=0), alloc(t=-0.0), alloc(t=2**63), alloc(t=2**63 - 1), alloc(t=-1),
    alloc(t=1e308), b'{"ev": "alloc", "t": 1e999, "b": 1, "size": 1, "align": 0, "ptr": 1, '
    b'"bytes": 1}\n', alloc(t=True), alloc(t="1"), alloc(b=2**63), alloc(b=2**64),
    alloc(b=-1), alloc(b=1.0), alloc(size=0), alloc(size=2**63), alloc(size=2**63 - 1,
    bytes=2**63 - 1), alloc(bytes=4095), alloc(bytes=None), alloc(align=3),
    alloc(align=2**62), alloc(align=-2), alloc(ptr=2**63), alloc(ptr=-1), alloc(ptr=True),
    alloc(tag=None), alloc(tag=5), alloc(tag="\ud800"), alloc(tag="é\x1b[2J"),
    alloc(reason="fragmented"), alloc(reason=None, ptr=None), alloc(ptr=None,
    reason="over_limit"), alloc(stack=[]), alloc(stack=None), alloc(stack=[0]),
    alloc(extra={"deep": [1, 2, {"x": None}]}), alloc(b=2),
    b'{"ev": "alloc", "t": 0.5, "b": 1, "size": 4096, "align": 0, "ptr": 8192, '
    b'"bytes": 4096, "ptr": 12288}\n',  # a key twice: the last one counts, as in json
    b'{"ev": "free", "t": 0.5, "b": 1, "ptr": 8192, "ev": "alloc", "size": 1, "align": 0, '
    b'"bytes": 1}\n',
    b'{"ev": "alloc", "t": 0.5, "b": 1, "size": 4096, "align": 0, "tag": "\xff", '
    b'"ptr": 8192, "bytes": 4096}\n',  # not UTF-8
    b'{"ev": "alloc", "t": 0.5, "b": 1, "size": 4096, "align": 0, "ta\xcc": "w", '
    b'"ptr": 8192, "bytes": 4096}\n',  # a key that is not UTF-8 (the fuzzer found it)
    b'{"ev": "free", "t": 0.5, "b": 1, "ptr": 8192, "later": ' + b"9" * 5000 + b'}\n',
    b'{"ev": "free", "t": 0.5, "b": 1, "ptr": 8192, "later": "\xed\xa0\x80"}\n',
    b'  {"ev": "free", "t": 0.5, "b": 1, "ptr": 8192}  \n',
    b'{"ev": "free", "t": 0.5, "b": 1, "ptr": 8192}{}\n',
    b'{"t": 0.5, "b": 1, "ptr": 8192, "ev": "free"}\n',
    b'{"ev": "free", "t": 0.5, "b": 1, "ptr": 8192}\n',
    b'{"ev": "free", "t": 0.5, "b": 1, "ptr": 8192.0}\n',
    b'{"ev": "free", "t": NaN, "b": 1, "ptr": 8192}\n',
    b'{"ev": "free", "t": 0.5, "b": 1, "ptr": ' + b"[" * 5000 + b"]" * 5000 + b"}\n",
    b'{"ev": "frame", "id": 0, "at": "a.py:1 in f"}\n',
    b'{"ev": "free", "t": 0.5, "b": 1, "ptr": 8192}',  # the last line, cut short
    b'{"ev": "free", "t": 0.5, "b": 1, "ptr": 81',
    b"\r\n", b"   \n", b"\n\n\n",
]


@pytest.mark.parametrize("index", range(len(EDGE_LINES)))
def test_edge_lines_read_alike(tmp_path: Path, index: int) -> None:
    """Each edge line after a root and a granted block (so that frees and doubles have
    something to name), and again alone after the root."""
    line = EDGE_LINES[index]
    for number, body in enumerate((alloc() + line, line, line + line)):
        path = tmp_path / f"edge{number}.jsonl"
        path.write_bytes(HEADER + ROOT + body)
        alike(path)


def test_the_fuzzers_mutations_read_alike(tmp_path: Path) -> None:
    seeds = record_seeds(str(tmp_path))
    rng = random.Random(11)
    read = refused = 0
    for number in range(1500):
        seed = rng.choice(seeds).split(b"\n")[:-1]
        path = tmp_path / f"mutated{number}.jsonl"
        path.write_bytes(b"\n".join(mutate(seed, seeds, rng)) + rng.choice([b"\n", b""]))
        plain = alike(path)
        read += plain[0] == "read"
        refused += plain[0] == "refused"
    assert read > 20 and refused > 200  # both kinds were compared


def test_auto_takes_the_fastest_unless_told(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(HEADER + ROOT)
    monkeypatch.delenv(PARSER_ENV, raising=False)
    with TraceReader(path) as reader:
        assert reader.parser == FAST[0]
    for told in ("json", *FAST):
        monkeypatch.setenv(PARSER_ENV, told)
        with TraceReader(path) as reader:
            assert reader.parser == told
    monkeypatch.setenv(PARSER_ENV, "yaml")  # not a parser: the fastest
    with TraceReader(path) as reader:
        assert reader.parser == FAST[0]
    with pytest.raises(ValueError, match="parser must be one of auto, c, msgspec, json"):
        TraceReader(path, parser="yaml")


@pytest.mark.parametrize("parser", ["json", *FAST])
def test_runs_of_empty_lines_are_skipped_fast_and_counted(tmp_path: Path, parser: str) -> None:
    """32 MiB of empty lines between a header and a bad line: the error names the right
    line, soon; the same with a good line reads it."""
    blank = 32 << 20
    path = tmp_path / "blank.jsonl"
    with open(path, "wb") as out:
        out.write(HEADER)
        out.write(b"\n" * blank)
        out.write(ROOT)
        out.write(b"\n \n\n")
        out.write(b'{"ev": "exit", "t": 0.1, "b": 2}\n')

    def read() -> None:
        with pytest.raises(TraceError, match=rf":{blank + 6}: exit event: budget 2 was not "
                           rf"entered before this line$"), \
                TraceReader(path, parser=parser) as reader:
            list(reader)

    finishes(read, 60)
    good = tmp_path / "good.jsonl"
    good.write_bytes(HEADER + b"\n" * 100_000 + ROOT + b"\n" * 3)
    trace = read_trace(good)
    assert [type(e).__name__ for e in trace.events] == ["Enter"]
    with TraceReader(good, parser=parser) as reader:
        list(reader)
        assert reader.lines == 100_005 and reader.bytes_read == good.stat().st_size


def test_empty_lines_count_toward_the_size_limit_of_a_stream() -> None:
    """Standard input has no size to check first: the skipped lines are counted."""
    data = HEADER + b"\n" * 100_000 + ROOT
    done = subprocess.run([sys.executable, "-m", "gpubudget", "report", "--max-size", "50000",
                           "-"], input=data, capture_output=True, env=subprocess_env(),
                          timeout=120)
    err = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, err
    assert err[0].startswith("gpubudget: error: -:") and "passes the limit of" in err[0]
