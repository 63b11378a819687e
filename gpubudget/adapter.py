"""What adapters (``tensorrt/``, ``cupy.py``, ``torch.py``, ``ray/``) and tools (``replay/``,
``cli/``) use of gpubudget besides its public API: one small interface, so that the core
(``gpubudget._core``) and the other internal modules stay free to change.

- :func:`by_device`: a framework's allocator function that serves one device from a budget
  and passes the others on (in C where the C core runs: CuPy calls it for every array).

``tests/test_layers.py`` checks that adapters and tools import nothing else of the package
but its public names and this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ._core import native

__all__ = ["by_device"]

R = TypeVar("R")


class _ByDevice:
    """The Python :func:`by_device` (where the C core is not built)."""

    __slots__ = ("current", "device", "here", "elsewhere")

    def __init__(self, current: Callable[[], object], device: object,
                 here: Callable[..., Any], elsewhere: Callable[..., Any]) -> None:
        self.current, self.device, self.here, self.elsewhere = current, device, here, elsewhere

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.current() == self.device:
            return self.here(*args, **kwargs)
        return self.elsewhere(*args, **kwargs)


def by_device(current: Callable[[], object], device: object, here: Callable[..., R],
              elsewhere: Callable[..., R]) -> Callable[..., R]:
    """A callable that calls ``here`` with its arguments while ``current()`` returns
    ``device``, else ``elsewhere``.

    Examples
    --------
    >>> device = [0]
    >>> route = by_device(lambda: device[0], 0, lambda n: ("budget", n), lambda n: ("old", n))
    >>> route(256), device.__setitem__(0, 1), route(512)
    (('budget', 256), None, ('old', 512))
    """
    kind: Any = native.Router if native is not None else _ByDevice
    route: Callable[..., R] = kind(current, device, here, elsewhere)
    return route
