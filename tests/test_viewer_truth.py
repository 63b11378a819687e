"""The viewer says one thing at a time, in headless Chromium: what the tooltip counts at a
moment is what a click there lists; a double-click on a budget zooms to where its memory
lived, not to its ``with`` block alone; the header's search finds budgets, tags and
addresses and shows each where the eye is (the lane, the tag's blocks coloured, the block's
life). Leaks by report()'s rule: :mod:`tests.test_viewer_views`. Screenshots as
:mod:`tests.test_viewer_browser` keeps them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget.viewer import ViewBudget, ViewModel, model_from_trace, write_page

from tests.test_viewer_browser import (
    V,
    at_canvas,
    click_canvas,
    console_problems,
    demo_trace,
    js,
    lane_top,
    load,
    pixel,
    rgb,
    shot,
    start_browser,
)

from selenium.webdriver.common.by import By  # noqa: E402  (test_viewer_browser skips first)
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


def spike_model() -> ViewModel:
    """One budget over one second: a 100 MiB block throughout, small blocks coming and
    going, and a 500 MiB block that lives 0.4 µs at 0.5 s (a spike inside one pixel)."""
    model = ViewModel("spike", "trace")
    model.budgets.append(ViewBudget("pool", None, 2**30, 0, 0.0))
    used = 0

    def step(t: float, delta: int) -> int:
        nonlocal used
        at = model.tick(t)
        used += delta
        model.point(at, 0, used, used)
        return at

    at = model.tick(0.0)
    model.point(at, 0, 0, 0)
    model.block(0, 100 * MiB, model.tag_id("base"), 0x10000000, step(0.0, 100 * MiB), -1)
    for index in range(200):  # small blocks, none near 0.5 s but the spike
        t = 0.001 + index * 0.004
        if 0.49 < t < 0.51:
            if t < 0.495:
                spike = model.block(0, 500 * MiB, model.tag_id("spike"), 0x40000000,
                                    step(0.5, 500 * MiB), -1)
                model.end_block(spike, step(0.5000004, -500 * MiB))
            continue
        block = model.block(0, MiB, model.tag_id("small"), 0x20000000 + index * MiB,
                            step(t, MiB), -1)
        model.end_block(block, step(t + 0.002, -MiB))
    step(1.0, 0)
    model.end = 1.0
    model.infer_regions({})
    return model


def test_the_tooltip_and_a_click_say_one_number_for_one_moment(browser: Any,
                                                               tmp_path: Path) -> None:
    """A pixel column shows its highest moment (the spike); hovering there counts the blocks
    live at that moment, and a click there chooses that moment: the Blocks table, its title
    and the flame graph list the same blocks and bytes as the tooltip."""
    page = tmp_path / "spike.html"
    write_page(spike_model(), page)
    load(browser, page)
    width = js(browser, f"{V}.app.plotWidth()")
    x = js(browser, f"{V}.GUTTER") + 100.5
    y = lane_top(browser, 0) + js(browser, f"{V}.LANE") - 10  # low: the base block's band
    at_canvas(browser, x, y).perform()  # where the pointer lands, to the pixel
    column = int(js(browser, f"{V}.hovered.x") - js(browser, f"{V}.GUTTER"))
    span = 1.0  # the spike in the middle of that column
    v0 = 0.5000002 - (column + 0.5) * span / width
    browser.execute_script(f"{V}.state.v0 = arguments[0]; {V}.state.v1 = arguments[1];"
                           f"{V}.draw()", v0, v0 + span)
    at_canvas(browser, x + 40, y).perform()
    at_canvas(browser, x, y).perform()
    hovered = js(browser, f"{V}.hovered")
    tip = js(browser, f"{V}.tip")
    assert hovered["count"] == 2 and hovered["bytes"] == 600 * MiB, tip  # the spike is seen
    assert "600.00 MiB live in 2 blocks" in tip
    click_canvas(browser, x, y)
    assert js(browser, f"{V}.state.moment") == hovered["t"]
    listed = js(browser, f"{V}.listed")
    assert len(listed) == hovered["count"]
    title = browser.find_element(By.ID, "blocks-title").text
    assert title.startswith("2 blocks in pool live at") and title.endswith(", 600.00 MiB")
    assert js(browser, f"{V}.flame.bytes") == hovered["bytes"]
    moment = re.search(r" at (.+?): ", tip)
    assert moment is not None and f"live at {moment.group(1)}," in title  # the same time
    assert console_problems(browser) == []
    shot(browser, tmp_path, "one-number")


def test_double_clicking_a_budget_zooms_to_where_its_memory_lived(browser: Any,
                                                                  tmp_path: Path) -> None:
    """The detector's scope lasts a few milliseconds; its weights serve until the end of
    the record: a double-click on it in the tree shows all of that, not its scope alone."""
    trace = demo_trace(tmp_path)
    model = model_from_trace(trace)
    page = tmp_path / "demo.html"
    write_page(model, page)
    load(browser, page)
    detector = [b.name for b in model.budgets].index("detector")
    entered, exited = model.budgets[detector].entered, model.budgets[detector].exited
    assert exited is not None
    last = max(model.end if model.block_to[k] < 0 else model.block_end[k]
               for k in range(len(model.block_size)) if model.block_budget[k] == detector)
    assert last > exited + (exited - entered)  # it lives well after its scope
    row = browser.find_element(By.CSS_SELECTOR, f"#tree [data-budget='{detector}']")
    ActionChains(browser).double_click(row).perform()
    v0, v1 = js(browser, f"[{V}.state.v0, {V}.state.v1]")
    assert v0 <= entered and v1 >= last
    assert v1 - v0 <= (last - entered) * 1.15 + 2e-6  # and little more
    shot(browser, tmp_path, "zoom-to-memory")


def search_for(browser: Any, text: str) -> list[dict[str, Any]]:
    box = browser.find_element(By.ID, "search")
    box.clear()
    box.send_keys(text)
    WebDriverWait(browser, 120).until(  # the page's input handler has answered
        lambda d: d.execute_script(f"return {V}.state.query") == text,
        "the search never reached the page")
    found: list[dict[str, Any]] = js(browser, f"{V}.matches")
    shown = browser.find_elements(By.CSS_SELECTOR, "#search-results div")
    assert len(shown) == len(found) and all(row.is_displayed() for row in shown)
    return found


def test_the_search_finds_budgets_tags_and_addresses_where_the_user_looks(
        browser: Any, tmp_path: Path) -> None:
    trace = demo_trace(tmp_path)
    model = model_from_trace(trace)
    page = tmp_path / "demo.html"
    write_page(model, page)
    load(browser, page)
    names = [b.name for b in model.budgets]

    # a budget: Enter picks it (its lane, its row in the tree, the address view's root)
    found = search_for(browser, "classif")
    assert found[0]["kind"] == "budget" and names[found[0]["index"]] == "classifier"
    browser.find_element(By.ID, "search").send_keys(Keys.ENTER)
    assert js(browser, f"{V}.state.lane") == names.index("classifier")
    assert "selected" in browser.find_element(
        By.CSS_SELECTOR, f"#tree [data-budget='{names.index('classifier')}']").get_attribute(
        "class")

    # a tag: its blocks in the first colour on the lanes, every other block grey
    found = search_for(browser, "weights")
    tags = [m for m in found if m["kind"] == "tag"]
    assert sorted(model.tags[m["index"]] for m in tags) == ["classifier/weights",
                                                            "detector/weights"]
    choice = next(i for i, m in enumerate(found) if m["kind"] == "tag"
                  and model.tags[m["index"]] == "classifier/weights")
    browser.find_elements(By.CSS_SELECTOR, "#search-results div")[choice].click()
    assert js(browser, f"{V}.app.keys.mode") == "focus"
    assert browser.find_element(By.ID, "legend").text.split("\n")[:2] == [
        "classifier/weights", "the other blocks"]
    palette = js(browser, "window.gpubudgetParts.PALETTE")
    end = model.end
    x = js(browser, f"{V}.xOf(arguments[0])", end * 0.98)
    weights = next(k for k in range(len(model.block_size))
                   if model.tags[model.block_tag[k]] == "classifier/weights")
    detector_weights = next(k for k in range(len(model.block_size))
                            if model.tags[model.block_tag[k]] == "detector/weights")
    for k, colour in ((weights, palette[0]), (detector_weights, palette[12])):
        lane = model.block_budget[k]
        budget = model.budgets[lane]
        scale = js(browser, "window.gpubudgetParts.laneScale(arguments[0])",
                   {"limit": budget.limit, "peak": budget.peak})
        base = lane_top(browser, lane) + js(browser, f"{V}.LANE") - 4
        height = js(browser, f"{V}.LANE") - 14
        # the lane's bands: the chosen tag first (rank 0), then the grey ones
        below = 0.0 if colour == palette[0] else sum(
            model.block_size[j] for j in js(browser, f"{V}.laneHit(arguments[0], arguments[1])",
                                            x, base - 1)["live"]
            if model.tags[model.block_tag[j]] == "classifier/weights")
        middle = base - (below + model.block_size[k] / 2) / scale * height
        assert pixel(browser, x, middle)[:3] == rgb(colour), k
    shot(browser, tmp_path, "search-tag")

    # an address inside a block: the block, its life, a moment it was live
    k = detector_weights
    address = int(model.block_address[k]) + 0x1234
    found = search_for(browser, hex(address))
    assert found[0]["kind"] == "block" and found[0]["index"] == k
    browser.find_element(By.ID, "search").send_keys(Keys.ENTER)
    assert js(browser, f"{V}.state.block") == k and js(browser, f"{V}.life") == k
    moment = js(browser, f"{V}.state.moment")
    assert model.block_start[k] <= moment and not model.block_end[k] <= moment
    assert js(browser, f"{V}.state.lane") == model.block_budget[k]
    life = browser.find_element(By.ID, "life").text
    assert hex(int(model.block_address[k])) in life and "detector/weights" in life
    assert k in js(browser, f"{V}.listed")  # the table: the blocks holding that address
    assert search_for(browser, "0xdeadbeef0") == []  # nowhere: nothing found, nothing shown
    assert not browser.find_element(By.ID, "search-results").is_displayed()
    shot(browser, tmp_path, "search-address")
    assert console_problems(browser) == []
