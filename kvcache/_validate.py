"""Argument checks and index plumbing shared by the package. Each check raises with the offending
value and the limit; none changes anything.

One home for what managers, the allocator and the flow all need: integer arguments (a real
integer, never ``bool``, ``float`` or ``complex``), token-id and slot tensors, the length-mismatch
error, page alignment, and the page <-> slot arithmetic. The arithmetic works on NumPy arrays:
the bookkeeping arrays are small, and a NumPy op on them costs a fraction of a torch dispatch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_INT_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))

_UNSIGNED = {4: np.uint32, 8: np.uint64}
_NP_INT_DTYPES = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8))
_I64, _I32 = np.dtype(np.int64), np.dtype(np.int32)
_CPU = torch.device("cpu")

#: Slots are ``torch.int32``: a pool may hold at most this many token slots.
MAX_SLOTS = 2**31 - 1

Device = torch.device | str


# ------------------------------------------------------------------------------ integers
def as_int(value: object, name: str) -> int:
    """``value`` as a Python int, if it is a real integer.

    Accepted: a Python ``int``, a NumPy integer scalar, a 0-d integer torch tensor (an element
    of an integer tensor). Refused with ``TypeError``: ``bool`` (of any library), floats (even
    ``2.0``), complex numbers, strings, anything else.
    """
    if type(value) is int:  # the common case first, one type() call
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    if isinstance(value, int):  # int subclasses other than bool (e.g. IntEnum)
        return int(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype in _INT_DTYPES:
        return int(value.item())
    what = (
        f"tensor of dtype {value.dtype} and shape {tuple(value.shape)}"
        if isinstance(value, torch.Tensor)
        else f"{type(value).__name__} {value!r}"
    )
    raise TypeError(f"{name} must be an integer (int, or a NumPy/torch integer scalar), got {what}")


def check_size(size: object, name: str = "size") -> int:
    """A token count: a non-negative real integer, returned as a Python int."""
    value = as_int(size, name)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_positive_int(value: object, name: str) -> int:
    """A strictly positive real integer, returned as a Python int."""
    v = as_int(value, name)
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def check_page_size(value: object, name: str = "page_size") -> int:
    """Tokens per page: an integer in ``[1, MAX_SLOTS]`` (a page's slots are int32, so no pool
    holds a larger page), returned as a Python int, never a NumPy or torch scalar."""
    v = check_positive_int(value, name)
    if v > MAX_SLOTS:
        raise ValueError(f"{name} must be <= {MAX_SLOTS} (a page's slots are int32), got {v}")
    return v


def check_int_in(value: object, name: str, lo: int, hi: int) -> int:
    """A real integer in ``[lo, hi]`` (both ends included), returned as a Python int."""
    v = as_int(value, name)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


# ------------------------------------------------------------------------------ tensors
def check_dense(t: torch.Tensor, name: str) -> None:
    """``TypeError`` unless ``t`` is a dense (strided) tensor: a sparse one has no NumPy view,
    no strides and no data pointer, so every later step would fail inside torch."""
    if t.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def check_token_ids(input_ids: object, name: str = "input_ids") -> torch.Tensor:
    """Token ids must be a dense 1-D integer tensor on the CPU."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(input_ids).__name__}")
    check_dense(input_ids, name)
    if input_ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype, got {input_ids.dtype}")
    if not input_ids.is_cpu:
        raise ValueError(f"{name} must be on the CPU, got device {input_ids.device}")
    return input_ids


def as_list(values: object, name: str, what: str) -> list[Any]:
    """``list(values)``; ``TypeError`` naming ``name`` when ``values`` is not iterable (an int, a
    float, ``None``, a 0-d tensor or array), instead of Python's "object is not iterable"."""
    try:
        items = iter(values)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"{name} must be a sequence of {what}, got {type(values).__name__}"
        ) from None
    return list(items)


def reject_one_tensor(values: object, name: str) -> None:
    """``TypeError`` if ``values``, meant to be a sequence of 1-D token-id tensors, is one tensor
    (iterating it would give its rows or elements)."""
    if isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a sequence of 1-D token-id tensors, got one tensor")


def check_indices(indices: object, device: torch.device, name: str = "indices") -> torch.Tensor:
    """KV-slot indices must be a dense 1-D ``torch.int32`` tensor on ``device``."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(indices).__name__}")
    check_dense(indices, name)
    if indices.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {indices.dtype}")
    if indices.device != device:
        raise ValueError(f"{name} must be on device {device}, got {indices.device}")
    return indices


def token_ids(input_ids: object, name: str = "input_ids") -> np.ndarray:
    """Token ids as the package computes with them: a C-contiguous 1-D ``int64`` NumPy array.

    ``input_ids`` must be what `check_token_ids` accepts (a dense 1-D integer tensor on the
    CPU; same errors). Returns a view of its memory when it is C-contiguous int64 already (the
    common case costs one ``numpy()`` call), a converted copy otherwise.
    """
    ids: np.ndarray | None = None
    if isinstance(input_ids, torch.Tensor):
        try:
            ids = input_ids.numpy()  # only a dense CPU tensor gets past here
        except (TypeError, RuntimeError):  # sparse, or requires grad
            ids = None
    if ids is not None and ids.dtype is _I64 and ids.ndim == 1 and ids.flags.c_contiguous:
        return ids
    if ids is None or ids.ndim != 1 or ids.dtype not in _NP_INT_DTYPES:
        check_token_ids(input_ids, name)  # raises with the standard message
        raise TypeError(f"{name} must be a 1-D integer tensor on the CPU, got {input_ids!r:.80}")
    return np.ascontiguousarray(ids, dtype=np.int64)


def slot_array(indices: object, device: torch.device, name: str = "indices") -> np.ndarray:
    """KV slots as the package computes with them: a 1-D ``int32`` NumPy array on the host.

    ``indices`` must be what `check_indices` accepts (a dense 1-D ``torch.int32`` tensor on
    ``device``; same errors). On the CPU the result is a view of its memory; from another
    device, a host copy (one transfer).
    """
    if device != _CPU and device.type != "cpu":  # ``!=`` first: reading ``type`` costs more
        return check_indices(indices, device, name).cpu().numpy()
    slots: np.ndarray | None = None
    if isinstance(indices, torch.Tensor):
        try:
            slots = indices.numpy()
        except (TypeError, RuntimeError):
            slots = None
    if slots is not None and slots.dtype is _I32 and slots.ndim == 1:
        return slots
    check_indices(indices, device, name)  # raises with the standard message
    raise TypeError(f"{name} must be a 1-D torch.int32 tensor on {device}, got {indices!r:.80}")


def native_order(arr: np.ndarray) -> np.ndarray:
    """``arr`` with its values in this machine's byte order: itself, or a converted copy (a
    big-endian array read through a native view would see other values)."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def check_id_array(ids: object, name: str, limit: int) -> np.ndarray:
    """Page ids or slots: a 1-D integer tensor (any device) or NumPy array, of values in
    ``[0, limit)``.

    The range is checked on the values as given, before any cast, so ``2**32 + 1`` is refused
    instead of wrapping to ``1``. Returns the values on the host as an ``int32`` NumPy array
    (a view where they already are CPU int32). ``bool``, float and complex dtypes are refused
    with ``TypeError``; values out of range with ``ValueError``.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in _INT_DTYPES:
            raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
        try:
            arr = ids.numpy() if ids.is_cpu else ids.cpu().numpy()
        except (TypeError, RuntimeError, NotImplementedError):
            check_dense(ids, name)  # the usual cause: a sparse tensor
            raise TypeError(
                f"{name} must be a dense tensor with a host copy, got {ids!r:.80}"
            ) from None
    elif isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
        arr = native_order(ids)
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(ids).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.shape[0]:
        # One reduction for both ends: seen as unsigned, a negative value is larger than any limit.
        wide = arr if arr.itemsize >= 4 else arr.astype(np.int64)
        if int(wide.view(_UNSIGNED[wide.itemsize]).max()) >= limit:
            lo, hi = int(arr.min()), int(arr.max())
            raise ValueError(f"{name}: {lo if lo < 0 else hi} is outside [0, {limit})")
    return arr if arr.dtype == np.int32 else arr.astype(np.int32)


def check_slot_tensor(
    slots: object, name: str, num_slots: int, device: torch.device
) -> torch.Tensor:
    """Token slots of a pool: a 1-D integer tensor on ``device`` of values in ``[0, num_slots)``.

    Checked on the values as given, before any cast (on a GPU the range check reads two
    numbers back to the host, in one transfer). ``TypeError`` for a non-integer dtype (bool,
    float, complex), ``ValueError`` for a wrong shape, device or range.
    """
    return check_slot_tensors([slots], name, num_slots, device, names=[name])[0]


def check_slot_tensors(
    slots: Sequence[object],
    name: str,
    num_slots: int,
    device: torch.device,
    names: Sequence[str] | None = None,
) -> list[torch.Tensor]:
    """:func:`check_slot_tensor` for each of a batch's slot tensors (named ``name[r]``, or
    ``names[r]``), with one range read-back for the whole batch: on a GPU one sync, not one per
    request. The tensor at fault is looked for only when a value is out of range, so the error
    names it."""
    labels = list(names) if names is not None else [f"{name}[{r}]" for r in range(len(slots))]
    checked: list[torch.Tensor] = []
    for label, s in zip(labels, slots, strict=True):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(s).__name__}")
        check_dense(s, label)
        if s.dim() != 1:
            raise ValueError(f"{label} must be 1-D, got shape {tuple(s.shape)}")
        if s.dtype not in _INT_DTYPES:
            raise TypeError(f"{label} must have an integer dtype, got {s.dtype}")
        if s.device != device:
            raise ValueError(f"{label} must be on device {device}, got {s.device}")
        checked.append(s)
    nonempty = [s for s in checked if s.shape[0]]
    if nonempty:
        lo, hi = min_max(nonempty[0] if len(nonempty) == 1 else torch.cat(nonempty))
        if lo < 0 or hi >= num_slots:
            for label, s in zip(labels, checked, strict=True):
                lo, hi = min_max(s) if s.shape[0] else (0, 0)
                if lo < 0 or hi >= num_slots:
                    raise ValueError(f"{label}: {lo if lo < 0 else hi} is outside [0, {num_slots})")
    return checked


def min_max(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of a non-empty integer tensor, read back to the host in one transfer (on a
    GPU, one sync rather than one per value)."""
    lo_hi = torch.aminmax(t)
    if t.device.type == "cpu":
        return int(lo_hi[0]), int(lo_hi[1])
    lo, hi = torch.stack(lo_hi).tolist()
    return int(lo), int(hi)


def check_same_length(
    n: int, expected: int, name: str = "indices", expected_name: str = "input_ids"
) -> None:
    """The length-mismatch error: ``len(name)`` must equal ``len(expected_name)``."""
    if n != expected:
        raise ValueError(f"len({name}) ({n}) must equal len({expected_name}) ({expected})")


def as_device(device: object, name: str = "device") -> torch.device:
    """``torch.device(device)``: ``TypeError`` for anything but a ``str`` or ``torch.device``,
    ``ValueError`` for a name torch does not know. Whether it exists here is not asked."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a torch.device or str, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name} {device!r} is not a device torch knows: {e}") from None


def check_device(device: object, name: str = "device") -> torch.device:
    """A ``torch.device`` (or its name) that exists on this machine: `as_device`, and
    ``ValueError`` for a device that is not available (e.g. ``"cuda"`` without a GPU)."""
    dev = as_device(device, name)
    if dev.type == "cpu":
        return dev
    try:
        torch.empty(0, device=dev)
    except (
        RuntimeError,
        AssertionError,
    ) as e:  # torch raises AssertionError when built without CUDA
        raise ValueError(f"{name} {str(dev)!r} is not available on this machine: {e}") from None
    return dev


# ------------------------------------------------------------------------------ pages and slots
def pages_to_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Slots of ``pages`` (1-D integer array), page after page: ``(len(pages) * page_size,)``.

    No checks: the caller passes valid page ids of a pool whose slots fit in ``int32``.
    """
    if page_size == 1:
        return pages
    return (pages[:, None] * page_size + np.arange(page_size, dtype=pages.dtype)).reshape(-1)


def slots_to_pages(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The distinct pages that ``slots`` touch, in first-touch order (a run of slots of one page
    gives that page once). No checks."""
    if page_size == 1 or slots.shape[0] == 0:
        return slots
    pages = slots // page_size
    if pages.shape[0] == 1:
        return pages
    keep = np.empty(pages.shape[0], dtype=np.bool_)
    keep[0] = True
    np.not_equal(pages[1:], pages[:-1], out=keep[1:])
    return pages[keep]


def aligned_run_pages(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The pages of a run of slots laid page after page from a page start (a request's own slots
    from a page-aligned position): every ``page_size``-th slot, divided. No checks."""
    return slots if page_size == 1 else slots[::page_size] // page_size


def check_page_aligned(slots: np.ndarray, page_size: int, name: str = "indices") -> None:
    """Every ``page_size`` entries of ``slots`` must be the consecutive slots of one page.

    ``slots``: 1-D, its length a multiple of ``page_size``. ``ValueError`` otherwise.
    """
    if page_size == 1 or slots.shape[0] == 0:
        return
    rows = slots.reshape(-1, page_size)
    # Each row against its page's slots: a first slot that is no multiple of page_size fails too.
    starts = rows[:, 0] // page_size * page_size
    if np.count_nonzero(rows - starts[:, None] != np.arange(page_size, dtype=rows.dtype)):
        shown = slots[: 4 * page_size].tolist()
        raise ValueError(
            f"with page_size={page_size} every {page_size} {name} must be the consecutive slots of one page "
            f"(first slot a multiple of {page_size}); got {shown}{' ...' if slots.shape[0] > len(shown) else ''}"
        )


def check_count(value: object, name: str = "size") -> int:
    """A non-negative token count as a Python int: `check_size` under the name the block-hash
    manager uses (ints, NumPy integers, 0-d integer tensors; never bool, float or complex)."""
    return check_size(value, name)


def check_host_bytes(nbytes: int, what: str) -> None:
    """``ValueError`` when ``what`` would need more host memory (``nbytes``) than the machine has
    in all: refused by name at once, where the allocation would fail late or be killed."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): nothing to check against
        return
    if total > 0 and nbytes > total:
        raise ValueError(
            f"{what} needs {nbytes / 2**30:.1f} GiB of host memory; this machine has "
            f"{total / 2**30:.1f} GiB"
        )
