"""The ledger: what each budget is charged, checked against its own and its ancestors' limits.

An :class:`Account` holds one budget's numbers. A budget's ``used`` is its own blocks plus
what its children pass up; a child with a ``reserve`` floor passes up ``max(used, reserve)``,
so its reserve counts in the parent from entry on. Every change goes through these
functions, with the tree's lock held:

1. :func:`claim` -- would ``delta`` more bytes exceed a limit anywhere up the chain? If not,
   they are claimed (``claimed``, at every level) until step 2 or 3; if so, nothing changes
   and the first account that refuses is named. (:func:`refusal` asks the same and claims
   nothing.) What is claimed counts against the limits like what is used, so an allocation
   made while another is between its claim and its charge (a finalizer that runs while the
   pure arena places a block, on the same thread) cannot pass a limit with it;
2. :func:`charge` -- apply ``delta`` (positive or negative) up the chain, a positive one
   taking its claim back; peaks rise only here, so a request that is refused, or that the
   arena cannot place, never moves a peak. An account with words to publish into
   (``published``: a root registered in the host ledger, :mod:`gpubudget.hostledger`, and
   each of its children that the ledger shows) has its ``used`` stored there each time it
   changes, and its ``peak`` each time ``used`` is at it (so after ``reset_peak()`` the
   published peak follows once ``used`` reaches the new one): plain stores, one or two per
   level of the chain that has words, nothing else;
3. :func:`settle` -- a claim that will not be charged (the arena cannot place the block, a
   resize cannot grow in place), withdrawn.

A claim puts its whole ``delta`` on every level, even above a reserve floor that passes less
up: it may count more than its charge will for a moment, never less, and :func:`charge` and
:func:`settle` take back exactly what it put, whatever changed meanwhile.

Under the driver door (:mod:`gpubudget.door`), an account also has the door's words for its
budget (``door``): :func:`refusal`, :func:`claim` and :func:`available` count the bytes the
door charged it (that are not a root's own memory) against its limit, and every change
stores ``used + claimed`` into them, for the door to count against the same limit. Without
the door ``door`` is ``None``. The door charges from any thread, without the tree's lock:
:func:`claim` stores its bytes into the door's words before it reads the door's bytes again
to check, and the door does the mirror image (its compare-and-swap, then this word read
again), so of two allocations made at the same moment, one through the door and one here,
at least one sees the other: both may be refused, never both granted past the limit.

Invariant ``LEDGER`` (checked by ``Budget.check()``): an account's ``used`` is the aligned size
of its own live blocks plus, for each unreleased child, ``max(child.used, child.reserve)``;
``used <= limit`` always.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final, cast

from ..extensions import extension

native: Final = extension("_core", "_native")  # the C core, or None

__all__ = ["Account", "available", "charge", "claim", "encloses", "passed_up", "publish",
           "refusal", "settle"]


class Account:
    """One budget's numbers: its limit, reserve floor, bytes charged now and their peak.

    ``parent`` is the parent budget's account (``None`` for a root), ``depth`` the number of
    ancestors; ``plain`` says that neither this account nor any ancestor has a reserve, so
    that every one of them is charged the same delta. An account keeps no copy of its chain:
    a tree ``n`` budgets deep costs ``n`` accounts, not ``n**2`` references.
    """

    __slots__ = ("name", "limit", "reserve", "used", "peak", "refusals", "parent", "depth",
                 "plain", "published", "door", "claimed")

    def __init__(
        self, name: str, limit: int, reserve: int = 0, parent: Account | None = None
    ) -> None:
        self.name: Final = name  # the budget's, for saying who refused
        self.limit: Final = limit
        self.reserve: Final = reserve
        self.used = 0  # aligned bytes charged now, children's included
        self.peak = 0  # highest ``used`` reached by granted charges
        self.claimed = 0  # bytes claimed here by allocations not yet charged (claim)
        self.refusals = 0  # requests this limit refused (asked here or below), counted by callers
        self.parent: Final = parent
        self.depth: Final[int] = 0 if parent is None else parent.depth + 1
        self.plain: Final[bool] = not reserve and (parent is None or parent.plain)
        # Words in the host ledger (used, peak, ...: a registered root's slot, or a shown
        # child's row), which every change of ``used`` stores into: plain stores, for other
        # processes to read.
        self.published: memoryview | None = None
        # The driver door's words for this budget (gpubudget.door): [0] bytes the door
        # charged here, [2] the part that is a root's own memory; [1] gets ``used``.
        self.door: memoryview | None = None


def passed_up(account: Account, used: int) -> int:
    """What an account using ``used`` bytes weighs in its parent."""
    return used if used > account.reserve else account.reserve


_passed_up: Final = passed_up  # the Python one, for the Python functions below


def _foreign(account: Account) -> int:
    """Bytes the driver door charged ``account`` that are not its own memory (0 without)."""
    door = account.door
    return 0 if door is None else max(door[0] - door[2], 0)


def _over(link: Account, delta: int, claimed: int) -> bool:
    """Whether ``delta`` more bytes take ``link`` over its limit, counting ``claimed`` bytes
    claimed there and not yet charged, and the door's bytes (for a positive ``delta``)."""
    if delta > 0:
        delta += claimed + _foreign(link)
    return link.used + delta > link.limit


def refusal(account: Account, delta: int) -> Account | None:
    """The first account of ``account``'s chain whose limit ``delta`` more bytes would
    exceed (counting what is claimed there, see :func:`claim`), or ``None`` when all of them
    can take it. Changes nothing."""
    link: Account | None = account
    if account.plain:
        while link is not None:
            if _over(link, delta, link.claimed):
                return link
            link = link.parent
        return None
    node: Account | None = account
    while node is not None and delta > 0:
        if _over(node, delta, node.claimed):
            return node
        if node.reserve:  # only what rises above the floor reaches the parent
            delta = _passed_up(node, node.used + delta) - _passed_up(node, node.used)
        node = node.parent
    return None


_refusal: Final = refusal  # the Python ones, for the functions below (the names become C's)
_WORD_MAX: Final = 2**63 - 1  # the door's words are signed 64-bit


def _word(account: Account) -> int:
    """What the door counts of ``account``: ``used`` and the bytes claimed, not yet charged."""
    return min(account.used + account.claimed, _WORD_MAX)


def _claimed(door: memoryview, word: int) -> int:
    """Store ``word`` into ``door``'s word 1, then read the door's bytes that are not a
    root's own, in that order for the door's threads too (the door library's ``gbd_claim``:
    a Python store and load are not ordered against another core's compare-and-swap)."""
    if not _gbd_claim:
        import ctypes  # here: only under the door

        found = getattr(ctypes.CDLL(None), "gbd_claim", None)  # the preloaded door
        if found is not None:
            found.restype = ctypes.c_int64
            found.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        _gbd_claim.append(cast("Callable[[int, int], int] | None", found))
    claim_at = _gbd_claim[0]
    if claim_at is None:  # no door library in the process: words nobody else writes
        door[1] = word
        return max(door[0] - door[2], 0)
    import ctypes

    return claim_at(ctypes.addressof(ctypes.c_int64.from_buffer(door)), word)


_gbd_claim: list[Callable[[int, int], int] | None] = []  # the door's gbd_claim, once looked up


def claim(account: Account, delta: int) -> Account | None:
    """:func:`refusal` for an allocation about to be charged, which claims its bytes: each
    level's ``claimed`` gets the whole ``delta`` (see the module's docstring), shown to the
    door before its bytes are read again. Call :func:`charge` (which takes the claim back as
    the bytes become ``used``) or :func:`settle` after a claim that passed; a refusal
    withdraws what it claimed."""
    if delta <= 0:
        return _refusal(account, delta)
    d = delta  # what reaches this level, past the floors below
    node: Account | None = account
    while node is not None:
        others = node.claimed
        refused = d > 0 and _over(node, d, others)
        stop: Account | None = node  # the first level not claimed, on a refusal
        if not refused:
            node.claimed = others + delta
            stop = node.parent
            if node.door is not None:
                foreign = _claimed(node.door, _word(node))  # the door's bytes, read again
                refused = d > 0 and node.used + d + others + foreign > node.limit
        if refused:
            _unclaim(account, stop, delta)
            return node
        if not account.plain and node.reserve and d > 0:
            d = _passed_up(node, node.used + d) - _passed_up(node, node.used)
        node = node.parent
    return None


def _unclaim(account: Account, stop: Account | None, delta: int) -> None:
    """A claim of ``delta`` given back from ``account`` up to (not including) ``stop``."""
    link: Account | None = account
    while link is not stop and link is not None:
        link.claimed = max(link.claimed - delta, 0)
        if link.door is not None:
            link.door[1] = _word(link)
        link = link.parent


def settle(account: Account, delta: int) -> None:
    """A claim of ``delta`` bytes that will not be charged (the arena could not place the
    block, a resize could not grow in place), withdrawn at every level."""
    _unclaim(account, None, max(delta, 0))


def charge(account: Account, delta: int) -> None:
    """Add ``delta`` bytes (negative to give back) to ``account`` and, as reserves pass them
    up, to its ancestors; raise their peaks. A positive ``delta`` follows its
    :func:`claim`, which it takes back at every level."""
    claimed = delta if delta > 0 else 0
    if account.plain:
        link: Account | None = account
        while link is not None:
            used = link.used = link.used + delta
            if used > link.peak:
                link.peak = used
            if claimed:
                link.claimed = max(link.claimed - claimed, 0)
            if link.door is not None:  # the driver door reads it: ledger.c does the same
                link.door[1] = _word(link)
            published = link.published
            if published is not None:
                published[0] = used
                if used == link.peak:  # at its peak: a new one, or the one reset_peak() set
                    published[1] = used
            link = link.parent
        return
    node: Account | None = account
    while node is not None and (delta or claimed):
        if delta:
            old = node.used
            used = node.used = old + delta
            if used > node.peak:
                node.peak = used
            if node.published is not None:
                node.published[0] = used
                if used == node.peak:
                    node.published[1] = used
            if node.reserve:
                delta = _passed_up(node, used) - _passed_up(node, old)
        if claimed:
            node.claimed = max(node.claimed - claimed, 0)
        if node.door is not None:
            node.door[1] = _word(node)
        node = node.parent


def publish(account: Account) -> None:
    """Store ``account``'s ``used`` (and its ``peak``, if ``used`` is at it) into its
    published words, and what the door counts of it into the door's, as :func:`charge`
    does: after its numbers were set another way."""
    if account.door is not None:
        account.door[1] = _word(account)
    published = account.published
    if published is not None:
        published[0] = account.used
        if account.used == account.peak:
            published[1] = account.used


def available(account: Account) -> int:
    """Bytes one allocation could still be charged to ``account`` by every limit of its
    chain, counting reserved but unused bytes below each level as usable there."""
    best = account.limit - account.used - _foreign(account)
    slack = 0  # reserved but unused bytes of the accounts walked so far
    link = account
    while link.parent is not None:
        slack += max(link.reserve - link.used, 0)
        parent = link.parent
        best = min(best, parent.limit - parent.used - _foreign(parent) + slack)
        link = parent
    return max(best, 0)


def encloses(account: Account, other: Account) -> bool:
    """Whether ``account`` is ``other`` or one of its ancestors (a walk up from ``other``)."""
    link: Account | None = other
    while link is not None and link.depth >= account.depth:
        if link is account:
            return True
        link = link.parent
    return False


PYTHON: Final = (Account, available, charge, passed_up, refusal, claim, settle)
"""The ledger in Python, whichever core runs (tests compare it with the C one)."""

if native is not None and not TYPE_CHECKING:  # the same rules in C: ledger.c
    Account = native.Account
    available = native.available
    charge = native.charge
    passed_up = native.passed_up
    refusal = native.refusal
    claim = native.claim
    settle = native.settle
