"""The ledger file of one device: a header page, fixed-size slots of 64-bit words, then pages
of child budgets.

::

    bytes 0 .. 255        header: magic, version, geometry, slots ever used, the host-wide
                          cap, the device's total memory, whether claims must fit it, pages
                          ever used, the limit set on it from outside and what set it, the
                          device's identity and label
    bytes 256 .. 271      the change count, and the mark of the last change made without the
                          lock
    bytes 512 .. 2559     the change log: the slot of change n in word n % 256
    bytes 4096 + 256 * i  slot i: one root budget of a live process (or free)
    CHILDREN + 2048 * p   page p: the child budgets of one root (or free)

A slot is 32 native 64-bit words: 17 numbers (:data:`SLOT_FIELDS`), then the budget's name
(64 bytes) and the process's title (56 bytes), UTF-8, NUL-padded. Its ``state`` is
:data:`FREE`, :data:`CLAIMED` (the process is reserving its memory) or :data:`RESERVED`.
The owning process writes ``used``, ``peak`` and ``denials`` (three consecutive words) with
plain stores as they change, and ``hidden`` (its children that no page shows); everything
else changes only under the file's lock, and each
such change of a slot counts one in the header's change count and writes the slot's number
into the change log, so that a process can bring what it knows of the slots up to date by
reading only the slots that changed. A slot changed without the lock (its owner's own, when
another process keeps the lock too long) writes a new random mark instead: a process that
sees another mark than the one it last saw reads every slot again.

A page is 16 rows of 16 words. Row 0 is its head (:data:`PAGE_FIELDS`): the root slot that
owns it (+ 1; 0: the page is free) and that root's pid, serial and claim time, which must all
match the slot for the page to count (a page whose root has gone is free for the next
taker). Rows 1 to 15 are child budgets of that root (:data:`CHILD_FIELDS`, then the name,
64 bytes): a row's number in the file is ``16 * page + row``; ``parent`` is the parent's row
number + 1, 0 for the root itself. A page is taken under the file's lock (its root's first
child, or one more than its pages hold); its rows are written by its owner alone, with plain
stores, ``state`` last when a child enters and first when it goes, and ``used`` and ``peak``
as they change. A root frees its pages (owner 0) before its slot.

The file lives on one host (``/dev/shm``), so words are in the machine's byte order. Nothing
read from it is trusted: a value out of its range is damage.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

__all__ = [
    "CHILDREN",
    "CHILD_BYTES",
    "CHILD_FIELDS",
    "CLAIMED",
    "FILE_BYTES",
    "FREE",
    "CHANGES_WORD",
    "HEADER",
    "HEADER_BYTES",
    "LIMIT_BYTES",
    "LIMIT_TEXT",
    "LOG_LENGTH",
    "LOG_WORD",
    "UNLOCKED_WORD",
    "MAGIC",
    "OPEN",
    "PAGES",
    "PAGE_BYTES",
    "PAGE_FIELDS",
    "PAGE_ROWS",
    "RESERVED",
    "SLOT",
    "SLOTS",
    "SLOT_BYTES",
    "SLOT_FIELDS",
    "VERSION",
    "Child",
    "Damage",
    "Entry",
    "Header",
    "child_word",
    "decode_child",
    "decode_entry",
    "decode_header",
    "encode_header",
    "encode_child",
    "encode_slot",
    "header_word",
    "page_word",
    "slot_word",
    "text_field",
]

MAGIC: Final = b"GPUBLEDG"
VERSION: Final = 3
"""Format 2 added the change count and log, format 3 the pages of child budgets; files of an
older format are refused (remove them)."""
HEADER_BYTES: Final = 4096
SLOT_BYTES: Final = 256
SLOTS: Final = 4096
"""Root budgets of live processes one device's ledger holds at once."""
CHILD_BYTES: Final = 128
PAGE_ROWS: Final = 16
"""Rows of a page: its head, then 15 child budgets."""
PAGE_BYTES: Final = PAGE_ROWS * CHILD_BYTES
PAGES: Final = 1024
"""Pages of child budgets one device's ledger holds: 15,360 children at most, in pages of
15 taken by one root each."""
CHILDREN: Final = HEADER_BYTES + SLOTS * SLOT_BYTES
"""Where the pages start."""
FILE_BYTES: Final = CHILDREN + PAGES * PAGE_BYTES
TEXT_BYTES: Final = 64
PROCESS_BYTES: Final = 56

LIMIT_BYTES: Final = 32
HEADER: Final = struct.Struct(f"=8s11Q{LIMIT_BYTES}s{TEXT_BYTES}s{TEXT_BYTES}s")
"""magic, version, slot bytes, slots, slots ever used, cap, total, hard, child bytes, pages,
pages ever used, the outside limit; what set that limit, identity, label. (The outside
limit and its name fill what was padding: zeros in older files, read as none.)"""
_HEADER_WORDS: Final = ("magic", "version", "slot_bytes", "slots", "high", "cap", "total",
                        "hard", "child_bytes", "pages", "pages_high", "limit")
LIMIT_TEXT: Final = len(_HEADER_WORDS) * 8
"""Byte offset of the name of what set the outside limit, in the header."""

SLOT_FIELDS: Final = ("state", "pid", "start", "pidns", "boot", "limit", "claim", "reserved",
                      "used", "peak", "denials", "claimed_at", "reserved_at", "ordinal",
                      "share", "serial", "hidden")
"""The 17 numbers of a slot, in order. ``start``: the process's start time in clock ticks
after boot; ``pidns``: its PID namespace; ``boot``: the boot it ran in; ``claim``: bytes it
counts against the device; ``claimed_at``/``reserved_at``: ``CLOCK_MONOTONIC`` nanoseconds;
``ordinal``: its CUDA ordinal + 1 (0: none); ``share``: a share asked for, in millionths
(0: a plain limit); ``serial``: the budget's number in its process; ``hidden``: its child
budgets (at any depth) that no page shows (the pages are full)."""
SLOT: Final = struct.Struct(f"={len(SLOT_FIELDS)}Q{TEXT_BYTES}s{PROCESS_BYTES}s")
PAGE_FIELDS: Final = ("owner", "pid", "serial", "claimed_at")
"""A page's head: the root slot that owns it + 1 (0: free), and that root's ``pid``,
``serial`` and ``claimed_at``."""
CHILD_FIELDS: Final = ("state", "parent", "depth", "serial", "limit", "reserve", "used",
                       "peak")
"""The 8 numbers of a child's row: ``state`` (:data:`OPEN`, or 0: free), ``parent`` (its
row + 1, 0 for the root), ``depth`` (1 under the root), ``serial`` (the budget's number in
its process: the order children entered), its ``limit`` and ``reserve``, then ``used`` and
``peak`` (two consecutive words)."""
CHILD: Final = struct.Struct(f"={len(CHILD_FIELDS)}Q{TEXT_BYTES}s")
OPEN: Final = 1
CHANGES_WORD: Final = 32
"""Header word: changes of slots made under the lock so far (it wraps at 2**64)."""
UNLOCKED_WORD: Final = 33
"""Header word: a random mark written after each change of a slot made without the lock
(see the docstring); a new one each time, so that a mark lost to another's is still new."""
LOG_WORD: Final = 64
LOG_LENGTH: Final = 256
"""The change log: the slot of change ``n`` is word ``LOG_WORD + n % LOG_LENGTH``."""
assert SLOT.size == SLOT_BYTES and HEADER.size <= CHANGES_WORD * 8 and CHILD.size == CHILD_BYTES
assert (LOG_WORD + LOG_LENGTH) * 8 <= HEADER_BYTES

FREE: Final = 0
CLAIMED: Final = 1
RESERVED: Final = 2
State = Literal["claimed", "reserved"]
_STATES: Final[dict[int, State]] = {CLAIMED: "claimed", RESERVED: "reserved"}


_FIELD_WORD: Final = {field: index for index, field in enumerate(SLOT_FIELDS)}


def slot_word(slot: int, field: str) -> int:
    """Index, among the file's 64-bit words, of ``field`` of slot ``slot``.

    >>> slot_word(0, "state"), slot_word(1, "used")
    (512, 552)
    """
    return (HEADER_BYTES + slot * SLOT_BYTES) // 8 + _FIELD_WORD[field]


def header_word(field: str) -> int:
    """Index, among the file's 64-bit words, of a numeric header field (``high``, ``cap``,
    ``total``, ``hard``, ``pages_high``)."""
    return _HEADER_WORDS.index(field)


_PAGE_WORD: Final = {field: index for index, field in enumerate(PAGE_FIELDS)}
_CHILD_WORD: Final = {field: index for index, field in enumerate(CHILD_FIELDS)}


def page_word(page: int, field: str) -> int:
    """Index, among the file's 64-bit words, of ``field`` of page ``page``'s head.

    >>> page_word(0, "owner") * 8 == CHILDREN, page_word(1, "pid") * 8 - CHILDREN
    (True, 2056)
    """
    return (CHILDREN + page * PAGE_BYTES) // 8 + _PAGE_WORD[field]


def child_word(row: int, field: str) -> int:
    """Index, among the file's 64-bit words, of ``field`` of child row ``row`` (its number in
    the file: ``PAGE_ROWS * page + row in the page``, never a page's head)."""
    return (CHILDREN + row * CHILD_BYTES) // 8 + _CHILD_WORD[field]


def text_field(text: str, size: int = TEXT_BYTES) -> bytes:
    """``text`` as UTF-8, cut to ``size`` bytes without splitting a character."""
    data = text.encode("utf-8", "backslashreplace")[:size]
    return data.decode("utf-8", "ignore").encode("utf-8")


def _text(data: bytes) -> str:
    return data.rstrip(b"\0").decode("utf-8", "replace")


@dataclass(frozen=True)
class Header:
    """What a ledger file says about its device."""

    version: int
    slot_bytes: int
    slots: int
    high: int
    """Slots ever used: every slot past it is free."""
    cap: int | None
    """The host-wide cap of the device (``set_device_cap``), if any."""
    total: int
    hard: bool
    """Whether claims must fit ``total`` (a simulated device, which nothing else enforces)."""
    identity: str
    label: str
    pages_high: int = 0
    """Pages of child budgets ever used: every page past it is free."""
    limit: int | None = None
    """The limit set from outside on the device's memory (an MPS or HAMi variable, the
    cgroup's ``dmem.max``, NVML's) as the last root to claim there read it, if any."""
    limited_by: str = ""
    """What set :attr:`limit` (a variable's or file's name)."""


def encode_header(identity: str, label: str, total: int, hard: bool) -> bytes:
    """A new file's header page."""
    packed = HEADER.pack(MAGIC, VERSION, SLOT_BYTES, SLOTS, 0, 0, total, int(hard),
                         CHILD_BYTES, PAGES, 0, 0, b"", text_field(identity),
                         text_field(label))
    return packed.ljust(HEADER_BYTES, b"\0")


class Damage(ValueError):
    """A ledger file that says something impossible: a damaged file."""


def decode_header(data: bytes) -> Header:
    """The header of ``data`` (at least ``HEADER.size`` bytes); ``ValueError`` saying what is
    wrong when it is not a ledger this version can read (:class:`Damage` when it is damaged).
    """
    if len(data) < HEADER.size:
        raise ValueError(f"too short for a ledger header ({len(data)} bytes)")
    (magic, version, slot_bytes, slots, high, cap, total, hard, child_bytes, pages, pages_high,
     limit, limited_by, identity, label) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a gpubudget ledger (it starts with {magic!r})")
    if version != VERSION:
        raise ValueError(f"written in ledger format {version}; this gpubudget reads format "
                         f"{VERSION}")
    if (slot_bytes, slots) != (SLOT_BYTES, SLOTS) or high > slots:
        raise Damage(f"damaged header (slots {slots} of {slot_bytes} bytes, {high} used)")
    if (child_bytes, pages) != (CHILD_BYTES, PAGES) or pages_high > pages:
        raise Damage(f"damaged header (pages {pages} of {child_bytes}-byte rows, {pages_high} "
                     f"used)")
    return Header(version, slot_bytes, slots, high, cap or None, total, bool(hard),
                  _text(identity), _text(label), pages_high, limit or None, _text(limited_by))


def encode_slot(numbers: dict[str, int], name: str, process: str) -> bytes:
    """A slot's bytes: ``numbers`` by field name (missing ones 0), the two texts."""
    return SLOT.pack(*(numbers.get(field, 0) for field in SLOT_FIELDS), text_field(name),
                     text_field(process, PROCESS_BYTES))


class Entry(NamedTuple):
    """One claimed slot as read: a root budget of some process (maybe ended). A named tuple:
    a claim reads every slot of its device, so each must be cheap to make.

    >>> entry = decode_entry(encode_slot({"state": RESERVED, "pid": 7, "claim": 4096,
    ...                                   "reserved": 4352}, "model", "python serve.py"), 0, 0)
    >>> entry.name, entry.pid, entry.holds
    ('model', 7, 4352)
    """

    slot: int
    state: State
    pid: int
    start: int
    pidns: int
    boot: int
    limit: int
    claim: int
    reserved: int
    used: int
    peak: int
    denials: int
    claimed_at: int
    reserved_at: int
    ordinal: int | None
    share: float | None
    serial: int
    name: str
    process: str
    hidden: int = 0
    """Its child budgets that no page shows."""

    @property
    def holds(self) -> int:
        """Bytes this budget counts against its device: its claim, or what it reserved if
        that is more."""
        return max(self.claim, self.reserved)


def decode_entry(data: bytes | memoryview, offset: int, slot: int) -> Entry | None:
    """The slot at ``offset`` of ``data``, or ``None`` if it is free (or not a state this
    version writes)."""
    (state, pid, start, pidns, boot, limit, claim, reserved, used, peak, denials, claimed_at,
     reserved_at, ordinal, share, serial, hidden, name, process) = SLOT.unpack_from(data, offset)
    kind = _STATES.get(state)
    if kind is None:
        return None
    return Entry(slot, kind, pid, start, pidns, boot, limit, claim, reserved, used, peak,
                 denials, claimed_at, reserved_at, ordinal - 1 if ordinal else None,
                 share / 1e6 if share else None, serial, _text(name), _text(process), hidden)


def encode_child(numbers: dict[str, int], name: str) -> bytes:
    """A child's row: ``numbers`` by field name (missing ones 0), then its name."""
    return CHILD.pack(*(numbers.get(field, 0) for field in CHILD_FIELDS), text_field(name))


class Child(NamedTuple):
    """One child budget's row as read (see the module docstring).

    >>> child = decode_child(encode_child({"state": OPEN, "depth": 1, "limit": 4096},
    ...                                   "backbone"), 0, 17)
    >>> child.row, child.parent, child.name, child.limit
    (17, None, 'backbone', 4096)
    """

    row: int
    parent: int | None
    """The parent's row; ``None`` for the root."""
    depth: int
    serial: int
    limit: int
    reserve: int
    used: int
    peak: int
    name: str


def decode_child(data: bytes | memoryview, offset: int, row: int) -> Child | None:
    """The child row at ``offset`` of ``data``, or ``None`` if it is free (or not a state
    this version writes)."""
    (state, parent, depth, serial, limit, reserve, used, peak,
     name) = CHILD.unpack_from(data, offset)
    if state != OPEN:
        return None
    return Child(row, parent - 1 if parent else None, depth, serial, limit, reserve, used,
                 peak, _text(name))
