from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpubudget import Budget, bind, current_budget, gpu_budget


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
