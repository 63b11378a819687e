"""The two cores side by side: every answer and every number of the C core (``_core/*.c``)
must be the Python core's.

- The arena: ``native.Arena`` against the Python ``Arena`` on the same random and
  adversarial operations (same addresses, same bookkeeping, ``check()`` after each step).
- The ledger: C accounts and functions against the Python ones on random trees with reserves.
- Whole trees: two roots fed the same operations, one taking the C fast path of
  ``Budget.allocate``/``free`` where it can, the other every call through the Python methods;
  their answers, numbers, statistics, tags, registry, arena and timelines must agree.

CI runs this file with the C core built; in the pure-Python run it is skipped (nothing to
compare)."""

from __future__ import annotations

import contextlib
import contextvars
import random
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

import gpubudget
from gpubudget import Budget, gpu_budget, label
from gpubudget._core import arena as arena_module
from gpubudget._core import ledger, native
from gpubudget.backends.host import HostBackend
from gpubudget.tracefile import Alloc, Free, read_trace
from gpubudget.units import KiB
from tests.helpers import StreamBackend, python_paths

pytestmark = pytest.mark.skipif(native is None, reason="the C core is not built here")

GRAN = 256
POWERS = st.sampled_from([0, 0, 0, 1, 256, 512, 1024, 4096, 3, 96])


# -- the arena -----------------------------------------------------------------------------


def _arena_pair(capacity: int, granularity: int) -> tuple[Any, Any]:
    assert native is not None
    base = 1 << 20
    return arena_module.Arena(base, capacity, granularity), arena_module.PythonArena(
        base, capacity, granularity)


class Arenas(RuleBasedStateMachine):
    """The C arena and the Python one, step by step."""

    blocks = Bundle("blocks")

    @initialize(units=st.integers(1, 4096), shift=st.integers(0, 12))
    def start(self, units: int, shift: int) -> None:
        self.granularity = 1 << shift
        self.c, self.py = _arena_pair(units << shift, self.granularity)

    @rule(target=blocks, units=st.integers(1, 600), alignment=POWERS)
    def allocate(self, units: int, alignment: int) -> int | None:
        size = units * self.granularity
        if alignment and alignment & (alignment - 1):
            alignment = 0  # the arena's callers check alignments; the tree tests bad ones
        got: int | None = self.c.allocate(size, alignment)
        assert got == self.py.allocate(size, alignment)
        return got

    @rule(block=consumes(blocks))
    def free(self, block: int | None) -> None:
        if block is not None:
            assert self.c.free(block) == self.py.free(block)

    @rule(block=blocks, units=st.integers(1, 600))
    def resize(self, block: int | None, units: int) -> None:
        if block is not None:
            size = units * self.granularity
            assert self.c.resize(block, size) == self.py.resize(block, size)

    @rule(address=st.integers(-(1 << 70), 1 << 70))
    def free_anything(self, address: int) -> None:
        assert self.c.free(address) == self.py.free(address) == 0 or address >= 1 << 20

    @invariant()
    def agree(self) -> None:
        assert self.c._state() == self.py._state()
        assert list(self.c.walk()) == list(self.py.walk())
        for name in ("free_bytes", "used_bytes", "largest_free", "blocks", "free_blocks"):
            assert getattr(self.c, name) == getattr(self.py, name), name
        self.c.check()


TestArenas = Arenas.TestCase
TestArenas.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_arenas_agree_on_a_long_churn_with_alignments() -> None:
    """An adversarial sequence: thousands of blocks of every size class, aligned requests,
    frees in random order; the same addresses from both, and the same bookkeeping."""
    c, py = _arena_pair(1 << 30, GRAN)
    rng = random.Random(11)
    live: list[int] = []
    for step in range(20_000):
        if live and (rng.random() < 0.45 or len(live) > 3000):
            block = live.pop(rng.randrange(len(live)))
            assert c.free(block) == py.free(block)
        else:
            size = int(2 ** rng.uniform(8, 22)) // GRAN * GRAN + GRAN
            alignment = rng.choice([0, 0, 0, 4096, 1 << 16])
            got = c.allocate(size, alignment)
            assert got == py.allocate(size, alignment)
            if got is not None:
                live.append(got)
        if step % 2000 == 0:
            assert c._state() == py._state()
    assert c._state() == py._state()
    c.check()


@pytest.mark.parametrize("arguments", [(0, 1024, 3), (100, 1024, 256), (0, 1000, 256),
                                       (0, 0, 256), (-256, 1024, 256)])
def test_both_arenas_refuse_the_same_geometry(arguments: tuple[int, int, int]) -> None:
    assert native is not None
    messages = []
    for kind in (native.Arena, arena_module.PythonArena):
        with pytest.raises(ValueError) as info:
            kind(*arguments)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


# -- the ledger ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_ledgers_agree(seed: int) -> None:
    assert native is not None
    rng = random.Random(seed)
    for _ in range(300):
        pairs: list[tuple[Any, Any]] = []
        for i in range(rng.randint(1, 7)):
            parent = pairs[rng.randrange(i)] if i else (None, None)
            limit, reserve = rng.randint(0, 2000), rng.choice([0, 0, rng.randint(0, 500)])
            if parent[0] is None:
                reserve = 0
            pairs.append((native.Account(f"a{i}", limit, reserve, parent[0]),
                          ledger.PYTHON[0](f"a{i}", limit, reserve, parent[1])))
        _, py_available, py_charge, py_passed_up, py_refusal = ledger.PYTHON[:5]
        for _ in range(40):
            c, py = pairs[rng.randrange(len(pairs))]
            delta = rng.choice([rng.randint(-300, 600), 2**70, -(2**70), 0])
            refused_c, refused_py = native.refusal(c, delta), py_refusal(py, delta)
            assert (refused_c is None) == (refused_py is None)
            if refused_c is not None and refused_py is not None:
                assert refused_c.name == refused_py.name
            elif abs(delta) < 2**62 and (delta > 0 or -delta <= py.used):
                native.charge(c, delta)
                py_charge(py, delta)
            assert native.available(c) == py_available(py)
            assert native.passed_up(c, c.used) == py_passed_up(py, py.used)
            for a, b in pairs:
                assert (a.used, a.peak, a.depth, a.plain) == (b.used, b.peak, b.depth, b.plain)


@pytest.mark.parametrize("seed", range(3))
def test_claims_agree_and_leave_the_door_the_bytes_being_charged(seed: int) -> None:
    # under the driver door, a claim shows the door what ``used`` will be before it reads the
    # door's bytes again; one that passes stands until charge or settle, one that is refused
    # leaves every word as it was: both ledgers, the same answers and words
    assert native is not None
    rng = random.Random(seed)
    _, _, py_charge, _, _, py_claim, py_settle = ledger.PYTHON
    for _ in range(100):
        pairs: list[tuple[Any, Any, memoryview, memoryview]] = []
        for i in range(rng.randint(1, 5)):
            parent = pairs[rng.randrange(i)] if i else (None, None, None, None)
            limit = rng.randint(0, 3000)
            reserve = rng.choice([0, 0, rng.randint(0, 500)]) if i else 0
            c = native.Account(f"a{i}", limit, reserve, parent[0])
            py = ledger.PYTHON[0](f"a{i}", limit, reserve, parent[1])
            words = (memoryview(bytearray(24)).cast("q"), memoryview(bytearray(24)).cast("q"))
            if rng.random() < 0.7:  # levels under the door, and levels not
                held, own = rng.randint(0, 800), rng.choice([0, 0, rng.randint(0, 400)])
                for w in words:
                    w[0], w[2] = held, own
                c.door, py.door = words
            pairs.append((c, py, *words))
        for _ in range(30):
            c, py, _, _ = pairs[rng.randrange(len(pairs))]
            delta = rng.randint(1, 700)
            before = [(list(a), list(b)) for _, _, a, b in pairs]
            refused_c, refused_py = native.claim(c, delta), py_claim(py, delta)
            assert (refused_c is None) == (refused_py is None)
            if refused_c is not None and refused_py is not None:
                assert refused_c.name == refused_py.name
                assert [(list(a), list(b)) for _, _, a, b in pairs] == before  # settled
            elif rng.random() < 0.7:
                native.charge(c, delta)
                py_charge(py, delta)
            else:  # the arena could not place it: withdrawn
                native.settle(c, delta)
                py_settle(py, delta)
                assert [(list(a), list(b)) for _, _, a, b in pairs] == before
            for a, b, wa, wb in pairs:
                assert (a.used, a.peak, a.claimed) == (b.used, b.peak, 0)
                assert list(wa) == list(wb)
                if a.door is not None:
                    assert wa[1] == a.used  # charged or settled: the door sees ``used``


def test_a_claim_stands_until_charged_or_settled() -> None:
    assert native is not None
    cores: list[tuple[Any, Any, Any, Any]] = [
        (native.Account, native.claim, native.settle, native.charge),
        (ledger.PYTHON[0], ledger.PYTHON[5], ledger.PYTHON[6], ledger.PYTHON[2])]
    for account_type, claim, settle, charge in cores:
        root = account_type("root", 1000)
        child = account_type("child", 700, 0, root)
        root_words, child_words = (memoryview(bytearray(24)).cast("q") for _ in range(2))
        root.door, child.door = root_words, child_words
        root_words[0] = 400  # the door charged the root 400 bytes, none of them its own
        assert claim(child, 300) is None
        assert (child_words[1], root_words[1], child.used, child.claimed) == (300, 300, 0, 300)
        assert claim(child, 250) is None  # a second claim, standing beside the first
        assert (child_words[1], root_words[1], root.claimed) == (550, 550, 550)
        assert claim(child, 100) is root  # 550 claimed + 100 + 400 the door's > 1000
        assert (child_words[1], root_words[1], child.claimed) == (550, 550, 550)
        charge(child, -0)  # a change of nothing keeps what is claimed shown
        assert child_words[1] == 550
        settle(child, 250)
        assert (child_words[1], root_words[1], child.claimed) == (300, 300, 300)
        refused = claim(child, 450)  # 300 + 450 past the child's 700: nothing more shown
        assert refused is not None and refused.name == "child"
        charge(child, 300)  # the first claim charged: used, no longer claimed
        assert (child_words[1], root_words[1], child.used, child.claimed) == (300, 300, 300, 0)
        assert claim(child, 0) is None and claim(child, -50) is None  # nothing to claim
        assert (child_words[1], root.claimed) == (300, 0)


def test_a_claim_counts_whole_above_a_reserve_floor_and_is_given_back_whole() -> None:
    # a child with a 400-byte floor passes up only what rises above it; its claim puts the
    # whole request on the parent (more than the charge will, never less), and the charge
    # takes back exactly that, even when a free came in between
    assert native is not None
    cores: list[tuple[Any, Any, Any]] = [
        (native.Account, native.claim, native.charge),
        (ledger.PYTHON[0], ledger.PYTHON[5], ledger.PYTHON[2])]
    for account_type, claim, charge in cores:
        root = account_type("root", 1000)
        child = account_type("child", 800, 400, root)
        charge(root, 400)  # the floor set aside at entry
        charge(child, 100)
        assert claim(child, 500) is None  # 100 -> 600: 200 above the floor reach the root
        assert (child.claimed, root.claimed) == (500, 500)
        charge(child, -100)  # a finalizer frees a block meanwhile
        charge(child, 500)
        assert (child.used, root.used, child.claimed, root.claimed) == (500, 500, 0, 0)


def test_published_words_follow_the_root() -> None:
    assert native is not None
    words = memoryview(bytearray(24)).cast("Q")
    root = native.Account("root", 1000)
    child = native.Account("child", 500, 0, root)
    root.published = words
    native.charge(child, 300)
    assert list(words) == [300, 300, 0]
    native.charge(child, -100)
    assert list(words) == [200, 300, 0]
    root.published = None
    native.charge(child, 50)
    assert list(words) == [200, 300, 0]
    with pytest.raises(ValueError):
        root.published = memoryview(bytearray(24))  # bytes, not 64-bit words


# -- whole trees: the fast path against the Python methods --------------------------------


SIZES = st.one_of(st.integers(1, 40 * KiB), st.sampled_from([0, -5, 2**70, 10**30]),
                  st.sampled_from(["1KiB", "3 KiB", "lots"]))  # a float: test_size_types
TAGS = st.sampled_from([None, None, "weights", "cache", "über", 7])
LABELS = st.sampled_from([None, None, "phase-a", "phase-b"])


class Trees(RuleBasedStateMachine):
    """Two roots fed the same operations; one may take the fast path, the other may not."""

    blocks = Bundle("blocks")

    @initialize(limit=st.integers(32, 512), align=st.sampled_from([1, 64, 256, 1024]),
                streams=st.booleans())
    def start(self, limit: int, align: int, streams: bool) -> None:
        self.start_roots(limit, align, streams)

    def backend(self, streams: bool) -> HostBackend:
        return StreamBackend() if streams else HostBackend()

    def start_roots(self, limit: int, align: int, streams: bool, **options: Any) -> None:
        """The two roots, entered with ``options`` besides the limit and alignment."""
        # each root in a context of its own: entered side by side, neither is the other's child
        self.contexts = (contextvars.Context(), contextvars.Context())
        self.fast = gpu_budget(limit * KiB, align=align, name="root",
                               backend=self.backend(streams), **options)
        self.slow = gpu_budget(limit * KiB, align=align, name="root",
                               backend=self.backend(streams), **options)
        self.contexts[0].run(self.fast.__enter__)
        self.contexts[1].run(self.slow.__enter__)
        python_paths(self.slow)
        assert self.fast._node.tree is not None and self.fast._node.tree.fast
        self.open: list[tuple[Budget, Budget]] = [(self.fast, self.slow)]  # innermost last
        self.known: list[tuple[Budget, Budget]] = [(self.fast, self.slow)]

    def _base(self, budget: Budget) -> int:
        tree = budget._node.tree
        assert tree is not None
        return tree.arena.base

    def _offset(self, budget: Budget, address: int | None) -> int | None:
        return None if address is None else address - self._base(budget)

    @rule(limit=st.integers(1, 300), reserve=st.sampled_from([None, 0, 1, 5, 64]),
          align=st.sampled_from([1, 256, 512, 4096]))
    def enter(self, limit: int, reserve: int | None, align: int) -> None:
        self.enter_both(limit, f"c{len(self.known)}", align=align,
                        reserve=None if reserve is None else reserve * KiB)

    def enter_both(self, limit: int, name: str, **options: Any) -> None:
        """A child of the innermost open pair entered on both sides, each in its context:
        entered on both or refused on both with the same error."""
        outcomes = []
        pair = []
        for context, parent in zip(self.contexts, self.open[-1]):
            try:
                child = gpu_budget(limit * KiB, name=name, parent=parent, **options)
                context.run(child.__enter__)
                outcomes.append("entered")
                pair.append(child)
            except Exception as exc:  # noqa: BLE001 - both must fail alike
                outcomes.append(f"{type(exc).__name__}: {exc}")
        assert outcomes[0] == outcomes[1]
        if outcomes[0] == "entered":
            self.open.append((pair[0], pair[1]))
            self.known.append((pair[0], pair[1]))

    @precondition(lambda self: len(self.open) > 1)
    @rule()
    def leave(self) -> None:
        for context, budget in zip(self.contexts, self.open.pop()):
            context.run(budget.__exit__, None, None, None)

    @rule(target=blocks, which=st.integers(0, 50), size=SIZES, alignment=POWERS, tag=TAGS,
          current=LABELS, stream=st.sampled_from([None, None, 1, 2]))
    def allocate(self, which: int, size: Any, alignment: int, tag: Any, current: str | None,
                 stream: int | None) -> tuple[int, int | None]:
        index = which % len(self.known)
        fast, slow = self.known[index]
        def allocate(budget: Budget) -> int | None:
            with label(current) if current is not None else contextlib.nullcontext():
                return budget.allocate(size, alignment, tag=tag, stream=stream)

        got = [context.run(allocate, budget) for context, budget in zip(self.contexts, (fast, slow))]
        assert self._offset(fast, got[0]) == self._offset(slow, got[1])
        return (index, self._offset(fast, got[0]))

    @rule(block=consumes(blocks), by=st.integers(0, 50), stream=st.sampled_from([None, None, 1]))
    def free(self, block: tuple[int, int | None], by: int, stream: int | None) -> None:
        index, offset = block
        if offset is None:
            return
        fast, slow = self.known[by % len(self.known)] if by % 3 == 0 else self.known[index]
        done = [budget.free(self._base(budget) + offset, stream=stream)
                for budget in (fast, slow)]
        assert done[0] == done[1]

    @rule(block=blocks, size=st.integers(1, 40 * KiB))
    def resize(self, block: tuple[int, int | None], size: int) -> None:
        index, offset = block
        if offset is None:
            return
        fast, slow = self.known[index]
        got = [budget.resize(self._base(budget) + offset, size) for budget in (fast, slow)]
        assert self._offset(fast, got[0]) == self._offset(slow, got[1])

    @rule(address=st.one_of(st.integers(-5, 1 << 70), st.sampled_from(["x", 1.0])))
    def free_anything(self, address: Any) -> None:
        fast, slow = self.open[-1]
        assert fast.free(address) == slow.free(address)

    @rule()
    def finish_streams(self) -> None:
        for budget in (self.fast, self.slow):
            backend = budget._node.tree.backend  # type: ignore[union-attr]
            if isinstance(backend, StreamBackend):
                backend.finish()

    @rule()
    def reset_peak(self) -> None:
        self.fast.reset_peak()
        self.slow.reset_peak()

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "fast"):
            return
        ids: list[dict[int, int]] = [{}, {}]
        for position, pair in enumerate(self.known):
            for side, budget in enumerate(pair):
                ids[side][budget._node.id] = position
        seen = []
        for side, root in enumerate((self.fast, self.slow)):
            tree = root._node.tree
            assert tree is not None
            root.check()
            base = tree.arena.base
            numbers = []
            for pair in self.known:
                node = pair[side]._node
                stats = node.stats
                numbers.append((node.state, node.account.used, node.account.peak,
                                node.account.refusals, stats.allocations, stats.frees,
                                stats.blocks, stats.peak_blocks, stats.invalid_frees,
                                stats.denied, stats.largest_denied, dict(stats.denials),
                                stats.bytes_allocated, stats.bytes_freed, list(stats.retired),
                                {tag: list(entry) for tag, entry in stats.tags.items()}))
            live = {address - base: (ids[side][owner.id], nbytes, tag)
                    for address, (owner, nbytes, tag, _) in tree.live.items()}
            blocks = [(block.address - base, block.size, block.free)
                      for block in tree.arena.walk()]
            events = [(kind, ids[side].get(budget, -1), nbytes, tag, used, total)
                      for _, kind, budget, nbytes, tag, used, total in tree.recorder.events]
            seen.append((numbers, live, blocks, events, tree.recorder.logged))
        assert seen[0] == seen[1]

    def teardown(self) -> None:
        if not hasattr(self, "fast"):
            return
        for pair in reversed(self.open):
            for context, budget in zip(self.contexts, pair):
                context.run(budget.__exit__, None, None, None)
        for root in (self.fast, self.slow):
            tree = root._node.tree
            if tree is not None:
                for address in list(tree.live):
                    root.free(address)
                if isinstance(tree.backend, StreamBackend):
                    tree.backend.finish()


TestTrees = Trees.TestCase
TestTrees.settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])


# -- the fast path on its own --------------------------------------------------------------


def _python_calls(work: Any) -> list[str]:
    """The functions of gpubudget written in Python that ``work()`` calls."""
    called: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and "gpubudget" in frame.f_code.co_filename:
            called.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return called


def test_fast_path_runs_whole_in_c_and_leaves_the_rest_to_python() -> None:
    assert gpubudget.compiled
    assert type(Budget.__dict__["allocate"]).__name__ == "method_descriptor"
    assert "Return the address of a block" in (Budget.allocate.__doc__ or "")
    with gpu_budget("1MiB", backend="host") as pool:
        blocks: list[int | None] = []
        assert _python_calls(lambda: blocks.append(pool.allocate(KiB, tag="t"))) == []
        assert _python_calls(lambda: blocks.append(pool.free(blocks[0]))) == []  # type: ignore[arg-type]
        assert blocks[0] is not None and blocks[1] is True
        assert "allocate" in _python_calls(lambda: pool.allocate(2 * KiB * KiB))  # denied
        assert "allocate" in _python_calls(lambda: pool.allocate("1KiB"))  # a string
        assert "free" in _python_calls(lambda: pool.free(12345))  # not a block
        with gpu_budget("1KiB", track_stacks=True) as child:
            calls = _python_calls(lambda: child.allocate(KiB))  # stacks: taken in C
            assert "allocate" not in calls and set(calls) <= {"frame_text", "_ours"}
        assert pool.used == 2 * KiB  # "1KiB", and the child's block
        for report in pool.report().walk():
            for live in report.live_blocks:
                assert pool.free(live.address)
        assert pool.used == 0


def test_a_traced_tree_with_stacks_stays_in_c(tmp_path: Path) -> None:
    """Tracing and stacks on the fast path: no Python code runs for a pair once each frame's
    text is made (callers.frame_text, once per frame); the trace says what Python's would."""
    path = tmp_path / "t.jsonl"
    with gpu_budget("1MiB", backend="host", trace=str(path)) as pool:
        with gpu_budget("64KiB", track_stacks=True) as child:
            def pair() -> None:
                assert child.free(child.allocate(KiB, tag="t\u00e9"))  # type: ignore[arg-type]

            calls = [_python_calls(pair) for _ in range(2)]  # one line: the same frames
            assert calls[0] and calls[1] == []
            assert child.report().allocations == 2
    trace = read_trace(path)
    allocs = [event for event in trace.events if isinstance(event, Alloc)]
    assert [(a.size, a.align, a.tag, a.nbytes, a.reason) for a in allocs] == [
        (KiB, 0, "t\u00e9", KiB, None)] * 2
    assert allocs[0].stack == allocs[1].stack and allocs[0].stack is not None
    assert allocs[0].stack[-1].endswith(" in pair") and __file__ in allocs[0].stack[-1]
    assert sum(isinstance(event, Free) for event in trace.events) == 2


def test_threads_sharing_a_tree_keep_it_whole() -> None:
    """Eight threads allocate and free through the fast path while two others take the
    Python path (a report and a moving resize, which hold the lock): nothing is lost."""
    with gpu_budget("64MiB", backend="host", name="pool") as pool:
        errors: list[BaseException] = []

        def churn(seed: int) -> None:
            rng = random.Random(seed)
            mine: list[int] = []
            try:
                for _ in range(3000):
                    if mine and rng.random() < 0.5:
                        assert pool.free(mine.pop(rng.randrange(len(mine))))
                    else:
                        block = pool.allocate(rng.randint(1, 64 * KiB), tag=f"t{seed % 3}")
                        if block is not None:
                            mine.append(block)
                    if rng.random() < 0.01 and mine:
                        moved = pool.resize(mine[-1], 256 * KiB)
                        if moved is not None:
                            mine[-1] = moved
                for block in mine:
                    assert pool.free(block)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def watch() -> None:
            for _ in range(50):
                pool.report()
                pool.check()

        threads = [threading.Thread(target=churn, args=(i,)) for i in range(8)]
        threads.append(threading.Thread(target=watch))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        pool.check()
        assert pool.used == 0 and pool.report().allocations == pool.report().frees


def test_the_registry_answers_as_the_dict_it_stands_for() -> None:
    """Random sets, gets, pops and deletes: the C registry and a dict say the same."""
    assert native is not None
    registry, reference = native.Registry(), {}
    rng = random.Random(3)
    owners = [object(), object()]
    for _ in range(5000):
        key = rng.randrange(0, 300) * 256
        action = rng.random()
        if action < 0.4:
            value = (rng.choice(owners), rng.randrange(1, 1 << 40), rng.choice([None, "a"]),
                     rng.choice([None, ("f:1",)]))
            registry[key] = value
            reference[key] = value
        elif action < 0.6:
            assert registry.get(key) == reference.get(key)
            assert (key in registry) == (key in reference)
        elif action < 0.8:
            assert registry.pop(key, None) == reference.pop(key, None)
        elif key in reference:
            del registry[key]
            del reference[key]
        else:
            with pytest.raises(KeyError):
                del registry[key]
    assert len(registry) == len(reference)
    assert sorted(registry.items()) == sorted(reference.items())
    assert sorted(registry) == sorted(reference)
    assert registry.get("x") is None and registry.get(-1, 7) == 7 and 2**70 not in registry
    with pytest.raises(TypeError):
        registry["x"] = (owners[0], 1, None, None)
    with pytest.raises(TypeError):
        registry[256] = "not an entry"


@pytest.mark.parametrize("maxlen", [1, 3, 64, 1000])
def test_both_event_logs_keep_and_count_the_same(maxlen: int) -> None:
    """The C event log against the Python one: the events kept, oldest first, and how many
    were ever logged (what a report says was dropped)."""
    assert native is not None
    from gpubudget._core.recorder import _EventLog

    c, py = native.EventLog(maxlen), _EventLog(maxlen)
    rng = random.Random(maxlen)
    for step in range(2500):
        event = (step * 0.5, rng.choice(["alloc", "free", "deny"]), rng.randrange(9),
                 rng.choice([256, 2**70]), rng.choice([None, "t"]), step, step * 2)
        c.append(event)
        py.append(event)
        if step % 97 == 0:
            assert list(c) == list(py) and len(c) == len(py) and c.logged == py.logged
    assert list(c) == list(py) and c.logged == py.logged == 2500 and c.maxlen == py.maxlen
