"""gpubudget.ray: budgeted Ray actors on a real local cluster with logical GPUs (simulated in
host memory), and the pieces that need no Ray.

The cluster is one per module: ``ray.init(num_cpus=2, num_gpus=2)`` with
``GPUBUDGET_DEVICE_MEMORY=8GiB``. Three actors of ``num_gpus=0.5`` (the ``trio``) live for the
whole module, so one half GPU is left: the tests that need another actor take it in turn and
free it when they end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import doctest
import importlib
import importlib.util
import inspect
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpubudget import Budget, BudgetError, current_budget, format_size, gpu_budget, use
from gpubudget.ray import (
    ActorEntry,
    ActorInfo,
    ClusterReport,
    FlatReport,
    PlacementError,
    SimulatedGpu,
    budgeted,
    cluster_report,
    ray_command,
)
from gpubudget.ray import actor as ray_actor
from gpubudget.ray import methods
from gpubudget.ray.placement import cuda_ordinal, derived_limit, gpu_share, open_device
from gpubudget.ray.registry import REGISTRY_NAME, REGISTRY_NAMESPACE, Registry, RegistryBook
from gpubudget.units import GiB, MiB
from tests.helpers import subprocess_env

if TYPE_CHECKING:
    from ray.actor import ActorClass, ActorHandle

HAVE_RAY = importlib.util.find_spec("ray") is not None
NO_RAY = "Ray is not installed: pip install -e '.[dev,ray-serve]'"
DEVICE_MEMORY = "8GiB"
HALF_GPU_LIMIT = 3 * GiB
"""Half of an 8 GiB GPU, less the default 1 GiB margin."""
ANSWER_WAIT = 30.0
"""Seconds the registry may wait for the actors' reports (they answer at once when idle)."""
DEATH_WAIT = 60.0
"""Seconds to wait for Ray to collect an actor whose handles are all gone."""


# -- without Ray ------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["", ".actor", ".placement", ".simulated", ".registry",
                                    ".report", ".command"])
def test_docstring_examples(module: str) -> None:
    """Those that need no cluster run; the others are marked to be skipped."""
    result = doctest.testmod(importlib.import_module(f"gpubudget.ray{module}"),
                             optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_gpu_share_takes_up_to_one_gpu_and_says_what_is_supported() -> None:
    assert gpu_share({"GPU": 0.25, "CPU": 1.0}, "actor A") == 0.25
    assert gpu_share({"GPU": 1.0}, "actor A") == 1.0
    with pytest.raises(PlacementError, match=r"actor A was given no GPU.*0 < num_gpus <= 1"):
        gpu_share({"CPU": 1.0}, "actor A")
    with pytest.raises(PlacementError, match=r"num_gpus=2: .*supports 0 < num_gpus <= 1"):
        gpu_share({"GPU": 2.0}, "actor A")


def test_cuda_ordinal_maps_rays_gpu_id_through_cuda_visible_devices() -> None:
    assert cuda_ordinal([5], "5", "a") == ("5", 0)
    assert cuda_ordinal(["1"], "0, 1", "a") == ("1", 1)
    assert cuda_ordinal([2], None, "a") == ("2", 2)
    with pytest.raises(PlacementError, match=r"Ray GPU '3'.*CUDA_VISIBLE_DEVICES='0,1'"):
        cuda_ordinal([3], "0,1", "a")
    with pytest.raises(PlacementError, match=r"GPUs \[0, 1\].*one GPU per actor"):
        cuda_ordinal([0, 1], "0,1", "a")


def test_default_limit_is_the_share_less_the_margin_in_whole_mib() -> None:
    assert derived_limit(0.5, 8 * GiB, GiB, "a") == 3 * GiB
    assert derived_limit(0.3, 10 * GiB, 0, "a") == 3 * GiB // MiB * MiB
    assert derived_limit(1 / 3, 3 * GiB, 0, "a") % MiB == 0
    with pytest.raises(PlacementError, match=r"share 0.1 .* not more than the 1.00 GiB margin"):
        derived_limit(0.1, 8 * GiB, GiB, "a")


def test_device_memory_comes_from_cuda_or_the_environment(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setenv("GPUBUDGET_BACKEND", "host")
    monkeypatch.delenv("GPUBUDGET_DEVICE_MEMORY", raising=False)
    with pytest.raises(PlacementError, match="GPUBUDGET_DEVICE_MEMORY is not set.*8GiB"):
        open_device(0, "node-gpu0", "actor A")
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "eight gigs")
    with pytest.raises(PlacementError, match="actor A: .*'eight gigs'"):
        open_device(0, "node-gpu0", "actor A")
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "6GiB")
    backend, total, is_simulated = open_device(0, "node-gpu0", "actor A")
    assert (total, is_simulated) == (6 * GiB, True)
    assert isinstance(backend, SimulatedGpu) and backend.key == "node-gpu0"
    assert backend.directory is None  # the process's ledger directory


def test_a_simulated_gpu_is_shared_by_every_process_that_names_it(tmp_path: Path) -> None:
    first = SimulatedGpu("gpu0", 8 * GiB, directory=tmp_path)
    second = SimulatedGpu("gpu0", 8 * GiB, directory=tmp_path)  # as another process would
    with gpu_budget("5GiB", name="pool", backend=first) as pool:
        assert second.mem_info() == (3 * GiB, 8 * GiB)
        other = gpu_budget("4GiB", name="other", backend=second)  # a root, as in another actor
        with pytest.raises(BudgetError, match=r"'other' cannot claim 4.00 GiB on simulated GPU "
                           r"gpu0: the device has 8.00 GiB, 5.00 GiB of it claimed, 3.00 GiB "
                           r"left; held by pid \d+ \(.*\) 'pool' 5.00 GiB"):
            contextvars.Context().run(other.__enter__)
        block = pool.allocate(4096)
        assert block is not None and pool.free(block)
    assert second.mem_info() == (8 * GiB, 8 * GiB)  # released with the budget
    with pytest.raises(ValueError, match="key must be a string of 1 to 64 bytes"):
        SimulatedGpu("x" * 65, GiB)


def test_reservations_of_exited_processes_stop_counting(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from gpubudget import gpu_budget; "
         "from gpubudget.ray import SimulatedGpu; "
         "gpu = SimulatedGpu('gpu0', 8 * 2**30, directory=sys.argv[1]); "
         "budget = gpu_budget('6GiB', backend=gpu).__enter__(); print('held', flush=True); "
         "time.sleep(600)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        gpu = SimulatedGpu("gpu0", 8 * GiB, directory=tmp_path)
        assert gpu.mem_info() == (2 * GiB, 8 * GiB)
    finally:
        holder.kill()  # SIGKILL: no exit handler runs
        holder.wait()
    assert gpu.mem_info() == (8 * GiB, 8 * GiB)


def test_budgeted_checks_its_arguments_and_quotes_them() -> None:
    with pytest.raises(ValueError, match="'lots'"):
        budgeted("lots")
    with pytest.raises(ValueError, match="'-1GiB'"):
        budgeted(margin="-1GiB")
    with pytest.raises(ValueError, match="power of two.*48"):
        budgeted(align=48)
    with pytest.raises(TypeError, match="name.*''"):
        budgeted(name="")
    with pytest.raises(TypeError, match="directory path, got 3"):
        budgeted(trace=3)  # type: ignore[call-overload]


def test_budgeted_refuses_what_is_not_a_plain_class() -> None:
    class ActorClassLike:  # what @ray.remote(...) returns: an object, not a class
        def remote(self) -> None: ...

    with pytest.raises(TypeError, match=r"decorates a class, got .*below @ray.remote"):
        budgeted()(ActorClassLike())  # type: ignore[type-var]

    @budgeted()
    class Once:
        pass

    with pytest.raises(TypeError, match="already budgeted"):
        budgeted()(Once)


class _Kinds:
    """Methods of every kind Ray can call, and some it cannot."""

    def plain(self) -> Budget | None:
        return current_budget()

    async def coroutine(self) -> Budget | None:
        await asyncio.sleep(0)
        return current_budget()

    def steps(self) -> Generator[object, object, None]:
        yield current_budget()
        received = yield current_budget()
        yield received

    async def async_steps(self) -> AsyncIterator[Budget | None]:
        yield current_budget()
        await asyncio.sleep(0)
        yield current_budget()

    def __call__(self) -> Budget | None:
        return current_budget()

    def __repr__(self) -> str:
        return f"<kinds {current_budget()!r}>"

    @staticmethod
    def static() -> Budget | None:
        return current_budget()

    @property
    def prop(self) -> Budget | None:
        return current_budget()


_Kinds.plain.__ray_num_returns__ = 1  # type: ignore[attr-defined]  # as @ray.method sets


def test_methods_keep_their_kind_name_signature_and_ray_options() -> None:
    decorated = budgeted()(_Kinds)
    assert decorated.__name__ == "_Kinds" and issubclass(decorated, _Kinds)
    assert issubclass(budgeted(_Kinds), _Kinds)  # @budgeted without parentheses works too
    assert inspect.iscoroutinefunction(decorated.coroutine)
    assert inspect.isgeneratorfunction(decorated.steps)
    assert inspect.isasyncgenfunction(decorated.async_steps)
    assert decorated.plain.__ray_num_returns__ == 1  # type: ignore[attr-defined]
    assert inspect.signature(decorated.plain) == inspect.signature(_Kinds.plain)
    wrapped = set(methods.actor_methods(_Kinds))
    assert wrapped == {"plain", "coroutine", "steps", "async_steps", "__call__"}
    assert decorated.__repr__ is _Kinds.__repr__ and decorated.static is _Kinds.static


def test_methods_run_with_the_instance_budget_current_and_steps_do_not_leak() -> None:
    decorated = budgeted()(_Kinds)
    kinds = object.__new__(decorated)  # its __init__ needs Ray: its budget is given by hand
    budget, context = _open_elsewhere("actor")  # open, current nowhere: as between two calls
    vars(kinds)[methods.SCOPE_ATTRIBUTE] = methods.ActorScope(budget, context)
    assert current_budget() is None
    assert kinds.plain() is budget and kinds() is budget
    assert asyncio.run(kinds.coroutine()) is budget
    steps = kinds.steps()
    assert next(steps) is budget
    assert current_budget() is None  # nothing stays current between items
    assert next(steps) is budget
    assert steps.send("sent") == "sent"
    steps.close()

    async def consume() -> list[Budget | None]:
        seen = []
        async for item in kinds.async_steps():
            seen.append(item)
            seen.append(current_budget())
        return seen

    assert asyncio.run(consume()) == [budget, None, budget, None]
    assert kinds.static() is None and kinds.prop is None and current_budget() is None


class _Ending:
    """A class with the hooks Ray (``__ray_shutdown__``) and Serve (``__del__``) call."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []

    def __ray_shutdown__(self) -> None:
        budget = current_budget()
        self.seen.append(budget.name if budget is not None else None)

    def __del__(self) -> None:
        budget = current_budget()
        self.seen.append(budget.name if budget is not None else None)


class _AsyncEnding:
    async def __del__(self) -> None:  # Ray Serve awaits an async __del__
        pass


def test_the_end_hooks_run_in_the_budget_and_then_exit_it() -> None:
    decorated = budgeted()(_Ending)
    ending = object.__new__(decorated)
    _Ending.__init__(ending)
    budget, context = _open_elsewhere("actor")
    vars(ending)[methods.SCOPE_ATTRIBUTE] = methods.ActorScope(budget, context)
    ending.__ray_shutdown__()
    assert ending.seen == ["actor"] and budget.state == "released"  # nothing held it
    ending.__del__()  # after the budget's end: runs without one
    assert ending.seen == ["actor", None]
    assert inspect.iscoroutinefunction(budgeted()(_AsyncEnding).__del__)
    plain = object.__new__(budgeted()(_Kinds))  # no hooks of its own, no scope: nothing to do
    plain.__ray_shutdown__()  # type: ignore[attr-defined]


def _open_elsewhere(name: str) -> tuple[Budget, contextvars.Context]:
    """An open budget entered in a context of its own: current nowhere else, as an actor's
    budget between two calls; and that context."""
    context = contextvars.Context()
    budget = gpu_budget("1MiB", name=name)
    context.run(budget.__enter__)
    return budget, context


def _info(actor_id: str, gpu: str, limit: int, **fields: Any) -> ActorInfo:
    values: dict[str, Any] = dict(
        actor_id=actor_id, class_name="Model", actor_name=None, application=None,
        deployment=None, replica=None, node_id="n" * 56, node_ip="10.0.0.5", gpu_id=gpu,
        ordinal=0, share=0.5, device_memory=8 * GiB, simulated=False, limit=limit, pid=1,
        trace=None)
    values.update(fields)
    return ActorInfo(**values)


def _budget_report(name: str, limit: int, used: int) -> FlatReport:
    with gpu_budget(limit, name=name) as budget:
        if used:
            assert budget.allocate(used) is not None
        return FlatReport.of(budget.report())


def test_cluster_report_groups_by_node_and_gpu_and_warns_of_overcommitted_gpus() -> None:
    entries = (
        ActorEntry(_info("a" * 32, "0", 5 * GiB), "alive", _budget_report("a", 5 * GiB, MiB),
                   fresh=True),
        ActorEntry(_info("b" * 32, "0", 5 * GiB, deployment="det", application="app",
                         replica="r1"), "alive", _budget_report("det", 5 * GiB, 2 * MiB),
                   fresh=False),
        ActorEntry(_info("c" * 32, "1", 7 * GiB), "dead", _budget_report("c", 7 * GiB, MiB),
                   fresh=False, death="killed by `ray.kill`."),
    )
    report = ClusterReport(entries, "gpubudget/gpubudget-registry", dead_dropped=2)
    gpu0, gpu1 = report.devices
    assert (gpu0.gpu_id, gpu0.limits, gpu0.used, gpu0.overcommitted) == ("0", 10 * GiB,
                                                                         3 * MiB, True)
    assert (gpu1.limits, gpu1.used, gpu1.overcommitted) == (0, 0, False)  # dead: not counted
    assert report.warnings == ("node 10.0.0.5 GPU 0: the limits of its budgets add up to "
                               "10.00 GiB, more than its 8.00 GiB",)
    text = str(report)
    assert text.splitlines()[:3] == [
        "gpubudget cluster report: 2 budgeted actors alive, 1 dead",
        "node 10.0.0.5 (nnnnnnnnnnnn)",
        "  GPU 0 (8.00 GiB): 2 actors alive, limits 10.00 GiB, used 3.00 MiB"]
    assert "    Serve app/det replica r1 (actor bbbbbbbbbbbb): alive, did not answer" in text
    assert "    Model (actor cccccccccccc): DEAD (killed by `ray.kill`.)" in text
    assert "      c [host] (open): used 1.00 MiB of 7.00 GiB" in text
    assert "(2 older dead actors forgotten)" in text and text.endswith("8.00 GiB")
    assert report.to_json() == json.dumps(report.as_dict(), indent=2)  # built another way
    assert report.to_json(indent=None) == json.dumps(report.as_dict())
    data = json.loads(report.to_json())
    assert data["registry"] == {"actor": "gpubudget/gpubudget-registry", "error": None,
                                "note": None, "recovering": False}
    (node,) = data["nodes"]
    assert [d["gpu_id"] for d in node["devices"]] == ["0", "1"]
    assert [a["actor_id"][0] for a in node["devices"][0]["actors"]] == ["a", "b"]
    assert node["devices"][1]["actors"][0]["state"] == "dead"
    assert node["devices"][0]["actors"][1]["report"]["used"] == 2 * MiB
    assert data["warnings"] == list(report.warnings)


def test_reports_of_deep_budget_trees_travel_and_render() -> None:
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(gpu_budget("1MiB", name="root", backend="host"))
        for level in range(1000):
            stack.enter_context(gpu_budget("1KiB", name=f"level-{level}"))
        report = root.report()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # the flat form pickles without recursing per level
    try:
        pickled = pickle.dumps(FlatReport.of(report))
    finally:
        sys.setrecursionlimit(limit)
    flat = pickle.loads(pickled)
    rebuilt = flat.tree()
    assert [(r.name, len(r.children)) for r in rebuilt.walk()] == [
        (r.name, len(r.children)) for r in report.walk()]
    cluster = pickle.loads(pickle.dumps(ClusterReport(
        (ActorEntry(_info("d" * 32, "0", MiB), "alive", flat, fresh=True),))))
    assert "└─ level-999 [host] (" in str(cluster)
    text = cluster.to_json()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # json.loads recurses per level; the writer did not
    try:
        data = json.loads(text)
    finally:
        sys.setrecursionlimit(limit)
    budget = data["nodes"][0]["devices"][0]["actors"][0]["report"]
    for _ in range(1000):
        (budget,) = budget["children"]
    assert budget["name"] == "level-999"
    assert json.loads(ClusterReport(()).to_json(indent=None))["alive"] == 0


def test_registry_book_keeps_a_bounded_number_of_dead_actors() -> None:
    book = RegistryBook(dead_kept=2)
    for key in "abcd":
        book.register(_info(key * 32, "0", GiB), handle=None, report=None)
    generation = book.next_generation()
    assert not book.answered(generation)
    for key in "abc":
        book.mark_dead(key * 32, "gone")
    assert book.dropped == 1 and set(book.records) == {"b" * 32, "c" * 32, "d" * 32}
    assert not book.answered(generation)  # d is alive and has not answered
    book.update("d" * 32, generation, _budget_report("d", GiB, 0))
    assert book.answered(generation)
    fresh = {entry.info.actor_id[0]: (entry.state, entry.fresh)
             for entry in book.entries(generation)}
    assert fresh == {"b": ("dead", False), "c": ("dead", False), "d": ("alive", True)}


class _Store:
    """A key-value store that outlives the registry, as Ray's does."""

    def __init__(self) -> None:
        self.data: bytes | None = None
        self.saves = 0

    def load(self) -> bytes | None:
        return self.data

    def save(self, data: bytes) -> None:
        self.data = data
        self.saves += 1


def test_a_restarted_registry_keeps_its_history_and_says_who_has_not_registered_again(
        ) -> None:
    store, now = _Store(), [100.0]

    def clock() -> float:
        return now[0]

    async def before_the_restart() -> tuple[tuple[ActorEntry, ...], int, str | None]:
        first = Registry(store, clock)
        for key in "abc":
            await first.register(_info(key * 32, "0", GiB), None,
                                 _budget_report(key, GiB, MiB if key == "a" else 0))
        first._book.mark_dead("c" * 32, "killed by `ray.kill`.")
        return await first.collect(0.01)

    entries, dropped, note = asyncio.run(before_the_restart())
    assert note is None and len(entries) == 3 and store.saves == 4

    async def after_it() -> list[tuple[tuple[ActorEntry, ...], int, str | None]]:
        restarted = Registry(store, clock)  # Ray started it again: an empty process
        now[0] += 3
        answers = [await restarted.collect(0.01)]
        await restarted.register(_info("a" * 32, "0", GiB), None,
                                 _budget_report("a", GiB, 2 * MiB))
        answers.append(await restarted.collect(0.01))
        now[0] += 60  # b never came back: it ended while the registry was down
        answers.append(await restarted.collect(0.01))
        return answers

    (entries, dropped, note), (_, _, second_note), (last, _, last_note) = asyncio.run(after_it())
    report = ClusterReport(entries, "gpubudget/gpubudget-registry", dead_dropped=dropped,
                           note=note)
    assert {(e.info.actor_id[0], e.state, e.fresh) for e in report.actors} == {
        ("a", "alive", False), ("b", "alive", False), ("c", "dead", False)}
    assert report.entry("a" * 32).used == MiB  # type: ignore[union-attr]  # its last report
    assert report.entry("c" * 32).death == "killed by `ray.kill`."  # type: ignore[union-attr]
    text = str(report)
    assert text.splitlines()[:2] == [
        "gpubudget cluster report: 2 budgeted actors alive, 1 dead",
        "note: the registry restarted 3 s ago; 2 actors it knew alive have not registered "
        "again yet (each does within a few seconds): shown with the last report it had"]
    assert json.loads(report.to_json())["registry"]["note"] == note
    assert second_note is not None and " 1 actor it knew alive has not" in second_note
    states = {e.info.actor_id[0]: (e.state, e.death) for e in last}
    assert last_note is None and states["a"] == ("alive", None) and states["b"][0] == "dead"
    assert "did not register again within 30 s" in str(states["b"][1])

    async def once_more() -> dict[str, bool]:
        again = Registry(store, clock)  # the history stays
        return {key[0]: record.dead is not None for key, record in again._book.records.items()}

    assert asyncio.run(once_more()) == {"a": False, "b": True, "c": True}


def test_a_registry_with_an_unreadable_book_starts_empty() -> None:
    store = _Store()
    store.data = b"not a pickle"

    async def collect() -> tuple[tuple[ActorEntry, ...], int, str | None]:
        return await Registry(store).collect(0.01)

    assert asyncio.run(collect()) == ((), 0, None)


class _Ref:
    """An object ref whose future holds ``value`` or raises it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def future(self) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if isinstance(value := self.value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
        return future


class _Method:
    def __init__(self, answer: Callable[..., Any]) -> None:
        self.answer = answer

    def remote(self, *args: Any) -> _Ref:
        try:
            return _Ref(self.answer(*args))
        except Exception as exc:  # noqa: BLE001 - the call's failure, carried by its ref
            return _Ref(exc)


def _unavailable() -> Exception:
    from ray.exceptions import ActorUnavailableError

    return ActorUnavailableError("The actor is temporarily unavailable: restarting", None)


def test_while_ray_restarts_the_registry_the_report_lists_what_it_saved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAVE_RAY:
        pytest.skip(NO_RAY)
    import ray
    from ray.exceptions import RayActorError

    from gpubudget.ray import registry as registry_module

    store = _Store()

    async def before_the_kill() -> None:
        first = Registry(store)
        for key in "ab":
            await first.register(_info(key * 32, "0", GiB), None, _budget_report(key, GiB, MiB))
        first._book.mark_dead("b" * 32, "killed by `ray.kill`.")
        first._save()

    asyncio.run(before_the_kill())
    failure: list[Exception] = [_unavailable()]

    def collect(timeout: float) -> Any:
        raise failure[0]

    registry = types.SimpleNamespace(collect=_Method(collect))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get", lambda ref, timeout: ref.future().result())
    monkeypatch.setattr(registry_module, "find_registry", lambda: registry)
    monkeypatch.setattr(registry_module.KeyValueStore, "load", lambda self: store.data)
    report = cluster_report()
    assert report.registry_error is None and report.recovering
    assert {(entry.info.actor_id[0], entry.state, entry.fresh) for entry in report.actors} == {
        ("a", "alive", False), ("b", "dead", False)}
    assert report.entry("a" * 32).used == MiB  # type: ignore[union-attr]
    text = str(report)
    assert text.splitlines()[:2] == [
        "gpubudget cluster report: 1 budgeted actor alive, 1 dead",
        "note: the registry is restarting (Ray answers ActorUnavailableError for now); the "
        "actors are shown with the last reports it saved, and register again as soon as it "
        "is up"]
    assert json.loads(report.to_json())["registry"]["recovering"] is True
    failure[0] = RayActorError()  # dead for good, or not a registry: nothing to say more
    report = cluster_report()
    assert report.actors == () and not report.recovering
    assert str(report.registry_error).startswith("the registry did not answer (RayActorError")
    failure[0] = _unavailable()
    store.data = None  # restarting, and nothing saved: the report says so, empty
    report = cluster_report()
    assert report.actors == () and str(report.registry_error).startswith(
        "the registry did not answer (ActorUnavailableError")


class _Stop(BaseException):
    """Ends a reporter's thread (its loop catches every ``Exception``)."""


def test_an_actor_asks_a_restarting_registry_again_every_half_second_not_every_10_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAVE_RAY:
        pytest.skip(NO_RAY)
    import ray

    from gpubudget.ray import reporter as reporter_module

    pauses: list[float | None] = []

    class Paused:
        """``threading.Event`` for the reporter's thread: a wait is recorded, not waited."""

        def wait(self, timeout: float | None = None) -> bool:
            pauses.append(timeout)
            return False

    done, registrations = threading.Event(), []
    attempts = {"register": 0}

    def killed(*args: Any) -> Any:
        raise _unavailable()  # the call in flight when the registry's process died

    def register(info: ActorInfo, handle: Any, report: FlatReport) -> int:
        attempts["register"] += 1
        if attempts["register"] <= 3:  # Ray is still starting its new process
            raise _unavailable()
        registrations.append(info.actor_id)
        return 7

    def next_request(actor_id: str, seen: int, wait: float) -> int:
        done.set()
        raise _Stop

    dying = types.SimpleNamespace(next_request=_Method(killed))
    restarted = types.SimpleNamespace(register=_Method(register),
                                      next_request=_Method(next_request))
    monkeypatch.setattr(reporter_module, "find_registry", lambda: restarted)
    monkeypatch.setattr(reporter_module, "threading",
                        types.SimpleNamespace(Event=Paused, Thread=threading.Thread))
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: types.SimpleNamespace(current_actor="me"))
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the _Stop that ends it
    with gpu_budget("1MiB", name="actor") as budget:
        reporter = reporter_module.Reporter(_info("a" * 32, "0", MiB), budget)
        reporter._registry = dying  # type: ignore[assignment]
        worker = threading.Thread(target=reporter._serve, daemon=True)
        worker.start()
        assert done.wait(ANSWER_WAIT), pauses
        worker.join(ANSWER_WAIT)
    assert not worker.is_alive() and registrations == ["a" * 32]
    assert reporter.registry_error is None and attempts["register"] == 4
    assert pauses == [reporter_module.FIRST_RETRY_SECONDS] * 4  # not RETRY_SECONDS (10 s)


def test_ray_command_without_ray_says_so_and_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert ray_command(None, False) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("gpubudget ray: Ray is not installed; pip install "
                                 "'gpubudget[ray]'\n")


def test_ray_command_without_a_cluster_exits_2_at_once() -> None:
    if not HAVE_RAY:
        pytest.skip(NO_RAY)
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from gpubudget.ray import ray_command; "
         "sys.exit(ray_command('127.0.0.1:1', False))"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "gpubudget ray: no Ray cluster at '127.0.0.1:1': nothing answers at 127.0.0.1:1 "
        "([Errno 111] Connection refused)"]


# -- on a local Ray cluster with two logical GPUs ----------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """The module's cluster (tests import ``ray`` themselves: it may be missing)."""
    if not HAVE_RAY:
        pytest.skip(NO_RAY)
    import ray

    # a cluster of its own: without address="local", Ray joins the one another program
    # started last on this machine (and refuses num_cpus and num_gpus for it)
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": {
                 "GPUBUDGET_DEVICE_MEMORY": DEVICE_MEMORY, "GPUBUDGET_BACKEND": "host"}})
    yield
    ray.shutdown()


def model_class(num_gpus: float, limit: str | None = None) -> ActorClass:
    """A budgeted actor class that allocates its weights in ``__init__``."""
    import ray

    @budgeted(limit)
    class Model:
        def __init__(self, weights: int = 0) -> None:
            budget = current_budget()
            assert budget is not None
            self.weights = budget.allocate(weights, tag="weights") if weights else None

        def describe(self) -> dict[str, Any]:
            budget = current_budget()
            assert budget is not None
            return {"actor_id": ray.get_runtime_context().get_actor_id(),
                    "gpu_id": str(ray.get_gpu_ids()[0]), "name": budget.name,
                    "limit": budget.limit, "used": budget.used}

        def allocate(self, size: int) -> int | None:
            budget = current_budget()
            assert budget is not None
            return budget.allocate(size)

        def free(self, address: int) -> bool:
            budget = current_budget()
            assert budget is not None
            return budget.free(address)

        def names(self, count: int) -> Iterator[str | None]:
            for _ in range(count):
                budget = current_budget()
                yield budget.name if budget is not None else None

        def in_a_thread_of_its_own(self) -> tuple[bool, bool]:
            seen: list[Budget | None] = []
            actor = ray_actor.actor_budget()
            assert actor is not None

            def work() -> None:
                seen.append(current_budget())
                with use(actor):
                    seen.append(current_budget())

            thread = threading.Thread(target=work)
            thread.start()
            thread.join()
            return seen[0] is None, seen[1] is current_budget()

        def registry_error(self) -> str | None:
            reporter = ray_actor.actor_reporter()
            return reporter.registry_error if reporter is not None else "no reporter"

        def crash(self) -> None:
            os._exit(3)

        def pid(self) -> int:
            return os.getpid()

    return ray.remote(num_cpus=0, num_gpus=num_gpus)(Model)


@pytest.fixture(scope="module")
def trio(ray_cluster: None) -> Iterator[list[tuple[ActorHandle, dict[str, Any]]]]:
    """Three actors of half a GPU (1 GiB, 512 MiB and no weights): two share a GPU, the
    third is alone on the other, which keeps half a GPU free."""
    import ray

    model = model_class(num_gpus=0.5)
    actors = [model.remote(GiB), model.remote(GiB // 2), model.remote()]
    described = ray.get([actor.describe.remote() for actor in actors])
    yield list(zip(actors, described))
    for actor in actors:
        ray.kill(actor)


def report_now() -> ClusterReport:
    """The cluster report, waiting for every live actor's answer (on a loaded machine they
    may take longer than the default two seconds)."""
    return cluster_report(timeout=ANSWER_WAIT)


def pair_and_single(trio: list[tuple[ActorHandle, dict[str, Any]]]
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    by_gpu: dict[str, list[dict[str, Any]]] = {}
    for _, described in trio:
        by_gpu.setdefault(described["gpu_id"], []).append(described)
    pair, single = sorted(by_gpu.values(), key=len, reverse=True)
    assert (len(pair), len(single)) == (2, 1), by_gpu
    return pair, single[0]


def test_half_gpu_actors_each_get_half_its_memory_and_are_capped(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]]) -> None:
    import ray

    pair, single = pair_and_single(trio)  # 3 x 0.5 on 2 GPUs: two share one, whatever Ray picks
    assert [d["limit"] for d in (*pair, single)] == [HALF_GPU_LIMIT] * 3
    assert sorted(d["used"] for d in (*pair, single)) == [0, GiB // 2, GiB]
    first, _ = trio[0]
    assert ray.get(first.allocate.remote(HALF_GPU_LIMIT - GiB + 1)) is None  # over its cap
    block = ray.get(first.allocate.remote(HALF_GPU_LIMIT - GiB))  # exactly up to it
    assert block is not None and ray.get(first.free.remote(block))
    second, _ = trio[1]
    assert ray.get(second.allocate.remote(2 * GiB + GiB // 2 + 1)) is None


def test_methods_of_every_kind_run_with_the_actor_budget(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]]) -> None:
    import ray

    actor, described = trio[0]
    assert described["name"] == "Model"
    assert [ray.get(ref) for ref in actor.names.remote(3)] == ["Model"] * 3
    assert ray.get(actor.in_a_thread_of_its_own.remote()) == (True, True)


def test_cluster_report_lists_every_actor_on_its_gpu_with_its_use(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]]) -> None:
    pair, single = pair_and_single(trio)
    report = report_now()
    assert report.registry_error is None
    for _, described in trio:
        entry = report.entry(described["actor_id"])
        assert entry is not None and entry.state == "alive" and entry.fresh
        assert entry.report is not None and entry.report.used == described["used"]
        assert (entry.info.gpu_id, entry.info.limit, entry.info.share, entry.info.simulated) == (
            described["gpu_id"], HALF_GPU_LIMIT, 0.5, True)
        assert entry.info.class_name == "Model" and entry.info.deployment is None
    devices = {device.gpu_id: device for device in report.devices
               if {entry.info.actor_id for entry in device.alive}
               & {d["actor_id"] for d in (*pair, single)}}
    shared = devices[pair[0]["gpu_id"]]
    pair_used = sum(described["used"] for described in pair)
    assert (shared.memory, shared.limits, shared.used) == (8 * GiB, 2 * HALF_GPU_LIMIT,
                                                           pair_used)
    assert not shared.overcommitted
    text = str(report)
    for described in (*pair, single):
        assert f"Model (actor {described['actor_id'][:12]}): alive; num_gpus 0.5" in text
    assert f"  GPU {shared.gpu_id} (simulated, 8.00 GiB): 2 actors alive, limits 6.00 GiB, " \
           f"used {format_size(pair_used)}" in text


def test_ray_command_prints_text_and_json(ray_cluster: None,
                                          trio: list[tuple[ActorHandle, dict[str, Any]]],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert ray_command(None, False) == 0
    text = capsys.readouterr().out
    assert text.startswith("gpubudget cluster report: ")
    assert all(described["actor_id"][:12] in text for _, described in trio)
    assert ray_command(None, True) == 0
    data = json.loads(capsys.readouterr().out)
    listed = {actor["actor_id"] for node in data["nodes"] for device in node["devices"]
              for actor in device["actors"]}
    assert {described["actor_id"] for _, described in trio} <= listed


def test_another_driver_finds_the_registry_and_the_actors(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]]) -> None:
    import ray

    address = ray.get_runtime_context().gcs_address
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from gpubudget.ray import ray_command; "
         "sys.exit(ray_command(sys.argv[1], True))", address],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    alive = {actor["actor_id"] for node in data["nodes"] for device in node["devices"]
             for actor in device["actors"] if actor["state"] == "alive"}
    assert {described["actor_id"] for _, described in trio} <= alive


def creation_error(actor: ActorHandle) -> str:
    """The message Ray gives for an actor whose creation failed."""
    import ray

    with pytest.raises(ray.exceptions.RayActorError) as failure:
        ray.get(actor.describe.remote(), timeout=120)
    return str(failure.value)


def test_a_limit_larger_than_the_free_memory_fails_creation_with_our_message(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]]) -> None:
    # the only half GPU left is beside the single trio actor, which holds 3 GiB of 8
    import ray

    big = model_class(num_gpus=0.5, limit="6GiB").remote()
    message = creation_error(big)
    assert "BudgetError: Ray actor Model" in message
    assert "(num_gpus=0.5): budget 'Model' cannot claim 6.00 GiB on simulated GPU " in message
    assert "the device has 8.00 GiB, 3.00 GiB of it claimed, 5.00 GiB left; held by pid " \
        in message
    _, single = pair_and_single(trio)
    holder = ray.get([actor.pid.remote() for actor, described in trio
                      if described["actor_id"] == single["actor_id"]])[0]
    assert f"held by pid {holder} (ray::Model" in message and "'Model' 3.00 GiB" in message


def test_an_actor_without_a_gpu_fails_creation_saying_what_is_supported(
        ray_cluster: None) -> None:
    cpu_only = model_class(num_gpus=0).remote()
    message = creation_error(cpu_only)
    assert "PlacementError: Ray actor Model" in message
    assert "was given no GPU (num_gpus=0): a budget lives on one GPU; create the actor with " \
           "0 < num_gpus <= 1" in message


def wait_for_death(actor_id: str) -> ActorEntry:
    deadline = time.monotonic() + DEATH_WAIT
    while True:
        entry = report_now().entry(actor_id)
        assert entry is not None
        if entry.state == "dead" or time.monotonic() > deadline:
            return entry
        time.sleep(0.2)


def test_killed_and_crashed_actors_turn_dead_and_keep_their_last_report(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]]) -> None:
    import ray

    model = model_class(num_gpus=0.5)
    killed = model.remote(GiB)
    killed_id = ray.get(killed.describe.remote())["actor_id"]
    ray.kill(killed)
    entry = wait_for_death(killed_id)
    assert entry.state == "dead" and entry.death is not None and "ray.kill" in entry.death
    assert entry.report is not None and entry.report.used == GiB
    crashed = model.remote(GiB // 4)
    crashed_id = ray.get(crashed.describe.remote())["actor_id"]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(crashed.crash.remote())
    entry = wait_for_death(crashed_id)
    assert entry.state == "dead" and entry.report is not None
    assert entry.report.used == GiB // 4
    report = report_now()
    assert f"Model (actor {crashed_id[:12]}): DEAD (" in str(report)
    assert report.entry(trio[0][1]["actor_id"]) is not None  # the others stay alive


def test_an_actor_dropped_by_its_owner_is_not_kept_alive_by_the_registry(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]]) -> None:
    import ray

    dropped = model_class(num_gpus=0.5).remote()
    dropped_id = ray.get(dropped.describe.remote())["actor_id"]
    del dropped  # its only strong handle; the registry holds a weak one
    assert wait_for_death(dropped_id).state == "dead"



def async_model_class(trace: Path) -> ActorClass:
    """A budgeted asyncio actor class with a 1 GiB budget that writes a trace."""
    import ray

    @budgeted("1GiB", name="async-model", trace=trace)
    class AsyncModel:
        async def allocate(self, size: int) -> int | None:
            await asyncio.sleep(0)
            budget = current_budget()
            assert budget is not None
            return budget.allocate(size, tag="request")

        async def names(self, count: int) -> AsyncIterator[str | None]:
            for _ in range(count):
                await asyncio.sleep(0)
                budget = current_budget()
                yield budget.name if budget is not None else None

        def actor_id(self) -> str | None:
            return ray.get_runtime_context().get_actor_id()

    return ray.remote(num_cpus=0, num_gpus=0.5)(AsyncModel)


def test_async_actors_run_coroutines_and_async_generators_in_the_budget_and_trace_it(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]],
        tmp_path: Path) -> None:
    import ray

    actor = async_model_class(tmp_path / "traces").remote()
    actor_id = ray.get(actor.actor_id.remote())
    assert ray.get(actor.allocate.remote(GiB // 2)) is not None
    assert ray.get(actor.allocate.remote(GiB // 2 + 1)) is None  # over its 1 GiB
    assert [ray.get(ref) for ref in actor.names.remote(2)] == ["async-model"] * 2
    entry = report_now().entry(actor_id)
    assert entry is not None and entry.report is not None
    assert (entry.info.limit, entry.report.used, entry.report.denied) == (GiB, GiB // 2, 1)
    actor.__ray_terminate__.remote()  # a clean exit writes out the whole trace
    assert wait_for_death(actor_id).state == "dead"
    trace = tmp_path / "traces" / f"AsyncModel.{actor_id[:12]}.jsonl"
    assert entry.info.trace == str(trace)
    calls_shutdown_hook = _version(ray.__version__) >= (2, 50)  # Ray calls __ray_shutdown__
    events = finished_trace(trace) if calls_shutdown_hook else trace_events(trace)
    assert [(e["ev"], e.get("name"), e.get("limit")) for e in events[:1]] == [
        ("enter", "async-model", GiB)]
    assert [(e["bytes"], e["reason"]) for e in events if e["ev"] == "alloc"] == [
        (GiB // 2, None), (GiB // 2 + 256, "over_limit")]
    if calls_shutdown_hook:
        assert events[-1]["ev"] == "exit"  # the budget was exited as the actor ended


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def finished_trace(path: Path) -> list[dict[str, Any]]:
    """The events of an actor's trace (its JSON lines after the header) once the last one,
    ``exit``, is there (Ray may say the actor is dead a moment before its process has run
    its shutdown hook)."""
    deadline = time.monotonic() + DEATH_WAIT
    while True:
        try:
            events = trace_events(path)
        except json.JSONDecodeError:  # a line being written: look again
            events = []
        if (events and events[-1]["ev"] == "exit") or time.monotonic() > deadline:
            return events
        time.sleep(0.1)


def trace_events(path: Path) -> list[dict[str, Any]]:
    """The events of a trace file: its JSON lines after the header."""
    header, *lines = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(header)["format"] == "gpubudget-trace"
    return [json.loads(line) for line in lines]


def test_serve_replicas_are_budgeted_and_named_by_their_deployment(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]],
        tmp_path: Path) -> None:
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: "
                                            "pip install -e '.[dev,ray-serve]'")
    from ray import serve

    @budgeted(trace=tmp_path)
    class Detector:
        def __init__(self) -> None:
            budget = current_budget()
            assert budget is not None
            self.weights = budget.allocate(GiB, tag="weights")

        def __call__(self, size: int) -> tuple[str, int, bool]:
            budget = current_budget()
            assert budget is not None
            return budget.name, budget.limit, budget.allocate(size) is not None

    deployment = serve.deployment(ray_actor_options={"num_gpus": 0.5, "num_cpus": 0})(Detector)
    serve.start(proxy_location="Disabled")  # no HTTP here
    try:
        handle = serve.run(deployment.bind(), name="vision", route_prefix=None)
        assert handle.remote(MiB).result() == ("Detector", HALF_GPU_LIMIT, True)
        assert handle.remote(HALF_GPU_LIMIT).result() == ("Detector", HALF_GPU_LIMIT, False)
        report = report_now()
        (entry,) = [entry for entry in report.alive if entry.info.deployment == "Detector"]
        assert entry.info.application == "vision" and entry.info.replica
        assert entry.report is not None and entry.report.used == GiB + MiB
        assert f"Serve vision/Detector replica {entry.info.replica} (actor " in str(report)
        assert entry.info.trace == str(tmp_path / f"vision.Detector.{entry.info.replica}.jsonl")
    finally:
        serve.shutdown()
    assert wait_for_death(entry.info.actor_id).state == "dead"
    events = finished_trace(Path(entry.info.trace))
    assert [(e["ev"], e.get("tag")) for e in events] == [
        ("enter", None), ("alloc", "weights"), ("alloc", None), ("alloc", None), ("exit", None)]


def test_a_restarted_registry_lists_the_actors_it_knew_throughout_and_they_come_back(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]]) -> None:
    import ray

    ids = {described["actor_id"] for _, described in trio}
    before = report_now()
    assert ids <= {entry.info.actor_id for entry in before.alive}
    ray.kill(ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE), no_restart=False)
    deadline = time.monotonic() + DEATH_WAIT
    reports = []
    while True:  # while Ray restarts it, and until every actor registered again
        report = report_now()
        reports.append(report)
        assert report.registry_error is None, str(report)  # never "0 actors"
        assert ids <= {entry.info.actor_id for entry in report.alive}, str(report)
        assert len(report.dead) >= len(before.dead)  # the history is kept
        if ids <= {entry.info.actor_id for entry in report.alive if entry.fresh} \
                and report.note is None:
            break
        assert report.recovering and report.note is not None, str(report)
        assert time.monotonic() < deadline, str(report)
        time.sleep(0.2)
    assert not reports[-1].recovering
    assert all("restart" in str(report.note) for report in reports[:-1])


class Squatter:
    """An actor that takes the registry's name without being one."""

    def ping(self) -> str:
        return "pong"


def test_actors_keep_their_budgets_when_the_registry_is_gone_or_does_not_answer(
        ray_cluster: None, trio: list[tuple[ActorHandle, dict[str, Any]]]) -> None:
    import ray  # this test runs last: it takes the registry away

    ray.kill(ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE))
    report = report_now()  # "did not answer" while Ray still has its name, then "no actor"
    assert report.actors == () and report.registry_error is not None
    report = wait_for(report_now, lambda r: "no actor" in (r.registry_error or ""))
    assert report.actors == () and report.registry_error is not None
    assert report.registry_error.startswith(
        "no actor 'gpubudget-registry' in namespace 'gpubudget': no budgeted actor has "
        "started in this cluster, or the registry was killed")
    assert "registry missing: no actor 'gpubudget-registry'" in str(report)
    actor, described = trio[0]
    assert ray.get(actor.describe.remote()) == described  # its budget is intact
    assert ray.get(actor.allocate.remote(HALF_GPU_LIMIT)) is None  # and still caps it

    squatter = ray.remote(num_cpus=0)(Squatter).options(
        name=REGISTRY_NAME, namespace=REGISTRY_NAMESPACE).remote()
    assert ray.get(squatter.ping.remote()) == "pong"
    try:
        newcomer = model_class(num_gpus=0.5).remote(MiB)
        assert ray.get(newcomer.describe.remote())["used"] == MiB  # created and working
        assert ray.get(newcomer.registry_error.remote()) is not None
        report = report_now()
        assert report.actors == () and report.registry_error is not None
        assert report.registry_error.startswith("the registry did not answer")
        ray.kill(newcomer)
    finally:
        ray.kill(squatter)


def wait_for(make: Callable[[], ClusterReport], done: Callable[[ClusterReport], bool]
             ) -> ClusterReport:
    deadline = time.monotonic() + DEATH_WAIT
    while True:
        report = make()
        if done(report) or time.monotonic() > deadline:
            return report
        time.sleep(0.2)
