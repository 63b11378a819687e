"""``gpubudget demo``: two models sharing one pool, a denial, the report and a plot."""

from __future__ import annotations

import importlib.util
import os
import time
import warnings

from ..backends import Backend, get_backend
from ..budget import gpu_budget
from ..plot import plot_format
from ..scope import label
from ..text import printable
from ..units import MiB, format_size
from ..adapter import hooks

__all__ = ["demo"]


def _demo_backend(name: str | None) -> tuple[Backend, str]:
    """The backend the demo runs on, and how it was chosen: ``--backend``, else
    ``GPUBUDGET_BACKEND``, else PyCUDA when usable, else host memory (as budgets choose)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the host-memory notice: said below
        backend = get_backend(name)
    if name is not None:
        why = f"--backend {name}"
    elif os.environ.get("GPUBUDGET_BACKEND", "").strip():
        why = f"GPUBUDGET_BACKEND={printable(os.environ['GPUBUDGET_BACKEND'].strip())}"
    else:
        why = "no usable CUDA device and PyCUDA here" if backend.name == "host" else ""
    if backend.name == "host":
        where = (f"host memory ({why}; the budgets, limits and placement are real, the "
                 f"memory is the host's)")
    else:
        where = f"a CUDA device ({backend.name} backend{'; ' + why if why else ''})"
    return backend, where


def demo(plot: str | None, backend_name: str | None) -> None:
    """Two models sharing one pool on a 6 GiB card, with a build, a denial and serving."""
    if plot is not None:
        plot_format(plot)
    backend, where = _demo_backend(backend_name)
    print(f"gpubudget demo on {where}\n")
    print("A 6 GiB card runs a detector and a classifier beside other work: both draw from one")
    print("4 GiB pool, reserved once; each is capped; the other 2 GiB stay free for the rest.\n")
    with gpu_budget("4GiB", name="shared", backend=backend) as pool:
        with gpu_budget("2GiB", name="detector") as detector:
            with label("detector/build"):
                for size in (256, 512, 128, 512, 256, 64):  # tactic workspaces come and go
                    block = detector.allocate(size * MiB)
                    time.sleep(0.002)  # so that the plot shows the steps apart
                    if block is not None:
                        detector.free(block)
            with label("detector/weights"):
                weights = detector.allocate(1200 * MiB)
            time.sleep(0.002)
        with gpu_budget("1.5GiB", name="classifier") as classifier:
            with label("classifier/weights"):
                classifier.allocate(900 * MiB)
            time.sleep(0.002)
            with label("classifier/workspace"):
                refused = classifier.allocate(700 * MiB)
                print(f"classifier asks for 700 MiB of workspace: {refused} (over its cap)")
                workspace = classifier.allocate(400 * MiB)
                print(f"classifier asks for 400 MiB instead: {'granted' if workspace else None}")
        for _ in range(12):  # serving: activations per request
            for model, size in ((detector, 300), (classifier, 96)):
                with label(f"{model.name}/activations"):
                    block = model.allocate(size * MiB)
                time.sleep(0.001)
                if block is not None:
                    model.free(block)
        assert weights is not None
        for model in (detector, classifier):  # loaded until the program ends, as an engine
            hooks(model).pin()  # would be: their memory is not a leak, and exit says nothing of it
    print(f"\npool: {format_size(pool.used)} used of {format_size(pool.limit)}, "
          f"{format_size(pool.available)} left\n")
    report = pool.report()
    print(report)
    if plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            print("\n(no plot: pip install 'gpubudget[plot]' for matplotlib)")
        else:
            report.plot(plot)
            print(f"\nplot written to {printable(plot)}")
