"""``python -m gpubudget`` (also installed as ``gpubudget``): ``demo``, ``report``, ``fit``.

Exit status: 0 done; 2 bad input or usage (one line on stderr, never a traceback; set
``GPUBUDGET_DEBUG=1`` to see the traceback of an internal error); 130 interrupted (Ctrl-C);
141 the output was closed early (``| head``): the command stops quietly, as if killed by
``SIGPIPE``. Text from a trace (names, tags) is printed with unprintable characters escaped.
On a terminal, ``report`` and ``fit`` show a progress line on stderr once they have run for
a second; nothing when stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, NoReturn, TextIO

from . import __version__
from .backends import Backend, get_backend
from .budget import gpu_budget
from .errors import GpuBudgetError
from .plot import plot_format
from .replay import Fit, ReplayResult, fit, replay
from .report import BudgetReport
from .scope import label
from .tracefile import MAX_TRACE_BYTES, printable
from .units import GiB, KiB, MiB, format_size, parse_size

__all__ = ["EXIT_BAD_INPUT", "EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "Progress", "main"]

EXIT_BAD_INPUT: Final = 2
EXIT_INTERRUPTED: Final = 130
EXIT_BROKEN_PIPE: Final = 141
DEBUG_ENV: Final = "GPUBUDGET_DEBUG"
_NAMES_LISTED: Final = 5
"""Root names a message lists at most."""
_NAME_COLUMN: Final = 40
"""Characters of a budget name the fit table shows at most."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {printable(message)} (see --help)\n")


class _Failure(Exception):
    """Ends a command with one line on stderr and exit status 2."""


def _say(message: str) -> None:
    """One line on stderr, prefixed with the program's name."""
    print(f"gpubudget: {printable(message)}", file=sys.stderr)


def _show_warning(message: Warning | str, category: type[Warning], filename: str,
                  lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
    _say(f"warning: {message}")


# -- progress ------------------------------------------------------------------------------


PROGRESS_DELAY: Final = 1.0
"""Seconds a command runs before its progress line shows."""


class Progress:
    """A progress line on a terminal, rewritten in place.

    Calls are cheap and may come often: a message is shown only when ``stream`` is a
    terminal, once ``delay`` seconds (default :data:`PROGRESS_DELAY`) have passed since the
    start, and at most every ``interval`` seconds. :meth:`clear` erases it before other
    output.
    """

    def __init__(self, stream: TextIO, *, delay: float | None = None, interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.enabled = _is_terminal(stream)
        self.interval = interval
        self.clock = clock
        self.next_at = clock() + (PROGRESS_DELAY if delay is None else delay)
        self.width = 0  # characters on the line now

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now < self.next_at:
            return
        self.next_at = now + self.interval
        text = printable(message)[:79]
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def clear(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


# -- demo ------------------------------------------------------------------------------


def _demo_backend(name: str | None) -> tuple[Backend, str]:
    """The backend the demo runs on, and how it was chosen: ``--backend``, else
    ``GPUBUDGET_BACKEND``, else PyCUDA when usable, else host memory (as budgets choose)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the host-memory notice: said below
        backend = get_backend(name)
    if name is not None:
        why = f"--backend {name}"
    elif os.environ.get("GPUBUDGET_BACKEND", "").strip():
        why = f"GPUBUDGET_BACKEND={printable(os.environ['GPUBUDGET_BACKEND'].strip())}"
    else:
        why = "no usable CUDA device and PyCUDA here" if backend.name == "host" else ""
    if backend.name == "host":
        where = (f"host memory ({why}; the budgets, limits and placement are real, the "
                 f"memory is the host's)")
    else:
        where = f"a CUDA device ({backend.name} backend{'; ' + why if why else ''})"
    return backend, where


def demo(plot: str | None, backend_name: str | None) -> None:
    """Two models sharing one pool on a 6 GB card, with a build, a denial and serving."""
    if plot is not None:
        plot_format(plot)
    backend, where = _demo_backend(backend_name)
    print(f"gpubudget demo on {where}\n")
    print("A 6 GB card runs a detector and a classifier beside other work: both draw from one")
    print("4 GiB pool, reserved once; each is capped; about 2 GB stay free for the rest.\n")
    with gpu_budget("4GiB", name="shared", backend=backend) as pool:
        with gpu_budget("2GiB", name="detector") as detector:
            with label("detector/build"):
                for size in (256, 512, 128, 512, 256, 64):  # tactic workspaces come and go
                    block = detector.allocate(size * MiB)
                    time.sleep(0.002)  # so that the plot shows the steps apart
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
        for _ in range(12):  # serving: activations per request
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
        if importlib.util.find_spec("matplotlib") is None:
            print("\n(no plot: pip install 'gpubudget[plot]' for matplotlib)")
        else:
            report.plot(plot)
            print(f"\nplot written to {printable(plot)}")


# -- report ----------------------------------------------------------------------------


def _safe_report(report: BudgetReport) -> BudgetReport:
    """``report`` with every name and tag printable (see :func:`printable`)."""
    made: dict[int, BudgetReport] = {}
    for item in reversed(report.walk()):  # children before parents: no recursion
        made[id(item)] = dataclasses.replace(
            item,
            name=printable(item.name),
            children=tuple(made.pop(id(child)) for child in item.children),
            denials=tuple(dataclasses.replace(d, refused_by=printable(d.refused_by))
                          for d in item.denials),
            live_blocks=tuple(dataclasses.replace(b, tag=printable(b.tag)) if b.tag else b
                              for b in item.live_blocks),
            by_tag=tuple(dataclasses.replace(u, tag=printable(u.tag)) for u in item.by_tag),
            callback_errors=tuple(printable(error) for error in item.callback_errors),
        )
    return made[id(report)]


def _names(reports: Sequence[BudgetReport]) -> str:
    shown = ", ".join(repr(r.name) for r in reports[:_NAMES_LISTED])
    return shown + (f", … ({len(reports)} in all)" if len(reports) > _NAMES_LISTED else "")


def _choose(reports: tuple[BudgetReport, ...], wanted: str | None,
            trace: str) -> list[BudgetReport]:
    """The roots ``--root`` names: every root called ``wanted``, or ``NAME#K``, the K-th
    root called NAME; all roots without ``--root``."""
    if wanted is None:
        return list(reports)
    named = [r for r in reports if r.name == wanted]
    if named:
        return named
    match = re.fullmatch(r"(.*)#([0-9]+)", wanted, flags=re.DOTALL)
    if match is not None:
        same = [r for r in reports if r.name == match.group(1)]
        index = int(match.group(2))
        if 1 <= index <= len(same):
            return [same[index - 1]]
        if same:
            raise _Failure(f"--root {wanted!r}: there are {len(same)} roots named "
                           f"{match.group(1)!r} in {trace}")
    raise _Failure(f"--root {wanted!r}: no root budget of that name in {trace}; its roots: "
                   f"{_names(reports)}")


def _report_json(trace: str, reports: Sequence[BudgetReport], result: ReplayResult) -> str:
    """One JSON document: ``{"trace", "cut_short", "after_release", "roots": [report, ...]}``
    (each report as ``BudgetReport.to_json`` writes it)."""
    roots = ",\n".join(report.to_json() for report in reports)
    return (f'{{"trace": {json.dumps(trace)}, "cut_short": {json.dumps(result.cut_short)}, '
            f'"after_release": {result.after_release}, "roots": [\n{roots}\n]}}')


def _plot_one(chosen: list[BudgetReport], wanted: str | None, path: str) -> None:
    """Plot the first chosen root; say which when there was a choice, and how to pick."""
    shown = chosen[0]
    if len(chosen) > 1:
        if wanted is None:
            _say(f"the trace has {len(chosen)} root budgets ({_names(chosen)}); the plot "
                 f"shows the first, {shown.name!r}; pick another with --root NAME")
        else:
            _say(f"{len(chosen)} root budgets are named {wanted!r}; the plot shows the "
                 f"first; pick another with --root '{wanted}#2' (#3, ...)")
    try:
        shown.plot(path)
    except OSError as exc:
        raise _Failure(f"cannot write {path!r}: {exc.strerror or exc}") from None
    print(f"\nplot written to {printable(path)}")


def report_command(trace: str, plot: str | None, as_json: bool, root: str | None,
                   max_bytes: int) -> None:
    """Replay ``trace`` and print its roots' reports (text or one JSON document)."""
    if plot is not None:
        plot_format(plot)
        if importlib.util.find_spec("matplotlib") is None:
            raise _Failure("--plot needs matplotlib: pip install 'gpubudget[plot]'")
    progress = Progress(sys.stderr)
    shown = printable(trace)
    base = printable(os.path.basename(trace) or trace)
    total = os.path.getsize(trace) if os.path.isfile(trace) else 0
    of = f" of {format_size(total)}" if total else ""

    def reading(lines: int, nbytes: int) -> None:
        share = f" ({100 * nbytes // total}%)" if total else ""
        progress(f"replaying {base}: {lines:,} lines, {format_size(nbytes)}{of}{share}")

    try:
        result = replay(trace, max_bytes=max_bytes, progress=reading)
    finally:
        progress.clear()
    _note_warnings(result)
    if not result.reports:
        raise _Failure(f"{shown}: the trace holds no budget")
    chosen = _choose(result.reports, root, shown)
    if as_json:
        print(_report_json(trace, chosen, result))
    else:
        print("\n\n".join(str(_safe_report(report)) for report in chosen))
    if plot is not None:
        _plot_one(chosen, root, plot)


def _note_warnings(result: ReplayResult) -> None:
    """Warnings about what the replay could not show as recorded."""
    if result.cut_short is not None:
        _say(f"warning: {result.cut_short}")
    if result.after_release:
        _say(f"warning: {result.after_release} allocation(s) came after their budget was "
             f"released in this replay (something such as a TensorRT engine kept it alive "
             f"in the recording); they were skipped. 'gpubudget fit' replays them")


# -- fit -------------------------------------------------------------------------------


@dataclass
class _Group:
    """Budgets that share a path of names from their root, across roots and traces: one
    ``with`` line in the code ``fit`` prints, with the largest of their numbers."""

    name: str
    count: int = 0
    recorded_limit: int = 0
    align: int = 1
    reserve: int = 0
    peak: int = 0
    largest_denied: int = 0
    limit: int = 0
    children: dict[str, _Group] = field(default_factory=dict)

    def add(self, found: Fit) -> None:
        self.count += 1
        self.recorded_limit = max(self.recorded_limit, found.recorded_limit)
        self.align = max(self.align, found.align)
        self.reserve = max(self.reserve, found.reserve)
        self.peak = max(self.peak, found.peak)
        self.largest_denied = max(self.largest_denied, found.largest_denied)
        self.limit = max(self.limit, found.limit)

    def walk(self, first: str = "", rest: str = "") -> Iterator[tuple[str, str, _Group]]:
        """``(prefix of its line, prefix of its children's lines, group)``, depth first,
        parents first, with a stack instead of recursion (trees may be deep)."""
        stack: list[tuple[str, str, _Group]] = [(first, rest, self)]
        while stack:
            head, tail, group = stack.pop()
            yield head, tail, group
            children = list(group.children.values())
            for index in range(len(children) - 1, -1, -1):
                last = index == len(children) - 1
                stack.append((tail + ("└─ " if last else "├─ "),
                              tail + ("   " if last else "│  "), children[index]))


def _group(fits: Sequence[Fit], into: dict[str, _Group]) -> None:
    """Add ``fits`` (parents before children) to the forest ``into``, by name path."""
    placed: dict[int, _Group] = {}
    for found in fits:
        siblings = into if found.parent is None else placed[found.parent].children
        group = siblings.get(found.name)
        if group is None:
            group = siblings[found.name] = _Group(found.name)
        group.add(found)
        placed[found.budget] = group


def _cell(name: str, count: int) -> str:
    shown = printable(name)
    if len(shown) > _NAME_COLUMN:
        shown = shown[: _NAME_COLUMN - 1] + "…"
    return shown + (f" (×{count})" if count > 1 else "")


def _fit_table(forest: dict[str, _Group]) -> list[str]:
    rows = [(head + _cell(group.name, group.count), group)
            for root in forest.values() for head, _, group in root.walk()]
    width = max(len("budget"), *(len(cell) for cell, _ in rows))
    lines = [f"{'budget':<{width}}  {'recorded':>10}  {'peak':>10}  {'denied':>10}  "
             f"{'fits in':>10}"]
    for cell, group in rows:
        denied = format_size(group.largest_denied) if group.largest_denied else "-"
        lines.append(f"{cell:<{width}}  {format_size(group.recorded_limit):>10}  "
                     f"{format_size(group.peak):>10}  {denied:>10}  "
                     f"{format_size(group.limit):>10}")
    return lines


def _size_literal(nbytes: int) -> str:
    """``nbytes`` as ``gpu_budget`` reads it: ``"13MiB"`` when a unit divides it exactly."""
    for unit, factor in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes % factor == 0:
            return f'"{nbytes // factor}{unit}"'
    return str(nbytes)


def _fit_code(forest: dict[str, _Group]) -> list[str]:
    """Nested ``with gpu_budget(...)`` blocks that reproduce the run without a denial."""
    lines = []
    for root in forest.values():
        for _, tail, group in root.walk():
            indent = "    " * (len(tail) // 3)
            reserve = f", reserve={_size_literal(group.reserve)}" if group.reserve else ""
            notes = [format_size(group.limit)] if _size_literal(group.limit).isdigit() else []
            if group.count > 1:
                notes.append(f"the largest of {group.count}")
            comment = f"  # {', '.join(notes)}" if notes else ""
            lines.append(f"{indent}with gpu_budget({_size_literal(group.limit)}, "
                         f"align={group.align}{reserve}, name={group.name!r}):{comment}")
            if not group.children:
                lines.append(f"{indent}    ...")
    return lines


def _trace_files(paths: Sequence[str]) -> list[str]:
    """The files named, a directory standing for its ``*.jsonl`` files (sorted)."""
    files: list[str] = []
    for path in paths:
        if path != "-" and os.path.isdir(path):
            found = sorted(os.path.join(path, name) for name in os.listdir(path)
                           if name.endswith(".jsonl"))
            if not found:
                raise _Failure(f"{printable(path)}: a directory with no .jsonl trace in it")
            files += found
        else:
            files.append(path)
    return files


def fit_command(paths: Sequence[str], max_bytes: int) -> int:
    """Fit every trace named; print a table for each, then the code for all of them."""
    files = _trace_files(paths)
    progress = Progress(sys.stderr)
    merged: dict[str, _Group] = {}
    fitted = failed = 0
    for path in files:
        shown = printable(path)
        base = printable(os.path.basename(path) or path)
        try:
            fits = fit(path, max_bytes=max_bytes, progress=_Prefixed(f"{base}: ", progress))
        except (GpuBudgetError, ValueError) as exc:
            progress.clear()
            _say(f"error: {exc}")
            failed += 1
            continue
        progress.clear()
        forest: dict[str, _Group] = {}
        _group(fits, forest)
        _group(fits, merged)
        roots = sum(1 for f in fits if f.parent is None)
        print(f"{shown}: {roots} root{'s' * (roots != 1)}, {len(fits)} "
              f"budget{'s' * (len(fits) != 1)}\n")
        print("\n".join(_fit_table(forest)) + "\n")
        fitted += 1
    if fitted:
        print(_fit_legend(fitted, failed))
        print("\n".join(_fit_code(merged)))
    return EXIT_BAD_INPUT if failed else 0


class _Prefixed:
    """A progress callback that puts ``prefix`` before each message."""

    def __init__(self, prefix: str, progress: Callable[[str], None]) -> None:
        self.prefix = prefix
        self.progress = progress

    def __call__(self, message: str) -> None:
        self.progress(self.prefix + message)


def _fit_legend(fitted: int, failed: int) -> str:
    which = "the trace replays" if fitted == 1 else f"all {fitted} traces replay"
    skipped = f" ({failed} more could not be read: see above)" if failed else ""
    return ("peak: the most the run was granted. denied: the largest request it was refused,"
            "\nreplayed as a probe (memory the program wanted), so the limit found grants it."
            f"\n\n# Smallest limits under which {which} without a denial{skipped}:")


# -- main --------------------------------------------------------------------------------


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
    return parser


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            demo(None if args.no_plot else args.plot, args.backend)
            return 0
        if args.command == "report":
            report_command(args.trace, args.plot, args.json, args.root, args.max_size)
            return 0
        return fit_command(args.traces, args.max_size)
    except BrokenPipeError:
        raise
    except (_Failure, GpuBudgetError, ValueError, ImportError) as exc:
        _say(f"error: {exc}")
    except OSError as exc:
        _say(f"error: {exc.strerror or exc}"
             + (f": {exc.filename!r}" if exc.filename is not None else ""))
    except MemoryError:
        _say("error: out of memory")
    except Exception as exc:  # noqa: BLE001 - the command line never shows a traceback
        if os.environ.get(DEBUG_ENV):
            raise
        _say(f"internal error: {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 to see the "
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
            warnings.showwarning = _show_warning
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
            _say("interrupted")
        except OSError:
            pass
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
