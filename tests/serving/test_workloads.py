"""`replay`'s accounting: a prompt's last token is always computed, as on a server.

The model needs the logits of a prompt's last token to produce the first output token, so that
token is run even when the whole prompt is cached (mini-sglang matches ``input_ids[:-1]``). The
old accounting counted a fully cached prompt as zero work; these tests would catch it.
"""

import inspect
from itertools import pairwise

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import NaiveCacheManager, PageAllocator, RadixCacheManager, RequestFlow
from kvcache.managers.block_hash import BlockHashCacheManager
from kvcache.serving import workloads as W
from kvcache.serving.workloads import Job, replay


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def deltas(samples, field):
    """Per-request increments of a cumulative `Sample` field."""
    values = [0] + [getattr(s, field) for s in samples]
    return [b - a for a, b in pairwise(values)]


def test_a_fully_cached_prompt_still_computes_its_last_token():
    flow = RequestFlow(RadixCacheManager(), PageAllocator(64))
    prompt = t(1, 2, 3, 4)
    samples = replay(flow, [Job(prompt, t()), Job(prompt, t())], decode=False)
    assert deltas(samples, "reused_tokens") == [0, 3]
    assert deltas(samples, "computed_tokens") == [4, 1]
    assert samples[-1].prompt_tokens == 8


def test_a_cached_prompt_with_output_computes_last_token_and_output():
    flow = RequestFlow(RadixCacheManager(), PageAllocator(64))
    first = Job(t(1, 2, 3), t(4, 5))
    # the next turn resends prompt + output exactly: all of it is cached
    again = Job(t(1, 2, 3, 4, 5), t(6))
    samples = replay(flow, [first, again])
    assert deltas(samples, "reused_tokens") == [0, 4]
    assert deltas(samples, "computed_tokens") == [3 + 2, 1 + 1]


def test_whole_pages_of_the_prompt_but_its_last_token():
    # page size 4: a cached 8-token prompt sent again reuses one page (its 7 tokens but the
    # last hold one whole page), not two
    flow = RequestFlow(RadixCacheManager(page_size=4), PageAllocator(16, 4))
    prompt = t(*range(8))
    samples = replay(flow, [Job(prompt, t()), Job(prompt, t())], decode=False)
    assert deltas(samples, "reused_tokens") == [0, 4]
    assert deltas(samples, "computed_tokens") == [8, 4]


def reference_reuse(jobs, page_size: int, decode: bool) -> list[int]:
    """Tokens each job reuses, from a list of the sequences cached before it (no eviction)."""
    cached: list[list[int]] = []
    out = []
    for j in jobs:
        p = j.prompt.tolist()
        best = 0
        for c in cached:
            n = 0
            while n < min(len(c), len(p) - 1) and c[n] == p[n]:
                n += 1
            best = max(best, n)
        out.append(best // page_size * page_size)
        seq = p + (j.output.tolist() if decode else [])
        cached.append(seq[: len(seq) // page_size * page_size])
    return out


@settings(max_examples=60, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), min_size=1, max_size=9),
            st.lists(st.integers(0, 2), max_size=4),
        ),
        min_size=1,
        max_size=6,
    ),
    page_size=st.sampled_from([1, 2, 4]),
    decode=st.booleans(),
    kind=st.sampled_from(["radix", "block-hash", "naive"]),
)
def test_replay_reuse_matches_a_reference_and_never_the_last_token(jobs, page_size, decode, kind):
    jobs = [Job(t(*p), t(*o)) for p, o in jobs]
    make = {
        "radix": lambda: RadixCacheManager(page_size=page_size),
        "block-hash": lambda: BlockHashCacheManager(page_size=page_size),
        "naive": lambda: NaiveCacheManager(page_size=page_size),
    }[kind]
    flow = RequestFlow(make(), PageAllocator(128, page_size))  # no eviction
    samples = replay(flow, jobs, decode=decode)
    reused = deltas(samples, "reused_tokens")
    computed = deltas(samples, "computed_tokens")
    expected = [0] * len(jobs) if kind == "naive" else reference_reuse(jobs, page_size, decode)
    assert reused == expected
    for j, r, c in zip(jobs, reused, computed, strict=True):
        assert r <= len(j.prompt) - 1  # the last prompt token is never reused
        assert c == len(j.prompt) - r + (len(j.output) if decode else 0)
        assert c >= 1
    assert samples[-1].computed_tokens == flow.stats.computed_tokens


# ------------------------------------------------------------------ the generators' arguments
GENERATORS = [
    W.shared_system_prompts,
    W.few_shot,
    W.multi_turn_chat,
    W.branching,
    W.mixed,
    W.long_few_shot,
    W.agent,
]


def _argument(kind: str) -> st.SearchStrategy:
    small = st.integers(-3, 12)
    if kind == "int":
        return small
    if kind == "tuple[int, int]":
        return st.tuples(small, small)
    return st.one_of(st.floats(-0.5, 1.5), st.just(float("nan")))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data(), which=st.integers(0, len(GENERATORS) - 1))
def test_every_generator_makes_jobs_or_names_the_argument_and_its_limit(data, which):
    """Any counts, any (lo, hi) ranges (reversed, negative), any probability, for every
    generator: the jobs (ids in ``[0, vocab)``, lengths within the ranges), or a ``ValueError``
    / ``TypeError`` that names the argument and its limit; never "empty range for randrange()"
    or a loop that does not end."""
    fn = GENERATORS[which]
    params = inspect.signature(fn).parameters
    kwargs = {
        name: data.draw(_argument(p.annotation), label=name)
        for name, p in params.items()
        if p.annotation in ("int", "tuple[int, int]", "float") and name != "seed"
    }
    for count in ("num_requests", "num_conversations"):  # kept small: the runs stay short
        if count in kwargs:
            kwargs[count] = min(kwargs[count], 6)
    try:
        jobs = fn(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e)
        named = [n for n in kwargs if message.startswith(n)]
        assert named, message
        assert any(limit in message for limit in (">= 0", ">= 1", "0 <= lo <= hi", "[0, 1]"))
        return
    vocab = kwargs.get("vocab", 32000)
    for job in jobs:
        for part in (job.prompt, job.output):
            assert part.dtype == torch.int64 and part.dim() == 1
            assert not len(part) or 0 <= int(part.min()) <= int(part.max()) < vocab
    if "output_len" in kwargs and fn is not W.mixed:
        lo, hi = kwargs["output_len"]
        assert all(lo <= len(job.output) <= hi for job in jobs)


def test_timed_manager_forwards_the_flows_combined_calls():
    """`TimedManager` times ``match_and_lock`` and ``insert_and_unlock`` as themselves: the manager
    behind it receives the combined calls (its own fast path, not the base class's separate
    calls), decides exactly as it does bare, and every second is counted once."""

    class Counting(RadixCacheManager):
        combined = 0

        def match_and_lock(self, *args, **kwargs):
            Counting.combined += 1
            return super().match_and_lock(*args, **kwargs)

        def insert_and_unlock(self, *args, **kwargs):
            Counting.combined += 1
            return super().insert_and_unlock(*args, **kwargs)

    jobs = W.mixed(60, seed=1)
    bare = RequestFlow(RadixCacheManager(page_size=4), PageAllocator(400, 4))
    replay(bare, jobs)
    timed = W.TimedManager(Counting(page_size=4))
    flow = RequestFlow(timed, PageAllocator(400, 4))
    replay(flow, jobs)
    assert (flow.stats.reused_tokens, flow.stats.evicted_tokens) == (
        bare.stats.reused_tokens,
        bare.stats.evicted_tokens,
    )
    assert timed.calls["match_and_lock"] == timed.calls["insert_and_unlock"] == len(jobs)
    assert Counting.combined == 2 * len(jobs)
    assert timed.calls["match_prefix"] == timed.calls["lock_handle"] == 0  # not double counted
    assert timed.total_seconds == sum(timed.seconds.values()) > 0


def test_timed_manager_takes_a_clock_and_refuses_what_is_not_one():
    import time

    import pytest

    ticks = iter(range(1000))
    timed = W.TimedManager(RadixCacheManager(), clock=lambda: float(next(ticks)))
    flow = RequestFlow(timed, PageAllocator(1024))
    replay(flow, W.shared_system_prompts(3, system_len=8, seed=0))
    assert timed.total_seconds == sum(timed.calls.values())  # one tick per call
    assert W.TimedManager(RadixCacheManager(), clock=time.thread_time).clock is time.thread_time
    with pytest.raises(TypeError, match="clock"):
        W.TimedManager(RadixCacheManager(), clock=5)
