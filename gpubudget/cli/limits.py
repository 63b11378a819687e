"""The limits file of ``gpubudget fit --check``: Python (the code ``fit`` prints) or TOML,
read into one :class:`Limits`; a bad file is a :class:`~gpubudget.cli.output.Failure` of
one line.

Besides a limit, each budget of the file may carry three settings, each the way to say
"this is on purpose" about something the gate otherwise fails on:

==============================  =========================================================
TOML key (Python: a comment)    meaning
==============================  =========================================================
``denials = "expected"``        the run's denied requests in this budget are expected: it
                                must fit what the run was granted, not what it was refused
``absent = "ok"``               the run may not hold this budget at all
``unlisted = "unchecked"``      budgets of the run at or inside this one that the file
                                gives no limit are listed, not checked
==============================  =========================================================

In a Python file a setting is a comment on the line of the ``gpu_budget(...)`` call::

    with gpu_budget("1.5GiB", name="classifier"):  # gpubudget: denials=expected

``denials = "fail"``, ``absent = "fail"`` and ``unlisted = "fail"`` are the defaults, and
may be written out.
"""

from __future__ import annotations

import ast
import difflib
import io
import os
import stat
import textwrap
import tokenize
from dataclasses import dataclass, field
from typing import Any, Final

from ..text import printable
from ..units import parse_size
from .output import Failure

__all__ = ["SETTINGS", "Limits", "Path", "Settings", "read_limits"]

Path = tuple[str, ...]
"""A budget's names from its root down: ``("shared", "detector")``."""

SETTINGS: Final = {"denials": "expected", "absent": "ok", "unlisted": "unchecked"}
"""Each setting a budget of the limits file may carry, and the value that turns it on (the
other value allowed is ``"fail"``, the default)."""
_CALLS: Final = ("gpu_budget", "Budget")
_PRAGMA: Final = "gpubudget:"
_MAX_BYTES: Final = 1 << 20
_MAX_KEY_PARTS: Final = 128
"""Names in one TOML key or table header (``[a.b.c]``) at most: budgets nest far less deep,
and the TOML reader's time grows with the square of a key's parts."""
_MAX_ALL_KEY_PARTS: Final = 50_000
"""Names in all the keys and headers of a TOML limits file together, at most."""


@dataclass(frozen=True)
class Settings:
    """What one budget of the limits file allows besides its limit (all off by default)."""

    denials: bool = False
    """Its denials in the run are expected (``denials = "expected"``)."""
    absent: bool = False
    """The run may lack it (``absent = "ok"``)."""
    unlisted: bool = False
    """Budgets of the run at or inside it without a limit are not checked
    (``unlisted = "unchecked"``)."""


@dataclass(frozen=True)
class Limits:
    """What a limits file says: a limit per budget path, and each path's settings.

    ``named`` holds every path the file names, a limit or not (a TOML table may only hold
    the tables of the budgets inside it).
    """

    shown: str
    """The file's name, safe to print."""
    limits: dict[Path, int]
    named: dict[Path, Settings] = field(default_factory=dict)

    def settings(self, path: Path) -> Settings:
        return self.named.get(path, Settings())

    def roots(self) -> set[str]:
        """The root budgets the file names: it speaks for their whole trees."""
        return {path[0] for path in self.named}

    def unlisted_unchecked(self, path: Path) -> bool:
        """Whether ``path`` or a budget above it says ``unlisted = "unchecked"``."""
        return any(self.settings(path[:depth]).unlisted for depth in range(1, len(path) + 1))


def _settings(values: dict[str, str], where: str) -> Settings:
    """:class:`Settings` from ``{key: value}``; a :class:`Failure` naming ``where`` for an
    unknown key or value."""
    found: dict[str, bool] = {}
    for key, value in values.items():
        on = SETTINGS.get(key)
        if on is None:
            raise Failure(f"{where}: unknown setting {key!r} (the settings: "
                          f"{', '.join(f'{k} = {v!r}' for k, v in SETTINGS.items())})")
        if value not in (on, "fail"):
            raise Failure(f"{where}: {key} must be {on!r} or 'fail', not {value!r}")
        found[key] = value == on
    return Settings(**found)


# -- Python --------------------------------------------------------------------------------


def _literal_limit(call: ast.Call, where: str) -> int:
    node = call.args[0] if call.args else next(
        (k.value for k in call.keywords if k.arg == "limit"), None)
    if node is None:
        raise Failure(f"{where}: gpu_budget(...) without a limit")
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
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


def _pragmas(text: str, shown: str) -> dict[int, dict[str, str]]:
    """Line -> the settings of its ``# gpubudget: key=value, ...`` comment."""
    found: dict[int, dict[str, str]] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type != tokenize.COMMENT:
                continue
            comment = token.string[1:].strip()
            if not comment.startswith(_PRAGMA):
                continue
            where = f"{shown}:{token.start[0]}"
            values: dict[str, str] = {}
            for part in comment[len(_PRAGMA):].replace(",", " ").split():
                key, equals, value = part.partition("=")
                if not equals:
                    raise Failure(f"{where}: {part!r} in a '# gpubudget:' comment is not "
                                  f"key=value (e.g. denials=expected)")
                values[key] = value.strip("\"'")
            found[token.start[0]] = values
    except (tokenize.TokenError, SyntaxError):
        pass  # the parser says what is wrong, better
    return found


def _from_python(text: str, shown: str) -> Limits:
    text = textwrap.dedent(text)
    try:
        tree = ast.parse(text, filename=shown)
    except (RecursionError, MemoryError):
        raise Failure(f"{shown}: nested too deeply to be a limits file (the code "
                      f"'gpubudget fit' prints nests one 'with' block per budget)") from None
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        raise Failure(f"{shown}{f':{line}' if line else ''}: not Python ({getattr(exc, 'msg', exc)}); "
                      f"TOML limits go in a file named *.toml") from None
    pragmas = _pragmas(text, shown)
    limits: dict[Path, int] = {}
    named: dict[Path, Settings] = {}
    calls_on: dict[int, int] = {}  # line -> budget calls on it
    stack: list[tuple[ast.AST, Path]] = [(tree, ())]
    found: list[tuple[ast.Call, Path]] = []
    while stack:  # a loop: the nesting may be deep
        node, path = stack.pop()
        inner = path
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                call = _budget_call(item)
                if call is None:
                    continue
                where = f"{shown}:{call.lineno}"
                name = next((k.value for k in call.keywords if k.arg == "name"), None)
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                    raise Failure(f"{where}: gpu_budget(...) without a name=\"...\" string: "
                                  f"it cannot be matched to a recorded budget")
                inner = inner + (name.value,)
                first = next((c for c, p in found if p == inner), None)
                if first is not None:
                    raise Failure(f"{where}: a second limit for budget "
                                  f"{printable('/'.join(inner))!r} (the first is on line "
                                  f"{first.lineno}): give each budget one limit")
                limits[inner] = _literal_limit(call, where)
                found.append((call, inner))
                for line in range(call.lineno, (call.end_lineno or call.lineno) + 1):
                    calls_on[line] = calls_on.get(line, 0) + 1
        stack.extend((child, inner) for child in reversed(list(ast.iter_child_nodes(node))))
    if not limits:
        raise Failure(f"{shown}: no 'with gpu_budget(..., name=...)' block in it")
    for call, path in found:
        lines = range(call.lineno, (call.end_lineno or call.lineno) + 1)
        marked = [line for line in lines if line in pragmas]
        for line in marked:
            if calls_on[line] > 1:
                raise Failure(f"{shown}:{line}: a '# gpubudget:' comment on a line with "
                              f"several gpu_budget(...) calls: put each on its own line")
        values = {key: value for line in marked for key, value in pragmas[line].items()}
        named[path] = _settings(values, f"{shown}:{call.lineno}")
    unused = set(pragmas) - set(calls_on)
    if unused:
        line = min(unused)
        raise Failure(f"{shown}:{line}: a '# gpubudget:' comment belongs on the line of a "
                      f"gpu_budget(...) call")
    return Limits(shown, limits, named)


# -- TOML ----------------------------------------------------------------------------------


def _check_keys(text: str, shown: str) -> None:
    """A :class:`Failure` for a key or table header of more names than a limits file needs
    (:data:`_MAX_KEY_PARTS`, :data:`_MAX_ALL_KEY_PARTS` in all): read before the TOML
    reader, whose time grows with the square of a key's names. A dot in a quoted key counts
    too; the bounds are far above what a tree of budgets needs."""
    total = 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        key = stripped.partition("]")[0] if stripped.startswith("[") else line.partition("=")[0]
        parts = key.count(".") + 1
        if parts > _MAX_KEY_PARTS:
            raise Failure(f"{shown}:{number}: a key of {parts:,} dotted names; budgets are "
                          f"not nested that deep (at most {_MAX_KEY_PARTS} names a key)")
        total += parts
        if total > _MAX_ALL_KEY_PARTS:
            raise Failure(f"{shown}:{number}: more than {_MAX_ALL_KEY_PARTS:,} key names; "
                          f"not a limits file")


def _from_toml(text: str, shown: str) -> Limits:
    try:
        import tomllib as toml
    except ImportError:  # Python 3.10
        try:
            import tomli as toml  # type: ignore[import-not-found, no-redef]
        except ImportError:
            raise Failure("TOML limits need Python 3.11 or tomli: pip install tomli") from None
    _check_keys(text, shown)
    try:
        data = toml.loads(text)
    except (RecursionError, MemoryError):
        raise Failure(f"{shown}: nested too deeply to be a limits file") from None
    except toml.TOMLDecodeError as exc:
        raise Failure(f"{shown}: not valid TOML ({exc})") from None
    except ValueError as exc:  # an integer of thousands of digits
        reason = printable(str(exc)).partition(";")[0][:200]
        raise Failure(f"{shown}: a value that cannot be read ({reason})") from None
    limits: dict[Path, int] = {}
    named: dict[Path, Settings] = {}
    stack: list[tuple[Path, dict[str, Any]]] = [((name,), table) for name, table in
                                                data.items() if isinstance(table, dict)]
    if len(stack) != len(data):
        raise Failure(f"{shown}: every top-level key must be a [table] named after a root "
                      f"budget")
    while stack:
        path, table = stack.pop()
        where = f"{shown}: [{'.'.join(path)}]"
        values: dict[str, str] = {}
        for key, value in table.items():
            if isinstance(value, dict):
                stack.append((path + (key,), value))
            elif key == "limit":
                try:
                    limits[path] = parse_size(value, what=f"[{'.'.join(path)}] limit")
                except (TypeError, ValueError) as exc:
                    raise Failure(f"{shown}: {exc}") from None
            elif key in SETTINGS:
                if not isinstance(value, str):
                    raise Failure(f"{where}: {key} must be {SETTINGS[key]!r} or 'fail', "
                                  f"not {value!r}")
                values[key] = value
            else:
                close = difflib.get_close_matches(key, ("limit", *SETTINGS), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise Failure(f"{where} has {key!r}{hint}: only 'limit', "
                              f"{', '.join(repr(k) for k in SETTINGS)} and tables of the "
                              f"budgets inside it are read")
        named[path] = _settings(values, where)
    if not limits:
        raise Failure(f"{shown}: no budget with a limit in it")
    return Limits(shown, limits, named)


def _read(path: str, shown: str) -> bytes:
    """At most :data:`_MAX_BYTES` + 1 bytes of the regular file at ``path``, opened without
    waiting (a FIFO with no writer) and checked once open: what is checked is what is read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise Failure(f"{shown}: a directory, not a limits file")
        if not stat.S_ISREG(mode):
            raise Failure(f"{shown}: not a regular file (a pipe or a device); a limits file "
                          f"is read from a file")
        with open(fd, "rb", closefd=False) as file:
            return file.read(_MAX_BYTES + 1)
    finally:
        os.close(fd)


def read_limits(path: str) -> Limits:
    """The limits file at ``path`` (TOML if its name ends in ``.toml``, else Python); a
    :class:`~gpubudget.cli.output.Failure` in one line for a bad one.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "limits.toml")
    >>> with open(path, "w") as file:
    ...     _ = file.write('[pool]\\nlimit = "4GiB"\\n[pool.model]\\nlimit = "1GiB"\\n'
    ...                    'denials = "expected"\\n')
    >>> limits = read_limits(path)
    >>> limits.limits[("pool", "model")], limits.settings(("pool", "model")).denials
    (1073741824, True)
    """
    shown = printable(path)
    try:
        raw = _read(path, shown)
    except OSError as exc:
        raise Failure(f"{shown}: {exc.strerror or exc}") from None
    if len(raw) > _MAX_BYTES:
        raise Failure(f"{shown}: over 1 MiB; not a limits file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Failure(f"{shown}: not UTF-8 text") from None
    if path.lower().endswith(".toml"):
        return _from_toml(text, shown)
    return _from_python(text, shown)
