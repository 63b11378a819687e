"""Every memory door of TensorRT inside one budget: an engine loaded through the budget's
allocator, weight streaming sized from the budget's room, a context whose activations and
scratch come from the budget, exactly sized for its shapes, and outputs whose size depends on
the data, allocated in the budget during the inference.

    python examples/tensorrt_full.py [model.plan]

Without a plan it builds a small one: y = relu(x @ W) for x of shape (batch, 256), batch 1 to
64, with streamable weights, and the indices where y is not zero (an output whose size only
the data decides). It needs TensorRT, a GPU TensorRT supports and PyCUDA (for the input and
the stream); where one is missing it says how far it got, and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpubudget import Budget, format_size, gpu_budget
from gpubudget import tensorrt as gbt


def build_plan(trt: Any) -> bytes | None:
    """The demo network, serialized; without its data-dependent output where this TensorRT
    cannot build one here (TensorRT-RTX without a GPU cannot)."""
    import numpy as np

    for data_dependent in (True, False):
        quiet = trt.Logger(trt.Logger.INTERNAL_ERROR if data_dependent else trt.Logger.ERROR)
        builder = trt.Builder(quiet)
        network = builder.create_network(
            1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        x = network.add_input("x", trt.float32, (-1, 256))
        weights = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
        w = network.add_constant((256, 256), trt.Weights(weights))
        product = network.add_matrix_multiply(x, trt.MatrixOperation.NONE, w.get_output(0),
                                              trt.MatrixOperation.NONE)
        y = network.add_activation(product.get_output(0), trt.ActivationType.RELU).get_output(0)
        y.name = "y"
        network.mark_output(y)
        if data_dependent:
            nonzero = network.add_non_zero(y).get_output(0)
            nonzero.name = "nonzero"
            network.mark_output(nonzero)
        config = builder.create_builder_config()
        config.set_flag(trt.BuilderFlag.WEIGHT_STREAMING)
        profile = builder.create_optimization_profile()
        profile.set_shape("x", (1, 256), (8, 256), (64, 256))
        config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, config)
        if plan is not None:
            if not data_dependent:
                print("full: this TensorRT cannot build NonZero here; the demo network has "
                      "no data-dependent output")
            return bytes(plan)
    return None


def infer(context: Any, outputs: Any, budget: Budget) -> None:
    """One inference on the GPU; PyCUDA copies the input and makes the stream."""
    import numpy as np
    import pycuda.driver as cuda

    cuda.init()
    primary = cuda.Device(budget.device or 0).retain_primary_context()  # TensorRT's context
    primary.push()
    try:
        x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
        address = budget.allocate(x.nbytes, 256, tag="input", raise_on_denial=True)
        cuda.memcpy_htod(address, x)
        context.set_tensor_address("x", address)
        stream = cuda.Stream()
        if not context.execute_async_v3(stream.handle):
            print("full: the inference failed (an output refused? see the report)")
        stream.synchronize()
        for name in ("y", "nonzero"):
            if outputs.address(name) is not None:
                print(f"full: output {name}: shape {outputs.shape(name)}, "
                      f"{format_size(outputs.nbytes(name) or 0)} in the budget")
        budget.free(address)
    finally:
        primary.pop()


def prepare(engine: Any, budget: Budget, trt: Any) -> tuple[Any, Any]:
    """Everything after deserialization, before the inference."""
    if engine.streamable_weights_size > 0:
        print(gbt.stream_weights(engine, budget).text())       # resident weights: the room left
    memory = gbt.ContextMemory(engine, budget=budget, trt_module=trt)  # activations, scratch
    context = memory.create_context()
    context.set_input_shape("x", (8, 256))
    print(f"context memory for batch 8: {format_size(memory.fit(context))}")  # exact
    outputs = gbt.output_allocator(context, budget=budget, trt_module=trt)  # grown in the budget
    return context, outputs


def main(argv: list[str]) -> int:
    try:
        trt = gbt.load_module()
    except ImportError as exc:
        print(f"full: TensorRT is not installed, nothing to run ({exc})")
        return 0
    plan = Path(argv[0]).read_bytes() if argv else build_plan(trt)
    if plan is None:
        print(f"full: {trt.__name__} cannot build the demo network here")
        return 0
    with gpu_budget("1GiB", name="model") as budget:
        print(gbt.plan_needs(plan, budget=budget, trt_module=trt).text())  # no GPU needed
        runtime = gbt.Runtime(trt.Logger(trt.Logger.ERROR), trt_module=trt)
        engine = runtime.deserialize_cuda_engine(plan)  # the first call that needs a GPU
        if engine is None:
            print(f"full: {trt.__name__} could not deserialize the engine here; stopping "
                  "before the first call that needs a GPU")
            return 0
        print(gbt.engine_needs(engine, budget=budget).text())  # exact, now
        context, outputs = prepare(engine, budget, trt)
        infer(context, outputs, budget)
        del context, outputs
    print(budget.report())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
