"""Conversations that resend their history, branch from an earlier turn or edit it, through the
flow: the block-hash manager's insert takes the chain of the handle it releases as known and
hashes only what comes after it, and must decide exactly as a manager that hashes every block of
every request. The reference is the benchmark's vLLM stand-in, which hashes every block with
SHA-256 and carries nothing from one request to the next. (This file once tested a memo of recent
sequences the manager kept; the memo is gone, the decisions it had to keep are the same.)"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockHashCacheManager, PageAllocator, RequestFlow
from kvcache.examples.vllm_standin import VllmStandIn

#: One step of a trace: which conversation, how it goes on (0: resend the history with a new
#: message, 1: branch from an earlier turn, 2: edit one token of the history), how many new
#: tokens, where the branch or edit is. Every new token is fresh: a block's content is repeated
#: only by resending it, never by chance (inserts that repeat cached blocks by chance are
#: driven in test_block_vllm_decisions.py).
_steps = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(1, 9), st.integers(0, 30)),
    min_size=1,
    max_size=30,
)


def _weak(parent: int, tokens: tuple[int, ...]) -> int:
    """A hash that collides on purpose: tokens must be compared on every hit."""
    return (parent + tokens[0]) % 5


def _run(steps: list, ps: int, pool_tokens: int, hash_fn: object) -> None:
    pool_pages = pool_tokens // ps
    made = BlockHashCacheManager("cpu", ps) if hash_fn is None else None
    ours = made or BlockHashCacheManager("cpu", ps, hash_fn=hash_fn)  # type: ignore[arg-type]
    flows = [
        RequestFlow(ours, PageAllocator(pool_pages, ps)),
        RequestFlow(VllmStandIn("cpu", ps), PageAllocator(pool_pages, ps)),
    ]
    fresh = iter(range(10, 10**6)).__next__
    turns: list[list[list[int]]] = [[[c, c, c]] for c in range(3)]  # the states of each one
    for conv, how, num_new, where in steps:
        states = turns[conv]
        base = list(states[-1])
        if how == 1:
            base = list(states[where % len(states)])
        elif how == 2:
            base[where % len(base)] = fresh()
        if len(base) + num_new > 28:  # a request must fit the pool: start the conversation over
            base = list(states[0])
        new = [fresh() for _ in range(num_new)]
        out = [fresh(), fresh()]
        prompt = torch.tensor(base + new, dtype=torch.int64)
        reqs = [f.begin(prompt) for f in flows]
        assert reqs[0].reused_len == reqs[1].reused_len
        for f, r in zip(flows, reqs, strict=True):
            f.mark_computed(r)
            f.extend(r, torch.tensor(out, dtype=torch.int64))
            f.mark_computed(r)
            f.finish(r)
        states.append(base + new + out)
        assert flows[0].stats.evicted_tokens == flows[1].stats.evicted_tokens
        cached = [sorted(f.manager.cached_indices().tolist()) for f in flows]
        assert cached[0] == cached[1]
        flows[0].check_integrity()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(steps=_steps, ps=st.sampled_from([1, 2, 4]), pool_tokens=st.integers(32, 64))
def test_memo_decides_as_a_manager_without_memo(steps, ps, pool_tokens):
    """Conversations that resend, branch and edit their history, in a pool small enough to
    evict: tokens reused, tokens evicted and the slots cached agree with the stand-in."""
    _run(steps, ps, pool_tokens, None)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(steps=_steps, ps=st.sampled_from([1, 2]), pool_tokens=st.integers(32, 64))
def test_memo_with_colliding_hashes_decides_the_same(steps, ps, pool_tokens):
    """The same with a hash that collides all the time: the memo reuses hashes and pages only
    where the tokens are equal, so every decision still agrees."""
    _run(steps, ps, pool_tokens, _weak)
