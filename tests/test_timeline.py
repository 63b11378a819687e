"""Attribution (tags, labels), the bounded event log, leaks at exit, and the plot."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import subprocess_env

import gpubudget._core.recorder as recorder_module
from gpubudget import gpu_budget, label

KiB = 1024


def test_tag_precedence_explicit_then_label_then_none() -> None:
    with gpu_budget("1MiB") as budget:
        plain = budget.allocate(100)
        with label("outer"):
            with label("inner"):
                labelled = budget.allocate(100)
                explicit = budget.allocate(100, tag="mine")
            outer = budget.allocate(100)
    tags = {b.address: b.tag for b in budget.report().live_blocks}
    assert [tags[a] for a in (plain, labelled, explicit, outer)] == [None, "inner", "mine", "outer"]  # type: ignore[index]


def test_label_validates_and_works_async() -> None:
    import asyncio

    with pytest.raises(ValueError, match="''"):
        label("")
    with pytest.raises(TypeError, match="3"):
        label(3)  # type: ignore[arg-type]

    async def main() -> str | None:
        async with label("async"):
            from gpubudget import current_label

            return current_label()

    assert asyncio.run(main()) == "async"


def test_by_tag_tracks_live_and_peak() -> None:
    with gpu_budget("1MiB") as budget:
        a = budget.allocate(10 * KiB, tag="w")
        b = budget.allocate(20 * KiB, tag="w")
        assert a is not None and b is not None
        budget.free(a)
        c = budget.allocate(5 * KiB, tag="act")
        assert c is not None
        grown = budget.resize(c, 8 * KiB)
        assert grown == c
    usage = {u.tag: (u.live, u.peak) for u in budget.report().by_tag}
    assert usage == {"w": (20 * KiB, 30 * KiB), "act": (8 * KiB, 8 * KiB)}
    assert "w: 20.00 KiB / 30.00 KiB" in str(budget.report())


def test_timeline_records_allocations_frees_and_denials() -> None:
    with gpu_budget("64KiB", name="root") as root:
        with gpu_budget("16KiB", name="child") as child:
            a = child.allocate(8 * KiB, tag="t")
            assert child.allocate(32 * KiB) is None
            assert a is not None and child.free(a)
        b = root.allocate(4 * KiB)
        assert b is not None
    timeline = root.report().timeline
    assert [(e.kind, e.budget, e.size, e.used, e.total) for e in timeline] == [
        ("alloc", "child", 8 * KiB, 8 * KiB, 8 * KiB),
        ("deny", "child", 32 * KiB, 8 * KiB, 8 * KiB),
        ("free", "child", 8 * KiB, 0, 0),
        ("alloc", "root", 4 * KiB, 4 * KiB, 4 * KiB),
    ]
    assert timeline[0].tag == "t" and timeline[0].time == 0.0
    assert all(x.time <= y.time for x, y in zip(timeline, timeline[1:]))
    assert [e.budget for e in child.report().timeline] == ["child"] * 3
    assert root.report().children[0].timeline == ()  # only on the report asked for


def test_event_log_is_bounded() -> None:
    limit = recorder_module.EVENT_LOG_LIMIT
    with gpu_budget("1MiB") as budget:
        for _ in range(limit // 2 + 50):  # two events each
            block = budget.allocate(256)
            assert block is not None
            budget.free(block)
    report = budget.report()
    assert len(report.timeline) == limit and report.events_dropped == 100
    assert report.timeline[-1].kind == "free"


def test_leaks_property_and_exit_listing_with_stacks(tmp_path: Path) -> None:
    with gpu_budget("1MiB", name="root") as root:
        with gpu_budget("64KiB", name="child") as child:
            kept = child.allocate(KiB)
            assert root.report().leaks == ()  # the child's scope is still open
        assert [b.address for b in root.report().leaks] == [kept]  # it exited holding it
    script = tmp_path / "leak.py"
    script.write_text(textwrap.dedent("""
        from gpubudget import gpu_budget

        def load_model(budget):
            return budget.allocate(4096, tag="weights")

        with gpu_budget("1MiB", name="server", backend="host", track_stacks=True) as server:
            with gpu_budget("64KiB", name="model") as model:
                load_model(model)
        with gpu_budget("1MiB", name="quiet", backend="host") as quiet:
            quiet.allocate(4096)
    """))
    env = subprocess_env()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0
    err = result.stderr
    assert "1 block(s) of budget 'server' still live at exit" in err
    assert "weights" in err and "in load_model" in err and "leak.py" in err
    assert ("gpubudget: 1 block(s) of budget 'quiet' still live at exit (4.00 KiB: (no tag) "
            "4.00 KiB); gpu_budget(..., track_stacks=True) shows where each was allocated"
            ) in err.splitlines()


def _red_pixels(path: Path) -> int:
    """Pixels of pure red (the denial crosses) in a PNG, read back with matplotlib."""
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    red = (pixels[..., 0] > 0.9) & (pixels[..., 1] < 0.1) & (pixels[..., 2] < 0.1)
    return int(red.sum())


def test_plot_draws_denials_as_red_crosses_and_only_then(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = []
    for deny in (True, False):
        with gpu_budget("64KiB", name="root") as root:
            with gpu_budget("16KiB", name="child") as child:
                blocks = [child.allocate(4 * KiB) for _ in range(3)]
                if deny:
                    assert child.allocate(32 * KiB) is None
                for block in blocks:
                    assert block is not None and child.free(block)
        path = tmp_path / f"timeline-{deny}.png"
        root.report().plot(str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        paths.append(path)
    assert _red_pixels(paths[0]) > 20 and _red_pixels(paths[1]) == 0


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with gpu_budget("64KiB") as root:
        pass
    with pytest.raises(ImportError, match=r"gpubudget\[plot\]"):
        root.report().plot(str(tmp_path / "x.png"))
