"""Argument checks shared by the package. Each raises with the offending value and the limit."""

from __future__ import annotations

import operator

import torch

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_token_ids(input_ids: object, name: str = "input_ids") -> torch.Tensor:
    """Token ids must be a 1-D integer tensor on the CPU."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype, got {input_ids.dtype}")
    if input_ids.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {input_ids.device}")
    return input_ids


def check_indices(indices: object, device: torch.device, name: str = "indices") -> torch.Tensor:
    """KV-slot indices must be a 1-D ``torch.int32`` tensor on ``device``."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {indices.dtype}")
    if indices.device != device:
        raise ValueError(f"{name} must be on device {device}, got {indices.device}")
    return indices


def check_size(size: object, name: str = "size") -> int:
    """A token count: a non-negative Python int (bools are refused)."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"{name} must be an int, got {type(size).__name__}")
    if size < 0:
        raise ValueError(f"{name} must be >= 0, got {size}")
    return size


def check_positive_int(value: object, name: str) -> int:
    """A strictly positive Python int (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_count(value: object, name: str = "size") -> int:
    """A non-negative token count as a Python int: an int, a NumPy integer or a 0-d integer
    tensor; bools (of any kind), floats and complex numbers are refused with ``TypeError``."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype not in _INT_DTYPES:
            raise TypeError(f"{name} must be an int, got a tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
        value = int(value.item())
    else:
        try:
            if type(value).__name__ in ("bool", "bool_"):
                raise TypeError
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
