"""The shared converters of `kvcache._validate`: ids and slots as the package computes with them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache._validate import slot_array, token_ids

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_token_ids_every_integer_dtype(dtype):
    t = torch.tensor([1, 2, 3], dtype=dtype)
    ids = token_ids(t)
    assert ids.dtype == np.int64 and ids.flags.c_contiguous and ids.tolist() == [1, 2, 3]


def test_token_ids_is_a_view_of_int64():
    t = torch.tensor([5, 6, 7])
    ids = token_ids(t)
    t[0] = 9
    assert ids[0] == 9


def test_token_ids_of_a_strided_tensor_is_contiguous():
    t = torch.arange(10)[::2]
    assert token_ids(t).tolist() == [0, 2, 4, 6, 8]
    assert token_ids(t).flags.c_contiguous


@pytest.mark.parametrize(
    "bad, err",
    [
        ([1, 2], TypeError),
        (np.array([1, 2]), TypeError),
        (torch.tensor([1.0, 2.0]), TypeError),
        (torch.tensor([True, False]), TypeError),
        (torch.tensor([[1, 2]]), ValueError),
        (torch.tensor([1, 2]).to_sparse(), TypeError),
    ],
)
def test_token_ids_refuses_what_check_token_ids_refuses(bad, err):
    with pytest.raises(err, match="input_ids"):
        token_ids(bad)


def test_slot_array_view_and_errors():
    t = torch.tensor([3, 4], dtype=torch.int32)
    s = slot_array(t, CPU)
    assert s.dtype == np.int32 and s.tolist() == [3, 4]
    t[1] = 8
    assert s[1] == 8
    with pytest.raises(TypeError, match=r"torch\.int32"):
        slot_array(torch.tensor([1, 2]), CPU)
    with pytest.raises(ValueError, match="1-D"):
        slot_array(torch.zeros(2, 2, dtype=torch.int32), CPU)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        slot_array(np.array([1], dtype=np.int32), CPU, name="out_loc")
    with pytest.raises(ValueError, match="device meta"):
        slot_array(torch.tensor([1], dtype=torch.int32), torch.device("meta"))
