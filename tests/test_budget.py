from __future__ import annotations

import random
import threading
import warnings

import pytest

from gpubudget import Budget, BudgetError, BudgetNestingError, gpu_budget
from gpubudget.backends.host import HostBackend
from gpubudget.adapter import hooks

from tests.helpers import RecordingBackend, fill, holds

KiB = 1024
MiB = 2**20


# -- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "quoted"),
    [
        ({"limit": "4 parsecs"}, ValueError, "'4 parsecs'"),
        ({"limit": True}, TypeError, "True"),
        ({"limit": -1}, ValueError, "-1"),
        ({"limit": 0}, ValueError, "0"),
        ({"limit": float("nan")}, TypeError, "nan"),
        ({"limit": "1MiB", "align": 3}, ValueError, "3"),
        ({"limit": "1MiB", "align": 0}, ValueError, "0"),
        ({"limit": "1MiB", "align": 256.0}, TypeError, "256.0"),
        ({"limit": "1MiB", "name": ""}, ValueError, "''"),
        ({"limit": "1MiB", "name": 7}, TypeError, "7"),
        ({"limit": "1MiB", "reserve": "2MiB"}, ValueError, "'2MiB'"),
        ({"limit": "1MiB", "reserve": "lots"}, ValueError, "'lots'"),
        ({"limit": "1MiB", "backend": "tpu"}, ValueError, "'tpu'"),
        ({"limit": "1MiB", "backend": 3}, TypeError, "3"),
        ({"limit": "1MiB", "track_stacks": "yes"}, TypeError, "'yes'"),
    ],
)
def test_bad_arguments_fail_at_construction_quoting_the_input(
    kwargs: dict[str, object], error: type[Exception], quoted: str
) -> None:
    with pytest.raises(error) as info:
        gpu_budget(**kwargs)  # type: ignore[arg-type]
    assert quoted in str(info.value)


def test_repr_shows_name_limit_used_and_state() -> None:
    budget = gpu_budget("1MiB", name="det")
    assert all(part in repr(budget) for part in ("'det'", "1.00 MiB", "new"))
    with budget:
        block = budget.allocate(1000)
        assert "used=1.00 KiB" in repr(budget) and "open" in repr(budget)
    assert "exited" in repr(budget)
    assert block is not None and budget.free(block)
    assert "used=0 B" in repr(budget) and "released" in repr(budget)


# -- limits, alignment, nesting ----------------------------------------------------------------


def test_root_reserves_once_and_blocks_are_aligned_real_memory() -> None:
    backend = RecordingBackend()
    with gpu_budget("1MiB", align=512, name="root", backend=backend) as root:
        (reservation,) = backend.reservations
        blocks = [root.allocate(size) for size in (1, 700, 4096, 513)]
        assert all(b is not None and b % 512 == 0 for b in blocks)
        assert root.used == 512 + 1024 + 4096 + 1024  # charged aligned sizes
        for i, (block, size) in enumerate(zip(blocks, (1, 700, 4096, 513))):
            assert block is not None
            assert reservation.address <= block < reservation.address + reservation.nbytes
            fill(block, size, i + 1)
        for i, (block, size) in enumerate(zip(blocks, (1, 700, 4096, 513))):
            assert block is not None and holds(block, size, i + 1)


def test_requested_alignment_above_align_is_honoured_and_charged() -> None:
    with gpu_budget("1MiB") as root:
        block = root.allocate(100, alignment=8192)
        assert block is not None and block % 8192 == 0
        assert root.used == 8192
        assert root.size_of(block) == 8192


@pytest.mark.parametrize("alignment", [3, -4, 1000, 2.0, "x"])
def test_bad_alignment_is_denied_not_raised(alignment: object) -> None:
    with gpu_budget("1MiB") as root:
        assert root.allocate(100, alignment) is None  # type: ignore[call-overload]
        assert root.report().denials[0].reason == "invalid_alignment"


@pytest.mark.parametrize("size", [0, -1, "", "0B", "-1KiB", "1 lb", "1.5B"])
def test_bad_size_is_denied_not_raised(size: object) -> None:
    with gpu_budget("1MiB") as root:
        assert root.allocate(size) is None  # type: ignore[call-overload]
        block = root.allocate(KiB)
        assert block is not None and root.resize(block, size) is None  # type: ignore[arg-type]
        report = root.report()
        assert report.denied == 2 and {d.reason for d in report.denials} == {"invalid_size"}
        assert root.size_of(block) == KiB  # the old block untouched


def test_size_strings_are_sizes_in_allocate_and_resize() -> None:
    from gpubudget import AllocationDenied

    with gpu_budget("1MiB", name="pool") as pool:
        block = pool.allocate("1.5 KiB", tag="text")
        assert block is not None and pool.used == 1536 and pool.size_of(block) == 1536
        assert pool.resize(block, "4KiB") == block and pool.used == 4 * KiB
        assert pool.allocate("2MiB") is None  # a size, over the limit
        assert pool.report().denials[0].reason == "over_limit"
        with pytest.raises(AllocationDenied, match=r"refused '1 lb' .*invalid size: .*unknown "
                                                    r"unit 'lb'") as caught:
            pool.allocate("1 lb", raise_on_denial=True)
        assert (caught.value.reason, caught.value.size) == ("invalid_size", 0)
        with pytest.raises(AllocationDenied, match=r"refused '2MiB' \(2.00 MiB aligned\)"):
            pool.allocate("2MiB", raise_on_denial=True)
        assert pool.free(block)
    with gpu_budget("1KiB", name="later") as later:
        pass
    assert later.allocate("1KiB") is None  # released: denied, counted with its size
    assert later.report().denials[0].largest == KiB


def test_child_charges_every_ancestor_and_any_ancestor_can_refuse() -> None:
    with gpu_budget("1MiB", name="root") as root:
        with gpu_budget("768KiB", name="mid") as mid:
            with gpu_budget("1MiB", name="leaf") as leaf:  # overcommits: mid is the cap
                a = leaf.allocate(500 * KiB)
                assert a is not None
                assert (root.used, mid.used, leaf.used) == (500 * KiB, 500 * KiB, 500 * KiB)
                assert leaf.allocate(300 * KiB) is None  # mid would exceed 768 KiB
                denial = leaf.report().denials[0]
                assert (denial.reason, denial.refused_by) == ("over_limit", "mid")
                assert leaf.available == 268 * KiB
                assert leaf.free(a)
        assert root.used == mid.used == 0
        assert leaf.peak == mid.peak == root.peak == 500 * KiB


def test_overcommitted_siblings_are_capped_by_the_parent() -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        with gpu_budget("768KiB", name="a") as a:
            assert a.allocate(600 * KiB) is not None
        with gpu_budget("768KiB", name="b") as b:
            assert b.allocate(500 * KiB) is None
            assert b.report().denials[0].refused_by == "pool"
            assert b.allocate(400 * KiB) is not None
    assert pool.used == 1000 * KiB


def test_fragmentation_is_reported_apart_from_limits() -> None:
    with gpu_budget("64KiB", align=256, name="frag") as root:
        blocks = [root.allocate(4 * KiB) for _ in range(16)]
        for block in blocks[::2]:
            assert block is not None and root.free(block)
        assert root.available == 32 * KiB
        assert root.allocate(8 * KiB) is None  # 32 KiB free, no 8 KiB run
        report = root.report()
        assert report.denials[0].reason == "fragmented"
        assert report.largest_free_block == 4 * KiB and report.free_bytes == 32 * KiB


def test_reserve_floor_is_set_aside_for_the_child() -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        with gpu_budget("512KiB", name="vip", reserve="256KiB") as vip:
            assert pool.used == 256 * KiB  # set aside at entry
            block = vip.allocate(100 * KiB)
            assert pool.used == 256 * KiB  # inside the floor: the parent sees no change
        with gpu_budget("1MiB", name="other") as other:  # a sibling of vip
            assert other.available == 768 * KiB
            assert other.allocate(800 * KiB) is None
            hog = other.allocate(768 * KiB)
            assert hog is not None
        more = vip.allocate(156 * KiB)  # the floor is still there for vip
        assert more is not None and block is not None
        assert vip.allocate(KiB) is None  # past the floor the pool is full
        assert vip.report().denials[0].refused_by == "pool"
        for budget, address in ((other, hog), (vip, block), (vip, more)):
            assert budget.free(address)
        assert vip.state == "released"
        assert pool.used == 0  # the floor went back with the child


def test_reserve_above_what_the_parent_has_raises_budget_error() -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        assert pool.allocate(900 * KiB) is not None
        with pytest.raises(BudgetError, match="'greedy'.*reserve"):
            with gpu_budget("512KiB", name="greedy", reserve="512KiB"):
                pass  # pragma: no cover
        assert pool.used == 900 * KiB


def test_root_larger_than_memory_raises_budget_error_with_free_and_total() -> None:
    # More than a process's address space (128 TiB on x86-64): refused even where the kernel
    # overcommits memory, as it does on the GPU machines.
    with pytest.raises(BudgetError) as info:
        with gpu_budget("256TiB", name="huge"):
            pass  # pragma: no cover
    assert isinstance(info.value, MemoryError)
    message = str(info.value)
    assert "'huge'" in message and "256.00 TiB" in message and "free of" in message


# -- scope rules --------------------------------------------------------------------------------


def test_budget_is_single_use() -> None:
    budget = gpu_budget("1MiB", name="once")
    with budget:
        pass
    with pytest.raises(RuntimeError, match="'once' was already entered"):
        budget.__enter__()


def test_misnested_exit_raises_nesting_error() -> None:
    outer = gpu_budget("1MiB", name="outer")
    inner = gpu_budget("512KiB", name="inner")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(BudgetNestingError, match="'outer'.*'inner'"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    from gpubudget import current_budget

    assert current_budget() is None


def test_exception_in_block_propagates_and_budget_exits() -> None:
    budget = gpu_budget("1MiB")
    with pytest.raises(KeyError, match="boom"):
        with budget:
            raise KeyError("boom")
    assert budget.state == "released"


def test_misnesting_during_an_exception_does_not_hide_it() -> None:
    outer = gpu_budget("1MiB", name="outer")
    inner = gpu_budget("512KiB", name="inner")
    outer.__enter__()
    inner.__enter__()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outer.__exit__(ValueError, ValueError("original"), None)
    assert any("'outer'" in str(w.message) for w in caught)
    inner.__exit__(None, None, None)


@pytest.mark.parametrize("backend", ["host", HostBackend()])
def test_backend_is_for_roots_only(backend: object) -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        odd = gpu_budget("1KiB", name="odd", backend=backend)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="'odd' was given backend=.* inside 'pool'; "
                                             "backend= is for root budgets only"):
            odd.__enter__()
        assert odd.state == "new" and pool.children == ()  # nothing changed
        with pytest.raises(ValueError, match="backend= is for root budgets only"):
            with gpu_budget("1KiB", backend=backend, parent=pool):  # type: ignore[arg-type]
                pass  # pragma: no cover


def test_a_child_on_another_device_is_told_device_not_backend() -> None:
    with gpu_budget("1MiB", name="pool", backend=DeviceBackend(0)) as pool:
        with pytest.raises(ValueError, match="'odd' was given device=1 .* on device 0"):
            with gpu_budget("1KiB", name="odd", device=1, backend="pycuda"):
                pass  # pragma: no cover
        with gpu_budget("1KiB", name="same", device=0) as same:  # its root's device: fine
            assert same.device == 0


class DeviceBackend(HostBackend):
    """Host memory that says it is a CUDA device's."""

    def __init__(self, ordinal: int) -> None:
        super().__init__()
        self.ordinal = ordinal


# -- lifetime -----------------------------------------------------------------------------------


def test_blocks_outlive_the_scope_and_reservation_returns_after_last_free() -> None:
    backend = RecordingBackend()
    with gpu_budget("1MiB", name="root", backend=backend) as root:
        with gpu_budget("512KiB", name="child") as child:
            block = child.allocate(1000)
            assert block is not None
            fill(block, 1000, 0xAB)
    (reservation,) = backend.reservations
    assert (root.state, child.state) == ("exited", "exited")
    assert not reservation.released
    assert holds(block, 1000, 0xAB)
    late = child.allocate(2000)  # an exited budget still serves its bound users
    assert late is not None
    assert child.free(block) and child.free(late)
    assert (root.state, child.state) == ("released", "released")
    assert reservation.released
    assert child.allocate(100) is None
    assert child.report().denials[-1].reason == "released"


def test_pins_keep_the_reservation_after_exit() -> None:
    with gpu_budget("1MiB") as root:
        hooks(root).pin()
    assert root.state == "exited"  # pinned: still serving
    block = root.allocate(100)
    assert block is not None
    hooks(root).unpin()
    assert root.state == "exited"  # the live block still holds it
    assert root.free(block)
    assert root.report().state == "released"
    with pytest.raises(BudgetError, match="released"):
        hooks(root).pin()


def test_unpin_alone_releases_an_exited_budget() -> None:
    with gpu_budget("1MiB", name="p") as parent:
        with gpu_budget("1KiB", name="c") as child:
            hooks(child).pin()
    assert (parent.state, child.state) == ("exited", "exited")  # the child holds the parent
    hooks(child).unpin()
    assert (parent.state, child.state) == ("released", "released")


def test_allocate_before_entry_is_denied() -> None:
    budget = gpu_budget("1MiB")
    assert budget.allocate(10) is None
    assert budget.report().denials[0].reason == "inactive"


def test_free_rules() -> None:
    with gpu_budget("1MiB", name="root") as root:
        with gpu_budget("512KiB", name="a") as a:
            block = a.allocate(100)
        with gpu_budget("512KiB", name="b") as b:
            assert block is not None
            assert not b.free(block)  # not b's block
            assert not root.free(12345)
            assert not root.free("nope")  # type: ignore[arg-type]
            assert not root.free([1])  # type: ignore[arg-type]
            assert root.free(block)  # an ancestor may free it
            assert not a.free(block)  # double free
    assert b.report().invalid_frees == 1
    assert a.report().invalid_frees == 1
    assert root.report().invalid_frees == 3


def test_resize_in_place_moves_and_refuses() -> None:
    with gpu_budget("64KiB", align=256) as root:
        block = root.allocate(1 * KiB)
        assert block is not None
        fill(block, KiB, 7)
        assert root.resize(block, 4 * KiB) == block  # grows into the free tail
        assert root.used == 4 * KiB
        blocker = root.allocate(KiB)
        assert blocker is not None
        moved = root.resize(block, 8 * KiB)  # blocked: moves
        assert moved is not None and moved != block
        assert holds(moved, KiB, 7) and root.size_of(moved) == 8 * KiB
        assert root.used == 9 * KiB and root.size_of(block) == 0
        assert root.resize(moved, 2 * KiB) == moved  # shrinks in place
        assert root.used == 3 * KiB
        assert root.resize(moved, 128 * KiB) is None  # over the limit: untouched
        assert root.size_of(moved) == 2 * KiB and holds(moved, KiB, 7)
        assert root.resize(99, KiB) is None


# -- concurrency --------------------------------------------------------------------------------


def test_threads_never_share_blocks_or_corrupt_accounting() -> None:
    errors: list[str] = []
    with gpu_budget("8MiB", name="pool") as pool:
        children = [gpu_budget("3MiB", name=f"t{i}") for i in range(4)]
        for child in children:  # siblings, each entered then exited in this thread
            with child:
                pass
        barrier = threading.Barrier(len(children))

        def work(index: int, budget: Budget) -> None:
            rng = random.Random(index)
            mine: list[tuple[int, int, int]] = []
            barrier.wait()
            for step in range(1500):
                if mine and (len(mine) > 20 or rng.random() < 0.45):
                    address, size, byte = mine.pop(rng.randrange(len(mine)))
                    if not holds(address, size, byte):
                        errors.append(f"block {address:#x} overwritten")
                    if not budget.free(address):
                        errors.append("free failed")
                else:
                    size = rng.randrange(1, 64 * KiB)
                    block = budget.allocate(size)
                    if block is not None:
                        byte = (index * 31 + step) % 251 + 1
                        fill(block, size, byte)
                        mine.append((block, size, byte))
            for address, size, byte in mine:
                if not holds(address, size, byte):
                    errors.append(f"block {address:#x} overwritten")
                budget.free(address)

        threads = [threading.Thread(target=work, args=(i, c)) for i, c in enumerate(children)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert pool.used == 0 and all(c.used == 0 for c in children)
        assert pool.peak <= pool.limit and all(c.peak <= c.limit for c in children)
        pool.check()
        assert sum(c.report().allocations for c in children) == sum(
            c.report().frees for c in children
        )


# -- what issue reports and callers ask -----------------------------------------------------------


class Index:
    """An integer-like value, as numpy.int64 is: it has __index__, it is not an int."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_integer_like_sizes_are_sizes_and_floats_are_not() -> None:
    with gpu_budget(Index(1 << 20), align=Index(512), name="pool") as pool:  # type: ignore[arg-type]
        assert pool.limit == 1 << 20 and pool.align == 512
        block = pool.allocate(Index(1000), Index(1024))
        assert block is not None and block % 1024 == 0 and pool.used == 1024
        assert pool.resize(Index(block), Index(2048)) == block
        assert pool.free(Index(block))
        with pytest.raises(TypeError, match="not float 1000.0"):
            pool.allocate(1000.0)  # type: ignore[call-overload]
        assert pool.report().denied == 0
    with pytest.raises(TypeError, match="1.5"):
        gpu_budget(1.5)  # type: ignore[arg-type]


def test_raise_on_denial_says_who_refused_why_and_how_much() -> None:
    from gpubudget import AllocationDenied

    with gpu_budget("1MiB", name="pool") as pool:
        with gpu_budget("2MiB", name="model") as model:  # overcommitted: the pool is the cap
            assert model.allocate(600 * KiB) is not None
            with pytest.raises(AllocationDenied) as info:
                model.allocate(500 * KiB, raise_on_denial=True)
            denied = info.value
            assert isinstance(denied, MemoryError)
            assert (denied.budget, denied.refused_by, denied.reason) == ("model", "pool", "over_limit")
            assert (denied.size, denied.charged) == (500 * KiB, 500 * KiB)
            assert "'model'" in str(denied) and "'pool'" in str(denied) and "500.00 KiB" in str(denied)
            with pytest.raises(AllocationDenied, match="invalid size"):
                model.allocate(0, raise_on_denial=True)
            address: int = model.allocate(KiB, raise_on_denial=True)  # typed as an int
            assert model.free(address)
            assert model.report().denied == 2  # counted like any denial
    late = gpu_budget("1MiB", name="late")
    with pytest.raises(AllocationDenied, match="inactive"):
        late.allocate(1, raise_on_denial=True)


def test_reset_peak_measures_one_phase_of_a_subtree() -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        with gpu_budget("1MiB", name="model") as model:
            loading = [model.allocate(100 * KiB, tag="weights") for _ in range(3)]
            for block in loading[1:]:
                assert block is not None and model.free(block)
            pool.reset_peak()
            assert (pool.peak, model.peak) == (100 * KiB, 100 * KiB)
            serving = model.allocate(10 * KiB, tag="activations")
            assert (pool.peak, model.peak) == (110 * KiB, 110 * KiB)
            report = model.report()
            assert report.peak_blocks == 2
            assert {u.tag: u.peak for u in report.by_tag} == {"weights": 100 * KiB,
                                                              "activations": 10 * KiB}
            for block in (loading[0], serving):
                assert block is not None and model.free(block)


def test_reports_roll_up_the_subtree_and_count_refusals_where_they_happen() -> None:
    with gpu_budget("64KiB", name="pool") as pool:
        with gpu_budget("1MiB", name="a") as a:
            blocks = [a.allocate(8 * KiB) for _ in range(3)]
            with gpu_budget("1MiB", name="a1") as a1:
                kept = a1.allocate(32 * KiB)
                assert a1.allocate(32 * KiB) is None  # the pool's limit refuses
            assert blocks[0] is not None and a.free(blocks[0])
        report = pool.report()
        a_report = report.children[0]
        assert (report.totals.allocations, report.totals.frees) == (4, 1)
        assert report.totals.denied == 1 and report.totals.live_blocks == 3
        assert (a_report.totals.allocations, a_report.totals.live_blocks) == (4, 3)
        assert (report.denied, report.refused) == (0, 1)  # refused here, asked below
        assert (a_report.children[0].denied, a_report.children[0].refused) == (1, 0)
        assert a_report.peak_blocks == 3 and a_report.children[0].peak_blocks == 1
        text = str(report)
        assert "refused 1 by its limit" in text and "with the budgets below: allocations 4" in text
        for block in blocks[1:]:
            assert block is not None and a.free(block)
        assert kept is not None and a1.free(kept)


def test_released_children_beyond_those_listed_still_count_in_totals() -> None:
    with gpu_budget("1MiB", name="server") as server:
        for request in range(50):  # a budget per request: only the last 32 stay listed
            with gpu_budget("64KiB", name=f"request-{request}") as budget:
                block = budget.allocate(KiB)
                assert block is not None and budget.free(block)
        report = server.report()
        assert len(report.children) == 32
        assert (report.totals.allocations, report.totals.frees) == (50, 50)


def test_the_text_report_caps_tags() -> None:
    with gpu_budget("1MiB", name="pool") as pool:
        for index in range(30):
            assert pool.allocate(KiB + index * 256, tag=f"tag-{index:02d}") is not None
        text = str(pool.report()).split("by tag")[1]
    assert "tag-29" in text and "tag-00" not in text  # largest peaks first
    assert "... 10 more tags" in text
