"""Growable roots on a real device: CUDA's virtual memory management under a budget."""

from __future__ import annotations

import gc
import signal
import threading
import time

import pytest

from gpubudget import gpu_budget
from tests.gpu.conftest import cupy_or_skip, torch_or_skip

MiB = 2**20
GiB = 2**30



def _free() -> int:
    free: int = cupy_or_skip().cuda.runtime.memGetInfo()[0]
    return free


def test_a_growable_root_holds_what_it_maps_and_trim_gives_it_back() -> None:
    cp = cupy_or_skip()
    from gpubudget import cupy as gbc

    before = _free()
    with gpu_budget("40GiB", initial="2GiB", name="grow") as grow:
        assert grow.mapped == 2 * GiB
        assert before - _free() < 3 * GiB  # not the 40 GiB a reserved root would take
        blocks = [grow.allocate(512 * MiB) for _ in range(12)]
        assert all(block is not None for block in blocks) and grow.mapped == 6 * GiB
        arrays = [gbc.array_on(block, 128 * MiB, "float32") for block in blocks if block]
        for index, array in enumerate(arrays):
            array.fill(index)
        assert [float(array[-1]) for array in arrays] == [float(i) for i in range(12)]
        del arrays
        cp.cuda.Device().synchronize()
        for block in blocks[4:]:
            assert block is not None and grow.free(block)
        freed = grow.trim()
        assert freed == 4 * GiB and grow.mapped == 2 * GiB
        assert before - _free() < 2 * GiB + 256 * MiB  # the device has the 4 GiB back
        grow.check()
        for block in blocks[:4]:
            assert block is not None and grow.free(block)
    assert grow.state == "released" and before - _free() < 256 * MiB


def test_a_pytorch_model_computes_the_same_after_sleep_and_wake() -> None:
    torch = torch_or_skip()
    from gpubudget import torch as gbt

    with gpu_budget("40GiB", initial=0, name="model") as budget:
        with gbt.allocations():
            layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, dropout=0.0)
            model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).cuda()
            model.eval()
            x = torch.randn(8, 128, 512, device="cuda")
            with torch.no_grad():
                before = model(x)
            torch.cuda.synchronize()
        held = budget.mapped
        assert held is not None and 0 < held < 2 * GiB
        free_awake = _free()
        copied = budget.offload()
        assert copied == budget.used and budget.mapped == 0
        assert _free() - free_awake >= held - 64 * MiB  # the device has it back meanwhile
        assert budget.restore() == copied
        with gbt.allocations():
            with torch.no_grad():
                after = model(x)
            torch.cuda.synchronize()
        assert torch.equal(before, after)  # bitwise: same weights, same addresses
        budget.check()
        del model, layer, x, before, after
        gc.collect()
    torch.cuda.empty_cache()


def test_a_growth_the_device_cannot_back_is_denied_device_full() -> None:
    cp = cupy_or_skip()
    hog = []
    try:
        while _free() > 6 * GiB:  # take the device, outside the budget
            hog.append(cp.cuda.runtime.malloc(min(_free() - 5 * GiB, 16 * GiB)))
        with gpu_budget("40GiB", initial=0, name="starved") as starved:
            kept = starved.allocate(2 * GiB)
            assert kept is not None
            assert starved.allocate(16 * GiB) is None
            (denial,) = starved.report().denials
            assert (denial.reason, denial.refused_by) == ("device_full", "starved")
            assert starved.used == 2 * GiB and starved.mapped is not None
            assert starved.mapped <= 2 * GiB + 64 * MiB
            starved.check()
    finally:
        for pointer in hog:
            cp.cuda.runtime.free(pointer)


def test_ctrl_c_during_restore_leaves_it_asleep_and_nothing_lost() -> None:
    cp = cupy_or_skip()
    from gpubudget import cupy as gbc

    with gpu_budget("40GiB", initial=0, name="sleepy") as sleepy:
        blocks = [sleepy.allocate(128 * MiB) for _ in range(64)]  # 8 GiB in 64 blocks
        for index, block in enumerate(blocks):
            assert block is not None
            gbc.array_on(block, 32 * MiB, "float32").fill(index)
        cp.cuda.Device().synchronize()
        sleepy.offload()
        main = threading.main_thread().ident
        assert main is not None and threading.current_thread() is threading.main_thread()

        def interrupt_once_restoring() -> None:
            deadline = time.monotonic() + 30
            while sleepy.mapped == 0 and time.monotonic() < deadline:
                time.sleep(0.0002)
            signal.pthread_kill(main, signal.SIGINT)  # what Ctrl-C does

        thread = threading.Thread(target=interrupt_once_restoring)
        thread.start()
        with pytest.raises(KeyboardInterrupt):
            sleepy.restore()
        thread.join()
        assert sleepy.report().asleep == 8 * GiB and sleepy.mapped == 0
        assert sleepy.restore() == 8 * GiB
        values = [float(gbc.array_on(block, 32 * MiB, "float32")[-1]) for block in blocks
                  if block is not None]
        assert values == [float(i) for i in range(64)]
        sleepy.check()
