"""One test's outcome, how a failure is described, and the outcome files.

Nothing here imports CuPy, PyTorch or pytest: the pytest plugin (``cupy_routed``) feeds it
reports, ``compare`` reads what it wrote, and the tests run it on a machine without a GPU.

An outcome file is JSON::

    {"meta": {...the run...}, "tests": {nodeid: record, ...}}

written when the run ends, and streamed as it goes to a JSON-lines file beside it
(``X.json`` -> ``X.jsonl``: a ``{"meta": ...}`` line, one ``{"test": record}`` line per test
as it finishes, an ``{"end": ...}`` line), so a run killed by a time limit still leaves every
test it finished. A record::

    {"nodeid": ..., "outcome": "passed" | "failed" | "skipped" | "xfailed" | "xpassed"
                               | "error" | "crashed",
     "teardown_error": bool, "duration": seconds (setup + call + teardown),
     "phases": {"setup": s, "call": s, "teardown": s},
     "failure": {"when", "exc_type", "chain", "oom", "oom_type", "names_budget",
                 "message", "oom_line"} or null,
     "gpubudget": {...what the routing fixture measured...} or null}

``outcome`` is pytest's: ``error`` for a failed setup, or a failed teardown after a test that
did not fail (pytest counts those as errors too); a failed teardown after a failed test keeps
``failed`` and sets ``teardown_error``. ``crashed``: the worker process died while running
the test (pytest-timeout's ``thread`` method ends a hung worker that way).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

__all__ = [
    "OUTCOMES",
    "Recorder",
    "Run",
    "clean_out_of_memory",
    "describe_failure",
    "exception_chain",
    "is_hang",
    "is_out_of_memory_type",
    "load_run",
    "stream_path",
]

OUTCOMES: Final = ("passed", "failed", "skipped", "xfailed", "xpassed", "error", "crashed")
PROPERTY: Final = "gpubudget"  # user property: what the routing fixture measured
FAILURE: Final = "gpubudget.failure."  # user property prefix, + the phase
MESSAGE_CHARS: Final = 400
OOM_NAME: Final = "OutOfMemoryError"


def exception_chain(exc: BaseException | None, limit: int = 32) -> list[BaseException]:
    """``exc``, its causes and contexts, and the members of exception groups, each once."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    stack = [exc]
    while stack and len(chain) < limit:
        item = stack.pop(0)
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        chain.append(item)
        stack.extend([item.__cause__, item.__context__])
        stack.extend(getattr(item, "exceptions", ()) or ())
    return chain


def is_out_of_memory_type(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error of CuPy or PyTorch (or gpubudget's
    ``BudgetOutOfMemoryError``, a subclass of CuPy's): a class whose name ends with
    ``OutOfMemoryError`` is among its bases."""
    return any(cls.__name__.endswith(OOM_NAME) for cls in type(exc).__mro__)


def _notes(exc: BaseException) -> list[str]:
    notes = getattr(exc, "__notes__", None)
    return [str(note) for note in notes] if isinstance(notes, list) else []


def describe_failure(when: str, exc: BaseException | None, text: str,
                     budget: str | None) -> dict[str, Any]:
    """What a failed phase of a test says: the exception's type, whether it is (or its text
    contains) an ``OutOfMemoryError``, and whether the text names ``budget``.

    ``text`` is the failure as pytest shows it (for CuPy's ``numpy_cupy_*`` decorators that
    is an ``AssertionError`` whose message holds CuPy's error with its traceback); the
    messages and notes of the exceptions in the chain are searched too.
    """
    chain = exception_chain(exc)
    parts = [text]
    for item in chain:
        parts.append(f"{type(item).__name__}: {item}")
        parts.extend(_notes(item))
    everything = "\n".join(parts)
    oom_type = any(is_out_of_memory_type(item) for item in chain)
    oom_line = next((line.strip() for line in everything.splitlines() if OOM_NAME in line), "")
    names = budget is not None and f"'{budget}'" in everything
    message = str(exc) if exc is not None else text
    return {
        "when": when,
        "exc_type": type(exc).__name__ if exc is not None else None,
        "chain": [type(item).__name__ for item in chain],
        "oom_type": oom_type,
        "oom": oom_type or bool(oom_line),
        "names_budget": names,
        "message": message.strip()[:MESSAGE_CHARS],
        "oom_line": oom_line[:MESSAGE_CHARS],
    }


def clean_out_of_memory(failure: dict[str, Any] | None) -> bool:
    """A clean out-of-memory failure: an ``OutOfMemoryError`` (raised, or inside the
    ``AssertionError`` of CuPy's test helpers) whose text names the budget."""
    return bool(failure and failure.get("oom") and failure.get("names_budget"))


def is_hang(record: dict[str, Any]) -> bool:
    """A test that hung: its worker was ended (pytest-timeout's ``thread`` method, a crash),
    or pytest-timeout's ``signal`` method failed it."""
    if record.get("outcome") == "crashed":
        return True
    failure = record.get("failure") or {}
    return str(failure.get("message", "")).startswith("Timeout")


def stream_path(path: str | os.PathLike[str]) -> Path:
    """The JSON-lines file streamed beside an outcome file: ``X.json`` -> ``X.jsonl``."""
    p = Path(path)
    return p.with_suffix(".jsonl") if p.suffix == ".json" else Path(f"{p}.jsonl")


def _merge_properties(record: dict[str, Any], properties: Iterable[tuple[str, object]]) -> None:
    for key, value in properties:
        if key == PROPERTY and isinstance(value, dict):
            record["gpubudget"] = dict(value)
        elif key.startswith(FAILURE) and isinstance(value, dict):
            record.setdefault("_failures", {})[key[len(FAILURE):]] = dict(value)


class Recorder:
    """Turns pytest's reports (setup, call, teardown; ``???`` from xdist for a crashed
    worker) into one record per test, streams finished records to ``stream`` and keeps
    them for :meth:`document`."""

    def __init__(self, stream: str | os.PathLike[str] | None, meta: dict[str, Any]) -> None:
        self.meta = dict(meta)
        self.tests: dict[str, dict[str, Any]] = {}
        self._open: dict[str, dict[str, Any]] = {}
        self._stream: IO[str] | None = None
        if stream is not None:
            Path(stream).parent.mkdir(parents=True, exist_ok=True)
            self._stream = open(stream, "w", encoding="utf-8")  # noqa: SIM115 - kept open
            self._write({"meta": self.meta})

    def _write(self, line: dict[str, Any]) -> None:
        if self._stream is not None:
            self._stream.write(json.dumps(line, sort_keys=True) + "\n")
            self._stream.flush()

    def note_meta(self, **items: Any) -> None:
        """Add to the run's description (streamed as a ``{"meta": ...}`` line)."""
        self.meta.update(items)
        self._write({"meta": items})

    def add(self, nodeid: str, when: str, outcome: str, duration: float, *,
            wasxfail: bool = False, properties: Iterable[tuple[str, object]] = (),
            text: str = "") -> dict[str, Any] | None:
        """Take one report; return the test's record once it is complete."""
        record = self._open.setdefault(nodeid, {
            "nodeid": nodeid, "outcome": None, "teardown_error": False, "duration": 0.0,
            "phases": {}, "failure": None, "gpubudget": None})
        record["phases"][when] = round(duration, 6)
        record["duration"] = round(record["duration"] + duration, 6)
        _merge_properties(record, properties)
        failed = outcome == "failed"
        if when == "setup":
            if failed:
                record["outcome"] = "error"
            elif outcome == "skipped":
                record["outcome"] = "xfailed" if wasxfail else "skipped"
        elif when == "call":
            if failed:
                record["outcome"] = "failed"
            elif outcome == "skipped":
                record["outcome"] = "xfailed" if wasxfail else "skipped"
            else:
                record["outcome"] = "xpassed" if wasxfail else "passed"
        elif when == "teardown":
            if failed:
                record["teardown_error"] = True
                if record["outcome"] != "failed":
                    record["outcome"] = "error"
        else:  # "???": xdist's report for a worker that died running the test
            record["outcome"] = "crashed"
        if failed:
            failures = record.get("_failures", {})
            failure = failures.get(when) or {
                "when": when, "exc_type": "WorkerCrash" if when == "???" else None,
                "chain": [], "oom_type": False, "oom": OOM_NAME in text,
                "names_budget": False, "message": text.strip()[:MESSAGE_CHARS], "oom_line": ""}
            if record["failure"] is None:
                record["failure"] = failure
        if when in ("teardown", "???"):
            return self._finish(nodeid)
        return None

    def _finish(self, nodeid: str, incomplete: bool = False) -> dict[str, Any]:
        record = self._open.pop(nodeid)
        record.pop("_failures", None)
        if record["outcome"] is None:
            record["outcome"] = "passed" if not incomplete else "crashed"
        if incomplete:
            record["incomplete"] = True
        self.tests[nodeid] = record
        self._write({"test": record})
        return record

    def document(self, **end: Any) -> dict[str, Any]:
        """Every record (tests still open are closed as incomplete) and the run's meta."""
        for nodeid in list(self._open):
            self._finish(nodeid, incomplete=True)
        self.meta.update(end)
        self._write({"end": end})
        return {"meta": self.meta, "tests": self.tests}

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


@dataclass
class Run:
    """An outcome file, read back: its meta, its records, and whether the run ended."""

    path: Path
    meta: dict[str, Any]
    tests: dict[str, dict[str, Any]] = field(default_factory=dict)
    complete: bool = True

    @property
    def label(self) -> str:
        return str(self.meta.get("label") or self.path.stem)


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed run may be cut short
                continue
            if isinstance(item, dict):
                yield item


def load_run(path: str | os.PathLike[str]) -> Run:
    """Read an outcome file; where the JSON is missing (the run was killed) its JSON-lines
    stream, marked incomplete. ``FileNotFoundError`` when neither exists."""
    p = Path(path)
    if p.suffix == ".json" and p.is_file():
        document = json.loads(p.read_text(encoding="utf-8"))
        return Run(p, dict(document.get("meta", {})), dict(document.get("tests", {})),
                   complete=True)
    stream = stream_path(p) if p.suffix != ".jsonl" else p
    if not stream.is_file():
        raise FileNotFoundError(f"no outcome file {p} (nor {stream})")
    run = Run(p, {}, {}, complete=False)
    for item in _lines(stream):
        if "meta" in item and isinstance(item["meta"], dict):
            run.meta.update(item["meta"])
        elif "test" in item and isinstance(item["test"], dict):
            run.tests[str(item["test"]["nodeid"])] = item["test"]
        elif "end" in item and isinstance(item["end"], dict):
            run.meta.update(item["end"])
            run.complete = True
    return run
