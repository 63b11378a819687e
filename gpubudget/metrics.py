"""The host ledger for Prometheus: every budget of every process on the host, per device.

Needs ``prometheus_client`` (``pip install 'gpubudget[metrics]'``). :class:`LedgerCollector`
reads the ledger afresh at each scrape; :func:`start_metrics_server` serves it over HTTP in
this process (a thread), ``gpubudget metrics --port N`` as a process of its own. Metric names
and labels follow ``prometheus_client``'s conventions (base units, ``_bytes``, counters end
in ``_total``):

=====================================  ===========================  =========================
metric                                 labels                       what
=====================================  ===========================  =========================
``gpubudget_limit_bytes``              GPU, process, budget         the root's limit
``gpubudget_reserved_bytes``           GPU, process, budget         what it reserved
``gpubudget_used_bytes``               GPU, process, budget         what its blocks use now
``gpubudget_peak_bytes``               GPU, process, budget         the most they used
``gpubudget_denials_total``            GPU, process, budget         requests denied in it
``gpubudget_child_limit_bytes``        GPU, process, budget, child  a child budget's limit
``gpubudget_child_used_bytes``         GPU, process, budget, child  what it uses now
``gpubudget_child_peak_bytes``         GPU, process, budget, child  the most it used
``gpubudget_children_hidden``          GPU, process, budget         its children the ledger
                                                                    has no room to show
``gpubudget_device_memory_bytes``      GPU                          the device's memory
``gpubudget_device_cap_bytes``         GPU                          its host-wide cap, if any
``gpubudget_device_claimed_bytes``     GPU                          what all roots claimed
``gpubudget_device_used_bytes``        GPU                          what all roots' blocks use
``gpubudget_device_unclaimed_bytes``   GPU                          what new roots may still
                                                                    claim (the cap, else the
                                                                    memory, less the claimed)
``gpubudget_outside_bytes``            GPU, process                 held beyond its budgets
                                                                    (NVML)
``gpubudget_process_info``             process, pid, command        1 per process
``gpubudget_door_bytes``               GPU, process, budget, child  under the driver door:
                                                                    what libraries took
                                                                    through it in the
                                                                    budget's scope, live
``gpubudget_door_library_bytes``       GPU, process, budget,        the budget's own driver
                                       child, library               allocations live, by
                                                                    the library that asked
``gpubudget_door_refusals_total``      GPU, process, budget,        driver requests refused
                                       child, library               by the budget's limit,
                                                                    by the library that asked
=====================================  ===========================  =========================

*GPU* is three labels, named and spelt as NVIDIA's DCGM exporter names them, so that a query
can join both on the device (``on(UUID)``): ``UUID`` (a GPU's UUID, ``GPU-8f3c…``; ``host``
for budgets in host memory), ``gpu`` (NVML's index of the GPU, ``"0"``; empty where NVML
does not answer) and ``modelName`` (``NVIDIA H200``). ``budget`` is the root's name
(``name#2`` for the second root of that name in one process). ``process`` is the pid by
default: a restarted process makes new series. ``process_label="command"`` (``gpubudget
metrics --process-label command``) makes it the process's command line instead, the same
across restarts (``#2``, ``#3`` for further processes of one command, in order of pid);
``gpubudget_process_info`` then says which pid each is. ``child`` is a child budget's path
under its root, its ancestors' names and its own joined by ``/`` (``detector/backbone``;
``#2`` after a name that a sibling entered earlier holds too). The ``gpubudget_door_*``
families cover roots and children alike: ``child`` is empty for the root itself; they are
there only for processes started under the driver door (``gpubudget run``), read from their
door files (:mod:`gpubudget.door.shared`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final, Literal

from .hostledger import DeviceView, HostView, host_view
from .hostledger.children import ChildBudget
from .hostledger.devices import HOST_IDENTITY

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["PROCESS_LABELS", "LedgerCollector", "MetricsServer", "families", "metrics_command",
           "start_metrics_server"]

_NEEDS: str = "gpubudget metrics needs prometheus_client: pip install 'gpubudget[metrics]'"
PROCESS_LABELS: Final = ("pid", "command")
"""What the ``process`` label may hold: the pid, or the command line (stable)."""
ProcessLabel = Literal["pid", "command"]
_GPU: Final = ["UUID", "gpu", "modelName"]
"""The labels of a device, as NVIDIA's DCGM exporter names them."""


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(_NEEDS) from exc
    return prometheus_client


def nvml_indexes() -> dict[str, str]:
    """GPU UUID -> NVML's index of it (``"0"``), as DCGM's ``gpu`` label gives it; empty
    where NVML does not answer (no ``nvidia-ml-py``, no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, ...
        return {}
    found: dict[str, str] = {}
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
            found[uuid.decode() if isinstance(uuid, bytes) else str(uuid)] = str(index)
    except Exception:  # noqa: BLE001 - a GPU lost meanwhile: what was read
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return found


class LedgerCollector:
    """A ``prometheus_client`` collector of the host ledger in ``directory`` (default: this
    process's ledger directory), read at each scrape. ``nvml``: NVML's per-process memory
    and GPU indexes, where it answers. ``process_label``: ``"pid"`` or ``"command"`` (see
    the module docstring).

    >>> import os, tempfile
    >>> from unittest import mock
    >>> from prometheus_client import CollectorRegistry, generate_latest
    >>> from gpubudget import gpu_budget
    >>> registry = CollectorRegistry()
    >>> with mock.patch.dict(os.environ, GPUBUDGET_LEDGER_DIR=tempfile.mkdtemp()):
    ...     registry.register(LedgerCollector(nvml=False))
    ...     with gpu_budget("1MiB", name="model", backend="host") as model:
    ...         text = generate_latest(registry).decode()
    >>> [line for line in text.splitlines() if line.startswith("gpubudget_limit_bytes")]
    ['gpubudget_limit_bytes{UUID="host",budget="model",gpu="",modelName="host memory",process="..."} 1.048576e+06']
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 nvml: bool = True, process_label: ProcessLabel = "pid") -> None:
        if process_label not in PROCESS_LABELS:
            raise ValueError(f"process_label must be one of {', '.join(PROCESS_LABELS)}, got "
                             f"{process_label!r}")
        self.directory = directory
        self.nvml = nvml
        self.process_label: ProcessLabel = process_label

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration: the ledger is read per scrape

    def collect(self) -> Iterator[Any]:
        indexes = nvml_indexes() if self.nvml else {}
        yield from families(host_view(self.directory, nvml=self.nvml), indexes,
                            self.process_label)


def _process_names(view: HostView, label: ProcessLabel) -> dict[int, str]:
    """pid -> the ``process`` label: the pid, or its command (``#2``... in order of pid)."""
    commands: dict[int, str] = {}
    for device in view.devices:
        for entry in device.entries:
            commands.setdefault(entry.pid, entry.process)
        for pid in device.pids:
            commands.setdefault(pid, "")
    if label == "pid":
        return {pid: str(pid) for pid in commands}
    names: dict[int, str] = {}
    seen: dict[str, int] = {}
    for pid in sorted(commands):
        command = commands[pid] or f"pid {pid}"  # a process NVML sees, without budgets
        seen[command] = seen.get(command, 0) + 1
        names[pid] = command if seen[command] == 1 else f"{command}#{seen[command]}"
    return names


def _gpu(device: DeviceView, indexes: dict[str, str]) -> list[str]:
    """The device's DCGM labels: ``UUID``, ``gpu``, ``modelName``."""
    model = "host memory" if device.identity == HOST_IDENTITY else device.label
    return [device.identity, indexes.get(device.identity, ""), model]


def families(view: HostView, indexes: dict[str, str] | None = None,
             process_label: ProcessLabel = "pid") -> list[Any]:
    """The metric families of ``view`` (see the module docstring); ``indexes``: GPU UUID ->
    NVML index (:func:`nvml_indexes`)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    indexes = indexes or {}
    budget_labels = [*_GPU, "process", "budget"]
    gauges = {name: GaugeMetricFamily(f"gpubudget_{name}_bytes", text, labels=budget_labels)
              for name, text in (("limit", "The limit of a root budget."),
                                 ("reserved", "Bytes a root budget reserved on its device."),
                                 ("used", "Bytes a root budget's blocks use now."),
                                 ("peak", "The most bytes a root budget's blocks used."))}
    denials = CounterMetricFamily("gpubudget_denials", "Requests denied in a root budget's "
                                  "tree.", labels=budget_labels)
    device_gauges = {name: GaugeMetricFamily(f"gpubudget_device_{name}_bytes", text,
                                             labels=_GPU)
                     for name, text in (
                         ("memory", "A device's memory."),
                         ("cap", "The most that the roots of the host may claim on a device."),
                         ("claimed", "Bytes the roots of the host claimed on a device."),
                         ("used", "Bytes the blocks of the host's roots use on a device."),
                         ("unclaimed", "Bytes new roots may still claim on a device: its cap, "
                                       "else its memory, less what roots claimed."))}
    child_labels = [*budget_labels, "child"]
    child_gauges = {name: GaugeMetricFamily(f"gpubudget_child_{name}_bytes", text,
                                            labels=child_labels)
                    for name, text in (("limit", "The limit of a child budget."),
                                       ("used", "Bytes a child budget's blocks use now, its "
                                                "children's and unused reserves included."),
                                       ("peak", "The most bytes a child budget used."))}
    hidden = GaugeMetricFamily("gpubudget_children_hidden", "Child budgets of a root that the "
                               "ledger has no room to show.", labels=budget_labels)
    outside = GaugeMetricFamily("gpubudget_outside_bytes", "Bytes a process holds on a device "
                                "beyond its budgets (NVML).", labels=[*_GPU, "process"])
    info = GaugeMetricFamily("gpubudget_process_info", "A process with budgets.",
                             labels=["process", "pid", "command"])
    door_labels = [*child_labels, "library"]
    door_held = GaugeMetricFamily("gpubudget_door_bytes", "Bytes libraries took through the "
                                  "driver door in a budget's scope (its children's included).",
                                  labels=child_labels)
    door_bytes = GaugeMetricFamily("gpubudget_door_library_bytes", "A budget's own driver "
                                   "allocations live, by the library that asked.",
                                   labels=door_labels)
    door_refusals = CounterMetricFamily("gpubudget_door_refusals", "Driver requests a "
                                        "budget's limit refused, by the library that asked.",
                                        labels=door_labels)

    def door(labels: list[str], share: Any) -> None:
        if share is None:
            return
        door_held.add_metric(labels, share.held)
        for lib in share.libraries:
            door_bytes.add_metric([*labels, lib.name], lib.live)
            if lib.refusals:
                door_refusals.add_metric([*labels, lib.name], lib.refusals)

    names = _process_names(view, process_label)
    commands: dict[int, str] = {}
    for device in view.devices:
        gpu = _gpu(device, indexes)
        room = (device.cap if device.cap is not None else device.total) - device.claimed
        for name, value in (("memory", device.total), ("cap", device.cap),
                            ("claimed", device.claimed), ("used", device.used),
                            ("unclaimed", max(room, 0))):
            if value is not None:
                device_gauges[name].add_metric(gpu, value)
        seen: dict[tuple[int, str], int] = {}
        for entry in device.entries:
            count = seen[(entry.pid, entry.name)] = seen.get((entry.pid, entry.name), 0) + 1
            labels = [*gpu, names[entry.pid],
                      entry.name if count == 1 else f"{entry.name}#{count}"]
            for name, value in (("limit", entry.limit), ("reserved", entry.reserved),
                                ("used", entry.used), ("peak", entry.peak)):
                gauges[name].add_metric(labels, value)
            denials.add_metric(labels, entry.denials)
            hidden.add_metric(labels, entry.hidden)
            door([*labels, ""], device.door_of(entry))
            for path, child in _paths(device.children_of(entry)):
                for name, value in (("limit", child.limit), ("used", child.used),
                                    ("peak", child.peak)):
                    child_gauges[name].add_metric([*labels, path], value)
                door([*labels, path], device.door_of(entry, child))
            commands[entry.pid] = entry.process
        for pid in device.pids:
            held = device.outside(pid)
            if held is not None:
                outside.add_metric([*gpu, names[pid]], held)
    for pid, command in sorted(commands.items()):
        info.add_metric([names[pid], str(pid), command], 1)
    return [*gauges.values(), denials, *child_gauges.values(), hidden,
            *device_gauges.values(), outside, info, door_held, door_bytes, door_refusals]


def _paths(children: tuple[ChildBudget, ...]) -> Iterator[tuple[str, ChildBudget]]:
    """Each child (depth first) with its path under the root (see the module docstring)."""
    path: list[str] = []
    seen: list[dict[str, int]] = [{}]  # seen[d]: names of the siblings at depth d + 1
    for child in children:
        del path[child.depth - 1:]
        del seen[child.depth:]
        count = seen[-1][child.name] = seen[-1].get(child.name, 0) + 1
        path.append(child.name if count == 1 else f"{child.name}#{count}")
        seen.append({})
        yield "/".join(path), child


class MetricsServer:
    """An HTTP server of the ledger's metrics in a thread of this process."""

    def __init__(self, server: Any, thread: Any, registry: CollectorRegistry) -> None:
        self._server = server
        self._thread = thread
        self.registry = registry

    @property
    def port(self) -> int:
        """The port it listens on (the one the system chose, for ``port=0``)."""
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stop serving and wait for the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def start_metrics_server(port: int, address: str = "127.0.0.1", *,
                         directory: str | os.PathLike[str] | None = None,
                         nvml: bool = True, process_label: ProcessLabel = "pid"
                         ) -> MetricsServer:
    """Serve the host ledger's metrics at ``http://address:port/metrics`` from a thread.

    ``address`` defaults to this host only; give ``"0.0.0.0"`` for Prometheus on another
    machine. ``port=0`` lets the system choose (:attr:`MetricsServer.port` says which).
    ``process_label``: what the ``process`` label holds, ``"pid"`` or ``"command"`` (see the
    module docstring).
    ``ImportError`` naming the extra if ``prometheus_client`` is missing; ``ValueError`` for
    a port outside 0..65535.

    >>> import urllib.request
    >>> server = start_metrics_server(0, nvml=False)
    >>> with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as answer:
    ...     b"# TYPE gpubudget_used_bytes gauge" in answer.read()
    True
    >>> server.close()
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int from 0 to 65535, got {port!r}")
    client = _client()
    registry = client.CollectorRegistry()
    registry.register(LedgerCollector(directory, nvml=nvml, process_label=process_label))
    server, thread = client.start_http_server(port, addr=address, registry=registry)
    return MetricsServer(server, thread, registry)


def metrics_command(port: int, address: str, directory: str | None,
                    process_label: ProcessLabel = "pid") -> int:
    """``gpubudget metrics``: serve until interrupted (Ctrl-C, SIGTERM)."""
    import signal
    import sys
    import threading

    if directory is not None:
        host_view(directory, nvml=False)  # a bad directory or file: one line, exit 2, now
    server = start_metrics_server(port, address, directory=directory,
                                  process_label=process_label)
    print(f"gpubudget metrics: serving http://{address}:{server.port}/metrics", flush=True,
          file=sys.stderr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.close()
    return 0
