"""The story that started gpubudget: two models sharing one pool on a 6 GB card.

A 6 GB GPU runs a detector and a classifier next to other work. Both models draw from one
4 GiB pool, reserved once; each is capped so that neither can starve the other, and the rest
of the card (about 2 GB) stays free for whatever else runs there. The classifier then asks
for more than its cap, is refused with ``None`` (what TensorRT sees), and the report says who
used what.

    python examples/two_models.py

Runs on the PyCUDA backend when a CUDA device is usable, else in host memory.
"""

from __future__ import annotations

import warnings

from gpubudget import format_size, gpu_budget

MiB = 2**20


def main() -> None:
    warnings.simplefilter("ignore", RuntimeWarning)  # the host-memory notice, said below
    with gpu_budget("4GiB", align=256, name="shared") as pool:
        backend = pool.backend.name if pool.backend else "?"
        print(f"one reservation of {format_size(pool.limit)} on the {backend} backend\n")
        with gpu_budget("2GiB", name="detector") as detector:
            weights = detector.allocate(1200 * MiB, tag="detector/weights")
            activations = detector.allocate(300 * MiB, tag="detector/activations")
            assert weights is not None and activations is not None
        with gpu_budget("1.5GiB", name="classifier") as classifier:
            weights = classifier.allocate(900 * MiB, tag="classifier/weights")
            assert weights is not None
            too_big = classifier.allocate(700 * MiB, tag="classifier/workspace")
            print(f"classifier asks for 700 MiB more: {too_big} (over its 1.5 GiB cap)")
            smaller = classifier.allocate(400 * MiB, tag="classifier/workspace")
            print(f"classifier asks for 400 MiB instead: {'granted' if smaller else None}")
        detector.free(activations)  # models outlive their with-blocks; free when done
        print(f"\npool used {format_size(pool.used)} of {format_size(pool.limit)}, "
              f"{format_size(pool.available)} left for a third model\n")
    print(pool.report())


if __name__ == "__main__":
    main()
