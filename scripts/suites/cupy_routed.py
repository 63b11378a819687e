"""pytest plugin: every test inside a gpubudget budget, with CuPy's allocations routed into it.

Load it with ``-p scripts.suites.cupy_routed`` (the repository root on ``PYTHONPATH``)::

    python3 -m pytest -p scripts.suites.cupy_routed --gpubudget-limit 16GiB \\
        --gpubudget-mode root --gpubudget-outcomes out/root.json -n 8 tests/cupy_tests/...

An autouse fixture enters, before each test, ``gpu_budget(limit, name=<test>#<worker>.<n>)``
(``--gpubudget-mode root``: a root per test, which reserves its whole limit from the device;
``child``: a child of one root per worker process, of ``--gpubudget-root-limit``, entered at
the worker's start) and ``gpubudget.cupy.allocations(budget)``. After the test it leaves
both and calls ``budget.check()`` (an ``InvariantError`` fails the test's teardown, so pytest
reports it as an error, and is counted). Once pytest has finished the test's teardown (a
unittest case's instance goes only then), a budget not released at its exit (arrays or a
cache still hold its chunks) is retried after ``gc.collect()`` and
``gpubudget.cupy.release_cached()``, then after clearing CuPy's FFT plan cache (unless
``--gpubudget-keep-caches``), and checked again. Which step released it is recorded: the
counts say what held budgets, and reservations held by a cache do not pile up from test to
test.

``--gpubudget-off`` runs the tests unrouted and records the same way, for the comparison.
In every run, routed or not, what collection made is frozen (``gc.freeze()``; not with
``--gpubudget-no-freeze``): a full garbage collection of CuPy's collected suite costs tens
of milliseconds, which would otherwise land in whichever test Python's collector interrupts.
``--gpubudget-outcomes FILE.json`` writes the outcome file (see ``outcomes``), streamed as
the tests finish to ``FILE.jsonl``. Under pytest-xdist each worker routes its own tests and
the controller writes the file from the reports the workers send (the fixture's
measurements travel as user properties). For hangs use pytest-timeout's ``thread`` method
(``--timeout 30 --timeout-method thread``): it dumps every thread's stack and ends the
worker, which xdist reports as a crash of that test and replaces.

Each test's record holds what the fixture measured, in seconds: ``enter`` (the budget's
``__enter__``), ``route`` (``allocations().__enter__``), ``unroute``, ``exit`` (the budget's
``__exit__``, which for a root returns its reservation once nothing is left in it),
``release`` (the retries above), ``check``; and ``peak`` (bytes), ``released`` (``exit``,
``gc``, ``plan_cache`` or ``held``), ``held_bytes``, ``draining`` (retired CuPy pools whose
arrays were still alive when the test began), ``check_error``; the first test of a worker
also ``warmup`` (imports and a 1 MiB root entered once, before any test) and
``session_root``.

Imports CuPy and gpubudget's CuPy adapter only when a routed test runs.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest

from scripts.suites.outcomes import FAILURE, PROPERTY, Recorder, describe_failure, stream_path

__all__ = ["BACKEND_FACTORY", "Outcomes", "Routing"]

BACKEND_FACTORY: Callable[[], Any] | None = None
"""Makes the ``backend=`` of the roots; ``None``: gpubudget's choice (PyCUDA on a GPU).
The tests set it to host memory that says it is a device's."""

BUDGET_KEY: Final = pytest.StashKey[str]()
ROUTING_KEY: Final = pytest.StashKey["Routing"]()
PENDING_KEY: Final = pytest.StashKey[tuple[Any, dict[str, Any]]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpubudget", "every test inside a gpubudget budget (CuPy routed)")
    group.addoption("--gpubudget-limit", default="16GiB",
                    help="each test's budget (default 16GiB)")
    group.addoption("--gpubudget-mode", choices=("root", "child"), default="root",
                    help="root: a root budget per test; child: a child per test of one "
                         "root per worker")
    group.addoption("--gpubudget-root-limit", default="16GiB",
                    help="the limit of the worker's root in child mode (default 16GiB)")
    group.addoption("--gpubudget-off", action="store_true",
                    help="run unrouted (no budget), recording outcomes the same way")
    group.addoption("--gpubudget-keep-caches", action="store_true",
                    help="do not clear CuPy's FFT plan cache when it holds a budget")
    group.addoption("--gpubudget-outcomes", default=None, metavar="FILE.json",
                    help="write each test's outcome here (streamed to FILE.jsonl)")
    group.addoption("--gpubudget-label", default=None,
                    help="the run's name in the outcome file")
    group.addoption("--gpubudget-no-freeze", action="store_true",
                    help="do not gc.freeze() what collection made (routed or not)")


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


@dataclass
class Routing:
    """One process's routing: its options, the worker's root in child mode, a counter."""

    limit: str
    mode: str
    root_limit: str
    clear_caches: bool
    worker: str = field(default_factory=_worker)
    count: int = 0
    session_root: Any = None
    warmup_s: float | None = None
    session_root_s: float | None = None
    _modules: tuple[Any, Any, Any] | None = None

    def modules(self) -> tuple[Any, Any, Any]:
        """(gpubudget, gpubudget.cupy, cupy), imported on first use."""
        if self._modules is None:
            gpubudget = importlib.import_module("gpubudget")
            gbc = importlib.import_module("gpubudget.cupy")
            cupy = importlib.import_module("cupy")
            self._modules = (gpubudget, gbc, cupy)
        return self._modules

    def _root(self, limit: str, name: str) -> Any:
        gpubudget = self.modules()[0]
        backend = BACKEND_FACTORY() if BACKEND_FACTORY is not None else None
        return gpubudget.gpu_budget(limit, name=name, backend=backend)

    def warm_up(self) -> None:
        """Import everything and enter and leave a small root once, outside any test (so
        no test pays for imports, nor sees their warnings), then open the worker's root in
        child mode."""
        start = time.perf_counter()
        gbc, cupy = self.modules()[1:]
        with self._root("1MiB", f"warm-up@{self.worker}") as budget, gbc.allocations(budget):
            memory = cupy.cuda.alloc(256)
            del memory
        gbc.release_cached()
        self.warmup_s = time.perf_counter() - start
        if self.mode == "child":
            start = time.perf_counter()
            self.session_root = self._root(self.root_limit, f"session@{self.worker}")
            self.session_root.__enter__()
            self.session_root_s = time.perf_counter() - start

    def close(self) -> None:
        """Leave the worker's root (child mode) and check it; a failure is printed, not
        raised (pytest is ending, and the controller must still write the outcomes)."""
        root, self.session_root = self.session_root, None
        if root is None:
            return
        try:
            root.__exit__(None, None, None)
            root.check()
        except Exception as exc:  # noqa: BLE001
            print(f"\n[gpubudget] {self.worker}: the worker's root {root.name!r} at the end: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def around(self, item: pytest.Item) -> Generator[Any, None, None]:
        """The autouse fixture's body: the test runs at the ``yield``."""
        gpubudget, gbc, _ = self.modules()
        self.count += 1
        short = getattr(item, "originalname", None) or item.name.split("[")[0]
        name = f"{short}#{self.worker}.{self.count}"
        item.stash[BUDGET_KEY] = name
        info: dict[str, Any] = {"budget": name, "worker": self.worker,
                                "draining": len(getattr(gbc, "_draining", ()))}
        if self.count == 1:
            info.update(warmup=self.warmup_s, session_root=self.session_root_s)
        t0 = time.perf_counter()
        if self.mode == "child":
            budget = gpubudget.gpu_budget(self.limit, name=name, parent=self.session_root)
        else:
            budget = self._root(self.limit, name)
        budget.__enter__()
        t1 = time.perf_counter()
        routed = gbc.allocations(budget)
        try:
            routed.__enter__()
        except BaseException:
            budget.__exit__(None, None, None)
            raise
        t2 = time.perf_counter()
        info.update(enter=t1 - t0, route=t2 - t1)
        try:
            yield budget
        finally:
            self._after(item, budget, routed, info)

    def _after(self, item: pytest.Item, budget: Any, routed: Any, info: dict[str, Any]) -> None:
        """The fixture's teardown: leave the routing and the budget, ``check()``. What
        released the budget is looked at in :meth:`settle`, once pytest has let go of the
        test (a unittest case's instance goes in the item's own teardown, after this)."""
        gpubudget = self.modules()[0]
        errors: list[BaseException] = []
        item.stash[PENDING_KEY] = (budget, info)
        t3 = time.perf_counter()
        try:
            routed.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001 - raised once the budget is left too
            errors.append(exc)
        t4 = time.perf_counter()
        try:
            budget.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        t5 = time.perf_counter()
        try:
            budget.check()
        except gpubudget.InvariantError as exc:
            info["check_error"] = f"{type(exc).__name__}: {exc}"
            errors.insert(0, exc)
        t6 = time.perf_counter()
        info.update(unroute=t4 - t3, exit=t5 - t4, check=t6 - t5, peak=int(budget.peak),
                    released="exit" if budget.state == "released" else None)
        if errors:
            raise errors[0]

    def settle(self, item: pytest.Item) -> None:
        """After the test's whole teardown: a budget not released at its exit is retried
        after ``gc.collect()`` and ``release_cached()``, then after clearing CuPy's FFT plan
        cache; ``check()`` again; the measurements go to the teardown report."""
        pending = item.stash.get(PENDING_KEY, None)
        if pending is None:
            return
        del item.stash[PENDING_KEY]
        budget, info = pending
        gpubudget, gbc, cupy = self.modules()
        start = time.perf_counter()
        released = info.get("released")
        error: BaseException | None = None
        if released is None:
            for attribute in ("last_type", "last_value", "last_traceback", "last_exc"):
                if hasattr(sys, attribute):  # pytest keeps a failed test's frames there
                    setattr(sys, attribute, None)
            gc.collect()
            gbc.release_cached()
            released = "gc" if budget.state == "released" else None
            if released is None and self.clear_caches:
                try:
                    cupy.fft.config.clear_plan_cache()
                except Exception:  # noqa: BLE001 - a CuPy without cuFFT: nothing cached
                    pass
                gbc.release_cached()
                released = "plan_cache" if budget.state == "released" else None
            try:
                budget.check()
            except gpubudget.InvariantError as exc:
                info["check_error"] = info.get("check_error") or f"{type(exc).__name__}: {exc}"
                error = exc
        info.update(release=time.perf_counter() - start, released=released or "held",
                    held_bytes=0 if released else int(budget.used))
        info.setdefault("check_error", None)
        item.user_properties.append((PROPERTY, info))
        if error is not None:
            raise error


# -- pytest hooks ---------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    off = config.getoption("gpubudget_off")
    mode = config.getoption("gpubudget_mode")
    if not off:
        config.stash[ROUTING_KEY] = Routing(
            limit=config.getoption("gpubudget_limit"), mode=mode,
            root_limit=config.getoption("gpubudget_root_limit"),
            clear_caches=not config.getoption("gpubudget_keep_caches"))
    path = config.getoption("gpubudget_outcomes")
    if path and not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        recorder = Recorder(stream_path(path), {
            "label": config.getoption("gpubudget_label"),
            "mode": "off" if off else mode,
            "limit": None if off else config.getoption("gpubudget_limit"),
            "root_limit": config.getoption("gpubudget_root_limit")
            if not off and mode == "child" else None,
            "workers": getattr(config.option, "numprocesses", None),
            "args": [str(arg) for arg in config.args],
            "started": time.time()})
        config.pluginmanager.register(Outcomes(config, recorder, Path(path)),
                                      "gpubudget-outcomes")


def _runs_tests(config: pytest.Config) -> bool:
    """This process runs tests: a worker, or a run without xdist workers."""
    if hasattr(config, "workerinput"):
        return True
    return not getattr(config.option, "numprocesses", None) and \
        not getattr(config.option, "collectonly", False)


def pytest_sessionstart(session: pytest.Session) -> None:
    routing = session.config.stash.get(ROUTING_KEY, None)
    if routing is not None and _runs_tests(session.config):
        routing.warm_up()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection made (every run, routed or not): a full collection of a
    collected suite the size of CuPy's (some 220,000 objects) costs tens of milliseconds;
    frozen, the ``gc.collect()`` of :meth:`Routing.settle` and Python's own collections scan
    only what tests made since."""
    if not session.config.getoption("gpubudget_no_freeze") and session.items:
        gc.collect()
        gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    routing = session.config.stash.get(ROUTING_KEY, None)
    if routing is not None:
        routing.close()


@pytest.fixture(autouse=True)
def _gpubudget_routed(request: pytest.FixtureRequest) -> Generator[Any, None, None]:
    routing = request.config.stash.get(ROUTING_KEY, None)
    if routing is None:
        yield None
        return
    yield from routing.around(request.node)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    try:
        yield
    finally:
        routing = item.config.stash.get(ROUTING_KEY, None)
        if routing is not None:
            routing.settle(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if report.failed:
        exc = call.excinfo.value if call.excinfo is not None else None
        failure = describe_failure(call.when, exc, report.longreprtext,
                                   item.stash.get(BUDGET_KEY, None))
        report.user_properties = [*report.user_properties, (FAILURE + call.when, failure)]
    return report


class Outcomes:
    """The controller's part (or the only process's, without xdist): every report into
    the :class:`~scripts.suites.outcomes.Recorder`, the outcome file at the end."""

    def __init__(self, config: pytest.Config, recorder: Recorder, path: Path) -> None:
        self.config = config
        self.recorder = recorder
        self.path = path
        self.clock = time.perf_counter()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not getattr(self.config.option, "numprocesses", None):
            self.recorder.note_meta(collected=len(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if "collected" not in self.recorder.meta:
            self.recorder.note_meta(collected=len(ids))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.recorder.add(report.nodeid, str(report.when), report.outcome,
                          float(report.duration or 0.0), wasxfail=hasattr(report, "wasxfail"),
                          properties=report.user_properties,
                          text=report.longreprtext if report.failed else "")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        document = self.recorder.document(wall_s=round(time.perf_counter() - self.clock, 3),
                                          exitstatus=int(exitstatus))
        self.recorder.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(document, sort_keys=True), encoding="utf-8")
