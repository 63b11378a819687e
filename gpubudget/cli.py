"""``python -m gpubudget`` (also installed as ``gpubudget``): ``demo``, ``report``, ``fit``.

Bad input (a missing or malformed trace, a trace of a newer version) prints one line on
stderr and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import warnings
from collections.abc import Sequence
from typing import NoReturn

from .backends import cuda_usable
from .budget import gpu_budget
from .errors import GpuBudgetError
from .report import BudgetReport
from .scope import label
from .units import format_size

__all__ = ["main"]

MiB = 2**20


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _fail(message: str) -> NoReturn:
    print(f"gpubudget: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _plot(report: BudgetReport, path: str) -> None:
    try:
        report.plot(path)
    except ImportError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write {path!r}: {exc}")
    print(f"\nplot written to {path}")


def demo(plot: str | None, backend: str | None) -> None:
    """Two models sharing one pool on a 6 GB card, with a build, a denial and serving."""
    if backend is None:
        backend = "pycuda" if cuda_usable() else "host"
    where = "a CUDA device (PyCUDA backend)" if backend == "pycuda" else (
        "host memory (no usable CUDA device and PyCUDA here; the budgets, limits and "
        "placement are real, the memory is the host's)"
    )
    print(f"gpubudget demo on {where}\n")
    print("A 6 GB card runs a detector and a classifier beside other work: both draw from one")
    print("4 GiB pool, reserved once; each is capped; about 2 GB stay free for the rest.\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pool = gpu_budget("4GiB", name="shared", backend=backend)
    with pool:
        with gpu_budget("2GiB", name="detector") as detector:
            with label("detector/build"):
                for size in (256, 512, 128, 512, 256, 64):  # tactic workspaces come and go
                    block = detector.allocate(size * MiB)
                    time.sleep(0.002)
                    if block is not None:
                        detector.free(block)
            with label("detector/weights"):
                weights = detector.allocate(1200 * MiB)
            time.sleep(0.002)
        with gpu_budget("1.5GiB", name="classifier") as classifier:
            with label("classifier/weights"):
                classifier.allocate(900 * MiB)
            time.sleep(0.002)
            with label("classifier/workspace"):
                refused = classifier.allocate(700 * MiB)
                print(f"classifier asks for 700 MiB of workspace: {refused} (over its cap)")
                workspace = classifier.allocate(400 * MiB)
                print(f"classifier asks for 400 MiB instead: {'granted' if workspace else None}")
        for step in range(12):  # serving: activations per request
            for model, size in ((detector, 300), (classifier, 96)):
                with label(f"{model.name}/activations"):
                    block = model.allocate(size * MiB)
                time.sleep(0.001)
                if block is not None:
                    model.free(block)
        assert weights is not None
    print(f"\npool: {format_size(pool.used)} used of {format_size(pool.limit)}, "
          f"{format_size(pool.available)} left\n")
    report = pool.report()
    print(report)
    if plot is not None:
        if _has_matplotlib():
            _plot(report, plot)
        else:
            print("\n(no plot: pip install 'gpubudget[plot]' for matplotlib)")


def report_command(trace: str, plot: str | None, as_json: bool) -> None:
    from .replay import replay

    result = replay(trace)
    if not result.reports:
        _fail(f"trace {trace!r} holds no budget")
    for report in result.reports:
        print(report.to_json() if as_json else report)
    if plot is not None:
        _plot(result.reports[0], plot)


def fit_command(trace: str) -> None:
    from .replay import fit

    fits = fit(trace)
    names = {f.budget: f.name for f in fits}
    width = max(len(f.name) for f in fits) + 2
    print(f"{'budget':<{width}} {'parent':<{width}} {'recorded':>12} {'peak':>12} {'fits in':>12}")
    for f in fits:
        parent = names.get(f.parent, "") if f.parent is not None else "-"
        print(f"{f.name:<{width}} {parent:<{width}} {format_size(f.recorded_limit):>12} "
              f"{format_size(f.peak):>12} {format_size(f.limit):>12}")
    print("\nsmallest limits under which the trace replays without a denial:\n")
    for f in fits:
        print(f"gpu_budget({f.limit}, name={f.name!r})  # {format_size(f.limit)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="gpubudget", description="Scoped GPU memory budgets: demo and traces.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo_parser = commands.add_parser(
        "demo", help="two models sharing one pool: budgets at work, the report and a plot",
        description="Run the two-models-sharing-a-pool story on the PyCUDA backend when a GPU "
        "is usable, else in host memory; print the report and write a plot.",
    )
    demo_parser.add_argument("--plot", default="gpubudget-demo.png", metavar="PNG",
                             help="where to write the plot (default: %(default)s)")
    demo_parser.add_argument("--no-plot", action="store_true", help="write no plot")
    demo_parser.add_argument("--backend", choices=("pycuda", "host"),
                             help="force a backend (default: PyCUDA if usable, else host)")
    report_parser = commands.add_parser(
        "report", help="replay a trace and print its report",
        description="Replay a trace file (written with trace= or GPUBUDGET_TRACE) in host "
        "memory and print the report of each root budget.",
    )
    report_parser.add_argument("trace", help="a .jsonl trace file")
    report_parser.add_argument("--plot", metavar="PNG", help="also write the timeline plot")
    report_parser.add_argument("--json", action="store_true", help="print JSON")
    fit_parser = commands.add_parser(
        "fit", help="smallest limits under which a trace replays without a denial",
        description="Find, by replay and bisection, the smallest limit of every budget in a "
        "trace (alignment and fragmentation included) and print gpu_budget(...) lines.",
    )
    fit_parser.add_argument("trace", help="a .jsonl trace file")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            demo(None if args.no_plot else args.plot, args.backend)
        elif args.command == "report":
            report_command(args.trace, args.plot, args.json)
        else:
            fit_command(args.trace)
    except (GpuBudgetError, ValueError) as exc:
        _fail(str(exc))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
