"""Stream-ordered frees, on a backend whose stream work completes when the test says."""

from __future__ import annotations

from gpubudget import gpu_budget
from gpubudget.units import KiB
from tests.helpers import StreamBackend, consistent


def test_a_block_freed_on_a_stream_is_reused_at_once_by_that_stream_only() -> None:
    backend = StreamBackend()
    with gpu_budget("64KiB", backend=backend) as pool:
        a = pool.allocate(4 * KiB, stream=1)
        assert a is not None and pool.free(a, stream=1)
        assert pool.used == 0  # uncharged at once; the arena keeps it until stream 1 is done
        other = pool.allocate(4 * KiB, stream=2)
        assert other is not None and other != a  # stream 2 may not touch it yet
        same = pool.allocate(4 * KiB, stream=1)
        assert same == a  # same stream, same size: in order after the work that used it
        consistent(pool)
        for block in (other, same):
            assert pool.free(block)
    assert pool.state == "released"


def test_a_pending_block_returns_to_everyone_once_its_stream_is_done() -> None:
    backend = StreamBackend()
    with gpu_budget("16KiB", backend=backend) as pool:
        blocks = [pool.allocate(4 * KiB) for _ in range(4)]
        assert None not in blocks
        first = blocks[0]
        assert first is not None and pool.free(first, stream=7)
        assert pool.report().free_bytes == 0  # pending: still taken
        backend.finish(7)
        again = pool.allocate(4 * KiB)  # stream 7 is done: anyone may have it, no waiting
        assert again == first and backend.waits == 0
        consistent(pool)
        for block in [again, *blocks[1:]]:
            assert block is not None and pool.free(block)


def test_a_full_arena_waits_for_pending_frees_before_it_gives_up() -> None:
    backend = StreamBackend()
    with gpu_budget("16KiB", backend=backend) as pool:
        blocks = [pool.allocate(4 * KiB) for _ in range(4)]
        for block in blocks[:2]:
            assert block is not None and pool.free(block, stream=3)
        big = pool.allocate(8 * KiB, stream=9)  # only the pending blocks, merged, fit
        assert big is not None and backend.waits == 2  # it waited for both events
        consistent(pool)
        for block in [big, *blocks[2:]]:
            assert block is not None and pool.free(block)


def test_waiting_does_not_help_a_fragmented_arena() -> None:
    backend = StreamBackend()
    with gpu_budget("16KiB", backend=backend) as pool:
        blocks = [pool.allocate(4 * KiB) for _ in range(4)]
        for block in blocks[::2]:  # two pending holes, not adjacent
            assert block is not None and pool.free(block, stream=3)
        assert pool.allocate(8 * KiB) is None
        assert backend.waits == 2 and pool.report().denials[0].reason == "fragmented"
        consistent(pool)
        for block in blocks[1::2]:
            assert block is not None and pool.free(block)


def test_a_free_whose_stream_cannot_take_an_event_changes_nothing() -> None:
    backend = StreamBackend()
    with gpu_budget("16KiB", name="pool", backend=backend) as pool:
        block = pool.allocate(4 * KiB, tag="w")
        assert block is not None
        backend.fail_record = True
        assert pool.free(block, stream=0xBAD) is False
        assert pool.used == 4 * KiB and pool.size_of(block) == 4 * KiB  # still live, charged
        report = pool.report()
        assert report.frees == 0 and "invalid stream handle 0xbad" in report.callback_errors[0]
        consistent(pool)
        backend.fail_record = False
        assert pool.free(block)  # the block was not lost: it can still be freed
        consistent(pool)


def test_a_failing_event_is_reported_and_its_block_is_not_lost() -> None:
    backend = StreamBackend()
    with gpu_budget("16KiB", name="pool", backend=backend) as pool:
        block = pool.allocate(16 * KiB)
        assert block is not None and pool.free(block, stream=5)
        backend.fail_query = True  # the stream's context broke meanwhile
        again = pool.allocate(16 * KiB)
        assert again == block  # taken as done: the broken stream will not touch it again
        assert any("event query failed" in e for e in pool.report().callback_errors)
        consistent(pool)
        assert pool.free(again)


def test_the_root_waits_for_pending_frees_before_it_releases() -> None:
    backend = StreamBackend()
    with gpu_budget("16KiB", backend=backend) as pool:
        block = pool.allocate(KiB)
        assert block is not None and pool.free(block, stream=4)
    assert pool.state == "released" and backend.waits == 1
