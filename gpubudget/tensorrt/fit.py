"""Will it fit? What a TensorRT engine needs, against a budget's room, before loading it.

From a serialized engine (a plan) alone, without a GPU: its size — an upper bound of the
weights it will put on the device (the plan holds them, plus kernels and tables), except for a
weight-stripped plan (``BuilderFlag.STRIP_PLAN``), whose weights come later by a refit — and,
where
the TensorRT module can read plan headers (``Runtime.get_engine_validity``), whether it is a
plan of that TensorRT at all. Everything else needs the engine deserialized, which needs a GPU:
the exact weights (``get_engine_stat(TOTAL_WEIGHTS_SIZE)``), each optimization profile's
execution-context memory (``get_device_memory_size_for_profile_v2``), the largest
(``device_memory_size_v2``) and the streamable weights (``streamable_weights_size``).
:func:`plan_needs` deserializes only when asked (``deserialize=True``): TensorRT-RTX then
defers the weights (``Runtime.defer_weights_loading``), so nothing but small tables is
allocated; full TensorRT allocates the weights and frees them again.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from typing import Any, Final

from ..budget import Budget
from ..units import format_size
from .lifetime import keep_if_unusable
from .module import load_module, require_api
from .weights import room_of, weights_size

__all__ = ["EngineNeeds", "PlanError", "engine_needs", "plan_needs"]

HEAD: Final = 1 << 16
"""The bytes of a plan file read to check its header (TensorRT's are 64 bytes)."""
NEEDS_GPU: Final = ("weights", "context_memory", "streamable_weights")
"""The numbers only a deserialized engine gives (deserializing needs a GPU)."""
_BAD_PLAN: Final = ("VERSION_MISMATCH", "MALFORMED_ENGINE")


class PlanError(ValueError):
    """A file or buffer that is not a plan this TensorRT can read; the message says why."""


@dataclass(frozen=True)
class EngineNeeds:
    """What an engine needs on the device, in bytes; ``None`` where not known (see
    ``unknown``). ``context_memory`` is per optimization profile.

    Examples
    --------
    >>> from gpubudget.tensorrt import EngineNeeds
    >>> plan_only = EngineNeeds(plan_bytes=300 << 20, weights=None, context_memory=None,
    ...                         context_memory_max=None, streamable_weights=None, contexts=1,
    ...                         room=4 << 30, module="tensorrt")
    >>> plan_only.weights_bound == 300 << 20, plan_only.fits   # context memory needs a GPU
    (True, None)
    >>> exact = EngineNeeds(300 << 20, 280 << 20, (512 << 20,), 512 << 20, 0, 2, 1 << 30, None)
    >>> exact.lower == exact.upper == (280 + 2 * 512) << 20, exact.fits
    (True, False)
    """

    plan_bytes: int | None
    weights: int | None
    context_memory: tuple[int, ...] | None
    context_memory_max: int | None
    streamable_weights: int | None
    contexts: int
    room: int | None
    module: str | None
    unknown: str | None = None
    """Why the numbers of a deserialized engine are missing, if they are."""
    checked: tuple[str, ...] = ()
    """What was checked, in order: ``"plan size"`` (the bytes of the plan, always, for a
    plan), ``"header size"`` (the plan is at least as long as the module's
    ``engine_header_size``), ``"header"`` (the module's ``get_engine_validity`` accepted the
    header: TensorRT-RTX; no TensorRT 10 or 11 binding has it), ``"deserialized"`` (the
    numbers are the engine's own)."""

    @property
    def weights_bound(self) -> int | None:
        """The exact weights, else the plan's size (an upper bound, unless the plan was
        built weight-stripped: its weights are not in it)."""
        return self.weights if self.weights is not None else self.plan_bytes

    @property
    def upper(self) -> int | None:
        """An upper bound of what weights and ``contexts`` contexts need, if known (the
        CUDA context, kernels and TensorRT's own small tables are outside every budget and
        not counted)."""
        if self.weights_bound is None or self.context_memory_max is None:
            return None
        return self.weights_bound + self.contexts * self.context_memory_max

    @property
    def lower(self) -> int:
        """What is certainly needed (exact numbers only)."""
        return (self.weights or 0) + self.contexts * (self.context_memory_max or 0)

    @property
    def fits(self) -> bool | None:
        """``True``/``False`` against ``room`` when the numbers decide it, else ``None``."""
        if self.room is None:
            return None
        if self.upper is not None and self.upper <= self.room:
            return True
        if self.lower > self.room:
            return False
        return None

    def as_dict(self) -> dict[str, Any]:
        found = asdict(self)
        found["context_memory"] = list(self.context_memory or []) or None
        found.update(upper=self.upper, fits=self.fits)
        return found

    def text(self) -> str:
        """The report as aligned lines."""
        gpu = "needs a GPU (TensorRT deserializes the plan to know it)"

        def size(value: int | None) -> str:
            return format_size(value) if value is not None else gpu

        rows = []
        if self.plan_bytes is not None:
            rows.append(("plan", f"{format_size(self.plan_bytes)} (weights on the device: "
                                 f"at most this, unless the plan is weight-stripped)"))
        rows.append(("weights", size(self.weights)))
        if self.context_memory is not None:
            for index, nbytes in enumerate(self.context_memory):
                rows.append((f"context, profile {index}", format_size(nbytes)))
        rows.append(("context (largest)", size(self.context_memory_max)))
        rows.append(("streamable weights", size(self.streamable_weights)))
        if self.room is not None:
            rows.append(("room", format_size(self.room)))
            need = (f"{format_size(self.upper)} at most" if self.upper is not None
                    else f"at least {format_size(self.lower)}" if self.lower
                    else "not known here")
            rows.append((f"need ({self.contexts} context(s))", need))
            verdict = {True: "fits", False: "does not fit",
                       None: "cannot tell without the numbers that need a GPU"}[self.fits]
            rows.append(("verdict", verdict))
        if self.checked:
            rows.append(("checked", ", ".join(self.checked)))
        if self.unknown:
            rows.append(("why unknown", self.unknown))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def engine_needs(engine: Any, *, budget: Budget | None = None, room: int | None = None,
                 contexts: int = 1, plan_bytes: int | None = None) -> EngineNeeds:
    """The exact numbers of a deserialized ``engine`` against ``room`` (default: the
    budget's ``available``, if a budget is given).

    >>> print(gbt.engine_needs(engine, budget=pool).text())   # doctest: +SKIP
    """
    require_api(engine, ("num_optimization_profiles", "device_memory_size_v2",
                         "get_device_memory_size_for_profile_v2"), "engine_needs()")
    profiles = int(engine.num_optimization_profiles)
    per_profile = tuple(int(engine.get_device_memory_size_for_profile_v2(p))
                        for p in range(profiles))
    streamable = getattr(engine, "streamable_weights_size", None)
    return EngineNeeds(plan_bytes, weights_size(engine), per_profile,
                       int(engine.device_memory_size_v2),
                       int(streamable) if streamable is not None else None,
                       _contexts(contexts), _room(budget, room), type(engine).__module__,
                       checked=("deserialized",) if plan_bytes is None else
                       ("plan size", "deserialized"))


def plan_needs(plan: bytes | bytearray | memoryview | str | os.PathLike[str], *,
               budget: Budget | None = None, room: int | None = None, contexts: int = 1,
               trt_module: Any = None, deserialize: bool = False) -> EngineNeeds:
    """What the serialized engine ``plan`` (its bytes, or a file's path) needs, against
    ``room`` (default: ``budget.available`` if a budget is given). Without ``deserialize``
    no GPU is touched: the plan's size bounds the weights, and the TensorRT module (if one can
    be imported) checks the header. Raises :class:`PlanError` for a plan TensorRT calls
    malformed or of another version, ``OSError`` for a file that cannot be read.

    >>> print(gbt.plan_needs("model.plan", room=4 << 30).text())   # doctest: +SKIP
    """
    size, head = _read(plan, whole=False)
    try:
        module = load_module(trt_module)
    except ImportError:
        if trt_module is not None:  # named, so wanted: not silently none
            raise
        module = None
    if not size:
        raise PlanError("the plan is empty")
    known = EngineNeeds(size, None, None, None, None, _contexts(contexts),
                        _room(budget, room), getattr(module, "__name__", None),
                        "no TensorRT module can be imported here" if module is None else
                        "not deserialized: the numbers that need a GPU were not asked for",
                        ("plan size",))
    if module is None:
        return known
    header_api = [name for name in ("engine_header_size", "get_engine_validity")
                  if hasattr(module.Runtime, name)]
    if not deserialize and not header_api:  # nothing TensorRT could check without a GPU
        return known
    logger = _quiet_logger(module)
    runtime = module.Runtime(logger)
    broken = keep_if_unusable(runtime)  # never touched, never destroyed
    if broken is not None:
        said = [m for _, m in logger.messages if "CUDA" in m][:1]
        return _replace(known, unknown="TensorRT could not initialise CUDA here (no GPU or "
                        f"no CUDA driver it can use): {'; '.join(said) or broken}")
    checked = _check_header(module, runtime, head, size)
    known = _replace(known, checked=known.checked + checked)
    if not deserialize:
        return known
    if hasattr(runtime, "defer_weights_loading"):
        runtime.defer_weights_loading = True  # TensorRT-RTX: no weights on the device
    _, data = _read(plan, whole=True)  # all of it only now: the header is a plan's
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        errors = [m for severity, m in logger.messages if int(severity) <= 1]
        return _replace(known, unknown="TensorRT could not deserialize it here: "
                        + (errors[-1] if errors else "see its log"))
    exact = engine_needs(engine, room=known.room, contexts=contexts, plan_bytes=len(data))
    return _replace(exact, module=module.__name__, checked=(*known.checked, "deserialized"))


def _replace(needs: EngineNeeds, **changes: Any) -> EngineNeeds:
    return EngineNeeds(**{**asdict(needs), "context_memory": needs.context_memory, **changes})


def _read(plan: object, *, whole: bool) -> tuple[int, bytes]:
    """The plan's size in bytes and its bytes: all of them when ``whole``, else (for a file)
    only its first :data:`HEAD` bytes, enough for the header: a plan of many gigabytes is
    sized without being read."""
    if isinstance(plan, (bytes, bytearray, memoryview)):
        data = bytes(plan)
        return len(data), data
    if not isinstance(plan, (str, os.PathLike)):
        raise TypeError(f"plan must be bytes or a path, got {type(plan).__name__}")
    # opened without waiting (a pipe with no writer), then looked at: what is checked is
    # what is read
    fd = os.open(plan, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise PlanError("a directory, not a plan file")
        if not stat.S_ISREG(info.st_mode):
            raise PlanError("not a regular file")  # a pipe or a device: never wait on it
        with open(fd, "rb", closefd=False) as file:
            return info.st_size, file.read() if whole else file.read(HEAD)
    finally:
        os.close(fd)


def _check_header(module: Any, runtime: Any, head: bytes, size: int) -> tuple[str, ...]:
    """Raise :class:`PlanError` unless ``head``, the first bytes of a plan of ``size`` bytes,
    is a header that ``module`` accepts (where it can tell); return what was checked."""
    checked: tuple[str, ...] = ()
    header = getattr(runtime, "engine_header_size", None)
    if isinstance(header, int):
        if size < header:
            raise PlanError(f"the plan is {size} bytes, shorter than a {module.__name__} "
                            f"plan's header ({header} bytes)")
        checked = ("header size",)
    check = getattr(runtime, "get_engine_validity", None)
    diagnostics = getattr(module, "EngineInvalidityDiagnostics", None)
    if check is None or diagnostics is None:
        return checked
    _, found = check(head)
    bad = [name for name in _BAD_PLAN
           if int(found) & int(getattr(diagnostics, name, 0))]
    if bad:
        version = getattr(module, "__version__", None)
        raise PlanError(f"not a plan of this {module.__name__} "
                        f"({version if isinstance(version, str) else 'version unknown'}): "
                        f"{' and '.join(n.lower().replace('_', ' ') for n in bad)}")
    return (*checked, "header")


def _quiet_logger(module: Any) -> Any:
    """A TensorRT logger that keeps its messages instead of printing them."""

    class Quiet(module.ILogger):  # type: ignore[misc]
        def __init__(self) -> None:
            module.ILogger.__init__(self)
            self.messages: list[tuple[Any, str]] = []

        def log(self, severity: Any, msg: str) -> None:
            self.messages.append((severity, msg))

    return Quiet()


def _contexts(contexts: int) -> int:
    if isinstance(contexts, bool) or not isinstance(contexts, int) or contexts < 1:
        raise ValueError(f"contexts must be an int >= 1, got {contexts!r}")
    return contexts


def _room(budget: Budget | None, room: int | None) -> int | None:
    if room is not None:
        if isinstance(room, bool) or not isinstance(room, int) or room < 0:
            raise ValueError(f"room must be a number of bytes >= 0, got {room!r}")
        return room
    return room_of(budget, "the room") if budget is not None else None
