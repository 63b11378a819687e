"""Reading a pickle that holds nothing but plain data, and refusing any other without
running a line of it.

A pickle is a small program: besides building lists and dictionaries it can name any
importable function (``GLOBAL``, ``STACK_GLOBAL``, the extension registry) and call it
(``REDUCE``, ``BUILD``, ``INST``, ``OBJ``, ``NEWOBJ``), so ``pickle.load`` of a file from
elsewhere runs whatever its author chose. :func:`load_plain` runs the standard unpickler
with every door to code shut: naming a function or class stops the load at that opcode,
before anything is called (every call in a pickle needs a callable, and the only callables
a pickle can reach come through those names), and so does a persistent id or an
out-of-band buffer. What it can build is ``None``, booleans, numbers, strings, bytes,
tuples, lists, dictionaries and sets: what ``torch.cuda.memory._dump_snapshot`` writes.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Final

from ..errors import TraceError

__all__ = ["SnapshotError", "load_plain"]

_CODE_OPCODES: Final = frozenset({
    "GLOBAL", "STACK_GLOBAL", "EXT1", "EXT2", "EXT4", "REDUCE", "BUILD", "INST", "OBJ",
    "NEWOBJ", "NEWOBJ_EX", "PERSID", "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER"})
"""Opcodes that name, call or fetch something other than plain data."""


class SnapshotError(TraceError):
    """A memory snapshot cannot be read: missing, not a pickle, a pickle that asks for code
    (refused, never run), or not a PyTorch snapshot; the message is one line naming the
    file and what is wrong."""


class _Refused(Exception):
    """The pickle asked for something other than plain data."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        raise _Refused(f"it names {module}.{name}")

    def persistent_load(self, pid: object) -> object:
        raise _Refused("it asks for a persistent object")


def _first_code_opcode(data: bytes) -> str | None:
    """The first opcode of ``data`` that is not plain data, for the message (``None`` if
    there is none before the pickle ends or stops parsing)."""
    try:
        for opcode, _argument, _position in pickletools.genops(io.BytesIO(data)):
            if opcode.name in _CODE_OPCODES:
                return str(opcode.name)
    except Exception:  # noqa: BLE001 - a malformed pickle: the loader's message says why
        return None
    return None


def load_plain(data: bytes, name: str) -> object:
    """The plain data pickled in ``data``; :class:`SnapshotError` (``name: refused: ...``)
    for a pickle that names or calls anything, or one that is malformed.

    Examples
    --------
    >>> import pickle
    >>> load_plain(pickle.dumps({"segments": [(1, 2.5, "x", b"y", None, True)]}), "ok")
    {'segments': [(1, 2.5, 'x', b'y', None, True)]}
    >>> load_plain(pickle.dumps(ValueError("boom")), "bad")
    Traceback (most recent call last):
    ...
    gpubudget.viewer.plainpickle.SnapshotError: bad: refused: it names builtins.ValueError; ...
    """
    refusal = ("; only plain data (dictionaries, lists, strings, numbers) is read from a "
               "snapshot, and nothing in it is run")
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise SnapshotError(f"{name}: refused: {exc}{refusal}") from None
    except MemoryError:
        raise SnapshotError(f"{name}: out of memory while reading the pickle") from None
    except Exception as exc:  # noqa: BLE001 - whatever a malformed pickle raises
        opcode = _first_code_opcode(data)
        if opcode is not None:
            raise SnapshotError(f"{name}: refused: it uses the {opcode} opcode"
                                f"{refusal}") from None
        detail = " ".join(str(exc).split())[:200]
        raise SnapshotError(f"{name}: not a readable pickle ({type(exc).__name__}: "
                            f"{detail})") from None
