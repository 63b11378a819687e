"""Shared helpers: tests run on the host backend unless they say otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpubudget.context import ACTIVE


@pytest.fixture(autouse=True)
def _host_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("GPUBUDGET_BACKEND", "host")
    yield
    leaked = ACTIVE.get()
    ACTIVE.set(())
    assert leaked == (), f"test left budgets active: {leaked}"
