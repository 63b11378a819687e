"""run: a command started with the driver door loaded (``gpubudget run -- python serve.py``).

The door (:mod:`gpubudget.door`) is put first in ``LD_PRELOAD`` and the command replaces
this process (``exec``): its exit status is the command's, its signals reach it directly.
``--attribute-only`` counts every driver allocation by budget and library without refusing
any (``GPUBUDGET_DOOR_MODE=attribute``); ``--device-info`` leaves ``cuMemGetInfo`` answering
for the device rather than the budget (``GPUBUDGET_DOOR_DEVICE_INFO=1``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from ..door.build import DoorUnavailable, library
from .output import Failure

__all__ = ["add_run_parser", "run_command"]


def add_run_parser(commands: Any) -> None:
    """Register ``run`` on the ``gpubudget`` command's subparsers."""
    parser = commands.add_parser(
        "run", help="run a command with the driver door loaded",
        description="Run COMMAND with gpubudget's driver door loaded (LD_PRELOAD): every "
        "device allocation a thread asks of the CUDA driver is charged to the budget "
        "current in that thread, refused over its limit, and attributed to the library "
        "that asked.")
    parser.add_argument("--attribute-only", action="store_true",
                        help="count and attribute driver allocations, refuse none")
    parser.add_argument("--device-info", action="store_true",
                        help="cuMemGetInfo answers for the device, not for the budget")
    parser.add_argument("--print-library", action="store_true",
                        help="print the door library's path and exit")
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the command and its arguments")


def run_command(args: argparse.Namespace) -> int:
    """Run ``gpubudget run``: exec the command under the door (never returns then)."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv and not args.print_library:
        raise Failure("run needs a command: gpubudget run -- python serve.py")
    try:
        path = library()
    except DoorUnavailable as exc:
        raise Failure(str(exc)) from None
    if args.print_library:
        print(path)
        return 0
    env = dict(os.environ)
    preload = [item for item in env.get("LD_PRELOAD", "").replace(":", " ").split() if item]
    env["LD_PRELOAD"] = " ".join([str(path), *[p for p in preload if p != str(path)]])
    if args.attribute_only:
        env["GPUBUDGET_DOOR_MODE"] = "attribute"
    if args.device_info:
        env["GPUBUDGET_DOOR_DEVICE_INFO"] = "1"
    _exec(argv, env)


def _exec(argv: list[str], env: dict[str, str]) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        raise Failure(f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
