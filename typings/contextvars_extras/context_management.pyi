# Only the names gpubudget calls.
from collections.abc import Callable
from typing import Any, TypeVar

_R = TypeVar("_R")

def bind_to_snapshot_context(fn: Callable[..., _R], *args: Any, **kwargs: Any) -> Callable[..., _R]: ...
