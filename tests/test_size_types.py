"""A size of a type that is no size (``allocate(1.5e9)``) is a programming error: a
``TypeError`` naming it, as PyTorch gives, neither a denial nor an out-of-memory in
``num_ooms``; with either core, in allocate and resize, entered or not."""

from __future__ import annotations

import pytest

from gpubudget import gpu_budget
from tests.helpers import python_paths


@pytest.mark.parametrize("size", [1.5e9, 4096.0, None, True, b"4096", [4096]])
def test_a_size_that_is_no_size_raises_and_counts_nothing(size: object) -> None:
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        block = pool.allocate(4096)
        assert block is not None
        with pytest.raises(TypeError, match=r"^size must be an int \(bytes\) or a string such "
                                            r"as '1MiB', not "):
            pool.allocate(size)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match=r"^size must be an int"):
            pool.allocate(size, raise_on_denial=True)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match=r"^new_size must be an int"):
            pool.resize(block, size)  # type: ignore[arg-type]
        stats, report = pool.memory_stats(), pool.report()
        assert stats["num_ooms"] == 0 and report.denied == 0 and report.denials == ()
        assert stats["allocation.all.allocated"] == 1 and pool.size_of(block) == 4096
        pool.check()
    unentered = gpu_budget("1MiB", name="later", backend="host")
    with pytest.raises(TypeError):
        unentered.allocate(size)  # type: ignore[call-overload]
    assert unentered.report().denied == 0


def test_the_fast_path_and_the_python_path_raise_the_same_error() -> None:
    """With the C core, ``allocate`` takes plain ints in C and hands the rest (a float) to
    the Python method; a tree sent through the Python methods alone says the same."""
    errors = []
    for fast in (True, False):
        with gpu_budget("1MiB", name="pool", backend="host") as pool:
            if not fast:
                python_paths(pool)
            with pytest.raises(TypeError) as caught:
                pool.allocate(1.5e9)  # type: ignore[call-overload]
            errors.append(str(caught.value))
            assert pool.allocate(0) is None  # a value, not a type: still a denial
            assert pool.memory_stats()["num_ooms"] == 1
            pool.check()
    assert errors[0] == errors[1] == ("size must be an int (bytes) or a string such as "
                                      "'1MiB', not float 1500000000.0")
