"""Stand-ins for TensorRT engines and execution contexts (no engine can run here: no GPU, and
TensorRT-RTX refuses the GPU that exists). Fakes, not NVIDIA's code: they have the real
classes' method names (``tests/test_tensorrt_fakes.py`` checks each against TensorRT-RTX's
``ICudaEngine`` and ``IExecutionContext``) and model what the sizing logic relies on:

- a context's memory need grows with the batch of its input (``update_device_memory_size_for_
  shapes``), and it checks, at every "inference", that the memory it was given is still a live
  block of the budget, large enough;
- scratch is asked of ``temporary_allocator`` and data-dependent outputs of the output
  allocator, both through NVIDIA's C++ trampolines (``tests/trampoline.py``), as TensorRT's
  ``execute_async_v3`` would;
- weight streaming: the context memory includes a scratch that grows as fewer weights stay
  resident.
"""

from __future__ import annotations

from typing import Any

from gpubudget import Budget
from tests.trampoline import OutputTrampoline, Trampoline

KiB = 1024


class FakeEngine:
    """An ``ICudaEngine``: one input ``x`` (batch, 16) and one data-dependent output ``y``."""

    def __init__(self, trt: Any, *, per_batch: int = 4 * KiB, max_batch: int = 16,
                 profiles: int = 1, streamable: int = 0, weights: int = 64 * KiB,
                 name: str = "fake", allocator: Trampoline | None = None) -> None:
        self.trt = trt
        self.name = name
        self.per_batch = per_batch
        self.max_batch = max_batch
        self.num_optimization_profiles = profiles
        self.streamable_weights_size = streamable
        self._resident = streamable  # weight_streaming_budget_v2: everything resident
        self.weights = weights
        self.allocator = allocator  # the runtime's, through NVIDIA's trampoline
        self.weights_at: int | None = None
        self.weights_loaded = False
        self.load_weights(b"plan")
        self.live_contexts = 0
        self.strategies: list[Any] = []
        self.num_io_tensors = 2

    # -- sizes -------------------------------------------------------------------------
    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int:
        if not 0 <= profile_index < self.num_optimization_profiles:
            raise IndexError(profile_index)
        return self.per_batch * self.max_batch // (profile_index + 1)

    @property
    def device_memory_size_v2(self) -> int:
        return self.per_batch * self.max_batch + self.weight_streaming_scratch_memory_size

    @property
    def weight_streaming_scratch_memory_size(self) -> int:
        streamed = self.streamable_weights_size - self._resident
        return 0 if streamed <= 0 else 8 * KiB + streamed // 8

    @property
    def weight_streaming_budget_v2(self) -> int:
        return self._resident

    @weight_streaming_budget_v2.setter
    def weight_streaming_budget_v2(self, value: int) -> None:
        if self.live_contexts:
            raise RuntimeError("the budget can change only while no context exists")
        if not 0 <= value <= self.streamable_weights_size:
            raise ValueError(value)
        self._resident = value

    def get_weight_streaming_automatic_budget(self) -> int:
        return self.streamable_weights_size // 2

    def get_engine_stat(self, stat: Any = None) -> int:
        assert stat is None or stat == self.trt.EngineStat.TOTAL_WEIGHTS_SIZE
        return self.weights

    # -- tensors -------------------------------------------------------------------------
    def get_tensor_name(self, index: int) -> str:
        return ("x", "y")[index]

    def get_tensor_mode(self, name: str) -> Any:
        mode = self.trt.TensorIOMode
        return {"x": mode.INPUT, "y": mode.OUTPUT}[name]

    # -- contexts, weights -----------------------------------------------------------------
    def create_execution_context(self, strategy: Any = None) -> FakeContext:
        self.strategies.append(strategy)
        return FakeContext(self)

    def unload_weights(self) -> bool:
        if not self.weights_loaded:
            return False
        if self.allocator is not None and self.weights_at is not None:
            assert self.allocator.deallocate(self.weights_at)
        self.weights_at = None
        self.weights_loaded = False
        return True

    def load_weights(self, blob: Any) -> bool:
        if self.weights_loaded:
            return False
        if self.allocator is not None:
            self.weights_at = self.allocator.allocate(self.weights, 256, 0)
            if self.weights_at is None:
                return False
        self.weights_loaded = True
        return True


class FakeContext:
    """An ``IExecutionContext`` of a :class:`FakeEngine`."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.memory: tuple[int, int] | None = None
        self.batch = engine.max_batch
        self.temporary_allocator: Any = None
        self.output_allocators: dict[str, Any] = {}
        engine.live_contexts += 1

    def __del__(self) -> None:
        self.engine.live_contexts -= 1

    def set_device_memory(self, memory: int, size: int) -> None:
        if memory % 256:
            raise ValueError("memory must be 256-byte aligned")
        self.memory = (memory, size)

    @property
    def device_memory(self) -> int:
        return self.memory[0] if self.memory else 0

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        if name != "x" or len(shape) != 2 or not 1 <= shape[0] <= self.engine.max_batch:
            return False
        self.batch = shape[0]
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (self.batch, 16) if name == "x" else (-1,)

    def update_device_memory_size_for_shapes(self) -> int:
        return self.engine.per_batch * self.batch + self.engine.weight_streaming_scratch_memory_size

    def set_output_allocator(self, name: str, output_allocator: Any) -> bool:
        if name != "y":
            return False
        self.output_allocators[name] = output_allocator
        return True

    def get_output_allocator(self, name: str) -> Any:
        return self.output_allocators.get(name)

    def execute_async_v3(self, stream_handle: int, *, found: int = 3, budget: Budget,
                         trt: Any) -> bool:
        """One inference, as far as memory goes: the context memory must be a live block
        of ``budget`` big enough for the shapes; scratch is taken and given back through the
        temporary allocator's trampoline; output ``y`` of ``found`` elements (the data decides
        it) is asked of its output allocator's trampoline and its shape notified."""
        need = self.update_device_memory_size_for_shapes()
        assert self.memory is not None, "no device memory set"
        address, size = self.memory
        assert size >= need and budget.root.size_of(address) >= need, (self.memory, need)
        if self.temporary_allocator is not None:
            scratch = Trampoline(self.temporary_allocator)
            block = scratch.allocate_async(2 * KiB, 256, 0, stream_handle)
            if block is None:
                return False
            assert scratch.deallocate_async(block, stream_handle)
        allocator = self.output_allocators.get("y")
        if allocator is not None:
            side = OutputTrampoline(allocator, trt.IOutputAllocator)
            current = allocator.address("y") or 0
            buffer = side.reallocate_output_async("y", current, max(found, 1) * 8, 256,
                                                  stream_handle)
            if buffer is None:
                return False
            side.notify_shape("y", (found,))
        return True


def real_plan(trt: Any) -> bytes:
    """A real serialized engine, built here by TensorRT-RTX's builder (which builds without a
    GPU): y = relu(x @ W) for x of shape (1..16, 64), weights streamable. Deserializing it
    needs a GPU TensorRT-RTX supports, which no test machine here has."""
    import numpy as np

    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(
        1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    x = network.add_input("x", trt.float32, (-1, 64))
    weights = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096
    constant = network.add_constant((64, 64), trt.Weights(weights))
    product = network.add_matrix_multiply(x, trt.MatrixOperation.NONE, constant.get_output(0),
                                          trt.MatrixOperation.NONE)
    relu = network.add_activation(product.get_output(0), trt.ActivationType.RELU)
    relu.get_output(0).name = "y"
    network.mark_output(relu.get_output(0))
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.WEIGHT_STREAMING)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 64), (4, 64), (16, 64))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "TensorRT-RTX could not build the test network"
    return bytes(plan)
