"""An insert's new blocks for `BlockHashCacheManager`: the check of their pages and the filing of
their keys (with the collision probing `block_lookup` describes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .._validate import check_indices, check_int_in
from .base import SLOT_DTYPES, host_array
from .block_pool import BlockTable

__all__ = ["slot_rows", "new_pages", "file_keys", "row_bytes", "max_pages_for"]

_INT32 = np.dtype(np.int32)


def row_bytes(page_size: int) -> int:
    """Bytes a `BlockTable` keeps per page id: tokens (int64) and slots (int32) of a page, its key,
    six int64 fields and its free-queue position."""
    return 12 * page_size + 64


#: The block table a manager grows to by default, at most: 4 GiB, some 17 million pages of 16
#: tokens (277 million slots) or 63 million of one, past any pool a GPU holds.
DEFAULT_TABLE_BYTES = 4 << 30


def max_pages_for(max_pages: object, page_size: int) -> int:
    """``max_pages`` checked (an integer in ``[1, 2**31 // page_size]``: int32 slots), or for
    ``None`` as many pages as `DEFAULT_TABLE_BYTES` of block table holds."""
    top = (1 << 31) // page_size
    if max_pages is None:
        return min(DEFAULT_TABLE_BYTES // row_bytes(page_size), top)
    return check_int_in(max_pages, "max_pages", 1, top)


def slot_rows(
    indices: torch.Tensor | np.ndarray, device: torch.device, on_cpu: bool, host: bool
) -> np.ndarray:
    """``indices`` as 1-D int32 NumPy on the host, checked as `check_indices` checks a tensor;
    ``host``: a NumPy array is taken too (1-D int32, checked as `host_array` checks)."""
    if host and type(indices) is np.ndarray and indices.dtype == _INT32 and indices.ndim == 1:
        return indices  # the flow's form
    if type(indices) is torch.Tensor and indices.is_cpu and on_cpu:
        try:
            slots: np.ndarray = indices.numpy()
        except (TypeError, RuntimeError):  # no NumPy view (sparse): the checks name why
            check_indices(indices, device)
            raise
        if slots.ndim != 1 or slots.dtype != _INT32:
            check_indices(indices, device)  # raises
        return slots
    if host and isinstance(indices, np.ndarray):
        return host_array(indices, "indices", SLOT_DTYPES)
    out: np.ndarray = check_indices(indices, device).cpu().numpy()
    return out


_MASK = (1 << 64) - 1
_NONE = np.int64(-1).tobytes()  # ``gen`` of a page that holds no block


def new_pages(
    new: np.ndarray, page_size: int, table: BlockTable
) -> tuple[np.ndarray, list[int], int]:
    """The pages of the new blocks' slots ``new`` (int32, validated, whole blocks), checked; as
    an int64 array, as a list, and the largest (``-1`` when all are within ``table``'s capacity).

    Each block's slots must be the ``page_size`` consecutive slots of one page (``>= 0``, the
    first a multiple of ``page_size``); no page may already be cached or appear twice.
    ``ValueError`` naming the page or slots otherwise. NumPy, no per-block Python work.
    """
    ps = page_size
    pages = np.floor_divide(new[::ps], ps, dtype=np.int64) if ps > 1 else new.astype(np.int64)
    # The usual case in one comparison: a negative page reads a row from the end of the table
    # (nonnegative slots, or the spare row's, which no block of page -1 has), which cannot equal
    # its slots, and one past the end raises, so equal bytes mean every page is inside the table
    # and every block's slots are its page's.
    try:
        usual = ps > 1 and table.slot_rows[pages].tobytes() == new.tobytes()
    except IndexError:
        usual = False
    if usual:
        top = -1
        # A page that holds no block has gen -1: all bytes 0xff.
        taken_by = 0 if table.gen[pages].tobytes() != _NONE * len(pages) else -1
    # Seen unsigned, a negative page is huge: one pass bounds the pages on both sides.
    elif (top := int(np.maximum.reduce(pages.view(np.uint64)))) < table.capacity:
        if ps > 1 and table.slots.take(pages, axis=0).tobytes() != new.tobytes():
            _bad_slots(new, ps)
        taken_by = int(np.maximum.reduce(table.gen[pages]))  # -1: no block on any of them
    else:
        if np.count_nonzero(new < 0):
            raise ValueError(f"indices must be >= 0, got {int(new.min())}")
        if ps > 1 and np.count_nonzero(
            new.reshape(-1, ps) != (pages * ps)[:, None] + np.arange(ps, dtype=np.int32)
        ):
            _bad_slots(new, ps)
        taken_by = 0 if np.count_nonzero(table.holds(pages)) else -1
        if top >= table.max_pages:
            raise ValueError(
                f"indices: page {top} (slots {top * ps}..{(top + 1) * ps - 1}) is past this "
                f"manager's max_pages={table.max_pages}: its block table keeps "
                f"{row_bytes(ps)} bytes for every page id up to the largest cached, so pass "
                "max_pages (the pool's page count) to cache pages past it"
            )
    if taken_by >= 0:
        page = int(pages[table.holds(pages).argmax()])
        raise ValueError(
            f"page {page} (slots {page * ps}..{(page + 1) * ps - 1}) already holds cached "
            f"block {int(table.key[page]):#018x}; a page can be cached once"
        )
    listed: list[int] = pages.tolist()
    if len(set(listed)) != len(listed):
        dup = next(p for p in listed if listed.count(p) > 1)
        raise ValueError(f"page {dup} appears in more than one new block of this insert")
    return pages, listed, top


def _bad_slots(new: np.ndarray, ps: int) -> None:
    if np.count_nonzero(new < 0):
        raise ValueError(f"indices must be >= 0, got {int(new.min())}")
    raise ValueError(
        f"with page_size={ps} every {ps} indices must be the consecutive slots of one page "
        f"(first slot a multiple of {ps}); got {new.tolist()}"
    )


def file_keys(
    table: BlockTable, new_hashes: Sequence[int], listed: list[int]
) -> tuple[Sequence[int], list[int] | None]:
    """File new blocks with these hashes, on pages ``listed``, in ``table.page_of``; return
    their keys and probe offsets (``None``: all 0).

    Each key is the block's hash, or the next key (``hash + 1``, ...) that neither a cached block
    nor an earlier new one holds. Nothing raises. Raises ``table.max_probe`` when a probe goes
    further than any before."""
    taken = table.page_of
    before = len(taken)
    # Usually every hash is a new key. (Equal lengths: no ``strict``, whose check costs more.)
    taken.update(zip(new_hashes, listed))  # noqa: B905
    if len(taken) == before + len(new_hashes):
        return new_hashes, None
    # A hash was taken (by a cached block or an earlier new one): undo, then probe. A cached
    # block's key is still in ``table.key`` (its value was overwritten above, its place kept).
    for h in new_hashes:
        held = np.flatnonzero((table.key == np.uint64(h)) & (table.gen >= 0))
        if len(held):
            taken[h] = int(held[0])
        else:
            taken.pop(h, None)
    keys: list[int] = []
    probes: list[int] = []
    mine: set[int] = set()
    for h in new_hashes:
        key, probe = h, 0
        while key in taken or key in mine:
            probe += 1
            key = (h + probe) & _MASK
        keys.append(key)
        probes.append(probe)
        mine.add(key)
    table.max_probe = max(table.max_probe, *probes)
    taken.update(zip(keys, listed, strict=True))
    return keys, probes
