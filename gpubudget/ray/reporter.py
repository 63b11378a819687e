"""The thread in each budgeted actor that keeps the registry informed.

At the end of the actor's ``__init__`` it registers (creating the registry on first use) and
then waits in the registry for report requests, answering each with a snapshot of the budget.
Nothing here can stop the actor from working: if the registry is missing or stops answering,
the error is recorded (:attr:`Reporter.registry_error`, and one warning in the actor's log)
and the thread registers anew once a registry answers (it never creates one after the first
attempt). It asks again after :data:`FIRST_RETRY_SECONDS`, and keeps asking that often while
Ray says the registry is restarting (its calls fail with ``ActorUnavailableError`` until the
new process is up), so that the actors are back in the reports within a second or two of it;
while there is no registry at all (or something else answers to its name), it looks every
:data:`RETRY_SECONDS`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Final, TypeVar

from ..budget import Budget
from ..tracefile import writer_for
from .registry import death_cause, find_registry, restarting, start_registry
from .report import ActorInfo, FlatReport

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

T = TypeVar("T")
__all__ = ["FIRST_RETRY_SECONDS", "FLUSH_SECONDS", "REGISTER_SECONDS", "RETRY_SECONDS",
           "Reporter"]

REGISTER_SECONDS: Final = 30.0
"""How long an actor's ``__init__`` waits for the registry (its first start included), and
how long any call to the registry may take before the actor counts it as lost."""
RETRY_SECONDS: Final = 10.0
"""How often an actor looks for a registry while there is none (or one that does not work)."""
FIRST_RETRY_SECONDS: Final = 0.5
"""How soon an actor that just lost the registry asks for it again, and how often it asks
while Ray restarts it (a restarting registry keeps its name; each call to it fails after a
second or so until it is up)."""
POLL_SECONDS: Final = 2.0
"""How long one wait for a report request lasts: an actor that exits gracefully waits for
its pending calls, so for at most this long."""
FLUSH_SECONDS: Final = 1.0
"""How often an actor's trace file is flushed (a killed actor loses at most that much)."""
_log: Final = logging.getLogger("gpubudget.ray")


class Reporter:
    """Registers one budgeted actor and answers the registry's report requests."""

    def __init__(self, info: ActorInfo, budget: Budget) -> None:
        self.info: Final = info
        self.budget: Final = budget
        self.registry_error: str | None = None
        """Why the registry could not be reached, the last time it could not; ``None`` while
        it answers."""
        self._registry: ActorHandle | None = None
        self._generation = 0
        self._restarting = False
        """Whether the last failure said the registry is being restarted by Ray."""

    def snapshot(self) -> FlatReport:
        """The budget's report, flat and without its event log (the registry does not need
        it); the trace file, if any, is flushed first, so that it holds what the report
        shows."""
        self.flush_trace()
        return FlatReport.of(dataclasses.replace(self.budget.report(), timeline=()))

    def flush_trace(self) -> None:
        """Write out the trace's buffered events (an actor's process may end without running
        exit handlers, as Ray's workers do); never raises."""
        if self.info.trace is not None and self.budget.state == "open":
            try:
                writer_for(self.info.trace).flush()
            except Exception:  # noqa: BLE001, S110 - the budget records trace failures itself
                pass

    def register(self, *, create: bool, timeout: float | None = None) -> bool:
        """Register with the registry (creating it if ``create``); ``False`` on failure."""
        import ray

        try:
            registry = start_registry() if create else find_registry()
            if registry is None:
                self._failed("the registry is missing")
                return False
            handle = ray.get_runtime_context().current_actor  # weak: keeps nothing alive
            self._generation = _result(
                registry.register.remote(self.info, handle, self.snapshot()), timeout)
        except Exception as exc:  # noqa: BLE001 - never fail the actor over its report
            self._failed(f"{type(exc).__name__}: {death_cause(exc)}", restarting(exc))
            return False
        self._registry = registry
        self.registry_error = None
        self._restarting = False
        return True

    def start(self) -> None:
        """Answer report requests from a daemon thread, for the life of the process (and,
        with a trace, flush it every :data:`FLUSH_SECONDS` from another)."""
        threading.Thread(target=self._serve, name="gpubudget-reporter", daemon=True).start()
        if self.info.trace is not None:
            threading.Thread(target=self._flush_often, name="gpubudget-trace-flush",
                             daemon=True).start()

    def _flush_often(self) -> None:
        wait = threading.Event()
        while self.budget.state == "open":
            wait.wait(FLUSH_SECONDS)
            self.flush_trace()

    def _serve(self) -> None:
        while True:
            registry = self._registry
            if registry is None:
                if not self.register(create=False, timeout=REGISTER_SECONDS):
                    self._pause(FIRST_RETRY_SECONDS if self._restarting else RETRY_SECONDS)
                continue
            try:
                asked = _result(registry.next_request.remote(
                    self.info.actor_id, self._generation, POLL_SECONDS),
                    POLL_SECONDS + REGISTER_SECONDS)
                if asked != self._generation:
                    self._generation = asked
                    _result(registry.update.remote(self.info.actor_id, asked,
                                                   self.snapshot()), REGISTER_SECONDS)
            except Exception as exc:  # noqa: BLE001 - the registry died or was killed
                self._registry = None
                self._failed(f"{type(exc).__name__}: {death_cause(exc)}", True)
                self._pause(FIRST_RETRY_SECONDS)

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` before asking the registry again."""
        threading.Event().wait(seconds)

    def _failed(self, reason: str, restarting: bool = False) -> None:
        if self.registry_error is None:
            _log.warning("gpubudget: %s cannot reach the registry (%s); its budget works "
                         "as before, it is missing from cluster reports until it registers "
                         "again", self.info.title, reason)
        self.registry_error = reason
        self._restarting = restarting


def _result(ref: ObjectRef[T], timeout: float | None = None) -> T:
    """What ``ref`` resolves to, waiting in this thread (``ray.get`` would warn inside an
    asyncio actor, although this thread is not its event loop)."""
    return ref.future().result(timeout)
