"""The test of a module is found from its name: ``gpubudget/x/y.py`` is tested by
``tests/test_x_y.py``, or by ``tests/test_y.py`` when no other module is named ``y`` (a
package's ``__init__.py`` by ``tests/test_x.py``; a leading underscore is dropped:
``_core/tree.py`` by ``tests/test_tree.py``). A module tested elsewhere is listed in
:data:`ELSEWHERE` with the file that tests it, and why; a new module needs one or the other.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpubudget"
TESTS = ROOT / "tests"

ELSEWHERE: dict[str, tuple[str, str]] = {
    # module: (the test file that tests it, why there)
    "__init__.py": ("test_budget.py", "the public names: every test imports them"),
    "__main__.py": ("test_cli.py", "python -m gpubudget is the command"),
    "_budget/arguments.py": ("test_budget.py", "gpu_budget's arguments, through gpu_budget"),
    "_budget/hooks.py": ("test_report.py", "adapter.hooks(budget), through what reports show"),
    "_budget/roots.py": ("test_budget.py", "a root's entry and exit"),
    "_budget/snapshot.py": ("test_report.py", "Budget.report(); leaks at exit in test_exit_leaks"),
    "_budget/view.py": ("test_budget.py", "what a budget answers"),
    "_core/__init__.py": ("test_native.py", "the core's door: the C core beside the Python one"),
    "_core/node.py": ("test_tree.py", "a tree's budgets, through the tree"),
    "_core/recorder.py": ("test_timeline.py", "the event log and its counters"),
    "_core/recovery.py": ("test_tree.py", "a fault at each place a signal handler may run"),
    "_core/registry.py": ("test_native.py", "registry.py beside registry.c"),
    "adapter.py": ("test_report.py", "hooks(budget), through reports; callbacks' errors in "
                                     "test_interrupts"),
    "backends/base.py": ("test_backend_contract.py", "the protocol every backend keeps"),
    "backends/host.py": ("test_backend_contract.py", "the contract, on host memory"),
    "backends/pycuda.py": ("gpu/test_pycuda_gpu.py", "needs a GPU"),
    "backends/virtual.py": ("test_residency.py", "a growable root's ranges"),
    "cli/demo.py": ("test_cli.py", "the demo subcommand"),
    "cli/limits.py": ("test_gate.py", "fit --check's limits file"),
    "cli/output.py": ("test_cli.py", "one-line errors and warnings of every subcommand"),
    "cli/run.py": ("test_door.py", "run: the driver door loaded"),
    "cli/traces.py": ("test_cli.py", "report and fit"),
    "cli/visual.py": ("test_viewer.py", "view and export"),
    "context.py": ("test_scope.py", "the active budgets and the label"),
    "door/build.py": ("test_door.py", "the door built on first use"),
    "door/records.py": ("test_door.py", "door.numbers(); when it loads, in test_import_cost"),
    "door/shared.py": ("test_door.py", "the door file, read by top and metrics from another "
                                       "process"),
    "errors.py": ("test_doctests.py", "its examples; each error where it is raised"),
    "hostledger/__init__.py": ("test_hostledger_view.py", "host_view, and the rest by module"),
    "hostledger/errors.py": ("test_hostledger_failures.py", "the ledger when it cannot be used"),
    "jsontext.py": ("test_report.py", "to_json: a report's JSON text"),
    "ray/actor.py": ("test_ray.py", "budgeted actors"),
    "ray/command.py": ("test_ray.py", "ray_command"),
    "ray/methods.py": ("test_ray.py", "methods run with their budget current"),
    "ray/placement.py": ("test_ray.py", "where an actor runs"),
    "ray/registry.py": ("test_ray.py", "the registry actor"),
    "ray/report.py": ("test_ray.py", "cluster_report"),
    "ray/reporter.py": ("test_ray.py", "the reporting thread"),
    "ray/simulated.py": ("test_backend_contract.py", "a simulated GPU keeps the contract"),
    "replay/fit.py": ("test_replay.py", "fit"),
    "replay/results.py": ("test_replay.py", "what a replay gives"),
    "replay/run.py": ("test_replay.py", "replay"),
    "routing.py": ("test_torch.py", "routing shared by torch and cupy; test_cupy too"),
    "tensorrt/callbacks.py": ("test_tensorrt.py", "the allocator TensorRT calls"),
    "tensorrt/lifetime.py": ("test_tensorrt.py", "who keeps allocators alive"),
    "tensorrt/module.py": ("test_tensorrt_nogpu.py", "which TensorRT, by its real names"),
    "tensorrt/vtable.py": ("test_tensorrt_nogpu.py", "a binding's objects read"),
    "text.py": ("test_escapes.py", "names escaped by every command"),
    "torchstate.py": ("test_torch.py", "the PyTorch adapter's process state"),
    "tracefile/checks.py": ("test_tracefile.py", "each line checked"),
    "tracefile/events.py": ("test_tracefile.py", "the events a reader yields"),
    "tracefile/format.py": ("test_tracefile.py", "the format's constants"),
    "tracefile/perpath.py": ("test_tracefile_files.py", "trace= and GPUBUDGET_TRACE"),
    "tracefile/reader.py": ("test_tracefile.py", "the streaming reader"),
    "tracefile/writer.py": ("test_tracefile.py", "the writer; safety in test_tracefile_files"),
    "viewer/model.py": ("test_viewer.py", "the model drawn"),
    "viewer/overview.py": ("test_viewer.py", "the summary"),
    "viewer/page.py": ("test_viewer.py", "the page written"),
    "viewer/plainpickle.py": ("test_viewer_torchsnap.py", "the unpickler of snapshots"),
    "viewer/reportfile.py": ("test_viewer.py", "a report's JSON read back"),
    "viewer/sources.py": ("test_viewer_attacks.py", "records read within a limit"),
    "viewer/tracemodel.py": ("test_viewer.py", "a trace read into the model"),
}


def modules() -> list[str]:
    """Every Python module of the package, relative to it."""
    return sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                  if "__pycache__" not in path.parts)


def names(module: str, bare: Counter[str]) -> list[str]:
    """The names the test of ``module`` may have (see the module docstring)."""
    parts = module.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts:
        return []
    found = ["_".join(part.strip("_") for part in parts)]
    if bare[parts[-1]] == 1:
        found.append(parts[-1].strip("_"))
    return [f"test_{name}.py" for name in dict.fromkeys(found)]


def found_by_name() -> tuple[list[str], list[str]]:
    """The modules whose test is found from their name, and the others."""
    every = modules()
    bare = Counter(module.removesuffix(".py").split("/")[-1] for module in every
                   if not module.endswith("__init__.py"))
    bare.update(module.split("/")[-2] for module in every
                if module.endswith("/__init__.py"))
    found: list[str] = []
    others: list[str] = []
    for module in every:
        hits = [name for name in names(module, bare) if (TESTS / name).is_file()]
        (found if hits else others).append(module)
    return found, others


def test_every_module_has_a_test_found_by_its_name_or_listed_with_where() -> None:
    found, others = found_by_name()
    unlisted = [module for module in others if module not in ELSEWHERE]
    assert not unlisted, (f"no test found by the name of {unlisted}: add tests/test_<name>.py "
                          f"(see {Path(__file__).name}), or list the module in ELSEWHERE")
    stale = sorted(module for module in ELSEWHERE if module in found
                   or not (PACKAGE / module).is_file())
    assert not stale, f"listed in ELSEWHERE but tested by name, or gone: {stale}"


def test_each_listed_test_file_exists() -> None:
    missing = {module: where for module, (where, _) in ELSEWHERE.items()
               if not (TESTS / where).is_file()}
    assert not missing, missing


def test_the_naming_rule() -> None:
    bare = Counter(["tree", "view", "view", "hostledger"])
    assert names("_core/tree.py", bare) == ["test_core_tree.py", "test_tree.py"]
    assert names("hostledger/view.py", bare) == ["test_hostledger_view.py"]  # two are "view"
    assert names("hostledger/__init__.py", bare) == ["test_hostledger.py"]
    assert names("__init__.py", bare) == []
