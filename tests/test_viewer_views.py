"""Each view of the viewer in headless Chromium, on records made for it: the summary the
page shows without its script, the address view (fragmentation and the largest free
block), the flame graph, the comparison of two moments and of two records, the leaks and
the denials (each clickable), and a PyTorch memory snapshot. Screenshots as
:mod:`tests.test_viewer_browser` keeps them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget.cli import main
from gpubudget.viewer import model_from_trace, write_page
from gpubudget.viewer.torchsnap import model_from_torch_data
from gpubudget.tracefile import writer_for
from gpubudget.units import format_size

from tests.test_viewer_browser import (
    V,
    at_canvas,
    chromium,
    click_canvas,
    console_problems,
    js,
    lane_top,
    load,
    pixel,
    rgb,
    shot,
    start_browser,
)
from tests.test_viewer_torchsnap import BASE, snapshot_fixture

from selenium.webdriver.common.by import By  # noqa: E402  (test_viewer_browser skips first)

KiB, MiB = 2**10, 2**20


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


def load_weights(budget: Any, nbytes: int) -> int:
    block = budget.allocate(nbytes, tag="weights")
    assert block is not None
    return int(block)


def load_cache(budget: Any, nbytes: int) -> int:
    block = budget.allocate(nbytes, tag="cache")
    assert block is not None
    return int(block)


def fragmented(path: Path) -> Path:
    """Four 1 MiB blocks fill a 4 MiB model; the second and the fourth are freed; a 2 MiB
    request is then denied though 2 MiB are free (in two pieces)."""
    with gpu_budget("4MiB", name="pool", backend="host", trace=str(path),
                    track_stacks=True) as pool:
        with gpu_budget("4MiB", name="model") as model:
            a, b, c, d = (model.allocate(MiB, tag=tag) for tag in "abcd")
            assert a is not None and c is not None
            assert b is not None and model.free(b) and d is not None and model.free(d)
            assert model.allocate(2 * MiB, tag="big") is None
            assert model.free(a) and model.free(c)
        assert pool.used == 0
    writer_for(path).flush()
    return path


def page_of(path: Path, tmp_path: Path) -> Path:
    page = tmp_path / (path.stem + ".html")
    write_page(model_from_trace(path), page)
    return page


def test_the_summary_shows_before_and_without_the_script(tmp_path: Path) -> None:
    """Without its script (or before it has drawn) the page shows every budget's peak
    against its limit, its denials and leaks; a headless screenshot taken at load time,
    with no --virtual-time-budget, is not blank."""
    page = page_of(fragmented(tmp_path / "frag.jsonl"), tmp_path)
    driver = start_browser("--blink-settings=scriptEnabled=false")
    try:
        driver.get(page.as_uri())
        overview = driver.find_element(By.ID, "overview")
        assert overview.is_displayed()
        rows = [row.text for row in overview.find_elements(By.CSS_SELECTOR, "tbody tr")]
        assert rows[0].split()[:5] == ["pool", "4.00", "MiB", "4.00", "MiB"]
        assert rows[1].split()[0] == "model" and rows[1].split()[-2:] == ["1", "0"]  # denied
        assert "2 budgets, 4 blocks, 1 denial, 0 leaked blocks" in overview.text
        bar = driver.find_element(By.CSS_SELECTOR, "#overview .bar > div")
        assert bar.get_attribute("style") in ("width: 100%;", "width: 100.0%;")
        shot(driver, tmp_path, "summary-without-script")
    finally:
        driver.quit()
    png = tmp_path / "at-load.png"
    subprocess.run([chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
                    "--disable-dev-shm-usage", "--window-size=1200,800",
                    f"--screenshot={png}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    image = pytest.importorskip("PIL.Image").open(png).convert("RGB")
    top = image.crop((0, 40, 1200, 400)).tobytes()
    coloured = sum(1 for i in range(0, len(top), 3)  # the summary's bars, or the lanes
                   if max(top[i:i + 3]) - min(top[i:i + 3]) > 60)
    assert coloured > 500, coloured


def test_the_address_view_shows_fragmentation_and_the_largest_free_block(
        browser: Any, tmp_path: Path) -> None:
    trace = fragmented(tmp_path / "frag.jsonl")
    model = model_from_trace(trace)
    load(browser, page_of(trace, tmp_path))
    (t_denied, budget, nbytes, reason, _), = model.denials
    assert reason == "fragmented" and nbytes == 2 * MiB
    # the denials tab lists it; a click goes to its moment
    browser.find_element(By.ID, "denials-tab").click()
    assert browser.find_element(By.ID, "denials-tab").text == "Denials (1)"
    row = browser.find_element(By.CSS_SELECTOR, "#denials tbody tr")
    assert row.text.split()[-4:] == ["2.00", "MiB", "fragmented", "big"]
    row.click()
    assert js(browser, f"{V}.state.moment") == t_denied
    assert js(browser, f"{V}.state.lane") == budget
    free = js(browser, f"{V}.addresses.free")
    a, b, c, d = (int(model.block_address[k]) for k in range(4))
    assert (free["free"], free["pieces"], free["held"]) == (2 * MiB, 2, 4 * MiB)
    assert free["largest"] == {"addr": b, "size": MiB}  # the lower of two equal pieces
    title = browser.find_element(By.ID, "address-title").text
    assert "2.00 MiB free of 4.00 MiB in 2 pieces, the largest 1.00 MiB" in title
    assert "(50% of the free bytes are in smaller pieces)" in title
    # pixels: at the denial, c is in its colour, b's hole is the held grey, above d too
    legend = dict(js(browser, f"{V}.app.keys.legend.map(e => [e.label, e.rank])"))
    palette = js(browser, "window.gpubudgetParts.PALETTE")
    # between d's free (the last change before the denial) and the denial, in a view of
    # just that time: far from the moment's marks, whatever the clock did
    freed = model.block_end[3]
    browser.execute_script(f"{V}.state.v0 = arguments[0]; {V}.state.v1 = arguments[1]; "
                           f"{V}.draw()", freed, t_denied + (t_denied - freed) * 0.25)
    x = js(browser, f"{V}.xOf(arguments[0])", (freed + t_denied) / 2)

    def y(address: int) -> float:
        return float(js(browser, f"{V}.app.addressY(arguments[0])", address))

    assert pixel(browser, x, y(c + MiB // 2), "addresses")[:3] == rgb(palette[legend["c"]])
    assert pixel(browser, x, y(a + MiB // 2), "addresses")[:3] == rgb(palette[legend["a"]])
    held = [0xE4, 0xE7, 0xEC]
    assert pixel(browser, x, y(b + MiB // 2), "addresses")[:3] == held
    assert pixel(browser, x, y(d + MiB // 2), "addresses")[:3] == held
    # the blocks live then are a and c; hovering c says so
    assert sorted(js(browser, f"{V}.listed")) == [0, 2]
    at_canvas(browser, x, y(c + MiB // 2), "addresses").perform()
    tip = browser.find_element(By.ID, "tip")
    assert tip.is_displayed() and tip.text.startswith("1.00 MiB · tag c · model")
    assert "in fragmented" in tip.text  # its stack
    shot(browser, tmp_path, "addresses-fragmented")
    # a click on the address view picks the block there and its moment
    click_canvas(browser, x, y(a + MiB // 2), "addresses")
    assert js(browser, f"{V}.state.block") == 0
    assert "1.00 MiB at 0x" in browser.find_element(By.ID, "life").text
    assert console_problems(browser) == []


def test_the_address_view_draws_a_growable_roots_mapped_granules(
        browser: Any, tmp_path: Path) -> None:
    """A growable root's range is pale where only addressed, blue-grey where mapped: A's
    granules stay mapped after A is freed, and go at the trim; the title says what is
    mapped at the chosen moment."""
    from tests.test_trace_mappings import grown

    trace = tmp_path / "grown.jsonl"
    at = grown(trace)
    model = model_from_trace(trace)
    load(browser, page_of(trace, tmp_path))
    base = at["a"]
    freed = int(model.block_to[0])  # A's free
    trim = next(end for _, address, size, _, end in model.mappings
                if address == base + 2 * MiB)  # A's growth is unmapped by the trim
    placed = min(start for _, address, size, start, _ in model.mappings
                 if address == base and size == MiB)  # C's granule mapped
    legend = dict(js(browser, f"{V}.app.keys.legend.map(e => [e.label, e.rank])"))
    palette = js(browser, "window.gpubudgetParts.PALETTE")
    mapped, addressed = [0xBF, 0xD2, 0xE6], [0xF4, 0xF5, 0xF7]

    def look(first: int, last: int) -> tuple[Any, float]:
        """A view of the time from event ``first`` to ``last``, the moment late in it; the
        address view's answer, and an x early in it (away from the moment's mark)."""
        t0, t1 = model.times[first], model.times[last]
        browser.execute_script(f"{V}.state.v0 = arguments[0]; {V}.state.v1 = arguments[1]; "
                               f"{V}.state.moment = arguments[2]; {V}.draw()",
                               t0, t1, t0 + 0.8 * (t1 - t0))
        return js(browser, f"{V}.addresses"), js(browser, f"{V}.xOf(arguments[0])",
                                                  t0 + 0.3 * (t1 - t0))

    def y(address: int) -> float:
        return float(js(browser, f"{V}.app.addressY(arguments[0])", address))

    before, x = look(freed, trim)  # A freed, its granules still mapped
    assert before["free"]["mapped"] == 8 * MiB
    assert pixel(browser, x, y(base + 3 * MiB), "addresses")[:3] == mapped
    assert pixel(browser, x, y(base + 7 * MiB), "addresses")[:3] == rgb(palette[legend["b"]])
    assert pixel(browser, x, y(base + 12 * MiB), "addresses")[:3] == addressed
    assert "; 8.00 MiB mapped" in browser.find_element(By.ID, "address-title").text
    shot(browser, tmp_path, "addresses-growable-before-trim")
    after, x = look(trim, placed)  # trimmed: only B's granules
    assert after["free"]["mapped"] == 2 * MiB
    assert after["free"]["held"] == 16 * MiB  # the range's addresses, all of them
    assert pixel(browser, x, y(base + 3 * MiB), "addresses")[:3] == addressed
    assert pixel(browser, x, y(base + 7 * MiB), "addresses")[:3] == rgb(palette[legend["b"]])
    assert "; 2.00 MiB mapped" in browser.find_element(By.ID, "address-title").text
    shot(browser, tmp_path, "addresses-growable-after-trim")
    assert console_problems(browser) == []


def loading(path: Path, cache: int, extra: int = 0) -> Path:
    """A model that loads weights, then a cache (and more), each by a function of its own."""
    with gpu_budget("64MiB", name="server", backend="host", trace=str(path),
                    track_stacks=True) as server:
        with gpu_budget("32MiB", name="model") as model:
            weights = load_weights(model, 4 * MiB)
            kept = load_cache(model, cache)
            more = [model.allocate(extra, tag="extra")] if extra else []
            for block in (*more, kept, weights):
                assert block is not None and model.free(block)
        del server
    writer_for(path).flush()
    return path


def test_the_flame_graph_shows_live_bytes_by_stack_and_by_tag(browser: Any,
                                                              tmp_path: Path) -> None:
    trace = loading(tmp_path / "load.jsonl", cache=2 * MiB)
    model = model_from_trace(trace)
    load(browser, page_of(trace, tmp_path))
    assert js(browser, f"{V}.state.moment") == model.block_start[1]  # the peak: both live
    rows = js(browser, f"{V}.app.flame.rows.map(([n, d]) => [n.name, d, n.bytes])")
    names = {name.rsplit(" in ", 1)[-1]: nbytes for name, depth, nbytes in rows if depth}
    assert names["load_weights"] == 4 * MiB and names["load_cache"] == 2 * MiB
    test = "in test_the_flame_graph_shows_live_bytes_by_stack_and_by_tag"
    assert rows[0][0].endswith(test) and rows[0][1:] == [0, 6 * MiB]  # where the stacks
    # part (loading calls the two from two lines): every block shares the frames above it
    depth = js(browser, f"{V}.flame.depth")
    assert "Live bytes by stack in server at" in browser.find_element(By.ID, "flame-title").text
    # hovering the model's lane: the band under the mouse is a block, with its stack
    budget, height = model.budgets[1], js(browser, f"{V}.LANE")
    scale = js(browser, "window.gpubudgetParts.laneScale(arguments[0])",
               {"limit": budget.limit, "peak": budget.peak})
    base = lane_top(browser, 1) + height - 4
    t = (model.block_start[1] + model.block_end[1]) / 2  # both blocks live
    for below, tag, function in ((2 * MiB, "weights", "load_weights"),
                                 (5 * MiB, "cache", "load_cache")):  # weights first: more bytes
        at_canvas(browser, js(browser, f"{V}.xOf(arguments[0])", t),
                  base - below / scale * (height - 14)).perform()
        tip = browser.find_element(By.ID, "tip").text.split("\n")
        assert tip[0].startswith(f"{format_size(4 * MiB if tag == 'weights' else 2 * MiB)} · "
                                 f"tag {tag} · model")
        assert tip[3] == f"tag {tag}: {format_size(4 * MiB if tag == 'weights' else 2 * MiB)}" \
                         " in 1 blocks"
        assert tip[4].endswith(f"in {function}")  # the innermost frame first
    shot(browser, tmp_path, "lane-hover")
    # hover and click a frame: zoom into it
    flame_rows = js(browser, f"{V}.app.flame.rows.map(([n, d, x, w]) => [n.name, d, x, w])")
    name, row, x, width = next(r for r in flame_rows if r[0].endswith("in load_cache"))
    at_canvas(browser, x + width / 2, row * 18 + 9, "flame").perform()
    assert browser.find_element(By.ID, "tip").text.startswith(name)
    assert "2.00 MiB in 1 blocks (33.3%)" in browser.find_element(By.ID, "tip").text
    click_canvas(browser, x + width / 2, row * 18 + 9, "flame")
    assert js(browser, f"{V}.flameFocus")[-1] == name
    assert js(browser, f"{V}.flame.bytes") == 2 * MiB
    shot(browser, tmp_path, "flame-zoomed")
    click_canvas(browser, 20, 9, "flame")  # the top row: every frame, from the outermost
    assert js(browser, f"{V}.flameFocus") == [] and js(browser, f"{V}.flame.bytes") == 6 * MiB
    assert js(browser, f"{V}.app.flame.rows[0][0].name") == "all"
    assert js(browser, f"{V}.flame.depth") > depth  # the shared frames too
    # tags first: a level of tags above the frames
    browser.find_element(By.ID, "flame-by-tag").click()
    tags = js(browser, f"{V}.app.flame.rows.filter(r => r[1] === 1).map(r => [r[0].name, "
                       "r[0].bytes])")
    assert sorted(tags) == [["tag cache", 2 * MiB], ["tag weights", 4 * MiB]]
    shot(browser, tmp_path, "flame-by-tag")


def test_compare_two_moments_of_one_record(browser: Any, tmp_path: Path) -> None:
    trace = loading(tmp_path / "load.jsonl", cache=2 * MiB)
    model = model_from_trace(trace)
    load(browser, page_of(trace, tmp_path))
    browser.find_element(By.CSS_SELECTOR, ".tabs button[data-tab='compare']").click()
    # the default: the peak against the end
    compared = js(browser, f"{V}.compared")
    assert compared["a"]["bytes"] == 6 * MiB and compared["b"]["bytes"] == 0
    # A: a moment with the weights alone; B: one with the cache too
    between = (model.block_start[0] + model.block_start[1]) / 2
    later = (model.block_start[1] + model.block_end[1]) / 2
    browser.execute_script(f"{V}.state.v0 = arguments[0]; {V}.state.v1 = arguments[1]; "
                           f"{V}.draw()", model.block_start[0], model.block_end[1])  # wide apart
    for name, t in (("a", between), ("b", later)):
        click_canvas(browser, js(browser, f"{V}.xOf(arguments[0])", t), lane_top(browser, 1) + 30)
        browser.find_element(By.ID, f"compare-{name}-pin").click()
    compared = js(browser, f"{V}.compared")
    assert (compared["a"]["bytes"], compared["b"]["bytes"]) == (4 * MiB, 6 * MiB)
    assert compared["tags"] == [["cache", 0, 2 * MiB], ["weights", 4 * MiB, 4 * MiB]]
    (stack, before, after), _ = compared["stacks"]
    assert stack.endswith("in load_cache") and (before, after) == (0, 2 * MiB)
    first_stack = browser.find_element(By.CSS_SELECTOR, "#compare-stacks tbody tr")
    assert first_stack.text.split()[:2] == ["load_cache", "(test_viewer_views.py)"]
    assert first_stack.get_attribute("title") == stack  # the whole stack on hover
    first = browser.find_element(By.CSS_SELECTOR, "#compare-tags tbody tr")
    assert first.text.split() == ["cache", "0", "B", "2.00", "MiB", "+2.00", "MiB"]
    assert "grew" in first.find_elements(By.TAG_NAME, "td")[3].get_attribute("class")
    assert "B − A: +2.00 MiB" in browser.find_element(By.ID, "compare-title").text
    shot(browser, tmp_path, "compare-moments")


def test_compare_two_records_before_and_after_a_change(browser: Any, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    before = loading(tmp_path / "before.jsonl", cache=2 * MiB)
    after = loading(tmp_path / "after.jsonl", cache=6 * MiB, extra=512 * KiB)
    page = tmp_path / "diff.html"
    assert main(["view", str(after), "--compare", str(before), "-o", str(page)]) == 0
    assert "viewer written to" in capsys.readouterr().out
    load(browser, page)
    assert "compared with before.jsonl" in browser.find_element(By.ID, "note").text
    browser.find_element(By.CSS_SELECTOR, ".tabs button[data-tab='compare']").click()
    compared = js(browser, f"{V}.compared")  # the other record's peak against this one's
    assert (compared["a"]["bytes"], compared["b"]["bytes"]) == (6 * MiB, 10.5 * MiB)
    assert compared["tags"] == [["cache", 2 * MiB, 6 * MiB], ["extra", 0, 512 * KiB],
                                ["weights", 4 * MiB, 4 * MiB]]
    # stacks match by their functions, whatever lines they were called from
    assert [(s.rsplit(" in ", 1)[-1], b - a) for s, a, b in compared["stacks"]] == [
        ("load_cache", 4 * MiB), ("loading", 512 * KiB), ("load_weights", 0)]
    # the other record's end instead: nothing live there
    when = browser.find_element(By.ID, "compare-a-when")
    when.find_element(By.CSS_SELECTOR, "option[value='end']").click()
    assert js(browser, f"{V}.compared.a.bytes") == 0
    # scoped to the model: the same budget by its path in both records
    browser.find_element(By.CSS_SELECTOR, "#tree [data-budget='1']").click()
    assert "the other record, model at the end" in browser.find_element(
        By.ID, "compare-title").text
    shot(browser, tmp_path, "compare-records")
    assert main(["view", str(after), "--compare", str(tmp_path / "none.jsonl"), "-o",
                 str(tmp_path / "x.html")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_leaks_are_listed_clickable_and_marked_by_the_reports_rule(browser: Any,
                                                                   tmp_path: Path) -> None:
    """A leak is what ``BudgetReport.leaks`` calls one: a block still live when the record
    ends whose budget's scope had exited. Serving after the scope is no leak: the engine's
    band keeps its colour after the exit (no red over it), and the leak is marked red where
    the record ends, as the legend says."""
    trace = tmp_path / "leak.jsonl"
    with gpu_budget("16MiB", name="server", backend="host", trace=str(trace)):
        with gpu_budget("8MiB", name="model") as model:
            kept = model.allocate(4 * MiB, tag="engine")
            temp = model.allocate(MiB, tag="scratch")
            assert kept is not None and temp is not None and model.free(temp)
        # the model's scope has exited with its engine live: it serves from here on
        other = model.allocate(MiB, tag="late")  # served after exit, freed: no leak
        assert other is not None and model.free(other)
        # the record ends with the engine still live: a leak by report()'s rule
        assert [block.tag for block in model.report().leaks] == ["engine"]
    writer_for(trace).flush()
    assert model.free(kept)
    data = model_from_trace(trace)
    load(browser, page_of(trace, tmp_path))
    rule = browser.find_element(By.ID, "leak-rule").text
    assert "still live when the record ends" in rule and "exited" in rule
    tab = browser.find_element(By.ID, "leaks-tab")
    assert tab.text == "Leaks (1)" and "alert" in tab.get_attribute("class")
    tab.click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#leaks tbody tr")
    assert len(rows) == 1 and rows[0].text.split()[:4] == ["4.00", "MiB", "engine", "model"]
    rows[0].click()
    exited = data.budgets[1].exited
    assert exited is not None
    assert js(browser, f"{V}.state.moment") == exited and js(browser, f"{V}.state.lane") == 1
    assert "leaked 4.00 MiB" in browser.find_element(By.ID, "tree").text
    legend = dict(js(browser, f"{V}.app.keys.legend.map(e => [e.label, e.rank])"))
    engine = rgb(js(browser, "window.gpubudgetParts.PALETTE")[legend["engine"]])
    red = [217, 45, 32]
    browser.execute_script(f"{V}.state.block = null")  # no outline of the chosen block
    end = js(browser, f"{V}.end")
    top, height = lane_top(browser, 1), js(browser, f"{V}.LANE")
    base = top + height - 4
    scale = js(browser, "window.gpubudgetParts.laneScale(arguments[0])",
               {"limit": data.budgets[1].limit, "peak": data.budgets[1].peak})
    middle = base - 2 * MiB / scale * (height - 14)
    for v0, v1 in ((data.block_start[0], exited), (exited, end)):  # before and after the exit
        browser.execute_script(f"{V}.state.v0 = arguments[0]; {V}.state.v1 = arguments[1]; "
                               f"{V}.draw()", v0, v1 + (end - exited) * 0.05)
        x = js(browser, f"{V}.xOf(arguments[0])", (v0 + v1) / 2)
        row = [pixel(browser, x + dx, middle)[:3] for dx in range(8)]
        assert row == [engine] * 8, (v0, row)  # its colour, no stripe: serving
    x_end = js(browser, f"{V}.xOf(arguments[0])", end)
    assert red in [pixel(browser, x_end + dx, middle)[:3] for dx in range(-3, 1)]
    assert red in [pixel(browser, x_end + dx, top + 20)[:3] for dx in range(-3, 1)]
    shot(browser, tmp_path, "leaks")


def test_a_pytorch_snapshot_opens(browser: Any, tmp_path: Path) -> None:
    model = model_from_torch_data(snapshot_fixture(), title="snapshot.pickle")
    page = tmp_path / "snapshot.html"
    write_page(model, page)
    load(browser, page)
    assert console_problems(browser) == []
    assert js(browser, f"{V}.budgets.map(b => b.name)") == ["cuda:0", "pool (1, 7)"]
    assert "a PyTorch memory snapshot" in browser.find_element(By.ID, "note").text
    assert browser.find_element(By.ID, "colour-by").get_attribute("value") == "tag"
    # it opens on the peak of reserved bytes, with the blocks live then
    assert js(browser, f"{V}.state.moment") == pytest.approx(100e-6)  # the segment's alloc
    assert browser.find_element(By.ID, "denials-tab").text == "Denials (1)"
    browser.find_element(By.ID, "denials-tab").click()
    row = browser.find_element(By.CSS_SELECTOR, "#denials tbody tr")
    assert "out of memory: the device had 3.00 MiB free" in row.text
    row.click()
    assert js(browser, f"{V}.state.moment") == pytest.approx(600e-6)  # after the last change
    listed = js(browser, f"{V}.listed")
    assert sorted(int(model.block_size[k]) for k in listed) == [MiB, 3 * MiB]
    rows = js(browser, f"{V}.app.flame.rows.map(([n, d]) => [n.name, d, n.bytes])")
    assert rows[0] == ["/work/main.py:11 in main", 0, 4 * MiB]  # the frame they share
    assert ["/work/load_weights.py:10 in load_weights", 1, 3 * MiB] in rows
    title = browser.find_element(By.ID, "address-title").text
    assert title.startswith("Addresses of cuda:0 at ") and "free of 10.00 MiB" in title
    assert js(browser, f"{V}.app.layout.spans.length") == 2  # two ranges, packed
    assert js(browser, f"{V}.app.layout.spans[0].start") == BASE
    assert "Leaks (0)" == browser.find_element(By.ID, "leaks-tab").text
    shot(browser, tmp_path, "pytorch-snapshot")


def test_the_whole_run_shows_each_buckets_peak_with_its_bytes_per_colour(
        browser: Any, tmp_path: Path) -> None:
    """A lane with many events is drawn, at the whole run, from a summary: per bucket of the
    run, the most bytes live at once (the state carried into the bucket included) and the
    bytes of each colour at that moment. Checked against the same computed here from the
    model, bucket by bucket."""
    import math
    import random

    rng = random.Random(7)
    trace = tmp_path / "many.jsonl"
    with gpu_budget("64MiB", name="server", backend="host", trace=str(trace)):
        with gpu_budget("32MiB", name="model") as model:
            live: list[int] = []
            for _ in range(24_000):  # more changes than a lane draws one by one
                if live and (len(live) > 60 or rng.random() < 0.45):
                    assert model.free(live.pop(rng.randrange(len(live))))
                else:
                    block = model.allocate(rng.randrange(1, 64) * 4 * KiB,
                                           tag=rng.choice("abc"))
                    assert block is not None
                    live.append(block)
            for block in live:
                assert model.free(block)
    writer_for(trace).flush()
    data = model_from_trace(trace)
    load(browser, page_of(trace, tmp_path))
    assert js(browser, f"{V}.drawn.modes") == {"0": "summary", "1": "summary"}
    nb = js(browser, "window.gpubudgetParts.NB")
    legend = dict(js(browser, f"{V}.app.keys.legend.map(e => [e.label, e.rank])"))
    peaks, keys = browser.execute_script(
        f"const s = window.gpubudgetParts.summary({V}.app, 1);"
        "return [Array.from(s.peak), Array.from(s.keys)];")
    ranks = len(keys) // nb
    # the same here: the model's events in order, frees before allocations at one event
    changes: dict[int, list[tuple[int, int]]] = {}
    for k in range(len(data.block_size)):
        changes.setdefault(data.block_from[k], []).append((1, k))
        if data.block_to[k] >= 0:
            changes.setdefault(data.block_to[k], []).append((0, k))
    scale = nb / data.end
    total, sums = 0.0, [0.0] * ranks
    expected_peak = [0.0] * nb
    expected_keys = [[0.0] * ranks for _ in range(nb)]
    current = 0
    expected_peak[0], expected_keys[0] = total, sums[:]
    for at in range(len(data.times)):
        bucket = min(nb - 1, math.floor(data.times[at] * scale))
        while current < bucket:
            current += 1
            expected_peak[current], expected_keys[current] = total, sums[:]
        for start, k in sorted(changes.get(at, ())):
            size = data.block_size[k] if start else -data.block_size[k]
            total += size
            sums[legend[data.tags[data.block_tag[k]]]] += size
            if total > expected_peak[current]:
                expected_peak[current], expected_keys[current] = total, sums[:]
    while current < nb - 1:
        current += 1
        expected_peak[current], expected_keys[current] = total, sums[:]
    assert peaks == expected_peak
    assert [keys[j * ranks:(j + 1) * ranks] for j in range(nb)] == expected_keys
    shot(browser, tmp_path, "summary-bands")
