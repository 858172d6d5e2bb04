"""What a rank's error and seed cost: its traceback text is the standard one (formatted once per place
the frames stood), and seeding a rank seeds what ``torch.manual_seed`` seeds."""

from __future__ import annotations

import builtins
import sys
import traceback

import pytest
import torch

import tpsim
from tpsim.comm.scheduler import format_exception
from tpsim.seeding import manual_seed


def _refuse(n: int) -> None:
    if n % 2:
        raise ValueError(f"n={n} is not divisible by 2")


def _wrapped(n: int) -> None:
    try:
        _refuse(n)
    except ValueError as err:
        raise RuntimeError("the build failed") from err


def _during(n: int) -> None:
    try:
        _refuse(n)
    except ValueError:
        raise KeyError(n)  # noqa: B904 - an implicit context is what is tested


def _recurse() -> None:
    _recurse()


def _raised(fn, *args) -> BaseException:
    try:
        fn(*args)
    except BaseException as err:  # noqa: BLE001
        return err
    raise AssertionError(f"{fn.__name__} did not raise")


@pytest.mark.parametrize("fn, args", [(_refuse, (3,)), (_wrapped, (3,)), (_during, (5,)), (_recurse, ())])
def test_a_rank_traceback_is_the_standard_text(fn, args) -> None:
    err = _raised(fn, *args)
    assert format_exception(err) == "".join(traceback.format_exception(err))


def test_the_same_frames_with_another_message_keep_their_own_message() -> None:
    # The frames are formatted once; the message, which differs at every case, never comes from the cache.
    first, second = _raised(_wrapped, 3), _raised(_wrapped, 7)
    assert "n=3 is not" in format_exception(first) and "n=7 is not" not in format_exception(first)
    assert "n=7 is not" in format_exception(second) and "n=3 is not" not in format_exception(second)
    assert format_exception(second) == "".join(traceback.format_exception(second))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are Python 3.11+")
def test_an_exception_group_keeps_the_standard_layout() -> None:
    group = getattr(builtins, "ExceptionGroup")  # noqa: B009 - a name Python 3.10 lacks
    err = _raised(lambda: (_ for _ in ()).throw(group("ranks", [ValueError("a"), KeyError("b")])))
    assert format_exception(err) == "".join(traceback.format_exception(err))


def test_seeding_a_rank_gives_the_numbers_torch_manual_seed_gives() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(5), torch.randn(3, dtype=torch.float64)
    torch.manual_seed(99)
    manual_seed(1234)
    got = torch.rand(5), torch.randn(3, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_rank_that_refuses_reports_its_own_traceback_in_a_run() -> None:
    def refuse() -> None:
        _wrapped(3)

    with pytest.raises(tpsim.RankError) as info:
        tpsim.run_world(refuse, world_size=2, backend="inproc", timeout=20.0)
    text = info.value.remote_traceback
    assert "in _refuse" in text and "ValueError: n=3 is not divisible by 2" in text
    assert "RuntimeError: the build failed" in text
