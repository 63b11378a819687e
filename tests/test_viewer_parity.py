"""The views a user of PyTorch's memory_viz looks for, in headless Chromium: the event list
(step through the allocator's events, each with its block's stack), requested against
rounded sizes (the bytes lost to rounding), streams, a minimap of the whole run, a flame
graph by segment, and the old list-of-segments snapshot pickles. Screenshots as
:mod:`tests.test_viewer_browser` keeps them."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget.cli import main
from gpubudget.tracefile import writer_for
from gpubudget.viewer import model_from_trace, write_page
from gpubudget.viewer.torchsnap import model_from_torch_data, model_from_torch_snapshot

from tests.test_viewer_browser import (
    V,
    click_canvas,
    console_problems,
    js,
    load,
    pixel,
    shot,
    start_browser,
)
from tests.test_viewer_torchsnap import BASE, frames, snapshot_fixture

from selenium.webdriver.common.by import By  # noqa: E402  (test_viewer_browser skips first)
from selenium.webdriver.common.keys import Keys  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


def parity_snapshot() -> dict[str, Any]:
    """The snapshot of :mod:`tests.test_viewer_torchsnap`, its weights block asking for 1,000
    bytes less than its 3 MiB, its activations on stream 0xbeef, its pool's on stream 7."""
    data = copy.deepcopy(snapshot_fixture())
    data["segments"][0]["blocks"][0]["requested_size"] = 3 * MiB - 1000
    data["device_traces"][0][3]["stream"] = 0xBEEF
    data["segments"][1]["stream"] = 7
    return data


def snapshot_page(tmp_path: Path, data: object) -> Path:
    page = tmp_path / "snapshot.html"
    write_page(model_from_torch_data(data, title="snapshot.pickle"), page)
    return page


def open_tab(browser: Any, name: str) -> None:
    browser.find_element(By.CSS_SELECTOR, f".tabs button[data-tab='{name}']").click()


def test_the_event_list_steps_through_events_with_their_stacks(browser: Any,
                                                                tmp_path: Path) -> None:
    load(browser, snapshot_page(tmp_path, parity_snapshot()))
    open_tab(browser, "events")
    rows = browser.find_elements(By.CSS_SELECTOR, "#events tbody tr")
    # a free from before the record, the segment mapped, two allocations, a free, the oom
    assert [row.text.split()[3] for row in rows] == ["free", "segment", "alloc", "alloc",
                                                      "free", "denied"]
    rows[2].click()  # the weights' allocation: its moment, its life and stack
    events = js(browser, f"{V}.events")
    assert events["at"] == 2 and events["n"] == 6
    assert js(browser, f"{V}.state.moment") == pytest.approx(200e-6)
    life = browser.find_element(By.ID, "life").text
    assert "load_weights" in life and "tag weights" in life
    body = browser.find_element(By.TAG_NAME, "body")
    body.send_keys(Keys.ARROW_DOWN)  # the next event: the activations' allocation
    assert js(browser, f"{V}.events.at") == 3
    assert js(browser, f"{V}.state.moment") == pytest.approx(300e-6)
    life = browser.find_element(By.ID, "life").text
    assert "train_step" in life and "stream 0xbeef" in life
    assert "now" in browser.find_element(By.CSS_SELECTOR, "#events tr[data-event='3']"
                                         ).get_attribute("class")
    body.send_keys("j")
    body.send_keys("j")  # the out-of-memory: the moment of the denial
    assert js(browser, f"{V}.events.at") == 5
    assert js(browser, f"{V}.state.moment") == pytest.approx(600e-6)
    body.send_keys("k")
    assert js(browser, f"{V}.events.at") == 4
    assert console_problems(browser) == []
    shot(browser, tmp_path, "events")


def test_requested_against_rounded_sizes_say_what_rounding_lost(browser: Any,
                                                                tmp_path: Path) -> None:
    """A trace records what was asked and what was charged: 1,000 bytes asked, 1,024
    charged (aligned to 256); a snapshot, its blocks' ``requested_size``."""
    trace = tmp_path / "round.jsonl"
    with gpu_budget("1MiB", name="pool", backend="host", trace=str(trace)) as pool:
        asked = [pool.allocate(1000, tag="odd"), pool.allocate(4096, tag="even")]
        assert all(block is not None for block in asked)
    writer_for(trace).flush()
    page = tmp_path / "round.html"
    write_page(model_from_trace(trace), page)
    load(browser, page)
    browser.execute_script(f"{V}.select({V}.end, 0)")
    title = browser.find_element(By.ID, "blocks-title").text
    assert "(24 B of it lost to rounding: 4.98 KiB requested)" in title, title
    rows = browser.find_elements(By.CSS_SELECTOR, "#blocks tbody tr")
    odd = next(row for row in rows if "odd" in row.text)
    assert "1000 B" in odd.text
    odd.click()
    life = browser.find_element(By.ID, "life").text
    assert "requested 1000 B, rounded to 1.00 KiB (1,024 B): 24 B lost to rounding" in life

    load(browser, snapshot_page(tmp_path, parity_snapshot()))
    browser.execute_script(f"{V}.select(0.00025, 0)")  # the weights live
    title = browser.find_element(By.ID, "blocks-title").text
    assert "1000 B of it lost to rounding" in title, title
    browser.execute_script(f"{V}.select(0.00035, 0)")  # and the activations, asked exactly
    title = browser.find_element(By.ID, "blocks-title").text
    assert "8.00 MiB (1000 B of it lost to rounding: 8.00 MiB requested)" in title, title
    shot(browser, tmp_path, "rounding")


def test_streams_colour_the_blocks_and_are_listed(browser: Any, tmp_path: Path) -> None:
    load(browser, snapshot_page(tmp_path, parity_snapshot()))
    assert js(browser, f"{V}.ds.streams") == ["stream 0", "stream 7", "stream 0xbeef"]
    colour = browser.find_element(By.ID, "colour-by")
    colour.find_element(By.CSS_SELECTOR, "option[value='stream']").click()
    assert js(browser, f"{V}.app.keys.mode") == "stream"
    legend = browser.find_element(By.ID, "legend").text.split("\n")
    assert {"stream 0", "stream 7", "stream 0xbeef"} <= set(legend)
    browser.execute_script(f"{V}.select(0.00035, 0)")  # the activations live, on 0xbeef
    rows = browser.find_elements(By.CSS_SELECTOR, "#blocks tbody tr")
    assert any("stream 0xbeef" in row.text and "4.00 MiB" in row.text for row in rows)
    assert console_problems(browser) == []
    shot(browser, tmp_path, "streams")


def test_the_minimap_shows_the_view_and_moves_it(browser: Any, tmp_path: Path) -> None:
    load(browser, snapshot_page(tmp_path, parity_snapshot()))
    end = js(browser, f"{V}.end")
    browser.execute_script(f"{V}.state.v0 = arguments[0]; {V}.state.v1 = arguments[1];"
                           f"{V}.draw()", end * 0.1, end * 0.2)
    mini = js(browser, f"{V}.minimap")
    gutter, width = js(browser, f"{V}.GUTTER"), js(browser, f"{V}.app.plotWidth()")
    assert mini["x0"] == pytest.approx(gutter + 0.1 * width, abs=1)
    assert mini["x1"] == pytest.approx(gutter + 0.2 * width, abs=1)
    edge = pixel(browser, mini["x0"], 18, "minimap")
    assert edge[0] > 200 and 100 < edge[1] < 180 and edge[2] < 80  # the window's orange
    click_canvas(browser, gutter + 0.7 * width, 18, "minimap")  # the view moves there
    v0, v1 = js(browser, f"[{V}.state.v0, {V}.state.v1]")
    assert v1 - v0 == pytest.approx(end * 0.1)
    assert (v0 + v1) / 2 == pytest.approx(0.7 * end, abs=end * 0.01)
    shot(browser, tmp_path, "minimap")


def test_the_flame_graph_by_segment_shows_where_memory_sits(browser: Any,
                                                            tmp_path: Path) -> None:
    load(browser, snapshot_page(tmp_path, parity_snapshot()))
    browser.execute_script(f"{V}.select(0.00035, 0)")  # 8 MiB and 2 MiB segments held
    browser.find_element(By.ID, "flame-by-segment").click()
    tree = js(browser, f"""(() => {{ const t = {V}.app.flame.tree;
        return [t.name, t.bytes, [...t.children.values()].map(s => [s.name, s.bytes,
          [...s.children.values()].map(c => [c.name, c.bytes])])]; }})()""")
    name, total, segments = tree
    assert name == "all segments" and total == 10 * MiB
    assert [s[1] for s in segments] == [8 * MiB, 2 * MiB]
    big = dict(segments[0][2])  # weights 3 MiB and activations 4 MiB live; 1 MiB free
    assert big["tag weights"] == 3 * MiB and big["(no tag)"] == 4 * MiB
    assert big["(free: held, no block)"] == MiB
    assert "Segments held" in browser.find_element(By.ID, "flame-title").text
    assert console_problems(browser) == []
    shot(browser, tmp_path, "flame-by-segment")


def old_snapshot() -> list[dict[str, Any]]:
    """A snapshot as PyTorch 1.x wrote it: the list of segments, each block's ``history``
    its allocations (``addr``, ``real_size``, ``frames``)."""
    stack = frames("main", "load_weights")
    return [{"device": 0, "address": BASE, "total_size": 4 * MiB, "allocated_size": 2 * MiB,
             "active_size": 2 * MiB, "stream": 0, "segment_type": "large", "blocks": [
                 {"size": 2 * MiB, "state": "active_allocated",
                  "history": [{"addr": BASE, "real_size": 2 * MiB - 512, "frames": stack}]},
                 {"size": 2 * MiB, "state": "inactive"}]}]


def test_an_old_list_of_segments_snapshot_opens(browser: Any, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = tmp_path / "old.pickle"
    snapshot.write_bytes(pickle.dumps(old_snapshot(), protocol=2))
    model = model_from_torch_snapshot(snapshot)
    assert [b.name for b in model.budgets] == ["cuda:0"]
    assert list(model.block_size) == [2 * MiB] and list(model.block_requested) == [2 * MiB - 512]
    assert [model.frames[f] for f in model.stacks[model.block_stack[0]]][-1].endswith(
        "in load_weights")
    assert any("old snapshot" in note for note in model.notes)
    page = tmp_path / "old.html"
    assert main(["view", str(snapshot), "-o", str(page)]) == 0
    assert "viewer written to" in capsys.readouterr().out
    load(browser, page)
    assert "old snapshot" in browser.find_element(By.ID, "note").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#blocks tbody tr")
    assert len(rows) == 1 and "load_weights" in rows[0].text and "0x7f0000000000" in rows[0].text
    assert console_problems(browser) == []
    shot(browser, tmp_path, "old-snapshot")
