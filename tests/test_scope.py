from __future__ import annotations

import asyncio
import contextvars
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpubudget import Budget, bind, current_budget, gpu_budget, use
from gpubudget.budget import THREAD_ROOT


def test_current_budget_follows_nesting() -> None:
    assert current_budget() is None
    with gpu_budget("1MiB", name="a") as a:
        assert current_budget() is a
        with gpu_budget("1KiB", name="b") as b:
            assert current_budget() is b and b.parent is a and a.children == (b,)
        assert current_budget() is a
    assert current_budget() is None


def test_new_threads_do_not_inherit_but_bind_carries_budgets() -> None:
    seen: list[Budget | None] = []
    with gpu_budget("1MiB", name="pool") as pool:
        thread = threading.Thread(target=lambda: seen.append(current_budget()))
        thread.start()
        thread.join()
        with ThreadPoolExecutor(2) as executor:
            bound = executor.submit(bind(current_budget)).result()
            blocks = list(executor.map(bind(lambda size: current_budget().allocate(size)), [10, 20]))  # type: ignore[union-attr]
    assert seen == [None]
    assert bound is pool
    assert all(block is not None for block in blocks)
    assert pool.report().allocations == 2


def test_bind_passes_arguments_and_nested_budgets_in_threads_become_children() -> None:
    def in_thread(limit: str) -> Budget:
        with gpu_budget(limit, name="worker") as worker:
            return worker

    with gpu_budget("1MiB", name="pool") as pool:
        with ThreadPoolExecutor(1) as executor:
            worker = executor.submit(bind(in_thread, "1KiB")).result()
    assert worker.parent is pool


def test_bind_rejects_non_callables() -> None:
    with pytest.raises(TypeError, match="42"):
        bind(42)  # type: ignore[arg-type]


def test_asyncio_tasks_each_see_their_own_innermost_budget() -> None:
    async def model(name: str, limit: str) -> tuple[str, str | None, int | None]:
        async with gpu_budget(limit, name=name) as budget:
            await asyncio.sleep(0.01)  # interleave with the other task
            inner = current_budget()
            block = budget.allocate(1000)
            await asyncio.sleep(0.01)
            return name, inner.name if inner else None, block

    async def main() -> tuple[Budget, list[tuple[str, str | None, int | None]]]:
        async with gpu_budget("1MiB", name="pool") as pool:
            results = await asyncio.gather(model("det", "64KiB"), model("cls", "64KiB"))
            return pool, list(results)

    pool, results = asyncio.run(main())
    assert [(name, inner) for name, inner, _ in results] == [("det", "det"), ("cls", "cls")]
    assert {child.name for child in pool.children} == {"det", "cls"}
    assert pool.used == 2048


# -- the thread-pool trap: a root entered in a thread while another is open -----------------


def _in_a_thread(work: Callable[[], object]) -> list[warnings.WarningMessage]:
    """Run ``work`` in a new thread; the warnings gpubudget gave (not, say, a ResourceWarning
    of some earlier test's garbage that the collector finalized meanwhile)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ThreadPoolExecutor(1) as executor:
            executor.submit(work).result()
    return ours(caught)


def ours(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [warning for warning in caught if str(warning.message).startswith("gpubudget")]


def test_a_root_entered_in_a_thread_while_another_is_open_is_warned_at_its_line() -> None:
    def request() -> Budget:
        with gpu_budget("1KiB", name="request") as budget:  # the trap: a root, not a child
            return budget
    line = request.__code__.co_firstlineno + 1

    with gpu_budget("1MiB", name="server") as server:
        caught = _in_a_thread(request)
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    warning = caught[0]
    assert (warning.filename, warning.lineno) == (__file__, line)
    message = str(warning.message)
    assert message.startswith(THREAD_ROOT + ": 'request' (1.00 KiB) is entered in thread")
    for advice in ("'server' is open", "gpubudget.use(parent)", "parent=parent",
                   "gpubudget.bind(fn)", f"warnings.filterwarnings('ignore', message="
                                         f"{THREAD_ROOT!r})"):
        assert advice in message, advice
    assert server.children == ()  # it was a root indeed


def test_no_warning_for_a_child_a_main_thread_root_or_a_lone_root() -> None:
    def child_by_use(pool: Budget) -> None:
        with use(pool), gpu_budget("1KiB") as child:
            assert child.parent is pool

    def child_by_parent(pool: Budget) -> None:
        with gpu_budget("1KiB", parent=pool) as child:
            assert child.parent is pool

    def child_by_bind() -> None:
        with gpu_budget("1KiB") as child:
            assert child.parent is not None

    def lone_root() -> None:
        with gpu_budget("1KiB") as root:
            assert root.parent is None

    with gpu_budget("1MiB", name="pool") as pool:
        assert _in_a_thread(lambda: child_by_use(pool)) == []
        assert _in_a_thread(lambda: child_by_parent(pool)) == []
        assert _in_a_thread(bind(child_by_bind)) == []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            contextvars.Context().run(lone_root)  # the main thread: a root is meant
        assert ours(caught) == []
    assert _in_a_thread(lone_root) == []  # no other root is open


def test_the_filter_the_warning_names_silences_it() -> None:
    def separate() -> None:
        with gpu_budget("1KiB", name="separate") as root:
            assert root.parent is None

    with gpu_budget("1MiB", name="pool"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message=THREAD_ROOT)
            with ThreadPoolExecutor(1) as executor:
                executor.submit(separate).result()
    assert ours(caught) == []
