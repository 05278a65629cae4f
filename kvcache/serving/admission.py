"""The order in which a scheduler tries its waiting requests: the admission policies.

Every policy orders the same thing, the waiting queue, and only *looks* at the cache: a match
asked for ordering never moves a page between tiers (a host tier answers `peek_prefix`, see
`cached_prefix_len`).

* ``"fcfs"``: the queue's own order (arrival; preempted requests go back to its front).
* ``"lpm"``: longest cached prefix first, as SGLang's ``CacheAwarePolicy.LPM``
  (``python/sglang/srt/managers/schedule_policy.py``, ``_sort_by_longest_prefix``, checked at
  sgl-project/sglang commit ``00550cd1``); stable, so ties keep the queue's order. With
  *in-batch prefix caching* (``in_batch_prefix=k``, SGLang's
  ``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`` and ``..._DEPRIORITIZE_THRESHOLD``, both 32 there):
  a request whose cached match is at most ``k`` tokens and whose first ``k`` tokens equal those
  of an earlier such request in the queue waits behind everyone else this step, so that the
  prefix they share is computed once, by the first, and found cached by the rest.
* ``"dfs_weight"``: SGLang's ``CacheAwarePolicy.DFS_WEIGHT``: the requests hang in the cache's
  tree at the node their cached match ends (namespaces apart); a node weighs the requests in its
  subtree; a depth-first walk takes the heavier child first and a node's own requests after its
  children. Requests that share a cached prefix run together, the largest group first; requests
  with no cached prefix come last. Built here from each request's matched tokens, so it works
  with any manager, not only a radix tree.
* ``"priority"``: smallest ``priority`` first, then arrival (vLLM's ``policy="priority"``:
  its waiting queue is a heap on ``(priority, arrival_time)``, ``vllm/v1/core/sched/
  request_queue.py``).

SGLang matches every waiting request only while at most 128 wait (``_determine_active_policy``);
past that LPM falls back to FCFS, and so does ours (``lpm_queue_limit``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ..managers.base import BaseCacheManager

__all__ = [
    "ADMISSION_POLICIES",
    "CACHE_AWARE",
    "cached_prefix_len",
    "dfs_weight_order",
    "in_batch_deprioritized",
]

#: The orders in which a `Scheduler` tries its waiting requests (see this module's docstring).
ADMISSION_POLICIES = ("fcfs", "lpm", "dfs_weight", "priority")
#: The policies that match every waiting request against the cache.
CACHE_AWARE = ("lpm", "dfs_weight")


def cached_prefix_len(manager: BaseCacheManager, ids: torch.Tensor, extra_key: Hashable) -> int:
    """Leading tokens of ``ids`` the manager would serve without computing them, found by
    looking only: a manager with ``peek_prefix`` (the host tier, which would otherwise load
    pages back from the host to answer) is asked that; any other is asked `match_prefix`, whose
    only side effects are an LRU refresh and a node split."""
    peek = getattr(manager, "peek_prefix", None)
    if callable(peek):
        return int(peek(ids, extra_key))
    handle, _ = (
        manager.match_prefix(ids) if extra_key is None else manager.match_prefix(ids, extra_key)
    )
    return handle.cached_len


def in_batch_deprioritized(
    tokens: Sequence[np.ndarray], cached: Sequence[int], keys: Sequence[Hashable], k: int
) -> set[int]:
    """Which of the waiting requests (``tokens[i]`` in queue order, ``cached[i]`` of them
    cached, namespace ``keys[i]``) in-batch prefix caching holds back: those with at most ``k``
    cached tokens whose first ``k`` tokens equal those of an earlier request with at most ``k``
    cached that was not held back (SGLang's ``_compute_prefix_matches``: its waiting-queue tree
    answers a match of ``k`` tokens or more exactly when the first ``k`` agree)."""
    seen: set[tuple[Hashable, bytes]] = set()
    held: set[int] = set()
    for i, (ids, c, key) in enumerate(zip(tokens, cached, keys, strict=True)):
        if c > k:
            continue
        head = (key, ids[:k].tobytes())
        if len(ids) >= k and head in seen:
            held.add(i)
        elif len(ids) >= k:
            seen.add(head)
    return held


def dfs_weight_order(prefixes: Sequence[np.ndarray], keys: Sequence[Hashable]) -> list[int]:
    """The indices of the requests whose cached matches are ``prefixes[i]`` (namespace
    ``keys[i]``) in DFS-weight order (see the module docstring). Ties between children keep
    the order in which their first request appears."""
    order: list[int] = []
    empty = [i for i, p in enumerate(prefixes) if len(p) == 0]  # they hang at the root
    spaces: dict[Hashable, list[int]] = {}
    for i, p in enumerate(prefixes):
        if len(p):
            spaces.setdefault(keys[i], []).append(i)
    for members in sorted(spaces.values(), key=len, reverse=True):
        order.extend(_visit(prefixes, members, _common(prefixes, members, 0)))
    return order + empty


def _common(prefixes: Sequence[np.ndarray], members: list[int], depth: int) -> int:
    """How far from ``depth`` on the prefixes of ``members`` agree (at most the shortest)."""
    shortest = min(len(prefixes[i]) for i in members)
    if len(members) == 1 or shortest == depth:
        return shortest
    stack = np.stack([prefixes[i][depth:shortest] for i in members])
    differ = np.flatnonzero((stack != stack[0]).any(axis=0))
    return depth + int(differ[0]) if len(differ) else shortest


def _visit(prefixes: Sequence[np.ndarray], members: list[int], depth: int) -> list[int]:
    """DFS-weight order of ``members``, whose prefixes agree up to ``depth`` (a node of the
    tree): the children (grouped by the next token), heaviest first, then the node's own."""
    own = [i for i in members if len(prefixes[i]) == depth]
    children: dict[int, list[int]] = {}
    for i in members:
        if len(prefixes[i]) > depth:
            children.setdefault(int(prefixes[i][depth]), []).append(i)
    out: list[int] = []
    for group in sorted(children.values(), key=len, reverse=True):
        out.extend(_visit(prefixes, group, _common(prefixes, group, depth + 1)))
    return out + own
