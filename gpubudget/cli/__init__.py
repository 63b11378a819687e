"""``python -m gpubudget`` (also installed as ``gpubudget``): ``demo``, ``report``, ``fit``,
``view``, ``export``, ``ray``, ``top``, ``metrics``, ``engine``, ``run``.

Exit status: 0 done; 1 ``fit --check``: the run needs more than the limits allow, or does
not match them (``engine --limit``: the engine does not fit, or cannot be shown to); 2 bad
input or usage (one line on stderr, never a traceback; set
``GPUBUDGET_DEBUG=1`` to see the traceback of an internal error); 130 interrupted (Ctrl-C);
141 the output was closed early (``| head``): the command stops quietly, as if killed by
``SIGPIPE``. Text from a trace (names, tags) is printed with unprintable characters escaped.
On a terminal, ``report`` and ``fit`` show a progress line on stderr once they have run for
a second; nothing when stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Final, NoReturn

from .. import __version__
from ..errors import GpuBudgetError
from ..tracefile import MAX_TRACE_BYTES
from ..text import printable
from ..units import format_size, parse_size
from .demo import demo
from .engine import add_engine_parser
from .run import add_run_parser
from .gate import ALLOWANCES
from .output import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    Failure,
    Progress,
    say,
    show_warning,
)
from .traces import fit_command, report_command

__all__ = ["EXIT_BAD_INPUT", "EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "Progress", "main"]

DEBUG_ENV: Final = "GPUBUDGET_DEBUG"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {printable(message)} (see --help)\n")


def _size_argument(text: str) -> int:
    try:
        return parse_size(text, what="--max-size")
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpubudget", description="Scoped GPU memory budgets: demo and traces.")
    parser.add_argument("--version", action="version", version=f"gpubudget {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo_parser = commands.add_parser(
        "demo", help="two models sharing one pool: budgets at work, the report and a plot",
        description="Run the two-models-sharing-a-pool story on the backend that --backend, "
        "else GPUBUDGET_BACKEND, names; else on the PyCUDA backend when a GPU is usable, "
        "else in host memory. Print the report and write a plot.",
    )
    demo_parser.add_argument("--plot", default="gpubudget-demo.png", metavar="FILE",
                             help="where to write the plot, .png, .svg or .pdf "
                             "(default: %(default)s)")
    demo_parser.add_argument("--no-plot", action="store_true", help="write no plot")
    demo_parser.add_argument("--backend", choices=("pycuda", "host"),
                             help="the backend (default: GPUBUDGET_BACKEND, else PyCUDA if "
                             "usable, else host)")
    size_help = (f"refuse a trace longer than SIZE (default {format_size(MAX_TRACE_BYTES)}; "
                 f"e.g. 16GiB)")
    report_parser = commands.add_parser(
        "report", help="replay a trace and print its report",
        description="Replay a trace file (written with trace= or GPUBUDGET_TRACE) in host "
        "memory, with its recorded times, and print the report of each root budget.",
    )
    report_parser.add_argument("trace", help="a .jsonl trace file, or - for standard input")
    report_parser.add_argument("--plot", metavar="FILE",
                               help="also draw the timeline, .png, .svg or .pdf (one root: "
                               "the first, or the one --root names)")
    report_parser.add_argument("--root", metavar="NAME",
                               help="only the root budget(s) named NAME; NAME#2 for the "
                               "second of several with that name")
    report_parser.add_argument("--json", action="store_true",
                               help='print one JSON document: {"trace", "cut_short", '
                               '"after_release", "roots": [...]}')
    report_parser.add_argument("--max-size", type=_size_argument, default=MAX_TRACE_BYTES,
                               metavar="SIZE", help=size_help)
    fit_parser = commands.add_parser(
        "fit", help="smallest limits under which a trace replays without a denial",
        description="Find, by replay and bisection, the smallest limit of every budget in "
        "each trace (alignment and fragmentation included); print a table per trace and "
        "nested 'with gpu_budget(...)' blocks that fit them all.",
    )
    fit_parser.add_argument("traces", nargs="+", metavar="TRACE",
                            help="a .jsonl trace file, a directory of them, or - for "
                            "standard input")
    fit_parser.add_argument("--max-size", type=_size_argument, default=MAX_TRACE_BYTES,
                            metavar="SIZE", help=size_help)
    fit_parser.add_argument("--check", metavar="LIMITS",
                            help="a CI gate: exit 1, with a table, when the traces need more "
                            "than LIMITS allow (the 'with gpu_budget(...)' code fit prints, "
                            "or a .toml file) or do not match them (a budget of LIMITS not "
                            "in the run, a budget of a tree LIMITS names without a limit), 0 "
                            "when they fit")
    fit_parser.add_argument("--allow", action="append", default=[], metavar="WHAT",
                            choices=ALLOWANCES,
                            help="with --check, for every budget: 'absent' budgets of LIMITS "
                            "may be missing from the run; 'unlisted' budgets of the run may "
                            "have no limit; 'denials' of the run are expected (each budget "
                            "must fit what it was granted). Repeat for more than one")
    view_parser = commands.add_parser(
        "view", help="an interactive viewer of a trace: one HTML file",
        description="Write one self-contained HTML page (no network needed to open it): a "
        "lane per budget with its live blocks as bands, its limit and denials, where blocks "
        "sit in memory, the live bytes by stack at a moment, leaks, and a comparison of two "
        "moments or two records. Reads gpubudget traces, a report's JSON (report --json, "
        "BudgetReport.to_json()) and PyTorch memory snapshots "
        "(torch.cuda.memory._dump_snapshot; only plain data is read from the pickle).")
    view_parser.add_argument("trace", help="a .jsonl trace file, a report's JSON, a PyTorch "
                             "memory snapshot (.pickle), or - for standard input")
    view_parser.add_argument("-o", "--output", required=True, metavar="FILE",
                             help="where to write the page (.html)")
    view_parser.add_argument("--compare", metavar="OTHER",
                             help="another trace or snapshot (before a change) to compare with")
    view_parser.add_argument("--max-size", type=_size_argument, default=MAX_TRACE_BYTES,
                             metavar="SIZE", help=size_help)
    export_parser = commands.add_parser(
        "export", help="a trace in another format: --perfetto",
        description="Convert a trace: --perfetto writes the Trace Event Format (JSON) that "
        "ui.perfetto.dev and chrome://tracing open: a process per root budget, a thread and "
        "a counter track per budget, a slice for its life and one for each block (tag, "
        "bytes, stack), an instant for each denial; times in whole microseconds, the file "
        "no larger than the trace.")
    export_parser.add_argument("trace", help="a .jsonl trace file, or - for standard input")
    export_parser.add_argument("--perfetto", action="store_true", required=True,
                               help="write the Trace Event Format (the only format so far)")
    export_parser.add_argument("-o", "--output", required=True, metavar="FILE",
                               help="where to write it (.json)")
    export_parser.add_argument("--max-size", type=_size_argument, default=MAX_TRACE_BYTES,
                               metavar="SIZE", help=size_help)
    ray_parser = commands.add_parser(
        "ray", help="the GPU budgets of every budgeted actor of a Ray cluster",
        description="Print the cluster report: node, GPU, actor and budget of every actor "
        "decorated with gpubudget.ray.budgeted (needs Ray: pip install 'gpubudget[ray]').")
    ray_parser.add_argument("--address", metavar="ADDR",
                            help="the cluster, as ray.init(address=...) takes it (default: "
                            "RAY_ADDRESS, else the cluster started on this machine)")
    ray_parser.add_argument("--json", action="store_true", help="print one JSON document")
    _host_commands(commands)
    add_engine_parser(commands)
    return parser


def _host_commands(commands: Any) -> None:
    """``top`` and ``metrics``: the host ledger, live and for Prometheus."""
    from .top import SORT_KEYS

    top_parser = commands.add_parser(
        "top", help="every budget of every process on this host, per GPU, live",
        description="Show the host ledger: per device, every root budget of every live "
        "process (limit, used, peak, denials) and, with NVML, the memory each process holds "
        "outside its budgets. Keys: s sort, r reverse, / filter, c clear filter, q quit.")
    top_parser.add_argument("--once", action="store_true", help="print the view once")
    top_parser.add_argument("--json", action="store_true", help="print it once as JSON")
    top_parser.add_argument("--sort", choices=SORT_KEYS, default="used",
                            help="sort rows by this (default: %(default)s)")
    top_parser.add_argument("--reverse", action="store_true", help="reverse the order")
    top_parser.add_argument("--filter", default="", metavar="TEXT",
                            help="only rows whose pid, process or budget has TEXT")
    top_parser.add_argument("--device", default="", metavar="TEXT",
                            help="only devices whose UUID or name has TEXT")
    top_parser.add_argument("--interval", type=_seconds, default=1.0, metavar="SECONDS",
                            help="seconds between refreshes (default: %(default)s)")
    top_parser.add_argument("--all", action="store_true",
                            help="also devices with no budget (simulated ones aside)")
    metrics_parser = commands.add_parser(
        "metrics", help="serve the host ledger to Prometheus",
        description="Serve every budget of every process on this host as Prometheus metrics "
        "at http://ADDRESS:PORT/metrics until interrupted (needs prometheus_client: pip "
        "install 'gpubudget[metrics]').")
    metrics_parser.add_argument("--port", type=_port, required=True,
                                help="the port (0: any free one, printed on stderr)")
    metrics_parser.add_argument("--process-label", choices=("pid", "command"), default="pid",
                                help="what the process label holds: the pid (default), or "
                                "the command line, the same after a restart")
    metrics_parser.add_argument("--address", default="127.0.0.1",
                                help="the address to listen on (default: %(default)s, this "
                                "host only; 0.0.0.0 for every interface)")
    add_run_parser(commands)
    for each in (top_parser, metrics_parser):
        each.add_argument("--ledger-dir", metavar="DIR",
                          help="the ledger directory (default: GPUBUDGET_LEDGER_DIR, else "
                          "/dev/shm/gpubudget-ledger-UID)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"--interval {text!r} is not a number of seconds "
                                         f"from 0.1 to 3600")
    return value


def _port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"--port {text!r} is not a port number (0 to 65535)")
    return int(text)


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            demo(None if args.no_plot else args.plot, args.backend)
            return 0
        if args.command == "report":
            report_command(args.trace, args.plot, args.json, args.root, args.max_size)
            return 0
        if args.command == "view":
            from .visual import view_command

            view_command(args.trace, args.output, args.max_size, args.compare)
            return 0
        if args.command == "export":
            from .visual import export_command

            export_command(args.trace, args.output, args.max_size)
            return 0
        if args.command == "ray":
            from ..ray import ray_command

            return ray_command(args.address, args.json)
        if args.command == "top":
            from .top import TopOptions, top_command

            options = TopOptions(sort=args.sort, reverse=args.reverse, filter=args.filter,
                                 device=args.device, directory=args.ledger_dir,
                                 interval=args.interval, idle=args.all)
            return top_command(options, once=args.once, as_json=args.json)
        if args.command == "engine":
            from .engine import engine_command

            return engine_command(args)
        if args.command == "run":
            from .run import run_command

            return run_command(args)
        if args.command == "metrics":
            from ..metrics import metrics_command

            return metrics_command(args.port, args.address, args.ledger_dir,
                                   args.process_label)
        if args.check is not None:
            from .gate import check_command

            return check_command(args.check, args.traces, args.max_size, args.allow)
        if args.allow:
            raise Failure("--allow goes with --check LIMITS")
        return fit_command(args.traces, args.max_size)
    except BrokenPipeError:
        raise
    except (Failure, GpuBudgetError, ValueError, ImportError) as exc:
        say(f"error: {exc}")
    except OSError as exc:
        say(f"error: {exc.strerror or exc}"
             + (f": {exc.filename!r}" if exc.filename is not None else ""))
    except MemoryError:
        say("error: out of memory")
    except Exception as exc:  # noqa: BLE001 - the command line never shows a traceback
        if os.environ.get(DEBUG_ENV):
            raise
        say(f"internal error: {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 to see the "
             f"traceback, and please report it)")
    return EXIT_BAD_INPUT


def _quiet_stdout() -> None:
    """After the reader of our output went away: send what is left to /dev/null, so that
    the interpreter's last flush does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (see the module docstring)."""
    try:
        if isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout.reconfigure(errors="backslashreplace")  # any encoding: never a crash
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            try:
                status = _run(argv)
            except SystemExit as done:  # argparse: --help, --version, a usage error
                status = done.code if isinstance(done.code, int) else (
                    0 if done.code is None else EXIT_BAD_INPUT)
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
            return status
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        try:
            say("interrupted")
        except OSError:
            pass
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
