"""The viewer in a real headless browser (Chromium, driven by Selenium): it loads without
console errors, opens on the first root's peak with every view filled, draws the lanes and
the denial, and a click or a hover shows the right blocks. Every wait is for a state only
the page's own handler can produce (the page marks itself ready; clicks and hovers are
handled before Selenium's call returns). Screenshots go to the directory named by
``GPUBUDGET_VIEWER_SHOTS`` (kept as artifacts), else to each test's temporary directory.
Skipped, saying why, where no Chromium, chromedriver or Selenium can be had (CI installs
them: see .ci/run). :mod:`tests.test_viewer_views` covers the other views."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget.viewer import model_from_trace, write_page

from tests.helpers import subprocess_env

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
SHOTS_ENV = "GPUBUDGET_VIEWER_SHOTS"
V = "window.gpubudgetViewer"


def chromium() -> str:
    binary = next((found for name in _BROWSERS if (found := shutil.which(name))), None)
    if binary is None or shutil.which("chromedriver") is None:
        pytest.skip("no Chromium and chromedriver here (Debian: apt-get install chromium "
                    "chromium-driver)")
    return binary


def start_browser(*arguments: str) -> Any:
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1600", *arguments):
        options.add_argument(argument)
    options.binary_location = chromium()
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))),
                            options=options)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: Any, tmp_path: Path, name: str) -> Path:
    """Save a screenshot as ``name``.png in ``$GPUBUDGET_VIEWER_SHOTS`` (else ``tmp_path``)."""
    folder = Path(os.environ.get(SHOTS_ENV) or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    assert driver.save_screenshot(str(path)), path
    return path


def demo_trace(folder: Path) -> Path:
    """The demo's trace (python -m gpubudget demo with GPUBUDGET_TRACE), in host memory."""
    path = folder / "demo.jsonl"
    env = subprocess_env(GPUBUDGET_TRACE=str(path))
    subprocess.run([sys.executable, "-m", "gpubudget", "demo", "--no-plot", "--backend", "host"],
                   check=True, capture_output=True, env=env, timeout=120)
    return path


def load(driver: Any, page: Path) -> None:
    """Open ``page`` and wait until its script says it has drawn (or failed)."""
    driver.get_log("browser")  # what earlier pages logged
    driver.get(page.as_uri())
    WebDriverWait(driver, 120).until(
        lambda d: d.execute_script("return document.body.dataset.ready || ''"),
        "the page never became ready")
    assert driver.execute_script("return document.body.dataset.ready") == "1", (
        driver.execute_script(f"return {V}.errors"))


def js(driver: Any, expression: str, *args: Any) -> Any:
    return driver.execute_script(f"return {expression}", *args)


def console_problems(driver: Any) -> list[str]:
    """What the page logged as errors or warnings (not Chromium's hint about the tests' own
    pixel reads: the page reads no pixels)."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] in ("SEVERE", "WARNING")
            and "willReadFrequently" not in entry["message"]]


def pixel(driver: Any, x: float, y: float, canvas: str = "lanes") -> list[int]:
    """The canvas's colour at CSS pixel (x, y)."""
    return list(driver.execute_script(
        "const c = document.getElementById(arguments[2]), r = window.devicePixelRatio || 1;"
        "return Array.from(c.getContext('2d').getImageData(Math.round(arguments[0] * r),"
        " Math.round(arguments[1] * r), 1, 1).data);", x, y, canvas))


def rgb(hex_colour: str) -> list[int]:
    return [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]


def at_canvas(driver: Any, x: float, y: float, canvas: str = "lanes") -> Any:
    """Selenium's actions, at CSS pixel (x, y) of the canvas (offsets from its centre)."""
    element = driver.find_element(By.ID, canvas)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    size = element.size
    return ActionChains(driver).move_to_element_with_offset(
        element, int(x - size["width"] / 2), int(y - size["height"] / 2))


def click_canvas(driver: Any, x: float, y: float, canvas: str = "lanes") -> None:
    at_canvas(driver, x, y, canvas).click().perform()


def lane_top(driver: Any, budget: int) -> float:
    return float(js(driver, f"{V}.AXIS + {V}.laneRow.get(arguments[0]) * {V}.LANE", budget))


def test_the_demo_trace_loads_draws_and_answers_clicks(browser: Any, tmp_path: Path) -> None:
    trace = demo_trace(tmp_path)
    model = model_from_trace(trace)
    page = tmp_path / "demo.html"
    write_page(model, page)
    load(browser, page)
    assert console_problems(browser) == []
    assert js(browser, f"{V}.drawn.lanes") == 3 and js(browser, f"{V}.drawn.denials") == 1
    lane_names = js(browser, f"{V}.budgets.map(b => b.name)")
    assert lane_names == ["shared", "detector", "classifier"]
    tree = browser.find_element(By.ID, "tree").text
    assert "classifier" in tree and "1 denied" in tree
    assert not browser.find_element(By.ID, "overview").is_displayed()  # the script drew

    # Before any click: the moment of the first root's peak, and every view filled for it.
    shared = [u for b, u in zip(model.point_budget, model.point_used) if b == 0]
    peak_t = [t for t, b in zip(model.point_t, model.point_budget) if b == 0][
        shared.index(max(shared))]
    assert js(browser, f"{V}.state.moment") == peak_t and js(browser, f"{V}.state.lane") == 0
    live = [k for k in range(len(model.block_size)) if model.block_start[k] <= peak_t
            and not model.block_end[k] <= peak_t]
    assert sorted(js(browser, f"{V}.listed")) == live
    assert len(browser.find_elements(By.CSS_SELECTOR, "#blocks tbody tr")) == len(live)
    assert js(browser, f"{V}.flame.bytes") == sum(model.block_size[k] for k in live)
    assert "free of 4.00 GiB" in browser.find_element(By.ID, "address-title").text
    legend = browser.find_element(By.ID, "legend").text.split("\n")
    assert sorted(legend[:-1]) == sorted(model.tags) and legend[-1].startswith("leak: ")
    colour = browser.find_element(By.ID, "colour-by")  # colour by budget, then by tag again
    colour.find_element(By.CSS_SELECTOR, "option[value='budget']").click()
    assert browser.find_element(By.ID, "legend").text.split("\n")[:-1] == ["detector",
                                                                            "classifier"]
    assert js(browser, f"{V}.app.keys.mode") == "budget"
    colour.find_element(By.CSS_SELECTOR, "option[value='tag']").click()
    assert js(browser, f"{V}.app.keys.mode") == "tag"

    # The denial is drawn: red at its time, at the top of the classifier's lane.
    (t_denied, lane, *_), = model.denials
    assert model.budgets[lane].name == "classifier"
    x = js(browser, f"{V}.xOf(arguments[0])", t_denied)
    row = [pixel(browser, x + dx, lane_top(browser, 2) + 4) for dx in range(-4, 5)]
    assert sum(r > 180 and g < 90 and b < 90 for r, g, b, _ in row) >= 4  # the moment's line
    # (orange) may cross it
    shot(browser, tmp_path, "viewer-loaded")

    # A click on the detector's lane near the end: its live blocks then, largest first.
    detector = lane_names.index("detector")
    click_canvas(browser, js(browser, f"{V}.xOf(arguments[0])", model.end * 0.97),
                 lane_top(browser, 1) + 30)
    moment = js(browser, f"{V}.state.moment")  # where the click landed
    assert abs(moment - model.end * 0.97) < model.end * 0.01
    assert js(browser, f"{V}.state.lane") == detector
    expected = sorted((int(model.block_size[k]) for k in range(len(model.block_size))
                       if model.block_budget[k] == detector and model.block_start[k] <= moment
                       and not model.block_end[k] <= moment), reverse=True)
    listed = js(browser, f"{V}.listed")
    assert [int(model.block_size[k]) for k in listed] == expected and expected
    assert all(model.block_budget[k] == detector for k in listed)
    title = browser.find_element(By.ID, "blocks-title").text
    assert title.startswith(f"{len(expected)} blocks in detector live at")
    rows = browser.find_elements(By.CSS_SELECTOR, "#blocks tbody tr")
    assert rows[0].text.split()[:3] == ["1.17", "GiB", "detector/weights"]

    # A click on a block: its life (the detector's scope exited with its weights live).
    rows[0].click()
    life = browser.find_element(By.ID, "life").text
    assert "in detector, tag detector/weights" in life and "still live at the end" in life
    assert "allocated at" in life and "leaked: still live when the record ends" in life

    # Search by tag, at a moment in the life of one of the detector's activations.
    active = next(k for k in range(len(model.block_size)) if model.block_budget[k] == detector
                  and model.tags[model.block_tag[k]] == "detector/activations")
    click_canvas(browser, js(browser, f"{V}.xOf(arguments[0])",
                             (model.block_start[active] + model.block_end[active]) / 2),
                 lane_top(browser, 1) + 30)
    search = browser.find_element(By.ID, "search")
    search.send_keys("activations")
    WebDriverWait(browser, 120).until(  # the page's input handler has listed the blocks
        lambda d: d.execute_script(f"return {V}.state.query") == "activations",
        "the search never reached the page")
    listed = js(browser, f"{V}.listed")
    assert active in listed
    assert all(model.tags[model.block_tag[k]] == "detector/activations" for k in listed)
    shot(browser, tmp_path, "viewer-clicked")
    assert console_problems(browser) == []
    if os.environ.get("GPUBUDGET_SCREENSHOT"):  # docs/viewer.png, made with this test
        browser.set_window_size(1300, 1100)
        load(browser, page)  # as it opens
        browser.save_screenshot(os.environ["GPUBUDGET_SCREENSHOT"])
        browser.set_window_size(1400, 1600)


def test_zoomed_in_every_block_is_a_band_in_its_tags_colour(browser: Any,
                                                            tmp_path: Path) -> None:
    """Zoomed in on one step, each live block is its own band, stacked by colour then by
    allocation, in its tag's legend colour; above the used line, nothing."""
    model = model_from_trace(demo_trace(tmp_path))
    page = tmp_path / "zoom.html"
    write_page(model, page)
    load(browser, page)
    points = [(t, u) for t, b, u in zip(model.point_t, model.point_budget, model.point_used)
              if b == 1]
    (t0, used0), (t1, _) = points[3], points[4]
    browser.execute_script(f"{V}.state.v0 = arguments[0]; {V}.state.v1 = arguments[1];"
                           f"{V}.draw()", t0 - (t1 - t0) * 0.1, t1)
    assert js(browser, f"{V}.drawn.modes[1]") == "blocks"
    mid = (t0 + t1) / 2
    live = [k for k in range(len(model.block_size)) if model.block_budget[k] == 1
            and model.block_start[k] <= mid and not model.block_end[k] <= mid]
    assert sum(model.block_size[k] for k in live) == used0  # the detector's own blocks
    colours = js(browser, f"{V}.app.keys.legend.map(e => [e.label, e.rank])")
    palette = js(browser, "window.gpubudgetParts.PALETTE")
    colour_of = {label: rgb(palette[rank]) for label, rank in colours}
    order = sorted(live, key=lambda k: ([label for label, _ in colours].index(
        model.tags[model.block_tag[k]]), k))
    budget = model.budgets[1]
    height = js(browser, f"{V}.LANE") - 14
    scale = js(browser, "window.gpubudgetParts.laneScale(arguments[0])",
               {"limit": budget.limit, "peak": budget.peak})
    base = lane_top(browser, 1) + js(browser, f"{V}.LANE") - 4
    x = js(browser, f"{V}.xOf(arguments[0])", mid)
    below = 0.0
    for k in order:  # the middle of each band is its tag's colour
        middle = base - (below + model.block_size[k] / 2) / scale * height
        assert pixel(browser, x, middle)[:3] == colour_of[model.tags[model.block_tag[k]]], k
        below += model.block_size[k]
    level = base - used0 / scale * height
    # blank above: nothing, or the grid (light lines beneath; where a time tick falls on x
    # depends on the trace's own times), never a band (every colour of the palette is darker)
    above = pixel(browser, x, level - 4)
    assert above[3] == 0 or min(above[:3]) >= 225, above
    found = js(browser, f"{V}.laneHit(arguments[0], arguments[1])", x,
               base - model.block_size[order[0]] / 2 / scale * height)
    assert found["block"] == order[0]
    shot(browser, tmp_path, "viewer-zoomed-bands")


def test_a_reports_page_lists_its_live_blocks_with_their_stacks(browser: Any,
                                                                tmp_path: Path) -> None:
    from gpubudget import gpu_budget

    def load_weights(budget: Any) -> int:
        return int(budget.allocate(3 * 2**20, tag="weights"))

    with gpu_budget("64MiB", name="server", backend="host", track_stacks=True) as server:
        with gpu_budget("16MiB", name="model") as model:
            weights = load_weights(model)
            assert model.allocate(32 * 2**20, tag="activations") is None
            scratch = model.allocate(2**20, tag="scratch")
            assert scratch is not None and model.free(scratch)
        page = tmp_path / "report.html"
        server.report().to_html(page)
        assert model.free(weights)
    load(browser, page)
    assert console_problems(browser) == []
    assert js(browser, f"{V}.drawn.lanes") == 2 and js(browser, f"{V}.drawn.denials") == 1
    assert "from a report" in browser.find_element(By.ID, "note").text
    browser.find_element(By.CSS_SELECTOR, "#tree [data-budget='1']").click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#blocks tbody tr")  # live at the peak:
    assert [row.text.split()[2] for row in rows] == ["weights", "scratch"]  # from the timeline
    assert "load_weights" in rows[0].text and "0x" in rows[0].text  # the report's live block
    assert "—" in rows[1].text  # a block freed before the report: no address kept
    rows[0].click()
    life = browser.find_element(By.ID, "life").text
    assert "allocated at" in life and "still live at the end" in life
    assert "in load_weights" in life and "test_viewer_browser.py" in life
    assert "leaked" in life  # its scope had exited when the report was taken
    shot(browser, tmp_path, "report-page")


def test_many_budgets_a_tree_pick_brings_its_lane_and_zooms_to_its_life(
        browser: Any, tmp_path: Path) -> None:
    from gpubudget import gpu_budget
    from gpubudget.tracefile import writer_for

    trace = tmp_path / "requests.jsonl"
    for index in range(150):  # 300 budgets: more than the lanes drawn at once
        with gpu_budget("1MiB", name=f"request-{index}", trace=str(trace)):
            with gpu_budget("64KiB", name="model") as model:
                block = model.allocate(1000 * (index + 1) % 60000 + 1, tag="t")
                assert block is not None and model.free(block)
    writer_for(trace).flush()
    model_ = model_from_trace(trace)
    page = tmp_path / "requests.html"
    write_page(model_, page)
    load(browser, page)
    assert js(browser, f"{V}.drawn.lanes") == 200
    last = len(model_.budgets) - 2  # the last root
    assert model_.budgets[last].name == "request-149"
    assert js(browser, f"{V}.laneRow.get({last})") is None
    row = browser.find_element(By.CSS_SELECTOR, f"#tree [data-budget='{last}']")
    browser.execute_script("arguments[0].scrollIntoView()", row)
    row.click()
    assert js(browser, f"{V}.drawnLanes[0]") == last
    assert js(browser, f"{V}.addresses.root") == last  # the address view follows the pick
    ActionChains(browser).double_click(row).perform()
    v0, v1 = js(browser, f"[{V}.state.v0, {V}.state.v1]")
    entered, exited = model_.budgets[last].entered, model_.budgets[last].exited
    assert exited is not None and v0 <= entered < exited <= v1
    assert v1 - v0 < (exited - entered) * 1.2 + 2e-6  # its life fills the view
    assert console_problems(browser) == []


def test_a_budgets_driver_door_bytes_and_refusals_show_in_the_tree(browser: Any,
                                                                   tmp_path: Path) -> None:
    import dataclasses

    from gpubudget import gpu_budget
    from gpubudget.report import DoorLibrary, DoorUsage

    with gpu_budget("64MiB", name="server", backend="host") as server:
        with gpu_budget("16MiB", name="model") as model:
            block = model.allocate(2**20, tag="weights")
        report = server.report()
        assert block is not None and model.free(block)
    door = DoorUsage(3 << 20, 3 << 20, 2, 1, 8 << 20, "libcublasLt.so.13",
                     (DoorLibrary("libcublasLt.so.13", 2 << 20, 1),
                      DoorLibrary("libnccl.so.2", 1 << 20, 0)), False)
    report = dataclasses.replace(report, children=(dataclasses.replace(
        report.children[0], driver_door=door),))  # as a report under `gpubudget run` has it
    page = tmp_path / "door.html"
    report.to_html(page)
    load(browser, page)
    assert console_problems(browser) == []
    server_row = browser.find_element(By.CSS_SELECTOR, "#tree [data-budget='0']").text
    model_row = browser.find_element(By.CSS_SELECTOR, "#tree [data-budget='1']").text
    assert "driver door" not in server_row  # no door numbers: no line
    assert ("driver door 3.00 MiB (libcublasLt.so.13 2.00 MiB, libnccl.so.2 1.00 MiB)"
            in model_row)
    assert "1 refused at the door, the last 8.00 MiB asked by libcublasLt.so.13" in model_row
    shot(browser, tmp_path, "door-tree")
