"""Python code cannot crash the C core.

The C fast path (``_core/tree.c``) reads the ``__slots__`` of ``Budget``, ``Node``, ``Tree``,
``Recorder``, ``PendingFrees``, ``Mapping`` and the interrupt state at offsets looked up once,
and the object members of its own ``Stats``. Python code may put anything there: ``None``, an
int, a str, an object of another class, or nothing (``del``). For every slot named in
``install()`` and every object member of the C types that Python may set, read from the C
source itself (every ``.c`` and ``.h`` file of ``_core/``), a process puts each of those
there, then allocates, frees, reports, checks and leaves its budgets (a growable root's when
the slot is its ``Mapping``'s): it may raise (Python's errors), and it must not die by a
signal.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpubudget._core import native
from tests.helpers import subprocess_env

CORE = Path(__file__).parent.parent / "gpubudget" / "_core"


def c_source() -> str:
    """The C core's source: its header and every C file, as one text."""
    return "\n".join(path.read_text() for path in sorted([*CORE.glob("*.h"), *CORE.glob("*.c")]))

# How the attack reaches an object of each kind the C source names, from the child budget
# ``child`` (of root ``root``) that holds a block.
REACH = {
    "budget": "child",
    "node": "child._node",
    "tree": "child._node.tree",
    "recorder": "child._node.tree.recorder",
    "pending": "child._node.tree.pending",
    "Stats": "child._node.stats",
    "registry": "child._node.tree.live",  # a live block's owner, read by the fast free
    "mapping": "child._node.tree.mapping",  # a growable root's granules
}


def slots_read_at_offsets() -> list[tuple[str, str]]:
    """``(kind, slot)`` for every ``slot_offset`` call of ``install()`` in the C source."""
    text = c_source()
    start = re.search(r"PyObject \*py_install\([^)]*\) \{", text)  # its definition
    assert start is not None, "the C source defines no py_install()"
    install = text[start.start():]
    install = install[: install.index("\n}\n")]
    found = re.findall(r'slot_offset\(\s*(?:\(PyObject \*\)Py_TYPE\()?(\w+)\)?,\s*"(\w+)"',
                       install)
    return [(kind, name) for kind, name in found]


def writable_object_members() -> list[tuple[str, str]]:
    """``(type, member)`` for every object member of a C type that Python may set."""
    text = c_source()
    found = re.findall(r'\{"(\w+)", T_OBJECT(?:_EX)?, offsetof\((\w+)Object, \w+\), 0,', text)
    return [(kind, name) for name, kind in found]


ATTACKS = slots_read_at_offsets() + writable_object_members() + [("registry", "owner")]

_SCRIPT = """
    import sys
    from gpubudget import gpu_budget

    where, slot = sys.argv[1], sys.argv[2]

    def attempt(what, work):
        try:
            work()
        except BaseException as exc:  # Python's errors are allowed; a signal is not
            print(f"  {what}: {type(exc).__name__}", flush=True)

    def put(target, value, block):
        \"\"\"Put ``value`` where the attack says; a function that puts back what was there.\"\"\"
        if where.endswith(".live"):  # the owner of a live block, in the C registry
            entry = target[block]
            target[block] = (None if value is DELETE else value, *entry[1:])
            return lambda: target.__setitem__(block, entry)
        saved = getattr(target, slot)
        if value is DELETE:
            delattr(target, slot)
        else:
            setattr(target, slot, value)
        return lambda: setattr(target, slot, saved)

    # a growable root where the attack is on its memory (tree.mapping, the Mapping's slots)
    initial = 0 if "mapping" in (where, slot) or where.endswith(".mapping") else None

    def attack(value, label):
        print(label, flush=True)
        with gpu_budget("1MiB", name="root", backend="host", initial=initial) as root:
            with gpu_budget("512KiB", name="child") as child:
                blocks = [child.allocate(256, tag="t"), child.allocate(512), root.allocate(256)]
                others = {"a Node": child._node, "a Tree": child._node.tree,
                          "a Recorder": child._node.tree.recorder,
                          "a PendingFrees": child._node.tree.pending, "a Budget": root}
                value = others.get(label, value)
                restore = []
                target = eval(where, {"child": child})
                attempt("put", lambda: restore.append(put(target, value, blocks[0])))
                for budget in (child, root):
                    attempt("allocate", lambda: budget.allocate(256))
                    attempt("allocate tagged", lambda: budget.allocate(256, tag="t"))
                    attempt("allocate new tag", lambda: budget.allocate(256, tag=label))
                    for block in blocks:
                        attempt("free", lambda: budget.free(block))
                    attempt("report", lambda: str(budget.report()))
                    attempt("check", budget.check)
                    attempt("repr", lambda: repr(budget))
                for undo in restore:
                    attempt("restore", undo)
        print("  left", flush=True)

    DELETE = object()
    for value, label in [(None, "None"), (12345, "an int"), ("text", "a str"),
                         (object(), "an object"), ([], "a list"), (DELETE, "nothing"),
                         (bytearray(1), "a short bytearray"),
                         (None, "a Node"), (None, "a Tree"), (None, "a Recorder"),
                         (None, "a PendingFrees"), (None, "a Budget")]:
        try:
            attack(value, label)
        except BaseException as exc:
            print(f"  raised {type(exc).__name__}", flush=True)
    print("done", flush=True)
"""


def test_the_attacks_cover_every_slot_the_fast_path_reads() -> None:
    kinds = {kind for kind, _ in ATTACKS}
    assert kinds <= set(REACH), f"the C source reads slots of {kinds - set(REACH)}: teach REACH"
    assert len(slots_read_at_offsets()) >= 25  # the parse found install()'s list
    assert ("Stats", "tags") in ATTACKS and ("node", "tree") in ATTACKS


@pytest.mark.skipif(native is None, reason="the C core is not built here")
@pytest.mark.parametrize(("kind", "slot"), ATTACKS, ids=[f"{k}.{s}" for k, s in ATTACKS])
def test_a_wrong_object_in_a_slot_never_crashes_the_process(kind: str, slot: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT), REACH[kind], slot],
                            capture_output=True, text=True, timeout=120,
                            env=subprocess_env(GPUBUDGET_BACKEND="host"))
    lines = result.stdout.splitlines()
    last = next((line for line in reversed(lines) if not line.startswith(" ")), "?")
    assert result.returncode >= 0, (
        f"{kind}.{slot} holding {last}: the process died by signal {-result.returncode}\n"
        f"{result.stderr[-2000:]}")
    assert lines and lines[-1] == "done", result.stdout[-2000:] + result.stderr[-2000:]
    assert "  put:" not in result.stdout, result.stdout  # every attack took place
