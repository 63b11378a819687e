"""``gpubudget engine PLAN``: will a TensorRT engine fit, before loading it.

Without a GPU it prints the plan's size (an upper bound of the weights the engine puts on the
device, unless the plan was built weight-stripped) after its header has been checked — by
TensorRT where the module can, and always for the tag a plan begins with (``ftrt`` for
TensorRT, ``vtrt`` for TensorRT-RTX: four bytes ending in ``trt``) — and says which numbers
need a GPU: the exact weights, the execution-context memory of each optimization profile and
the streamable weights, which only a deserialized engine gives. Where the CUDA driver shows a
device, TensorRT deserializes the plan (TensorRT-RTX without loading the weights) and all of
them are printed; the file is read whole only then, never on a machine without a GPU.

Exit status: 0 printed (and, with ``--limit``, it fits); 1 with ``--limit``: it does not fit,
or the numbers known here cannot show that it does; 2 a bad plan file or argument (one line).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import re
import stat
from typing import Any, Final

from ..text import printable
from ..units import parse_size
from .output import Failure

__all__ = ["add_engine_parser", "engine_command"]


def _limit(text: str) -> int:
    try:
        return parse_size(text, what="--limit")
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_MODULE_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_PLAN_TAG: Final = re.compile(rb"[a-z]trt")
"""The four bytes a TensorRT plan begins with: ``ftrt`` (TensorRT), ``vtrt`` (TensorRT-RTX)."""
_CUDA_DRIVERS: Final = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


def _module_name(text: str) -> str:
    if not _MODULE_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{printable(text)!r} is not a module name (a dotted Python name such as "
            f"tensorrt or tensorrt_rtx)")
    return text


def _count(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 1_000_000:
        raise argparse.ArgumentTypeError(f"--contexts {text!r} is not a count from 1")
    return int(text)


def add_engine_parser(commands: Any) -> None:
    """Register ``engine`` on the ``gpubudget`` command's subparsers."""
    parser = commands.add_parser(
        "engine", help="what a TensorRT plan needs, and whether it fits a limit",
        description="Print what a serialized TensorRT engine needs on the device: its size "
        "(an upper bound of its weights) without a GPU; with a GPU TensorRT supports, also "
        "the exact weights, each profile's execution-context memory and the streamable "
        "weights. With --limit, exit 1 unless it certainly fits.")
    parser.add_argument("plan", help="a serialized engine (.plan/.engine file)")
    parser.add_argument("--limit", type=_limit, metavar="SIZE",
                        help="the budget's room, e.g. 4GiB: exit 1 unless the engine fits")
    parser.add_argument("--contexts", type=_count, default=1, metavar="N",
                        help="execution contexts to count (default: %(default)s)")
    parser.add_argument("--trt-module", metavar="NAME", type=_module_name,
                        help="the TensorRT module (default: the first importable of "
                        "tensorrt, tensorrt_bindings, tensorrt_rtx, tensorrt_rtx_bindings, "
                        "tensorrt_lean, tensorrt_lean_bindings)")
    parser.add_argument("--no-gpu", action="store_true",
                        help="do not deserialize, even where a GPU could (without a CUDA "
                        "device, it never does)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def engine_command(args: argparse.Namespace) -> int:
    """Run ``gpubudget engine``; see the module docstring."""
    from ..tensorrt.fit import PlanError, plan_needs

    try:
        needs = plan_needs(args.plan, room=args.limit, contexts=args.contexts,
                           trt_module=args.trt_module, deserialize=False)
        _check_tag(args.plan)
        if not args.no_gpu:
            if _cuda_devices():
                needs = plan_needs(args.plan, room=args.limit, contexts=args.contexts,
                                   trt_module=args.trt_module, deserialize=True)
            elif needs.module is not None:
                needs = dataclasses.replace(needs, unknown="no CUDA device here (the driver "
                                            "shows none): TensorRT deserializes a plan only "
                                            "on a GPU")
    except PlanError as exc:
        raise Failure(f"{args.plan}: {exc}") from None
    except ImportError as exc:  # only a module named with --trt-module is required
        raise Failure(f"--trt-module {args.trt_module}: cannot be imported ({exc})") from None
    if args.json:
        print(json.dumps({"plan": args.plan, **needs.as_dict()}, indent=2))
    else:
        print(f"{'file':<19}  {args.plan}")
        print(needs.text())
    return 0 if args.limit is None or needs.fits else 1


def _check_tag(plan: str) -> None:
    """A ``PlanError`` unless the file ``plan`` begins with a plan's tag (see
    :data:`_PLAN_TAG`): what a module that cannot read headers would let through."""
    from ..tensorrt.fit import PlanError

    fd = os.open(plan, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PlanError("not a regular file")
        head = os.read(fd, 4)
    finally:
        os.close(fd)
    if not _PLAN_TAG.fullmatch(head):
        raise PlanError(f"not a TensorRT plan: it begins with {head!r}, where a plan begins "
                        f"with a tag such as b'ftrt' (TensorRT) or b'vtrt' (TensorRT-RTX)")


def _cuda_devices() -> int:
    """How many CUDA devices the driver shows this process: 0 where there is no driver.
    Asked of the driver library itself, which loads no framework and no TensorRT."""
    for name in _CUDA_DRIVERS:
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0
