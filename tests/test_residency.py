"""Growable roots (``initial=``) on the host backend, whose ranges are mapped with
``mprotect``: a block outside a mapped granule would fault, as it would on a device."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpubudget import BudgetError, gpu_budget
from gpubudget.backends.host import HostBackend
from gpubudget.backends.virtual import HostVirtualRange
from gpubudget.units import KiB, MiB
from tests.helpers import consistent, fill, holds


def test_a_root_maps_as_blocks_need_and_never_more_than_its_limit() -> None:
    with gpu_budget("64MiB", initial="8MiB", backend="host", name="grow") as grow:
        assert grow.mapped == 8 * MiB  # granules of 4 MiB: a sixteenth of the limit
        a = grow.allocate("6MiB")
        assert a is not None and grow.mapped == 8 * MiB
        fill(a, 6 * MiB, 1)
        b = grow.allocate("10MiB")
        assert b is not None and grow.mapped == 16 * MiB
        fill(b, 10 * MiB, 2)
        with gpu_budget("64MiB", name="child") as child:
            c = child.allocate("40MiB")
            assert c is not None and grow.mapped == 56 * MiB
            fill(c, 40 * MiB, 3)
            assert child.allocate("16MiB") is None  # over the root's limit: never mapped
            assert grow.mapped <= 64 * MiB
        consistent(grow)
        assert holds(a, 6 * MiB, 1) and holds(b, 10 * MiB, 2)
        report = grow.report()
        assert report.mapped == grow.mapped and report.mapped_peak == 56 * MiB
        assert "device memory mapped 56.00 MiB" in str(report)


def test_trim_gives_back_what_no_block_touches_and_trim_on_exit() -> None:
    with gpu_budget("64MiB", initial=0, backend="host", trim_on_exit=True) as pool:
        kept = pool.allocate("4MiB")
        assert kept is not None
        with gpu_budget("32MiB") as child:
            scratch = child.allocate("20MiB")
            assert scratch is not None and pool.mapped == 24 * MiB
            child.free(scratch)
        assert pool.mapped == 4 * MiB  # trimmed when the child's scope ended
        fill(kept, 4 * MiB, 7)
        pool.free(kept)
        assert pool.trim() == 4 * MiB and pool.mapped == 0
        again = pool.allocate("4MiB")  # maps again, on demand
        assert again is not None and pool.mapped == 4 * MiB
        fill(again, 4 * MiB, 8)
        consistent(pool)


def test_a_growth_the_device_cannot_back_is_denied_device_full() -> None:
    backend = HostBackend(device_capacity=16 * MiB)  # the "device" has 16 MiB
    with gpu_budget("64MiB", initial=0, backend=backend, name="big") as big:
        a = big.allocate("12MiB")
        assert a is not None
        assert big.allocate("8MiB") is None
        (denial,) = big.report().denials
        assert (denial.reason, denial.refused_by) == ("device_full", "big")
        assert big.mapped == 12 * MiB and big.used == 12 * MiB  # nothing half done
        assert any("refused" in e for e in big.report().callback_errors)
        assert big.allocate("4MiB") is not None  # what fits still does
        consistent(big)


def test_offload_and_restore_keep_every_byte_at_the_same_address() -> None:
    with gpu_budget("64MiB", initial=0, backend="host", name="model") as model:
        blocks = {model.allocate(n * KiB): n for n in (100, 3000, 20_000)}
        for index, (address, n) in enumerate(blocks.items()):
            assert address is not None
            fill(address, n * KiB, index + 1)
        with gpu_budget("32MiB", name="head") as head:
            h = head.allocate("5MiB")
            assert h is not None
            fill(h, 5 * MiB, 9)
        gone = model.allocate("1MiB")
        assert gone is not None
        copied = model.offload()
        assert copied == model.used and model.mapped == 0
        assert model.report().asleep == copied and "asleep:" in str(model.report())
        assert model.allocate(100) is None and model.report().denials[-1].reason == "asleep"
        assert model.free(gone)  # frees work asleep
        consistent(model)
        assert model.restore() == copied - MiB
        assert model.mapped is not None and model.mapped > 0
        for index, (address, n) in enumerate(blocks.items()):
            assert address is not None and holds(address, n * KiB, index + 1)
        assert holds(h, 5 * MiB, 9)
        assert model.restore() == 0  # awake already
        consistent(model)


class _Flaky(HostVirtualRange):
    """Host addresses whose copies to the "device" call ``after_copy``."""

    __slots__ = ("after_copy",)
    after_copy: Callable[[], None] | None

    def to_device(self, device: int, host: int, nbytes: int) -> None:
        super().to_device(device, host, nbytes)
        if self.after_copy is not None:
            self.after_copy()


class _FlakyBackend(HostBackend):
    range: _Flaky

    def reserve_virtual(self, nbytes: int, granule: int) -> HostVirtualRange:
        self.range = _Flaky(nbytes, granule, self.device_capacity)
        self.range.after_copy = None
        return self.range


def test_a_restore_that_cannot_be_backed_or_is_interrupted_stays_asleep() -> None:
    backend = _FlakyBackend(device_capacity=32 * MiB)
    with gpu_budget("64MiB", initial=0, backend=backend) as pool:
        a, b = pool.allocate("8MiB"), pool.allocate("8MiB")
        assert a is not None and b is not None
        fill(a, 8 * MiB, 4)
        fill(b, 8 * MiB, 5)
        pool.offload()
        backend.range.capacity = 8 * MiB  # someone else took the device meanwhile
        with pytest.raises(MemoryError):
            pool.restore()
        assert pool.report().asleep == 16 * MiB and pool.mapped == 0
        backend.range.capacity = 32 * MiB
        copies: list[int] = []

        def ctrl_c() -> None:
            copies.append(1)
            raise KeyboardInterrupt  # a Ctrl-C lands during the first copy

        backend.range.after_copy = ctrl_c
        with pytest.raises(KeyboardInterrupt):
            pool.restore()
        assert len(copies) == 1 and pool.report().asleep == 16 * MiB and pool.mapped == 0
        backend.range.after_copy = None
        assert pool.restore() == 16 * MiB
        assert holds(a, 8 * MiB, 4) and holds(b, 8 * MiB, 5)
        consistent(pool)


def test_bad_uses_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="initial '2GiB'.*exceeds limit"):
        gpu_budget("1GiB", initial="2GiB")
    with pytest.raises(ValueError, match="initial"):
        gpu_budget("1GiB", initial=-1)
    with pytest.raises(TypeError, match="trim_on_exit"):
        gpu_budget("1GiB", initial=0, trim_on_exit="yes")  # type: ignore[arg-type]
    with gpu_budget("1MiB", backend="host", name="fixed") as fixed:
        with pytest.raises(BudgetError, match="reserved its whole limit"):
            fixed.trim()
        with pytest.raises(ValueError, match="initial= is for root budgets only"):
            with gpu_budget("512KiB", initial=0):
                pass  # pragma: no cover
        assert fixed.mapped is None and fixed.report().mapped is None
    with gpu_budget("4MiB", initial=0, backend="host") as pool:
        with gpu_budget("1MiB") as child:
            with pytest.raises(BudgetError, match="a child"):
                child.offload()
    with pytest.raises(BudgetError, match="released"):
        pool.restore()

    class NoVirtual(HostBackend):
        reserve_virtual = None  # type: ignore[assignment]

    with pytest.raises(BudgetError, match="initial= needs a backend that maps"):
        with gpu_budget("4MiB", initial=0, backend=NoVirtual()):
            pass  # pragma: no cover


def test_threads_allocate_while_the_root_grows() -> None:
    with gpu_budget("256MiB", initial=0, backend="host") as pool:
        errors: list[BaseException] = []

        def work(index: int) -> None:
            try:
                with gpu_budget("64MiB", parent=pool, name=f"t{index}") as mine:
                    for round_ in range(50):
                        block = mine.allocate((round_ % 7 + 1) * 100 * KiB)
                        assert block is not None
                        fill(block, 100 * KiB, index)
                        assert holds(block, 100 * KiB, index)
                        mine.free(block)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        consistent(pool)


class GrowableModel(RuleBasedStateMachine):
    """Random allocations, frees, trims, sleeps and wakes of a growable root on a "device"
    smaller than its limit: every block keeps its bytes, every check passes."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = HostBackend(device_capacity=3 * MiB)
        self.budget = gpu_budget("4MiB", initial=0, backend=self.backend, align=4096)
        self.budget.__enter__()
        self.blocks: dict[int, tuple[int, int]] = {}  # address -> (size, byte)
        self.asleep = False
        self.byte = 0

    @rule(size=st.integers(1, 600 * KiB))
    def allocate(self, size: int) -> None:
        address = self.budget.allocate(size)
        if self.asleep:
            assert address is None
        elif address is not None:
            self.byte = self.byte % 250 + 1
            fill(address, size, self.byte)
            self.blocks[address] = (size, self.byte)

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        address = data.draw(st.sampled_from(sorted(self.blocks)))
        assert self.budget.free(address)
        del self.blocks[address]

    @rule()
    def trim(self) -> None:
        if not self.asleep:
            self.budget.trim()

    @rule()
    def sleep(self) -> None:
        self.budget.offload()
        self.asleep = True

    @rule()
    def wake(self) -> None:
        self.budget.restore()
        self.asleep = False

    @invariant()
    def bytes_and_books_hold(self) -> None:
        consistent(self.budget)
        mapped = self.budget.mapped
        assert mapped is not None and mapped <= 3 * MiB
        if not self.asleep:
            for address, (size, byte) in self.blocks.items():
                assert holds(address, size, byte)
        else:
            assert mapped == 0

    def teardown(self) -> None:
        self.budget.__exit__(None, None, None)


TestGrowableModel = GrowableModel.TestCase
TestGrowableModel.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_the_host_ledger_counts_what_a_growable_root_maps() -> None:
    from gpubudget.hostledger import host_view

    with gpu_budget("64MiB", initial="8MiB", backend="host", name="lazy") as lazy:
        def entry() -> Any:
            (found,) = [e for e in host_view(nvml=False).entries if e.name == "lazy"]
            return found

        assert (entry().limit, entry().reserved) == (64 * MiB, 8 * MiB)
        block = lazy.allocate("20MiB")
        assert block is not None and entry().reserved == lazy.mapped == 20 * MiB
        lazy.free(block)
        lazy.trim()
        assert entry().reserved == 0
        lazy.offload()
        assert entry().reserved == 0
        lazy.restore()


def test_stream_ordered_frees_wait_on_a_growable_root_and_offload_waits_for_them() -> None:
    from tests.helpers import StreamBackend

    backend = StreamBackend()
    with gpu_budget("64MiB", initial=0, backend=backend) as pool:
        a = pool.allocate("8MiB", stream=7)
        assert a is not None
        fill(a, 8 * MiB, 3)
        assert pool.free(a, stream=7)
        assert pool.allocate("8MiB", stream=7) == a  # same stream: reused at once
        assert pool.free(a, stream=7)
        assert pool.trim() == 0  # the pending block's granules stay mapped
        b = pool.allocate("4MiB")
        assert b is not None
        fill(b, 4 * MiB, 4)
        pool.offload()  # waits for the stream's work before anything is copied
        assert backend.waits >= 1 and pool.mapped == 0
        pool.restore()
        assert holds(b, 4 * MiB, 4)
        consistent(pool)


def test_a_growable_roots_trace_reads_replays_and_fits(tmp_path: Path) -> None:
    from gpubudget.replay import fit, replay
    from gpubudget.tracefile import read_trace

    path = tmp_path / "grow.jsonl"
    with gpu_budget("64MiB", initial=0, backend="host", name="grow", trace=path):
        with gpu_budget("32MiB", name="model") as model:
            kept = model.allocate("20MiB", tag="weights")
            scratch = model.allocate("8MiB", tag="scratch")
            assert kept is not None and scratch is not None
            model.free(scratch)
            assert model.allocate("40MiB") is None  # over the child's limit
        model.free(kept)
    trace = read_trace(path)
    (report,) = replay(trace).reports
    assert (report.name, report.peak, report.denied) == ("grow", 28 * MiB, 0)
    assert report.children[0].denied == 1  # the recorded refusal, refused again
    fitted = {found.name: found for found in fit(trace)}
    assert fitted["grow"].limit >= 28 * MiB and fitted["model"].peak == 28 * MiB


def test_tensorrt_and_cupy_allocate_in_a_growable_root(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from gpubudget import cupy as gbc
    from tests.fakes import DeviceHostBackend, fake_cupy

    class DeviceGrowable(DeviceHostBackend):
        pass  # host memory named device 0: adapters route to it; it can grow

    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    with gpu_budget("64MiB", initial=0, backend=DeviceGrowable(0), name="mixed") as mixed:
        with gbc.allocations():
            array = cp.allocate(5 * MiB)
        assert mixed.mapped == 8 * MiB and mixed.used >= 5 * MiB  # two 4 MiB granules
        trt = pytest.importorskip("tensorrt_rtx_bindings")
        from gpubudget import tensorrt as gbt
        from tests.trampoline import Trampoline

        cpp = Trampoline(gbt.allocator(trt_module=trt))
        address = cpp.allocate(10 * MiB, 0, 0)
        assert address is not None and mixed.mapped == 16 * MiB  # [5, 15) MiB: 2 more
        fill(address, 10 * MiB, 6)
        assert holds(address, 10 * MiB, 6) and cpp.deallocate(address)
        del array
    gbc.release_cached()
    assert mixed.report().state == "released"


def test_a_restore_can_keep_the_host_memory_for_the_next_sleep() -> None:
    with gpu_budget("64MiB", initial=0, backend="host") as pool:
        a = pool.allocate("8MiB")
        assert a is not None
        fill(a, 8 * MiB, 1)
        pool.offload()
        pool.restore(keep_host=True)
        report = pool.report()
        assert report.host_kept == 8 * MiB and "8.00 MiB of host memory kept" in str(report)
        small = pool.allocate("1MiB")
        assert small is not None
        fill(small, MiB, 2)
        pool.free(a)
        pool.offload()  # 1 MiB now: the kept 8 MiB serve it
        assert pool.report().asleep == MiB and pool.report().host_kept == 0
        pool.restore()
        assert holds(small, MiB, 2) and pool.report().host_kept == 0
        consistent(pool)


def test_a_share_of_the_device_can_grow_too(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))  # no other root
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "1GiB")  # the host as a GPU of 1 GiB
    with gpu_budget("50%", initial="8MiB", backend="host", name="half") as half:
        assert half.limit == 512 * MiB and half.mapped == 32 * MiB  # one granule: 1/16 of it
