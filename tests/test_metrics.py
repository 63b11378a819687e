"""gpubudget.metrics: the host ledger scraped over HTTP on localhost, as Prometheus reads it,
from a server in this process and from ``gpubudget metrics``."""

from __future__ import annotations

import contextvars
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubudget import gpu_budget
from gpubudget.cli import main
from gpubudget.metrics import start_metrics_server
from gpubudget.units import GiB, MiB
from tests.helpers import subprocess_env
from tests.test_hostledger_claims import WORKER, Worker

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="prometheus_client is not installed: pip install -e '.[dev]'")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

@pytest.fixture(autouse=True)
def _ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path / "ledger"))
    monkeypatch.setenv("GPUBUDGET_DEVICE_MEMORY", "8GiB")


@pytest.fixture
def busy() -> Iterator[list[Worker]]:
    first, second = Worker(), Worker()
    try:
        assert first.ask("enter 2GiB detector").startswith("ok")
        assert first.ask("allocate 1048576").startswith("ok")
        assert second.ask("enter 1GiB llm").startswith("ok")
        assert second.ask("allocate 4294967296").startswith("denied")
        yield [first, second]
    finally:
        first.close()
        second.close()


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


HOST = (("UUID", "host"), ("gpu", ""), ("modelName", "host memory"))
"""The device labels of the host backend's budgets."""


def budget(name: str, pid: int | str, metric: str, samples: Samples) -> float:
    return samples[(metric, tuple(sorted((*HOST, ("budget", name), ("process", str(pid))))))]


def test_every_budget_of_every_process_scraped_over_http(busy: list[Worker]) -> None:
    first, second = busy
    server = start_metrics_server(0)
    try:
        samples = scrape(server.port)
    finally:
        server.close()
    assert budget("detector", first.pid, "gpubudget_limit_bytes", samples) == 2 * GiB
    assert budget("detector", first.pid, "gpubudget_reserved_bytes", samples) == 2 * GiB
    assert budget("detector", first.pid, "gpubudget_used_bytes", samples) == MiB
    assert budget("detector", first.pid, "gpubudget_peak_bytes", samples) == MiB
    assert budget("llm", second.pid, "gpubudget_denials_total", samples) == 1
    assert budget("llm", second.pid, "gpubudget_used_bytes", samples) == 0
    assert samples[("gpubudget_device_claimed_bytes", HOST)] == 3 * GiB
    assert samples[("gpubudget_device_memory_bytes", HOST)] == 8 * GiB
    assert samples[("gpubudget_device_used_bytes", HOST)] == MiB
    assert samples[("gpubudget_device_unclaimed_bytes", HOST)] == 5 * GiB
    assert samples[("gpubudget_process_info", (
        ("command", WORKER), ("pid", str(first.pid)), ("process", str(first.pid))))] == 1
    assert not [key for key in samples if key[0] == "gpubudget_device_cap_bytes"]


def test_two_roots_of_one_name_in_a_process_are_told_apart() -> None:
    first, second = contextvars.Context(), contextvars.Context()
    a = first.run(gpu_budget("1MiB", name="pool").__enter__)
    b = second.run(gpu_budget("2MiB", name="pool").__enter__)
    server = start_metrics_server(0, nvml=False)
    try:
        samples = scrape(server.port)
    finally:
        server.close()
        first.run(a.__exit__, None, None, None)
        second.run(b.__exit__, None, None, None)
    assert budget("pool", os.getpid(), "gpubudget_limit_bytes", samples) == MiB
    assert budget("pool#2", os.getpid(), "gpubudget_limit_bytes", samples) == 2 * MiB


def test_the_command_serves_until_terminated(busy: list[Worker]) -> None:
    server = subprocess.Popen([sys.executable, "-m", "gpubudget", "metrics", "--port", "0"],
                              stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert server.stderr is not None
        line = server.stderr.readline()
        assert line.startswith("gpubudget metrics: serving http://127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        samples = scrape(port)
        assert budget("detector", busy[0].pid, "gpubudget_used_bytes", samples) == MiB
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stderr is not None:
            server.stderr.close()


def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    assert main(["metrics", "--port", "http"]) == 2
    assert "--port 'http' is not a port number (0 to 65535)" in capsys.readouterr().err
    assert main(["metrics"]) == 2
    assert "the following arguments are required: --port" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "GPU-x.ledger").write_text("x")
    assert main(["metrics", "--port", "0", "--ledger-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the ledger file" in err and "is 1 bytes" in err
    with pytest.raises(ValueError, match="port must be an int from 0 to 65535, got 70000"):
        start_metrics_server(70000)


def test_without_prometheus_client_the_error_names_the_extra(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pip install 'gpubudget\[metrics\]'"):
        start_metrics_server(0)
    assert main(["metrics", "--port", "0"]) == 2
    assert "needs prometheus_client: pip install 'gpubudget[metrics]'" in capsys.readouterr().err


def test_labels_join_with_nvidias_dcgm_exporter() -> None:
    """A GPU's series carry DCGM's ``UUID``, ``gpu`` (NVML's index) and ``modelName``, so
    that ``gpubudget_used_bytes * on(UUID) group_left DCGM_FI_DEV_FB_USED`` joins."""
    from gpubudget.hostledger import DeviceView, HostView
    from gpubudget.metrics import families
    from tests.test_top import entry, view

    gpu = DeviceView("GPU-77aa", "NVIDIA L4", 24 * GiB, 20 * GiB, False, (
        entry(40, "embedder", 4 * GiB, GiB, GiB, 2, "python embed.py"),), 0, {40: 5 * GiB})
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in families(HostView("d", view().taken_at, (gpu,), None),
                                      {"GPU-77aa": "3"})
               for sample in family.samples}
    device = (("UUID", "GPU-77aa"), ("gpu", "3"), ("modelName", "NVIDIA L4"))
    assert samples[("gpubudget_used_bytes", tuple(sorted(
        (*device, ("budget", "embedder"), ("process", "40")))))] == GiB
    assert samples[("gpubudget_denials_total", tuple(sorted(
        (*device, ("budget", "embedder"), ("process", "40")))))] == 2
    assert samples[("gpubudget_device_used_bytes", device)] == GiB
    assert samples[("gpubudget_device_unclaimed_bytes", device)] == 16 * GiB  # the cap's
    assert samples[("gpubudget_device_cap_bytes", device)] == 20 * GiB
    assert samples[("gpubudget_outside_bytes", tuple(sorted((*device, ("process", "40")))))] \
        == GiB  # NVML's 5 GiB less the 4 GiB its budget reserved
    assert {label for key in samples for label, _ in key[1]} == {
        "UUID", "gpu", "modelName", "process", "budget", "pid", "command"}


def test_nvml_gives_the_gpu_index_dcgm_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubudget.metrics import nvml_indexes

    class FakeNvml:
        calls: list[str] = []

        def nvmlInit(self) -> None:
            self.calls.append("init")

        def nvmlShutdown(self) -> None:
            self.calls.append("shutdown")

        def nvmlDeviceGetCount(self) -> int:
            return 2

        def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
            return index

        def nvmlDeviceGetUUID(self, handle: int) -> bytes | str:
            return b"GPU-aaaa" if handle == 0 else "GPU-bbbb"

    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert nvml_indexes() == {"GPU-aaaa": "0", "GPU-bbbb": "1"}
    assert fake.calls == ["init", "shutdown"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: no index, no error
    assert nvml_indexes() == {}


def test_a_stable_process_label_survives_a_restart(tmp_path: Path) -> None:
    """With ``--process-label command`` a process started again under the same command
    keeps its series; with the pid it would start new ones."""
    def scrape_once(worker: Worker) -> Samples:
        assert worker.ask("enter 1GiB server").startswith("ok")
        server = start_metrics_server(0, nvml=False, process_label="command")
        try:
            return scrape(server.port)
        finally:
            server.close()

    first = Worker()
    try:
        before = scrape_once(first)
    finally:
        first.close()
    second = Worker()
    try:
        after = scrape_once(second)
    finally:
        second.close()
    assert first.pid != second.pid
    assert budget("server", WORKER, "gpubudget_limit_bytes", before) == GiB
    assert budget("server", WORKER, "gpubudget_limit_bytes", after) == GiB  # the same series
    assert after[("gpubudget_process_info", (
        ("command", WORKER), ("pid", str(second.pid)), ("process", WORKER)))] == 1


def test_processes_of_one_command_are_numbered_in_order_of_pid(busy: list[Worker]) -> None:
    first, second = sorted(busy, key=lambda worker: worker.pid)
    server = start_metrics_server(0, nvml=False, process_label="command")
    try:
        samples = scrape(server.port)
    finally:
        server.close()
    assert budget("detector" if first is busy[0] else "llm", WORKER, "gpubudget_limit_bytes",
                  samples) > 0
    assert budget("llm" if first is busy[0] else "detector", f"{WORKER}#2",
                  "gpubudget_limit_bytes", samples) > 0
    assert samples[("gpubudget_process_info", (
        ("command", WORKER), ("pid", str(second.pid)), ("process", f"{WORKER}#2")))] == 1


def test_child_budgets_are_scraped_by_their_path_under_the_root() -> None:
    worker = Worker()
    server = start_metrics_server(0)
    try:
        assert worker.ask("enter 2GiB server").startswith("ok")
        for command in ("child 1GiB model", "allocate 1048576", "child 256MiB cache",
                        "child 64MiB cache"):  # inside the first cache
            assert worker.ask(command).startswith("ok"), command
        samples = scrape(server.port)
        assert worker.ask("leave").startswith("ok")
        after = scrape(server.port)
    finally:
        server.close()
        worker.close()

    def child(path: str, metric: str, seen: Samples) -> float | None:
        labels = (*HOST, ("budget", "server"), ("child", path), ("process", str(worker.pid)))
        return seen.get((f"gpubudget_child_{metric}_bytes", tuple(sorted(labels))))

    assert child("model", "limit", samples) == GiB and child("model", "used", samples) == MiB
    assert child("model/cache", "limit", samples) == 256 * MiB
    assert child("model/cache/cache", "limit", samples) == 64 * MiB
    assert child("model", "peak", samples) == MiB
    assert budget("server", worker.pid, "gpubudget_children_hidden", samples) == 0
    assert child("model/cache/cache", "limit", after) is None  # released: gone
    assert child("model/cache", "limit", after) == 256 * MiB


def test_siblings_of_one_name_are_told_apart_in_their_paths() -> None:
    from gpubudget.hostledger import ChildBudget
    from gpubudget.metrics import _paths

    def kid(name: str, depth: int) -> ChildBudget:
        return ChildBudget(name, depth, 1, 0, 0, 0, 1)

    children = (kid("a", 1), kid("x", 2), kid("x", 2), kid("x", 3), kid("a", 1), kid("x", 2))
    assert [path for path, _ in _paths(children)] == [
        "a", "a/x", "a/x#2", "a/x#2/x", "a#2", "a#2/x"]
