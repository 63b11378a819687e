"""Two models on one GPU under Ray: Ray schedules them, gpubudget caps them.

Ray's ``num_gpus=0.5`` puts two actors on one GPU but limits nothing: either can take the
whole card. Here a detector and a classifier each get ``num_gpus=0.5`` of a one-GPU cluster,
and ``@budgeted()`` gives each a budget of half the GPU, less 1 GiB for its process's CUDA
context. The classifier then asks for more than its half and is refused; the cluster report
shows both, on the GPU they share.

    pip install 'gpubudget[ray]'
    python examples/ray_two_models.py

On a machine without CUDA the GPU Ray declares is simulated in host memory: its size comes
from ``GPUBUDGET_DEVICE_MEMORY`` (8 GiB unless set). Without Ray, the example says so and
exits.
"""

from __future__ import annotations

import os

from gpubudget import current_budget, format_size
from gpubudget.ray import budgeted, cluster_report

GiB = 2**30


@budgeted()  # the budget's name: the actor's name; its limit: half the GPU less 1 GiB
class Model:
    def __init__(self, weights: int) -> None:
        budget = current_budget()  # the actor's budget, current in __init__ and every method
        assert budget is not None
        self.name = budget.name
        self.weights = budget.allocate(weights, tag=f"{self.name}/weights")

    def infer(self, activations: int) -> str:
        budget = current_budget()
        assert budget is not None
        block = budget.allocate(activations, tag=f"{self.name}/activations")
        if block is None:  # what TensorRT, CuPy or PyTorch would see: a refusal
            return (f"{self.name}: {format_size(activations)} of activations refused "
                    f"(over its {format_size(budget.limit)} cap)")
        budget.free(block)
        return f"{self.name}: ran with {format_size(activations)} of activations"


def main() -> None:
    try:
        import ray
    except ImportError:
        print("Ray is not installed, so no cluster can start here: pip install "
              "'gpubudget[ray]' and run this again. It puts two models on one GPU with "
              "num_gpus=0.5 each, which Ray alone does not limit, and caps each at half the "
              "GPU less 1 GiB.")
        return
    os.environ.setdefault("GPUBUDGET_DEVICE_MEMORY", "8GiB")  # read by the actors' processes
    # a cluster of its own (address="local"): without it, ray.init joins the cluster another
    # program on this machine started last, which refuses num_cpus and num_gpus
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=0, num_gpus=0.5)(Model)
        detector = actor.options(name="detector").remote(GiB)
        classifier = actor.options(name="classifier").remote(GiB // 2)
        print(ray.get(detector.infer.remote(GiB)))
        print(ray.get(classifier.infer.remote(3 * GiB)))
        print()
        print(cluster_report())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
