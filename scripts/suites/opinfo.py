"""PyTorch's OpInfo database on CUDA: every op's sample inputs unrouted, routed, and tight.

    python3 scripts/suites/opinfo.py --out out/opinfo.json [--md out/opinfo.md] \\
        [--dtypes float32,bfloat16,int64] [--max-seconds 120] [--limit 16GiB] \\
        [--tight 1MiB] [--ops REGEX] [--skip REGEX] [--max-samples N]

For each OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` and each
dtype (in the order given; all ops of the first dtype before the second) that the op
supports on CUDA, with the same seed each time:

- (a) unrouted: the samples of ``op.sample_inputs("cuda", dtype)`` are made and the op is
  called on each; for float32 samples of ops that support autograd, a backward pass too (the
  sum of the floating outputs that require grad, ``.backward()``);
- (b) routed: the same inside a child budget (``--limit``) of one session root and
  ``gpubudget.torch.allocations()``, the samples made inside it too. PyTorch's cache is
  emptied before (b), and the bytes PyTorch holds outside every private pool
  (``torch.cuda.memory_snapshot()`` segments of pool ``(0, 0)``) are read before and after;
  after the warm-up that (a) is, an allocation that escaped the budget (the backward pass
  runs on autograd's threads) shows as growth;
- (c) tight: the samples made unrouted, the op called inside a child budget of ``--tight``
  (1 MiB: below the 2 MiB segments PyTorch asks for, so every allocation is refused).

Each outcome is ``ok`` or ``<phase>:<exception type>`` (phase ``gen``, ``fwd``, ``bwd`` or
``sync``). (a) and (b) must agree; where both are ``ok`` their values are compared too
(``torch.testing.assert_close``; a difference is reported, not a failure: some ops are
nondeterministic). Every (c) failure that (a) did not have must be a
``torch.OutOfMemoryError`` whose message or notes name the budget. After (b) and (c) the
budget's ``check()`` runs; a budget still held after its scope is retried after
``gc.collect()`` and ``gpubudget.torch.release_cached()``, then after clearing cuBLAS's
workspaces (unless ``--keep-workspaces``), and what released it is recorded.

Results stream to ``OUT.jsonl`` as each (op, dtype) ends, and go to ``OUT.json`` at the end
with the table (``compare.py opinfo`` prints it from either). The loop stops starting new
ops after ``--max-seconds``; an op that runs longer than ``--op-timeout`` seconds ends the
process with every thread's stack on stderr (``faulthandler``), its predecessors kept.
``--device cpu`` runs the loop on the CPU with (b) and (c) unrouted, to try the harness
where there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import importlib
import json
import random
import re
import sys
import time
import types
import unittest
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, ContextManager, Final

if __package__ in (None, ""):  # run as a file: python3 scripts/suites/opinfo.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.suites.compare import opinfo_report  # noqa: E402
from scripts.suites.outcomes import is_out_of_memory_type  # noqa: E402

__all__ = ["BACKEND_FACTORY", "main"]

BACKEND_FACTORY: Callable[[], Any] | None = None
"""Makes the ``backend=`` of the session root; ``None``: gpubudget's choice (PyCUDA on a GPU).
The tests set it to host memory that says it is a device's."""

SEED: Final = 20261130
MESSAGE_CHARS: Final = 300
STICKY: Final = ("illegal memory access", "device-side assert", "unspecified launch failure",
                 "misaligned address", "illegal instruction")
NO_VALUES: Final = re.compile(r"empty")  # uninitialized memory: values differ by design


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="opinfo.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the result, JSON (streamed to .jsonl)")
    parser.add_argument("--md", help="write the table here too")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtypes", default="float32,bfloat16,int64")
    parser.add_argument("--backward-dtypes", default="float32")
    parser.add_argument("--limit", default="16GiB", help="(b)'s budget")
    parser.add_argument("--root-limit", default="16GiB", help="the session root's limit")
    parser.add_argument("--tight", default="1MiB", help="(c)'s budget")
    parser.add_argument("--max-seconds", type=float, default=120.0,
                        help="start no new op after this many seconds")
    parser.add_argument("--op-timeout", type=float, default=90.0,
                        help="end the process (stacks dumped) if one op runs this long")
    parser.add_argument("--ops", default=None, help="only ops whose name this regex finds")
    parser.add_argument("--skip", default=None, help="skip ops whose name this regex finds")
    parser.add_argument("--max-samples", type=int, default=None,
                        help="at most this many samples per op and dtype")
    parser.add_argument("--no-values", action="store_true", help="do not compare values")
    parser.add_argument("--keep-workspaces", action="store_true",
                        help="do not clear cuBLAS workspaces when they hold a budget")
    parser.add_argument("--list", type=int, default=20, help="list at most this many")
    parser.add_argument("--warnings", action="store_true",
                        help="show the warnings ops give (hidden by default)")
    return parser.parse_args(argv)


def _op_db() -> list[Any]:
    """PyTorch's OpInfo list. Its test utilities need ``expecttest`` only for a base class
    of unit tests, which is not used here: a stand-in goes where it is not installed."""
    try:
        importlib.import_module("expecttest")
    except ImportError:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        stand_in.ACCEPT = False  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stand_in
    module = importlib.import_module("torch.testing._internal.common_methods_invocations")
    return list(module.op_db)


class Harness:
    """The loop's state: torch, gpubudget, the session root, the stream, the options."""

    def __init__(self, args: argparse.Namespace, torch: Any, stream: IO[str]) -> None:
        self.args = args
        self.torch = torch
        self.stream = stream
        self.cuda = args.device == "cuda"
        self.device_index = torch.cuda.current_device() if self.cuda else 0
        self.gpubudget: Any = None
        self.gbt: Any = None
        self.root: Any = None
        self.sticky: str | None = None
        if self.cuda:
            self.gpubudget = importlib.import_module("gpubudget")
            self.gbt = importlib.import_module("gpubudget.torch")
            backend = BACKEND_FACTORY() if BACKEND_FACTORY is not None else None
            self.root = self.gpubudget.gpu_budget(args.root_limit, name="opinfo-session",
                                                  backend=backend)
            self.root.__enter__()

    def close(self) -> None:
        if self.root is not None:
            self.root.__exit__(None, None, None)

    # -- one sample ------------------------------------------------------------------------

    def seed(self) -> None:
        self.torch.manual_seed(SEED)
        random.seed(SEED)
        with contextlib.suppress(ImportError):
            importlib.import_module("numpy").random.seed(SEED % 2**32)

    def generate(self, op: Any, dtype: Any, grad: bool) -> tuple[list[Any], str | None]:
        """The op's samples (at most ``--max-samples``), or the error making them."""
        samples: list[Any] = []
        try:
            for sample in op.sample_inputs(self.args.device, dtype, requires_grad=grad):
                samples.append(sample)
                if self.args.max_samples and len(samples) >= self.args.max_samples:
                    break
        except Exception as exc:  # noqa: BLE001 - recorded as the outcome of every mode
            return [], f"gen:{type(exc).__name__}"
        return samples, None

    def leaves(self, out: Any) -> list[Any]:
        """The output's leaves, tensors copied to the CPU, other values as ``repr``."""
        pytree = importlib.import_module("torch.utils._pytree")
        values: list[Any] = []
        for leaf in pytree.tree_flatten(out)[0]:
            if isinstance(leaf, self.torch.Tensor):
                try:
                    values.append(leaf.detach().to("cpu", copy=True))
                except Exception as exc:  # noqa: BLE001 - sparse, quantized...
                    values.append(f"<{type(exc).__name__}>")
            else:
                values.append(repr(leaf))
        return values

    def backward(self, out: Any) -> None:
        pytree = importlib.import_module("torch.utils._pytree")
        torch = self.torch
        parts = [leaf for leaf in pytree.tree_flatten(out)[0]
                 if isinstance(leaf, torch.Tensor) and leaf.requires_grad
                 and (leaf.is_floating_point() or leaf.is_complex())]
        if parts:
            loss = sum((part.real if part.is_complex() else part).sum() for part in parts)
            loss.backward()

    def attempt(self, op: Any, sample: Any, grad: bool, routed: Callable[[], ContextManager[Any]],
                keep: bool, budget: str | None) -> tuple[str, list[Any] | None, bool, str]:
        """Call the op on one sample inside ``routed()``: (outcome, values, whether a failure
        is a clean OutOfMemoryError naming ``budget``, its message)."""
        phase = "fwd"
        values = None
        try:
            with routed():
                out = op(sample.input, *sample.args, **sample.kwargs)
                if keep:
                    values = self.leaves(out)
                if grad:
                    phase = "bwd"
                    self.backward(out)
                del out
                if self.cuda:
                    phase = "sync"
                    self.torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome
            text = "\n".join([str(exc), *map(str, getattr(exc, "__notes__", []) or [])])
            clean = is_out_of_memory_type(exc) and budget is not None and f"'{budget}'" in text
            if any(marker in text for marker in STICKY):
                self.sticky = f"{type(exc).__name__}: {' '.join(text.split())[:MESSAGE_CHARS]}"
            return (f"{phase}:{type(exc).__name__}", None, clean,
                    " ".join(text.split())[:MESSAGE_CHARS])
        return "ok", values, False, ""

    # -- the budgets -----------------------------------------------------------------------

    def outside(self) -> tuple[int, int]:
        """Bytes PyTorch holds (reserved, allocated) in the default pool, outside every
        private pool."""
        if not self.cuda:
            return 0, 0
        reserved = allocated = 0
        for segment in self.torch.cuda.memory_snapshot():
            if segment.get("device", self.device_index) != self.device_index:
                continue
            if tuple(segment.get("segment_pool_id") or (0, 0)) == (0, 0):
                reserved += int(segment.get("total_size", 0))
                allocated += int(segment.get("allocated_size", 0))
        return reserved, allocated

    def child(self, limit: str, name: str) -> Any:
        if not self.cuda:
            return contextlib.nullcontext()
        return self.gpubudget.gpu_budget(limit, name=name, parent=self.root)

    def routing(self, budget: Any) -> Callable[[], ContextManager[Any]]:
        if not self.cuda:
            return contextlib.nullcontext
        return lambda: self.gbt.allocations(budget)

    def settle(self, budget: Any) -> tuple[str, str | None]:
        """After the budget's scope: what released it, and ``check()``'s error if any."""
        if not self.cuda:
            return "exit", None
        how = "exit" if budget.state == "released" else "held"
        if how == "held":
            gc.collect()
            self.gbt.release_cached()
            how = "gc" if budget.state == "released" else "held"
        if how == "held" and not self.args.keep_workspaces:
            clear = getattr(self.torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            self.gbt.release_cached()
            how = "workspaces" if budget.state == "released" else "held"
        try:
            budget.check()
        except self.gpubudget.InvariantError as exc:
            print(f"[opinfo] INVARIANT after {budget.name!r}: {exc}", file=sys.stderr,
                  flush=True)
            return how, f"{type(exc).__name__}: {exc}"
        return how, None

    # -- one op and dtype ------------------------------------------------------------------

    def run(self, op: Any, dtype: Any, grad: bool, routed: Callable[[], ContextManager[Any]],
            generate_inside: bool, keep: bool, budget: str | None,
            ) -> tuple[str | None, list[tuple[str, list[Any] | None, bool, str]]]:
        """One mode: make the samples (inside ``routed()`` if ``generate_inside``) and call
        the op on each. Returns the error making them, if any, and each sample's
        :meth:`attempt`. The samples die with this frame."""
        self.seed()
        with routed() if generate_inside else contextlib.nullcontext():
            samples, failed = self.generate(op, dtype, grad)
        return failed, [self.attempt(op, sample, grad, routed, keep, budget)
                        for sample in samples]

    def pair(self, op: Any, name: str, dtype: Any, dtype_name: str) -> dict[str, Any]:
        torch = self.torch
        grad = bool(op.supports_autograd) and dtype_name in self.args.backward_dtypes.split(",")
        if grad:
            with contextlib.suppress(Exception):
                grad = dtype in op.supported_backward_dtypes(self.args.device)
        keep = not self.args.no_values and not NO_VALUES.search(name)
        record: dict[str, Any] = {"op": name, "dtype": dtype_name, "backward": grad,
                                  "times": {}, "released": {}, "check_error": None}
        rows: dict[int, dict[str, Any]] = {}

        def row(index: int) -> dict[str, Any]:
            return rows.setdefault(index, {"sample": index})

        # (a) unrouted: also the warm-up of everything the op needs once
        start = time.perf_counter()
        failed, results = self.run(op, dtype, grad, contextlib.nullcontext, False, keep, None)
        record["times"]["a"] = time.perf_counter() - start
        if failed:
            row(-1)["a"] = failed
        expected = {index: values for index, (_, values, _, _) in enumerate(results)}
        for index, (outcome, _, _, message) in enumerate(results):
            row(index)["a"] = outcome
            if message:
                row(index)["a_message"] = message
        del results
        if self.sticky:
            return self._finish(record, rows)

        # (b) routed, the samples made inside the budget; memory outside private pools read
        # before and after (the end of the budget's scope empties PyTorch's cache: before it)
        if self.cuda:
            torch.cuda.empty_cache()
        before = self.outside()
        start = time.perf_counter()
        budget = self.child(self.args.limit, f"{name}:{dtype_name}")
        with budget:
            failed, results = self.run(op, dtype, grad, self.routing(budget), True, keep, None)
            after = self.outside()
        record["times"]["b"] = time.perf_counter() - start
        if failed:
            row(-1)["b"] = failed
        for index, (outcome, values, _, message) in enumerate(results):
            row(index)["b"] = outcome
            if message:
                row(index)["b_message"] = message
            if values is not None and expected.get(index) is not None:
                mismatch = self.same(expected[index] or [], values)
                if mismatch:
                    row(index)["value_mismatch"] = mismatch
        del results, expected
        record["outside_growth"] = {"reserved": after[0] - before[0],
                                    "allocated": after[1] - before[1],
                                    "before": list(before), "after": list(after)}
        record["peak_b"] = int(budget.peak) if self.cuda else None
        record["released"]["b"], record["check_error"] = self.settle(budget)
        if self.sticky:
            return self._finish(record, rows)

        # (c) tight: the samples made unrouted, the op inside a budget too small for it
        tight_name = f"{name}:{dtype_name}:tight"
        start = time.perf_counter()
        tight = self.child(self.args.tight, tight_name)
        with tight:
            failed, results = self.run(op, dtype, grad, self.routing(tight), False, False,
                                       tight_name if self.cuda else None)
        record["times"]["c"] = time.perf_counter() - start
        if failed:
            row(-1)["c"] = failed
        for index, (outcome, _, clean, message) in enumerate(results):
            row(index)["c"] = outcome
            if outcome != "ok":
                row(index)["c_clean"] = clean
                if not clean:  # a clean one says what every clean one says
                    row(index)["c_message"] = message
        how, error = self.settle(tight)
        record["released"]["c"] = how
        record["check_error"] = record["check_error"] or error
        return self._finish(record, rows)

    def failed(self, name: str, dtype_name: str, exc: BaseException) -> dict[str, Any]:
        """A pair the harness itself failed on (not the op: it catches those): said loudly,
        recorded, and the loop goes on."""
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:MESSAGE_CHARS]}"
        print(f"[opinfo] HARNESS ERROR on {name}[{dtype_name}]: {error}", file=sys.stderr,
              flush=True)
        return self._finish({"op": name, "dtype": dtype_name, "harness_error": error}, {})

    def _finish(self, record: dict[str, Any], rows: dict[int, dict[str, Any]]) -> dict[str, Any]:
        record["samples"] = [rows[index] for index in sorted(rows)]
        self.stream.write(json.dumps({"pair": record}, sort_keys=True, default=str) + "\n")
        self.stream.flush()
        return record

    def same(self, expected: list[Any], actual: list[Any]) -> str | None:
        """``None`` when (b)'s values are (a)'s, else what differs."""
        if len(expected) != len(actual):
            return f"{len(actual)} outputs, (a) had {len(expected)}"
        torch = self.torch
        for want, got in zip(expected, actual):
            if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
                try:
                    torch.testing.assert_close(got, want, equal_nan=True, check_device=False,
                                               check_layout=False, check_stride=False)
                except Exception as exc:  # noqa: BLE001 - AssertionError, or not comparable
                    return " ".join(str(exc).split())[:MESSAGE_CHARS]
            elif want != got:
                return f"{got!r:.100} != {want!r:.100}"
        return None


def _ops(op_db: list[Any], args: argparse.Namespace) -> Iterator[tuple[str, Any]]:
    only = re.compile(args.ops) if args.ops else None
    skip = re.compile(args.skip) if args.skip else None
    for op in op_db:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if (only is None or only.search(name)) and (skip is None or not skip.search(name)):
            yield name, op


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = _parse(argv)
    sys.argv = sys.argv[:1]  # PyTorch's test utilities may parse the command line
    deadline = started + args.max_seconds
    if not args.warnings:
        warnings.simplefilter("ignore")
    torch = importlib.import_module("torch")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("opinfo.py: no CUDA device (use --device cpu to try the harness)",
              file=sys.stderr)
        return 2
    op_db = _op_db()
    gc.collect()
    gc.freeze()  # PyTorch and the OpInfos: collections (settle's, Python's own) skip them
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stream_path = out.with_suffix(".jsonl") if out.suffix == ".json" else Path(f"{out}.jsonl")
    dtypes = [name for name in args.dtypes.split(",") if name]
    meta: dict[str, Any] = {
        "torch": torch.__version__, "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "ops_total": len(op_db), "dtypes": dtypes, "limit": args.limit, "tight": args.tight,
        "root_limit": args.root_limit, "max_seconds": args.max_seconds, "seed": SEED,
        "import_s": round(time.perf_counter() - started, 3)}
    pairs: list[dict[str, Any]] = []
    cut_short = False
    with stream_path.open("w", encoding="utf-8") as stream:
        stream.write(json.dumps({"meta": meta}) + "\n")
        harness = Harness(args, torch, stream)
        try:
            for dtype_name in dtypes:
                dtype = getattr(torch, dtype_name)
                done = 0
                for name, op in _ops(op_db, args):
                    if time.perf_counter() > deadline:
                        cut_short = True
                        break
                    try:
                        supported = dtype in op.supported_dtypes(args.device)
                    except Exception:  # noqa: BLE001
                        supported = False
                    if not supported:
                        continue
                    faulthandler.dump_traceback_later(args.op_timeout, exit=True)
                    try:
                        pairs.append(harness.pair(op, name, dtype, dtype_name))
                    except Exception as exc:  # noqa: BLE001 - the harness's own failure
                        pairs.append(harness.failed(name, dtype_name, exc))
                    finally:
                        faulthandler.cancel_dump_traceback_later()
                    done += 1
                    if done % 50 == 0:
                        print(f"[opinfo] {dtype_name}: {done} ops, "
                              f"{time.perf_counter() - started:.0f} s", flush=True)
                    if harness.sticky:
                        break
                print(f"[opinfo] {dtype_name}: {done} ops done, "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
                if cut_short or harness.sticky:
                    break
        finally:
            harness.close()
        end = {"wall_s": round(time.perf_counter() - started, 3), "cut_short": cut_short,
               "sticky_error": harness.sticky, "pairs": len(pairs)}
        meta.update(end)
        stream.write(json.dumps({"end": end}) + "\n")
    document = {"meta": meta, "pairs": pairs, "complete": True}
    out.write_text(json.dumps(document, sort_keys=True, default=str), encoding="utf-8")
    markdown, _, ok = opinfo_report(document, args.list)
    sys.stdout.write(markdown)
    if args.md:
        Path(args.md).write_text(markdown, encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
