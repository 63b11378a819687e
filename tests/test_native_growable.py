"""Growable roots (``initial=``) on the C fast path, against the Python core.

A growable root maps its memory granule by granule (``_core/memory.py``). The C core
allocates in it whole when every granule the block touches is mapped already (it reads the
``Mapping``'s ``mapped`` bytes, which one Python class keeps for both cores); a growth, a
sleeping root, or anything unusual goes through the Python methods. Here, on the host
backend's virtual ranges (``mmap``/``mprotect``):

- two growable roots fed the same random operations, one through the fast path and one
  through the Python methods, with trims, sleeps and wakes between them, growths the device
  refuses (a capped range), and the same answers, numbers, events, arena and mapped
  granules on both sides after every step;
- what runs in C and what in Python;
- threads allocating in C while others trim, sleep and wake the root: nothing lost, no
  block ever outside the mapped granules.

CI runs this file with the C core built; in the pure-Python run it is skipped.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from gpubudget import gpu_budget
from gpubudget._core import native
from gpubudget.backends.host import HostBackend
from gpubudget.units import KiB, MiB
from benchmarks.churn import grown, run_trace
from benchmarks.traces import churn
from tests.test_native import Trees, _python_calls

pytestmark = pytest.mark.skipif(native is None, reason="the C core is not built here")

GRANULE = 64 * KiB  # what the host backend maps at a time for these small roots


class GrowableTrees(Trees):
    """:class:`~tests.test_native.Trees` with growable roots, and their trims, sleeps and
    wakes."""

    @initialize(limit=st.integers(32, 512), align=st.sampled_from([1, 64, 256, 1024]),
                streams=st.booleans(), initial=st.sampled_from([0, 0, 64, 200]),
                capacity=st.sampled_from([None, None, 2, 4]))
    def start(self, limit: int, align: int, streams: bool, initial: int,
              capacity: int | None) -> None:
        self.capacity = capacity  # granules a root may map at once (the device's memory)
        mapped = min(initial * KiB, limit * KiB, (capacity or limit) * GRANULE)
        self.start_roots(limit, align, streams, initial=mapped)
        assert self.fast._node.tree is not None and self.fast._node.tree.mapping is not None

    def backend(self, streams: bool) -> HostBackend:
        backend = super().backend(streams)
        backend.device_capacity = None if self.capacity is None else self.capacity * GRANULE
        return backend

    @rule()
    def trim(self) -> None:
        assert self.fast.trim() == self.slow.trim()

    @rule()
    def offload(self) -> None:
        assert self.fast.offload() == self.slow.offload()

    @rule(keep=st.booleans())
    def restore(self, keep: bool) -> None:
        outcomes: list[int | str] = []
        for budget in (self.fast, self.slow):
            try:
                outcomes.append(budget.restore(keep_host=keep))
            except MemoryError as exc:  # the capped range cannot map them all back
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1]

    @invariant()
    def mappings_agree(self) -> None:
        if not hasattr(self, "fast"):
            return
        seen = []
        for root in (self.fast, self.slow):
            mapping = root._node.tree.mapping  # type: ignore[union-attr]
            assert mapping is not None
            seen.append((bytes(mapping.mapped), mapping.count, mapping.high,
                         mapping.asleep is None, mapping.kept_bytes, list(mapping.errors),
                         root.mapped))
        assert seen[0] == seen[1]


TestGrowableTrees = GrowableTrees.TestCase
TestGrowableTrees.settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def _in_c(work: Callable[[], object]) -> tuple[bool, object]:
    """Whether ``work()`` ran no function of gpubudget written in Python, and its answer."""
    answer: list[object] = []
    return _python_calls(lambda: answer.append(work())) == [], answer[0]


def test_a_block_in_mapped_granules_is_placed_in_c_and_a_growth_in_python() -> None:
    with gpu_budget(64 * MiB, initial=0, backend="host", name="grow") as pool:
        in_c, first = _in_c(lambda: pool.allocate(KiB))
        assert not in_c and pool.mapped == 4 * MiB  # grown: one granule (a 16th of the limit)
        in_c, second = _in_c(lambda: pool.allocate(KiB, tag="t"))
        assert in_c and isinstance(second, int)  # in the granule mapped
        assert _in_c(lambda: pool.free(second)) == (True, True)
        in_c, large = _in_c(lambda: pool.allocate(8 * MiB))
        assert not in_c and pool.mapped == 12 * MiB  # two more granules
        in_c, middle = _in_c(lambda: pool.allocate(3 * MiB))
        assert in_c and isinstance(large, int) and isinstance(middle, int)
        assert pool.free(large) and pool.free(middle)
        assert pool.trim() == 8 * MiB  # the first block's granule stays
        in_c, again = _in_c(lambda: pool.allocate(5 * MiB))
        assert not in_c and isinstance(again, int)  # grown again
        assert pool.offload() == KiB + 5 * MiB
        denied = pool.report().denied
        assert _in_c(lambda: pool.allocate(KiB)) == (False, None)  # asleep: denied in Python
        assert pool.report().denied == denied + 1
        pool.restore()
        in_c, last = _in_c(lambda: pool.allocate(KiB))
        assert in_c and isinstance(last, int)
        pool.check()
        for block in (first, again, last):
            assert isinstance(block, int) and pool.free(block)
        assert pool.used == 0


def test_a_growth_the_device_refuses_is_denied_alike_on_both_paths() -> None:
    answers = []
    for fast in (True, False):
        backend = HostBackend(device_capacity=2 * GRANULE)
        with gpu_budget(1 * MiB, initial=0, backend=backend, name="capped") as pool:
            tree = pool._node.tree
            assert tree is not None
            tree.fast = fast
            got = [pool.allocate(GRANULE) for _ in range(3)]  # the third needs a third granule
            report = pool.report()
            answers.append(([block is None for block in got], report.denied, pool.mapped,
                            dict(pool._node.stats.denials)))
            pool.check()
            for block in got:
                if block is not None:
                    pool.free(block)
    assert answers[0] == answers[1]
    assert answers[0][0] == [False, False, True] and answers[0][1] == 1


@pytest.mark.parametrize("fast", [True, False])
def test_a_mapping_whose_granules_are_short_is_read_as_python_reads_it(fast: bool) -> None:
    """``mapped`` replaced by a bytearray shorter than the range (Python code may put one
    there): the C core does not read past its end (where this one still holds a 1); the call
    fails as Python's does."""
    with gpu_budget(64 * MiB, initial=32 * MiB, backend="host") as pool:  # 8 granules of 4
        tree = pool._node.tree
        assert tree is not None and tree.mapping is not None
        tree.fast = fast
        first = pool.allocate(28 * MiB)  # granules 0 to 6: the next block lands in granule 7
        short = bytearray(b"\x01" * 8)
        del short[6:]  # 6 granules long; CPython keeps the buffer, a 1 at index 7
        saved, tree.mapping.mapped = tree.mapping.mapped, short
        try:
            with pytest.raises(IndexError):
                pool.allocate(KiB)
        finally:
            tree.mapping.mapped = saved
        assert pool.used == 28 * MiB and pool.free(first)  # type: ignore[arg-type]


def test_threads_allocating_in_c_while_others_trim_sleep_and_wake_keep_the_root_whole() -> None:
    """Six threads churn in a growable root (their blocks in mapped granules placed in C,
    growths in Python) while one thread trims in a loop and another puts the root to sleep
    and wakes it: nothing is lost, and ``check()`` (every block's granules mapped) holds."""
    with gpu_budget(256 * MiB, initial=0, backend="host", name="pool") as pool:
        errors: list[BaseException] = []
        done = threading.Event()

        def churn(seed: int) -> None:
            rng = random.Random(seed)
            mine: list[int] = []
            try:
                for _ in range(2000):
                    if mine and rng.random() < 0.5:
                        assert pool.free(mine.pop(rng.randrange(len(mine))))
                    else:
                        block = pool.allocate(rng.randint(1, 2 * MiB), tag=f"t{seed % 3}")
                        if block is not None:  # None: denied while asleep
                            mine.append(block)
                for block in mine:
                    assert pool.free(block)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def trim() -> None:
            try:
                while not done.is_set():
                    pool.trim()
                    pool.check()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def sleep() -> None:
            try:
                while not done.is_set():
                    pool.offload(pinned=False)
                    pool.check()
                    pool.restore()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        workers = [threading.Thread(target=churn, args=(i,)) for i in range(6)]
        others = [threading.Thread(target=trim), threading.Thread(target=sleep)]
        for thread in workers + others:
            thread.start()
        for thread in workers:
            thread.join(timeout=300)
            assert not thread.is_alive(), "a churning thread did not finish"
        done.set()
        for thread in others:
            thread.join(timeout=300)
            assert not thread.is_alive(), "the trimming or sleeping thread did not finish"
        assert errors == []
        pool.restore()
        pool.check()
        report = pool.report()
        assert pool.used == 0 and report.allocations == report.frees
        assert pool.trim() >= 0 and pool.mapped == 0


def test_the_benchmarks_growable_root_never_grows_while_timed() -> None:
    """``benchmarks.churn.grown`` maps the whole limit first, so the churn trace that is timed
    after it runs in C from its first step: its allocations call no Python, and nothing more
    is mapped."""
    with gpu_budget(1 << 30, initial=0, backend="host", name="churn") as pool:
        grown(pool)
        mapping = pool._node.tree.mapping  # type: ignore[union-attr]
        assert mapping is not None and pool.mapped == 1 << 30
        maps = mapping.count
        warmup, timed = churn(live=200, steps=2000, seed=3)
        called = _python_calls(lambda: run_trace(pool.allocate, pool.free, warmup, timed,
                                                 collect=False))
        # no function of gpubudget (the benchmark's own frames count where a checkout's path
        # names gpubudget)
        assert set(called) <= {"<lambda>", "run_trace"}, called
        assert mapping.count == maps and pool.used == 0
