"""A root budget's numbers as other processes see them: plain stores into shared memory.

A root registered in the host ledger (:mod:`gpubudget.hostledger`) owns one slot of a file
that every process of the host maps. :class:`Published` writes the root's ``used``, ``peak``
and denial count into that slot's words as they change, with one aligned 64-bit store each:
no lock, no system call, nothing but the numbers. Only the owning process writes them; readers
(``gpubudget top``, metrics) may see a value a moment old, never a torn one.
"""

from __future__ import annotations

from typing import Final

__all__ = ["Published"]


class Published:
    """Writes one root's counters into ``words`` (a ``memoryview`` of 64-bit words) at
    ``at`` (``used``), ``at + 1`` (``peak``) and ``at + 2`` (denials).

    >>> words = memoryview(bytearray(8 * 4)).cast("Q")
    >>> published = Published(words, 1)
    >>> published.moved(4096, 4096); published.moved(1024, 4096); published.denied()
    >>> words.tolist()
    [0, 1024, 4096, 1]
    """

    __slots__ = ("words", "at", "peak", "denials")

    def __init__(self, words: memoryview, at: int) -> None:
        self.words: Final = words
        self.at: Final = at
        self.peak = 0
        self.denials = 0

    def moved(self, used: int, peak: int) -> None:
        """The root's ``used`` is now ``used`` (its ``peak`` ``peak``)."""
        words = self.words
        words[self.at] = used
        if peak != self.peak:
            self.peak = peak
            words[self.at + 1] = peak

    def denied(self) -> None:
        """A request somewhere in the root's tree was denied."""
        self.denials += 1
        self.words[self.at + 2] = self.denials
