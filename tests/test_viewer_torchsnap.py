"""PyTorch memory snapshots in the viewer: the unpickler that reads plain data and refuses
everything else without running it, and the model a snapshot becomes. The snapshots are
built by hand after PyTorch's documented format (``torch.cuda.memory._snapshot``: segments
with their blocks, and per device the actions recorded); ``tests/gpu`` opens a real one."""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import sys
from pathlib import Path
from typing import Any

import pytest

from gpubudget.cli import EXIT_BAD_INPUT, main
from gpubudget.viewer.plainpickle import SnapshotError, load_plain
from gpubudget.viewer.torchsnap import model_from_torch_data, model_from_torch_snapshot

MiB = 2**20
BASE = 0x7F00_0000_0000


def frames(*names: str) -> list[dict[str, Any]]:
    """A stack as PyTorch records it: innermost first, C++ frames among the Python ones."""
    out: list[dict[str, Any]] = [{"filename": "??", "line": 0, "name": "c10::cuda::alloc"}]
    out += [{"filename": f"/work/{name}.py", "line": 10 + i, "name": name}
            for i, name in enumerate(reversed(names))]
    return out


def entry(action: str, addr: int, size: int, time_us: int, stack: list[dict[str, Any]],
          **extra: Any) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us,
            "frames": stack, **extra}


def snapshot_fixture() -> dict[str, Any]:
    """One device: a segment of 8 MiB mapped during the record and one of 2 MiB from before
    it (a private pool's); a block from before the record freed in it, two allocated and
    one of them freed, one live from before the record (in the pool), an out-of-memory."""
    weights, step = frames("main", "load_weights"), frames("main", "train_step")
    return {
        "segments": [
            {"device": 0, "address": BASE, "total_size": 8 * MiB, "allocated_size": 3 * MiB,
             "active_size": 3 * MiB, "requested_size": 3 * MiB, "stream": 0,
             "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
             "frames": weights, "blocks": [
                 {"address": BASE, "size": 3 * MiB, "requested_size": 3 * MiB,
                  "state": "active_allocated", "frames": weights},
                 {"address": BASE + 3 * MiB, "size": 5 * MiB, "requested_size": 5 * MiB,
                  "state": "inactive", "frames": []}]},
            {"device": 0, "address": BASE + 64 * MiB, "total_size": 2 * MiB,
             "allocated_size": MiB, "active_size": MiB, "requested_size": MiB, "stream": 0,
             "segment_type": "large", "segment_pool_id": (1, 7), "frames": [], "blocks": [
                 {"address": BASE + 64 * MiB, "size": MiB, "requested_size": MiB,
                  "state": "active_allocated", "frames": step}]}],
        "device_traces": [[
            entry("free_completed", BASE + 96 * MiB, MiB // 2, 1_000, step),
            entry("segment_alloc", BASE, 8 * MiB, 1_100, weights),
            entry("alloc", BASE, 3 * MiB, 1_200, weights, user_metadata="weights"),
            entry("alloc", BASE + 3 * MiB, 4 * MiB, 1_300, step),
            entry("free_requested", BASE + 3 * MiB, 4 * MiB, 1_400, step),
            entry("free_completed", BASE + 3 * MiB, 4 * MiB, 1_500, step),
            {"action": "oom", "size": 64 * 2**30, "device_free": 3 * MiB, "stream": 0,
             "time_us": 1_600, "frames": step},
            entry("snapshot", 0, 0, 1_700, []),
        ]],
    }


def write(path: Path, data: object, protocol: int = pickle.HIGHEST_PROTOCOL) -> Path:
    path.write_bytes(pickle.dumps(data, protocol=protocol))
    return path


def test_a_snapshot_becomes_budgets_blocks_and_points(tmp_path: Path) -> None:
    model = model_from_torch_snapshot(write(tmp_path / "s.pickle", snapshot_fixture()))
    assert model.source == "torch" and model.time_unit == "s"
    assert [(b.name, b.parent, b.limit) for b in model.budgets] == [
        ("cuda:0", None, 0), ("pool (1, 7)", 0, 0)]
    # blocks: before the record and freed in it; allocated and live; allocated and freed;
    # live from before the record in the pool
    assert list(model.block_size) == [MiB // 2, 3 * MiB, 4 * MiB, MiB]
    assert list(model.block_budget) == [0, 0, 0, 1]
    assert [model.block_from[k] >= 0 for k in range(4)] == [False, True, True, False]
    assert [model.block_to[k] >= 0 for k in range(4)] == [True, False, True, False]
    assert model.block_end[2] - model.block_start[2] == pytest.approx(200e-6)  # 1300 -> 1500
    assert math.isnan(model.block_start[3]) and math.isnan(model.block_end[3])
    assert model.tags == ["weights"] and model.block_tag[1] == 0 and model.block_tag[2] == -1
    # stacks: the Python frames, outermost first
    assert [model.frames[f] for f in model.stacks[model.block_stack[1]]] == [
        "/work/main.py:11 in main", "/work/load_weights.py:10 in load_weights"]
    # used is what the allocator reserved: 2 MiB (the pool's, from before), then 8 MiB more
    root = [(t, u, o) for t, b, u, o in zip(model.point_t, model.point_budget,
                                            model.point_used, model.point_own) if b == 0]
    assert root[0] == (0.0, 2 * MiB, MiB // 2)  # before: the pool's segment; a block
    assert root[-1][1:] == (10 * MiB, 3 * MiB)
    assert model.budgets[0].peak == 10 * MiB and model.budgets[1].peak == 2 * MiB
    (denial,) = model.denials
    assert denial[1:3] == (0, 64 * 2**30) and "3.00 MiB free" in denial[3]
    assert denial[0] == pytest.approx(600e-6)
    assert model.end == pytest.approx(700e-6)  # the snapshot's own action, after the last change
    regions = sorted((address - BASE, size, first >= 0) for _, address, size, first, _ in
                     model.regions)
    assert regions == [(0, 8 * MiB, True), (64 * MiB, 2 * MiB, False)]


def test_actions_of_two_devices_keep_one_clock_and_untimed_records_count_actions() -> None:
    one = entry("alloc", BASE, MiB, 5_000, [])
    two = entry("alloc", BASE + MiB, MiB, 2_000, [])
    model = model_from_torch_data({"segments": [], "device_traces": [[one], [two]]})
    assert [b.name for b in model.budgets] == ["cuda:0", "cuda:1"]
    starts = {model.budgets[b].name: t for b, t in zip(model.block_budget, model.block_start)}
    assert starts == {"cuda:1": 0.0, "cuda:0": pytest.approx(3e-3)}  # merged by time
    del one["time_us"], two["time_us"]
    untimed = model_from_torch_data({"segments": [], "device_traces": [[one], [two]]})
    assert untimed.time_unit == "event" and list(untimed.block_start) == [1.0, 1.0]


def test_expandable_segments_map_and_unmap_in_pieces() -> None:
    trace = [entry("segment_map", BASE, 8 * MiB, 10, []),
             entry("segment_unmap", BASE + 2 * MiB, 2 * MiB, 20, []),
             entry("segment_unmap", BASE + 32 * MiB, 2 * MiB, 30, [])]  # mapped before
    model = model_from_torch_data({"segments": [], "device_traces": [trace]})
    assert list(model.times) == [0.0, 0.0, 10e-6, 20e-6]  # the start, then each action
    regions = sorted((a - BASE, s, f, t) for _, a, s, f, t in model.regions)
    assert regions == [(0, 2 * MiB, 2, -1),  # what the first unmap left below, until the end
                       (0, 8 * MiB, 1, 2),  # mapped, until the first unmap
                       (4 * MiB, 4 * MiB, 2, -1),  # and above
                       (32 * MiB, 2 * MiB, -1, 3)]  # mapped before the record began
    used = [u for b, u in zip(model.point_budget, model.point_used) if b == 0]
    assert used == [2 * MiB, 10 * MiB, 8 * MiB, 6 * MiB]


def test_the_legacy_format_keeps_stacks_in_history() -> None:
    legacy = {"segments": [{"device": 0, "address": BASE, "total_size": 2 * MiB, "stream": 0,
                            "segment_type": "large", "blocks": [
                                {"size": MiB, "state": "inactive"},
                                {"size": MiB, "state": "active_allocated", "history": [
                                    {"addr": BASE + MiB, "real_size": MiB,
                                     "frames": frames("old")}]}]}],
              "device_traces": []}
    model = model_from_torch_data(legacy)
    assert list(model.block_address) == [BASE + MiB]  # placed after the first block
    assert [model.frames[f] for f in model.stacks[0]] == ["/work/old.py:10 in old"]
    assert model.time_unit == "s" and model.end == 0.0


@pytest.mark.parametrize("data, where", [
    ("x", "the pickle is 'x', not a dictionary"),
    ([5], "segments[0] is 5, not a dictionary"),
    ({"nothing": 1}, "neither 'segments' nor 'device_traces'"),
    ({"segments": [1]}, "segments[0] is 1"),
    ({"segments": [{"device": 0, "address": -5, "total_size": 1, "blocks": []}]},
     "segments[0]['address'] is -5"),
    ({"segments": [{"device": 0, "address": 0, "total_size": True, "blocks": []}]},
     "segments[0]['total_size'] is True"),
    ({"device_traces": [[{"action": "alloc", "addr": "x", "size": 1}]]},
     "device_traces[0][0]['addr'] is 'x'"),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 1, "frames": 3}]]},
     "device_traces[0][0]['frames'] is 3, not a list of frames"),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 1, "pool_id": (1,)}]]},
     "['pool_id'] is a tuple of 1, not a pair"),
])
def test_what_is_not_a_snapshot_is_named_where(data: object, where: str) -> None:
    with pytest.raises(SnapshotError) as caught:
        model_from_torch_data(data, name="s.pickle")
    message = str(caught.value)
    assert message.startswith("s.pickle: not a PyTorch memory snapshot: ") and where in message
    assert "\n" not in message


def test_an_object_shared_many_times_is_refused_not_walked_again() -> None:
    """A pickle can reference one list a million times for a few bytes each: walking every
    reference would cost what the file does not; PyTorch never shares these."""
    actions = [entry("alloc", BASE + i * 512, 512, i, []) for i in range(100)]
    data = pickle.dumps({"device_traces": [actions] * 10_000})
    assert len(data) < 100_000
    with pytest.raises(SnapshotError, match=r"device_traces\[1\] is the same object"):
        model_from_torch_data(load_plain(data, "s"), name="s")
    shared_stack = frames("main")  # frames, though, are shared by PyTorch itself
    fine = {"device_traces": [[entry("alloc", BASE + i * 512, 512, i, shared_stack)
                               for i in range(3)]]}
    assert len(model_from_torch_data(load_plain(pickle.dumps(fine), "s")).stacks) == 1


# -- the unpickler ------------------------------------------------------------------------

CANARY = "gpubudget_viewer_canary"


def _canary_pickle(tmp_path: Path) -> bytes:
    """A pickle that imports a module of ours and calls it: the module, if it were ever
    imported, would write a file."""
    (tmp_path / f"{CANARY}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).write_text('yes')\n"
        "def run(*args):\n"
        f"    pathlib.Path({str(tmp_path / 'called')!r}).write_text('yes')\n")
    return (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x08segments\x94"
            + b"\x8c" + bytes([len(CANARY)]) + CANARY.encode() + b"\x94\x8c\x03run\x94\x93"
            + b"\x94)R\x94s.")


def test_a_pickle_that_names_code_is_refused_and_nothing_runs(tmp_path: Path,
                                                              monkeypatch: Any) -> None:
    data = _canary_pickle(tmp_path)
    assert "STACK_GLOBAL" in {op.name for op, _, _ in pickletools.genops(io.BytesIO(data))}
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SnapshotError, match=f"refused: it names {CANARY}.run"):
        load_plain(data, "s.pickle")
    assert CANARY not in sys.modules
    assert not (tmp_path / "imported").exists() and not (tmp_path / "called").exists()
    assert pickle.loads(data)["segments"] is None  # what pickle.load would have done
    assert (tmp_path / "imported").exists() and (tmp_path / "called").exists()


class _Cls:
    def __init__(self) -> None:
        self.x = 1


def _ext_pickle() -> bytes:
    import copyreg

    copyreg.add_extension("os", "getcwd", 0xF0)
    try:
        return b"\x80\x02\x82\xf0)R."  # EXT1 0xF0 (os.getcwd), EMPTY_TUPLE, REDUCE
    finally:
        copyreg.remove_extension("os", "getcwd", 0xF0)


@pytest.mark.parametrize("name, data, said", [
    ("a global, protocol 0", b"cos\nsystem\n(S'true'\ntR.", "it names os.system"),
    ("an instance", pickle.dumps(_Cls(), protocol=2), "it names tests.test_viewer_torchsnap"),
    ("an exception", pickle.dumps(ValueError("x")), "it names builtins.ValueError"),
    ("a function", pickle.dumps(os.getcwd), "it names posix.getcwd"),
    ("BUILD on plain data", b"\x80\x04}\x94}\x94b.", "it uses the BUILD opcode"),
    ("REDUCE of plain data", b"\x80\x04}\x94)R.", "it uses the REDUCE opcode"),
    ("a persistent id", b"\x80\x04\x8c\x01x\x94Q.", "it asks for a persistent object"),
    ("an out-of-band buffer", b"\x80\x05\x97.", "it uses the NEXT_BUFFER opcode"),
])
def test_every_door_to_code_is_shut(name: str, data: bytes, said: str) -> None:
    with pytest.raises(SnapshotError) as caught:
        load_plain(data, "s.pickle")
    assert str(caught.value).startswith(f"s.pickle: refused: {said}"), name


def test_an_extension_code_goes_through_the_same_door() -> None:
    data = _ext_pickle()
    import copyreg

    copyreg.add_extension("os", "getcwd", 0xF0)
    try:
        with pytest.raises(SnapshotError, match="refused: it names os.getcwd"):
            load_plain(data, "s.pickle")
    finally:
        copyreg.remove_extension("os", "getcwd", 0xF0)


def test_plain_data_reads_in_every_protocol_that_writes_it_as_data() -> None:
    """Protocols 4 and 5 (what ``pickle.dump`` writes by default, and so PyTorch) write
    bytes and sets as data; older ones write them as calls (``_codecs.encode``, ``set``),
    which are refused like any call; the rest reads in every protocol."""
    data: dict[str, Any] = {"a": [1, 2.5, -3, 2**70, "x", None, True, (1, 2), {"b": []}]}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert load_plain(pickle.dumps(data, protocol=protocol), "s") == data
    data.update(b=b"y", s={1, 2}, f=frozenset({3}))
    for protocol in (4, 5):
        assert load_plain(pickle.dumps(data, protocol=protocol), "s") == data
    assert load_plain(pickle.dumps(bytearray(b"z"), protocol=5), "s") == bytearray(b"z")
    with pytest.raises(SnapshotError, match="refused: it names _codecs.encode"):
        load_plain(pickle.dumps(b"y", protocol=2), "s")


def test_a_malformed_pickle_is_one_line() -> None:
    for data in (b"", b"\x80\x04", b"\x80\x04\x95\xff\xff\xff\xff", b"not a pickle at all\n"):
        with pytest.raises(SnapshotError) as caught:
            load_plain(data, "s.pickle")
        assert str(caught.value).startswith("s.pickle: ") and "\n" not in str(caught.value)


# -- the command line ---------------------------------------------------------------------


def test_view_opens_a_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = write(tmp_path / "dump", snapshot_fixture())  # found by its first byte
    assert main(["view", str(snapshot), "-o", str(tmp_path / "view.html")]) == 0
    assert "viewer written to" in capsys.readouterr().out
    page = (tmp_path / "view.html").read_text()
    assert "a PyTorch memory snapshot" in page and "pool (1, 7)" in page


def test_view_refuses_a_pickle_with_code_in_one_line(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: Any) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(_canary_pickle(tmp_path))
    status = main(["view", str(evil), "-o", str(tmp_path / "view.html")])
    out, err = capsys.readouterr()
    assert status == EXIT_BAD_INPUT and err.count("\n") == 1 and "Traceback" not in err
    assert f"refused: it names {CANARY}.run" in err
    assert not (tmp_path / "view.html").exists() and not (tmp_path / "imported").exists()
    for bad, said in ((tmp_path / "none.pickle", "cannot read snapshot"),
                      (write(tmp_path / "plain.pkl", {"x": 1}), "not a PyTorch memory snapshot"),
                      (tmp_path, "not a regular file"),
                      (tmp_path / "fifo.pickle", "not a regular file")):
        if bad == tmp_path:
            bad = tmp_path / "dir.pickle"
            bad.mkdir()
        elif bad.name == "fifo.pickle":
            os.mkfifo(bad)  # opened without a writer: refused, not waited on
        assert main(["view", str(bad), "-o", str(tmp_path / "view.html")]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1
    big = write(tmp_path / "big.pickle", snapshot_fixture())
    assert main(["view", str(big), "-o", str(tmp_path / "v.html"), "--max-size", "100"]) == 2
    assert "longer than 100 B" in capsys.readouterr().err


def test_an_action_records_the_request_and_the_block_is_rounded_as_pytorch_rounds() -> None:
    """PyTorch 2.x's actions carry the size asked for (2.11, checked on a GPU: 64 MiB + 1000
    asked, recorded as such); its blocks are that rounded up to 512 bytes. A live block's
    ``requested_size`` in the segments says the same."""
    data = {"device_traces": [[
        entry("alloc", BASE, 1000, 1, frames("main")),
        entry("alloc", BASE + 4096, 300, 2, frames("main")),
        entry("free_completed", BASE + 4096, 300, 3, frames("main")),
        entry("free_completed", BASE + 8192, 513, 4, frames("main"))]]}
    model = model_from_torch_data(data)
    assert list(model.block_size) == [1024, 512, 1024]  # the last from before the record
    assert list(model.block_requested) == [1000, 300, 513]


REAL = Path(__file__).parent / "data" / "torch-2.11-snapshot.pickle"
"""A snapshot PyTorch 2.11 wrote on an H200 (13 KB): 64 MiB + 1000 bytes asked for and kept,
3 MiB + 7 and twenty small blocks on a side stream, an 8 MiB block freed."""


def test_a_real_pytorch_2_11_snapshot_gives_requests_rounding_and_streams() -> None:
    model = model_from_torch_snapshot(REAL)
    assert [b.name for b in model.budgets] == ["cuda:0"]
    sizes = {int(model.block_requested[k]): k for k in range(len(model.block_size))}
    weights, side = sizes[64 * MiB + 1000], sizes[3 * MiB + 7]
    assert model.block_size[weights] == 64 * MiB + 1024  # rounded to 512, as kept
    assert model.block_to[weights] == -1 and model.block_to[side] == -1  # live at the end
    assert model.block_stream[weights] == 0 and model.block_stream[side] != 0
    small = [k for k in range(len(model.block_size)) if 1000 <= model.block_requested[k] < 1020]
    assert len(small) == 20 and all(model.block_size[k] == 1024 for k in small)
    assert all(model.block_stream[k] == model.block_stream[side] for k in small)
    assert all(model.block_to[k] >= 0 for k in small)  # freed before the snapshot
    frames = [model.frames[f] for f in model.stacks[model.block_stack[weights]]]
    assert frames[-1].endswith("in load_weights")
