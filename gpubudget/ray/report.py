"""``ClusterReport``: the budgets of every budgeted actor of a Ray cluster, node by device.

Plain frozen dataclasses, built by the registry and sent to whoever asks; text and JSON forms.
Nothing here needs Ray.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal

from ..report import BudgetReport
from ..text import printable
from ..units import format_size

__all__ = ["ActorEntry", "ActorInfo", "ClusterReport", "DeviceSummary", "FlatReport"]

_INDENT: Final = " " * 6
"""How far an actor's budget report is indented in the text form (under the actor's line)."""


@dataclass(frozen=True)
class ActorInfo:
    """Who a budgeted actor is and where it runs; fixed for the actor's life."""

    actor_id: str
    class_name: str
    actor_name: str | None
    """The name given with ``.options(name=...)``, if any."""
    application: str | None
    """Ray Serve: the application of the replica (``None`` for a plain actor)."""
    deployment: str | None
    """Ray Serve: the deployment of the replica."""
    replica: str | None
    """Ray Serve: the replica's id."""
    node_id: str
    node_ip: str
    gpu_id: str
    """The GPU's id on its node, as Ray names it."""
    ordinal: int
    """The GPU's CUDA device ordinal in the actor's process."""
    share: float
    """The actor's ``num_gpus``."""
    device_memory: int
    simulated: bool
    """Whether the GPU is simulated in host memory (``GPUBUDGET_DEVICE_MEMORY``)."""
    limit: int
    pid: int
    trace: str | None
    """The actor's trace file (``budgeted(trace=DIR)``), if any."""

    @property
    def title(self) -> str:
        """One line naming the actor: its Serve replica, or its class (and name)."""
        if self.deployment is not None:
            return (f"Serve {self.application}/{self.deployment} replica {self.replica} "
                    f"(actor {self.actor_id[:12]})")
        named = f" {self.actor_name!r}" if self.actor_name else ""
        return f"{self.class_name}{named} (actor {self.actor_id[:12]})"


@dataclass(frozen=True)
class FlatReport:
    """A :class:`~gpubudget.BudgetReport` tree as a flat list, to send between processes.

    Pickling the nested form recurses once per level and fails for trees a few hundred
    budgets deep; this form is flat, and :meth:`tree` rebuilds the nested one with a loop.

    >>> from gpubudget import gpu_budget
    >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
    ...     with gpu_budget("1KiB", name="a"), gpu_budget("1KiB", name="b"):
    ...         pass
    >>> flat = FlatReport.of(pool.report())
    >>> flat.parents, [report.name for report in flat.tree().walk()]
    ((-1, 0, 1), ['pool', 'a', 'b'])
    """

    reports: tuple[BudgetReport, ...]
    """Every budget's own report (without children), parents before their children."""
    parents: tuple[int, ...]
    """The index in ``reports`` of each one's parent; -1 for the root."""

    @classmethod
    def of(cls, report: BudgetReport) -> FlatReport:
        reports: list[BudgetReport] = []
        parents: list[int] = []
        stack = [(report, -1)]
        while stack:
            node, parent = stack.pop()
            parents.append(parent)
            reports.append(dataclasses.replace(node, children=()))
            stack.extend((child, len(reports) - 1) for child in reversed(node.children))
        return cls(tuple(reports), tuple(parents))

    @property
    def root(self) -> BudgetReport:
        """The root budget's own report (its totals include its children's)."""
        return self.reports[0]

    def tree(self) -> BudgetReport:
        """The nested report again."""
        children: list[list[BudgetReport]] = [[] for _ in self.reports]
        for index in reversed(range(len(self.reports))):  # children before their parents
            node = dataclasses.replace(self.reports[index],
                                       children=tuple(reversed(children[index])))
            if self.parents[index] < 0:
                return node
            children[self.parents[index]].append(node)
        raise ValueError("a flat report without a root")


@dataclass(frozen=True)
class ActorEntry:
    """One budgeted actor as the registry last saw it."""

    info: ActorInfo
    state: Literal["alive", "dead"]
    flat: FlatReport | None
    """Its budget tree, as sent: taken for this report when ``fresh``, else the last one
    received (see :attr:`report`)."""
    fresh: bool
    """Whether the report was taken for this cluster report (a dead or unresponsive actor
    keeps the last report it sent)."""
    death: str | None = None
    """Why Ray says the actor died."""

    @property
    def report(self) -> BudgetReport | None:
        """The actor's budget tree (rebuilt from :attr:`flat` at each access)."""
        return self.flat.tree() if self.flat is not None else None

    @property
    def used(self) -> int:
        return self.flat.root.used if self.flat is not None else 0

    def as_dict(self) -> dict[str, Any]:
        """Plain data: the actor's fields, its state and its report."""
        fields: dict[str, Any] = dataclasses.asdict(self.info)
        report = self.report
        fields.update(state=self.state, fresh=self.fresh, death=self.death,
                      report=report.as_dict() if report is not None else None)
        return fields


@dataclass(frozen=True)
class DeviceSummary:
    """The budgeted actors on one GPU of one node, and what they add up to."""

    node_id: str
    node_ip: str
    gpu_id: str
    memory: int
    """The GPU's total memory, as its actors reported it."""
    simulated: bool
    actors: tuple[ActorEntry, ...]
    """Alive actors first, then dead ones."""

    @property
    def alive(self) -> tuple[ActorEntry, ...]:
        return tuple(entry for entry in self.actors if entry.state == "alive")

    @property
    def limits(self) -> int:
        """Sum of the limits of the alive actors' budgets."""
        return sum(entry.info.limit for entry in self.alive)

    @property
    def used(self) -> int:
        """Sum of what the alive actors' budgets use now."""
        return sum(entry.used for entry in self.alive)

    @property
    def overcommitted(self) -> bool:
        """Whether the alive actors' limits add up to more than the GPU has."""
        return self.limits > self.memory

    def as_dict(self) -> dict[str, Any]:
        return {"gpu_id": self.gpu_id, "memory": self.memory, "simulated": self.simulated,
                "limits": self.limits, "used": self.used, "overcommitted": self.overcommitted,
                "actors": [entry.as_dict() for entry in self.actors]}


@dataclass(frozen=True)
class ClusterReport:
    """Every budgeted actor of a Ray cluster, grouped by node and GPU.

    ``str(report)`` renders the tree: node, GPU (memory, sum of limits, sum of use), actor,
    its :class:`~gpubudget.BudgetReport`. Names and tags come from other programs' code, so
    the text shows each unprintable character of them escaped (as the trace commands do,
    with :func:`~gpubudget.tracefile.printable`): no terminal escape sequence passes through. :meth:`as_dict` and :meth:`to_json` give the same
    nested node -> device -> actor structure as plain data.

    Examples
    --------
    >>> report = ClusterReport((), registry_error="no registry actor")
    >>> print(report)
    gpubudget cluster report: 0 budgeted actors alive, 0 dead
    registry missing: no registry actor
    >>> report.as_dict()["registry"]["error"]
    'no registry actor'
    """

    actors: tuple[ActorEntry, ...]
    registry: str = ""
    """The registry actor asked, as ``namespace/name``."""
    registry_error: str | None = None
    """Why the registry actor could not be asked (missing, unreachable); ``None`` if it
    answered."""
    dead_dropped: int = 0
    """Dead actors forgotten to keep the registry bounded."""
    note: str | None = None
    """What the registry says about its state: that it restarted and which actors have not
    registered again yet; ``None`` when all is as usual."""
    recovering: bool = False
    """Whether the registry is being restarted, or was, and not every actor it knew has
    registered again: the actors listed may show their last reports, saved before."""

    @property
    def alive(self) -> tuple[ActorEntry, ...]:
        return tuple(entry for entry in self.actors if entry.state == "alive")

    @property
    def dead(self) -> tuple[ActorEntry, ...]:
        return tuple(entry for entry in self.actors if entry.state == "dead")

    @property
    def devices(self) -> tuple[DeviceSummary, ...]:
        """One summary per GPU that has (or had) a budgeted actor, by node then GPU id."""
        groups: dict[tuple[str, str], list[ActorEntry]] = {}
        for entry in self.actors:
            groups.setdefault((entry.info.node_id, entry.info.gpu_id), []).append(entry)
        return tuple(_summary(entries) for _, entries in
                     sorted(groups.items(), key=lambda item: _device_order(item[1][0].info)))

    def entry(self, actor_id: str) -> ActorEntry | None:
        """The entry of the actor with this id, if the registry knows it."""
        return next((entry for entry in self.actors if entry.info.actor_id == actor_id), None)

    @property
    def warnings(self) -> tuple[str, ...]:
        """GPUs whose alive actors' limits add up to more than the GPU has."""
        return tuple(
            f"node {device.node_ip} GPU {device.gpu_id}: the limits of its budgets add up to "
            f"{format_size(device.limits)}, more than its {format_size(device.memory)}"
            for device in self.devices if device.overcommitted)

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts, lists, strings and numbers: registry, nodes -> devices -> actors."""
        nodes: dict[str, dict[str, Any]] = {}
        for device in self.devices:
            node = nodes.setdefault(device.node_id, {
                "node_id": device.node_id, "node_ip": device.node_ip, "devices": []})
            node["devices"].append(device.as_dict())
        return {
            "registry": {"actor": self.registry, "error": self.registry_error,
                         "note": self.note, "recovering": self.recovering},
            "alive": len(self.alive),
            "dead": len(self.dead),
            "dead_dropped": self.dead_dropped,
            "nodes": list(nodes.values()),
            "warnings": list(self.warnings),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON text: what ``json.dumps(report.as_dict(), indent=indent)``
        gives, for budget trees of any depth (each actor's report is written by
        :meth:`~gpubudget.BudgetReport.to_json`, a loop; the rest by ``json``)."""
        data = self.as_dict()
        reports: dict[str, str] = {}
        for node in data["nodes"]:
            for device in node["devices"]:
                for actor in device["actors"]:
                    if actor["report"] is not None:
                        entry = self.entry(actor["actor_id"])
                        report = entry.report if entry is not None else None
                        token = actor["report"] = f"\u0000report {len(reports)}\u0000"
                        reports[json.dumps(token)] = (report.to_json(indent) if report
                                                      is not None else "null")
        return _splice(json.dumps(data, indent=indent), reports)

    def __str__(self) -> str:
        alive = len(self.alive)
        lines = [f"gpubudget cluster report: {alive} budgeted "
                 f"{'actor' if alive == 1 else 'actors'} alive, {len(self.dead)} dead"]
        if self.registry_error is not None:
            lines.append(f"registry missing: {printable(self.registry_error)}")
        elif self.note is not None:
            lines.append(f"note: {printable(self.note)}")
        if self.registry_error is None and not self.actors:
            lines.append("no budgeted actor has registered")
        node_id = None
        for device in self.devices:
            if device.node_id != node_id:
                node_id = device.node_id
                lines.append(f"node {printable(device.node_ip)} "
                             f"({printable(device.node_id[:12])})")
            lines.extend(_device_lines(device))
        if self.dead_dropped:
            lines.append(f"({self.dead_dropped} older dead actors forgotten)")
        lines.extend(f"warning: {printable(warning)}" for warning in self.warnings)
        return "\n".join(lines)


def _splice(text: str, parts: dict[str, str]) -> str:
    """``text`` with each quoted token (in order) replaced by its JSON, whose lines are
    indented like the token's line."""
    pieces: list[str] = []
    done = 0
    for token, part in parts.items():
        at = text.index(token, done)
        line = text[text.rfind("\n", 0, at) + 1:at]
        margin = line[:len(line) - len(line.lstrip(" "))]
        pieces += [text[done:at], part.replace("\n", "\n" + margin)]
        done = at + len(token)
    return "".join(pieces) + text[done:]


def _summary(entries: list[ActorEntry]) -> DeviceSummary:
    first = entries[0].info
    alive_first = sorted(entries, key=lambda entry: (entry.state != "alive", entry.info.title))
    return DeviceSummary(first.node_id, first.node_ip, first.gpu_id,
                         memory=max(entry.info.device_memory for entry in entries),
                         simulated=any(entry.info.simulated for entry in entries),
                         actors=tuple(alive_first))


def _device_order(info: ActorInfo) -> tuple[str, str, int, str]:
    gpu = info.gpu_id
    return (info.node_ip, info.node_id, int(gpu) if gpu.isdigit() else -1, gpu)


def _device_lines(device: DeviceSummary) -> Iterable[str]:
    kind = "simulated, " if device.simulated else ""
    count = len(device.alive)
    yield (f"  GPU {printable(device.gpu_id)} ({kind}{format_size(device.memory)}): {count} "
           f"{'actor' if count == 1 else 'actors'} alive, limits {format_size(device.limits)}, "
           f"used {format_size(device.used)}")
    for entry in device.actors:
        yield f"    {printable(entry.info.title)}: {_status(entry)}"
        if entry.flat is not None:
            flat = entry.flat
            shown = FlatReport(tuple(_printable(own) for own in flat.reports), flat.parents)
            for line in str(shown.tree()).splitlines():
                yield _INDENT + line


def _printable(report: BudgetReport) -> BudgetReport:
    """One budget's own report (children not included) with its names, tags and errors
    printable (see :func:`~gpubudget.tracefile.printable`)."""
    return dataclasses.replace(
        report,
        name=printable(report.name),
        denials=tuple(dataclasses.replace(d, refused_by=printable(d.refused_by))
                      for d in report.denials),
        live_blocks=tuple(dataclasses.replace(b, tag=printable(b.tag)) if b.tag else b
                          for b in report.live_blocks),
        by_tag=tuple(dataclasses.replace(u, tag=printable(u.tag)) for u in report.by_tag),
        callback_errors=tuple(printable(error) for error in report.callback_errors),
        trace_error=None if report.trace_error is None else printable(report.trace_error))


def _status(entry: ActorEntry) -> str:
    info = entry.info
    where = f"num_gpus {info.share:g}, pid {info.pid}"
    if info.trace:
        where += f", trace {printable(info.trace)}"
    if entry.state == "dead":
        return f"DEAD ({printable(entry.death or 'cause unknown')}); {where}; its last report:"
    if not entry.fresh:
        return f"alive, did not answer in time; {where}; its last report:"
    return f"alive; {where}"
