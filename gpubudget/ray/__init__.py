"""GPU budgets for Ray actors and Ray Serve replicas, and one report for the whole cluster.

Ray's ``num_gpus=0.5`` schedules two actors on one GPU but limits nothing. With
:func:`budgeted`, each actor runs inside a budget of its share of that GPU, and
:func:`cluster_report` shows every budgeted actor of the cluster: node, GPU, actor, budget.

>>> import ray                                                        # doctest: +SKIP
>>> from gpubudget.ray import budgeted, cluster_report
>>> @ray.remote(num_gpus=0.5)                                         # doctest: +SKIP
... @budgeted()
... class Detector:
...     def infer(self, batch): ...
>>> detectors = [Detector.remote() for _ in range(2)]                 # doctest: +SKIP
>>> print(cluster_report())                                           # doctest: +SKIP

Needs Ray (``pip install 'gpubudget[ray]'``) where actors run and where reports are asked
for; importing this module does not import Ray.
"""

from __future__ import annotations

from .actor import ActorSpec, actor_budget, budgeted
from .command import ray_command
from .placement import DEFAULT_MARGIN, DEVICE_MEMORY_ENV, PlacementError
from .registry import DEAD_KEPT, REGISTRY_NAME, REGISTRY_NAMESPACE, cluster_report
from .report import ActorEntry, ActorInfo, ClusterReport, DeviceSummary, FlatReport
from .simulated import SimulatedGpu

__all__ = [
    "DEAD_KEPT",
    "DEFAULT_MARGIN",
    "DEVICE_MEMORY_ENV",
    "REGISTRY_NAME",
    "REGISTRY_NAMESPACE",
    "ActorEntry",
    "ActorInfo",
    "ActorSpec",
    "ClusterReport",
    "DeviceSummary",
    "FlatReport",
    "PlacementError",
    "SimulatedGpu",
    "actor_budget",
    "budgeted",
    "cluster_report",
    "ray_command",
]
