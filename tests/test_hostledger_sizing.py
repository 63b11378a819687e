"""gpubudget.hostledger.sizing: shares and caps as written, every bad one a clear error naming
it, and the rule that decides what a root may claim."""

from __future__ import annotations

import pytest

from gpubudget import gpu_budget
from gpubudget.hostledger.sizing import Share, decide, parse_cap, parse_share
from gpubudget.units import GiB, MiB


@pytest.mark.parametrize(("text", "fraction", "margin"), [
    ("50%", 0.5, 0), (" 12.5 % ", 0.125, 0), ("100%", 1.0, 0), ("rest", 1.0, 0),
    ("REST", 1.0, 0), ("rest - 2GiB", 1.0, 2 * GiB), ("rest-512MiB", 1.0, 512 * MiB),
    ("30% - 1 GB", 0.3, 10**9), (".5%", 0.005, 0)])
def test_shares_as_written(text: str, fraction: float, margin: int) -> None:
    assert parse_share(text) == Share(fraction, margin, text)


@pytest.mark.parametrize("value", ["4GiB", "4096", 4096, None, b"50%", 0.5])
def test_what_is_not_written_as_a_share_is_left_to_sizes(value: object) -> None:
    assert parse_share(value) is None


@pytest.mark.parametrize(("text", "message"), [
    ("0%", "'0%': a share must be more than 0% and at most 100%"),
    ("150%", "'150%': a share must be more than 0% and at most 100%"),
    ("-5%", "'-5%' is not a share: write a percentage"),
    ("%", "'%' is not a share: '' before '%' is not a number"),
    ("1.2.3%", "'1.2.3%' is not a share"),
    ("50%%", "'50%%' is not a share"),
    ("rest of it", "'rest of it' is not a share"),
    ("restful", "'restful' is not a share"),
    ("50% - lots", "the margin of limit '50% - lots' 'lots' is not a size"),
    ("rest - 0", "the margin of limit 'rest - 0' must be positive"),
    ("50% + 1GiB", "'50% \\+ 1GiB' is not a share"),
])
def test_a_share_written_wrong_is_an_error_that_quotes_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_share(text)
    with pytest.raises(ValueError, match=message):
        gpu_budget(text)  # at construction, like every bad argument


@pytest.mark.parametrize(("text", "cap"), [("90%", 9 * GiB), ("8GiB", 8 * GiB),
                                           (" 100 % ", 10 * GiB), ("0.5%", int(10 * GiB * 0.005))])
def test_caps_are_sizes_or_percentages_of_the_device(text: str, cap: int) -> None:
    assert parse_cap(text, 10 * GiB) == cap


@pytest.mark.parametrize(("text", "message"), [
    ("lots", "GPUBUDGET_DEVICE_CAP='lots' 'lots' is not a size"),
    ("0%", "GPUBUDGET_DEVICE_CAP='0%' is not a cap: a percentage must be"),
    ("120%", "GPUBUDGET_DEVICE_CAP='120%' is not a cap"),
    ("x%", "GPUBUDGET_DEVICE_CAP='x%' is not a cap"),
    ("nan%", "GPUBUDGET_DEVICE_CAP='nan%' is not a cap"),
    ("-1GiB", "GPUBUDGET_DEVICE_CAP='-1GiB' must be positive"),
    ("", "GPUBUDGET_DEVICE_CAP='' '' is not a size"),
])
def test_a_cap_that_does_not_parse_is_an_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message + ".*a cap is a size such as '120GiB'"
                       if "is not a cap" not in message else message):
        parse_cap(text, 10 * GiB)


def rule(request: int | Share, **given: object) -> int | None:
    arguments: dict[str, object] = dict(granularity=256, held=0, total=16 * GiB, cap=None,
                                        hard=False, free=None, unsettled=0)
    arguments.update(given)
    return decide(request, **arguments).nbytes  # type: ignore[arg-type]


def test_a_share_is_of_the_room_under_the_cap_the_total_and_the_free_memory() -> None:
    half = Share(0.5, 0, "50%")
    assert rule(half) == 8 * GiB
    assert rule(half, held=4 * GiB) == 6 * GiB
    assert rule(half, cap=10 * GiB, held=4 * GiB) == 3 * GiB
    assert rule(half, free=5 * GiB) == 5 * GiB // 2
    assert rule(half, free=5 * GiB, unsettled=GiB) == 2 * GiB  # still reserving: not free
    assert rule(Share(1.0, GiB, "rest - 1GiB"), held=4 * GiB) == 11 * GiB
    assert (rule(Share(1 / 3, 0, "33.3%")) or 1) % MiB == 0  # rounded down to a MiB
    assert rule(Share(1.0, 0, "rest"), held=16 * GiB) is None
    denied = decide(Share(1.0, 2 * GiB, "rest - 2GiB"), granularity=256, held=15 * GiB,
                    total=16 * GiB, cap=None, hard=False, free=None, unsettled=0)
    assert denied.reason == ("the device has 16.00 GiB, 15.00 GiB of it claimed, 1.00 GiB "
                             "left: 'rest - 2GiB' is 100% of it less 2.00 GiB, nothing")


def test_a_limit_is_refused_above_the_cap_a_hard_total_or_the_free_memory() -> None:
    assert rule(20 * GiB) == 20 * GiB  # no cap, a device that enforces itself: its business
    assert rule(20 * GiB, hard=True) is None
    assert rule(12 * GiB, hard=True, held=4 * GiB) == 12 * GiB
    assert rule(12 * GiB, cap=15 * GiB, held=4 * GiB) is None
    assert rule(6 * GiB, free=6 * GiB) == 6 * GiB
    reason = decide(6 * GiB, granularity=256, held=0, total=16 * GiB, cap=None, hard=False,
                    free=6 * GiB, unsettled=GiB).reason
    assert reason == ("the device has 6.00 GiB free of 16.00 GiB total, 1.00 GiB of it "
                      "claimed by roots still reserving, 5.00 GiB left")


def test_a_share_is_never_more_than_the_device_has_whatever_the_cap() -> None:
    share = Share(0.5, 0, "50%")
    assert decide(share, granularity=256, held=2 * GiB, total=8 * GiB, cap=32 * GiB,
                  hard=False, free=None, unsettled=0).nbytes == 3 * GiB  # not 15 GiB


def test_a_share_of_a_gpu_leaves_the_headroom_and_a_limit_does_not() -> None:
    rest = Share(1.0, 0, "rest")
    room = {"granularity": 256, "held": 0, "total": 16 * GiB, "cap": None, "hard": False,
            "free": 10 * GiB, "unsettled": GiB, "headroom": 256 * MiB}
    assert decide(rest, **room).nbytes == 9 * GiB - 256 * MiB  # type: ignore[arg-type]
    assert decide(9 * GiB, **room).nbytes == 9 * GiB  # type: ignore[arg-type]
    assert decide(9 * GiB + 256, **room).nbytes is None  # type: ignore[arg-type]
    nothing = decide(rest, **{**room, "free": GiB + 256 * MiB})  # type: ignore[arg-type]
    assert nothing.nbytes is None and nothing.reason == (
        "the device has 1.25 GiB free of 16.00 GiB total, 1.00 GiB of it claimed by roots "
        "still reserving, less 256.00 MiB of headroom, 0 B left: 'rest' is 100% of it, "
        "nothing")
