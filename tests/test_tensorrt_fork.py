"""A process forked while another thread holds one of the TensorRT adapter's module locks (a
first allocator class being made, a probe running, an allocator being attached) must not wait
for that thread in the child, where it does not exist."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import subprocess_env

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, types, warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: forking with threads
    from gpubudget import gpu_budget
    from gpubudget import tensorrt as gbt
    from gpubudget.tensorrt import callbacks, contexts, lifetime, outputs
    import gpubudget.tensorrt as package

    def fake(name):
        module = types.ModuleType(name)
        class IGpuAllocator:
            def __init__(self):
                pass
        class IGpuAsyncAllocator(IGpuAllocator):
            pass
        class IOutputAllocator:
            def __init__(self):
                pass
        class Runtime:
            pass
        module.IGpuAllocator, module.IGpuAsyncAllocator = IGpuAllocator, IGpuAsyncAllocator
        module.IOutputAllocator, module.Runtime = IOutputAllocator, Runtime
        return module

    locks = [callbacks._lock, lifetime._lock, outputs._lock, contexts._lock, package._lock]
    held, done = threading.Event(), threading.Event()

    def hold():
        for lock in locks:
            lock.acquire()
        held.set()
        done.wait(60)
        for lock in locks:
            lock.release()

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(60)
    child = os.fork()
    if child == 0:
        signal.alarm(60)  # a child that waits for a lock nobody holds dies, loudly
        module = fake("fake_tensorrt_in_child")
        assert not gbt.argument_order(module).known
        with gpu_budget("64KiB", backend="host"):
            assert gbt.allocator(trt_module=module) is not None
        outputs.output_allocator_class(module)
        assert gbt.context_memory(object()) is None
        package._runtime_class(module)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    done.set()
    thread.join(60)
    print("child", os.waitstatus_to_exitcode(status))
""")


def test_a_child_forked_while_a_lock_is_held_does_not_wait_for_it() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            env=subprocess_env(GPUBUDGET_BACKEND="host"), timeout=300)
    assert (result.returncode, result.stdout.strip()) == (0, "child 0"), result.stderr
