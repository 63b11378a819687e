"""Allocation traces shared by the benchmarks.

A trace is a list of steps ``(slot, size)``: free whatever ``slot`` holds (if anything),
then, when ``size`` is positive, allocate ``size`` bytes into ``slot``.
"""

from __future__ import annotations

import math
import random

Trace = list[tuple[int, int]]

MIN_SIZE = 256
MAX_SIZE = 16 * 2**20


def log_uniform(rng: random.Random, low: int = MIN_SIZE, high: int = MAX_SIZE) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def churn(live: int = 1000, steps: int = 20_000, seed: int = 0) -> tuple[Trace, Trace]:
    """DESIGN §8's churn trace: ``live`` blocks of log-uniform sizes (256 B–16 MiB), then
    ``steps`` steps that each free a random block and allocate a new one in its place.

    Returns ``(warmup, timed)``: the fill, and the steps that are timed.
    """
    rng = random.Random(seed)
    warmup = [(slot, log_uniform(rng)) for slot in range(live)]
    timed = [(rng.randrange(live), log_uniform(rng)) for _ in range(steps)]
    return warmup, timed
