"""gpubudget.hostledger.children: a registered root's child budgets shown in the ledger file as
they enter and go, with their numbers kept exactly (by both cores alike); hidden, never
refused, when the ledger has no room for them or its lock cannot be had; gone with their
process."""

from __future__ import annotations

import contextlib
import contextvars
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget import Budget, gpu_budget
from gpubudget._core import ledger, native
from gpubudget.hostledger import ChildBudget, host_view
from gpubudget.hostledger.layout import PAGE_ROWS, PAGES
from gpubudget.units import KiB, MiB
from tests.helpers import python_paths, subprocess_env
from tests.test_hostledger_claims import Worker
from tests.test_hostledger_failures import LOCK_HOLDER


@pytest.fixture(autouse=True)
def _ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))
    monkeypatch.delenv("GPUBUDGET_DEVICE_MEMORY", raising=False)


def shown(name: str = "pool") -> tuple[tuple[ChildBudget, ...], int]:
    """The children that the ledger shows of this process's root ``name``, and how many it
    hides."""
    view = host_view(nvml=False)
    (device,) = view.devices
    (entry,) = [entry for entry in device.entries
                if entry.name == name and entry.pid == os.getpid()]
    return device.children_of(entry), entry.hidden


def numbers(budget: Budget, depth: int) -> ChildBudget:
    """What the ledger should show of ``budget``, as the budget itself says it."""
    return ChildBudget(budget.name, depth, budget.limit, budget.reserve, budget.used,
                       budget.peak, budget.available)


def test_children_are_shown_as_a_tree_with_the_numbers_their_budgets_give() -> None:
    with gpu_budget("64MiB", name="pool", backend="host") as pool:
        assert shown() == ((), 0)
        with gpu_budget("16MiB", name="detector", reserve="4MiB") as detector:
            own = detector.allocate(MiB)
            with gpu_budget("8MiB", name="backbone") as backbone:
                deep = backbone.allocate(3 * MiB)
                with gpu_budget("1MiB", name="head") as head:
                    assert shown() == ((numbers(detector, 1), numbers(backbone, 2),
                                        numbers(head, 3)), 0)
                with gpu_budget("2MiB", name="neck") as neck:  # a sibling, after it
                    tiny = neck.allocate(KiB)
                    assert shown()[0] == (numbers(detector, 1), numbers(backbone, 2),
                                          numbers(neck, 3))
                    assert neck.free(tiny or 0)
                assert backbone.free(deep or 0)
            assert detector.free(own or 0)
        with gpu_budget("30MiB", name="classifier") as classifier:
            block = classifier.allocate(20 * MiB)
            assert shown() == ((numbers(classifier, 1),), 0)
            assert shown()[0][0][4:] == (20 * MiB, 20 * MiB, 10 * MiB)  # used, peak, free
            assert classifier.free(block or 0)
        assert pool.used == 0
    assert host_view(nvml=False).devices == ()


def test_a_child_goes_when_it_is_released_not_when_its_scope_ends() -> None:
    with gpu_budget("8MiB", name="pool", backend="host") as pool:
        context = contextvars.copy_context()
        child = gpu_budget("2MiB", name="leaky")
        context.run(child.__enter__)
        block = child.allocate(MiB)
        context.run(child.__exit__, None, None, None)  # exited, a block still live
        assert [c.name for c in shown()[0]] == ["leaky"] and shown()[0][0].used == MiB
        assert child.free(block or 0)  # the last block: released
        assert shown() == ((), 0)
        with gpu_budget("2MiB", name="next") as after:  # its row is taken again
            assert shown()[0] == (numbers(after, 1),)
        assert pool.used == 0


def test_the_rows_follow_every_charge_reserve_resize_and_reset_peak_exactly() -> None:
    with gpu_budget("4MiB", name="pool", backend="host"):
        with gpu_budget("2MiB", name="model", reserve="512KiB") as model:
            def row() -> tuple[int, int, int]:
                (child,), _ = shown()
                return child.used, child.peak, child.free

            assert row() == (0, 0, 2 * MiB)  # its reserve counts in the pool, not in it
            first = model.allocate(256 * KiB)
            assert row() == (256 * KiB, 256 * KiB, 2 * MiB - 256 * KiB)
            second = model.allocate(768 * KiB)
            assert row() == (MiB, MiB, MiB)
            assert model.allocate(2 * MiB) is None and row() == (MiB, MiB, MiB)  # denied
            moved = model.resize(second or 0, 1280 * KiB)
            assert moved is not None and row() == (1536 * KiB, 1536 * KiB, 512 * KiB)
            assert model.free(first or 0) and row()[:2] == (1280 * KiB, 1536 * KiB)
            model.reset_peak()
            assert row()[:2] == (1280 * KiB, 1536 * KiB)  # follows once used reaches it
            again = model.allocate(KiB)
            assert row()[:2] == (1281 * KiB, 1281 * KiB) == (model.used, model.peak)
            assert model.free(again or 0) and model.free(moved)
            assert row() == (0, 1281 * KiB, 2 * MiB)


def test_both_cores_publish_every_level_alike() -> None:
    """The C accounts and the Python ones, on random trees with words at every level."""
    if native is None:
        pytest.skip("the C core is not built here")
    rng = random.Random(7)
    for _ in range(200):
        pairs: list[tuple[Any, Any, memoryview, memoryview]] = []
        own: list[int] = []  # bytes charged to each account itself (its blocks)
        for i in range(rng.randint(1, 6)):
            parent = pairs[rng.randrange(i)] if i else (None, None)
            limit = rng.randint(0, 4000)
            reserve = rng.choice([0, 0, rng.randint(0, 500)]) if i else 0
            c = native.Account(f"a{i}", limit, reserve, parent[0])
            py = ledger.PYTHON[0](f"a{i}", limit, reserve, parent[1])
            words = (memoryview(bytearray(16)).cast("Q"), memoryview(bytearray(16)).cast("Q"))
            if rng.random() < 0.7:  # some levels shown, some not (hidden, or the root
                c.published, py.published = words  # unregistered)
            pairs.append((c, py, *words))
            own.append(0)
        py_charge, py_refusal = ledger.PYTHON[2], ledger.PYTHON[4]
        for _ in range(30):
            index = rng.randrange(len(pairs))
            c, py, _, _ = pairs[index]
            delta = rng.randint(-300, 600)
            if py_refusal(py, delta) is None and -delta <= own[index]:
                native.charge(c, delta)
                py_charge(py, delta)
                own[index] += delta
            if rng.random() < 0.1:
                c.peak, py.peak = c.used, py.used  # reset_peak()
            for c, py, c_words, py_words in pairs:
                assert list(c_words) == list(py_words)
                assert (c.used, c.peak) == (py.used, py.peak)
                if c.published is not None:
                    assert c_words[0] == c.used


def test_the_fast_path_and_the_python_methods_publish_the_same_rows() -> None:
    """Two roots fed the same operations, one through the C fast path where the C core runs,
    the other through the Python methods: their children's rows agree at every step."""
    with contextlib.ExitStack() as stack:
        trees: list[tuple[contextvars.Context, Budget, Budget, list[tuple[Budget, int]]]] = []
        for name, slow in (("pool", False), ("slow pool", True)):
            context = contextvars.Context()
            root = gpu_budget("16MiB", name=name, backend="host")
            context.run(root.__enter__)
            stack.callback(context.run, root.__exit__, None, None, None)
            if slow:
                python_paths(root)
            child = gpu_budget("8MiB", name="model", reserve="1MiB")
            context.run(child.__enter__)
            grandchild = gpu_budget("4MiB", name="layer")
            context.run(grandchild.__enter__)
            trees.append((context, child, grandchild, []))
        rng = random.Random(3)
        for _ in range(300):
            size, pick, drop = rng.randint(1, 400) * KiB, rng.random(), rng.random() < 0.4
            for context, child, grandchild, blocks in trees:
                budget = child if pick < 0.5 else grandchild
                if drop and blocks:
                    owner, address = blocks.pop(int(pick * len(blocks)))
                    assert owner.free(address)
                else:
                    granted = budget.allocate(size)
                    if granted is not None:
                        blocks.append((budget, granted))
            assert shown("pool") == shown("slow pool")
        for context, child, grandchild, blocks in trees:
            for owner, address in blocks:
                assert owner.free(address)
            context.run(grandchild.__exit__, None, None, None)
            context.run(child.__exit__, None, None, None)
        assert shown("pool") == shown("slow pool") == ((), 0)


@contextlib.contextmanager
def siblings(parent_context: contextvars.Context, count: int
             ) -> Iterator[list[tuple[Budget, contextvars.Context]]]:
    """``count`` children of the budget active in ``parent_context``, each entered in a copy
    of it (so that all are open at once), and their contexts; those still in the list are
    left at the end."""
    entered: list[tuple[Budget, contextvars.Context]] = []
    try:
        for index in range(count):
            context = parent_context.run(contextvars.copy_context)
            child = gpu_budget("1MiB", name=f"child-{index}")
            context.run(child.__enter__)
            entered.append((child, context))
        yield entered
    finally:
        for child, context in reversed(entered):
            context.run(child.__exit__, None, None, None)


def test_a_full_ledger_hides_children_and_never_fails_a_budget(workers: list[Worker]) -> None:
    room = PAGES * (PAGE_ROWS - 1)
    worker = Worker()  # another process's root with a child: a page, until it dies
    workers.append(worker)
    assert worker.ask("enter 8MiB elsewhere").startswith("ok")
    assert worker.ask("child 1MiB its-child").startswith("ok")
    os.kill(worker.pid, signal.SIGKILL)
    worker.process.wait()
    with gpu_budget("64MiB", name="pool", backend="host") as pool:  # its claim clears the
        context = contextvars.copy_context()                          # dead process's slot
        with siblings(context, room + 3) as children:
            for child, _ in children[-5:]:  # every budget works, shown or hidden
                block = child.allocate(KiB)
                assert block is not None and child.free(block)
                child.check()
            rows, hidden = shown()
            assert (len(rows), hidden) == (room, 3)  # the dead process's page was taken too
            assert [row.name for row in rows[:2]] == ["child-0", "child-1"]
            child, its_context = children.pop()  # a hidden one goes
            its_context.run(child.__exit__, None, None, None)
            assert shown()[1] == 2
            with siblings(context, 1) as (extra,), siblings(extra[1], 1) as (below,):
                assert shown()[1] == 4  # no row: hidden, and so its child, shown or not
                block = below[0].allocate(KiB)
                assert block is not None and below[0].free(block)
            assert shown()[1] == 2
            child, its_context = children.pop(0)  # a shown one goes: its row is free
            its_context.run(child.__exit__, None, None, None)
            with siblings(context, 1) as (extra,):
                rows, hidden = shown()
                assert (len(rows), hidden, rows[-1].name) == (room, 2, "child-0")
        assert shown() == ((), 0) and pool.used == 0


def test_children_wait_briefly_for_the_lock_then_are_hidden_not_refused() -> None:
    with gpu_budget("8MiB", name="pool", backend="host"):
        path = Path(os.environ["GPUBUDGET_LEDGER_DIR"]) / "host.ledger"
        holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(path)],
                                  stdout=subprocess.PIPE, env=subprocess_env())
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
            with gpu_budget("2MiB", name="first") as first:  # needs a page: the lock
                block = first.allocate(KiB)
                assert block is not None and shown() == ((), 1)
                assert first.free(block)
        finally:
            holder.kill()
            holder.wait()
            if holder.stdout is not None:
                holder.stdout.close()
        assert shown() == ((), 0)
        with gpu_budget("2MiB", name="second") as second:
            assert shown()[0] == (numbers(second, 1),)


def test_an_unregistered_root_shows_nothing_and_its_children_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUBUDGET_LEDGER", "0")
    with gpu_budget("8MiB", name="pool", backend="host"), gpu_budget("1MiB") as child:
        assert child.allocate(KiB) is not None
        assert host_view(nvml=False).devices == ()


def test_another_process_children_are_read_and_go_with_it(workers: list[Worker]) -> None:
    worker = Worker()
    workers.append(worker)
    assert worker.ask("enter 64MiB server").startswith("ok")
    assert worker.ask("child 16MiB model").startswith("ok")
    assert worker.ask("allocate 1048576").startswith("ok")
    assert worker.ask("child 4MiB cache").startswith("ok")
    (device,) = host_view(nvml=False).devices
    (entry,) = device.entries
    assert device.children_of(entry) == (
        ChildBudget("model", 1, 16 * MiB, 0, MiB, MiB, 15 * MiB),
        ChildBudget("cache", 2, 4 * MiB, 0, 0, 0, 4 * MiB))
    assert worker.ask("leave").startswith("ok")
    (device,) = host_view(nvml=False).devices
    assert [child.name for child in device.children_of(device.entries[0])] == ["model"]
    os.kill(worker.pid, signal.SIGKILL)
    worker.process.wait()
    assert host_view(nvml=False).devices == ()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.close()


def test_a_failure_while_showing_a_child_never_reaches_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubudget.hostledger.children import Family

    with gpu_budget("8MiB", name="pool", backend="host"):
        with gpu_budget("1MiB", name="shown") as first:
            def broken(*args: object) -> None:
                raise RuntimeError("a bug")

            monkeypatch.setattr(Family, "opened", broken)
            with pytest.warns(RuntimeWarning, match="child budgets are no longer shown in "
                                                    "the host ledger: RuntimeError: a bug"):
                with gpu_budget("1MiB", name="second") as second:
                    block = second.allocate(KiB)
                    assert block is not None and second.free(block)
                    second.check()
            assert shown() == ((), 0)  # none shown from then on, the first one included
            block = first.allocate(KiB)
            assert block is not None and first.free(block) and first.used == 0


class _Alarm:
    """Raises a signal handler's ``TimeoutError`` (an ``OSError`` without an error number)."""

    def __init__(self, *args: object) -> None:
        raise TimeoutError("alarm")


class _AlarmedRow:
    """The struct of a child's row, whose write raises as a signal handler's exception would."""

    def pack_into(self, *args: object) -> None:
        raise TimeoutError("alarm")


@pytest.mark.parametrize("where", ["the file's lock", "the child's row"])
def test_a_signal_handlers_timeout_while_showing_a_child_propagates_and_leaves_no_row(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubudget import current_budget
    from gpubudget.hostledger import children
    from gpubudget.hostledger.book import DeviceBook
    from gpubudget.hostledger.children import Family

    with gpu_budget("8MiB", name="pool", backend="host") as pool:
        with monkeypatch.context() as patch:
            if where == "the file's lock":  # its first child takes a page
                patch.setattr(DeviceBook, "_take", _Alarm)
            else:
                patch.setattr(children, "CHILD", _AlarmedRow())
            with pytest.raises(TimeoutError, match="alarm"):  # not taken for the file's failure
                with gpu_budget("1MiB", name="cut"):
                    pytest.fail("entered")
        assert current_budget() is pool
        pool.check()
        assert pool._node.tree is not None
        family = pool._node.tree.recorder.family
        assert isinstance(family, Family) and family.rows == {}  # shown still, nothing hidden
        assert shown() == ((), 0)
        with gpu_budget("2MiB", name="next") as after:
            assert shown()[0] == (numbers(after, 1),)
        # one page taken, each of its rows free again: none was lost to the alarm
        assert len(family.pages) == 1 and len(family.free) == PAGE_ROWS - 1


_FORKED = """
import contextvars, os, sys
from gpubudget import gpu_budget
from gpubudget.hostledger import host_view

def rows():
    (device,) = host_view(nvml=False).devices
    (entry,) = device.entries
    return device.children_of(entry)

with gpu_budget("8MiB", name="pool", backend="host"):
    context = contextvars.copy_context()
    model = gpu_budget("4MiB", name="model")
    context.run(model.__enter__)
    block = model.allocate(1 << 20)
    before = rows()
    pid = os.fork()
    if pid == 0:  # the parent's rows are not the child's: it leaves them alone
        with gpu_budget("1MiB", name="own") as own:  # a root of its own here
            pass
        model.free(block)  # refused here (forked): nothing changes
        context.run(model.__exit__, None, None, None)
        sys.exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    print(rows() == before, [child.name for child in before], before[0].used)
    model.free(block)
    context.run(model.__exit__, None, None, None)
    print(rows())
"""


def test_a_forked_process_leaves_its_parents_rows_alone(tmp_path: Path) -> None:
    found = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True,
                           env=subprocess_env(GPUBUDGET_LEDGER_DIR=str(tmp_path / "forked")),
                           timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines() == ["True ['model'] 1048576", "()"]
