"""The viewer and the Perfetto export on a large trace: time, file sizes, and the page's
load, redraw and click times in headless Chromium.

    python -m benchmarks.viewer [--events N] [--keep DIR] [--against CHECKOUT] [--trace FILE]

Records a churn trace through real budgets (one root, three children, 1,000 live blocks of
log-uniform sizes, each step frees a random block and allocates another, a denial now and
then) until ``--events`` events are written (default 1,000,000), then times
``model_from_trace``, the page, the Perfetto export, and, where Chromium, chromedriver and
Selenium are at hand, the page in the browser: load (until drawn; the better of two), a
redraw of the whole run and one zoomed in 1000 times (every view that follows the time
axis: the lanes and the addresses), choosing a moment (every view that follows it: the live
blocks, the flame graph, the addresses), a hover over a lane (each the best of five, after
what the page prepares once shown); and ``report().to_json()`` with and without its
timeline after 100,000 allocations. ``--trace FILE`` measures a trace recorded before
instead of recording one.

``--against CHECKOUT`` (another checkout of gpubudget, e.g. ``git worktree add /tmp/old
main``) writes the page of the same trace with that checkout's viewer too, in a process of
its own, and measures both pages in the same browser, side by side, with their ratio.
Timings vary from machine to machine; compare rows of one run.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any

from gpubudget import gpu_budget
from gpubudget.backends.host import HostBackend
from gpubudget.viewer import model_from_trace, write_page
from gpubudget.perfetto import write_perfetto
from gpubudget.tracefile import writer_for
from gpubudget.units import MiB, format_size


def record(path: str, events: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    backend = HostBackend(noreserve=True)

    def size() -> int:
        return int(math.exp(rng.uniform(math.log(256), math.log(4 * MiB))))

    with gpu_budget("64GiB", name="server", backend=backend, trace=path) as root:
        children = [gpu_budget("16GiB", name=f"model-{k}", parent=root) for k in range(3)]
        for child in children:
            child.__enter__()
        live: list[tuple[Any, int]] = []
        written = 0
        while written < events:
            child = children[rng.randrange(3)]
            if len(live) >= 1000:
                owner, block = live.pop(rng.randrange(len(live)))
                owner.free(block)
                written += 1
            wanted = size() if rng.random() > 1e-4 else 32 * 1024 * MiB  # now and then too much
            granted = child.allocate(wanted, tag=f"layer{rng.randrange(7)}")
            written += 1
            if granted is not None:
                live.append((child, granted))
        for owner, block in live:
            owner.free(block)
        for child in reversed(children):
            child.__exit__(None, None, None)
        assert root.used == 0
    writer_for(path).flush()


def _timed(work: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = work()
    return result, time.perf_counter() - start


def json_rows(allocations: int = 100_000) -> list[tuple[str, str]]:
    """``report().to_json()`` with and without the timeline, after ``allocations``
    allocations and frees (the timeline keeps the last ``EVENT_LOG_LIMIT`` events)."""
    with gpu_budget("1GiB", name="pool", backend=HostBackend(noreserve=True)) as pool:
        for _ in range(allocations):
            block = pool.allocate(4096, tag="t")
            assert block is not None and pool.free(block)
        report = pool.report()
    rows = []
    for timeline in (False, True):
        text, seconds = _timed(lambda: report.to_json(timeline=timeline))
        rows.append((f"to_json(timeline={timeline}) after {allocations:,} allocations",
                     f"{seconds * 1000:.0f} ms, {format_size(len(text))}"))
    return rows


_TIMING = """
    const v = window.gpubudgetViewer, s = v.state, end = v.end, out = {};
    const time = f => { const t = performance.now(); f(); return performance.now() - t; };
    const best = f => Math.min(...[1, 2, 3, 4, 5].map(() => time(f)));  // the least noise
    out.whole = best(() => { s.v0 = 0; s.v1 = end; v.draw(); });
    out.close = best(() => { s.v0 = end / 2; s.v1 = end / 2 + end / 1000; v.draw(); });
    s.v0 = 0; s.v1 = end; v.draw();
    let at = 0.4;  // a different moment each time
    out.click = best(() => v.select(end * (at += 0.05), null));
    if (v.laneHit) out.hover = best(() => v.laneHit(v.xOf(end * (at -= 0.07)), v.AXIS + v.LANE / 2));
    return out;
"""


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("google-chrome")
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        return None
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.binary_location = binary
    return webdriver.Chrome(service=Service(driver_path), options=options)


def _measure(driver: Any, page: str) -> dict[str, float]:
    driver.get("about:blank")
    start = time.perf_counter()
    driver.get("file://" + os.path.abspath(page))
    while not driver.execute_script("return document.body.dataset.ready || ''"):
        time.sleep(0.02)
    loaded = time.perf_counter() - start
    if driver.execute_script("return document.body.dataset.ready") != "1":
        raise RuntimeError(f"{page}: the page failed: "
                           f"{driver.execute_script('return window.gpubudgetViewer.errors')}")
    while driver.execute_script("return 'warm' in window.gpubudgetViewer && "
                                "!document.body.dataset.warm"):
        time.sleep(0.02)  # what the page prepares once shown, before the first zoom
    timings = dict(driver.execute_script(_TIMING))
    timings["load"] = loaded * 1000
    return timings


_BROWSER_ROWS = (("load", "browser: load until drawn"),  # the better of two loads; the rest
                 # the best of five runs in each of the two
                 ("whole", "browser: redraw, whole run"),
                 ("close", "browser: redraw, zoomed 1000x"),
                 ("click", "browser: choose a moment (blocks, flame graph, addresses)"),
                 ("hover", "browser: hover over a lane"))


def browser_rows(page: str, against: str | None = None) -> list[tuple[str, str]]:
    """The page's load and redraw times in headless Chromium; with ``against`` (another
    page of the same trace), that page's too, measured in the same browser, and the
    ratio (this one's time over the other's)."""
    try:
        driver = _browser()
    except ImportError:
        return [("browser", "selenium not installed")]
    if driver is None:
        return [("browser", "no chromium and chromedriver")]
    ours: dict[str, float] = {}
    theirs: dict[str, float] = {}
    try:
        for _ in range(2):  # alternately, the better of two of each
            for found, path in ((ours, page), (theirs, against)):
                if path is not None:
                    for key, value in _measure(driver, path).items():
                        found[key] = min(found.get(key, math.inf), value)
    finally:
        driver.quit()
    rows = []
    for key, name in _BROWSER_ROWS:
        if key not in ours:
            continue
        shown = f"{ours[key] / 1000:.2f} s" if key == "load" else f"{ours[key]:.0f} ms"
        if key in theirs:
            other = f"{theirs[key] / 1000:.2f} s" if key == "load" else f"{theirs[key]:.0f} ms"
            shown += f" (against {other}: x{ours[key] / max(theirs[key], 1e-3):.2f})"
        rows.append((name, shown))
    return rows


def other_page(checkout: str, trace: str, page: str) -> float:
    """Write the page of ``trace`` with the viewer of the gpubudget at ``checkout``, in a
    process of its own (pure-Python core); the seconds it took."""
    code = ("import sys, time\n"
            "try:\n"
            "    from gpubudget.viewer import model_from_trace, write_page\n"
            "except ImportError:  # a checkout from before the viewer's package was renamed\n"
            "    from gpubudget.html import model_from_trace, write_page\n"
            "model = model_from_trace(sys.argv[1])\n"
            "start = time.perf_counter()\n"
            "write_page(model, sys.argv[2])\n"
            "print(time.perf_counter() - start)\n")
    # -S: no .pth file runs, so an editable install of this checkout (its finder comes
    # before the path) cannot answer for the other; its dependencies stay on the path
    path = os.pathsep.join([os.path.abspath(checkout), sysconfig.get_paths()["purelib"],
                            sysconfig.get_paths()["platlib"]])
    env = dict(os.environ, PYTHONPATH=path, GPUBUDGET_PURE="1")
    done = subprocess.run([sys.executable, "-S", "-c", code, trace, page], env=env, check=True,
                          capture_output=True, text=True, cwd=os.path.abspath(checkout))
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keep", metavar="DIR", help="write the files here, and keep them")
    parser.add_argument("--trace", metavar="FILE", help="a trace recorded before, to measure")
    parser.add_argument("--against", metavar="CHECKOUT",
                        help="another gpubudget checkout whose viewer to measure side by side")
    args = parser.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="gpubudget-viewer-")
    os.makedirs(folder, exist_ok=True)
    trace = args.trace or os.path.join(folder, "churn.jsonl")
    recorded = math.nan
    if not args.trace:
        if os.path.exists(trace):
            os.unlink(trace)
        _, recorded = _timed(lambda: record(trace, args.events))
    model, modelled = _timed(lambda: model_from_trace(trace))
    page = os.path.join(folder, "churn.html")
    _, paged = _timed(lambda: write_page(model, page))
    exported = os.path.join(folder, "churn.perfetto.json")
    _, perfettoed = _timed(lambda: write_perfetto(trace, exported))
    rows = [
        ("events recorded", f"{args.events:,} ({format_size(os.path.getsize(trace))} trace)"
         if not args.trace else f"{trace} ({format_size(os.path.getsize(trace))})"),
        ("points, blocks, denials", f"{len(model.point_t):,}, {len(model.block_budget):,}, "
                                    f"{len(model.denials):,}"),
        *([("record the trace", f"{recorded:.1f} s")] if not args.trace else []),
        ("model_from_trace", f"{modelled:.1f} s"),
        ("write the page", f"{paged:.1f} s, {format_size(os.path.getsize(page))}"),
        ("export --perfetto (reads the trace again)",
         f"{perfettoed:.1f} s, {format_size(os.path.getsize(exported))}"),
    ]
    against = None
    if args.against:
        against = os.path.join(folder, "churn-against.html")
        seconds = other_page(args.against, trace, against)
        rows.append(("write the page, --against's viewer",
                     f"{seconds:.1f} s, {format_size(os.path.getsize(against))}"))
    rows += browser_rows(page, against)
    rows += json_rows()
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
