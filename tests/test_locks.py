"""The lock rule (``gpubudget/_core/locks.py``): a lock is taken in a ``with`` block, or by
an ``acquire()`` that a ``try`` whose ``finally`` releases it follows at once; and a tree's
waiters are let in (:func:`~gpubudget._core.locks.let_in`)."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

from gpubudget._core.locks import Turns, let_in, new_lock

PACKAGE = Path(__file__).resolve().parent.parent / "gpubudget"


def _name(node: ast.expr) -> str:
    return ast.unparse(node)


def _released_by(statement: ast.stmt, lock: str) -> bool:
    """Whether ``statement`` is a ``try`` whose ``finally`` releases ``lock``."""
    return isinstance(statement, ast.Try) and any(
        isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
        and call.func.attr == "release" and _name(call.func.value) == lock
        for final in statement.finalbody for call in ast.walk(final))


def acquisitions_breaking_the_rule(source: str) -> list[str]:
    """``line: lock`` for each ``acquire()`` not followed at once by a ``try`` whose
    ``finally`` releases the same lock (as the statement itself, or as the condition of a
    ``while``/``if`` whose body starts with it)."""
    broken = []
    for parent in ast.walk(ast.parse(source)):
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(parent, field, None)
            if not isinstance(statements, list):
                continue
            for index, statement in enumerate(statements):
                if not isinstance(statement, ast.stmt) or isinstance(
                        statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                heads: list[ast.AST] = [statement]
                if isinstance(statement, (ast.While, ast.If)):
                    heads = [statement.test]
                for head in heads:
                    for call in ast.walk(head):
                        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                                and call.func.attr == "acquire"):
                            continue
                        lock = _name(call.func.value)
                        after = (statement.body[:1] if isinstance(statement, (ast.While, ast.If))
                                 else statements[index + 1:index + 2])
                        if not (after and _released_by(after[0], lock)):
                            broken.append(f"{call.lineno}: {lock}")
    return broken


def test_every_lock_of_the_package_is_taken_by_the_rule() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        broken = acquisitions_breaking_the_rule(path.read_text())
        if broken:
            found[str(path.relative_to(PACKAGE))] = broken
    assert found == {}


def test_the_rule_is_checked() -> None:
    assert acquisitions_breaking_the_rule(
        "lock.acquire()\nwork()\nlock.release()\n") == ["1: lock"]
    assert acquisitions_breaking_the_rule(
        "lock.acquire()\ntry:\n    work()\nexcept BaseException:\n    lock.release()\n"
        "    raise\n") == ["1: lock"]  # released only on the way out of an exception
    assert acquisitions_breaking_the_rule(
        "self.a.acquire()\ntry:\n    work()\nfinally:\n    self.b.release()\n") == ["1: self.a"]
    assert acquisitions_breaking_the_rule(
        "self.a.acquire()\ntry:\n    work()\nfinally:\n    self.a.release()\n") == []
    assert acquisitions_breaking_the_rule(
        "while lock.acquire(False):\n    try:\n        work()\n    finally:\n"
        "        lock.release()\n") == []
    assert acquisitions_breaking_the_rule("with lock:\n    work()\n") == []


def test_a_thread_that_releases_lets_a_waiting_thread_in_first() -> None:
    lock, turns = new_lock(), Turns()
    order: list[str] = []
    lock.acquire()
    try:
        def wait() -> None:
            turns.waiting += 1
            with lock:
                turns.arrived()
                order.append("waiter")

        waiter = threading.Thread(target=wait)
        waiter.start()
        while turns.waiting == 0:  # the waiter is on its way in
            pass
    finally:
        lock.release()
    let_in(turns)  # returns once the waiter got in
    with lock:
        order.append("again")
    waiter.join()
    assert order == ["waiter", "again"]


def test_a_count_left_by_a_wait_cut_short_is_forgotten() -> None:
    turns = Turns()
    turns.waiting = 1  # a wait an exception ended before it took the lock
    let_in(turns)
    assert turns.waiting == 0
    let_in(turns)  # and the next call does not wait
