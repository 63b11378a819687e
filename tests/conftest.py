"""Shared helpers: tests run on the host backend unless they say otherwise, and register
their root budgets in a host ledger of the test session's own (not the machine's)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from gpubudget._budget import roots, snapshot
from gpubudget.context import ACTIVE
from tests.helpers import forget_stale_handled_exception


@pytest.fixture(autouse=True)
def _host_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("GPUBUDGET_BACKEND", "host")
    yield
    leaked = ACTIVE.get()
    ACTIVE.set(())
    assert leaked == (), f"test left budgets active: {leaked}"
    still_open = [root.name for root in list(roots._open_roots) if root.state == "open"]
    roots._open_roots.clear()  # one test's leak does not fail the next
    assert still_open == [], f"test left root budgets open (entered, never exited): {still_open}"


@pytest.fixture(autouse=True, scope="session")
def _session_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The processes the suite starts (subprocesses, Ray workers) inherit it too."""
    os.environ["GPUBUDGET_LEDGER_DIR"] = str(tmp_path_factory.mktemp("ledger"))
    yield
    del os.environ["GPUBUDGET_LEDGER_DIR"]


@pytest.fixture(autouse=True)
def _leaks_stay_in_their_test() -> Iterator[None]:
    """What a test's budgets hold when it ends is the test's business (the tests of leaks
    assert ``report().leaks``, and the tests of what interpreter exit prints run a program
    of their own): the suite's own exit does not list them."""
    before = set(snapshot._watched)
    yield
    for budget in list(snapshot._watched):
        if budget not in before:
            snapshot._watched.discard(budget)


@pytest.fixture(autouse=True)
def _no_exception_left_handled(request: pytest.FixtureRequest) -> None:
    """A test that leaves an exception "being handled" fails, rather than some later test
    whose exceptions it would chain itself to."""

    def check() -> None:
        stale = forget_stale_handled_exception()
        assert stale is None, f"the test left {stale!r} as the exception being handled"

    request.addfinalizer(check)
