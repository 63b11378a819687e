"""The ledger file of one device: a header page, then fixed-size slots of 64-bit words.

::

    bytes 0 .. 255        header: magic, version, geometry, slots ever used, the host-wide
                          cap, the device's total memory, whether claims must fit it, the
                          device's identity and label
    bytes 256 .. 271      the change count, and the mark of the last change made without the
                          lock
    bytes 512 .. 2559     the change log: the slot of change n in word n % 256
    bytes 4096 + 256 * i  slot i: one root budget of a live process (or free)

A slot is 32 native 64-bit words: 16 numbers (:data:`SLOT_FIELDS`), then the budget's name
(64 bytes) and the process's title (64 bytes), UTF-8, NUL-padded. Its ``state`` is
:data:`FREE`, :data:`CLAIMED` (the process is reserving its memory) or :data:`RESERVED`.
The owning process writes ``used``, ``peak`` and ``denials`` (three consecutive words) with
plain stores as they change; everything else changes only under the file's lock, and each
such change of a slot counts one in the header's change count and writes the slot's number
into the change log, so that a process can bring what it knows of the slots up to date by
reading only the slots that changed. A slot changed without the lock (its owner's own, when
another process keeps the lock too long) writes a new random mark instead: a process that
sees another mark than the one it last saw reads every slot again. The file lives on one host (``/dev/shm``), so words are in the
machine's byte order. Nothing read from it is trusted: a value out of its range is damage.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

__all__ = [
    "CLAIMED",
    "FILE_BYTES",
    "FREE",
    "CHANGES_WORD",
    "HEADER",
    "HEADER_BYTES",
    "LOG_LENGTH",
    "LOG_WORD",
    "UNLOCKED_WORD",
    "MAGIC",
    "RESERVED",
    "SLOT",
    "SLOTS",
    "SLOT_BYTES",
    "SLOT_FIELDS",
    "VERSION",
    "Damage",
    "Entry",
    "Header",
    "decode_entry",
    "decode_header",
    "encode_header",
    "encode_slot",
    "header_word",
    "slot_word",
    "text_field",
]

MAGIC: Final = b"GPUBLEDG"
VERSION: Final = 2
"""Format 2 added the change count and log; format 1 files are refused (remove them)."""
HEADER_BYTES: Final = 4096
SLOT_BYTES: Final = 256
SLOTS: Final = 4096
"""Root budgets of live processes one device's ledger holds at once."""
FILE_BYTES: Final = HEADER_BYTES + SLOTS * SLOT_BYTES
TEXT_BYTES: Final = 64

HEADER: Final = struct.Struct(f"=8s7Q64x{TEXT_BYTES}s{TEXT_BYTES}s")
"""magic, version, slot bytes, slots, slots ever used, cap, total, hard; identity, label."""
_HEADER_WORDS: Final = ("magic", "version", "slot_bytes", "slots", "high", "cap", "total",
                        "hard")

SLOT_FIELDS: Final = ("state", "pid", "start", "pidns", "boot", "limit", "claim", "reserved",
                      "used", "peak", "denials", "claimed_at", "reserved_at", "ordinal",
                      "share", "serial")
"""The 16 numbers of a slot, in order. ``start``: the process's start time in clock ticks
after boot; ``pidns``: its PID namespace; ``boot``: the boot it ran in; ``claim``: bytes it
counts against the device; ``claimed_at``/``reserved_at``: ``CLOCK_MONOTONIC`` nanoseconds;
``ordinal``: its CUDA ordinal + 1 (0: none); ``share``: a share asked for, in millionths
(0: a plain limit); ``serial``: the budget's number in its process."""
SLOT: Final = struct.Struct(f"={len(SLOT_FIELDS)}Q{TEXT_BYTES}s{TEXT_BYTES}s")
CHANGES_WORD: Final = 32
"""Header word: changes of slots made under the lock so far (it wraps at 2**64)."""
UNLOCKED_WORD: Final = 33
"""Header word: a random mark written after each change of a slot made without the lock
(see the docstring); a new one each time, so that a mark lost to another's is still new."""
LOG_WORD: Final = 64
LOG_LENGTH: Final = 256
"""The change log: the slot of change ``n`` is word ``LOG_WORD + n % LOG_LENGTH``."""
assert SLOT.size == SLOT_BYTES and HEADER.size <= CHANGES_WORD * 8
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
    ``total``, ``hard``)."""
    return _HEADER_WORDS.index(field)


def text_field(text: str) -> bytes:
    """``text`` as UTF-8, cut to fit a text field without splitting a character."""
    data = text.encode("utf-8", "backslashreplace")[:TEXT_BYTES]
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


def encode_header(identity: str, label: str, total: int, hard: bool) -> bytes:
    """A new file's header page."""
    packed = HEADER.pack(MAGIC, VERSION, SLOT_BYTES, SLOTS, 0, 0, total, int(hard),
                         text_field(identity), text_field(label))
    return packed.ljust(HEADER_BYTES, b"\0")


class Damage(ValueError):
    """A ledger file that says something impossible: a damaged file."""


def decode_header(data: bytes) -> Header:
    """The header of ``data`` (at least ``HEADER.size`` bytes); ``ValueError`` saying what is
    wrong when it is not a ledger this version can read (:class:`Damage` when it is damaged).
    """
    if len(data) < HEADER.size:
        raise ValueError(f"too short for a ledger header ({len(data)} bytes)")
    (magic, version, slot_bytes, slots, high, cap, total, hard, identity,
     label) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a gpubudget ledger (it starts with {magic!r})")
    if version != VERSION:
        raise ValueError(f"written in ledger format {version}; this gpubudget reads format "
                         f"{VERSION}")
    if (slot_bytes, slots) != (SLOT_BYTES, SLOTS) or high > slots:
        raise Damage(f"damaged header (slots {slots} of {slot_bytes} bytes, {high} used)")
    return Header(version, slot_bytes, slots, high, cap or None, total, bool(hard),
                  _text(identity), _text(label))


def encode_slot(numbers: dict[str, int], name: str, process: str) -> bytes:
    """A slot's bytes: ``numbers`` by field name (missing ones 0), the two texts."""
    return SLOT.pack(*(numbers.get(field, 0) for field in SLOT_FIELDS), text_field(name),
                     text_field(process))


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

    @property
    def holds(self) -> int:
        """Bytes this budget counts against its device: its claim, or what it reserved if
        that is more."""
        return max(self.claim, self.reserved)


def decode_entry(data: bytes | memoryview, offset: int, slot: int) -> Entry | None:
    """The slot at ``offset`` of ``data``, or ``None`` if it is free (or not a state this
    version writes)."""
    (state, pid, start, pidns, boot, limit, claim, reserved, used, peak, denials, claimed_at,
     reserved_at, ordinal, share, serial, name, process) = SLOT.unpack_from(data, offset)
    kind = _STATES.get(state)
    if kind is None:
        return None
    return Entry(slot, kind, pid, start, pidns, boot, limit, claim, reserved, used, peak,
                 denials, claimed_at, reserved_at, ordinal - 1 if ordinal else None,
                 share / 1e6 if share else None, serial, _text(name), _text(process))
