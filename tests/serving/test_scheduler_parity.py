"""The scheduler against what SGLang's, vLLM's and mini-sglang's schedulers do (issue 30).

Each test names the peer behaviour it follows and the file it was checked in:

* mini-sglang ``python/minisgl/scheduler/scheduler.py`` (``_process_last_data``: after a
  prefill batch ``cache_manager.cache_req(req, finished=False)``, at commit ``20fcd7f3``);
* vLLM ``vllm/v1/core/sched/utils.py`` (``check_stop``, at ``018d5dc7``) and
  ``vllm/v1/core/sched/scheduler.py`` (``schedule``: priority preemption
  ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``; ``reset_prefix_cache``
  with ``reset_running_requests``; chunked prefill off admits a prompt only whole; at
  ``00024d31``);
* SGLang ``python/sglang/srt/managers/schedule_policy.py`` (``_compute_prefix_matches``: in-batch
  prefix caching; ``_sort_by_dfs_weight``, ``_calc_weight``, ``_get_dfs_priority``; at
  ``00550cd1``).

Rules over many inputs are property-based (hypothesis); the references they compare with are
written here from the peers' code, independently of the package's implementation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import (
    BlockHashCacheManager,
    Engine,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
    Scheduler,
    StopConditions,
    TinyLlama,
    TinyLlamaConfig,
    model_runner,
)
from kvcache.serving.admission import dfs_weight_order, in_batch_deprioritized

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int64)


def flow_of(kind: str, num_pages: int, page_size: int = 1) -> RequestFlow:
    manager = (
        RadixCacheManager(page_size=page_size)
        if kind == "radix"
        else BlockHashCacheManager(page_size=page_size)
    )
    return RequestFlow(manager, PageAllocator(num_pages, page_size))


# ------------------------------------------------------------------ 1. cache when prefill completes
@FAST
@given(
    kind=st.sampled_from(["radix", "block_hash"]),
    page_size=st.sampled_from([1, 2, 4]),
    length=st.integers(2, 40),
    chunked=st.booleans(),
    chunk=st.integers(3, 16),
)
def test_the_prompt_is_cached_when_prefill_completes(kind, page_size, length, chunked, chunk):
    """mini-sglang caches a request's prompt after its prefill batch (``cache_req(req,
    finished=False)``); vLLM caches full blocks as they are computed. A request that arrives
    with the same prompt while the first decodes reuses every whole page of it."""
    sched = Scheduler(
        flow_of(kind, 64, page_size),
        token_budget=64,
        chunk_size=chunk,
        chunked_prefill=chunked,
        max_batch=4,
    )
    prompt = torch.arange(100, 100 + length)
    first = sched.submit(prompt, 20, forced=torch.full((20,), 7))
    while not sched.requests[first].output:
        sched.step()
    assert sched.requests[first].status == "running"  # decoding
    second = sched.submit(prompt, 2, forced=ids(1, 2))
    rec = sched.step()
    assert second in rec.admitted
    # its last prompt token always runs (it yields the logits): whole pages before it reused
    assert sched.requests[second].flow_req.reused_len == (length - 1) // page_size * page_size
    sched.run()
    sched.check_integrity()


# ------------------------------------------------------------------ 3. stop conditions
def vllm_check_stop(output, max_tokens, min_tokens, eos, stop_ids, ignore_eos):
    """vLLM's ``check_stop`` for the last token of ``output``: ``None`` or the status it sets
    (eos_token_id is ``None`` in its sampling params when ``ignore_eos``)."""
    eos_token_id = None if ignore_eos else eos
    if len(output) < min_tokens:
        return None
    last = output[-1]
    if last == eos_token_id:
        return "eos"
    if last in stop_ids:
        return "stop"
    if len(output) >= max_tokens:
        return "length"
    return None


@FAST
@given(
    stream=st.lists(st.integers(0, 6), min_size=1, max_size=12),
    data=st.data(),
    eos=st.one_of(st.none(), st.integers(0, 6)),
    stop_ids=st.sets(st.integers(0, 6), max_size=2),
    ignore_eos=st.booleans(),
    page_size=st.sampled_from([1, 2]),
)
def test_stop_conditions_follow_vllm_check_stop(stream, data, eos, stop_ids, ignore_eos, page_size):
    """Every request stops at the first token after which vLLM's ``check_stop`` stops it, with
    the same reason; the stopping token is part of the output; a stopped request is cached
    exactly as one that ran out its length: its prompt and output (less the last token, never
    run) as whole pages."""
    max_new = len(stream)
    min_tokens = data.draw(st.integers(0, max_new))
    flow = flow_of("radix", 64, page_size)
    sched = Scheduler(flow, token_budget=16, max_batch=2, eos_token_id=eos)
    prompt = ids(9, 9, 8, 8, 7)
    sid = sched.submit(
        prompt,
        max_new,
        forced=torch.tensor(stream),
        min_tokens=min_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
    )
    sched.run()
    sched.check_integrity()
    want, reason = [], None
    for t in stream:
        want.append(t)
        reason = vllm_check_stop(want, max_new, min_tokens, eos, stop_ids, ignore_eos)
        if reason:
            break
    s = sched.requests[sid]
    assert s.output == want and s.finish_reason == reason and s.status == "finished"
    seq = torch.cat([prompt, ids(*want)])[:-1]
    cached, _ = flow.manager.match_prefix(seq)
    assert cached.cached_len == len(seq) // page_size * page_size


def test_min_tokens_above_max_new_tokens_is_refused():
    sched = Scheduler(flow_of("radix", 16), token_budget=8)
    with pytest.raises(ValueError, match="min_tokens"):
        sched.submit(ids(1, 2), 3, forced=ids(1, 1, 1), min_tokens=4)
    with pytest.raises(TypeError, match="ignore_eos"):
        sched.submit(ids(1, 2), 3, forced=ids(1, 1, 1), ignore_eos=1)
    assert not sched.requests


def test_the_models_eos_stops_a_greedy_request():
    """mini-sglang ends a request on the tokenizer's eos unless ``ignore_eos``
    (``_process_last_data``); the model's own greedy token is the eos here."""
    model = TinyLlama(TinyLlamaConfig(hidden_size=32, intermediate_size=64, seed=3))

    def serve(eos, **stop):
        engine = Engine(model, model.new_kv_cache(32), RadixCacheManager(), PageAllocator(32))
        sched = Scheduler(engine.flow, runner=model_runner(engine), eos_token_id=eos)
        sid = sched.submit(ids(72, 105, 33), 8, **stop)
        sched.run()
        return sched.requests[sid]

    free = serve(None).output
    eos = free[3]
    stops_at = free.index(eos) + 1
    s = serve(eos)
    assert s.output == free[:stops_at] and s.finish_reason == "eos"
    assert serve(eos, ignore_eos=True).output == free
    later = serve(eos, min_tokens=stops_at + 1).output
    assert later[: stops_at + 1] == free[: stops_at + 1]


# ------------------------------------------------------------------ 4. priorities
@FAST
@given(priorities=st.lists(st.integers(-2, 2), min_size=2, max_size=7))
def test_priority_admission_is_priority_then_arrival(priorities):
    """vLLM's priority queue pops by ``(priority, arrival_time)`` (smaller first)."""
    sched = Scheduler(flow_of("radix", 64), token_budget=64, max_batch=1, policy="priority")
    for i, p in enumerate(priorities):
        sched.submit(ids(1, 2, i), 1, forced=ids(5), priority=p)
    sched.run()
    admitted = [sid for r in sched.history for sid in r.admitted]
    assert admitted == sorted(range(len(priorities)), key=lambda i: (priorities[i], i))


@FAST
@given(
    priorities=st.lists(st.integers(0, 3), min_size=2, max_size=4),
    pages=st.integers(8, 14),
)
def test_priority_preempts_the_lowest_priority_latest_arrival(priorities, pages):
    """vLLM (``policy="priority"``): when a running request cannot get pages the victim is
    ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``."""
    sched = Scheduler(flow_of("radix", pages), token_budget=64, max_batch=4, policy="priority")
    for i, p in enumerate(priorities):
        sched.submit(ids(i, 50 + i), 6, forced=torch.full((6,), i), priority=p)
    while not sched.idle:
        before = {s.sid: s.priority for s in sched.running}
        rec = sched.step()
        for victim in rec.preempted:
            assert victim in before
            assert (before[victim], victim) == max((p, sid) for sid, p in before.items())
            del before[victim]
        sched.check_integrity()
    assert all(s.status == "finished" for s in sched.requests.values())


# ------------------------------------------------------------------ 5. chunked prefill off, reset
@FAST
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5), budget=st.integers(13, 20))
def test_without_chunked_prefill_a_prompt_runs_whole(lengths, budget):
    """vLLM with ``enable_chunked_prefill=False``: a waiting request whose new tokens exceed the
    step's budget is not scheduled; once scheduled its prompt runs in one step."""
    sched = Scheduler(flow_of("radix", 128), token_budget=budget, chunked_prefill=False)
    for i, n in enumerate(lengths):
        sched.submit(torch.arange(n) + 10 * i, 2, forced=ids(3, 4))
    sched.run()
    sched.check_integrity()
    for sid, n in enumerate(lengths):
        chunks = [q for r in sched.history for s, q in r.prefill if s == sid]
        assert chunks == [n]  # one chunk: the whole prompt (nothing of it was cached)
    with pytest.raises(ValueError, match="chunked prefill"):
        sched.submit(torch.arange(budget + 1), 1, forced=ids(1))


def test_reset_prefix_cache_with_running_requests():
    """vLLM's ``reset_prefix_cache(reset_running_requests=True)`` preempts every running
    request (in reverse, so they return in FIFO order) and then resets; without it a reset is
    refused while requests hold KV."""
    flow = flow_of("radix", 64)
    sched = Scheduler(flow, token_budget=8, max_batch=3)
    for i in range(4):
        sched.submit(ids(1, 2, 3, 4, i), 4, forced=torch.full((4,), i))
    sched.step()
    sched.step()
    running = [s.sid for s in sched.running]
    waiting = [s.sid for s in sched.waiting]
    assert running and flow.manager.size_info.total_size
    with pytest.raises(RuntimeError, match="running"):
        sched.reset_prefix_cache()
    assert [s.sid for s in sched.running] == running
    forgotten = sched.reset_prefix_cache(reset_running_requests=True)
    assert forgotten > 0 and flow.manager.size_info.total_size == 0
    assert not sched.running and [s.sid for s in sched.waiting] == running + waiting
    sched.check_integrity()
    sched.run()
    for sid in range(4):
        assert sched.requests[sid].output == [sid] * 4


# ------------------------------------------------------------------ 6. SGLang's cache-aware orders
def sglang_dfs_weight(prefixes, keys):
    """SGLang's ``_sort_by_dfs_weight`` over an explicit token trie (one node per token, one
    subtree per namespace): a node weighs the requests in its subtree; children are visited
    heaviest first (a stable sort: ties in insertion order) and a node's own requests come
    after its children's."""
    root: dict = {"children": {}, "reqs": []}
    for i, (p, key) in enumerate(zip(prefixes, keys, strict=True)):
        node = root
        path = [("ns", key), *((int(t), None) for t in p)] if len(p) else []
        for step in path:
            node = node["children"].setdefault(step, {"children": {}, "reqs": []})
        node["reqs"].append(i)

    def weight(node):
        node["w"] = len(node["reqs"]) + sum(weight(c) for c in node["children"].values())
        return node["w"]

    def dfs(node, out):
        for child in sorted(node["children"].values(), key=lambda c: -c["w"]):
            dfs(child, out)
        out.extend(node["reqs"])

    weight(root)
    out: list[int] = []
    dfs(root, out)
    return out


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(0, 2), max_size=6), st.sampled_from([None, "t"])),
        min_size=1,
        max_size=9,
    )
)
def test_dfs_weight_order_is_sglangs(rows):
    prefixes = [np.array(p, dtype=np.int64) for p, _ in rows]
    keys = [k for _, k in rows]
    assert dfs_weight_order(prefixes, keys) == sglang_dfs_weight(prefixes, keys)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(0, 1), max_size=6), st.integers(0, 6)),
        min_size=1,
        max_size=8,
    ),
    k=st.integers(1, 4),
)
def test_in_batch_prefix_caching_is_sglangs(rows, k):
    """SGLang's ``_compute_prefix_matches``: a request with at most ``k`` cached tokens is
    matched against a tree of the earlier such requests not held back; a match of ``k`` tokens
    or more holds it back, else it is inserted."""
    tokens = [np.array(t, dtype=np.int64) for t, _ in rows]
    cached = [c for _, c in rows]
    inserted: list[list[int]] = []
    want = set()
    for i, (t, c) in enumerate(zip(tokens, cached, strict=True)):
        if c > k:
            continue
        lcp = max((_lcp(t.tolist(), o) for o in inserted), default=0)
        if lcp >= k:
            want.add(i)
        else:
            inserted.append(t.tolist())
    assert in_batch_deprioritized(tokens, cached, [None] * len(rows), k) == want


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_in_batch_prefix_caching_computes_a_shared_prefix_once():
    """Four requests share a 32-token prefix nobody has cached, four others share nothing; the
    budget runs two prompts a step. LPM (all matches empty: arrival order) runs two of the
    sharing ones together, both computing the prefix; in-batch prefix caching holds the other
    sharers back a step, runs an unrelated request beside the first, and the held ones then
    find the prefix cached."""

    def computed(in_batch):
        sched = Scheduler(
            flow_of("radix", 512),
            token_budget=70,
            max_batch=8,
            chunked_prefill=False,
            policy="lpm",
            in_batch_prefix=in_batch,
        )
        shared = torch.arange(200, 232)
        for i in range(4):
            sched.submit(torch.cat([shared, ids(i, i)]), 1, forced=ids(1))
        for i in range(4):
            sched.submit(torch.arange(34) + 300 + 40 * i, 1, forced=ids(1))
        report = sched.run()
        sched.check_integrity()
        return report.computed_tokens

    assert computed(None) - computed(32) == 32  # the shared prefix, computed once less
    with pytest.raises(ValueError, match="lpm"):
        Scheduler(flow_of("radix", 8), policy="fcfs", in_batch_prefix=32)


def test_stop_conditions_cut_a_stream():
    """`StopConditions.cut` is the output a request emitting ``stream`` ends with."""
    rule = StopConditions.make(5, min_tokens=2, stop_token_ids=[4], eos_token_id=9)
    assert rule.cut([9, 4, 1, 9, 2]) == [9, 4]  # eos ignored below min_tokens, then stop id
    assert rule.cut([1, 1, 1, 1, 1]) == [1, 1, 1, 1, 1] and rule.reason([1] * 5) == "length"
    assert StopConditions.make(3, eos_token_id=9, ignore_eos=True).cut([9, 9, 9]) == [9, 9, 9]
    with pytest.raises(ValueError, match="stop_token_ids"):
        StopConditions.make(3, stop_token_ids=[-1])
    with pytest.raises(ValueError, match="fewer than"):
        rule.cut([1])
