"""The registry: one detached, named actor that knows every budgeted actor of the cluster.

It lives in namespace ``gpubudget`` under the name ``gpubudget-registry``, is created by the
first budgeted actor that starts (``get_if_exists``), uses no CPU, and outlives the drivers
that created it (``lifetime="detached"``; Ray restarts it if its process dies, empty, and the
actors register again).

How a report is gathered (:func:`cluster_report`): the registry opens a new *generation*;
each budgeted actor has a thread waiting in :meth:`Registry.next_request`, which returns, and
the thread sends its budget's report (so a busy actor answers too, and so does a Serve
replica, whose methods Ray Serve owns). The wait is short (``POLL_SECONDS``) and renewed: Ray
lets an actor exit gracefully only once the calls it made have returned. Meanwhile the
registry probes every actor it believes alive with Ray's own ``__ray_ready__``: an actor that
Ray says is dead is marked dead, with Ray's reason, and keeps its last report. The registry
holds only weak handles (an actor's handle to itself), so it never keeps an actor alive.
Reports travel flat (:class:`~gpubudget.ray.report.FlatReport`), so trees of any depth do.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from .report import ActorEntry, ActorInfo, ClusterReport, FlatReport

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = [
    "DEAD_KEPT",
    "REGISTRY_NAME",
    "REGISTRY_NAMESPACE",
    "Registry",
    "RegistryBook",
    "cluster_report",
    "find_registry",
    "start_registry",
]

REGISTRY_NAME: Final = "gpubudget-registry"
REGISTRY_NAMESPACE: Final = "gpubudget"
DEAD_KEPT: Final = 100
"""Dead actors the registry remembers; older ones are forgotten (and counted)."""
ANSWER_SECONDS: Final = 30.0
"""How long :func:`cluster_report` waits for the registry beyond its own ``timeout``."""
CONCURRENT_CALLS: Final = 10_000
"""Calls the registry serves at once: every budgeted actor keeps one waiting."""
PROBE_SECONDS: Final = 1.0
"""How long a liveness probe waits: an actor busy longer than that counts as alive."""


@dataclass
class _Record:
    info: ActorInfo
    handle: Any
    report: FlatReport | None
    answered: int = 0
    """The last generation this actor sent a report for."""
    dead: str | None = None


@dataclass
class RegistryBook:
    """The registry's bookkeeping, without Ray (so that it can be tested alone).

    >>> book = RegistryBook(dead_kept=1)
    >>> generation = book.next_generation()
    >>> book.answered(generation)       # nobody registered: nobody to wait for
    True
    """

    dead_kept: int = DEAD_KEPT
    generation: int = field(default_factory=time.time_ns)
    """Starts from the clock, so that a restarted registry never reuses a generation."""
    records: dict[str, _Record] = field(default_factory=dict)
    dead_order: deque[str] = field(default_factory=deque)
    dropped: int = 0

    def register(self, info: ActorInfo, handle: Any, report: FlatReport | None) -> int:
        """Add (or renew) an actor; return the current generation."""
        self.records[info.actor_id] = _Record(info, handle, report, self.generation)
        return self.generation

    def update(self, actor_id: str, generation: int, report: FlatReport) -> None:
        record = self.records.get(actor_id)
        if record is not None:
            record.report = report
            record.answered = max(record.answered, generation)

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation

    def alive(self) -> list[tuple[str, Any]]:
        """``(actor_id, handle)`` of every actor not known to be dead."""
        return [(key, record.handle) for key, record in self.records.items()
                if record.dead is None]

    def answered(self, generation: int) -> bool:
        """Whether every actor not known to be dead has reported for ``generation``."""
        return all(record.answered >= generation or record.dead is not None
                   for record in self.records.values())

    def mark_dead(self, actor_id: str, cause: str) -> None:
        record = self.records.get(actor_id)
        if record is None or record.dead is not None:
            return
        record.dead = cause
        self.dead_order.append(actor_id)
        while len(self.dead_order) > self.dead_kept:
            self.records.pop(self.dead_order.popleft(), None)
            self.dropped += 1

    def entries(self, generation: int) -> tuple[ActorEntry, ...]:
        return tuple(
            ActorEntry(record.info, "alive" if record.dead is None else "dead", record.report,
                       fresh=record.dead is None and record.answered >= generation,
                       death=record.dead)
            for record in self.records.values())


class Registry:
    """The registry actor's methods (made a Ray actor by :func:`start_registry`)."""

    def __init__(self) -> None:
        self._book = RegistryBook()
        self._changed = asyncio.Condition()

    async def register(self, info: ActorInfo, handle: Any, report: FlatReport | None) -> int:
        """Add an actor (its handle to itself, which is weak); return the generation."""
        async with self._changed:
            generation = self._book.register(info, handle, report)
            self._changed.notify_all()
            return generation

    async def next_request(self, actor_id: str, seen: int, wait_seconds: float) -> int:
        """Wait until a report newer than generation ``seen`` is asked for, or for
        ``wait_seconds``; return the generation (``seen`` if nothing was asked)."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._book.generation > seen), wait_seconds)
            except asyncio.TimeoutError:
                pass
            return self._book.generation

    async def update(self, actor_id: str, generation: int, report: FlatReport) -> None:
        async with self._changed:
            self._book.update(actor_id, generation, report)
            self._changed.notify_all()

    async def collect(self, wait_seconds: float) -> tuple[tuple[ActorEntry, ...], int]:
        """Ask every actor for a report, find the dead, wait up to ``wait_seconds`` for the
        answers; return the entries and how many dead actors were forgotten."""
        async with self._changed:
            generation = self._book.next_generation()
            self._changed.notify_all()
            alive = self._book.alive()
        await asyncio.gather(*(self._probe(actor_id, handle) for actor_id, handle in alive))
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._book.answered(generation)),
                    wait_seconds)
            except asyncio.TimeoutError:
                pass  # the late ones keep their last report, marked not fresh
            return self._book.entries(generation), self._book.dropped

    async def _probe(self, actor_id: str, handle: Any) -> None:
        from ray.exceptions import ActorUnavailableError, RayActorError

        try:
            ready = handle.__ray_ready__.remote()
            await asyncio.wait_for(asyncio.wrap_future(ready.future()), PROBE_SECONDS)
        except asyncio.TimeoutError:
            return  # busy with a long call: alive
        except ActorUnavailableError:
            return  # unreachable for now (a node in trouble); not known to be dead
        except RayActorError as exc:
            async with self._changed:
                self._book.mark_dead(actor_id, death_cause(exc))
                self._changed.notify_all()


def death_cause(exc: BaseException) -> str:
    """The line of Ray's actor-death message that says why (its last line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


@functools.cache
def _registry_class() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=CONCURRENT_CALLS)(Registry)


def start_registry() -> ActorHandle:
    """The registry's handle, creating the registry if it does not exist."""
    handle: ActorHandle = _registry_class().options(
        name=REGISTRY_NAME, namespace=REGISTRY_NAMESPACE, lifetime="detached",
        get_if_exists=True).remote()
    return handle


def find_registry() -> ActorHandle | None:
    """The registry's handle if it exists (never creates it)."""
    import ray

    try:
        return ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE)
    except ValueError:
        return None


def cluster_report(*, timeout: float = 2.0) -> ClusterReport:
    """Every budgeted actor of the connected Ray cluster, with its budget's report now.

    Needs ``ray.init()`` (or runs inside a Ray worker). Actors that do not answer within
    ``timeout`` seconds keep their last report (marked not fresh); dead actors keep theirs,
    marked dead. Where the registry is missing or unreachable, the report is empty and says so
    (``registry_error``); the actors keep their budgets either way.

    Examples
    --------
    >>> import ray                                                    # doctest: +SKIP
    >>> from gpubudget.ray import cluster_report
    >>> ray.init(address="auto")                                      # doctest: +SKIP
    >>> print(cluster_report())                                       # doctest: +SKIP
    gpubudget cluster report: 3 budgeted actors alive, 0 dead
    node 10.0.0.5 (562ce4a41ee2)
      GPU 0 (80.00 GiB): 2 actors alive, limits 78.00 GiB, used 31.20 GiB
    ...
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError("cluster_report() needs a connection to the cluster: call "
                           "ray.init(address=...) first")
    where = f"{REGISTRY_NAMESPACE}/{REGISTRY_NAME}"
    registry = find_registry()
    if registry is None:
        return ClusterReport((), where, registry_error=(
            f"no actor {REGISTRY_NAME!r} in namespace {REGISTRY_NAMESPACE!r}: no budgeted "
            f"actor has started in this cluster, or the registry was killed (budgeted actors "
            f"keep their budgets; they register again once a new budgeted actor recreates "
            f"it)"))
    try:
        answer: tuple[tuple[ActorEntry, ...], int] = ray.get(
            registry.collect.remote(timeout), timeout=timeout + ANSWER_SECONDS)
    except Exception as exc:  # noqa: BLE001 - dead, restarting, not a registry at all
        return ClusterReport((), where, registry_error=(
            f"the registry did not answer ({type(exc).__name__}: {death_cause(exc)})"))
    entries, dropped = answer
    return ClusterReport(tuple(entries), where, dead_dropped=dropped)
