"""Soak: threads entering and leaving budgets at random under one root, loading models,
serving them, failing (a budget too small), unloading them (some after their budget ended,
from another thread), with ``release_cached()``, reports and ``check()`` in between; PyTorch
in several threads, CuPy and TensorRT-RTX's allocator (through its trampoline) beside them
where installed. Counts of each are printed; it passes with 0 aborts, 0 hangs, ``check()``
clean and every byte back at the end.

    python3 -m scripts.soak [--minutes 3] [--threads 4] [--seed 1] [--fake] [--rounds 0]
                            [--growable]
    python3 -m scripts.soak --measure 20000        # host memory per MemPool kept

It runs the soak in a child process (``-X faulthandler``, a watchdog that dumps every
thread's stack and exits if it runs past the time by ``--grace`` seconds) and reads how it
ended: exit 0 only if the child finished clean; an abort (a signal), a hang or a problem
exits 1. ``--fake`` runs on the CPU with the fakes of ``tests/`` (PyTorch aborts as 2.11 does
when a pool is destroyed while a thread routes); ``--rounds`` makes each thread do at least
that many rounds whatever the time. The core in use is the one the environment picks
(``GPUBUDGET_PURE=1``: the pure-Python one); the summary says which.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Any

import gpubudget
from gpubudget import Budget, gpu_budget
from scripts.soak_work import CupyWork, TorchWork, TrtWork, Work

WATCHDOG_EXIT = 1  # faulthandler's exit status when the watchdog fires
PROBLEM_EXIT = 2


class Tally:
    """Counts per (framework, event), and the problems seen, from every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.problems: list[str] = []

    def add(self, kind: str, event: str) -> None:
        with self.lock:
            self.counts[kind, event] += 1

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


class Handoff:
    """Models kept past their budget, unloaded later by whichever thread takes them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.models: list[tuple[Work, Any]] = []

    def put(self, work: Work, model: Any) -> None:
        with self.lock:
            self.models.append((work, model))

    def size(self) -> int:
        with self.lock:
            return len(self.models)

    def take(self) -> tuple[Work, Any] | None:
        """The oldest model kept, if any (no random pick: each thread's own choices depend
        only on the seed)."""
        with self.lock:
            return self.models.pop(0) if self.models else None


def one_model(work: Work, root: Budget, name: str, rng: random.Random, tally: Tally,
              handoff: Handoff) -> None:
    """Load a model in a budget of its own, serve it, then unload it or hand it off."""
    model = None
    try:
        with gpubudget.use(root), gpu_budget(rng.choice(work.limits), name=name), work.route():
            model = work.load(rng)
            tally.add(work.kind, "loads")
            for _ in range(rng.randint(1, 4)):
                work.serve(model, rng)
                tally.add(work.kind, "serves")
    except Exception as exc:  # noqa: BLE001 - sorted below
        if not work.refused(exc):
            raise
        said = " ".join([str(exc), *getattr(exc, "__notes__", [])])
        if repr(name) not in said:
            tally.problem(f"{work.kind}: a refusal that does not name budget {name!r}: {said}")
        tally.add(work.kind, "failures (budget too small)")
        model = None
    if model is None:
        return
    if rng.random() < 0.3 and handoff.size() < 8:  # bounded: the root does not fill up
        handoff.put(work, model)
        tally.add(work.kind, "kept past their budget")
    else:
        work.unload(model)
        tally.add(work.kind, "unloads")


def worker(work: Work, index: int, root: Budget, deadline: float, rounds: int, seed: int,
           tally: Tally, handoff: Handoff) -> None:
    rng = random.Random(seed * 1000 + index)
    done = 0
    try:
        while done < rounds or time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.7:
                one_model(work, root, f"{work.kind}-{index}-{done}", rng, tally, handoff)
            elif roll < 0.85:
                taken = handoff.take()
                if taken is not None:
                    taken[0].unload(taken[1])
                    tally.add(taken[0].kind, "unloads after their budget ended")
            else:
                work.release()
                tally.add(work.kind, "release_cached")
            done += 1
        work.release()  # in this thread too: CuPy's FFT plan cache is the thread's own
    except BaseException:  # noqa: BLE001 - reported, the soak fails
        tally.problem(f"{work.kind} thread {index}: {traceback.format_exc()}")


def janitor(root: Budget, works: list[Work], stop: threading.Event, tally: Tally) -> None:
    """Reports, checks and releases while the others work."""
    try:
        while not stop.wait(0.05):
            root.report()
            root.check()
            for work in works:
                work.release()
            tally.add("janitor", "rounds")
    except BaseException:  # noqa: BLE001
        tally.problem(f"janitor: {traceback.format_exc()}")


def frameworks(fake: bool, threads: int) -> tuple[list[Work], Any]:
    """The workloads (PyTorch ``threads`` times; CuPy and TensorRT where importable) and the
    backend of the root budget."""
    works: list[Work] = []
    if fake:
        from tests.fakes import DeviceHostBackend, fake_cupy, fake_torch

        sys.modules["torch"] = fake_torch(abort=True)
        sys.modules["cupy"] = fake_cupy()
        works = [TorchWork(sys.modules["torch"], True) for _ in range(threads)]
        works.append(CupyWork(sys.modules["cupy"], True))
        backend: Any = DeviceHostBackend(0)
    else:
        torch = importlib.import_module("torch")
        works = [TorchWork(torch, False) for _ in range(threads)]
        try:
            works.append(CupyWork(importlib.import_module("cupy"), False))
        except ImportError:
            pass
        backend = None
    try:
        works.append(TrtWork(importlib.import_module("tensorrt_rtx_bindings")))
    except ImportError:
        pass
    return works, backend


def soak(minutes: float, threads: int, seed: int, fake: bool, rounds: int,
         growable: bool = False) -> int:
    works, backend = frameworks(fake, threads)
    tally, handoff, stop = Tally(), Handoff(), threading.Event()
    deadline = time.monotonic() + minutes * 60
    started = time.monotonic()
    with gpu_budget("4GiB", name="soak", backend=backend,
                    initial=0 if growable else None) as root:
        pool = [threading.Thread(target=worker, name=f"{work.kind}-{index}",
                                 args=(work, index, root, deadline, rounds, seed, tally, handoff))
                for index, work in enumerate(works)]
        cleaner = threading.Thread(target=janitor, args=(root, works, stop, tally))
        for thread in [*pool, cleaner]:
            thread.start()
        for thread in pool:
            thread.join()
        stop.set()
        cleaner.join()
        while (taken := handoff.take()) is not None:
            taken[0].unload(taken[1])
            tally.add(taken[0].kind, "unloads after their budget ended")
        del taken
        gc.collect()
        for work in works:
            work.release()
        gc.collect()
        root.check()
        for _ in range(50):  # under the driver door, its watcher thread releases them
            report = root.report()
            waiting = [child.name for child in report.walk() if child.state != "released"
                       and child.name != "soak"]
            if not waiting:
                break
            time.sleep(0.1)
        if root.used or waiting:
            tally.problem(f"not everything came back: root used {root.used} B, budgets not "
                          f"released {waiting[:10]}\n{report}")
    for hazard in getattr(sys.modules.get("torch"), "hazards", [])[:5] if fake else []:
        tally.problem(f"the fake PyTorch saw Python under its allocator lock: {hazard}")
    summary = {"core": "C" if gpubudget.compiled else "pure Python", "fake": fake,
               "seconds": round(time.monotonic() - started, 1),
               "threads": {work.kind: sum(w.kind == work.kind for w in works) for work in works},
               "counts": {f"{kind}: {event}": n for (kind, event), n in sorted(tally.counts.items())},
               "problems": tally.problems}
    if not fake:
        from gpubudget import torch as gbt

        summary["mempools_kept"] = gbt.mempools_kept()
    print("SOAK " + json.dumps(summary, indent=1), flush=True)
    return PROBLEM_EXIT if tally.problems else 0


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(count: int, fake: bool) -> int:
    """Host memory each kept MemPool costs: ``count`` models loaded and unloaded, each in a
    budget of its own (a MemPool each), and ``count`` bare MemPools retired as gpubudget
    retires them."""
    works, backend = frameworks(fake, 1)
    torch = sys.modules["torch"]
    from gpubudget import torch as gbt
    from gpubudget.torchstate import kept_for_ever

    device = None if fake else "cuda"
    with gpu_budget("1GiB", name="measure", backend=backend) as root:
        def cycle(index: int) -> None:
            with gpu_budget("64MiB", name=f"m{index}"), gbt.allocations():
                torch.empty(1024, device=device)

        for index in range(200):  # warm: PyTorch's and Python's own first allocations
            cycle(index)
        before, kept = _rss(), gbt.mempools_kept()
        for index in range(count):
            cycle(index)
        gbt.release_cached()
        per_model = (_rss() - before) / count
        made = gbt.mempools_kept() - kept
        assert root.used == 0, root.report()
    allocator = gbt.allocations.new_pool(gbt.allocations(), torch, root).allocator
    before = _rss()
    for _ in range(count):
        mempool = kept_for_ever(torch.cuda.MemPool(allocator))
        torch._C._cuda_releasePool(0, mempool.id)
    torch.cuda.empty_cache()
    per_mempool = (_rss() - before) / count
    print(f"MEASURE {count} models loaded and unloaded: {made} MemPools kept, host memory "
          f"+{per_model:.0f} B per model; {count} bare MemPools retired and kept: "
          f"+{per_mempool:.0f} B each (resident set size; fake={fake})", flush=True)
    return 0


def child(args: argparse.Namespace) -> int:
    if args.measure:
        return measure(args.measure, args.fake)
    faulthandler.dump_traceback_later(args.minutes * 60 + args.grace, exit=True)
    return soak(args.minutes, args.threads, args.seed, args.fake, args.rounds, args.growable)


def parent(args: argparse.Namespace, argv: list[str]) -> int:
    command = [sys.executable, "-X", "faulthandler", "-m", "scripts.soak", "--child", *argv]
    limit = args.minutes * 60 + 2 * args.grace + 60
    try:
        code = subprocess.run(command, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        print(f"soak: HANG: the child ran past {limit:.0f} s and was killed", flush=True)
        return 1
    if code < 0:
        print(f"soak: ABORTED: the child died of {signal.Signals(-code).name}", flush=True)
        return 1
    if args.measure:
        print("measure: done" if code == 0 else f"measure: FAILED ({code})", flush=True)
        return 0 if code == 0 else 1
    verdict = {0: "soak: passed: 0 aborts, 0 hangs, check() clean, every byte back",
               WATCHDOG_EXIT: "soak: HANG: the watchdog fired (stacks above)",
               PROBLEM_EXIT: "soak: FAILED: problems listed above"}
    print(verdict.get(code, f"soak: FAILED: the child exited {code}"), flush=True)
    return 0 if code == 0 else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python3 -m scripts.soak",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=4, help="PyTorch threads")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=0, help="at least this many per thread")
    parser.add_argument("--grace", type=float, default=120.0,
                        help="seconds past --minutes before the watchdog calls it a hang")
    parser.add_argument("--fake", action="store_true", help="the fakes of tests/, on the CPU")
    parser.add_argument("--growable", action="store_true",
                        help="a growable root (initial=0), as under the driver door, where a "
                             "reserved root refuses the libraries' own allocations")
    parser.add_argument("--measure", type=int, default=0, metavar="N")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.minutes < 0 or args.threads < 1 or args.rounds < 0 or args.grace <= 0:
        parser.error("--minutes and --rounds must be >= 0, --threads >= 1, --grace > 0")
    if args.child:
        return child(args)
    return parent(args, argv)


if __name__ == "__main__":
    sys.exit(main())
