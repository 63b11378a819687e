"""gpubudget.hostledger.layout: the file format reads back what it wrote, and refuses what it
did not."""

from __future__ import annotations

import pytest

from gpubudget.hostledger import layout
from gpubudget.hostledger.layout import (
    HEADER,
    SLOT_FIELDS,
    decode_entry,
    decode_header,
    encode_header,
    encode_slot,
    text_field,
)


def test_a_header_reads_back() -> None:
    header = decode_header(encode_header("GPU-1234", "NVIDIA H200", 141 * 2**30, hard=False))
    assert (header.identity, header.label, header.total, header.hard, header.cap,
            header.high) == ("GPU-1234", "NVIDIA H200", 141 * 2**30, False, None, 0)
    assert len(encode_header("x", "y", 1, True)) == layout.HEADER_BYTES


@pytest.mark.parametrize(("data", "message"), [
    (b"short", "too short for a ledger header"),
    (b"NOTLEDGR" + bytes(4088), "not a gpubudget ledger (it starts with b'NOTLEDGR')"),
    (HEADER.pack(b"GPUBLEDG", 1, 256, 4096, 0, 0, 0, 0, 0, 0, 0, 0, b"", b"", b""),
     "written in ledger format 1; this gpubudget reads format 3"),
    (HEADER.pack(b"GPUBLEDG", 2, 256, 4096, 0, 0, 0, 0, 0, 0, 0, 0, b"", b"", b""),
     "written in ledger format 2; this gpubudget reads format 3"),
    (HEADER.pack(b"GPUBLEDG", 3, 128, 4096, 0, 0, 0, 0, 128, 1024, 0, 0, b"", b"", b""),
     "damaged header"),
    (HEADER.pack(b"GPUBLEDG", 3, 256, 4096, 5000, 0, 0, 0, 128, 1024, 0, 0, b"", b"", b""),
     "5000 used"),
    (HEADER.pack(b"GPUBLEDG", 3, 256, 4096, 0, 0, 0, 0, 64, 1024, 0, 0, b"", b"", b""),
     "pages 1024 of 64-byte rows"),
    (HEADER.pack(b"GPUBLEDG", 3, 256, 4096, 0, 0, 0, 0, 128, 1024, 1025, 0, b"", b"", b""),
     "1025 used"),
])
def test_a_header_that_is_not_ours_says_why(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_header(data)


def test_a_slot_reads_back_and_a_free_one_reads_as_none() -> None:
    numbers = {field: index + 1 for index, field in enumerate(SLOT_FIELDS)}
    numbers.update(state=layout.RESERVED, share=500_000, ordinal=2)
    entry = decode_entry(encode_slot(numbers, "detector", "python serve.py"), 0, 7)
    assert entry is not None
    assert (entry.slot, entry.state, entry.pid, entry.limit, entry.used, entry.share,
            entry.ordinal, entry.name, entry.process) == (
        7, "reserved", 2, 6, 9, 0.5, 1, "detector", "python serve.py")
    assert entry.holds == max(entry.claim, entry.reserved) == 8
    assert decode_entry(encode_slot({}, "", ""), 0, 0) is None
    assert decode_entry(encode_slot({"state": 9}, "", ""), 0, 0) is None  # unknown state
    assert decode_entry(encode_slot({"state": layout.CLAIMED}, "", ""), 0, 0) is not None


def test_a_child_row_reads_back_and_a_free_one_reads_as_none() -> None:
    numbers = {field: index + 1 for index, field in enumerate(layout.CHILD_FIELDS)}
    numbers["state"] = layout.OPEN
    child = layout.decode_child(layout.encode_child(numbers, "backbone"), 0, 33)
    assert child == layout.Child(33, 1, 3, 4, 5, 6, 7, 8, "backbone")  # parent: its row + 1
    root_child = layout.decode_child(layout.encode_child({"state": layout.OPEN}, "x"), 0, 1)
    assert root_child is not None and root_child.parent is None  # 0: the root
    assert layout.decode_child(layout.encode_child({}, "x"), 0, 1) is None
    assert layout.decode_child(layout.encode_child({"state": 2}, "x"), 0, 1) is None


def test_pages_follow_the_slots_and_fill_the_file() -> None:
    assert layout.CHILDREN == layout.HEADER_BYTES + layout.SLOTS * layout.SLOT_BYTES
    assert layout.FILE_BYTES == layout.CHILDREN + layout.PAGES * layout.PAGE_BYTES
    assert layout.page_word(3, "owner") * 8 == layout.CHILDREN + 3 * layout.PAGE_BYTES
    assert layout.child_word(16 * 3 + 2, "used") * 8 == (
        layout.CHILDREN + 3 * layout.PAGE_BYTES + 2 * layout.CHILD_BYTES + 6 * 8)
    assert layout.child_word(5, "peak") == layout.child_word(5, "used") + 1  # published pair
    header = decode_header(encode_header("x", "y", 1, True))
    assert header.pages_high == 0 and layout.header_word("pages_high") == 10


def test_texts_are_cut_to_64_bytes_without_splitting_a_character() -> None:
    assert text_field("é" * 40) == ("é" * 32).encode()
    assert text_field("a" + "é" * 40) == ("a" + "é" * 31).encode()
    assert text_field("\udcff") == b"\\udcff"  # a lone surrogate is written escaped


def test_the_change_log_fits_the_header_after_the_fields() -> None:
    assert layout.HEADER.size <= layout.CHANGES_WORD * 8 < layout.UNLOCKED_WORD * 8
    assert layout.UNLOCKED_WORD < layout.LOG_WORD
    assert (layout.LOG_WORD + layout.LOG_LENGTH) * 8 <= layout.HEADER_BYTES
    assert encode_header("x", "y", 1, True)[layout.CHANGES_WORD * 8:] == bytes(
        layout.HEADER_BYTES - layout.CHANGES_WORD * 8)  # a new file: no change yet


def test_word_indexes() -> None:
    assert layout.slot_word(0, "state") * 8 == layout.HEADER_BYTES
    assert layout.slot_word(2, "denials") * 8 == layout.HEADER_BYTES + 2 * 256 + 10 * 8
    assert layout.slot_word(2, "hidden") * 8 == layout.HEADER_BYTES + 2 * 256 + 16 * 8
    assert layout.header_word("cap") == 5
