"""A thread that takes a tree's lock over and over (``trim()`` in a loop) cannot keep the
threads that allocate and free out: each ``trim()`` lets a thread waiting for the lock take
it before it may take it again.

The lock itself is not fair: a thread that releases it and asks again at once gets it before
the thread that the release woke, which must first be scheduled. In the pure-Python core four
allocating threads did not finish in 200 s beside a fifth calling ``trim()`` in a loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from gpubudget import gpu_budget
from gpubudget.backends.host import HostBackend
from gpubudget.backends.virtual import HostVirtualRange
from gpubudget.units import KiB, MiB

JOIN_SECONDS = 120.0  # generous: expiring fails the test, it never passes one


class _GatedRange(HostVirtualRange):
    """Host addresses whose ``unmap`` (trim's work, the lock held) calls a hook first."""

    __slots__ = ("hook",)
    hook: Callable[[], None]

    def unmap(self, index: int) -> None:
        self.hook()
        super().unmap(index)


class _Gated(HostBackend):
    def __init__(self) -> None:
        super().__init__()
        self.hook: Callable[[], None] = lambda: None

    def reserve_virtual(self, nbytes: int, granule: int) -> HostVirtualRange:
        gated = _GatedRange(nbytes, granule, self.device_capacity)
        gated.hook = lambda: self.hook()
        return gated


def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for ``condition`` (set by another thread), failing loudly after a long time."""
    deadline = time.monotonic() + JOIN_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"waited {JOIN_SECONDS} s for {what}"
        time.sleep(0.001)


def test_a_thread_waiting_for_the_lock_takes_it_before_the_next_trim() -> None:
    backend = _Gated()
    with gpu_budget("64MiB", initial=0, name="pool", backend=backend) as pool:
        tree = pool._node.tree
        assert tree is not None
        block = pool.allocate(MiB)
        assert block is not None and pool.free(block)  # a granule mapped and unused: trimmed
        worker = threading.Thread(target=lambda: pool.allocate(KiB))

        def inside_trim() -> None:  # the lock held: a thread comes to allocate, and waits
            backend.hook = lambda: None
            worker.start()
            _until(lambda: tree.turns.waiting == 1, "the allocating thread to wait")

        backend.hook = inside_trim
        assert pool.trim() > 0
        with tree.lock:  # what a trim() called next would do first
            used = pool.used
        worker.join(JOIN_SECONDS)
        assert not worker.is_alive()
        assert used == KiB, "trim() took the lock again before the thread that waited for it"
        for live in pool.report().live_blocks:
            pool.free(live.address)


@pytest.mark.parametrize("threads", [4])
def test_allocating_threads_finish_beside_a_thread_that_trims_in_a_loop(threads: int) -> None:
    steps = 2000
    with gpu_budget("64MiB", initial=0, name="pool", backend="host") as pool:
        done = [0] * threads
        trims = [0]
        stop = threading.Event()
        errors: list[BaseException] = []

        def allocate_and_free(index: int) -> None:
            try:
                for _ in range(steps):
                    block = pool.allocate(64 * KiB)
                    assert block is not None and pool.free(block)
                    done[index] += 1
            except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
                errors.append(exc)

        def trim() -> None:
            while not stop.is_set():
                pool.trim()
                trims[0] += 1

        trimmer = threading.Thread(target=trim)
        workers = [threading.Thread(target=allocate_and_free, args=(i,)) for i in range(threads)]
        trimmer.start()
        for worker in workers:
            worker.start()
        try:
            for worker in workers:
                worker.join(JOIN_SECONDS)
            stuck = [worker.name for worker in workers if worker.is_alive()]
        finally:
            stop.set()
            trimmer.join(JOIN_SECONDS)
        assert not errors, errors[0]
        assert not stuck, (f"{len(stuck)} allocating threads not done after {JOIN_SECONDS} s "
                           f"(steps done: {done}, trims: {trims[0]})")
        assert done == [steps] * threads and trims[0] > 0
        assert pool.used == 0
        pool.check()
