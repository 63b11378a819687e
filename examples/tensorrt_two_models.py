"""The motivating case made runnable: one TensorRT runtime, two models under sibling budgets.

With a full TensorRT and a GPU it can run engines on, it builds two small networks (a
detector and a classifier stand-in), deserializes each under its own budget of one shared
pool, runs them, and prints the report. Where TensorRT cannot build or run engines (no
TensorRT, no GPU, or TensorRT-RTX on a GPU it does not support), it says why and exits 0.

    python examples/tensorrt_two_models.py
"""

from __future__ import annotations

import sys
from typing import Any

from gpubudget import gpu_budget
from gpubudget import tensorrt as gbt


def build_plan(trt: Any, logger: Any, width: int) -> Any:
    """Serialize a tiny network: y = relu(x) on a (1, width) input."""
    with gpu_budget("512MiB", name=f"build-{width}"):
        builder = gbt.Builder(logger, trt_module=trt)
        network = builder.create_network(0)
        x = network.add_input("x", trt.float32, (1, width))
        relu = network.add_activation(x, trt.ActivationType.RELU)
        network.mark_output(relu.get_output(0))
        return builder.build_serialized_network(network, builder.create_builder_config())


def main() -> int:
    try:
        trt = gbt.load_module()
    except ImportError as exc:
        print(f"two_models: TensorRT is not installed, nothing to run ({exc})")
        return 0
    logger = trt.Logger(trt.Logger.ERROR)
    try:
        plans = [build_plan(trt, logger, 1024), build_plan(trt, logger, 4096)]
    except Exception as exc:  # noqa: BLE001 - no GPU, or no builder support here
        print(f"two_models: {trt.__name__} cannot build engines here ({type(exc).__name__}: {exc})")
        return 0
    if any(plan is None for plan in plans):
        print(f"two_models: {trt.__name__} could not build the networks on this machine")
        return 0
    with gpu_budget("1GiB", name="shared") as pool:
        runtime = gbt.Runtime(logger, trt_module=trt)
        engines = []
        for name, plan in zip(("detector", "classifier"), plans):
            with gpu_budget("256MiB", name=name):
                engine = runtime.deserialize_cuda_engine(plan)
                if engine is None:
                    print(f"two_models: {trt.__name__} refused to deserialize the {name} "
                          "engine on this machine (see its log above); nothing ran")
                    return 0
                engines.append((engine, engine.create_execution_context()))
        print(f"two_models: deserialized {len(engines)} engines with {trt.__name__}")
    print(pool.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
