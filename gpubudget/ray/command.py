"""``ray_command``: print the cluster report, for the ``gpubudget ray`` command line."""

from __future__ import annotations

import logging
import socket
import sys
from typing import Final

from ..text import printable
from .registry import cluster_report, death_cause

__all__ = ["EXIT_ERROR", "ray_command"]

EXIT_ERROR: Final = 2
"""Exit status when no report could be made (Ray missing, no cluster)."""
CONNECT_SECONDS: Final = 5.0


def ray_command(address: str | None = None, as_json: bool = False, *,
                timeout: float = 2.0) -> int:
    """Print the cluster report of the Ray cluster at ``address``; return the exit status.

    ``address``: what ``ray.init(address=...)`` takes (``"auto"`` when ``None``: the
    ``RAY_ADDRESS`` environment variable, else the cluster started on this machine); a
    connection already made in this process is used as it is. Prints the text report, or
    JSON with ``as_json``, and returns 0. Where Ray is not installed or no cluster answers,
    prints one line on stderr and returns 2.

    Examples
    --------
    >>> from gpubudget.ray import ray_command
    >>> ray_command("10.0.0.5:6379")                                  # doctest: +SKIP
    gpubudget cluster report: 2 budgeted actors alive, 0 dead
    ...
    0
    """
    try:
        import ray
    except ImportError:
        print("gpubudget ray: Ray is not installed; pip install 'gpubudget[ray]'",
              file=sys.stderr)
        return EXIT_ERROR
    connected_here = not ray.is_initialized()
    if connected_here:
        target = address or "auto"
        try:
            _check_reachable(target)
            ray.init(address=target, logging_level=logging.ERROR, log_to_driver=False)
        except Exception as exc:  # noqa: BLE001 - ConnectionError, ValueError, RuntimeError
            print(f"gpubudget ray: no Ray cluster at {printable(repr(target))}: "
                  f"{printable(death_cause(exc))}", file=sys.stderr)
            return EXIT_ERROR
    try:
        report = cluster_report(timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - one line, whatever went wrong
        print(f"gpubudget ray: {type(exc).__name__}: {printable(death_cause(exc))}",
              file=sys.stderr)
        return EXIT_ERROR
    finally:
        if connected_here:
            ray.shutdown()
    print(report.to_json() if as_json else report)
    return 0


def _check_reachable(address: str) -> None:
    """Raise ``ConnectionError`` if ``host:port`` (optionally ``ray://host:port``) does not
    accept a connection within :data:`CONNECT_SECONDS` (``ray.init`` would retry for minutes).
    Other forms (``auto``, ``local``) are left to Ray."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_SECONDS).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {host}:{port} ({exc})") from None
