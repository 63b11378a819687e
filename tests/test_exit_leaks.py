"""What interpreter exit says of roots that exited still holding blocks: one line without
stacks, every block with its stack where they were kept, nothing where a TensorRT object or
a framework's pool still holds the memory (each case a program of its own)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import subprocess_env


def _stderr(program: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], capture_output=True,
                          text=True, timeout=60, env=subprocess_env(GPUBUDGET_BACKEND="host"))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.splitlines()


def test_a_root_without_stacks_says_its_leaks_in_one_line() -> None:
    lines = _stderr("""
        from gpubudget import gpu_budget
        with gpu_budget("1MiB", name="server") as server:
            with gpu_budget("512KiB", name="model") as model:
                for _ in range(3):
                    model.allocate("64KiB", tag="weights")
                model.allocate("1KiB", tag="act\\x1b[2J")
                server.allocate("4KiB")
                server.free(server.allocate("8KiB"))
        with gpu_budget("1MiB", name="tidy") as tidy:
            tidy.free(tidy.allocate(4096))
    """)
    assert lines == [
        "gpubudget: 5 block(s) of budget 'server' still live at exit (197.00 KiB: weights "
        "192.00 KiB, (no tag) 4.00 KiB, act\\x1b[2J 1.00 KiB); gpu_budget(..., "
        "track_stacks=True) shows where each was allocated"]


def test_many_tags_are_cut_to_the_largest() -> None:
    (line,) = _stderr("""
        from gpubudget import gpu_budget
        with gpu_budget("1MiB", name="pool") as pool:
            for index in range(5):
                pool.allocate((index + 1) * 1024, tag=f"t{index}")
    """)
    assert "(15.00 KiB: t4 5.00 KiB, t3 4.00 KiB, t2 3.00 KiB, 2 more tag(s))" in line


def test_a_root_still_open_or_holding_nothing_says_nothing() -> None:
    assert _stderr("""
        from gpubudget import gpu_budget
        pool = gpu_budget("1MiB", name="pool").__enter__()  # never exited: not a leak yet
        pool.allocate(4096)
    """) == []


def test_memory_something_still_holds_for_the_program_says_nothing() -> None:
    # a TensorRT runtime or engine alive at exit pins its budget; a PyTorch or CuPy pool
    # registers what it holds: keeping memory to the end is their normal life
    assert _stderr("""
        from gpubudget import gpu_budget
        from gpubudget.adapter import hooks
        with gpu_budget("1MiB", name="engine") as engine:
            engine.allocate(4096)
            hooks(engine).pin()
        with gpu_budget("1MiB", name="tensors") as tensors:
            tensors.allocate(4096)
            hooks(tensors).report_usage("torch", lambda: (4096, 4096))
    """) == []


def test_blocks_with_stacks_are_listed_one_by_one_with_the_others() -> None:
    lines = _stderr("""
        from gpubudget import gpu_budget

        def load(budget):
            return budget.allocate(4096, tag="weights")

        with gpu_budget("1MiB", name="server") as server:
            with gpu_budget("64KiB", name="model", track_stacks=True) as model:
                load(model)
            server.allocate(1024)
    """)
    assert lines[0] == "gpubudget: 2 block(s) of budget 'server' still live at exit:"
    assert lines[1].endswith(" 1.00 KiB")  # the root's own block: no stack kept
    assert lines[2].endswith(" 4.00 KiB weights") and lines[-1].endswith(" in load")
    assert sum("still live at exit" in line for line in lines) == 1  # said once, by the root


def test_the_demo_ends_without_a_word_of_leaks() -> None:
    done = subprocess.run([sys.executable, "-m", "gpubudget", "demo", "--no-plot", "--backend",
                           "host"], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr
    assert "still live at exit" not in done.stderr and done.stderr == "", done.stderr
    assert "detector/weights: 1.17 GiB / 1.17 GiB" in done.stdout  # its models stay loaded
