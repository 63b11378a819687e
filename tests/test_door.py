"""The driver door (gpubudget/door): a fake CUDA driver built here, programs in C and Python
reaching it the three ways (linked, dlsym on the driver's handle, cuGetProcAddress), run
under ``gpubudget run``, with both cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gpubudget
from gpubudget.door import build

HERE = Path(__file__).parent / "door"
ROOT = Path(__file__).parent.parent

if build.compiler() is None:
    pytest.skip("no C compiler here: the driver door and the fake driver are built from C",
                allow_module_level=True)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the fake driver (libcuda.so.1) and the door's build cache."""
    where = tmp_path_factory.mktemp("door")
    cc = build.compiler()
    assert cc is not None
    made = subprocess.run([cc, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-o",
                           str(where / "libcuda.so.1"), str(HERE / "fakecuda.c"), "-ldl",
                           "-lpthread"], capture_output=True, text=True, check=False)
    if made.returncode != 0:  # a compiler that cannot build (CI's stand-in for none)
        pytest.skip(f"{cc} cannot build the fake driver: {made.stderr.strip()[:200]}")
    (where / "libcuda.so").symlink_to("libcuda.so.1")
    subprocess.run([cc, "-O2", "-o", str(where / "prog"), str(HERE / "prog.c"),
                    f"-L{where}", "-lcuda", "-ldl"], check=True)
    return where


def environment(lab: Path, pure: bool = False, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUBUDGET_")}
    env.update(LD_LIBRARY_PATH=str(lab), GPUBUDGET_DOOR_CACHE=str(lab / "cache"),
               GPUBUDGET_LEDGER="0", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    if pure or not gpubudget.compiled:  # the suite's core, unless a test asks for the pure one
        env["GPUBUDGET_PURE"] = "1"
    env.update(extra)
    return env


def run(lab: Path, argv: list[str], pure: bool = False, door: bool = True,
        flags: tuple[str, ...] = (),
        extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``argv`` under ``gpubudget run FLAGS --`` (``door=False``: as it is)."""
    prefix = [sys.executable, "-m", "gpubudget", "run", *flags, "--"] if door else []
    return subprocess.run(prefix + argv,
                          env=environment(lab, pure, **(extra or {})), capture_output=True,
                          text=True,
                          timeout=120, check=False)


def python(lab: Path, code: str, pure: bool = False, flags: tuple[str, ...] = (),
           **extra: str) -> dict[str, object]:
    """Run ``code`` under the door; what it printed last, as JSON."""
    preamble = textwrap.dedent("""
        import ctypes, json, sys, threading
        import driver
        from gpubudget import gpu_budget, door, use, bind
        import gpubudget._core as core
        def held(budget):
            numbers = door.numbers(budget)
            return None if numbers is None else numbers.held
        out = {"native": core.native is not None, "loaded": door.loaded()}
    """)
    done = run(lab, [sys.executable, "-c", preamble + textwrap.dedent(code)
                     + "\nprint(json.dumps(out))\n"], pure, flags=flags, extra=extra)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    assert result.pop("loaded") is True
    assert result.pop("native") is (gpubudget.compiled and not pure)
    return result


CORES = [pytest.param(False, id="c-core", marks=pytest.mark.skipif(
             not gpubudget.compiled, reason="the C core is not built here")),
         pytest.param(True, id="pure")]


def test_a_c_program_is_charged_the_three_ways_and_refused_at_each_limit(lab: Path) -> None:
    done = run(lab, [str(lab / "prog")])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "granted 0 0 0 held 1800",  # linked, dlsym, cuGetProcAddress: each charged
        "refused 2 held 1800 refusals 1",  # CUDA_ERROR_OUT_OF_MEMORY at the child's limit
        "root 2 outside 0 held 1800",  # the root's limit; outside every budget it passes
        "freed held 0",
        "next dlsym in door",  # RTLD_NEXT searched after the program, not after the door
    ]
    without = run(lab, [str(lab / "prog")], door=False)  # no door: no gbd_* functions
    assert without.returncode == 3 and without.stdout == "no door\n"


@pytest.mark.parametrize("pure", CORES)
@pytest.mark.parametrize("way", ["direct", "dlsym", "proc"])
def test_python_allocations_land_in_the_innermost_budget(lab: Path, way: str,
                                                         pure: bool) -> None:
    out = python(lab, f"""
        way = {way!r}
        with gpu_budget("1MiB", backend="host", name="root") as root:
            with gpu_budget("256KiB", name="child") as child:
                status, a = driver.alloc(100_000, way)
                out["granted"] = status
                out["child"], out["root"] = held(child), held(root)
                out["over child"] = driver.alloc(200_000, way)[0]
                out["core refused"] = child.allocate(200_000) is None  # door bytes count
                block = child.allocate(100_000)
                out["door refused"] = driver.alloc(100_000, way)[0]  # core bytes count
                child.free(block)
            out["outer"] = driver.alloc(600_000, way)[0]
            out["over root"] = driver.alloc(400_000, way)[0]
            n = door.numbers(child)
            out["refusals"] = n.refusals
            out["by"] = n.last_refused_by
        out["after"] = driver.alloc(5 << 20, way)[0]
        out["freed"] = driver.free(a, way)
        out["left"] = held(root)
    """, pure)
    assert out == {"granted": 0, "child": 100_000, "root": 100_000, "over child": 2,
                   "core refused": True, "door refused": 2, "outer": 0, "over root": 2,
                   "refusals": 2, "by": "libffi.so.8", "after": 0, "freed": 0,
                   "left": 600_000}


@pytest.mark.parametrize("pure", CORES)
def test_mem_get_info_answers_the_budget(lab: Path, pure: bool) -> None:
    code = """
        out["device"] = driver.info()
        with gpu_budget("4MiB", backend="host") as root:
            with gpu_budget("1MiB") as child:
                block = child.allocate(256 << 10)
                s, a = driver.alloc(128 << 10)
                out["child"] = driver.info("proc")
                child.free(block); driver.free(a)
            out["root"] = driver.info("direct")
        with gpu_budget("2GiB", backend="host"):  # more than the device has
            out["big"] = driver.info()
    """
    out = python(lab, code, pure, FAKECUDA_TOTAL=str(1 << 30))
    assert out == {"device": [1 << 30, 1 << 30], "child": [(1 << 20) - (384 << 10), 1 << 20],
                   "root": [4 << 20, 4 << 20], "big": [1 << 30, 1 << 30]}
    seen = python(lab, code, pure, ("--device-info",), FAKECUDA_TOTAL=str(1 << 30))
    assert seen["child"] == [(1 << 30) - (128 << 10), 1 << 30]
    assert seen["root"] == [1 << 30, 1 << 30]


def test_threads_allocate_and_free_across_each_other(lab: Path) -> None:
    out = python(lab, """
        import queue
        handed = queue.Queue()
        with gpu_budget("8MiB", backend="host", name="pool") as pool:
            def worker(n):
                with use(pool):
                    with gpu_budget("1MiB", name=f"w{n}") as mine:
                        for _ in range(20):
                            status, a = driver.alloc(4096)
                            assert status == 0
                            handed.put(a)
            threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
            for t in threads: t.start()
            for t in threads: t.join()
            out["held"] = held(pool)
            def free_some():
                for _ in range(20):
                    driver.free(handed.get())
            freers = [threading.Thread(target=free_some) for _ in range(4)]  # in no budget
            for t in freers: t.start()
            for t in freers: t.join()
            out["after"] = held(pool)
            def in_pool():
                return driver.alloc(1000)
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(1) as ex:
                status, a = ex.submit(bind(in_pool)).result()
                out["bound"] = held(pool)
                out["unbound"] = ex.submit(in_pool).result()[0]
                out["still"] = held(pool)
            driver.free(a)
    """)
    assert out == {"held": 4 * 20 * 4096, "after": 0, "bound": 1000, "unbound": 0,
                   "still": 1000}


def test_memory_from_before_and_outside_passes_uncharged(lab: Path) -> None:
    out = python(lab, """
        status, early = driver.alloc(50_000)
        out["outside"] = door.outside()[0]
        with gpu_budget("100KiB", backend="host") as root:
            out["free early"] = driver.free(early)  # allocated before the budget
            out["held"] = held(root)
            out["big"] = driver.alloc(90_000)[0]  # the whole room is still there
            out["held big"] = held(root)
        out["outside after"] = door.outside()[0]
    """)
    assert out == {"outside": 50_000, "free early": 0, "held": 0, "big": 0,
                   "held big": 90_000, "outside after": 0}


@pytest.mark.parametrize("pure", CORES)
def test_budgets_ending_keep_their_driver_allocations_charged(lab: Path, pure: bool) -> None:
    out = python(lab, """
        import time
        with gpu_budget("1MiB", backend="host", name="root") as root:
            with gpu_budget("512KiB", name="child") as child:
                status, a = driver.alloc(300_000)
            with gpu_budget("256KiB", name="empty") as empty:
                pass
            out["ended"] = [child.state, empty.state]  # exited while they live, as blocks
            out["child gone"] = (held(child), held(root))
            out["refused"] = driver.alloc(800_000)[0]  # the child's bytes still count
            t = threading.Thread(target=driver.free, args=(a,))
            t.start(); t.join()
            out["freed"] = (held(child), held(root))
            status, b = driver.alloc(800_000)
            out["now"] = status
            def wait(budget):
                deadline = time.monotonic() + 60  # the watcher lets it go, woken by the free
                while budget.state != "released" and time.monotonic() < deadline:
                    time.sleep(0.05)
                return budget.state
            out["later"] = wait(child)
        out["root"] = root.state  # its scope's driver allocation still lives
        driver.free(b)
        out["root later"] = wait(root)
    """, pure)
    assert out == {"ended": ["exited", "released"], "child gone": [300_000, 300_000],
                   "refused": 2, "freed": [0, 0], "now": 0, "later": "released",
                   "root": "exited", "root later": "released"}


def test_fork_and_exit_with_live_allocations(lab: Path) -> None:
    out = python(lab, """
        import atexit, os
        with gpu_budget("100KiB", backend="host") as root:
            status, a = driver.alloc(60_000)
            pid = os.fork()
            if pid == 0:  # the child: its inherited budget charges nothing here
                code = 0 if driver.alloc(80_000)[0] == 0 and held(root) == 60_000 else 1
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            out["child exit"] = os.waitstatus_to_exitcode(status)
            out["held"] = held(root)
            out["refused"] = driver.alloc(80_000)[0]
        atexit.register(lambda: print("exit handler ran", file=sys.stderr))
        status, b = driver.alloc(10_000)  # live at exit, with a too
    """)
    assert out == {"child exit": 0, "held": 60_000, "refused": 2}


def test_exit_with_live_allocations_runs_the_exit_handlers(lab: Path) -> None:
    done = run(lab, [sys.executable, "-c", textwrap.dedent("""
        import atexit, driver
        from gpubudget import gpu_budget
        atexit.register(lambda: print("exit handler ran", flush=True))
        with gpu_budget("1MiB", backend="host"):
            status, a = driver.alloc(4096)
        status, b = driver.alloc(4096)
    """)])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "exit handler ran\n"


def test_garbage_arguments(lab: Path) -> None:
    out = python(lab, """
        alloc = driver.entry("dlsym", "cuMemAlloc_v2", driver.ALLOC)
        info = driver.entry("proc", "cuMemGetInfo_v2", driver.INFO)
        with gpu_budget("1MiB", backend="host") as root:
            out["null"] = alloc(None, 4096)
            p = driver.P()
            out["huge"] = [alloc(ctypes.byref(p), size) for size in (2**64 - 1, 2**63, 2**63 - 1)]
            out["zero"] = alloc(ctypes.byref(p), 0)
            out["held"] = held(root)
            out["bad frees"] = [driver.free(x) for x in (0, 1, 0xdeadbeef000, 2**64 - 1)]
            out["info null"] = info(None, None)
            out["live"] = door.numbers(root).live
        out["outside huge"] = alloc(ctypes.byref(p), 2**64 - 1)
    """)
    assert out == {"null": 1, "huge": [2, 2, 2], "zero": 1, "held": 0,
                   "bad frees": [1, 1, 1, 1], "info null": 1, "live": 0, "outside huge": 2}


def test_a_thread_holding_the_gil_waits_on_one_inside_the_hook(lab: Path) -> None:
    out = python(lab, """
        fake = ctypes.PyDLL("libcuda.so.1")  # PyDLL: the interpreter lock stays held
        fake.fake_deadlock_test.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
        hook = ctypes.cast(driver.handle.cuMemAlloc_v2, ctypes.c_void_p).value
        unhook = ctypes.cast(driver.handle.cuMemFree_v2, ctypes.c_void_p).value
        with gpu_budget("1MiB", backend="host") as root:
            account = door._accounts[root].address
            out["finished"] = [fake.fake_deadlock_test(hook, unhook, account, 60_000)
                               for _ in range(50)]
            out["held"] = held(root)
            out["granted"] = door.numbers(root).peak
    """)
    assert out == {"finished": [1] * 50, "held": 0, "granted": 4096}


def test_attribute_only_counts_without_refusing(lab: Path) -> None:
    out = python(lab, """
        with gpu_budget("64KiB", backend="host") as root:
            status, a = driver.alloc(1 << 20)
            n = door.numbers(root)
            out["result"] = [status, n.held, n.refusals, n.attribute_only,
                             [(lib.name, lib.live_bytes) for lib in n.libraries]]
    """, flags=("--attribute-only",))
    assert out == {"result": [0, 1 << 20, 0, True, [["libffi.so.8", 1 << 20]]]}


@pytest.mark.parametrize("pure", CORES)
def test_a_reserved_root_holds_its_limit_on_the_device(lab: Path, pure: bool) -> None:
    out = python(lab, """
        from backend import FakeCudaBackend
        before = driver.used()
        with gpu_budget("4MiB", backend=FakeCudaBackend(), name="reserved") as root:
            n = door.numbers(root)
            out["own"] = [n.own, n.held, driver.used() - before]
            out["foreign"] = driver.alloc(4096)[0]  # the reservation is the whole limit
            with gpu_budget("1MiB") as child:
                block = child.allocate(512 << 10)
                out["block"] = block is not None
                out["child foreign"] = driver.alloc(4096)[0]
                child.free(block)
            out["device"] = driver.used() - before
        out["released"] = driver.used() - before
    """, pure)
    assert out == {"own": [4 << 20, 4 << 20, 4 << 20], "foreign": 2, "block": True,
                   "child foreign": 2, "device": 4 << 20, "released": 0}


@pytest.mark.parametrize("pure", CORES)
def test_a_growable_root_holds_its_limit_on_the_device(lab: Path, pure: bool) -> None:
    out = python(lab, """
        from backend import FakeCudaBackend
        MiB = 1 << 20
        before = driver.used()
        with gpu_budget("8MiB", backend=FakeCudaBackend(), initial=0, name="grows") as root:
            out["start"] = driver.used() - before
            status, a = driver.alloc(5 * MiB)  # foreign: 5 MiB of the 8
            out["foreign"] = status
            first = root.allocate(2 * MiB)  # one granule mapped: 7 MiB on the device
            out["first"] = [first is not None, driver.used() - before]
            out["second"] = root.allocate(2 * MiB)  # a second granule would make 9
            out["device"] = driver.used() - before
            n = door.numbers(root)
            out["door"] = [n.own, n.foreign]
            driver.free(a)
            third = root.allocate(2 * MiB)
            out["after free"] = third is not None
            out["at most"] = driver.used() - before
            root.free(first); root.free(third)
        out["released"] = driver.used() - before
    """, pure)
    MiB = 1 << 20
    assert out == {"start": 0, "foreign": 0, "first": [True, 7 * MiB], "second": None,
                   "device": 7 * MiB, "door": [2 * MiB, 5 * MiB], "after free": True,
                   "at most": 4 * MiB, "released": 0}


@pytest.mark.parametrize("pure", CORES)
def test_outside_bytes_asks_the_device_and_counts_the_door_inside(lab: Path, pure: bool) -> None:
    # the report's "device memory taken outside budgets" reads the device's free memory;
    # under the door cuMemGetInfo answers the budget current in the thread, so the report
    # must ask for the device, and what the door charged the tree is not "outside"
    out = python(lab, """
        from backend import FakeCudaBackend
        MiB = 1 << 20
        with gpu_budget("64MiB", backend=FakeCudaBackend(), initial=0, name="grows") as root:
            with gpu_budget("32MiB", name="model"):
                status, mine = driver.alloc(6 * MiB)  # charged to the model: not outside
                out["charged"] = root.report().outside_bytes
                other = []
                thread = threading.Thread(target=lambda: other.append(driver.alloc(3 * MiB)))
                thread.start(); thread.join()  # a thread in no budget: outside
                out["with other"] = root.report().outside_bytes
                driver.free(mine); driver.free(other[0][1])
            out["after"] = root.report().outside_bytes
    """, pure, FAKECUDA_TOTAL=str(1 << 30))
    MiB = 1 << 20
    assert out == {"charged": 0, "with other": 3 * MiB, "after": 0}


@pytest.mark.parametrize("pure", CORES)
def test_a_granule_the_door_refuses_ends_the_growth(lab: Path, pure: bool) -> None:
    out = python(lab, """
        from backend import FakeCudaBackend
        MiB = 1 << 20
        before = driver.used()
        with gpu_budget("8MiB", backend=FakeCudaBackend(), initial=0, name="grows") as root:
            status, a = driver.alloc(7 * MiB)  # foreign: 7 MiB of the 8
            out["foreign"] = status
            out["small"] = root.allocate(4096)  # fits the ledger; its granule (2 MiB) not
            out["device"] = driver.used() - before
            out["denials"] = [[d.reason, d.count] for d in root.report().denials]
            driver.free(a)
            block = root.allocate(4096)
            out["then"] = [block is not None, driver.used() - before]
            root.free(block)
    """, pure)
    assert out == {"foreign": 0, "small": None, "device": 7 << 20,
                   "denials": [["device_full", 1]], "then": [True, 2 << 20]}


def test_run_without_a_command_or_a_compiler_says_so_in_one_line(lab: Path,
                                                                 tmp_path: Path) -> None:
    done = run(lab, [])
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "run needs a command" in done.stderr
    env = environment(lab, GPUBUDGET_DOOR_CACHE=str(tmp_path), CC="/nonexistent/cc",
                      PATH=str(tmp_path))
    bare = subprocess.run([sys.executable, "-m", "gpubudget", "run", "--", "true"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert bare.returncode == 2 and bare.stderr.count("\n") == 1
    assert "no C compiler was found" in bare.stderr
    missing = run(lab, ["/nonexistent/program"])
    assert missing.returncode == 2 and "cannot run '/nonexistent/program'" in missing.stderr
    given = run(lab, ["true"], extra={"GPUBUDGET_DOOR_LIB": str(tmp_path / "none.so")})
    assert given.returncode == 2 and given.stderr.count("\n") == 1
    assert "GPUBUDGET_DOOR_LIB=" in given.stderr and "is not a file" in given.stderr


def test_a_door_of_another_version_is_refused_in_one_line(lab: Path, tmp_path: Path) -> None:
    # a library built from an older door.c (before the door read the ledger's word again
    # after its compare-and-swap) would leave the race open: run refuses it by its tag, and a
    # process that loaded one by hand is told, once, that it is not used
    import re

    source = build.SOURCE.read_text()
    found = re.search(r"GBD_VERSION = (\d+)", source)
    assert found is not None and int(found.group(1)) == build.VERSION
    assert f'"gpubudget driver door, version {build.VERSION}."' in source
    built = run(lab, ["true"], flags=("--print-library",))
    assert build.version_of(Path(built.stdout.strip())) == build.VERSION
    older = tmp_path / "older.so"
    older.write_bytes(b"\x7fELF...gpubudget driver door, version 1.\x00...")
    for given, said in ((older, "is the driver door's version 1"),
                        (lab / "libcuda.so.1", "is no driver door")):
        done = run(lab, ["true"], extra={"GPUBUDGET_DOOR_LIB": str(given)})
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert said in done.stderr and f"needs version {build.VERSION}" in done.stderr
    old = tmp_path / "old.c"  # a door whose gbd_version is 1, preloaded by hand
    old.write_text(source.replace("GBD_VERSION = 2", "GBD_VERSION = 1"))
    cc = build.compiler()
    assert cc is not None
    subprocess.run([cc, *build.FLAGS, "-o", str(tmp_path / "old.so"), str(old), *build.LIBS],
                   check=True)
    code = "import warnings; from gpubudget import door; print(door.loaded())"
    done = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                          text=True, timeout=120, check=False,
                          env=environment(lab, LD_PRELOAD=str(tmp_path / "old.so")))
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    assert "door loaded in this process is version 1" in done.stderr
    assert f"needs version {build.VERSION}" in done.stderr


def test_a_cached_library_others_may_write_is_not_loaded(lab: Path) -> None:
    built = run(lab, ["true"], flags=("--print-library",))
    assert built.returncode == 0, built.stderr
    path = Path(built.stdout.strip())
    assert path.parent == lab / "cache" and path.is_file()
    path.chmod(0o777)
    try:
        done = run(lab, ["true"])
        assert done.returncode == 2 and done.stderr.count("\n") == 1
        assert "not this user's alone to write" in done.stderr
    finally:
        path.chmod(0o755)
    assert run(lab, ["true"]).returncode == 0


@pytest.mark.parametrize("pure", CORES)
def test_report_shows_the_door_by_library_and_names_who_was_refused(lab: Path,
                                                                    pure: bool) -> None:
    out = python(lab, """
        with gpu_budget("1MiB", backend="host", name="root") as root:
            with gpu_budget("256KiB", name="child") as child:
                status, a = driver.alloc(100_000)
                driver.alloc(200_000)  # refused
                report = root.report()
                out["available"] = report.children[0].available
                out["door"] = report.children[0].as_dict()["driver_door"]
                out["root held"] = report.driver_door.held
                out["text"] = [line.strip() for line in str(report).splitlines()
                               if "driver allocations" in line]
                driver.free(a)
    """, pure)
    assert out["available"] == (256 << 10) - 100_000
    assert out["door"] == {"held": 100_000, "peak": 100_000, "allocations": 1, "refusals": 1,
                           "last_refused": 200_000, "last_refused_by": "libffi.so.8",
                           "libraries": [{"name": "libffi.so.8", "live": 100_000,
                                          "refusals": 1}], "attribute_only": False}
    assert out["root held"] == 100_000
    assert out["text"] == [
        "driver allocations (through the door): 97.66 KiB held, peak 97.66 KiB",
        "driver allocations (through the door): 97.66 KiB held, peak 97.66 KiB; by library: "
        "libffi.so.8 97.66 KiB; 1 refused, the last 195.31 KiB asked by libffi.so.8",
    ]
    page = (ROOT / "docs" / "door.md").read_text(encoding="utf-8")  # the line it shows
    shown = page.split("checked by tests/test_door.py", 1)[1].split("```text\n", 1)[1]
    assert shown.split("\n```", 1)[0] == out["text"][1]


def test_report_has_no_door_line_without_the_door() -> None:
    from gpubudget import gpu_budget

    with gpu_budget("1MiB", backend="host") as root:
        report = root.report()
    assert report.driver_door is None
    assert "driver allocations" not in str(report)


def test_every_entry_point_is_charged_and_given_back(lab: Path) -> None:
    out = python(lab, """
        c = ctypes
        P, S, U = driver.P, driver.SIZE, c.c_uint
        h = driver.handle
        got = {}
        with gpu_budget("64MiB", backend="host") as root:
            def step(name, call, free):
                before = held(root)
                status = call()
                after = held(root)
                free()
                got[name] = [status, after - before, held(root) - before]
            p = P()
            step("cuMemAllocManaged", lambda: h.cuMemAllocManaged(c.byref(p), S(5000), U(1)),
                 lambda: h.cuMemFree_v2(p))
            step("cuMemAllocAsync", lambda: h.cuMemAllocAsync(c.byref(p), S(6000), None),
                 lambda: h.cuMemFreeAsync(p, None))
            step("cuMemAllocFromPoolAsync",
                 lambda: h.cuMemAllocFromPoolAsync(c.byref(p), S(7000), None, None),
                 lambda: h.cuMemFreeAsync_ptsz(p, None))
            pitch = S()
            step("cuMemAllocPitch_v2",
                 lambda: h.cuMemAllocPitch_v2(c.byref(p), c.byref(pitch), S(1000), S(3), U(4)),
                 lambda: h.cuMemFree_v2(p))
            q, qpitch = U(), U()
            step("cuMemAlloc", lambda: h.cuMemAlloc(c.byref(q), U(3000)), lambda: h.cuMemFree(q))
            step("cuMemAllocPitch", lambda: h.cuMemAllocPitch(c.byref(q), c.byref(qpitch), U(100),
                 U(2), U(4)), lambda: h.cuMemFree(q))
            # the per-thread-stream forms, through cuGetProcAddress with its flag
            get = h.cuGetProcAddress_v2
            get.argtypes = [c.c_char_p, c.POINTER(c.c_void_p), c.c_int, c.c_ulonglong, c.c_void_p]
            fn = c.c_void_p()
            assert get(b"cuMemAllocAsync", c.byref(fn), 12000, 2, None) == 0
            alloc_ptsz = c.CFUNCTYPE(c.c_int, c.POINTER(P), S, c.c_void_p)(fn.value)
            step("cuMemAllocAsync_ptsz", lambda: alloc_ptsz(c.byref(p), 8000, None),
                 lambda: h.cuMemFreeAsync(p, None))
            # cuGetProcAddress found through cuGetProcAddress is the door's too
            assert get(b"cuGetProcAddress", c.byref(fn), 12000, 0, None) == 0
            inner = c.CFUNCTYPE(c.c_int, c.c_char_p, c.POINTER(c.c_void_p), c.c_int,
                                c.c_ulonglong, c.c_void_p)(fn.value)
            assert inner(b"cuMemAlloc", c.byref(fn), 12000, 0, None) == 0
            alloc = driver.ALLOC(fn.value)
            step("cuMemAlloc via two lookups", lambda: alloc(c.byref(p), 9000),
                 lambda: h.cuMemFree_v2(p))
            # virtual memory: charged at create, given back once released and unmapped
            handle, address = c.c_ulonglong(), P()
            prop = (c.c_int * 8)(0, 0, 2, 0)  # location.type 2: host memory, not charged
            assert h.cuMemCreate(c.byref(handle), S(2 << 20), prop, c.c_ulonglong(0)) == 0
            out["host located"] = held(root)
            assert h.cuMemRelease(handle) == 0
            prop[2] = 1  # CU_MEM_LOCATION_TYPE_DEVICE
            assert h.cuMemAddressReserve(c.byref(address), S(4 << 20), S(0), P(0),
                                         c.c_ulonglong(0)) == 0
            out["create"] = h.cuMemCreate(c.byref(handle), S(2 << 20), prop, c.c_ulonglong(0))
            out["created"] = held(root)
            assert h.cuMemMap(address, S(2 << 20), S(0), handle, c.c_ulonglong(0)) == 0
            assert h.cuMemRelease(handle) == 0
            out["released, mapped"] = held(root)
            assert h.cuMemUnmap(address, S(2 << 20)) == 0
            out["unmapped"] = held(root)
            out["pitch"] = [pitch.value, qpitch.value]
            out["device"] = driver.used()
        out["got"] = got
    """)
    got = out.pop("got")
    assert got == {
        "cuMemAllocManaged": [0, 5000, 0], "cuMemAllocAsync": [0, 6000, 0],
        "cuMemAllocFromPoolAsync": [0, 7000, 0], "cuMemAllocPitch_v2": [0, 1024 * 3, 0],
        "cuMemAlloc": [0, 3000, 0], "cuMemAllocPitch": [0, 512 * 2, 0],
        "cuMemAllocAsync_ptsz": [0, 8000, 0], "cuMemAlloc via two lookups": [0, 9000, 0]}
    assert out == {"host located": 0, "create": 0, "created": 2 << 20,
                   "released, mapped": 2 << 20, "unmapped": 0,
                   "pitch": [1024, 512], "device": 0}


def test_asyncio_tasks_sharing_a_thread_and_follow(lab: Path) -> None:
    out = python(lab, """
        import asyncio
        async def main():
            with gpu_budget("16MiB", backend="host", name="root") as root:
                a_in, b_in, a_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
                budgets = {}
                async def task_a():
                    with gpu_budget("1MiB", name="a") as a:
                        budgets["a"] = a
                        a_in.set()
                        await b_in.wait()  # b entered its budget meanwhile, in this thread
                        status, p = driver.alloc(1000)  # the door sees b, entered last
                        out["unfollowed"] = [held(a), held(budgets["b"])]
                        driver.free(p)
                        door.follow()  # this task's budget again
                        status, p = driver.alloc(1000)
                        out["followed"] = [held(a), held(budgets["b"])]
                        driver.free(p)
                    a_done.set()
                async def task_b():
                    await a_in.wait()
                    with gpu_budget("2MiB", name="b") as b:
                        budgets["b"] = b
                        b_in.set()
                        await a_done.wait()
                await asyncio.gather(task_a(), task_b())
        asyncio.run(main())
    """)
    assert out == {"unfollowed": [0, 1000], "followed": [1000, 0]}


def test_threads_racing_in_one_budget_never_pass_its_limit(lab: Path) -> None:
    out = python(lab, """
        import random
        with gpu_budget("1MiB", backend="host", name="root") as root:
            with gpu_budget("256KiB", name="shared") as shared:
                refused = []
                def worker(seed):
                    rng = random.Random(seed)
                    live, no = [], 0
                    for _ in range(3000):
                        if live and rng.random() < 0.5:
                            driver.free(live.pop(rng.randrange(len(live))))
                        status, p = driver.alloc(rng.randint(1, 64 << 10))
                        if status == 0:
                            live.append(p)
                        else:
                            no += 1
                    for p in live:
                        driver.free(p)
                    refused.append(no)
                threads = [threading.Thread(target=bind(worker, n)) for n in range(4)]
                for t in threads: t.start()
                for t in threads: t.join()
                n = door.numbers(shared)
                out["peak within"] = n.peak <= 256 << 10
                out["refused some"] = sum(refused) > 0 and n.refusals == sum(refused)
                out["held"] = [n.held, held(root), n.live]
                out["device"] = driver.used()
    """)
    assert out == {"peak within": True, "refused some": True, "held": [0, 0, 0], "device": 0}


def test_accounts_go_once_nothing_holds_them(lab: Path) -> None:
    out = python(lab, """
        import gc
        lib = door._door()
        lib.gbd_accounts.restype = ctypes.c_int64
        lib.gbd_set_current.argtypes = [ctypes.c_void_p]
        base = lib.gbd_accounts()
        with gpu_budget("1MiB", backend="host") as root:
            with gpu_budget("512KiB") as child:
                status, a = driver.alloc(1000)
            out["made"] = lib.gbd_accounts() - base
            address = door._accounts[child].address
            t = threading.Thread(target=lib.gbd_set_current, args=(address,))
            t.start(); t.join()  # a thread that ends with the child's account current
        del root, child
        gc.collect()
        out["while held"] = lib.gbd_accounts() - base  # the child's allocation lives
        driver.free(a)
        import time
        deadline = time.monotonic() + 60  # the watcher releases them; then nothing holds them
        while lib.gbd_accounts() != base and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        out["after"] = lib.gbd_accounts() - base
    """)
    assert out == {"made": 2, "while held": 2, "after": 0}


def _under_door(lab: Path, code: str, ledger: Path, pure: bool = False,
                flags: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """``code`` started under the door, registering in the host ledger at ``ledger``; it
    prints "ready" when the test may look, and waits for a line on its stdin."""
    env = environment(lab, pure, GPUBUDGET_LEDGER="1", GPUBUDGET_LEDGER_DIR=str(ledger))
    program = "import driver, sys, threading\nfrom gpubudget import gpu_budget\n" + \
        textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-m", "gpubudget", "run", *flags, "--",
                             sys.executable, "-c", program], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_ready(child: subprocess.Popen[str]) -> None:
    assert child.stdout is not None
    line = child.stdout.readline()
    if line != "ready\n":
        child.kill()
        raise AssertionError(f"{line!r} {child.communicate()[1]}")


def _finish(child: subprocess.Popen[str]) -> None:
    out, err = child.communicate("go\n", timeout=120)
    assert child.returncode == 0, err


_VIEWED = """
    with gpu_budget("1MiB", backend="host", name="model") as root:
        with gpu_budget("256KiB", name="encoder") as child:
            status, a = driver.alloc(100_000)
            assert status == 0
            assert driver.alloc(200_000)[0] == 2  # refused by the encoder's limit
            status, b = driver.alloc(50_000)
        status, c = driver.alloc(30_000)  # the root's own scope
        print("ready", flush=True)
        sys.stdin.readline()
        driver.free(a); driver.free(b); driver.free(c)
"""


@pytest.mark.parametrize("pure", CORES)
def test_top_shows_each_budgets_door_bytes_by_library_from_another_process(
        lab: Path, tmp_path: Path, pure: bool) -> None:
    from gpubudget.cli.top import render
    from gpubudget.hostledger import host_view

    child = _under_door(lab, _VIEWED, tmp_path, pure)
    try:
        _wait_ready(child)
        view = host_view(tmp_path, nvml=False)  # this process has no door: it reads the file
        lines = [line.strip() for line in render(view) if "driver door" in line]
        as_json = view.as_dict()["devices"][0]["budgets"][0]
    finally:
        _finish(child)
    assert lines == [
        "↳ driver door 175.78 KiB: libffi.so.8 29.30 KiB",
        "↳ driver door 146.48 KiB: libffi.so.8 146.48 KiB · 1 refused, the last 195.31 KiB "
        "asked by libffi.so.8"]
    assert as_json["driver_door"]["held"] == 180_000
    encoder = as_json["children"][0]
    assert encoder["budget"] == "encoder" and encoder["driver_door"] == {
        "held": 150_000, "peak": 150_000, "refusals": 1, "last_refused": 200_000,
        "last_refused_by": "libffi.so.8", "attribute_only": False,
        "libraries": [{"name": "libffi.so.8", "live": 150_000, "refusals": 1}]}
    assert list(tmp_path.glob("*.door")) == []  # removed at exit


def test_metrics_show_each_budgets_door_bytes_and_refusals_by_library(
        lab: Path, tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from gpubudget.hostledger import host_view
    from gpubudget.metrics import families

    child = _under_door(lab, _VIEWED, tmp_path)
    try:
        _wait_ready(child)
        found = {(sample.name, tuple(sorted(sample.labels.items())), sample.value)
                 for family in families(host_view(tmp_path, nvml=False))
                 for sample in family.samples if family.name.startswith("gpubudget_door")}
        pid = str(child.pid)
    finally:
        _finish(child)
    host = (("UUID", "host"), ("budget", "model"), ("gpu", ""), ("modelName", "host memory"))

    def labels(child: str, library: str | None = None) -> tuple[tuple[str, str], ...]:
        more = [("library", library)] if library else []
        return tuple(sorted([*host, ("child", child), ("process", pid), *more]))

    assert found == {
        ("gpubudget_door_bytes", labels(""), 180_000),
        ("gpubudget_door_bytes", labels("encoder"), 150_000),
        ("gpubudget_door_library_bytes", labels("", "libffi.so.8"), 30_000),
        ("gpubudget_door_library_bytes", labels("encoder", "libffi.so.8"), 150_000),
        ("gpubudget_door_refusals_total", labels("encoder", "libffi.so.8"), 1)}


def test_a_forked_childs_frees_never_show_in_its_parents_door_file(lab: Path,
                                                                   tmp_path: Path) -> None:
    from gpubudget.hostledger import host_view

    child = _under_door(lab, """
        import os
        with gpu_budget("1MiB", backend="host", name="model") as root:
            status, a = driver.alloc(100_000)
            pid = os.fork()
            if pid == 0:  # frees the parent's allocation in its own copy of the driver
                driver.free(a)
                with gpu_budget("1MiB", backend="host", name="forked"):
                    driver.alloc(5_000)
                os._exit(0)
            os.waitpid(pid, 0)
            print("ready", flush=True)
            sys.stdin.readline()
            driver.free(a)
    """, tmp_path)
    try:
        _wait_ready(child)
        device = host_view(tmp_path, nvml=False).devices[0]
        shown = [(entry.name, door.held if (door := device.door_of(entry)) else None)
                 for entry in device.entries]
    finally:
        _finish(child)
    assert shown == [("model", 100_000)]


def test_a_boot_id_past_63_bits_makes_a_door_file_others_read(lab: Path,
                                                               tmp_path: Path) -> None:
    # a boot id is 64 random bits: half the machines' have the top one set (the H200's did,
    # and the door file could not be made there: struct.error at the first root)
    out = python(lab, """
        import gpubudget.hostledger.procs as procs
        from gpubudget.door.shared import read_doors
        procs._identity.cache_clear()
        procs.boot_id = lambda: 2**64 - 12345
        with gpu_budget("1MiB", backend="host", name="model") as root:
            status, a = driver.alloc(100_000)
            found = read_doors(LEDGER)
            out["held"] = sorted(share.held for share in found.values())
            driver.free(a)
    """.replace("LEDGER", repr(str(tmp_path))), GPUBUDGET_LEDGER="1",
                 GPUBUDGET_LEDGER_DIR=str(tmp_path))
    assert out == {"held": [100_000]}


@pytest.mark.parametrize("pure", CORES)
def test_the_viewer_gets_each_budgets_door_numbers_from_a_report(lab: Path, tmp_path: Path,
                                                                 pure: bool) -> None:
    from gpubudget.viewer.page import _data
    from gpubudget.viewer.reportfile import model_from_report_file

    path = tmp_path / "report.json"
    python(lab, f"""
        with gpu_budget("1MiB", backend="host", name="root") as root:
            with gpu_budget("256KiB", name="child") as child:
                status, a = driver.alloc(100_000)
                driver.alloc(200_000)  # refused
                with open({str(path)!r}, "w") as file:
                    file.write(root.report().to_json())
                driver.free(a)
    """, pure)
    model = model_from_report_file(path, max_bytes=1 << 20)
    assert [budget.name for budget in model.budgets] == ["root", "child"]
    assert [row[10] for row in _data(model)["budgets"]] == [
        [100_000, 0, 0, None, []],
        [100_000, 1, 200_000, "libffi.so.8", [["libffi.so.8", 100_000, 1]]]]
    without = tmp_path / "plain.json"
    from gpubudget import gpu_budget

    with gpu_budget("1MiB", backend="host", name="plain") as plain:
        without.write_text(plain.report().to_json(), encoding="utf-8")
    assert _data(model_from_report_file(without, max_bytes=1 << 20))["budgets"][0][10] is None


# -- the door and gpubudget's allocator at the same moment ----------------------------------


@pytest.fixture(scope="module")
def hooked(lab: Path) -> Path:
    """The door built with its tests' hook: ``gbd_test_between(fn)`` has the next charge
    call ``fn`` once, after it checked the limit and before it adds its bytes."""
    cc = build.compiler()
    assert cc is not None
    target = lab / "libgpubudget_door-hooked.so"
    subprocess.run([cc, *build.FLAGS, "-DGBD_TEST_HOOKS", "-o", str(target),
                    str(build.SOURCE), *build.LIBS], check=True)
    return target


@pytest.mark.parametrize("pure", CORES)
@pytest.mark.parametrize("level", [0, 1])
def test_an_allocation_between_the_doors_check_and_its_charge_is_seen(
        lab: Path, hooked: Path, pure: bool, level: int) -> None:
    # the door has checked 192 KiB against the room at one level of the chain (the model's
    # 256 KiB, or the root's above a larger model), and gpubudget's allocator takes 128 KiB
    # before the door adds them there: the door reads the allocator's word again after
    # adding, and gives its bytes back at every level; never both, 320 KiB, in 256 KiB
    limits = ("1MiB", "256KiB") if level == 0 else ("256KiB", "1MiB")
    out = python(lab, f"""
        hook = ctypes.CDLL(None).gbd_test_between
        hook.argtypes = [ctypes.c_void_p, ctypes.c_int]
        with gpu_budget("{limits[0]}", backend="host", name="root") as root:
            with gpu_budget("{limits[1]}", name="model") as model:
                blocks = []
                @ctypes.CFUNCTYPE(None)
                def between():
                    blocks.append(model.allocate(128 << 10))
                hook(ctypes.cast(between, ctypes.c_void_p), {level})
                status, p = driver.alloc(192 << 10)
                out["door"] = status
                out["block"] = blocks[0] is not None
                out["model"] = [model.report().used, held(model)]
                out["root"] = held(root)
                out["refused by"] = [door.numbers(model).refusals, door.numbers(root).refusals]
                model.free(blocks[0])
    """, pure, GPUBUDGET_DOOR_LIB=str(hooked))
    assert out == {"door": 2, "block": True, "model": [128 << 10, 0], "root": 0,
                   "refused by": [1, 1] if level else [1, 0]}


@pytest.mark.parametrize("pure", CORES)
def test_a_driver_allocation_between_the_allocators_check_and_its_charge_is_seen(
        lab: Path, pure: bool) -> None:
    # gpubudget's allocator has checked 3 MiB against the model's 4 MiB and, before it
    # charges them, maps a granule of its growable root; meanwhile another thread of the
    # model asks the driver for 2 MiB: the allocator showed the door its 3 MiB first, so the
    # door refuses; never both, 5 MiB, in a 4 MiB budget
    out = python(lab, """
        from backend import FakeCudaBackend
        from gpubudget.backends.virtual import CudaVirtualRange
        MiB = 1 << 20
        other = []
        class Range(CudaVirtualRange):
            def map(self, index):
                if not other:
                    thread = threading.Thread(target=bind(lambda: other.append(
                        driver.alloc(2 * MiB))))
                    thread.start(); thread.join()
                super().map(index)
        class Backend(FakeCudaBackend):
            def reserve_virtual(self, nbytes, granule):
                return Range(self, nbytes, granule)
        before = driver.used()
        with gpu_budget("16MiB", backend=Backend(), initial=0, name="grows") as root:
            with gpu_budget("4MiB", name="model") as model:
                block = model.allocate(3 * MiB)
                out["block"] = block is not None
                out["door"] = other[0][0]
                out["model"] = [model.report().used, held(model)]
                out["device"] = driver.used() - before
                model.free(block)
    """, pure)
    MiB = 1 << 20
    assert out == {"block": True, "door": 2, "model": [3 * MiB, 0], "device": 4 * MiB}


@pytest.mark.parametrize("pure", CORES)
def test_a_trace_carries_the_door_and_its_report_and_viewer_show_it(lab: Path, tmp_path: Path,
                                                                    pure: bool) -> None:
    """Each traced budget the door charged or refused gets a ``door`` line just before its
    ``exit``; ``gpubudget report`` of the trace prints the door line each budget's live
    report printed as it exited, and the viewer draws the same numbers as from a report."""
    from gpubudget.tracefile import Door, TraceReader
    from gpubudget.viewer import model_from_trace
    from gpubudget.viewer.page import _data

    path = tmp_path / "run.jsonl"
    out = python(lab, f"""
        def door_line(budget):
            return [line.strip() for line in str(budget.report()).splitlines()
                    if "driver allocations" in line][0]
        with gpu_budget("1MiB", backend="host", name="root", trace={str(path)!r}) as root:
            with gpu_budget("256KiB", name="child") as child:
                status, a = driver.alloc(100_000)
                driver.alloc(200_000)  # refused
                out["child"] = door_line(child)
            with gpu_budget("128KiB", name="quiet") as quiet:
                out["quiet"] = door_line(quiet)  # nothing charged, nothing refused
            driver.free(a)
            out["root"] = door_line(root)
    """, pure)
    assert out["quiet"] == "driver allocations (through the door): 0 B held, peak 0 B"
    assert out["child"] == ("driver allocations (through the door): 97.66 KiB held, peak "
                            "97.66 KiB; by library: libffi.so.8 97.66 KiB; 1 refused, the "
                            "last 195.31 KiB asked by libffi.so.8")
    assert out["root"] == "driver allocations (through the door): 0 B held, peak 97.66 KiB"

    lines = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    ids = {line["name"]: line["b"] for line in lines if line["ev"] == "enter"}
    doors = [(index, line) for index, line in enumerate(lines) if line["ev"] == "door"]
    assert [line["b"] for _, line in doors] == [ids["child"], ids["root"]]  # none for quiet
    for index, line in doors:
        assert lines[index + 1] == {"ev": "exit", "t": lines[index + 1]["t"], "b": line["b"]}
    child_line = {key: value for key, value in doors[0][1].items() if key != "t"}
    assert child_line == {
        "ev": "door", "b": ids["child"], "held": 100_000, "own": 0, "allocations": 1,
        "peak": 100_000, "refusals": 1, "last_refused": 200_000,
        "last_refused_by": "libffi.so.8", "libraries": [["libffi.so.8", 100_000, 1]],
        "attribute_only": False}
    assert (doors[1][1]["held"], doors[1][1]["peak"], doors[1][1]["libraries"]) == (
        0, 100_000, [])

    parsers = ["json", "msgspec", "c"]  # every reader: the same events
    readings = []
    for parser in parsers:
        try:
            with TraceReader(path, parser=parser) as reader:
                readings.append(list(reader.events(door=True)))
        except ImportError:
            continue  # that parser is not there
    assert all(reading == readings[0] for reading in readings)
    assert [event for event in readings[0] if isinstance(event, Door)][0] == Door(
        doors[0][1]["t"], ids["child"], 100_000, 0, 1, 100_000, 1, 200_000, "libffi.so.8",
        (("libffi.so.8", 100_000, 1),), False)

    shown = subprocess.run([sys.executable, "-m", "gpubudget", "report", str(path)],
                           env=environment(lab), capture_output=True, text=True,
                           timeout=120, check=True).stdout
    printed = ["driver allocations" + line.split("driver allocations", 1)[1]
               for line in shown.splitlines() if "driver allocations" in line]
    assert printed == [out["root"], out["child"]]  # quiet: no line, as it had no door line
    as_json = json.loads(subprocess.run(
        [sys.executable, "-m", "gpubudget", "report", "--json", str(path)],
        env=environment(lab), capture_output=True, text=True, timeout=120,
        check=True).stdout)
    root_report = as_json["roots"][0]
    assert [child["name"] for child in root_report["children"]] == ["child", "quiet"]
    assert root_report["children"][0]["driver_door"] == {
        "held": 100_000, "peak": 100_000, "allocations": 1, "refusals": 1,
        "last_refused": 200_000, "last_refused_by": "libffi.so.8",
        "libraries": [{"name": "libffi.so.8", "live": 100_000, "refusals": 1}],
        "attribute_only": False}
    assert root_report["children"][1].get("driver_door") is None

    model = model_from_trace(path)
    assert [budget.name for budget in model.budgets] == ["root", "child", "quiet"]
    assert [row[10] for row in _data(model)["budgets"]] == [
        [0, 0, 0, None, []],
        [100_000, 1, 200_000, "libffi.so.8", [["libffi.so.8", 100_000, 1]]],
        None]
