from __future__ import annotations

import json

from gpubudget import BudgetReport, gpu_budget
from gpubudget.adapter import hooks


def _tree() -> BudgetReport:
    with gpu_budget("1MiB", name="server", track_stacks=True) as server:
        with gpu_budget("256KiB", name="det") as det:
            kept = det.allocate(100_000, tag="det/weights")
            assert det.allocate(300_000) is None
        with gpu_budget("256KiB", name="cls") as cls:
            gone = cls.allocate(5000)
            assert gone is not None and cls.free(gone)
    assert kept is not None
    report = server.report()
    assert det.free(kept)  # a late free, so that nothing is left live at the end of the tests
    return report


def test_report_tree_numbers() -> None:
    report = _tree()
    det, cls = report.children
    assert (report.name, det.name, cls.name) == ("server", "det", "cls")
    assert report.used == det.used == 100_096 and cls.used == 0
    assert report.peak == 100_096 + 5120 and cls.peak == 5120  # det's block was live
    assert det.denied == 1 and det.largest_denied == 300_032
    assert det.denials[0].reason == "over_limit" and det.denials[0].refused_by == "det"
    assert (cls.allocations, cls.frees) == (1, 1)
    assert report.state == "exited" and cls.state == "released"
    (block,) = det.live_blocks
    assert block.tag == "det/weights" and block.size == 100_096
    assert block.stack is not None and any("test_report.py" in frame for frame in block.stack)
    assert not any("gpubudget/budget.py" in frame for frame in block.stack)
    assert [r.name for r in report.walk()] == ["server", "det", "cls"]


def test_report_renders_text_with_tree_denials_and_leaks() -> None:
    text = str(_tree())
    assert text.splitlines()[0].startswith("server [host] (exited): used 97.75 KiB of 1.00 MiB")
    assert "├─ det" in text and "└─ cls" in text
    assert "denied 1x, over the limit of 'det' (largest 293.00 KiB)" in text
    assert "det/weights" in text and "test_report.py" in text


def test_report_as_dict_and_json_round_trip() -> None:
    report = _tree()
    data = json.loads(report.to_json())
    assert data == json.loads(json.dumps(report.as_dict()))
    assert data["children"][0]["live_blocks"][0]["tag"] == "det/weights"
    assert data["children"][0]["denials"][0]["reason"] == "over_limit"


def test_report_works_before_entry_and_after_release() -> None:
    budget = gpu_budget("1MiB", name="later")
    assert budget.report().state == "new" and budget.report().free_bytes == 0
    with budget:
        pass
    report = budget.report()
    assert report.state == "released" and report.largest_free_block == 0


def test_record_error_shows_in_report() -> None:
    with gpu_budget("1MiB", name="cb") as budget:
        hooks(budget).record_error("allocate callback: ValueError: bad")
    report = budget.report()
    assert report.callback_errors == ("allocate callback: ValueError: bad",)
    assert report.denials[0].reason == "internal_error"
    assert "callback error: allocate callback" in str(report)


def test_a_parents_counts_line_gives_the_trees_counts_first() -> None:
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        with gpu_budget("512KiB", name="model") as model:
            for _ in range(3):
                block = model.allocate(1024)
                assert block is not None and model.free(block)
            assert model.allocate(600 * 1024) is None
    lines = str(pool.report()).splitlines()
    assert lines[1] == "  with the budgets below: allocations 3, frees 3, denied 1, live blocks 0"
    assert lines[2] == "  its own: allocations 0, frees 0, denied 0"
    child = [line.strip() for line in lines if "allocations" in line][-1]
    assert child.startswith("allocations 3, frees 3, denied 1")  # a leaf: its own, unlabelled
