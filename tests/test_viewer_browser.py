"""The viewer in a real headless browser (Chromium, driven by Selenium): it loads without
console errors, draws the lanes and the denial, and a click shows the right blocks.
Screenshots are kept in the test's temporary directory. Skipped, saying why, where no
Chromium, chromedriver or Selenium can be had (CI installs them: see .ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget.html import model_from_trace, write_page

from tests.helpers import subprocess_env

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    binary = next((found for name in _BROWSERS if (found := shutil.which(name))), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.skip("no Chromium and chromedriver here (Debian: apt-get install chromium "
                    "chromium-driver)")
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.binary_location = binary
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def demo_trace(folder: Path) -> Path:
    """The demo's trace (python -m gpubudget demo with GPUBUDGET_TRACE), in host memory."""
    path = folder / "demo.jsonl"
    env = subprocess_env(GPUBUDGET_TRACE=str(path))
    subprocess.run([sys.executable, "-m", "gpubudget", "demo", "--no-plot", "--backend", "host"],
                   check=True, capture_output=True, env=env, timeout=120)
    return path


def load(driver: Any, page: Path) -> None:
    driver.get_log("browser")  # what earlier pages logged
    driver.get(page.as_uri())
    deadline = time.monotonic() + 60
    while not driver.execute_script("return document.body.dataset.ready || ''"):
        assert time.monotonic() < deadline, "the page never became ready"
        time.sleep(0.05)
    assert driver.execute_script("return document.body.dataset.ready") == "1", (
        driver.execute_script("return window.gpubudgetViewer.errors"))


def console_problems(driver: Any) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] in ("SEVERE", "WARNING")]


def pixel(driver: Any, x: float, y: float) -> list[int]:
    """The canvas's colour at CSS pixel (x, y)."""
    return list(driver.execute_script(
        "const c = document.getElementById('lanes'), r = window.devicePixelRatio || 1;"
        "return Array.from(c.getContext('2d').getImageData(Math.round(arguments[0] * r),"
        " Math.round(arguments[1] * r), 1, 1).data);", x, y))


def click_canvas(driver: Any, x: float, y: float) -> None:
    canvas = driver.find_element(By.ID, "lanes")
    size = canvas.size
    ActionChains(driver).move_to_element_with_offset(
        canvas, int(x - size["width"] / 2), int(y - size["height"] / 2)).click().perform()


def test_the_demo_trace_loads_draws_and_answers_clicks(browser: Any, tmp_path: Path) -> None:
    trace = demo_trace(tmp_path)
    model = model_from_trace(trace)
    page = tmp_path / "demo.html"
    write_page(model, page)
    load(browser, page)
    assert console_problems(browser) == []
    viewer = "window.gpubudgetViewer"
    assert browser.execute_script(f"return {viewer}.drawn") == {"lanes": 3, "denials": 1}
    lane_names = browser.execute_script(f"return {viewer}.budgets.map(b => b.name)")
    assert lane_names == ["shared", "detector", "classifier"]
    tree = browser.find_element(By.ID, "tree").text
    assert "classifier" in tree and "1 denied" in tree

    # The denial is drawn: red at its time, at the top of the classifier's lane.
    (t_denied, lane, *_), = model.denials
    assert model.budgets[lane].name == "classifier"
    top = browser.execute_script(f"return {viewer}.AXIS + {viewer}.laneRow.get(2) * {viewer}.LANE")
    x = browser.execute_script(f"return {viewer}.xOf(arguments[0])", t_denied)
    red, green, blue, _ = pixel(browser, x, top + 5)
    assert red > 180 and green < 90 and blue < 90
    browser.save_screenshot(str(tmp_path / "viewer-loaded.png"))

    # A click on the detector's lane near the end: its live blocks then, largest first.
    detector = [b.name for b in model.budgets].index("detector")
    row_top = browser.execute_script(f"return {viewer}.AXIS + {viewer}.laneRow.get(1) * {viewer}.LANE")
    click_canvas(browser, browser.execute_script(f"return {viewer}.xOf(arguments[0])",
                                                 model.end * 0.97), row_top + 30)
    moment = browser.execute_script(f"return {viewer}.state.moment")  # where the click landed
    assert abs(moment - model.end * 0.97) < model.end * 0.01
    assert browser.execute_script(f"return {viewer}.state.lane") == detector
    expected = sorted((int(model.block_size[k]) for k in range(len(model.block_size))
                       if model.block_budget[k] == detector and model.block_start[k] <= moment
                       and not model.block_end[k] <= moment), reverse=True)
    listed = browser.execute_script(f"return {viewer}.listed")
    assert [int(model.block_size[k]) for k in listed] == expected and expected
    assert all(model.block_budget[k] == detector for k in listed)
    title = browser.find_element(By.ID, "blocks-title").text
    assert title.startswith(f"{len(expected)} blocks in detector live at")
    rows = browser.find_elements(By.CSS_SELECTOR, "#blocks tbody tr")
    assert rows[0].text.split()[:3] == ["1.17", "GiB", "detector/weights"]

    # A click on a block: its life.
    rows[0].click()
    life = browser.find_element(By.ID, "life").text
    assert "in detector, tag detector/weights" in life and "still live at the end" in life
    assert "allocated at" in life

    # Search by tag.
    search = browser.find_element(By.ID, "search")
    search.send_keys("activations")
    listed = browser.execute_script(f"return {viewer}.listed")
    assert listed and all(model.tags[model.block_tag[k]].endswith("activations") for k in listed)
    browser.save_screenshot(str(tmp_path / "viewer-clicked.png"))
    assert console_problems(browser) == []
    if os.environ.get("GPUBUDGET_SCREENSHOT"):  # docs/viewer.png, made with this test
        search.clear()
        browser.execute_script("document.getElementById('search').dispatchEvent(new Event('input'))")
        browser.set_window_size(1300, 600)
        browser.save_screenshot(os.environ["GPUBUDGET_SCREENSHOT"])
        browser.set_window_size(1400, 1000)


def test_zoom_is_exact_when_close(browser: Any, tmp_path: Path) -> None:
    """Zoomed in on one step, the lane draws the exact values of the events there."""
    model = model_from_trace(demo_trace(tmp_path))
    page = tmp_path / "zoom.html"
    write_page(model, page)
    load(browser, page)
    viewer = "window.gpubudgetViewer"
    points = [(t, u) for t, b, u in zip(model.point_t, model.point_budget, model.point_used)
              if b == 1]
    (t0, used0), (t1, _) = points[3], points[4]
    browser.execute_script(f"{viewer}.state.v0 = arguments[0]; {viewer}.state.v1 = arguments[1];"
                           f"{viewer}.draw()", t0 - (t1 - t0) * 0.1, t1)
    top = browser.execute_script(f"return {viewer}.AXIS + {viewer}.LANE")
    budget = model.budgets[1]
    scale = max(budget.limit, budget.peak)
    height = browser.execute_script(f"return {viewer}.LANE") - 14
    x = browser.execute_script(f"return {viewer}.xOf(arguments[0])", (t0 + t1) / 2)
    base = top + browser.execute_script(f"return {viewer}.LANE") - 4
    level = base - used0 / scale * height
    assert pixel(browser, x, level + 2)[2] > 150  # blue just under the level
    assert pixel(browser, x, level - 3)[:3] in ([255, 255, 255], [0, 0, 0])  # blank above


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
    viewer = "window.gpubudgetViewer"
    assert browser.execute_script(f"return {viewer}.drawn") == {"lanes": 2, "denials": 1}
    assert "from a report" in browser.find_element(By.ID, "note").text
    browser.find_element(By.CSS_SELECTOR, "#tree [data-budget='1']").click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#blocks tbody tr")
    assert len(rows) == 1 and "weights" in rows[0].text and "load_weights" in rows[0].text
    rows[0].click()
    life = browser.find_element(By.ID, "life").text
    assert "allocation time not kept" in life and "still live at the end" in life
    assert "in load_weights" in life and "test_viewer_browser.py" in life
    browser.save_screenshot(str(tmp_path / "report-page.png"))


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
    viewer = "window.gpubudgetViewer"
    assert browser.execute_script(f"return {viewer}.drawn.lanes") == 200
    last = len(model_.budgets) - 2  # the last root
    assert model_.budgets[last].name == "request-149"
    assert browser.execute_script(f"return {viewer}.laneRow.get({last})") is None
    row = browser.find_element(By.CSS_SELECTOR, f"#tree [data-budget='{last}']")
    browser.execute_script("arguments[0].scrollIntoView()", row)
    row.click()
    assert browser.execute_script(f"return {viewer}.drawnLanes[0]") == last
    ActionChains(browser).double_click(row).perform()
    v0, v1 = browser.execute_script(f"return [{viewer}.state.v0, {viewer}.state.v1]")
    entered, exited = model_.budgets[last].entered, model_.budgets[last].exited
    assert exited is not None and v0 <= entered < exited <= v1
    assert v1 - v0 < (exited - entered) * 1.2 + 2e-6  # its life fills the view
    assert console_problems(browser) == []
