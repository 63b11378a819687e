"""The layout drawn in docs/architecture.md holds, rule by rule as the page states them: the
drawing is whole, every unit imports only units drawn below it, the private folders are
entered by the budget layer alone and through their door, the tools, adapters and reports use
the public API, and no module imports another's private names."""

from __future__ import annotations

import ast
import importlib.machinery
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "gpubudget"
PAGE = ROOT / "docs" / "architecture.md"

HEADINGS = ("TOOLS", "ADAPTERS", "THE BUDGET LAYER", "REPORTS", "MACHINERY", "PLUMBING",
            "FOUNDATION")
"""The drawing's headings, top down: the rules below name some of them."""
PUBLIC_API_ONLY = ("TOOLS", "ADAPTERS", "REPORTS")


# -- the drawing -------------------------------------------------------------------------------


@dataclass
class Drawing:
    paths: list[str]
    """Every file and folder drawn, relative to the package (folders end with ``/``)."""
    units: list[str]
    """The units (a file at the top, without ``.py``; a folder, without ``/``), top down."""
    heading: dict[str, str]
    """The heading each unit is drawn under."""

    def under(self, *headings: str) -> set[str]:
        return {unit for unit, heading in self.heading.items() if heading in headings}


_HEADING = re.compile(r"^│ ([A-Z][A-Z ]*[A-Z])(?::|$)")
_ENTRY = re.compile(r"^((?:│   |    )*)(?:├── |└── )(\S+)")


def drawing(text: str | None = None) -> Drawing:
    """The tree of the page's section "The layout" (its first code block), read."""
    text = PAGE.read_text(encoding="utf-8") if text is None else text
    block = text.split("\n## The layout\n", 1)[1].split("```", 2)[1]
    lines = block.splitlines()[1:]  # past the language tag
    assert lines[0].startswith("gpubudget/"), lines[0]
    found = Drawing([], [], {})
    heading = ""
    folders: list[str] = []
    for line in lines[1:]:
        if (match := _HEADING.match(line)) is not None:
            heading = match.group(1)
            continue
        match = _ENTRY.match(line)
        if match is None:
            assert line.strip() in ("", "│"), f"not a line of the drawing: {line!r}"
            continue
        depth, name = len(match.group(1)) // 4, match.group(2)
        del folders[depth:]
        found.paths.append("".join(folders) + name)
        if name.endswith("/"):
            folders.append(name)
        if depth == 0 and (name.endswith("/") or name.endswith(".py")):
            unit = name.removesuffix("/").removesuffix(".py")
            found.units.append(unit)
            found.heading[unit] = heading
    return found


def files_on_disk() -> set[str]:
    """Every file and folder of the package but what Python or a build makes."""
    made = tuple(importlib.machinery.EXTENSION_SUFFIXES) + (".pyc",)
    found = set()
    for path in PACKAGE.rglob("*"):
        relative = path.relative_to(PACKAGE)
        if "__pycache__" in relative.parts or path.name.endswith(made):
            continue
        found.add(relative.as_posix() + ("/" if path.is_dir() else ""))
    return found


# -- what a file imports -----------------------------------------------------------------------


def unit_of(path: Path) -> str:
    """The unit a source file belongs to (a folder's files belong to the folder)."""
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _module(path: Path, node: ast.ImportFrom) -> list[str] | None:
    """The module ``node`` imports from, as parts below the package (``[]``: the package
    itself), or ``None`` for a module outside gpubudget."""
    if node.level == 0:
        parts = (node.module or "").split(".")
        return parts[1:] if parts[0] == "gpubudget" else None
    here = list(path.relative_to(PACKAGE).parent.parts)
    base = here[: len(here) - (node.level - 1)]
    return [*base, *(node.module.split(".") if node.module else [])]


def _is_module(parts: list[str]) -> bool:
    """Whether ``parts`` name a module (Python, a stub, or a C extension built here) or a
    folder of the package."""
    where = PACKAGE.joinpath(*parts)
    suffixes = (".py", ".pyi", *importlib.machinery.EXTENSION_SUFFIXES)
    return where.is_dir() or any(Path(f"{where}{suffix}").exists() for suffix in suffixes)


def _tree(path: Path, source: str | None) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8") if source is None else source)


def imported(path: Path, source: str | None = None,
             tree: ast.Module | None = None) -> list[tuple[list[str], ast.stmt]]:
    """Every module of gpubudget that ``path`` (or ``source``, as if it were at ``path``)
    imports, anywhere (at import time, under ``TYPE_CHECKING``, inside a function; by
    ``from`` or plain ``import``), as parts below the package, with the statement:
    ``from ._core import Tree`` is ``["_core"]``, ``from . import view`` in ``_budget/`` is
    ``["_budget", "view"]``, ``from .. import __version__`` is ``[]``."""
    found: list[tuple[list[str], ast.stmt]] = []
    for node in ast.walk(tree if tree is not None else _tree(path, source)):
        if isinstance(node, ast.ImportFrom):
            parts = _module(path, node)
            if parts is None:
                continue
            for alias in node.names:
                found.append(([*parts, alias.name] if _is_module([*parts, alias.name])
                              else parts, node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "gpubudget":
                    found.append((parts[1:], node))
    return found


def _unit(parts: list[str]) -> str:
    return parts[0] if parts else "__init__"


def imports_anywhere(path: Path) -> set[str]:
    """The units ``path`` imports, anywhere."""
    return {_unit(parts) for parts, _ in imported(path)}


def imports_at_import_time(path: Path, source: str | None = None) -> set[str]:
    """The units ``path`` imports when it is imported: not under ``TYPE_CHECKING``, not
    inside a function."""
    tree = _tree(path, source)
    at_import: set[int] = set()
    stack: list[ast.AST] = [node for node in tree.body if not (
        isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))]
    while stack:
        node = stack.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            at_import.add(id(node))
            stack.extend(ast.iter_child_nodes(node))
    return {_unit(parts) for parts, node in imported(path, tree=tree) if id(node) in at_import}


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


# -- the rules ---------------------------------------------------------------------------------


def test_the_drawing_has_its_headings_in_order() -> None:
    seen = list(dict.fromkeys(drawing().heading.values()))
    assert seen == list(HEADINGS)


def test_the_drawing_is_whole() -> None:
    """Rule 5: every file and folder drawn, once, and nothing that is not there."""
    drawn = drawing().paths
    assert [path for path in drawn if drawn.count(path) > 1] == []
    on_disk = files_on_disk()
    assert sorted(on_disk - set(drawn)) == [], "on disk, not drawn"
    assert sorted(set(drawn) - on_disk) == [], "drawn, not on disk"


def test_each_unit_imports_at_import_time_only_units_drawn_below_it() -> None:
    """Rule 1."""
    rank = {unit: index for index, unit in enumerate(drawing().units)}
    wrong = []
    for path in sources():
        unit = unit_of(path)
        for target in imports_at_import_time(path) - {unit}:
            if target in rank and rank[target] < rank[unit]:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}, drawn above it")
    assert wrong == []


def test_private_folders_are_entered_by_the_budget_layer_through_their_door() -> None:
    """Rule 2."""
    layout = drawing()
    private = {unit for unit in layout.units if unit.startswith("_")
               and (PACKAGE / unit).is_dir()}
    assert private == {"_budget", "_core"}
    layer = layout.under("THE BUDGET LAYER")
    wrong = []
    for path in sources():
        unit = unit_of(path)
        for parts, _ in imported(path):
            if not parts or parts[0] not in private or parts[0] == unit:
                continue
            if unit not in layer:
                wrong.append(f"{path.relative_to(ROOT)} ({unit}) imports {parts[0]}")
            elif len(parts) > 1:
                wrong.append(f"{path.relative_to(ROOT)} imports {'.'.join(parts)}, behind the "
                             f"door of {parts[0]}")
    assert wrong == []


def test_tools_adapters_and_reports_use_the_public_api() -> None:
    """Rule 3."""
    layout = drawing()
    closed = layout.under("PLUMBING") | {unit for unit in layout.units
                                         if unit.startswith("_") and (PACKAGE / unit).is_dir()}
    wrong = []
    for path in sources():
        if layout.heading.get(unit_of(path)) in PUBLIC_API_ONLY:
            for target in sorted(imports_anywhere(path) & closed):
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert wrong == []


def private_names_taken(path: Path, source: str | None = None) -> list[str]:
    """Names beginning with ``_`` that ``path`` imports from another module of gpubudget, or
    reads as ``x._y`` of a module ``x`` of gpubudget it imported (private folders are rule
    2's; a class's ``_make`` or ``_replace`` is no module's name)."""
    tree = _tree(path, source)
    own = list(path.relative_to(PACKAGE).with_suffix("").parts)
    taken, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = _module(path, node)
            if parts is None:
                continue
            for alias in node.names:
                if _is_module([*parts, alias.name]):
                    bound.add(alias.asname or alias.name)
                if (alias.name.startswith("_") and not alias.name.startswith("__")
                        and parts != own and not _is_module([*parts, alias.name])):
                    taken.append(f"{'.'.join(['gpubudget', *parts])}.{alias.name}")
        elif isinstance(node, ast.Import):
            bound |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] == "gpubudget"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            taken.append(f"{node.value.id}.{node.attr}")
    return taken


def test_no_module_imports_another_modules_private_names() -> None:
    """Rule 4."""
    wrong = [f"{path.relative_to(ROOT)}: {name}" for path in sources()
             for name in private_names_taken(path)]
    assert wrong == []


# -- the checkers themselves -------------------------------------------------------------------


def test_the_checkers_see_every_kind_of_import() -> None:
    where = PACKAGE / "cli" / "probe.py"  # read as if it were there; no such file is made
    source = ("from __future__ import annotations\n"
              "import gpubudget._core.tree\n"
              "from typing import TYPE_CHECKING\n"
              "from ..tracefile.format import _quote, MAX_FRAMES\n"
              "if TYPE_CHECKING:\n    from .. import budget\n"
              "def f() -> None:\n    from .._budget import view\n    view._private\n"
              "from .. import interrupts, __version__\n")
    assert {tuple(parts) for parts, _ in imported(where, source)} == {
        ("_core", "tree"), ("tracefile", "format"), ("budget",), ("_budget", "view"),
        ("interrupts",), ()}
    assert imports_at_import_time(where, source) == {"_core", "tracefile", "interrupts",
                                                     "__init__"}
    assert private_names_taken(where, source) == ["gpubudget.tracefile.format._quote",
                                                  "view._private"]


def test_the_drawing_is_read_line_by_line() -> None:
    page = ("\n## The layout\n\n```\ngpubudget/        the package\n│\n"
            "│ TOOLS: what the user runs\n"
            "├── cli/            the command\n"
            "│   ├── __init__.py  its parts\n"
            "│   └── engine.py    one of them\n"
            "├── metrics.py      metrics\n│\n"
            "│ FOUNDATION\n"
            "├── units.py        sizes\n"
            "└── py.typed        typed\n```\n")
    read = drawing(page)
    assert read.paths == ["cli/", "cli/__init__.py", "cli/engine.py", "metrics.py", "units.py",
                          "py.typed"]
    assert read.units == ["cli", "metrics", "units"]
    assert read.heading == {"cli": "TOOLS", "metrics": "TOOLS", "units": "FOUNDATION"}
