"""``gpubudget fit --check LIMITS TRACE...``: a CI gate. Exit 1, with a table of the budgets
that need more, when a recorded run needs more than LIMITS allow; 0 when it fits.

LIMITS is either the code ``gpubudget fit`` prints (or any Python with nested
``with gpu_budget("2GiB", name="detector"):`` blocks: the limit a literal, the name a
``name=`` string), or a TOML file (``.toml``) of nested tables, one per budget, each with a
``limit``::

    [shared]
    limit = "4GiB"

    [shared.detector]
    limit = "2GiB"

Budgets are matched by their path of names from the root (``shared/detector``), as ``fit``
groups them: the largest need of budgets sharing a path is checked. Budgets of the run that
LIMITS does not name are listed, not checked.
"""

from __future__ import annotations

import ast
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, Final

from ..errors import GpuBudgetError
from ..replay import fit
from ..tracefile import TraceReader, printable
from ..units import format_size, parse_size
from .output import Failure

__all__ = ["EXIT_OVER", "check_command", "read_limits"]

EXIT_OVER: Final = 1
"""The exit status when the run needs more than the limits allow."""
_CALLS: Final = ("gpu_budget", "Budget")

Path = tuple[str, ...]


def _literal_limit(call: ast.Call, where: str) -> int:
    node = call.args[0] if call.args else next(
        (k.value for k in call.keywords if k.arg == "limit"), None)
    if node is None:
        raise Failure(f"{where}: gpu_budget(...) without a limit")
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        raise Failure(f"{where}: the limit is not written out (a literal such as \"2GiB\" "
                      f"or 2147483648)") from None
    try:
        return parse_size(value, what="the limit")
    except (ValueError, TypeError) as exc:
        raise Failure(f"{where}: {exc}") from None


def _budget_call(item: ast.withitem) -> ast.Call | None:
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return None
    func = call.func
    name = func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else "")
    return call if name in _CALLS else None


def _from_python(text: str, shown: str) -> dict[Path, int]:
    try:
        tree = ast.parse(textwrap.dedent(text), filename=shown)
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        raise Failure(f"{shown}{f':{line}' if line else ''}: not Python ({getattr(exc, 'msg', exc)}); "
                      f"TOML limits go in a file named *.toml") from None
    limits: dict[Path, int] = {}
    stack: list[tuple[ast.AST, Path]] = [(tree, ())]
    while stack:  # a loop: the nesting may be deep
        node, path = stack.pop()
        inner = path
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                call = _budget_call(item)
                if call is None:
                    continue
                where = f"{shown}:{call.lineno}"
                named = next((k.value for k in call.keywords if k.arg == "name"), None)
                if not (isinstance(named, ast.Constant) and isinstance(named.value, str)):
                    raise Failure(f"{where}: gpu_budget(...) without a name=\"...\" string: "
                                  f"it cannot be matched to a recorded budget")
                inner = inner + (named.value,)
                limits[inner] = _literal_limit(call, where)
        stack.extend((child, inner) for child in reversed(list(ast.iter_child_nodes(node))))
    if not limits:
        raise Failure(f"{shown}: no 'with gpu_budget(..., name=...)' block in it")
    return limits


def _from_toml(text: str, shown: str) -> dict[Path, int]:
    try:
        import tomllib as toml
    except ImportError:  # Python 3.10
        try:
            import tomli as toml  # type: ignore[import-not-found, no-redef]
        except ImportError:
            raise Failure("TOML limits need Python 3.11 or tomli: pip install tomli") from None
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise Failure(f"{shown}: not valid TOML ({exc})") from None
    limits: dict[Path, int] = {}
    stack: list[tuple[Path, dict[str, Any]]] = [((name,), table) for name, table in
                                                data.items() if isinstance(table, dict)]
    if len(stack) != len(data):
        raise Failure(f"{shown}: every top-level key must be a [table] named after a root "
                      f"budget")
    while stack:
        path, table = stack.pop()
        for key, value in table.items():
            if isinstance(value, dict):
                stack.append((path + (key,), value))
            elif key == "limit":
                try:
                    limits[path] = parse_size(value, what=f"[{'.'.join(path)}] limit")
                except (TypeError, ValueError) as exc:
                    raise Failure(f"{shown}: {exc}") from None
            else:
                raise Failure(f"{shown}: [{'.'.join(path)}] has {key!r}: only 'limit' and "
                              f"tables of the budgets inside it are read")
    if not limits:
        raise Failure(f"{shown}: no budget with a limit in it")
    return limits


def read_limits(path: str) -> dict[Path, int]:
    """Budget path (names from the root) -> limit, from a Python or TOML file; a
    :class:`~gpubudget.cli.output.Failure` in one line for a bad one."""
    shown = printable(path)
    try:
        with open(path, "rb") as file:
            raw = file.read((1 << 20) + 1)
    except OSError as exc:
        raise Failure(f"{shown}: {exc.strerror or exc}") from None
    if len(raw) > 1 << 20:
        raise Failure(f"{shown}: over 1 MiB; not a limits file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Failure(f"{shown}: not UTF-8 text") from None
    if path.lower().endswith(".toml"):
        return _from_toml(text, shown)
    return _from_python(text, shown)


def _needs(paths: Sequence[str], max_bytes: int) -> dict[Path, int]:
    """Budget path -> the largest fitted limit among the traces (``fit``'s numbers)."""
    files: list[str] = []
    for path in paths:
        if path != "-" and os.path.isdir(path):
            files += sorted(os.path.join(path, name) for name in os.listdir(path)
                            if name.endswith(".jsonl"))
        else:
            files.append(path)
    if not files:
        raise Failure("no .jsonl trace in " + ", ".join(printable(p) for p in paths))
    needs: dict[Path, int] = {}
    for path in files:
        with TraceReader(path, max_bytes=max_bytes) as reader:
            fits = fit(reader)
        where: dict[int, Path] = {}
        for found in fits:  # parents before children
            key = (where[found.parent] if found.parent is not None else ()) + (found.name,)
            where[found.budget] = key
            needs[key] = max(needs.get(key, 0), found.limit)
    return needs


def _literal(nbytes: int) -> str:
    """``nbytes`` as a limit is written: ``"9MiB"`` when a unit divides it, else bytes."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % factor == 0:
            return f'"{nbytes // factor}{unit}"'
    return str(nbytes)


def check_command(limits_path: str, traces: Sequence[str], max_bytes: int) -> int:
    """Compare what ``traces`` need with the limits in ``limits_path``; print the table."""
    limits = read_limits(limits_path)
    try:
        needs = _needs(traces, max_bytes)
    except (GpuBudgetError, ValueError) as exc:
        raise Failure(str(exc)) from None
    checked = [path for path in needs if path in limits]
    if not checked:  # a gate that checks nothing must not pass
        raise Failure(f"none of the budgets of {printable(limits_path)} is in the run (its "
                      f"root budgets: {', '.join(sorted({printable(p[0]) for p in needs}))}); "
                      f"names are matched from the root down")
    over = [path for path in checked if needs[path] > limits[path]]
    shown = printable(limits_path)
    width = max([len("budget")] + [len(printable("/".join(p))) for p in checked])
    lines = [f"  {'budget':<{width}}  {'limit':>10}  {'needs':>10}"]
    for path in sorted(checked, key=lambda p: (p not in over, p)):
        name = printable("/".join(path))
        verdict = (f"+{format_size(needs[path] - limits[path])} over" if path in over
                   else "ok")
        lines.append(f"{'-' if path in over else ' '} {name:<{width}}  "
                     f"{format_size(limits[path]):>10}  {format_size(needs[path]):>10}  "
                     f"{verdict}")
    if over:
        lines.append("to fit, change:")
        for path in sorted(over):
            lines.append(f"  {printable('/'.join(path))}: {_literal(limits[path])} -> "
                         f"{_literal(needs[path])}")
    unchecked = [printable("/".join(p)) for p in needs if p not in limits]
    missing = [printable("/".join(p)) for p in limits if p not in needs]
    if over:
        print(f"gpubudget fit --check: {len(over)} budget(s) need more than {shown} allows")
    else:
        print(f"gpubudget fit --check: the run fits in {shown}")
    print("\n".join(lines))
    if unchecked:
        print(f"not in {shown} (not checked): {', '.join(unchecked)}")
    if missing:
        print(f"in {shown} but not in the run: {', '.join(missing)}")
    sys.stdout.flush()
    return EXIT_OVER if over else 0

