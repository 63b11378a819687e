"""``gpubudget engine PLAN``: will a TensorRT engine fit, before loading it.

Without a GPU it prints the plan's size (an upper bound of the weights the engine puts on the
device, unless the plan was built weight-stripped) after TensorRT has checked the plan's header
where the module can (TensorRT-RTX; no TensorRT 10/11 binding can), prints what was checked
(the file is read whole only to deserialize it), and says which numbers need a GPU: the
exact weights, the execution-context memory of each optimization profile and the streamable
weights, which only a deserialized engine gives. Where TensorRT can deserialize the plan (a GPU
it supports), it does — TensorRT-RTX without loading the weights — and prints them all.

Exit status: 0 printed (and, with ``--limit``, it fits); 1 with ``--limit``: it does not fit,
or the numbers known here cannot show that it does; 2 a bad plan file or argument (one line).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..units import parse_size
from .output import Failure

__all__ = ["add_engine_parser", "engine_command"]


def _limit(text: str) -> int:
    try:
        return parse_size(text, what="--limit")
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    parser.add_argument("--trt-module", metavar="NAME",
                        help="the TensorRT module (default: the first importable of "
                        "tensorrt, tensorrt_bindings, tensorrt_rtx, tensorrt_rtx_bindings, "
                        "tensorrt_lean, tensorrt_lean_bindings)")
    parser.add_argument("--no-gpu", action="store_true",
                        help="do not deserialize, even where a GPU could")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def engine_command(args: argparse.Namespace) -> int:
    """Run ``gpubudget engine``; see the module docstring."""
    from ..tensorrt.fit import PlanError, plan_needs

    try:
        needs = plan_needs(args.plan, room=args.limit, contexts=args.contexts,
                           trt_module=args.trt_module, deserialize=not args.no_gpu)
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
