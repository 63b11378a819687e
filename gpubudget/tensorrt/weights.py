"""Weights against a budget: weight streaming sized from the budget's room, and TensorRT-RTX's
unload and load of an engine's weights.

Weight streaming. An engine built with ``BuilderFlag.WEIGHT_STREAMING`` keeps only part of its
streamable weights on the device (``weight_streaming_budget_v2`` bytes) and streams the rest
from host memory as it runs. TensorRT's own guess, ``get_weight_streaming_automatic_budget()``,
looks at the device's free memory and cannot see a budget, nor the other models in it.
:func:`stream_weights` sets the resident part from what the budget has left instead, after
setting aside the memory every context will need: ``device_memory_size_v2``, which (with the
``V2`` APIs) includes the scratch weight streaming needs, ``weight_streaming_scratch_memory_size``
— and which changes with the resident part, so the two are settled together.

TensorRT-RTX. An engine deserialized with ``Runtime.defer_weights_loading = True`` loads its
weights later (``load_weights(plan)``) and can give them back (``unload_weights()``), keeping
its contexts. :func:`unload_weights` and :func:`load_weights` do that with the budget in view:
the load is refused with a clear error, before TensorRT is called, when the budget has no room
for the weights. Beside a growable root's ``offload()``/``restore()``, which park every block
of the budget in host memory and bring it back to the same addresses: unloading frees the
budget's memory for other models at once and needs the plan to load again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..budget import Budget
from ..errors import BudgetError
from ..units import format_size, parse_size
from .lifetime import require_budget
from .module import module_of, require_api

__all__ = ["WeightStreaming", "load_weights", "room_of", "stream_weights", "unload_weights",
           "weights_size"]



@dataclass(frozen=True)
class WeightStreaming:
    """What :func:`stream_weights` set, in bytes."""

    streamable: int
    """Weights that can stream (``streamable_weights_size``)."""
    resident: int
    """Of them, kept on the device (``weight_streaming_budget_v2``, as set)."""
    context_memory: int
    """Each context's memory at that setting (``device_memory_size_v2``, scratch included)."""
    scratch: int
    """The weight-streaming scratch inside it (``weight_streaming_scratch_memory_size``)."""
    contexts: int
    room: int
    """What the budget had for weights and contexts (its ``available`` less ``keep``)."""
    automatic: int | None
    """TensorRT's own guess, for comparison (``None`` where the binding has none)."""

    def text(self) -> str:
        return (f"weight streaming: {format_size(self.resident)} of "
                f"{format_size(self.streamable)} streamable weights resident; "
                f"{self.contexts} context(s) of {format_size(self.context_memory)} "
                f"(scratch {format_size(self.scratch)}); room {format_size(self.room)}")


def stream_weights(engine: Any, budget: Budget | None = None, *, contexts: int = 1,
                   keep: int | str = 0) -> WeightStreaming:
    """Set ``engine.weight_streaming_budget_v2`` from ``budget``'s room (default: the current
    budget): as many streamable weights resident as fit beside ``contexts`` execution contexts
    and ``keep`` bytes left for anything else. Call it after deserializing and before making
    contexts (TensorRT takes a new setting only then). Raises ``ValueError`` for an engine
    without streamable weights, ``BudgetError`` (naming the budget and the sizes) when not even
    the contexts fit with every streamable weight streamed.

    The room is the budget's ``available`` now (for a growable root, no more than its device
    can still back; none while it is asleep): streamable weights the engine may already hold
    in the budget are not counted back, so the setting errs towards streaming more. All or
    nothing: on any error the engine's setting is left as it was.

    >>> plan = gbt.stream_weights(engine, contexts=2)   # doctest: +SKIP
    """
    target = require_budget(budget, "stream_weights()")
    require_api(engine, ("streamable_weights_size", "weight_streaming_budget_v2",
                         "device_memory_size_v2"), "stream_weights()")
    if isinstance(contexts, bool) or not isinstance(contexts, int) or contexts < 1:
        raise ValueError(f"contexts must be an int >= 1, got {contexts!r}")
    kept = parse_size(keep, what="keep") if keep else 0
    streamable = int(engine.streamable_weights_size)
    if streamable <= 0:
        raise ValueError("the engine has no streamable weights: build it with "
                         "BuilderFlag.WEIGHT_STREAMING (and a strongly typed network)")
    room = room_of(target, "stream_weights()") - kept
    original = engine.weight_streaming_budget_v2
    try:
        return _settle(engine, target, streamable, contexts, room)
    except BaseException:
        engine.weight_streaming_budget_v2 = original  # all or nothing
        raise


def _settle(engine: Any, target: Budget, streamable: int, contexts: int,
            room: int) -> WeightStreaming:
    """Set the most resident weights that fit ``room`` beside ``contexts`` contexts."""
    granule = max(target.align, 256)  # a context's region is charged rounded up to it

    def fits(resident: int) -> int | None:
        """Set ``resident``; each context's memory then, if it all fits in the room."""
        engine.weight_streaming_budget_v2 = resident
        per_context = int(engine.device_memory_size_v2)
        charged = -(-per_context // granule) * granule
        return per_context if resident + contexts * charged <= room else None

    # the most that could fit: every weight resident makes the contexts' memory the least
    # (their scratch grows as fewer weights stay), whatever the engine was set to before;
    # then the largest that does fit, by bisection, to within 1/1024 of the streamable weights
    if fits(streamable) is not None:
        high = streamable
    else:
        least = int(engine.device_memory_size_v2)
        high = max(min(streamable, room - contexts * least), 0)
        if fits(high) is None:
            if fits(0) is None:
                raise BudgetError(
                    f"budget {target.name!r} has {format_size(max(room, 0))} for weights and "
                    f"{contexts} context(s); even with every streamable weight streamed the "
                    f"contexts need {format_size(contexts * int(engine.device_memory_size_v2))}")
            low, tolerance = 0, max(streamable >> 10, 1)
            while high - low > tolerance:
                middle = (low + high) // 2
                if fits(middle) is None:
                    high = middle
                else:
                    low = middle
            high = low
    settled = fits(high)
    assert settled is not None
    return WeightStreaming(streamable, high, settled,
                           int(engine.weight_streaming_scratch_memory_size), contexts, room,
                           _automatic(engine))


def room_of(budget: Budget, what: str) -> int:
    """What ``budget`` can still give: its ``available``, and for a growable root no more
    than its device can still back (the device's free memory and what the root has mapped
    but no block uses). ``BudgetError`` while the budget's root is asleep (offloaded)."""
    root = budget.root
    report = root.report()
    if report.asleep is not None:
        raise BudgetError(f"{what}: budget {budget.name!r} is asleep (its root {root.name!r} "
                          "was offloaded): restore() it first")
    room = budget.available
    backend = root.backend
    if report.mapped is not None and backend is not None:
        info = backend.mem_info()
        if info is not None:
            room = min(room, info[0] + max(report.mapped - root.used, 0))
    return room


def _automatic(engine: Any) -> int | None:
    guess = getattr(engine, "get_weight_streaming_automatic_budget", None)
    try:
        return int(guess()) if guess is not None else None
    except Exception:  # noqa: BLE001 - for the report only
        return None


def unload_weights(engine: Any, budget: Budget | None = None) -> int:
    """TensorRT-RTX: give the engine's weights back (``unload_weights()``); the bytes the
    budget got back (0 when the engine's allocator is not one of the budget's). Nothing may
    run on the engine's contexts meanwhile. Raises ``RuntimeError`` when TensorRT refuses
    (weights not loaded, or an engine not deserialized with deferred loading)."""
    target = require_budget(budget, "unload_weights()")
    _require(engine, "unload_weights")
    before = target.used
    if not engine.unload_weights():
        raise RuntimeError("TensorRT refused to unload the weights (are they loaded, and was "
                           "the engine deserialized with Runtime.defer_weights_loading?)")
    return max(before - target.used, 0)


def load_weights(engine: Any, plan: Any, budget: Budget | None = None) -> int:
    """TensorRT-RTX: load the engine's weights from ``plan`` (the serialized engine it came
    from); the bytes charged. Refused before TensorRT is called, with ``BudgetError`` naming
    the budget, when the budget's room is less than the engine's weights
    (``get_engine_stat(TOTAL_WEIGHTS_SIZE)``, where the binding has it)."""
    target = require_budget(budget, "load_weights()")
    _require(engine, "load_weights")
    if getattr(engine, "weights_loaded", False) is True:
        raise RuntimeError("the engine's weights are already loaded")
    need = weights_size(engine)
    room = room_of(target, "load_weights()")
    if need is not None and need > room:
        raise BudgetError(f"budget {target.name!r} has {format_size(room)} "
                          f"available; the engine's weights need {format_size(need)}")
    before = target.used
    if not engine.load_weights(plan):
        raise RuntimeError("TensorRT refused to load the weights (already loaded, not "
                           "deserialized with deferred loading, another plan, or no room: "
                           "see the budget's report and TensorRT's log)")
    return max(target.used - before, 0)


def weights_size(engine: Any) -> int | None:
    """The engine's device weights in bytes, where the binding says
    (``get_engine_stat(EngineStat.TOTAL_WEIGHTS_SIZE)``); else ``None``."""
    stat = getattr(engine, "get_engine_stat", None)
    if stat is None:
        return None
    try:
        kind = module_of(engine).EngineStat.TOTAL_WEIGHTS_SIZE
    except Exception:  # noqa: BLE001 - the binding's default is the total
        kind = None
    try:
        value = int(stat(kind) if kind is not None else stat())
    except Exception:  # noqa: BLE001 - not known
        return None
    return value if value >= 0 else None


def _require(engine: Any, method: str) -> None:
    if not callable(getattr(engine, method, None)):
        raise TypeError(f"{type(engine).__name__} has no {method}(): that is TensorRT-RTX's "
                        "(an engine deserialized with Runtime.defer_weights_loading = True)")
