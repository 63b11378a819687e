"""Attacks on the C core (``_core/*.c``) and on what it shares with the Python core.

Each test states behaviour the Python core (the reference) has, or that both must have. The
ones marked ``xfail(strict=True)`` fail on the code they were written against: each names the
defect, and flips to a pass (and so to a strict-xfail failure) once it is fixed.

- the collector running a finalizer inside the fast path, between the limit check and the
  commit (``tag_add`` builds a list): the finalizer's allocation passes the same check;
- a Ctrl-C (or any exception) raised by a clock written in Python is cleared by the fast path
  (``stamp``), which then hands the call to Python: the interrupt is lost;
- a clock that raises: the Python core raises after the commit (a block nobody can free);
- a clock written in Python is read before the tree's lock: the timeline is out of order;
- side by side, more operations than ``test_native.Trees`` has: pins, exited budgets freed
  through ancestors, growable roots, stacks, labels that are not strings, ``raise_on_denial``,
  the contextvar holding the label;
- the registry's open addressing with keys that collide and wrap around the table;
- threads with a tiny switch interval mixing the fast path with everything that takes the
  tree's lock;
- fork while another thread holds a tree's lock (both cores: no at-fork hook yet);
- limits and requests beyond 64 bits, and give-backs, in the C ledger.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import itertools
import os
import platform
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from gpubudget import AllocationDenied, Budget, gpu_budget, label
from gpubudget._core import ledger, native
from gpubudget.backends.host import HostBackend
from gpubudget.context import LABEL
from gpubudget.units import KiB, MiB
from gpubudget.adapter import hooks
from tests.helpers import StreamBackend, consistent, finishes, python_paths
from tests.test_native import Trees

C_CORE = native is not None
needs_c = pytest.mark.skipif(not C_CORE, reason="the C core is not built here")


class _ClockBackend(HostBackend):
    """Host memory whose timeline clock is a Python method (as the replay backend's)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.fail: int = 0  # raise on the next `fail` calls (-1: always)
        self.interrupt = False  # send SIGINT to this process on the next call

    def clock(self) -> float:
        self.calls += 1
        if self.interrupt:
            self.interrupt = False
            os.kill(os.getpid(), signal.SIGINT)  # delivered at the clock's next instruction
        if self.fail:
            self.fail -= 1 if self.fail > 0 else 0
            raise RuntimeError("the clock broke")
        return time.perf_counter()


@contextlib.contextmanager
def _collect_at_next_list(make_garbage: Callable[[], None]) -> Iterator[None]:
    """Make ``make_garbage()``'s cycles, then have the collector run at the next new list
    the interpreter makes (3.11: a collection starts when a new container is allocated and
    gen-0 is over its threshold)."""
    old = gc.get_threshold()
    gc.collect()
    gc.disable()
    make_garbage()
    hold: list[list[int]] = [[] for _ in range(200)]  # empties the list free list: the next list is new
    gc.set_threshold(1)
    gc.enable()
    try:
        yield
    finally:
        gc.set_threshold(*old)
        del hold


# -- 1. the collector inside the fast path ----------------------------------------------


def test_a_finalizer_run_by_the_collector_inside_allocate_cannot_overrun_the_limit() -> None:
    with gpu_budget(8 * KiB, align=256, name="root", backend="host"):
        with gpu_budget(2 * KiB, name="child") as child:
            first = child.allocate(KiB)
            got: list[int | None] = []

            class Grab:
                me: object

                def __del__(self) -> None:
                    got.append(child.allocate(KiB))

            def garbage() -> None:
                grab = Grab()
                grab.me = grab  # a cycle: only the collector frees it

            with _collect_at_next_list(garbage):
                second = child.allocate(KiB, tag="fresh")  # a new tag: a new list
            gc.collect()
            try:
                assert len(got) == 1  # the finalizer ran (inside allocate or before it)
                assert child.used <= child.limit
                child.check()
            finally:
                for address in (first, second, *got):
                    if address is not None:
                        child.free(address)


# -- 2. a clock written in Python --------------------------------------------------------


def test_a_ctrl_c_landing_in_a_python_clock_is_not_lost() -> None:
    backend = _ClockBackend()
    # Ctrl-C as from a terminal (a background job of a script inherits SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with gpu_budget(64 * KiB, name="root", backend=backend) as pool:
            backend.interrupt = True
            with pytest.raises(KeyboardInterrupt):
                pool.allocate(KiB)
            assert pool.used == 0 and len(pool._node.tree.live) == 0  # type: ignore[union-attr]
            pool.check()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_timeline_stays_in_time_order_with_a_python_clock_and_threads() -> None:
    class Ticking(HostBackend):
        def __init__(self) -> None:
            super().__init__()
            self.ticks = itertools.count()

        def clock(self) -> float:
            tick = next(self.ticks)
            time.sleep(0)  # any Python code may switch threads here
            return float(tick)

    with gpu_budget(4 * MiB, name="root", backend=Ticking()) as pool:
        def churn() -> None:
            for _ in range(200):
                block = pool.allocate(256)
                assert block is not None and pool.free(block)

        threads = [threading.Thread(target=churn) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        times = [event[0] for event in pool._node.tree.recorder.events]  # type: ignore[union-attr]
        assert len(times) == 1600
        assert times == sorted(times)


def test_a_clock_that_raises_leaves_allocate_all_or_nothing() -> None:
    backend = _ClockBackend()
    with gpu_budget(64 * KiB, name="root", backend=backend) as pool:
        backend.fail = -1
        try:
            address = pool.allocate(KiB)
        except RuntimeError:
            address = None
        backend.fail = 0
        live = pool._node.tree.live  # type: ignore[union-attr]
        try:
            if address is None:  # raised: nothing may have changed
                assert pool.used == 0 and len(live) == 0
            else:
                assert address in live
        finally:
            for block in list(live):
                pool.free(block)


def test_a_clock_that_raises_leaves_free_all_or_nothing() -> None:
    backend = _ClockBackend()
    with gpu_budget(64 * KiB, name="root", backend=backend) as pool:
        block = pool.allocate(KiB)
        assert block is not None
        live = pool._node.tree.live  # type: ignore[union-attr]
        backend.fail = -1
        try:
            freed: bool | None = pool.free(block)
        except RuntimeError:
            freed = None
        backend.fail = 0
        try:
            if freed is None:  # raised: the block must still be there
                assert block in live and pool.used == KiB
            else:
                assert freed and block not in live
        finally:
            for address in list(live):
                pool.free(address)


def test_a_python_clock_is_read_once_per_operation() -> None:
    backend = _ClockBackend()
    with gpu_budget(64 * KiB, name="root", backend=backend) as pool:
        calls = []
        works: list[Callable[[], object]] = [lambda: pool.allocate(MiB),  # denied: too big
                                             lambda: pool.free(12345)]  # not a block
        for work in works:
            backend.calls = 0
            work()
            calls.append(backend.calls)
        python_paths(pool)  # every call through the Python methods
        backend.calls = 0
        block = pool.allocate(KiB)
        calls.append(backend.calls)
        assert block is not None and pool.free(block)
        assert calls == [1, 0, 1]  # an invalid free logs no event


# -- 3. labels and tags the fast path must leave to Python ----------------------------------


class _Text(str):
    """A str subclass: not a tag (``type(tag) is str`` is the rule)."""


@needs_c
@pytest.mark.parametrize("value", [7, _Text("sub"), b"bytes", None, "plain"])
def test_a_label_contextvar_holding_anything_answers_as_python(value: object) -> None:
    results = []
    for fast in (True, False):
        context = contextvars.Context()

        def run(fast: bool = fast) -> tuple[Any, ...]:
            with gpu_budget(64 * KiB, name="root", backend="host") as pool:
                if not fast:
                    python_paths(pool)
                token = LABEL.set(value)  # type: ignore[arg-type]
                try:
                    block = pool.allocate(KiB)
                finally:
                    LABEL.reset(token)
                report = pool.report()
                outcome = (block is not None, pool.used, dict(pool._node.stats.tags),
                           dict(pool._node.stats.denials), report.denied)
                if block is not None:
                    assert pool.free(block)
                pool.check()
                return outcome

        results.append(context.run(run))
    assert results[0] == results[1]


# -- 4. side by side, more operations --------------------------------------------------------


class MoreTrees(Trees):
    """``test_native.Trees`` with more of what the fast path must see right: pins on exited
    budgets, growable roots, stacks, raise_on_denial, labels that are not strings."""

    @initialize(limit=st.integers(32, 512), align=st.sampled_from([1, 64, 256, 1024]),
                streams=st.booleans(), growable=st.booleans())
    def start(self, limit: int, align: int, streams: bool,
              growable: bool) -> None:
        def backend() -> HostBackend:
            return StreamBackend() if streams else HostBackend()

        self.contexts = (contextvars.Context(), contextvars.Context())
        initial = limit * KiB // 4 if growable else None
        self.fast = gpu_budget(limit * KiB, align=align, name="root", backend=backend(),
                               initial=initial)
        self.slow = gpu_budget(limit * KiB, align=align, name="root", backend=backend(),
                               initial=initial)
        self.contexts[0].run(self.fast.__enter__)
        self.contexts[1].run(self.slow.__enter__)
        python_paths(self.slow)
        self.open: list[tuple[Budget, Budget]] = [(self.fast, self.slow)]
        self.known: list[tuple[Budget, Budget]] = [(self.fast, self.slow)]
        self.pinned: list[tuple[Budget, Budget]] = []

    @rule(which=st.integers(0, 50))
    def pin(self, which: int) -> None:
        pair = self.known[which % len(self.known)]
        outcomes = []
        for budget in pair:
            try:
                hooks(budget).pin()
                outcomes.append("pinned")
            except Exception as exc:  # noqa: BLE001 - both must fail alike
                outcomes.append(f"{type(exc).__name__}: {exc}")
        assert outcomes[0] == outcomes[1]
        if outcomes[0] == "pinned":
            self.pinned.append(pair)

    @precondition(lambda self: bool(getattr(self, "pinned", None)))
    @rule(which=st.integers(0, 50))
    def unpin(self, which: int) -> None:
        pair = self.pinned.pop(which % len(self.pinned))
        for budget in pair:
            hooks(budget).unpin()

    @rule(limit=st.integers(1, 300), stacks=st.booleans())
    def enter_stacks(self, limit: int, stacks: bool) -> None:
        self.enter_both(limit, f"s{len(self.known)}", track_stacks=stacks)

    @rule(target=Trees.blocks, which=st.integers(0, 50), size=st.integers(1, 80 * KiB),
          odd=st.sampled_from([7, _Text("sub"), "ok", None]))
    def allocate_raising(self, which: int, size: int, odd: object) -> tuple[int, int | None]:
        index = which % len(self.known)
        got = []
        for context, budget in zip(self.contexts, self.known[index]):
            def run(budget: Budget = budget) -> str | int:
                token = LABEL.set(odd)  # type: ignore[arg-type]
                try:
                    return budget.allocate(size, raise_on_denial=True)
                except AllocationDenied as exc:
                    return str(exc)
                finally:
                    LABEL.reset(token)

            got.append(context.run(run))
        offsets = [g - self._base(b) if isinstance(g, int) else g
                   for g, b in zip(got, self.known[index])]
        assert offsets[0] == offsets[1]
        return (index, offsets[0] if isinstance(offsets[0], int) else None)

    def teardown(self) -> None:
        for pair in getattr(self, "pinned", []):
            for budget in pair:
                hooks(budget).unpin()
        super().teardown()


TestMoreTrees = MoreTrees.TestCase
TestMoreTrees.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
TestMoreTrees = needs_c(TestMoreTrees)


# -- 5. the registry's open addressing -----------------------------------------------------


@needs_c
def test_registry_runs_that_collide_and_wrap_around_answer_as_a_dict() -> None:
    """Keys whose home slots are the last three and the first of a 64-slot table: every
    deletion shifts entries back across the end of the table."""
    assert native is not None
    mask = (1 << 64) - 1

    def home(key: int) -> int:
        return ((key * 0x9E3779B97F4A7C15) & mask) >> 58  # 64 slots: the top 6 bits

    keys = [key for key in range(1, 200_000) if home(key) in (61, 62, 63, 0)][:40]
    rng = random.Random(5)
    owner = object()
    for _ in range(100):
        registry, reference = native.Registry(), {}
        for _ in range(300):
            key = rng.choice(keys)
            if rng.random() < 0.55:
                value = (owner, rng.randrange(1, 99), None, None)
                registry[key] = value
                reference[key] = value
            else:
                assert registry.pop(key, None) == reference.pop(key, None)
            assert all(registry.get(k) == reference.get(k) for k in keys)
        assert sorted(registry.items()) == sorted(reference.items())


@needs_c
def test_registry_and_arena_refuse_edge_integers_without_harm() -> None:
    assert native is not None
    registry = native.Registry()
    for key in (-1, -(2**63), 2**63 - 1, 2**63, 2**200, -(2**200)):
        assert key not in registry and registry.get(key, "none") == "none"
        with pytest.raises((TypeError, KeyError)):
            registry[key] = (object(), 1, None, None)
        with pytest.raises(KeyError):
            del registry[key]
    arena = native.Arena(1 << 20, 1 << 20, 256)
    for size in (0, -1, -(2**63), 2**63, 2**200, 2**63 - 1):
        assert arena.allocate(size) is None
    for address in (-1, 2**63, 2**200, -(2**200), (1 << 20) + 1):
        assert arena.free(address) == 0
        assert arena.resize(address, 256) is False
    block = arena.allocate(256)
    assert block is not None
    assert arena.resize(block, -(2**63)) is False and arena.resize(block, 2**200) is False
    assert arena.free(block) == 256 and arena.free_bytes == 1 << 20


# -- 6. threads -----------------------------------------------------------------------------


def test_threads_with_a_tiny_switch_interval_keep_the_tree_whole() -> None:
    """Eight threads: fast-path allocate and free in children with and without a reserve,
    frees through the root, labels, moving resizes, grandchildren entered and left,
    reset_peak; one more thread reports and checks all along. Nothing lost, nothing hung."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []

    def main() -> None:
        with gpu_budget(32 * MiB, backend="host", name="pool") as pool:
            stop = threading.Event()

            def churn(seed: int) -> None:
                rng = random.Random(seed)
                mine: list[int] = []
                reserve = 64 * KiB if seed % 2 else None
                try:
                    with gpu_budget(4 * MiB, name=f"c{seed}", parent=pool,
                                    reserve=reserve) as child:
                        for _ in range(2000):
                            who = child if seed % 3 else pool
                            roll = rng.random()
                            if mine and roll < 0.45:
                                by = pool if rng.random() < 0.3 else who
                                assert by.free(mine.pop(rng.randrange(len(mine))))
                            elif roll < 0.9:
                                scope = (label(f"l{seed % 2}") if rng.random() < 0.3
                                         else contextlib.nullcontext())
                                with scope:
                                    block = who.allocate(rng.randint(1, 32 * KiB),
                                                         rng.choice([0, 0, 4096]),
                                                         tag=rng.choice([None, "a", "b"]))
                                if block is not None:
                                    mine.append(block)
                            elif roll < 0.93 and mine:
                                moved = who.resize(mine[-1], rng.randint(1, 512 * KiB))
                                if moved is not None:
                                    mine[-1] = moved
                            elif roll < 0.96:
                                with gpu_budget(256 * KiB, name="g", parent=who) as inner:
                                    block = inner.allocate(1000)
                                    if block is not None:
                                        mine.append(block)  # freed later, the budget exited
                            else:
                                who.reset_peak()
                        for block in mine:
                            assert pool.free(block)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            def watch() -> None:
                while not stop.is_set():
                    pool.report()
                    pool.check()

            watcher = threading.Thread(target=watch)
            workers = [threading.Thread(target=churn, args=(i,)) for i in range(8)]
            watcher.start()
            for thread in workers:
                thread.start()
            for thread in workers:
                thread.join()
            stop.set()
            watcher.join()
            consistent(pool)
            assert pool.used == 0 and len(pool._node.tree.live) == 0  # type: ignore[union-attr]

    try:
        finishes(main, 120)
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


# -- 7. fork while another thread holds the tree's lock ------------------------------------


class _SlowCopy(HostBackend):
    """Host memory whose copy (a moving resize, the tree's lock held) waits for a cue."""

    def __init__(self) -> None:
        super().__init__()
        self.copying = threading.Event()
        self.go_on = threading.Event()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.copying.set()
        self.go_on.wait(120)
        super().copy(dst, src, nbytes)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_while_another_thread_holds_the_lock_does_not_hang() -> None:
    backend = _SlowCopy()
    with gpu_budget(256 * KiB, name="root", backend=backend) as pool:
        first = pool.allocate(4 * KiB)
        blocker = pool.allocate(4 * KiB)  # first cannot grow in place: the resize moves
        assert first is not None and blocker is not None
        mover = threading.Thread(target=pool.resize, args=(first, 64 * KiB))
        mover.start()
        try:
            assert backend.copying.wait(120)
            pid = os.fork()
            if pid == 0:  # the child: its main thread, killed by SIGALRM if it hangs
                # (not a new thread: one may get the identity of the parent's thread that
                # holds the lock, and take it "again")
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(60)  # a hang guard: it takes microseconds
                pool.allocate(KiB)
                os._exit(0)
            deadline = time.monotonic() + 120
            while True:
                finished, status = os.waitpid(pid, os.WNOHANG)
                if finished or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if not finished:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            assert finished and os.waitstatus_to_exitcode(status) == 0
        finally:
            backend.go_on.set()
            mover.join()
            for address in list(pool._node.tree.live):  # type: ignore[union-attr]
                pool.free(address)


@pytest.mark.skipif(not hasattr(os, "fork") or platform.libc_ver()[0] != "glibc",
                    reason="glibc gives a forked child's first new thread the identity of a "
                           "parent thread it did not copy")
def test_a_new_thread_in_a_forked_child_changes_nothing_of_a_tree_a_parent_thread_held() -> None:
    """glibc may give the child's first new thread the identity of the parent's thread that held
    the tree's lock: the child's trees are closed (forks.py) and their locks made anew, so that
    thread neither waits for nor enters the parent's operation: nothing of it changes."""
    with gpu_budget(64 * KiB, name="root", backend="host") as pool:
        lock = pool._node.tree.lock  # type: ignore[union-attr]
        block = pool.allocate(KiB)
        held, go_on = threading.Event(), threading.Event()

        def holder() -> None:
            lock.acquire()
            held.set()
            go_on.wait(120)
            lock.release()

        thread = threading.Thread(target=holder)
        thread.start()
        try:
            assert held.wait(120)
            pid = os.fork()
            if pid == 0:
                seen: list[object] = []

                def probe() -> None:
                    seen.append(pool.allocate(KiB))
                    seen.append(pool.free(block))  # type: ignore[arg-type]
                    seen.append(pool.used)

                thread_in_child = threading.Thread(target=probe)
                thread_in_child.start()
                thread_in_child.join(120)
                os._exit(0 if seen == [None, False, KiB] else 3)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        finally:
            go_on.set()
            thread.join()
            pool.free(block)  # type: ignore[arg-type]


# -- 8. limits and requests beyond 64 bits -----------------------------------------------


@pytest.mark.parametrize("size", [2**63 - 1, 2**64, 2**63 - 256])
def test_a_huge_request_is_refused_by_the_limit_it_exceeds(size: int) -> None:
    with gpu_budget(MiB, name="root", backend="host") as root:
        root.allocate(512)  # the child's chain is not empty: used + delta near 2**63
        with gpu_budget(2**70, name="child") as child:
            child.allocate(512)
            with pytest.raises(AllocationDenied, match="over the limit of 'root'"):
                child.allocate(size, raise_on_denial=True)
            assert child._node.account.refusals == 0
            assert set(child._node.stats.denials) == {("over_limit", "root")}
            for report in root.report().walk():
                for live in report.live_blocks:
                    root.free(live.address)


@needs_c
@pytest.mark.parametrize("limit", [2**70, 2**63 - 1, 100])
def test_the_c_ledger_never_refuses_a_give_back(limit: int) -> None:
    assert native is not None
    python_account, _, _, _, python_refusal = ledger.PYTHON[:5]
    for delta in (-5, -(2**63)):
        assert python_refusal(python_account("a", limit), delta) is None
        assert native.refusal(native.Account("a", limit), delta) is None
