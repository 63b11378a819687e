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

What it knows survives a restart: the registry saves its book (every actor's description,
last report and death, without handles) in Ray's key-value store (the cluster's GCS) when an
actor registers or dies and after each report, and a registry started again reads it back.
The actors it knew alive are listed with their last reports, not fresh, and the report says
that they have not registered again yet (they do within a second or two of the restart:
each asks every :data:`~gpubudget.ray.reporter.FIRST_RETRY_SECONDS` while Ray restarts it);
one that has not within :data:`REREGISTER_SECONDS` is marked dead. Dead actors keep their
history across restarts. While Ray is still starting the registry again (its calls fail with
``ActorUnavailableError``), :func:`cluster_report` reads the saved book itself and says that
the registry is recovering, rather than report no actor at all.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import pickle
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from .report import ActorEntry, ActorInfo, ClusterReport, FlatReport

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = [
    "DEAD_KEPT",
    "REGISTRY_NAME",
    "REREGISTER_SECONDS",
    "REGISTRY_NAMESPACE",
    "Registry",
    "RegistryBook",
    "cluster_report",
    "find_registry",
    "restarting",
    "saved_report",
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
REREGISTER_SECONDS: Final = 30.0
"""How long after a restart the registry waits for the actors it knew alive to register
again (each asks for it every half second while it restarts) before it marks one that has
not dead."""
STORE_KEY: Final = b"gpubudget-registry-book"
"""The key of the registry's saved book in Ray's key-value store (namespace
:data:`REGISTRY_NAMESPACE`)."""
_log: Final = logging.getLogger("gpubudget.ray")


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
    restored_at: float | None = None
    """When (``time.monotonic()``) a saved book was read back: the registry restarted."""
    missing: set[str] = field(default_factory=set)
    """Actors alive before the restart that have not registered again."""

    def register(self, info: ActorInfo, handle: Any, report: FlatReport | None) -> int:
        """Add (or renew) an actor; return the current generation."""
        self.records[info.actor_id] = _Record(info, handle, report, self.generation)
        self.missing.discard(info.actor_id)
        return self.generation

    def saved(self) -> bytes:
        """The book without handles (which do not outlive the registry), for a registry
        started again to read back with :meth:`restore`."""
        records = [(key, record.info, record.report, record.dead)
                   for key, record in self.records.items()]
        return pickle.dumps((records, list(self.dead_order), self.dropped))

    def restore(self, data: bytes, now: float) -> None:
        """Read back a book :meth:`saved`; the actors alive in it are ``missing`` until they
        register again."""
        records, dead_order, dropped = pickle.loads(data)  # noqa: S301 - the registry's own
        for key, info, report, dead in records:
            if key not in self.records:
                self.records[key] = _Record(info, None, report, 0, dead)
                if dead is None:
                    self.missing.add(key)
        self.dead_order.extend(key for key in dead_order if key not in self.dead_order)
        self.dropped += dropped
        self.restored_at = now

    def note(self, now: float) -> str | None:
        """What a report should say about a restart: who has not registered again yet.
        Actors still missing :data:`REREGISTER_SECONDS` after it are marked dead."""
        if self.restored_at is None or not self.missing:
            return None
        age = now - self.restored_at
        if age >= REREGISTER_SECONDS:
            for key in sorted(self.missing):
                self.mark_dead(key, f"did not register again within {REREGISTER_SECONDS:g} s "
                                    f"of the registry's restart (it ended meanwhile?)")
            self.missing.clear()
            return None
        count = len(self.missing)
        return (f"the registry restarted {age:.0f} s ago; {count} "
                f"{'actor' if count == 1 else 'actors'} it knew alive "
                f"{'has' if count == 1 else 'have'} not registered again yet (each does "
                f"within a few seconds): shown with the last report it had")

    def update(self, actor_id: str, generation: int, report: FlatReport) -> None:
        record = self.records.get(actor_id)
        if record is not None:
            record.report = report
            record.answered = max(record.answered, generation)

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation

    def alive(self) -> list[tuple[str, Any]]:
        """``(actor_id, handle)`` of every actor not known to be dead (and registered since
        the registry started: a handle to probe)."""
        return [(key, record.handle) for key, record in self.records.items()
                if record.dead is None and record.handle is not None]

    def answered(self, generation: int) -> bool:
        """Whether every actor not known to be dead (and registered since the registry
        started) has reported for ``generation``."""
        return all(record.answered >= generation or record.dead is not None
                   or key in self.missing for key, record in self.records.items())

    def mark_dead(self, actor_id: str, cause: str) -> None:
        record = self.records.get(actor_id)
        if record is None or record.dead is not None:
            return
        record.dead = cause
        self.missing.discard(actor_id)
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


class KeyValueStore:
    """Where the registry saves its book: Ray's key-value store (the GCS), which outlives
    the registry's process. Never raises: a book that cannot be saved or read is a book
    that starts empty (and one warning in the registry's log)."""

    def __init__(self) -> None:
        self._warned = False

    def load(self) -> bytes | None:
        from ray.experimental import internal_kv

        try:
            data: bytes | None = internal_kv._internal_kv_get(STORE_KEY,
                                                               namespace=REGISTRY_NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - never fail the registry over its history
            self._failed("read", exc)
            return None
        return data

    def save(self, data: bytes) -> None:
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_put(STORE_KEY, data, overwrite=True,
                                         namespace=REGISTRY_NAMESPACE)
        except Exception as exc:  # noqa: BLE001
            self._failed("save", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            _log.warning("gpubudget: the registry cannot %s its book in Ray's key-value "
                         "store (%s: %s); a restarted registry starts empty", what,
                         type(exc).__name__, exc)


class Registry:
    """The registry actor's methods (made a Ray actor by :func:`start_registry`).

    ``store`` keeps the book across restarts (a :class:`KeyValueStore` by default: anything
    with ``load() -> bytes | None`` and ``save(bytes)``); ``clock`` is ``time.monotonic``.
    """

    def __init__(self, store: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._book = RegistryBook()
        self._changed = asyncio.Condition()
        self._store = store if store is not None else KeyValueStore()
        self._clock = clock
        saved = self._store.load()
        if saved:
            try:
                self._book.restore(saved, clock())
            except Exception as exc:  # noqa: BLE001 - an unreadable book: start empty
                _log.warning("gpubudget: the registry's saved book cannot be read (%s: %s); "
                             "it starts empty", type(exc).__name__, exc)

    def _save(self) -> None:
        """The book's lock held: save it for a registry started again."""
        self._store.save(self._book.saved())

    async def register(self, info: ActorInfo, handle: Any, report: FlatReport | None) -> int:
        """Add an actor (its handle to itself, which is weak); return the generation."""
        async with self._changed:
            generation = self._book.register(info, handle, report)
            self._save()
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

    async def collect(self, wait_seconds: float
                      ) -> tuple[tuple[ActorEntry, ...], int, str | None]:
        """Ask every actor for a report, find the dead, wait up to ``wait_seconds`` for the
        answers; return the entries, how many dead actors were forgotten, and a note about
        a restart (see :meth:`RegistryBook.note`)."""
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
            note = self._book.note(self._clock())
            self._save()
            return self._book.entries(generation), self._book.dropped, note

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
                self._save()
                self._changed.notify_all()


def restarting(exc: BaseException) -> bool:
    """Whether ``exc`` says that an actor is unavailable for now (Ray is restarting it, or
    cannot reach it): Ray 2's ``ActorUnavailableError``.

    >>> restarting(ValueError("not Ray's"))
    False
    """
    try:
        from ray.exceptions import ActorUnavailableError
    except ImportError:  # no Ray, or one without it: no error of Ray's is this one
        return False
    return isinstance(exc, ActorUnavailableError)


def saved_report(where: str, why: BaseException) -> ClusterReport | None:
    """While the registry is restarting: the report its saved book gives (every actor not
    fresh), saying so; ``None`` if there is no saved book to read."""
    data = KeyValueStore().load()
    if not data:
        return None
    book = RegistryBook()
    try:
        book.restore(data, time.monotonic())
    except Exception:  # noqa: BLE001 - an unreadable book: as if there were none
        return None
    return ClusterReport(
        book.entries(book.generation), where, dead_dropped=book.dropped, recovering=True,
        note=(f"the registry is restarting (Ray answers {type(why).__name__} for now); the "
              f"actors are shown with the last reports it saved, and register again as soon "
              f"as it is up"))


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
    marked dead. While Ray restarts the registry, and until the actors it knew have
    registered again, the report lists them with the last reports it saved and says so
    (``recovering``, ``note``). Where the registry is missing or does not answer otherwise,
    the report is empty and says so (``registry_error``); the actors keep their budgets either
    way.

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
        answer: tuple[tuple[ActorEntry, ...], int, str | None] = ray.get(
            registry.collect.remote(timeout), timeout=timeout + ANSWER_SECONDS)
    except Exception as exc:  # noqa: BLE001 - dead, restarting, not a registry at all
        saved = saved_report(where, exc) if restarting(exc) else None
        return saved if saved is not None else ClusterReport((), where, registry_error=(
            f"the registry did not answer ({type(exc).__name__}: {death_cause(exc)})"))
    entries, dropped, note = answer
    return ClusterReport(tuple(entries), where, dead_dropped=dropped, note=note,
                         recovering=note is not None)
