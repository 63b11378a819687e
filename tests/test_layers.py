"""The module map in docs/architecture.md holds: each module imports only those above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "gpubudget"


def documented_order() -> list[str]:
    """Module names (``tree``, ``backends``, ``tensorrt``...) in the order of the table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    order: list[str] = []
    for cell in re.findall(r"^\| (.+?) \|", text, flags=re.M):
        for name in re.findall(r"`([a-z_]+)(?:\.py|/)`", cell):
            order.append(name)
    return order


def unit_of(path: Path) -> str:
    """The table entry a source file belongs to (a package's files belong to the package)."""
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imports_at_run_time(path: Path) -> set[str]:
    """Units of gpubudget that ``path`` imports when it is imported (not under
    ``TYPE_CHECKING``, not inside functions)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for child in ast.walk(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            if isinstance(child, ast.ImportFrom):
                found |= _targets(path, child)
    return found


def _targets(path: Path, node: ast.ImportFrom) -> set[str]:
    if node.level == 0:
        parts = (node.module or "").split(".")
        if parts[0] != "gpubudget":
            return set()
        parts = parts[1:]
    else:
        base = path.parent.relative_to(PACKAGE).parts[: len(path.parent.relative_to(PACKAGE).parts)
                                                      - (node.level - 1)]
        parts = [*base, *(node.module.split(".") if node.module else [])]
    if not parts:  # ``from . import x, y``
        return {alias.name for alias in node.names}
    return {parts[0]}


def test_every_module_is_in_the_table() -> None:
    order = documented_order()
    units = {unit_of(path) for path in PACKAGE.rglob("*.py")} - {"__init__", "__main__"}
    assert units <= set(order), units - set(order)


def test_no_module_imports_one_below_it() -> None:
    order = documented_order()
    rank = {name: index for index, name in enumerate(order)}
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        unit = unit_of(path)
        if unit in ("__init__", "__main__"):
            continue
        for target in imports_at_run_time(path):
            if target != unit and target in rank and rank[target] > rank[unit]:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert wrong == []


# Adapters and tools use the package's public names and ``adapter.py``, nothing of its
# plumbing: not at import, not inside a function, not by ``import gpubudget.x``.
ADAPTERS_AND_TOOLS = {"tensorrt", "cupy", "torch", "routing", "ray", "replay", "cli", "metrics",
                      "html", "perfetto", "pytest_plugin", "plot"}
PLUMBING = {"_core", "interrupts", "context", "callers", "_budget"}
# Who may use the private core: the layer right above it.
CORE_USERS = {"_core", "budget", "_budget", "adapter", "hostledger"}


def imports_anywhere(path: Path) -> set[str]:
    """Units of gpubudget that ``path`` imports anywhere: at import, under
    ``TYPE_CHECKING``, inside functions, by ``from`` or by plain ``import``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found |= _targets(path, node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "gpubudget" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_adapters_and_tools_use_the_interface_not_the_plumbing() -> None:
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        unit = unit_of(path)
        if unit not in ADAPTERS_AND_TOOLS:
            continue
        for target in imports_anywhere(path) & PLUMBING:
            wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert sorted(wrong) == []


def test_only_the_layer_above_the_core_imports_it() -> None:
    wrong = [f"{path.relative_to(ROOT)}" for path in PACKAGE.rglob("*.py")
             if unit_of(path) not in CORE_USERS | {"__init__"} and "_core" in imports_anywhere(path)]
    assert wrong == []


def test_the_checker_sees_plain_imports_and_function_bodies(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import gpubudget._core.tree\n"
                     "def f():\n    from gpubudget.interrupts import STATE\n")
    assert imports_anywhere(probe) == {"_core", "interrupts"}
