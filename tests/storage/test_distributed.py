"""TP info is process-global state: every test starts and ends with it unset (the autouse fixture
in conftest.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.storage.distributed import (
    DistributedInfo,
    divide_even,
    get_tp_info,
    reset_tp_info,
    set_tp_info,
    try_get_tp_info,
)


def test_unset_by_default():
    assert try_get_tp_info() is None
    with pytest.raises(RuntimeError, match="set_tp_info"):
        get_tp_info()


def test_set_get_reset():
    info = set_tp_info(1, 4)
    assert info == DistributedInfo(1, 4)
    assert get_tp_info() == try_get_tp_info() == info
    assert (info.rank, info.size) == (1, 4)
    assert not info.is_primary and DistributedInfo(0, 4).is_primary
    set_tp_info(0, 2)  # replaces
    assert get_tp_info() == DistributedInfo(0, 2)
    reset_tp_info()
    assert try_get_tp_info() is None


def test_info_is_frozen():
    info = DistributedInfo(0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize("rank,size", [(-1, 2), (2, 2), (5, 2), (0, 0), (0, -1)])
def test_bad_rank_or_size(rank, size):
    with pytest.raises(ValueError, match=str(rank) if size >= 1 else "size"):
        DistributedInfo(rank, size)


def test_bad_set_keeps_old_value():
    set_tp_info(1, 2)
    with pytest.raises(ValueError):
        set_tp_info(2, 2)
    with pytest.raises(TypeError):
        set_tp_info(0.0, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        set_tp_info(True, 2)
    assert get_tp_info() == DistributedInfo(1, 2)


def test_divide_even():
    assert divide_even(32, 4) == 8
    assert divide_even(0, 3) == 0
    assert divide_even(7, 1) == 7
    with pytest.raises(ValueError, match=r"\b6\b.*\b4\b"):
        divide_even(6, 4)
    for b in (0, -2):
        with pytest.raises(ValueError, match=str(b)):
            divide_even(6, b)
    with pytest.raises(ValueError, match="-4"):
        divide_even(-4, 2)
    with pytest.raises(TypeError):
        divide_even(6.0, 2)  # type: ignore[arg-type]


@settings(max_examples=50, derandomize=True, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 64))
def test_divide_even_matches_modulo(a, b):
    if a % b == 0:
        assert divide_even(a, b) * b == a
    else:
        with pytest.raises(ValueError):
            divide_even(a, b)
