"""The README and the pages of docs/ stay true: their examples run (a fresh process per page,
on the host backend), a block that cannot run here says why and still names only what
exists, every local link and anchor resolves, the commands they show exist, and the numbers
they state are the code's. The convention is in ``tests/docs_examples.py``."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import io
import json
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpubudget
from gpubudget import gpu_budget
from gpubudget.cli import main
from gpubudget.hostledger import SETTLE_SECONDS, book, sizing
from gpubudget.report import TAGS_SHOWN
from gpubudget.tracefile import (BUFFER_BYTES, FLUSH_BYTES, FLUSH_SECONDS, MAX_FRAMES, MAX_LINE_BYTES,
                                 MAX_TEXT, MAX_TRACE_BYTES)
from gpubudget.units import GiB, MiB
from tests.docs_examples import ROOT, SELF_TESTED, Block, blocks, pages, prose
from tests.helpers import subprocess_env

PAGES = pages()
ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]
NOT_RUN_AT_MOST = 7
"""Blocks marked not to run here, all pages together: each needs a GPU, a framework, a
cluster or the reader's own model. Raise it only for a block that cannot run here either."""


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


# -- examples --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "page", [page for page in PAGES if any(block.runs_here for block in blocks(page))],
    ids=_name)
def test_the_examples_run(page: Path, tmp_path: Path) -> None:
    env = subprocess_env(GPUBUDGET_BACKEND="host", GPUBUDGET_LEDGER_DIR=str(tmp_path / "ledger"),
                         PYTHONPATH=str(ROOT))
    for name in ("GPUBUDGET_TRACE", "GPUBUDGET_DEVICE_MEMORY", "GPUBUDGET_DEVICE_CAP",
                 "GPUBUDGET_HEADROOM", "GPUBUDGET_PURE"):
        env.pop(name, None)
    if not gpubudget.compiled:  # the suite's choice of core, for the page's process too
        env["GPUBUDGET_PURE"] = "1"
    result = subprocess.run([sys.executable, "-m", "tests.docs_examples", str(page)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_pages_new_to_users_have_examples_that_run() -> None:
    """The README and the pages of what a budget does show code that runs here."""
    for name in ("README.md", "docs/semantics.md", "docs/reports.md", "docs/traces.md",
                 "docs/growable.md", "docs/sharing.md"):
        assert any(block.runs_here for block in blocks(ROOT / name)), name


def test_every_block_of_code_runs_or_says_why() -> None:
    for block in ALL_BLOCKS:
        if block.language not in ("python", "pycon") or block.page.name in SELF_TESTED:
            continue
        assert block.note is None or block.not_run or block.checked_by, (
            f"{block.where}: the note before the block, {block.note!r}, is neither "
            f"'<!-- not run here: needs ... -->' nor '<!-- checked by tests/...py: how -->'")


def test_a_block_not_run_says_what_it_needs_and_they_are_few() -> None:
    not_run = [block for block in ALL_BLOCKS if block.not_run is not None]
    for block in not_run:
        assert block.not_run is not None and re.match(r"needs \w.{8,}", block.not_run), (
            f"{block.where}: say what it needs that this machine lacks")
    assert 0 < len(not_run) <= NOT_RUN_AT_MOST, [block.where for block in not_run]


def test_a_block_checked_elsewhere_names_a_test_that_reads_the_page() -> None:
    checked = [block for block in ALL_BLOCKS if block.checked_by is not None]
    assert checked
    for block in checked:
        assert block.checked_by is not None
        test = ROOT / block.checked_by
        assert test.is_file(), f"{block.where}: {block.checked_by} does not exist"
        assert block.page.name in test.read_text(encoding="utf-8"), (
            f"{block.where}: {block.checked_by} does not read {block.page.name}")


_MISSING = object()
_UNKNOWN = object()  # a module of gpubudget that needs what is not installed here


def _module(name: str) -> object:
    """Module ``name`` of gpubudget, else a marker: missing, or needing what is not here."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as missing:
        return _MISSING if (missing.name or "").split(".")[0] == "gpubudget" else _UNKNOWN


def _attribute(value: object, name: str) -> object:
    """``value.name``, a submodule if ``value`` is a package, else a marker."""
    if hasattr(value, name):
        return getattr(value, name)
    if isinstance(value, types.ModuleType):
        return _module(f"{value.__name__}.{name}")
    return _MISSING


@functools.cache
def _after_import(name: str) -> frozenset[str]:
    """What module ``name`` holds right after ``import name`` in a fresh interpreter (this
    process has imported its submodules since)."""
    shown = subprocess.run(
        [sys.executable, "-c", f"import json, {name}; print(json.dumps(dir({name})))"],
        capture_output=True, text=True, check=True, env=subprocess_env(PYTHONPATH=str(ROOT)))
    return frozenset(json.loads(shown.stdout))


def _unknown_names(code: str) -> list[str]:
    """The names a block takes from gpubudget (imports, and attributes of the modules it
    imports) that do not exist, or that are submodules the block never imported."""
    tree = ast.parse(code)
    bound: dict[str, object] = {}
    wrong: list[str] = []
    imported: set[str] = set()  # modules named by a plain import
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gpubudget":
                    module = importlib.import_module(alias.name)
                    bound[alias.asname or "gpubudget"] = module if alias.asname else gpubudget
                    parts = alias.name.split(".")
                    imported.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpubudget"):
            assert node.module is not None
            source = _module(node.module)
            if not isinstance(source, types.ModuleType):
                wrong += [] if source is _UNKNOWN else [node.module]
                continue
            for alias in node.names:
                value = _attribute(source, alias.name)
                if value is _MISSING:
                    wrong.append(f"{node.module}.{alias.name}")
                bound[alias.asname or alias.name] = value
    for node in ast.walk(tree):
        chain: list[str] = []
        inner: ast.expr = node if isinstance(node, ast.Attribute) else ast.Constant(None)
        while isinstance(inner, ast.Attribute):
            chain.insert(0, inner.attr)
            inner = inner.value
        if not (isinstance(inner, ast.Name) and isinstance(bound.get(inner.id), types.ModuleType)):
            continue
        value = bound[inner.id]
        for position, attr in enumerate(chain):
            if not isinstance(value, types.ModuleType):
                break  # what objects hold is the objects' business
            parent = value.__name__
            value = _attribute(value, attr)
            if value is _MISSING or (
                    isinstance(value, types.ModuleType) and parent in imported
                    and value.__name__ not in imported
                    and attr not in _after_import(parent)):  # gpubudget.torch: never imported
                wrong.append(".".join([inner.id, *chain[:position + 1]]))
                break
    return list(dict.fromkeys(wrong))  # a.b.c and its a.b are walked both


def test_a_block_not_run_compiles_and_names_only_what_gpubudget_has() -> None:
    for block in ALL_BLOCKS:
        if block.not_run is None:
            continue
        compile(block.text, block.where, "exec")
        assert _unknown_names(block.text) == [], block.where


def test_the_name_check_finds_a_misspelt_name() -> None:
    assert _unknown_names("from gpubudget import torch as gbt\ngbt.alocations()") == [
        "gbt.alocations"]
    assert _unknown_names("import gpubudget.cupy\ngpubudget.cupy.release_cache()") == [
        "gpubudget.cupy.release_cache"]
    assert _unknown_names("from gpubudget.tensorrt import Runtimes") == [
        "gpubudget.tensorrt.Runtimes"]
    assert _unknown_names("from gpubudget.tensorrtx import Runtime") == ["gpubudget.tensorrtx"]
    assert _unknown_names("from gpubudget import tensorrt as gbt\ngbt.Runtime(x).anything") == []
    assert _unknown_names("import gpubudget\ngpubudget.torch.allocations()") == [
        "gpubudget.torch"]  # an AttributeError: nothing imported gpubudget.torch
    assert _unknown_names("import gpubudget.torch\ngpubudget.torch.allocations()") == []
    assert _unknown_names("import gpubudget\ngpubudget.units.GiB") == []  # __init__ imports it


# -- links -----------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in prose(page).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = base = _slug(heading.group(1))
            count = 0
            while slug in found:
                count += 1
                slug = f"{base}-{count}"
            found.add(slug)
    return found


def _links(page: Path) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(prose(page).splitlines(), start=1):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if not re.match(r"[a-z]+:", target):  # https:, mailto:
                yield number, target


def test_the_slugs_are_githubs() -> None:
    assert _slug("PyTorch: what 2.11 does not allow, and what gpubudget does instead") == (
        "pytorch-what-211-does-not-allow-and-what-gpubudget-does-instead")
    assert _slug("Perfetto and `chrome://tracing`") == "perfetto-and-chrometracing"
    assert _slug("What a root's entry costs") == "what-a-roots-entry-costs"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_local_link_resolves(page: Path) -> None:
    for number, target in _links(page):
        path, _, anchor = target.partition("#")
        goal = (page.parent / path).resolve() if path else page
        assert goal.exists() and goal.is_relative_to(ROOT), f"{_name(page)}:{number}: {target}"
        if anchor:
            assert goal.suffix == ".md" and anchor in _anchors(goal), (
                f"{_name(page)}:{number}: no heading of {goal.name} has the anchor #{anchor}")


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve()
              for _, target in _links(ROOT / "README.md")}
    assert set(PAGES[1:]) <= linked, sorted(map(_name, set(PAGES[1:]) - linked))


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[ok](#a-page), [bad](#a-pag), [gone](gone.md), `[code](x)`\n")
    found = [target for _, target in _links(page)]
    assert found == ["#a-page", "#a-pag", "gone.md"] and _anchors(page) == {"a-page"}


# -- commands --------------------------------------------------------------------------------


def _commands() -> Iterator[tuple[str, str]]:
    """(where, command) for every command line shown: in shell blocks, after ``$ `` in
    output blocks, and in code spans of the prose."""
    for block in ALL_BLOCKS:
        for offset, line in enumerate(block.text.splitlines(), start=1):
            if block.language == "sh" or line.startswith("$ "):
                yield f"{block.where}+{offset}", line.removeprefix("$ ")
    for page in PAGES:
        for number, line in enumerate(prose(page).splitlines(), start=1):
            for span in _CODE_SPAN.findall(line):
                if re.match(r"(gpubudget|python3? |bash |pip install)", span[1:-1]):
                    yield f"{_name(page)}:{number}", span[1:-1]


def _pieces(command: str) -> Iterator[list[str]]:
    """Each simple command of a line (split at ``&&``, ``|``, ``;``), without a comment and
    the variables set before it."""
    for piece in re.split(r"&&|\||;", command.split(" #")[0]):
        words = piece.split()
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words.pop(0)
        if words:
            yield words


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--help"]) == 0
    return out.getvalue()


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = \[", section, flags=re.M))


def test_the_commands_shown_exist() -> None:
    top = _help()
    commands = set(re.findall(r"\{([\w,]+)\}", top)[0].split(","))
    helps: dict[str, str] = {}
    extras = _extras()
    seen = 0
    for where, command in _commands():
        for extra in re.findall(r"(?:\.|gpubudget)\[([\w,-]+)\]", command):
            assert set(extra.split(",")) <= extras, f"{where}: {command}"
        for words in _pieces(command):
            seen += 1
            if words[0] == "gpubudget" and len(words) > 1 and words[1].isupper():
                continue  # a placeholder: gpubudget COMMAND --help
            elif words[0] == "gpubudget" and len(words) > 1 and not words[1].startswith("-"):
                assert words[1] in commands, f"{where}: no command {words[1]!r}: {command}"
                text = helps.setdefault(words[1], _help(words[1]))
                for option in re.findall(r"(?<![\w-])--?[a-z][\w-]*", " ".join(words[2:])):
                    assert re.search(rf"(?<![\w-]){option}(?![\w-])", text), (
                        f"{where}: gpubudget {words[1]} has no option {option}")
            elif words[0] == "gpubudget" and len(words) > 1:
                assert words[1] in top, f"{where}: {command}"
            elif words[0] in ("python", "python3") and words[1:2] == ["-m"]:
                package, *rest = words[2].split(".")
                if package in ("benchmarks", "scripts", "tests", "gpubudget"):
                    assert ROOT.joinpath(package, *rest).with_suffix(".py").exists() or (
                        ROOT.joinpath(package, *rest, "__main__.py").exists()), where
            elif words[0] in ("python", "python3", "bash") and words[1].endswith((".py", ".sh")):
                if (ROOT / Path(words[1]).parts[0]).is_dir():  # not the reader's serve.py
                    assert (ROOT / words[1]).is_file(), f"{where}: {words[1]} does not exist"
    assert seen > 40


def test_the_readmes_two_commands_are_what_ci_runs() -> None:
    readme = [block.text.strip() for block in blocks(ROOT / "README.md")
              if block.language == "sh"]
    assert readme == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install '.[plot]' && gpubudget demo",
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev,ray-serve]' "
        "&& python -m pytest",
    ]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m venv .venv" in ci and ". .venv/bin/activate" in ci
    assert "pip install -q -e '.[dev,ray-serve]'" in ci
    assert re.search(r"^python -m pytest$", ci, flags=re.M)


def test_the_readme_stays_short() -> None:
    """What a newcomer needs; the rest is in docs/."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


# -- numbers ---------------------------------------------------------------------------------


def _text(name: str) -> str:
    return " ".join((ROOT / "docs" / name).read_text(encoding="utf-8").split())


def test_the_numbers_the_pages_state_are_the_codes() -> None:
    from gpubudget._core.memory import DEFAULT_GRANULE
    from gpubudget.ray import placement, registry, reporter

    traces = _text("traces.md")
    assert f"at least every {FLUSH_SECONDS:g} s" in traces
    assert f"as soon as {FLUSH_BYTES // MiB} MiB is queued" in traces
    assert f"at most {BUFFER_BYTES // MiB} MiB" in traces
    assert f"longer than {MAX_TEXT} characters" in traces and f"({MAX_TEXT - 1} characters" in traces
    assert f"a line over {MAX_LINE_BYTES // MiB} MiB" in traces
    assert f"size limit ({MAX_TRACE_BYTES // GiB} GiB" in traces
    assert f"more than {MAX_FRAMES} frames" in traces
    reports = _text("reports.md")
    assert f"EVENT_LOG_LIMIT` = {gpubudget.EVENT_LOG_LIMIT:,}".replace(",", " ") in reports
    assert f"lists the {TAGS_SHOWN} largest tags" in reports
    sharing = _text("sharing.md")
    assert f"a headroom of {sizing.HEADROOM // MiB} MiB" in sharing
    assert f"held for more than {book.LOCK_SECONDS:g} s" in sharing
    assert f"for up to {SETTLE_SECONDS:g} s" in sharing
    assert f"granules (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`; {DEFAULT_GRANULE // MiB} MiB" \
        in _text("growable.md")
    ray = _text("ray.md")
    assert f"`margin` (default {placement.DEFAULT_MARGIN // GiB} GiB" in ray
    assert f"The last {registry.DEAD_KEPT} are kept" in ray
    assert f"within {registry.REREGISTER_SECONDS:g} s is marked dead" in ray
    assert (f"every {reporter.FIRST_RETRY_SECONDS:g} s while Ray restarts it, else every "
            f"{reporter.RETRY_SECONDS:g} s") in ray
    assert f"in {reporter.POLL_SECONDS:g}-second calls" in ray
    import inspect

    timeout = inspect.signature(registry.cluster_report).parameters["timeout"].default
    assert f"within `timeout` ({timeout:g} s)" in ray
    assert "flushed every second" in ray and reporter.FLUSH_SECONDS == 1.0


def test_the_json_of_top_has_the_keys_sharing_md_lists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubudget.hostledger import host_view

    monkeypatch.setenv("GPUBUDGET_LEDGER_DIR", str(tmp_path))  # this test's root alone

    shown = _text("sharing.md").split("`--json` as JSON: `", 1)[1].split("`", 1)[0]
    listed = re.findall(r'"(\w+)"', shown)
    with gpu_budget("1MiB", name="model", backend="host") as model:
        view = host_view(nvml=False).as_dict()
    (device,) = view["devices"]
    assert model.state == "released"
    assert listed == [*view][:-1] + ["devices", *device]
