"""``budgeted``: a Ray actor class whose instance lives inside a GPU budget.

The decorator returns a subclass of the user's class with the same name. Its ``__init__``
works out the GPU Ray gave the actor (:mod:`gpubudget.ray.placement`), enters a root budget
there in a context of its own (so the budget stays open for the actor's life without being
tied to one thread), runs the user's ``__init__`` with that budget current, and registers the
actor (:mod:`gpubudget.ray.reporter`). Every method -- plain, ``async``, generator, async
generator -- runs with the budget current (:mod:`gpubudget.ray.methods`), whichever thread or
task Ray (or Ray Serve) calls it from. Methods keep their names, signatures, kinds and Ray
options (``@ray.method(...)``), so Ray sees the class as it was.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar, overload

from ..budget import Budget, gpu_budget
from ..errors import BudgetError
from ..scope import use
from ..units import DEFAULT_ALIGN, check_align, parse_size
from .placement import (
    DEFAULT_MARGIN,
    Placement,
    PlacementError,
    cuda_ordinal,
    derived_limit,
    gpu_share,
    open_device,
)
from .methods import SCOPE_ATTRIBUTE, ActorScope, actor_methods, closing, with_budget
from .report import ActorInfo
from .reporter import REGISTER_SECONDS, Reporter

__all__ = ["ActorSpec", "actor_budget", "actor_reporter", "budgeted"]

C = TypeVar("C", bound=type)
_SPEC_ATTR: Final = "__gpubudget_spec__"
_reporter: Reporter | None = None
"""The reporter of the budgeted actor in this process (Ray runs one actor per process)."""


@dataclass(frozen=True)
class ActorSpec:
    """What ``budgeted(...)`` was given, checked."""

    limit: int | None
    name: str | None
    align: int
    margin: int
    trace: str | None
    track_stacks: bool


@overload
def budgeted(limit: C) -> C: ...
@overload
def budgeted(limit: int | str | None = None, *, name: str | None = None,
             align: int = DEFAULT_ALIGN, margin: int | str = DEFAULT_MARGIN,
             trace: str | os.PathLike[str] | None = None,
             track_stacks: bool = False) -> Callable[[C], C]: ...


def budgeted(limit: Any = None, *, name: str | None = None, align: int = DEFAULT_ALIGN,
             margin: int | str = DEFAULT_MARGIN, trace: str | os.PathLike[str] | None = None,
             track_stacks: bool = False) -> Any:
    """Run a Ray actor class (or Ray Serve deployment) inside a GPU budget.

    Put it directly above ``class``, below ``@ray.remote(num_gpus=...)`` or
    ``@serve.deployment(ray_actor_options={"num_gpus": ...})``. In the actor's process,
    ``__init__`` runs inside a root budget on the GPU Ray assigned, and every method (plain,
    ``async``, generator, async generator) runs with that budget current, so TensorRT
    objects made through :mod:`gpubudget.tensorrt`, :func:`gpubudget.current_budget` and
    anything else that asks for the current budget draw from it.

    Parameters
    ----------
    limit
        The budget's limit (``"6GiB"``, bytes). Default: the actor's share of the GPU
        (``num_gpus``) times the GPU's memory, less ``margin``, rounded down to a MiB.
    name
        The budget's name; default the Serve deployment's name, else the actor's name
        (``.options(name=...)``), else the class name.
    align
        As for :func:`gpubudget.gpu_budget`.
    margin
        Left out of the default limit for the process's CUDA context and for libraries
        that allocate outside budgets; default 1 GiB. Ignored when ``limit`` is given.
    trace
        A directory: the actor's root budget writes its trace there, one file per actor,
        ``<app>.<deployment>.<replica>.jsonl`` for a Serve replica, else
        ``<actor name or class>.<actor id>.jsonl``.
    track_stacks
        As for :func:`gpubudget.gpu_budget`.

    Where Ray's GPUs are logical (no CUDA device in the process), the GPU is simulated in
    host memory of ``GPUBUDGET_DEVICE_MEMORY`` bytes (e.g. ``8GiB``). The actor must have
    ``0 < num_gpus <= 1``; otherwise, or if the limit cannot be reserved, its ``__init__``
    raises (:class:`~gpubudget.ray.PlacementError`, :class:`~gpubudget.BudgetError`) and Ray
    reports the actor's creation as failed, with that message.

    Examples
    --------
    >>> import ray                                                    # doctest: +SKIP
    >>> import gpubudget
    >>> from gpubudget.ray import budgeted
    >>> @ray.remote(num_gpus=0.5)                                     # doctest: +SKIP
    ... @budgeted()
    ... class Detector:
    ...     def __init__(self, plan: bytes):
    ...         self.engine = load_engine(plan)              # charged to the actor's budget
    ...     def limit(self) -> int:
    ...         return gpubudget.current_budget().limit
    >>> detector = Detector.remote(plan)                              # doctest: +SKIP
    >>> ray.get(detector.limit.remote()) / 2**30                      # doctest: +SKIP
    39.0
    """
    if isinstance(limit, type):
        return _decorate(limit, _spec(None, name, align, margin, trace, track_stacks))
    spec = _spec(limit, name, align, margin, trace, track_stacks)

    def decorate(cls: C) -> C:
        return _decorate(cls, spec)

    return decorate


def actor_budget() -> Budget | None:
    """The budget of the budgeted actor running in this process, if any (for threads the
    actor starts itself: ``with gpubudget.use(actor_budget()):``)."""
    return _reporter.budget if _reporter is not None else None


def _remember(reporter: Reporter) -> None:
    # A function of this module, not an assignment in __init__: Ray may ship that __init__
    # by value (it carries the user's module name), with a copy of this module's globals.
    global _reporter
    _reporter = reporter


def actor_reporter() -> Reporter | None:
    """The registry link of the budgeted actor in this process, if any."""
    return _reporter


def _spec(limit: int | str | None, name: str | None, align: int, margin: int | str,
          trace: str | os.PathLike[str] | None, track_stacks: bool) -> ActorSpec:
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TypeError(f"budgeted(name=...) must be a non-empty string, got {name!r}")
    if trace is not None and not isinstance(trace, (str, os.PathLike)):
        raise TypeError(f"budgeted(trace=...) must be a directory path, got {trace!r}")
    if not isinstance(track_stacks, bool):
        raise TypeError(f"budgeted(track_stacks=...) must be a bool, got {track_stacks!r}")
    margin_bytes = 0 if margin == 0 else parse_size(margin, what="margin")
    return ActorSpec(
        limit=None if limit is None else parse_size(limit, what="limit"),
        name=name, align=check_align(align, "align"), margin=margin_bytes,
        trace=None if trace is None else os.fspath(trace), track_stacks=track_stacks)


# -- the class ---------------------------------------------------------------------------


def _decorate(cls: C, spec: ActorSpec) -> C:
    if not isinstance(cls, type):
        raise TypeError(
            f"budgeted() decorates a class, got {cls!r}; put @budgeted(...) directly above "
            f"'class', below @ray.remote(...) or @serve.deployment(...)")
    if getattr(cls, _SPEC_ATTR, None) is not None:
        raise TypeError(f"class {cls.__qualname__} is already budgeted")
    namespace: dict[str, Any] = {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        _SPEC_ATTR: spec, "__init__": _budgeted_init(vars_init(cls), cls.__name__, spec),
        "__ray_shutdown__": closing("__ray_shutdown__", getattr(cls, "__ray_shutdown__", None)),
        "__del__": closing("__del__", getattr(cls, "__del__", None))}
    for name, method in actor_methods(cls).items():
        namespace[name] = with_budget(method)
    made: C = type(cls)(cls.__name__, (cls,), namespace)
    return made


def vars_init(cls: type) -> Callable[..., None]:
    """``cls.__init__`` as found on the class (not bound to anything)."""
    init: Callable[..., None] = getattr(cls, "__init__")  # noqa: B009 - mypy: unsound access
    return init


def _budgeted_init(init: Callable[..., None], class_name: str, spec: ActorSpec
                   ) -> Callable[..., None]:
    def __init__(self: object, *args: Any, **kwargs: Any) -> None:
        budget, info, context = _open_budget(class_name, spec)
        scope = vars(self)[SCOPE_ATTRIBUTE] = ActorScope(budget, context)
        try:
            with use(budget):
                init(self, *args, **kwargs)
        except BaseException:
            scope.close()  # the actor will not exist
            raise
        reporter = Reporter(info, budget)
        reporter.register(create=True, timeout=REGISTER_SECONDS)
        reporter.start()
        _remember(reporter)

    if inspect.isfunction(init):  # not object.__init__, which has no signature to copy
        functools.update_wrapper(__init__, init)
    return __init__


def _open_budget(class_name: str, spec: ActorSpec
                 ) -> tuple[Budget, ActorInfo, contextvars.Context]:
    """Enter the actor's root budget, in a context of its own (it stays open for the
    process's life); return it, the actor's description, and that context."""
    import ray

    runtime = ray.get_runtime_context()
    actor_id = runtime.get_actor_id()
    if actor_id is None:
        raise PlacementError(
            f"{class_name} is a budgeted Ray actor class: create it with "
            f"{class_name}.remote(...) under @ray.remote(num_gpus=...), or as a Serve "
            f"deployment; created directly it has no GPU from Ray")
    serve = _serve_replica()
    who = (f"Serve replica {serve[0]}/{serve[1]} {serve[2]}" if serve is not None
           else f"Ray actor {class_name} ({actor_id[:12]})")
    placement = _place(runtime, who)
    limit = spec.limit if spec.limit is not None else derived_limit(
        placement.share, placement.device_memory, spec.margin, who)
    actor_name = runtime.get_actor_name() or None
    name = spec.name or (serve[1] if serve is not None else actor_name or class_name)
    info = ActorInfo(
        actor_id=actor_id, class_name=class_name, actor_name=actor_name,
        application=serve[0] if serve else None, deployment=serve[1] if serve else None,
        replica=serve[2] if serve else None, node_id=placement.node_id,
        node_ip=placement.node_ip, gpu_id=placement.gpu_id, ordinal=placement.ordinal,
        share=placement.share, device_memory=placement.device_memory,
        simulated=placement.simulated, limit=limit, pid=os.getpid(), trace=None)
    trace = None if spec.trace is None else _trace_file(spec.trace, info, who)
    if trace is not None:
        info = dataclasses.replace(info, trace=trace)
    budget = gpu_budget(limit, align=spec.align, name=name, backend=placement.backend,
                        device=None if placement.simulated else placement.ordinal,
                        track_stacks=spec.track_stacks, trace=trace)
    context = contextvars.Context()
    try:
        context.run(budget.__enter__)
    except BudgetError as exc:
        raise BudgetError(f"{who} on GPU {placement.gpu_id} of node {placement.node_ip} "
                          f"(num_gpus={placement.share:g}): {exc}") from None
    return budget, info, context


def _place(runtime: Any, who: str) -> Placement:
    import ray

    share = gpu_share(runtime.get_assigned_resources(), who)
    gpu_id, ordinal = cuda_ordinal(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                                   who)
    node_id: str = runtime.get_node_id()
    backend, memory, simulated = open_device(ordinal, f"{node_id}-gpu{gpu_id}", who)
    return Placement(node_id=node_id, node_ip=ray.util.get_node_ip_address(), gpu_id=gpu_id,
                     ordinal=ordinal, share=share, device_memory=memory, simulated=simulated,
                     backend=backend)


def _serve_replica() -> tuple[str, str, str] | None:
    """``(application, deployment, replica id)`` inside a Ray Serve replica, else ``None``
    (Serve is imported already wherever a replica runs; it is never imported here)."""
    serve = sys.modules.get("ray.serve")
    if serve is None:
        return None
    try:
        context = serve.get_replica_context()
        return str(context.app_name), str(context.deployment), str(context.replica_tag)
    except Exception:  # noqa: BLE001 - RayServeException: not a replica
        return None


def _trace_file(directory: str, info: ActorInfo, who: str) -> str:
    """The actor's trace file in ``directory`` (created if missing): named by its Serve
    replica or its actor, plus its process id if Ray restarted the actor (the file of its
    first life is kept)."""
    if info.deployment is not None:
        stem = f"{info.application}.{info.deployment}.{info.replica}"
    else:
        stem = f"{info.actor_name or info.class_name}.{info.actor_id[:12]}"
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"{who}: cannot create the trace directory {directory!r}: {exc}") from None
    path = folder / (re.sub(r"[^A-Za-z0-9_.-]", "_", stem) + ".jsonl")
    if path.exists():  # a restarted actor (same id): keep the first life's trace
        path = path.with_suffix(f".{info.pid}.jsonl")
    return str(path)
