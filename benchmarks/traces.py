"""Allocation traces shared by the benchmarks, and a replayer.

A trace is a list of steps ``(slot, size)``. In the churn trace each step frees what
``slot`` holds and allocates ``size`` bytes in its place; in the model-loading trace a
positive ``size`` allocates into an empty slot and ``size == 0`` frees the slot.
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Callable
from typing import Any

from gpubudget.units import KiB, MiB

Trace = list[tuple[int, int]]

MIN_SIZE = 256
MAX_SIZE = 16 * MiB


def log_uniform(rng: random.Random, low: int = MIN_SIZE, high: int = MAX_SIZE) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def churn(live: int = 1000, steps: int = 20_000, seed: int = 0) -> tuple[Trace, Trace]:
    """The churn trace: ``live`` blocks of log-uniform sizes (256 B–16 MiB), then
    ``steps`` steps that each free a random block and allocate a new one in its place.

    Returns ``(warmup, timed)``: the fill, and the steps that are timed.
    """
    rng = random.Random(seed)
    warmup = [(slot, log_uniform(rng)) for slot in range(live)]
    timed = [(rng.randrange(live), log_uniform(rng)) for _ in range(steps)]
    return warmup, timed



def model_loading(models: int = 3, seed: int = 0) -> Trace:
    """A trace shaped like TensorRT loading and serving several models.

    Steps are ``(slot, size)``: ``size > 0`` allocates into the empty ``slot``, ``size == 0``
    frees it. For each model, in turn:

    1. build: 150 tactic trials, each allocating a workspace from a recurring set of sizes
       (1-256 MiB, powers of two) and 1-3 scratch blocks (64 KiB-4 MiB), then freeing them,
       mostly in reverse order, sometimes in random order; the builder's own weight copies
       (8-30 blocks, 256 KiB-64 MiB) stay live through the build and are freed at its end;
    2. deserialize: the engine's weights, one large block (64-512 MiB) and 10-40 layer blocks
       (64 KiB-32 MiB, log-uniform), live until the end;
    3. serve: 2-4 execution contexts, each allocating 20-60 activation blocks drawn from the
       model's palette of 12 recurring sizes (4 KiB-64 MiB) and a workspace; contexts are
       destroyed (frees in random order) and re-created 3 times.

    At the end every engine's blocks are freed, models interleaved. Sizes are not multiples
    of 256: TensorRT asks for exact tensor sizes.
    """
    rng = random.Random(seed)
    steps: Trace = []
    next_slot = 0

    def allocate(size: int) -> int:
        nonlocal next_slot
        slot = next_slot
        next_slot += 1
        steps.append((slot, size))
        return slot

    def free_all(slots: list[int], shuffle: bool) -> None:
        order = slots[:]
        if shuffle:
            rng.shuffle(order)
        else:
            order.reverse()
        steps.extend((slot, 0) for slot in order)
        slots.clear()

    def odd(size: int) -> int:  # an exact tensor size, rarely a round number
        return max(size - rng.randrange(0, 256), 1)

    engines: list[list[int]] = []
    for _ in range(models):
        builder_weights = [allocate(odd(log_uniform(rng, 256 * KiB, 64 * MiB)))
                           for _ in range(rng.randint(8, 30))]
        for _trial in range(150):
            trial = [allocate(odd(2 ** rng.randint(20, 28)))]
            trial += [allocate(odd(log_uniform(rng, 64 * KiB, 4 * MiB)))
                      for _ in range(rng.randint(1, 3))]
            free_all(trial, shuffle=rng.random() < 0.3)
        free_all(builder_weights, shuffle=True)
        engine = [allocate(odd(log_uniform(rng, 64 * MiB, 512 * MiB)))]
        engine += [allocate(odd(log_uniform(rng, 64 * KiB, 32 * MiB)))
                   for _ in range(rng.randint(10, 40))]
        engines.append(engine)
        palette = [odd(log_uniform(rng, 4 * KiB, 64 * MiB)) for _ in range(12)]
        contexts = [[] for _ in range(rng.randint(2, 4))]  # type: list[list[int]]
        for _round in range(4):
            for context in contexts:
                if context:
                    free_all(context, shuffle=True)
                context += [allocate(rng.choice(palette)) for _ in range(rng.randint(20, 60))]
                context.append(allocate(odd(2 ** rng.randint(20, 26))))
        for context in contexts:
            engine += context
    remaining = [slot for engine in engines for slot in engine]
    rng.shuffle(remaining)
    steps.extend((slot, 0) for slot in remaining)
    return steps


def adversarial(rounds: int = 600, seed: int = 0) -> Trace:
    """Two size classes with interleaved lifetimes, the pattern that fragments pools.

    Each round allocates a large, short-lived block (activations: 1-24 MiB, the size rising
    and falling like a batch size that varies) and a small, long-lived one (64-512 KiB, a
    cache entry kept to the end), then frees the large block of two rounds before. The small
    blocks land between the large ones and pin the holes they leave, so a later large block,
    a little bigger than any hole, needs new space. Model_loading format.
    """
    rng = random.Random(seed)
    steps: Trace = []
    large: list[int] = []
    small: list[int] = []
    slot = 0
    for step in range(rounds):
        wave = 0.5 + 0.5 * math.sin(step / 37)  # rises and falls
        steps.append((slot, int((1 + 23 * wave) * MiB) + rng.randrange(4096)))
        large.append(slot)
        slot += 1
        steps.append((slot, log_uniform(rng, 64 * KiB, 512 * KiB)))
        small.append(slot)
        slot += 1
        if len(large) > 2:
            steps.append((large.pop(0), 0))
    steps.extend((freed, 0) for freed in large + small)
    return steps


def peak_live(trace: Trace, align: int = 256) -> int:
    """Highest sum of live aligned sizes over ``trace`` (model_loading format)."""
    live: dict[int, int] = {}
    total = peak = 0
    for slot, size in trace:
        if size:
            live[slot] = (size + align - 1) & -align
            total += live[slot]
            peak = max(peak, total)
        else:
            total -= live.pop(slot)
    return peak


def replay(trace: Trace, allocate: Callable[[int], Any], free: Callable[[Any], object]) -> float:
    """Run a model_loading-format trace; seconds taken. Raises if an allocation fails."""
    slots: dict[int, Any] = {}
    gc.collect()  # every allocator starts timing from the same collector state
    start = time.perf_counter()
    for slot, size in trace:
        if size:
            handle = allocate(size)
            if handle is None:
                raise MemoryError(f"allocation of {size} bytes failed during the trace")
            slots[slot] = handle
        else:
            free(slots.pop(slot))
    elapsed = time.perf_counter() - start
    for handle in slots.values():
        free(handle)
    return elapsed
