"""The tree's operations under faults: each either happens whole or changes nothing.

Every test ends by checking, from outside, that ``used``, the live blocks and the arena agree
(:func:`tests.helpers.consistent`).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from gpubudget import (
    BudgetError,
    BudgetNestingError,
    InvariantError,
    current_budget,
    gpu_budget,
    label,
)
from gpubudget._core import LiveEntry
from gpubudget.backends.host import HostBackend, HostReservation
from gpubudget.backends.virtual import HostVirtualRange
from gpubudget.units import KiB, MiB
from gpubudget.adapter import hooks
from tests.helpers import consistent, fill, free_elsewhere, holds, python_paths


def test_a_trace_that_fails_stops_with_one_warning_and_the_budget_goes_on(tmp_path: Any) -> None:
    path = tmp_path / "full.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpu_budget("64KiB", name="pool", trace=str(path)) as pool:
            from gpubudget.tracefile import writer_for

            full = os.open("/dev/full", os.O_WRONLY)  # every write: no space left on device
            held = writer_for(path)._fd  # open: the root is
            assert held is not None
            os.dup2(full, held)  # the disk is full from now on
            os.close(full)
            blocks = [pool.allocate(KiB) for _ in range(40)]  # the 64th event flushes: fails
            assert None not in blocks
            for block in blocks:
                assert block is not None and pool.free(block)
            consistent(pool)
    assert pool.state == "released"  # the reservation went back despite the dead trace
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "No space left on device" in messages[0]
    report = pool.report()
    assert report.trace_error is not None and "stopped" in report.trace_error
    assert (report.allocations, report.frees) == (40, 40)
    assert "No space left" in str(report)


def test_a_non_string_tag_is_a_denial_and_takes_nothing() -> None:
    with gpu_budget("64KiB", name="pool") as pool:
        assert pool.allocate(KiB, tag=["x"]) is None  # type: ignore[call-overload]
        report = pool.report()
        assert (report.used, report.allocations, report.denials[0].reason) == (
            0, 0, "invalid_tag")
        consistent(pool)


def test_a_stream_that_is_no_handle_is_refused_and_changes_nothing() -> None:
    with gpu_budget("64KiB", name="pool") as pool:
        assert pool.allocate(KiB, stream="default") is None  # type: ignore[call-overload]
        assert pool.report().denials[0].reason == "invalid_stream"
        block = pool.allocate(KiB)
        assert block is not None
        assert pool.free(block, stream=1.5) is False  # type: ignore[arg-type]
        assert pool.size_of(block) == KiB and pool.report().invalid_frees == 1
        assert pool.free(block, stream=7)
        consistent(pool)


def test_peaks_count_only_granted_bytes() -> None:
    with gpu_budget("64KiB", name="pool") as pool:
        x, y = gpu_budget("64KiB", name="x"), gpu_budget("64KiB", name="y")
        for child in (x, y):  # siblings, both entered and exited here; pinned to stay usable
            with child:
                hooks(child).pin()
        mine, theirs = [], []
        for _ in range(4):  # x and y interleave 8 KiB blocks over the whole arena
            mine.append(x.allocate(8 * KiB))
            theirs.append(y.allocate(8 * KiB))
        for block in theirs:
            assert block is not None and y.free(block)
        assert (x.used, x.peak) == (32 * KiB, 32 * KiB)  # 8 KiB holes between x's blocks
        assert x.allocate(16 * KiB) is None  # within every limit, but no 16 KiB hole
        assert x.report().denials[0].reason == "fragmented"
        assert mine[0] is not None
        assert x.resize(mine[0], 24 * KiB) is None  # neither in place nor moved
        assert x.peak == 32 * KiB and pool.peak == 64 * KiB
        consistent(pool)
        for block in mine:
            assert block is not None and x.free(block)
        hooks(x).unpin()
        hooks(y).unpin()
    assert pool.state == "released"


def test_exit_from_another_thread_changes_nothing_and_the_right_exit_works() -> None:
    budget = gpu_budget("1MiB", name="mine")
    budget.__enter__()
    errors: list[BaseException] = []

    def stranger() -> None:
        try:
            budget.__exit__(None, None, None)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    thread = threading.Thread(target=stranger)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], BudgetNestingError)
    assert "not active" in str(errors[0])
    assert budget.state == "open" and current_budget() is budget  # nothing changed here
    budget.__exit__(None, None, None)
    assert budget.report().state == "released" and current_budget() is None
    with gpu_budget("1KiB", name="later") as later:  # this context is usable again
        assert later.parent is None


def test_a_thousand_nested_budgets_report_print_and_serialise() -> None:
    with gpu_budget("1MiB", name="root") as root:
        budgets = [root]
        for depth in range(1000):
            budgets.append(gpu_budget("1MiB", name=f"b{depth}").__enter__())
        leaf = budgets[-1]
        assert leaf.allocate(KiB) is not None
        report = root.report()
        assert len(report.walk()) == 1001 and report.walk()[-1].used == KiB
        text = str(report)
        assert text.count("\n") > 2000 and "b999" in text
        data = report.as_dict()
        assert data["children"][0]["name"] == "b0"
        assert report.to_json().count('"name"') == 1001
        consistent(root)
        for budget in reversed(budgets[1:]):
            budget.__exit__(None, None, None)
    assert leaf.state == "exited" and len(root.report().leaks) == 1


class RefusingBackend(HostBackend):
    """A backend of the user's that fails with an error of its own."""

    def reserve(self, nbytes: int) -> HostReservation:
        raise OSError(12, "the driver says no")


def test_a_custom_backend_error_at_entry_is_a_budget_error() -> None:
    with pytest.raises(BudgetError, match="'pool'.*OSError.*the driver says no"):
        with gpu_budget("1MiB", name="pool", backend=RefusingBackend()):
            pass  # pragma: no cover
    assert current_budget() is None


class BadReleaseBackend(HostBackend):
    def reserve(self, nbytes: int) -> HostReservation:
        reservation = super().reserve(nbytes)
        original = reservation.release

        def release() -> None:
            original()
            raise RuntimeError("free failed")

        return _Wrapped(reservation, release)  # type: ignore[return-value]


class _Wrapped:
    def __init__(self, inner: HostReservation, release: Any) -> None:
        self.address, self.nbytes, self.release = inner.address, inner.nbytes, release


def test_a_reservation_that_fails_to_go_back_is_reported_not_raised() -> None:
    with gpu_budget("1MiB", name="pool", backend=BadReleaseBackend()) as pool:
        assert pool.allocate(KiB) is not None
    block = pool.report().live_blocks[0].address
    assert pool.free(block)  # the last free releases: the error is recorded, not raised
    report = pool.report()
    assert report.state == "released" and "free failed" in report.callback_errors[-1]


class BrokenCopyBackend(HostBackend):
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        raise RuntimeError("copy engine fault")


def test_a_failed_copy_leaves_the_old_block_as_it_was() -> None:
    with gpu_budget("64KiB", name="pool", backend=BrokenCopyBackend()) as pool:
        block = pool.allocate(KiB)
        blocker = pool.allocate(KiB)
        assert block is not None and blocker is not None
        fill(block, KiB, 0x5C)
        assert pool.resize(block, 8 * KiB) is None  # must move, and the copy fails
        assert pool.size_of(block) == KiB and holds(block, KiB, 0x5C)
        assert pool.used == 2 * KiB and "copy engine fault" in pool.report().callback_errors[0]
        consistent(pool)


def test_resize_moves_a_block_that_is_not_aligned_as_asked() -> None:
    with gpu_budget("64KiB", align=256, name="pool") as pool:
        first = pool.allocate(256)
        block = pool.allocate(KiB)  # at base + 256: not a multiple of 4 KiB
        assert first is not None and block is not None and block % (4 * KiB) != 0
        fill(block, KiB, 0x21)
        moved = pool.resize(block, 2 * KiB, alignment=4 * KiB)
        assert moved is not None and moved % (4 * KiB) == 0 and holds(moved, KiB, 0x21)
        assert pool.size_of(block) == 0
        consistent(pool)


def test_check_names_a_broken_ledger() -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        assert pool.allocate(KiB) is not None
        pool.check()
        node: Any = pool._node  # break it from inside, as a bug would
        node.account.used += 1
        with pytest.raises(InvariantError, match="LEDGER.*'pool'") as info:
            pool.check()
        assert info.value.invariant == "LEDGER"
        node.account.used -= 1


def test_check_names_a_registry_that_disagrees_with_the_arena() -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        block = pool.allocate(KiB)
        assert block is not None
        node: Any = pool._node
        record = node.tree.live.pop(block)
        with pytest.raises(InvariantError, match="REGISTERED"):
            pool.check()
        node.tree.live[block] = record


def test_the_core_hands_out_live_blocks_with_named_fields() -> None:
    with gpu_budget(MiB, name="pool", align=256) as pool:
        with gpu_budget("64KiB", name="model") as model:
            with label("weights"):
                block = model.allocate(1000)
            assert block is not None
            other = pool.allocate(5000)
            assert other is not None
            tree = pool._node.tree
            assert tree is not None
            entry = tree.owner(block)
            assert isinstance(entry, LiveEntry)
            assert (entry.owner.budget, entry.nbytes, entry.tag, entry.stack) == (
                model, 1024, "weights", None)
            assert tree.owner(block + 1) is None and tree.size_of(block + 1) == 0
            assert (tree.size_of(block), tree.size_of(other)) == (1024, 5120)
            with pool._node.lock:
                entries = dict(tree.entries())
            assert entries == {block: entry, other: (pool._node, 5120, None, None)}
            assert (model.size_of(block), pool.owner_of(other)) == (1024, pool)
            assert model.free(block) and pool.free(other)
            assert tree.owner(block) is None


def test_children_and_parents_see_the_public_tree() -> None:
    with gpu_budget(MiB, name="pool") as pool:
        with gpu_budget("1KiB", name="model") as model:
            assert (model.root, model.parent, pool.root) == (pool, pool, pool)
            assert pool.encloses(model) and not model.encloses(pool)
            assert model.device is None and model.backend is pool.backend
            with pytest.raises(TypeError, match="encloses"):
                pool.encloses("model")  # type: ignore[arg-type]


def test_a_budget_dropped_with_live_blocks_keeps_its_memory() -> None:
    import gc

    def load() -> int:
        with gpu_budget("64KiB", name="dropped") as budget:
            block = budget.allocate(4 * KiB)
            assert block is not None
            fill(block, 4 * KiB, 0x6E)
            return block

    block = load()  # the budget object is gone; its block is still live
    gc.collect()
    with gpu_budget("64KiB", name="next") as later:
        others = [later.allocate(4 * KiB) for _ in range(16)]
        assert block not in others  # the memory was not handed out again
        assert holds(block, 4 * KiB, 0x6E)
        for other in others:
            assert other is not None and later.free(other)


# -- under the driver door, a claim is charged or withdrawn ---------------------------------


def _granted(address: int | None) -> int:
    assert address is not None
    return address


@pytest.mark.parametrize("path", ["fast", "python"])
def test_every_claim_the_door_was_shown_is_charged_or_withdrawn(path: str) -> None:
    # an allocation shows the door's word the bytes it is about to charge before it checks;
    # whatever then stops it (the arena cannot place it, a limit, a resize that cannot grow
    # in place), the word is the budget's ``used`` again afterwards
    with gpu_budget("128KiB", name="pool", backend="host") as pool:
        if path == "python":
            python_paths(pool)
        with gpu_budget("128KiB", name="c") as child:
            nodes: list[Any] = [pool._node, child._node]
            for node in nodes:
                node.account.door = memoryview(bytearray(24)).cast("q")

            def words() -> list[tuple[int, int]]:
                return [(node.account.door[1], node.account.used) for node in nodes]

            a, b, c, d = (_granted(child.allocate(16 * KiB)) for _ in range(4))
            child.free(a)
            child.free(c)
            assert child.allocate(80 * KiB) is None  # 96 KiB free, 64 at most in one piece
            assert child.report().denials[-1].reason == "fragmented"
            assert words() == [(32 * KiB, 32 * KiB)] * 2
            nodes[0].account.door[0] = 90 * KiB  # the door charged the pool 90 KiB
            assert child.allocate(16 * KiB) is None  # 32 + 16 + 90 > 128 at the pool
            assert words() == [(32 * KiB, 32 * KiB)] * 2
            nodes[0].account.door[0] = 0
            moved = _granted(child.resize(b, 40 * KiB))  # d is in the way: not in place
            assert moved != b
            assert words() == [(56 * KiB, 56 * KiB)] * 2
            for block in (moved, d):
                child.free(block)
            assert words() == [(0, 0)] * 2


@pytest.mark.parametrize("path", ["fast", "python"])
def test_a_claim_beyond_64_bits_is_a_denial_and_leaves_the_door_word(path: str) -> None:
    # the door's words are signed 64-bit: a request past them under a limit past them is
    # refused by the pool, as without the door, and the child's word keeps its used
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        if path == "python":
            python_paths(pool)
        with gpu_budget(2**70, name="c") as child:
            account: Any = child._node.account
            account.door = memoryview(bytearray(24)).cast("q")
            assert child.allocate(2**64) is None
            denial = child.report().denials[-1]
            assert (denial.reason, denial.refused_by) == ("over_limit", "pool")
            assert (account.door[1], account.claimed) == (0, 0)


class _RangeWithAHook(HostVirtualRange):
    """A host range that runs a function once, as it maps its next granule: what a
    finalizer that the collector runs there would do."""

    __slots__ = ("hook",)
    hook: Callable[[], None] | None

    def map(self, index: int) -> None:
        hook, self.hook = getattr(self, "hook", None), None
        if hook is not None:
            hook()
        super().map(index)


class _HookedHost(HostBackend):
    def reserve_virtual(self, nbytes: int, granule: int) -> HostVirtualRange:
        self.range = _RangeWithAHook(nbytes, granule)
        return self.range


@pytest.mark.parametrize("nested", ["free", "allocate"])
def test_what_runs_between_a_claim_and_its_charge_keeps_the_claim(nested: str) -> None:
    # a growable root maps a granule between an allocation's claim and its charge (both
    # cores: the C fast path hands such a block to Python); a finalizer running there on the
    # same thread frees a block or allocates one: the claim stays shown to the door, and the
    # nested allocation counts it against the limit
    backend = _HookedHost()
    with gpu_budget("256KiB", name="pool", backend=backend, initial=0) as pool:
        with gpu_budget("128KiB", name="c") as child:
            nodes: list[Any] = [pool._node, child._node]
            for node in nodes:
                node.account.door = memoryview(bytearray(24)).cast("q")
            victim = _granted(child.allocate(16 * KiB))  # maps the first granule (64 KiB)
            seen: list[object] = []

            def meanwhile() -> None:
                seen.append(nodes[1].account.door[1])
                if nested == "free":
                    child.free(victim)
                else:
                    seen.append(child.allocate(32 * KiB))  # 16 + 96 claimed + 32 > 128
                seen.append(nodes[1].account.door[1])

            backend.range.hook = meanwhile
            block = _granted(child.allocate(96 * KiB))  # needs a second granule mapped
            if nested == "free":
                assert seen == [112 * KiB, 96 * KiB]  # the claim kept through the free
                assert child.report().used == 96 * KiB
            else:
                assert seen == [112 * KiB, None, 112 * KiB]
                assert child.report().denials[-1].reason == "over_limit"
                child.free(victim)
            assert [(n.account.door[1], n.account.claimed) for n in nodes] == [
                (96 * KiB, 0), (96 * KiB, 0)]
            child.free(block)


# -- no signal handler's exception leaves the tree's lock held -----------------------------


class Injected(BaseException):
    """What the fault injector raises: a BaseException, as an asynchronous one may be."""


LOCK_TAKERS = ("allocate", "free", "resize", "_record", "note_error", "_deny", "check", "read",
               "fault")


def _lock_taking_code() -> set[Any]:
    from gpubudget._core.node import Node
    from gpubudget._core.tree import Tree

    return ({getattr(Tree, name).__code__ for name in LOCK_TAKERS}
            | {Node.open_child.__code__, Node.close.__code__})


def _raise_at(index: int, codes: set[Any], operation: Any) -> bool:
    """Run ``operation``, raising :class:`Injected` at the ``index``-th place where Python
    may run a signal handler in a frame of ``codes`` (counted across them, as they run):
    just after a call of a C function returns, and as a Python function called there starts
    (where a Ctrl-C, a signal handler's exception or one given to
    ``PyThreadState_SetAsyncExc`` lands); whether it was raised."""
    seen = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal seen
        here = frame if event == "c_return" else frame.f_back if event == "call" else None
        if here is not None and here.f_code in codes:
            seen += 1
            if seen == index + 1:
                raise Injected  # and Python unsets the profile function: one fault per run

    from tests.helpers import forget_stale_handled_exception

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        operation()
    except Injected:
        pass
    finally:
        sys.setprofile(previous)
    forget_stale_handled_exception()  # raised as a handler ended, it may be left "handled"
    return seen > index


def _exit_with_failing_hook() -> None:
    def fail() -> None:
        raise RuntimeError("adapter hook")

    budget = gpu_budget("1KiB").__enter__()
    hooks(budget).call_on_exit(fail)
    budget.__exit__(None, None, None)


def _scenarios() -> dict[str, Any]:
    """Operations that take the tree's lock, each on a pool of 64 KiB (and a child ``c``)
    holding two blocks ``a`` and ``b``; each returns the pool."""
    from tests.helpers import StreamBackend

    def run(body: Any, backend: Any = None) -> Any:
        def scenario(inject: Any) -> Any:
            with gpu_budget("64KiB", name="pool", backend=backend) as pool:
                python_paths(pool)
                with gpu_budget("32KiB", name="c") as child:
                    for budget in (pool, child):  # as the driver door gives them (empty)
                        budget._node.account.door = memoryview(bytearray(24)).cast("q")
                    a, b = child.allocate(KiB), child.allocate(KiB)
                    inject(lambda: body(pool, child, a, b))
                    for block in [x.address for x in pool.report().walk()[1].live_blocks]:
                        child.free(block)
                    for block in [x.address for x in pool.report().live_blocks]:
                        pool.free(block)
            return pool
        return scenario

    return {
        "allocate": run(lambda p, c, a, b: c.allocate(KiB)),
        "allocate with alignment": run(lambda p, c, a, b: c.allocate(KiB, 4096)),
        "allocate over a limit": run(lambda p, c, a, b: c.allocate(48 * KiB)),
        "allocate an invalid size": run(lambda p, c, a, b: c.allocate(0)),
        "allocate while frees are pending": run(
            lambda p, c, a, b: (c.free(a, stream=1), c.allocate(KiB, stream=1)),
            StreamBackend()),
        "free": run(lambda p, c, a, b: c.free(a)),
        "free on a stream": run(lambda p, c, a, b: c.free(a, stream=1), StreamBackend()),
        "free what is not a block": run(lambda p, c, a, b: c.free(12345)),
        "resize in place": run(lambda p, c, a, b: c.resize(b, 2 * KiB)),
        "resize by moving": run(lambda p, c, a, b: c.resize(a, 4 * KiB)),
        "resize what is not a block": run(lambda p, c, a, b: c.resize(12345, KiB)),
        "resize whose copy fails": run(lambda p, c, a, b: c.resize(a, 4 * KiB),
                                       BrokenCopyBackend()),
        "owner": run(lambda p, c, a, b: p.owner_of(a)),
        "size of": run(lambda p, c, a, b: p.size_of(a)),
        "check": run(lambda p, c, a, b: p.check()),
        "report": run(lambda p, c, a, b: p.report()),
        "enter and exit a child": run(lambda p, c, a, b: gpu_budget("1KiB").__enter__().__exit__(
            None, None, None)),
        "exit with a hook that fails": run(lambda p, c, a, b: _exit_with_failing_hook()),
    }


@pytest.mark.parametrize("name", list(_scenarios()))
def test_a_signal_handlers_exception_leaves_the_lock_free_and_the_tree_whole(name: str) -> None:
    scenario, codes = _scenarios()[name], _lock_taking_code()
    # One run traced without a fault first: Python 3.12 starts the per-opcode events of a
    # code object only from its next call after a trace function asked for them.
    scenario(lambda operation: _raise_at(-1, codes, operation))
    index = 0
    while True:
        fired = False

        def inject(operation: Any) -> None:
            nonlocal fired
            budget = current_budget()
            assert budget is not None
            lock = budget._node.tree.lock  # type: ignore[union-attr]
            fired = _raise_at(index, codes, operation)
            free = free_elsewhere(lock)
            if not free:
                lock.release()  # so that the test fails instead of hanging at the exit
            assert free, f"{name}: the lock is held after a fault at instruction {index}"
            tree = budget._node.tree
            assert tree is not None and (tree.reading, tree.deferred) == (0, []), (
                f"{name}: a walk is left open after a fault at instruction {index}")
            try:  # and the operation happened whole or not at all
                consistent(budget.root)
            except (AssertionError, InvariantError) as broken:
                raise AssertionError(f"{name}: a fault at instruction {index} left the tree "
                                     f"inconsistent: {broken}") from None
            for node in budget.root._node.subtree():  # no claim left standing for the door
                door = node.account.door
                assert door is None or door[1] == node.account.used, (
                    f"{name}: a fault at instruction {index} left {node.name!r}'s door word "
                    f"at {door[1]}, its used at {node.account.used}")

        scenario(inject)
        if not fired:
            break
        index += 1
    assert index > 1, f"{name}: only {index} places traced"


def test_a_moving_resize_is_whole_for_other_threads() -> None:
    """Another thread that frees the block being moved waits for the move: its free finds
    the old block gone (False), never frees it under the copy."""
    import threading

    from gpubudget import gpu_budget
    from gpubudget.backends.host import HostBackend

    class SlowCopy(HostBackend):
        def __init__(self) -> None:
            super().__init__()
            self.copying, self.go = threading.Event(), threading.Event()

        def copy(self, dst: int, src: int, nbytes: int) -> None:
            self.copying.set()
            assert self.go.wait(120)
            super().copy(dst, src, nbytes)

    backend = SlowCopy()
    with gpu_budget("1MiB", backend=backend) as budget:
        block = budget.allocate("100KiB")
        neighbour = budget.allocate("100KiB")  # so that growing must move
        assert block is not None and neighbour is not None
        moved: list[int | None] = []
        mover = threading.Thread(target=lambda: moved.append(budget.resize(block, "300KiB")))
        mover.start()
        assert backend.copying.wait(120)
        freed: list[bool] = []
        other = threading.Thread(target=lambda: freed.append(budget.free(block)))
        other.start()
        other.join(0.5)  # time for a free that did not wait to happen
        backend.go.set()
        mover.join(120)
        other.join(120)
        assert not mover.is_alive() and not other.is_alive()
        assert freed == [False] and moved[0] not in (None, block)
        assert budget.used == 400 * 1024  # the moved block and the neighbour
        budget.check()


# -- a finalizer that frees a block while the same thread walks the registry ----------------


class _Cycle:
    """An object in a reference cycle whose finalizer frees a block (the collector runs it
    wherever an allocation of a Python object happens to trigger a collection)."""

    def __init__(self, budget: Any, block: int, freed: list[bool]) -> None:
        self.budget, self.block, self.freed, self.me = budget, block, freed, self

    def __del__(self) -> None:
        self.freed.append(self.budget.free(self.block))


@pytest.mark.parametrize("walk", ["report", "check"])
def test_a_finalizer_freeing_a_block_during_a_walk_waits_for_the_walk(walk: str) -> None:
    import gc

    thresholds = gc.get_threshold()
    freed: list[bool] = []
    with gpu_budget("4MiB", name="pool", backend="host") as pool:
        with gpu_budget("2MiB", name="child") as child:
            keep = [child.allocate(256, tag="kept") for _ in range(200)]
            gc.collect()
            gc.set_threshold(1, 1, 1)  # a collection at (nearly) every allocation
            try:
                for round_ in range(30):
                    for _ in range(20):
                        block = child.allocate(256)
                        assert block is not None
                        _Cycle(child, block, freed)  # garbage at once, freed by the collector
                    if walk == "report":
                        report = pool.report()
                        assert report.used == sum(b.size for r in report.walk()
                                                  for b in r.live_blocks)
                    else:
                        pool.check()
            finally:
                gc.set_threshold(*thresholds)
            gc.collect()
            assert freed and all(freed)
            assert child.used == 256 * len(keep)
            consistent(pool)
