"""A registered root's child budgets in its device's ledger file: shown as they enter and go.

A root's slot says what the root holds and uses; its children live in *pages* of the file
(:mod:`~gpubudget.hostledger.layout`): 15 rows each, taken by one root under the file's lock
when its first child enters (or when its pages are full), freed when the root releases its
slot. Everything else is a plain store of the root's own process, with no lock: a child's
entry writes a free row of its root's pages (``state`` last) and points the child's ledger
account at the row's ``used`` and ``peak``, which every charge then stores into, as it does
into the root's slot (:func:`gpubudget._core.ledger.charge`); a child's release frees its row
(``state`` first). So a child's entry costs a few stores, and its root's first child one
short hold of the lock.

When no row can be had (the file's pages are all taken, or the lock is held elsewhere for
more than :data:`PAGE_WAIT`), the child is *hidden*: its budget works as any budget does,
the root's slot counts it in ``hidden`` until it is released, and ``gpubudget top`` says how
many are hidden. A child whose parent is hidden is hidden too. Nothing here ever fails a
budget; an exception from outside (a Ctrl-C, a signal handler's ``TimeoutError``) propagates,
leaving every page and row either this root's, and freed with it, or free.

:func:`read_children` builds, for a reader (``top``, metrics), each live root's children as
an indented tree (:class:`ChildBudget`), trusting nothing it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, NamedTuple

from ..errors import raise_if_from_outside
from .errors import LedgerError
from .layout import (
    CHILD,
    CHILD_BYTES,
    CHILD_FIELDS,
    CHILDREN,
    FREE,
    OPEN,
    PAGE_BYTES,
    PAGE_ROWS,
    PAGES,
    SLOTS,
    Entry,
    child_word,
    decode_child,
    header_word,
    page_word,
    slot_word,
    text_field,
)

if TYPE_CHECKING:
    from .book import DeviceBook

__all__ = ["PAGE_WAIT", "ChildBudget", "Family", "read_children"]

PAGE_WAIT: Final = 0.02
"""How long a root's child waits for the file's lock to take a page (its root's first child,
or one more than its pages hold); after that it is hidden. The lock is held for
microseconds: longer means a process stopped while holding it."""
_PAGES_HIGH: Final = header_word("pages_high")
_USED: Final = CHILD_FIELDS.index("used")
_MOST: Final = (1 << 64) - 1
"""A limit beyond 64 bits (a child may overcommit) is shown as the largest word."""
_PAGE_WORDS: Final = PAGE_BYTES // 8
_HEAD: Final = ("pid", "serial", "claimed_at")


class Family:
    """The child budgets of one registered root, in the root's slot ``slot`` of ``book``.

    Its methods are called with the root's tree lock held (:class:`~gpubudget._core.recorder.
    Recorder` calls them), so the rows need no other lock in this process; ``account`` is a
    budget's ledger account (:class:`gpubudget._core.ledger.Account`).
    """

    __slots__ = ("book", "slot", "root", "head", "pages", "free", "rows", "hidden")

    def __init__(self, book: DeviceBook, slot: int, root: Any) -> None:
        self.book: Final = book
        self.slot: Final = slot
        self.root: Final = root  # the root's account: a child's parent when it is the root
        words = book.words
        self.head: Final = tuple(words[slot_word(slot, field)] for field in _HEAD)
        self.pages: list[int] = []
        self.free: list[int] = []  # rows of its pages that no child holds
        self.rows: dict[Any, tuple[int, int]] = {}  # account -> its row and depth
        self.hidden: set[Any] = set()  # accounts of children that no row shows

    def opened(self, account: Any, parent: Any, serial: int, name: str) -> None:
        """The child budget of ``account`` entered under ``parent``'s: show it in a row, or
        count it hidden."""
        above = (-1, 0) if parent is self.root else self.rows.get(parent)
        if above is None or not self.free and not self._take_page():
            self.hidden.add(account)
            self.book.words[slot_word(self.slot, "hidden")] = len(self.hidden)
            return
        depth = above[1] + 1
        row = self.free[-1]
        self.rows[account] = (row, depth)  # first: released() frees it, whatever lands next
        del self.free[-1]
        offset = CHILDREN + row * CHILD_BYTES
        book = self.book
        CHILD.pack_into(book.map, offset, FREE, above[0] + 1, depth, serial,
                        min(account.limit, _MOST), min(account.reserve, _MOST), account.used,
                        account.peak, text_field(name))
        words = book.words
        words[offset // 8] = OPEN  # last: readers see it whole
        at = offset // 8 + _USED  # then "peak"
        account.published = words[at: at + 2]

    def released(self, account: Any) -> None:
        """``account``'s budget was released: its row is free (or it is hidden no more)."""
        found = self.rows.pop(account, None)
        if found is None:
            if account in self.hidden:
                self.hidden.discard(account)
                self.book.words[slot_word(self.slot, "hidden")] = len(self.hidden)
            return
        account.published = None
        self.book.words[child_word(found[0], "state")] = FREE  # first: readers skip it now
        self.free.append(found[0])

    def close(self) -> None:
        """The root goes: its pages are free (its slot is freed next). Without the lock: a
        page goes from owned to free only by its owner's store."""
        words = self.book.words
        for account in self.rows:
            account.published = None
        for page in self.pages:
            words[page_word(page, "owner")] = 0
        self.pages.clear()
        self.free.clear()
        self.rows.clear()

    def _take_page(self) -> bool:
        """A free page of the file for this root's children (under the file's lock, waiting
        :data:`PAGE_WAIT` at most); whether one was had."""
        book = self.book
        try:
            with book.locked(PAGE_WAIT):
                page = self._free_page()
                if page is None:
                    return False
                words, offset = book.words, CHILDREN + page * PAGE_BYTES
                book.map[offset: offset + PAGE_BYTES] = bytes(PAGE_BYTES)  # owner 0 first
                for field, value in zip(_HEAD, self.head):
                    words[page_word(page, field)] = value
                words[page_word(page, "owner")] = self.slot + 1  # last: the page is whole
                self.pages.append(page)  # then this root's (no signal is handled in between)
                if page >= words[_PAGES_HIGH]:
                    words[_PAGES_HIGH] = page + 1
        except LedgerError:
            return False
        except OSError as exc:  # the file's lock refused
            raise_if_from_outside(exc)  # a signal handler's TimeoutError propagates
            return False
        first = page * PAGE_ROWS + 1
        self.free.extend(range(first + PAGE_ROWS - 2, first - 1, -1))  # lowest row first
        return True

    def _free_page(self) -> int | None:
        """Lock held: a page nobody owns, or whose owner's root has gone; else a page never
        used; ``None`` when every page is taken."""
        words = self.book.words
        high = min(words[_PAGES_HIGH], PAGES)
        start = page_word(0, "owner")
        owners = words[start: start + high * _PAGE_WORDS: _PAGE_WORDS].tolist()
        try:
            return owners.index(0)
        except ValueError:
            pass
        for page, owner in enumerate(owners):
            if not _owned(words, page, owner):
                return page
        return high if high < PAGES else None


def _owned(words: memoryview, page: int, owner: int) -> bool:
    """Whether page ``page``, whose head names slot ``owner - 1``, belongs to the root that
    holds that slot now."""
    slot = owner - 1
    if not 0 <= slot < SLOTS or words[slot_word(slot, "state")] == FREE:
        return False
    return all(words[page_word(page, field)] == words[slot_word(slot, field)]
               for field in _HEAD)


class ChildBudget(NamedTuple):
    """A child budget as a reader shows it: its name, its depth under its root (1: a child of
    the root), its limit, reserve, ``used`` and ``peak``, and ``free``: what one more block
    could still be charged to it by every limit up to its root."""

    name: str
    depth: int
    limit: int
    reserve: int
    used: int
    peak: int
    free: int


def read_children(pages: bytes, entries: tuple[Entry, ...] | list[Entry],
                  serials: dict[int, tuple[int, ...]] | None = None
                  ) -> dict[int, tuple[ChildBudget, ...]]:
    """The children of each of ``entries`` (live roots) that ``pages`` (the file's first
    pages, as read) show, by root slot: depth first, siblings in the order they entered.
    Rows of pages whose root has gone, rows whose parent is not shown, loops: left out.
    ``serials``, if given, gets each root's children's serials (their budget numbers in
    their process), in the same order."""
    roots = {entry.slot: entry for entry in entries}
    rows: dict[int, dict[int, Any]] = {}  # root slot -> row -> child
    for page in range(len(pages) // PAGE_BYTES):
        base = page * PAGE_BYTES
        owner, pid, serial, claimed_at = memoryview(pages)[base: base + 32].cast("Q")
        entry = roots.get(owner - 1)
        if entry is None or (entry.pid, entry.serial, entry.claimed_at) != (
                pid, serial, claimed_at):
            continue
        found = rows.setdefault(entry.slot, {})
        for row in range(1, PAGE_ROWS):
            child = decode_child(pages, base + row * CHILD_BYTES, page * PAGE_ROWS + row)
            if child is not None:
                found[child.row] = child
    trees = {}
    for slot, found in rows.items():
        numbers: list[int] = []
        tree = _tree(roots[slot], found, numbers)
        if tree:
            trees[slot] = tree
            if serials is not None:
                serials[slot] = tuple(numbers)
    return trees


def _tree(root: Entry, rows: dict[int, Any], serials: list[int]) -> tuple[ChildBudget, ...]:
    """``rows`` (row -> child) of ``root`` as a tree, depth first."""
    below: dict[int | None, list[Any]] = {}
    for child in rows.values():
        below.setdefault(child.parent, []).append(child)
    for siblings in below.values():
        siblings.sort(key=lambda child: (child.serial, child.row))
    shown: list[ChildBudget] = []
    # (child, depth, what its ancestors' limits leave it, as ``available`` counts it)
    stack = [(child, 1, root.limit - root.used) for child in reversed(below.get(None, []))]
    seen: set[int] = set()
    while stack:
        child, depth, room = stack.pop()
        if child.row in seen:  # a loop: rows that name each other as parent
            continue
        seen.add(child.row)
        # its own reserve, set aside and unused, is room its ancestors' limits leave it
        room = min(child.limit - child.used, room + max(child.reserve - child.used, 0))
        shown.append(ChildBudget(child.name, depth, child.limit, child.reserve, child.used,
                                 child.peak, max(room, 0)))
        serials.append(child.serial)
        stack.extend((grandchild, depth + 1, room)
                     for grandchild in reversed(below.get(child.row, [])))
    return tuple(shown)
