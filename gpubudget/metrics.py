"""The host ledger for Prometheus: every budget of every process on the host, per device.

Needs ``prometheus_client`` (``pip install 'gpubudget[metrics]'``). :class:`LedgerCollector`
reads the ledger afresh at each scrape; :func:`start_metrics_server` serves it over HTTP in
this process (a thread), ``gpubudget metrics --port N`` as a process of its own. Metric names
and labels follow ``prometheus_client``'s conventions (base units, ``_bytes``, counters end
in ``_total``):

==================================  =============================  =========================
metric                              labels                         what
==================================  =============================  =========================
``gpubudget_limit_bytes``           device, process, budget        the root's limit
``gpubudget_reserved_bytes``        device, process, budget        what it reserved
``gpubudget_used_bytes``            device, process, budget        what its blocks use now
``gpubudget_peak_bytes``            device, process, budget        the most they used
``gpubudget_denials_total``         device, process, budget        requests denied in it
``gpubudget_device_memory_bytes``   device                         the device's memory
``gpubudget_device_cap_bytes``      device                         its host-wide cap, if any
``gpubudget_device_claimed_bytes``  device                         what all roots claimed
``gpubudget_outside_bytes``         device, process                held beyond its budgets
                                                                   (NVML)
``gpubudget_process_info``          process, command               1 per process
==================================  =============================  =========================

``device`` is the device's identity (a GPU's UUID, ``host``), ``process`` the pid and
``budget`` the root's name (``name#2`` for the second root of that name in one process).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .hostledger import HostView, host_view

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["LedgerCollector", "MetricsServer", "metrics_command", "start_metrics_server"]

_NEEDS: str = "gpubudget metrics needs prometheus_client: pip install 'gpubudget[metrics]'"


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(_NEEDS) from exc
    return prometheus_client


class LedgerCollector:
    """A ``prometheus_client`` collector of the host ledger in ``directory`` (default: this
    process's ledger directory), read at each scrape.

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
    ['gpubudget_limit_bytes{budget="model",device="host",process="..."} 1.048576e+06']
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 nvml: bool = True) -> None:
        self.directory = directory
        self.nvml = nvml

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration: the ledger is read per scrape

    def collect(self) -> Iterator[Any]:
        yield from families(host_view(self.directory, nvml=self.nvml))


def families(view: HostView) -> list[Any]:
    """The metric families of ``view`` (see the module docstring)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    budget_labels = ["device", "process", "budget"]
    gauges = {name: GaugeMetricFamily(f"gpubudget_{name}_bytes", text, labels=budget_labels)
              for name, text in (("limit", "The limit of a root budget."),
                                 ("reserved", "Bytes a root budget reserved on its device."),
                                 ("used", "Bytes a root budget's blocks use now."),
                                 ("peak", "The most bytes a root budget's blocks used."))}
    denials = CounterMetricFamily("gpubudget_denials", "Requests denied in a root budget's "
                                  "tree.", labels=budget_labels)
    memory = GaugeMetricFamily("gpubudget_device_memory_bytes", "A device's memory.",
                               labels=["device", "label"])
    cap = GaugeMetricFamily("gpubudget_device_cap_bytes", "The most that the roots of the "
                            "host may claim on a device.", labels=["device"])
    claimed = GaugeMetricFamily("gpubudget_device_claimed_bytes", "Bytes the roots of the "
                                "host claimed on a device.", labels=["device"])
    outside = GaugeMetricFamily("gpubudget_outside_bytes", "Bytes a process holds on a device "
                                "beyond its budgets (NVML).", labels=["device", "process"])
    info = GaugeMetricFamily("gpubudget_process_info", "A process with budgets.",
                             labels=["process", "command"])
    commands: dict[int, str] = {}
    for device in view.devices:
        memory.add_metric([device.identity, device.label], device.total)
        claimed.add_metric([device.identity], device.claimed)
        if device.cap is not None:
            cap.add_metric([device.identity], device.cap)
        seen: dict[tuple[int, str], int] = {}
        for entry in device.entries:
            count = seen[(entry.pid, entry.name)] = seen.get((entry.pid, entry.name), 0) + 1
            labels = [device.identity, str(entry.pid),
                      entry.name if count == 1 else f"{entry.name}#{count}"]
            for name, value in (("limit", entry.limit), ("reserved", entry.reserved),
                                ("used", entry.used), ("peak", entry.peak)):
                gauges[name].add_metric(labels, value)
            denials.add_metric(labels, entry.denials)
            commands[entry.pid] = entry.process
        for pid in device.pids:
            held = device.outside(pid)
            if held is not None:
                outside.add_metric([device.identity, str(pid)], held)
    for pid, command in sorted(commands.items()):
        info.add_metric([str(pid), command], 1)
    return [*gauges.values(), denials, memory, cap, claimed, outside, info]


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
                         nvml: bool = True) -> MetricsServer:
    """Serve the host ledger's metrics at ``http://address:port/metrics`` from a thread.

    ``address`` defaults to this host only; give ``"0.0.0.0"`` for Prometheus on another
    machine. ``port=0`` lets the system choose (:attr:`MetricsServer.port` says which).
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
    registry.register(LedgerCollector(directory, nvml=nvml))
    server, thread = client.start_http_server(port, addr=address, registry=registry)
    return MetricsServer(server, thread, registry)


def metrics_command(port: int, address: str, directory: str | None) -> int:
    """``gpubudget metrics``: serve until interrupted (Ctrl-C, SIGTERM)."""
    import signal
    import sys
    import threading

    if directory is not None:
        host_view(directory, nvml=False)  # a bad directory or file: one line, exit 2, now
    server = start_metrics_server(port, address, directory=directory)
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
