"""Nested budgets, a reserve floor, a denial and a leak, and the report that shows them.

    python examples/nested_report.py
"""

from __future__ import annotations

from gpubudget import gpu_budget

KiB = 1024


def main() -> None:
    with gpu_budget("1MiB", name="server", backend="host", track_stacks=True) as server:
        with gpu_budget("512KiB", name="model-a", reserve="256KiB") as model_a:
            kept = model_a.allocate(100 * KiB, tag="model-a/weights")
            scratch = model_a.allocate(100 * KiB, tag="model-a/scratch")
            assert scratch is not None
            model_a.free(scratch)
        with gpu_budget("900KiB", name="model-b") as model_b:
            # model-a uses 100 KiB, but 256 KiB of the server stay set aside for it: the
            # server has 768 KiB left, so model-b's 760 KiB fits and 800 KiB does not.
            print("model-b asks for 800 KiB:", model_b.allocate(800 * KiB))
            print("model-b asks for 760 KiB:", "granted" if model_b.allocate(760 * KiB) else None)
            leaked = model_b.allocate(8 * KiB, tag="model-b/never-freed")
    assert kept is not None and leaked is not None
    print(server.report())
    model_a.free(kept)


if __name__ == "__main__":
    main()
