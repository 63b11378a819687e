"""gpubudget.ray on a real multi-node Ray cluster started on this host
(``ray.cluster_utils.Cluster``): a head node without GPUs and two nodes with a logical GPU
each, each node with a host ledger of its own (``GPUBUDGET_LEDGER_DIR`` in the node's
environment: nodes of one host share ``/dev/shm``). The cluster report groups actors by node,
the ledgers stay per node, and a removed node's actors are marked dead with Ray's reason.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpubudget.hostledger import host_view
from gpubudget.ray import ClusterReport, cluster_report
from gpubudget.ray import registry as ray_registry
from gpubudget.units import GiB
from tests.test_ray import model_class

if TYPE_CHECKING:
    from ray.actor import ActorHandle

HAVE_RAY = importlib.util.find_spec("ray") is not None
WAIT = 90.0
"""Seconds to wait for Ray to notice a removed node, or for reports."""


@dataclass
class Cluster:
    cluster: Any
    nodes: dict[str, Any]
    """Ray's node objects by name: ``a`` and ``b`` (with a GPU each)."""
    ledgers: dict[str, Path]
    """The ledger directory of each node: ``head``, ``a``, ``b``."""
    node_ids: dict[str, str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not HAVE_RAY:
        pytest.skip("Ray is not installed: pip install -e '.[dev,ray-serve]'")
    import ray
    from ray.cluster_utils import Cluster as RayCluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ledgers = {name: tmp_path_factory.mktemp(f"ledger-{name}") for name in ("head", "a", "b")}

    def node_env(name: str) -> dict[str, str]:
        return {"GPUBUDGET_DEVICE_MEMORY": "8GiB", "GPUBUDGET_BACKEND": "host",
                "GPUBUDGET_LEDGER_DIR": str(ledgers[name])}

    ray_cluster = RayCluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "env_vars": node_env("head")})
    nodes = {name: ray_cluster.add_node(num_cpus=1, num_gpus=1, resources={f"node-{name}": 1},
                                        env_vars=node_env(name)) for name in ("a", "b")}
    ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        node_ids = {"head": ray_cluster.head_node.node_id,
                    **{name: node.node_id for name, node in nodes.items()}}
        # the registry on the head node, which stays (budgeted actors find it by name)
        ray_registry._registry_class().options(
            name=ray_registry.REGISTRY_NAME, namespace=ray_registry.REGISTRY_NAMESPACE,
            lifetime="detached", get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_ids["head"], soft=False),
        ).remote()
        yield Cluster(ray_cluster, nodes, ledgers, node_ids)
    finally:
        ray.shutdown()
        ray_cluster.shutdown()


def on_node(cluster: Cluster, name: str, weights: int
            ) -> tuple[ActorHandle, dict[str, Any]]:
    """A budgeted actor of half a GPU on node ``name``, holding ``weights`` bytes."""
    import ray

    actor = model_class(num_gpus=0.5).options(resources={f"node-{name}": 0.01}).remote(weights)
    return actor, ray.get(actor.describe.remote(), timeout=WAIT)


def report_until(done: Callable[[ClusterReport], bool]) -> ClusterReport:
    deadline = time.monotonic() + WAIT
    while True:
        report = cluster_report(timeout=30.0)
        if done(report) or time.monotonic() > deadline:
            return report
        time.sleep(0.5)


@dataclass
class Placed:
    ids: dict[str, set[str]]
    """Actor ids by node name."""
    pids: dict[str, set[int]]
    described: dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def placed(cluster: Cluster) -> Iterator[Placed]:
    """Two budgeted actors on node a (1 GiB and 512 MiB of weights), one on node b (256 MiB)."""
    import ray

    actors = {"a": [on_node(cluster, "a", GiB), on_node(cluster, "a", GiB // 2)],
              "b": [on_node(cluster, "b", GiB // 4)]}
    yield Placed(ids={name: {described["actor_id"] for _, described in pairs}
                      for name, pairs in actors.items()},
                 pids={name: {ray.get(actor.pid.remote()) for actor, _ in pairs}
                       for name, pairs in actors.items()},
                 described={name: [described for _, described in pairs]
                            for name, pairs in actors.items()})
    for pairs in actors.values():
        for actor, _ in pairs:
            ray.kill(actor)


def test_the_cluster_report_groups_actors_by_node(cluster: Cluster, placed: Placed) -> None:
    report = report_until(lambda r: len(r.alive) >= 3)
    by_node: dict[str, set[str]] = {}
    for device in report.devices:
        by_node.setdefault(device.node_id, set()).update(e.info.actor_id for e in device.alive)
    assert by_node == {cluster.node_ids["a"]: placed.ids["a"],
                       cluster.node_ids["b"]: placed.ids["b"]}
    text = str(report)
    assert text.count("\nnode ") == 2
    for name in ("a", "b"):
        assert f"({cluster.node_ids[name][:12]})" in text
    assert [len(node["devices"]) for node in report.as_dict()["nodes"]] == [1, 1]


def test_each_nodes_ledger_holds_its_own_budgets_only(cluster: Cluster, placed: Placed) -> None:
    for name in ("a", "b"):
        view = host_view(cluster.ledgers[name], nvml=False)
        assert {entry.pid for entry in view.entries} == placed.pids[name]
        assert [device.identity for device in view.devices] == [
            f"{cluster.node_ids[name]}-gpu{placed.described[name][0]['gpu_id']}"]
    used = [entry.used for entry in host_view(cluster.ledgers["a"], nvml=False).entries]
    assert sorted(used) == [GiB // 2, GiB]
    assert host_view(cluster.ledgers["head"], nvml=False).entries == ()


def test_a_removed_nodes_actors_are_marked_dead_with_rays_reason(cluster: Cluster,
                                                                  placed: Placed) -> None:
    cluster.cluster.remove_node(cluster.nodes["b"])  # last: node b is gone for good
    (lost,) = placed.ids["b"]

    def dead(report: ClusterReport) -> bool:
        entry = report.entry(lost)
        return entry is not None and entry.state == "dead"

    report = report_until(dead)
    entry = report.entry(lost)
    assert entry is not None and entry.state == "dead", str(report)
    # Ray's words, e.g. "the actor's node was terminated expectedly: received SIGTERM"
    assert entry.death is not None and "node" in entry.death.lower(), entry.death
    assert entry.report is not None and entry.report.used == GiB // 4  # its last report
    assert {e.info.actor_id for e in report.alive} >= placed.ids["a"]
    assert f"DEAD ({entry.death})" in str(report)
