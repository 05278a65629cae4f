"""Chained block hashes for `BlockHashCacheManager`: one block's hash, and a whole sequence's at once.

Block ``i`` of a sequence is named by ``h_i = H(h_{i-1}, tokens of block i)``, with
``h_{-1} = ROOT_HASH_SEED``. The default ``H`` is chosen so that the whole chain can be computed
with a few NumPy operations over every block together, instead of a Python call per block:

    c_i = mix(sum_k t_{i,k} * P^(k+1))            (the block's content hash, mod 2**64)
    h_i = h_{i-1} * M + c_i                         (mod 2**64; M odd, hence invertible)

so ``h_i = M^i * (seed * M + sum_{j<=i} c_j * M^-j)``: a cumulative sum. ``mix(x) = (x ^ (x >> 32))
* K`` folds the high bits (which every token reaches) into the low ones.
The hash is not cryptographic; the manager compares tokens on every hit, so a collision (even a
deliberate one) can cost a cache hit but never returns another prefix's K/V. Values depend on
nothing but the tokens: equal in every process and run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from operator import mul

import numpy as np
import torch

from .._validate import check_token_ids
from .base import TOKEN_DTYPES, host_array

__all__ = [
    "ROOT_HASH_SEED",
    "HashFn",
    "default_block_hash",
    "token_array",
    "block_rows",
    "ChainHasher",
    "key_seed",
]

_MASK = (1 << 64) - 1
_INT64 = np.dtype(np.int64)
#: What block 0 of every sequence chains from.
ROOT_HASH_SEED = 0x6B7663616368655F  # "kvcache_"
_P = 0x9E3779B97F4A7C15  # token weights: powers of the golden-ratio constant
_M = 0xD6E8FEB86659FD93  # chain multiplier (odd)
_M_INV = pow(_M, -1, 1 << 64)

HashFn = Callable[[int, tuple[int, ...]], int]


_K = 0xBF58476D1CE4E5B9
_FEW = 2  # up to this many blocks, `ChainHasher.chain` hashes in plain Python
_K_NP, _SHIFT_NP = np.uint64(_K), np.uint64(32)


def _mix64(x: int) -> int:
    return ((x ^ (x >> 32)) * _K) & _MASK


def default_block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """``H(parent_hash, tokens)`` as an unsigned 64-bit int (the module docstring's formula).

    Tokens are taken as 64-bit two's-complement integers. Equal to what `ChainHasher` computes
    for a whole sequence at once.
    """
    c, w = 0, 1
    for t in tokens:
        w = (w * _P) & _MASK
        c = (c + (t & _MASK) * w) & _MASK
    return (parent_hash * _M + _mix64(c)) & _MASK


def key_seed(extra_key: Hashable) -> int:
    """What block 0 chains from under namespace ``extra_key``: `ROOT_HASH_SEED` for ``None``,
    else the seed mixed with a digest of ``repr(extra_key)`` and its type (the same in every
    process, unlike ``hash`` of a str). Keys are still compared on every hit: a digest that
    collides costs a hit, never another namespace's K/V."""
    if extra_key is None:
        return ROOT_HASH_SEED
    raw = f"{type(extra_key).__qualname__}:{extra_key!r}".encode()
    digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    return (ROOT_HASH_SEED ^ digest) & _MASK or 1


def token_array(input_ids: torch.Tensor) -> np.ndarray:
    """The ids of a validated 1-D integer CPU tensor as an ``int64`` NumPy array (a view when possible)."""
    a = input_ids.numpy()
    return a if a.dtype == np.int64 else a.astype(np.int64)


def block_rows(input_ids: torch.Tensor | np.ndarray, page_size: int, host: bool) -> np.ndarray:
    """The full blocks of ``input_ids`` as an ``(n, page_size)`` int64 array (a view when it can
    be), checked as `check_token_ids` checks a tensor; ``host``: a 1-D NumPy array of an integer
    dtype is taken too (checked as `host_array` checks)."""
    ids: np.ndarray | None
    if host and type(input_ids) is np.ndarray and input_ids.dtype == _INT64 and input_ids.ndim == 1:
        nb = len(input_ids) // page_size  # the flow's usual form, checked
        return input_ids[: nb * page_size].reshape(nb, page_size)
    if type(input_ids) is torch.Tensor and input_ids.is_cpu:
        try:
            ids = input_ids.numpy()
        except (TypeError, RuntimeError):  # sparse, or float that requires grad: checked below
            ids = None
    elif host and isinstance(input_ids, np.ndarray):
        ids = host_array(input_ids, "input_ids", TOKEN_DTYPES)
    else:
        ids = None
    if ids is None or ids.ndim != 1 or ids.dtype != _INT64:  # the usual case skips the checks
        if ids is None or not isinstance(input_ids, np.ndarray):
            ids = token_array(check_token_ids(input_ids))
        else:
            ids = ids.astype(np.int64)
    nb = len(ids) // page_size
    return ids[: nb * page_size].reshape(nb, page_size)


def _powers(base: int, n: int) -> np.ndarray:
    """``[base**0, base**1, ..., base**(n-1)]`` mod 2**64 as ``uint64``."""
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint64)


class ChainHasher:
    """Computes the chained hashes of every full block of a sequence.

    With the default hash the work is vectorised (a handful of NumPy passes over the tokens);
    with a caller's ``hash_fn`` it is one call per block, each result checked to be an int. Either
    way everything is computed before the manager changes anything, so a ``hash_fn`` that raises
    leaves the manager as it was.
    """

    def __init__(self, page_size: int, hash_fn: HashFn | None = None) -> None:
        self.page_size = page_size
        self.custom = hash_fn is not None and hash_fn is not default_block_hash
        self.hash_fn: HashFn = hash_fn if self.custom else default_block_hash  # type: ignore[assignment]
        # ``_token_weights`` (``P**1 .. P**page_size``, uint64) and ``_weights`` (the same as
        # ints) are made by `__getattr__` on first use: a block of ``page_size`` tokens is then
        # at hand, so a huge ``page_size`` costs nothing until a block that long is hashed.
        self._token_weights: np.ndarray
        self._weights: list[int]
        self._m_pow = _powers(_M, 1)
        self._k_m_inv_pow = _powers(_M_INV, 1) * _K_NP  # mix's factor K folded in: one pass fewer
        self._powers: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getattr__(self, name: str) -> object:
        # Only called for a missing attribute: the weights before their first use.
        if name not in ("_token_weights", "_weights"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._token_weights = _powers(_P, self.page_size + 1)[1:]
        self._weights = self._token_weights.tolist()
        return getattr(self, name)

    def one(self, parent_hash: int, tokens: tuple[int, ...]) -> int:
        """The hash of one block; ``TypeError`` when a custom ``hash_fn`` returns a non-int."""
        h = self.hash_fn(parent_hash, tokens)
        if isinstance(h, bool) or not isinstance(h, int):
            raise TypeError(f"hash_fn must return an int, got {type(h).__name__} ({h!r})")
        return h & _MASK

    def chain(self, blocks: np.ndarray, seed: int = ROOT_HASH_SEED) -> list[int]:
        """Hashes of the rows of ``blocks`` (shape ``(num_blocks, page_size)``, int64), in order."""
        return self.chain_array(blocks, seed)[0]

    def chain_array(
        self, blocks: np.ndarray, seed: int = ROOT_HASH_SEED
    ) -> tuple[list[int], np.ndarray | None]:
        """`chain`, and the same hashes as a ``uint64`` array when it computed one (the default
        hash over more than a few blocks; else ``None``): writing them into an array from it
        skips converting a list of ints."""
        nb = blocks.shape[0]
        if nb == 0:
            return [], None
        if self.custom:
            out: list[int] = []
            parent = seed
            for row in blocks.tolist():
                parent = self.one(parent, tuple(row))
                out.append(parent)
            return out, None
        if nb <= _FEW:  # a few blocks: plain ints beat NumPy's fixed cost per call
            weights, short = self._weights, []
            for row in blocks.tolist():
                c = sum(map(mul, row, weights)) & _MASK
                seed = (seed * _M + (((c ^ (c >> 32)) * _K) & _MASK)) & _MASK
                short.append(seed)
            return short, None
        powers = self._powers.get(nb)  # the first ``nb`` of each, sliced once per length
        if powers is None:
            if len(self._m_pow) < nb + 1:
                size = max(nb + 1, 2 * len(self._m_pow))
                self._m_pow, self._k_m_inv_pow = _powers(_M, size), _powers(_M_INV, size) * _K_NP
                self._powers = {}
            powers = self._powers[nb] = (self._k_m_inv_pow[:nb], self._m_pow[:nb])
        # Integer array arithmetic wraps modulo 2**64 without a warning (only scalars warn).
        # c_i * M^-i = ((x ^ (x >> 32)) * K) * M^-i, the last two factors precomputed as one.
        c = blocks.view(np.uint64) @ self._token_weights
        c ^= c >> _SHIFT_NP
        c *= powers[0]
        c[0] = (c.item(0) + seed * _M) & _MASK  # the seed's term joins every partial sum
        np.add.accumulate(c, out=c)  # uint64 in, uint64 out (the ufunc skips cumsum's wrappers)
        c *= powers[1]
        hashes: list[int] = c.tolist()
        return hashes, c
