"""gpubudget.callers: the user's stack, outside gpubudget, as ``traceback`` would write it;
made once per frame and line (a cache that never answers for code it has not seen)."""

from __future__ import annotations

import os
import traceback

from gpubudget import callers, gpu_budget


def expected_stack() -> tuple[str, ...]:
    """What ``traceback`` says of the caller's caller's stack (this function left out)."""
    frames = traceback.extract_stack()[:-1]
    return tuple(f"{f.filename}:{f.lineno} in {f.name}" for f in frames)


def level_two() -> tuple[tuple[str, ...], tuple[str, ...]]:
    return callers.user_stack(), expected_stack()


def test_the_stack_is_tracebacks_outermost_first_and_the_same_when_cached() -> None:
    for _ in range(3):  # made, then found in the cache: the same either way
        found, expected = level_two()
        assert found[:-1] == expected[:-1]  # the last frame: the line of each call
        assert found[-1].rsplit(":", 1)[0] == expected[-1].rsplit(":", 1)[0]
        assert found[-1].endswith(" in level_two")


def test_frames_of_gpubudget_are_left_out_and_lines_told_apart() -> None:
    with gpu_budget("1MiB", name="pool", backend="host", track_stacks=True) as pool:
        first = pool.allocate(256)
        second = pool.allocate(256)
        stacks = {live.address: live.stack for live in pool.report().live_blocks}
    assert first is not None and second is not None
    one, two = stacks[first], stacks[second]
    assert one is not None and two is not None
    assert one[:-1] == two[:-1] and one[-1] != two[-1]  # same caller, another line
    assert one[-1].endswith(" in test_frames_of_gpubudget_are_left_out_and_lines_told_apart")
    package = os.path.dirname(callers.__file__)
    assert not [frame for frame in one if frame.startswith(package)]


def test_the_caches_stay_bounded_and_relative_names_are_not_kept() -> None:
    callers._frames.clear()
    callers._ours_by_name.clear()
    made = []
    for index in range(callers._CACHED + 10):  # as many code objects as a code generator makes
        namespace: dict[str, object] = {"callers": callers}
        exec(compile(f"def f{index}():\n    return callers.user_stack()\n",
                     f"/generated/module{index}.py", "exec"), namespace)
        made.append(namespace[f"f{index}"]())  # type: ignore[operator]
    assert len(callers._frames) <= callers._CACHED
    assert len(callers._ours_by_name) <= callers._CACHED
    assert made[-1][-1] == f"/generated/module{callers._CACHED + 9}.py:2 in f{callers._CACHED + 9}"
    assert callers._ours("relative/name.py") is False
    assert "relative/name.py" not in callers._ours_by_name  # it depends on the directory
