"""The fenced blocks of the README and of docs/, and the examples among them run as a user
would run them: ``python -m tests.docs_examples PAGE`` runs a page's examples in order, in one
namespace, in the current directory (``tests/test_docs_pages.py`` runs it in a fresh process
per page, on the host backend).

The convention the pages follow. A ```` ```python ```` block is code a reader may paste: it
runs. A ```` ```pycon ```` block shows what Python prints: it runs as a doctest (``...``
matches anything). A block that cannot run here says so in an HTML comment on the line just
before its fence, which the rendered page does not show:

- ``<!-- not run here: needs ... -->``: what it needs that a machine without a GPU lacks (a
  GPU, TensorRT, PyTorch, a Ray cluster, the reader's own model); such a block must still
  compile, and every name it takes from gpubudget must exist;
- ``<!-- checked by tests/test_x.py: how -->``: a test of its own runs or compares it.
"""

from __future__ import annotations

import doctest
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_RUN = re.compile(r"<!-- not run here: (.*?) -->")
CHECKED = re.compile(r"<!-- checked by (tests/[\w/]+\.py): (.+?) -->")
RUN_LANGUAGES = ("python", "pycon")
SELF_TESTED = {"hosts.md": "tests/test_hostledger_docs.py", "viewer.md": "tests/test_viewer_docs.py"}
"""Pages whose examples a test of their own runs whole (``doctest.testfile``)."""


@dataclass(frozen=True)
class Block:
    """A fenced block: its page, the line of its opening fence, its language, its text and
    the HTML comment on the line just before the fence, if any."""

    page: Path
    line: int
    language: str
    text: str
    note: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        """Why it is not run here, if its note says so."""
        found = NOT_RUN.fullmatch(self.note or "")
        return found.group(1) if found else None

    @property
    def checked_by(self) -> str | None:
        """The test that checks it instead, if its note names one."""
        found = CHECKED.fullmatch(self.note or "")
        return found.group(1) if found else None

    @property
    def runs_here(self) -> bool:
        return (self.language in RUN_LANGUAGES and self.note is None
                and self.page.name not in SELF_TESTED)


def pages() -> list[Path]:
    """The README and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, in order."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    fence: tuple[int, str, str | None] | None = None  # opening line, language, note
    body: list[str] = []
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            before = lines[number - 2].strip() if number >= 2 else ""
            note = before if before.startswith("<!--") else None
            fence, body = (number, stripped[3:].strip(), note), []
        elif fence is not None and stripped == "```":
            found.append(Block(page, fence[0], fence[1], "\n".join(body) + "\n", fence[2]))
            fence = None
        elif fence is not None:
            body.append(line)
    if fence is not None:
        raise ValueError(f"{page}:{fence[0]}: a fence that never closes")
    return found


def prose(page: Path) -> str:
    """The page without its fenced blocks (their lines left empty, so lines keep their
    numbers)."""
    kept: list[str] = []
    inside = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            kept.append("")
        else:
            kept.append("" if inside else line)
    return "\n".join(kept)


def run_page(page: Path) -> int:
    """Run the page's examples in order in one namespace; print each failure; the number
    of failures."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failures = 0
    for block in blocks(page):
        if not block.runs_here:
            continue
        if block.language == "pycon":
            test = doctest.DocTestParser().get_doctest(
                block.text, namespace, block.where, str(page), block.line)
            failures += runner.run(test, clear_globs=False).failed
            namespace.update(test.globs)  # a DocTest runs in a copy
            continue
        code = compile("\n" * block.line + block.text, str(page), "exec")
        try:
            exec(code, namespace)
        except Exception:  # every failure is reported, then the page fails
            print(f"{block.where}: the block raised", file=sys.stderr)
            traceback.print_exc()
            failures += 1
    return failures


if __name__ == "__main__":
    sys.exit(min(run_page(Path(sys.argv[1]).resolve()), 1))
