"""Seeded request workloads of the kinds that make prefix caching pay, and a driver for them.

Each generator returns a list of `Job` (prompt token ids and the tokens the model "generates").
`replay` drives a `RequestFlow` through them one request at a time, the way a server with a
batch of one would, and records what the cache did after every request.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch

from ..managers.base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from .integrity import check_manager
from .request_flow import RequestFlow

__all__ = [
    "Job", "Sample", "shared_system_prompts", "few_shot", "multi_turn_chat", "branching",
    "mixed", "replay", "WORKLOADS", "TimedManager",
]


class Job(NamedTuple):
    """One request: ``prompt`` is sent, ``output`` is what the model produces (decoded one by one)."""

    prompt: torch.Tensor
    output: torch.Tensor


class Sample(NamedTuple):
    """The cache after request ``step``: cumulative token counts and what the manager holds."""

    step: int
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    cached_tokens: int
    evicted_tokens: int
    free_pages: int


def _tokens(rng: random.Random, n: int, vocab: int) -> List[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _job(prompt: List[int], output: List[int]) -> Job:
    return Job(torch.tensor(prompt, dtype=torch.int64), torch.tensor(output, dtype=torch.int64))


def shared_system_prompts(num_requests: int = 200, num_prompts: int = 4, system_len: int = 300,
                          question_len: tuple = (20, 80), output_len: tuple = (10, 40),
                          vocab: int = 32000, seed: int = 0) -> List[Job]:
    """Many users, a few system prompts: every request is ``system + question``."""
    rng = random.Random(seed)
    systems = [_tokens(rng, system_len, vocab) for _ in range(num_prompts)]
    return [_job(rng.choice(systems) + _tokens(rng, rng.randint(*question_len), vocab),
                 _tokens(rng, rng.randint(*output_len), vocab)) for _ in range(num_requests)]


def few_shot(num_requests: int = 200, num_tasks: int = 3, shots: int = 5, shot_len: int = 60,
             question_len: tuple = (10, 40), output_len: tuple = (5, 20), vocab: int = 32000,
             seed: int = 0) -> List[Job]:
    """Each task has a fixed list of worked examples; requests differ only in the final question."""
    rng = random.Random(seed)
    tasks = [sum((_tokens(rng, shot_len, vocab) for _ in range(shots)), []) for _ in range(num_tasks)]
    return [_job(rng.choice(tasks) + _tokens(rng, rng.randint(*question_len), vocab),
                 _tokens(rng, rng.randint(*output_len), vocab)) for _ in range(num_requests)]


def multi_turn_chat(num_conversations: int = 20, turns: int = 8, system_len: int = 200,
                    message_len: tuple = (20, 60), output_len: tuple = (20, 60), vocab: int = 32000,
                    seed: int = 0) -> List[Job]:
    """Conversations interleaved at random; turn ``i`` resends the whole history so far."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len, vocab)
    history = [list(system) for _ in range(num_conversations)]
    remaining = [turns] * num_conversations
    jobs = []
    while any(remaining):
        c = rng.choice([i for i, r in enumerate(remaining) if r])
        remaining[c] -= 1
        prompt = history[c] + _tokens(rng, rng.randint(*message_len), vocab)
        output = _tokens(rng, rng.randint(*output_len), vocab)
        jobs.append(_job(prompt, output))
        history[c] = prompt + output
    return jobs


def branching(num_requests: int = 200, depth: int = 4, fanout: int = 3, segment_len: int = 40,
              output_len: tuple = (5, 20), vocab: int = 32000, seed: int = 0) -> List[Job]:
    """Tree-shaped prompts (e.g. tree-of-thought or agents retrying): a random root-to-leaf path."""
    rng = random.Random(seed)
    segments: Dict[tuple, List[int]] = {}

    def segment(path: tuple) -> List[int]:
        if path not in segments:
            segments[path] = _tokens(rng, segment_len, vocab)
        return segments[path]

    jobs = []
    for _ in range(num_requests):
        path: tuple = ()
        prompt: List[int] = []
        for _ in range(rng.randint(1, depth)):
            path = path + (rng.randrange(fanout),)
            prompt += segment(path)
        jobs.append(_job(prompt, _tokens(rng, rng.randint(*output_len), vocab)))
    return jobs


def mixed(num_requests: int = 400, seed: int = 0, vocab: int = 32000) -> List[Job]:
    """The four kinds above interleaved, plus one request in ten with no shared prefix at all."""
    rng = random.Random(seed)
    quarter = num_requests // 4
    pools = [shared_system_prompts(quarter, seed=seed + 1, vocab=vocab),
             few_shot(quarter, seed=seed + 2, vocab=vocab),
             multi_turn_chat(max(1, quarter // 8), 8, seed=seed + 3, vocab=vocab),
             branching(quarter, seed=seed + 4, vocab=vocab)]
    jobs: List[Job] = []
    while any(pools) and len(jobs) < num_requests:
        if rng.random() < 0.1:
            jobs.append(_job(_tokens(rng, rng.randint(50, 300), vocab), _tokens(rng, 20, vocab)))
            continue
        pool = rng.choice([p for p in pools if p])
        jobs.append(pool.pop(0))  # keep each kind's own order (turns of a chat stay in order)
    return jobs


WORKLOADS: Dict[str, Callable[..., List[Job]]] = {
    "system prompts": shared_system_prompts,
    "few-shot": few_shot,
    "multi-turn chat": multi_turn_chat,
    "branching": branching,
    "mixed": mixed,
}


class TimedManager(BaseCacheManager):
    """Forwards everything to ``manager``, adding up the time and calls of its hot operations.

    Pass it wherever a manager goes (e.g. ``RequestFlow(TimedManager(m), allocator)``): it
    changes nothing the manager does. ``seconds[op]`` and ``calls[op]`` per operation in ``OPS``
    (the calls a request makes; ``insert_and_match`` is the flow's insert).
    """

    OPS = ("match_prefix", "lock_handle", "insert_prefix", "insert_and_match", "evict")

    def __init__(self, manager: BaseCacheManager) -> None:
        check_manager(manager)
        self.manager = manager
        self.seconds: Dict[str, float] = dict.fromkeys(self.OPS, 0.0)
        self.calls: Dict[str, int] = dict.fromkeys(self.OPS, 0)
        self._bound = {op: getattr(manager, op) for op in self.OPS}

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def _timed(self, op: str, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._bound[op](*args, **kwargs)
        finally:
            self.seconds[op] += time.perf_counter() - t0
            self.calls[op] += 1

    def match_prefix(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("match_prefix", *args, **kwargs)

    def lock_handle(self, *args: Any, **kwargs: Any) -> None:
        return self._timed("lock_handle", *args, **kwargs)

    def insert_prefix(self, *args: Any, **kwargs: Any) -> int:
        return self._timed("insert_prefix", *args, **kwargs)

    def insert_and_match(self, *args: Any, **kwargs: Any) -> InsertResult:
        return self._timed("insert_and_match", *args, **kwargs)

    def evict(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._timed("evict", *args, **kwargs)

    # Not timed: forwarded as they are.
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.manager.device

    @property
    def page_size(self) -> int:  # type: ignore[override]
        return self.manager.page_size

    @property
    def size_info(self) -> SizeInfo:
        return self.manager.size_info

    def reset(self) -> None:
        self.manager.reset()

    def check_integrity(self) -> None:
        self.manager.check_integrity()

    def cached_indices(self) -> torch.Tensor:
        return self.manager.cached_indices()

    def handle_indices(self, handle: BaseCacheHandle) -> torch.Tensor:
        return self.manager.handle_indices(handle)

    def eviction_priority(self, node: Any) -> Any:
        return self.manager.eviction_priority(node)

    def __getattr__(self, name: str) -> Any:  # only reached for names TimedManager itself lacks
        if name in ("manager", "_bound"):  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.manager, name)


def replay(flow: RequestFlow, jobs: List[Job], *, decode: bool = True, token_by_token: bool = False,
           on_sample: Optional[Callable[[Sample], None]] = None) -> List[Sample]:
    """Run ``jobs`` through ``flow`` one after another: begin, store, (decode), finish.

    With ``decode=True`` the output is appended with `RequestFlow.extend` (one token per call
    with ``token_by_token=True``, as a server decodes; all at once otherwise, which leaves the
    cache in the same state), so the cached sequence is prompt + output, what the next turn of a
    chat resends. Returns one `Sample` per request.

    A request that fails (e.g. ``RuntimeError`` when the pool runs out) is aborted before the
    error propagates: no request is left running and its pages are free again.
    """
    samples = []
    for step, job in enumerate(jobs):
        req = flow.begin(job.prompt)
        try:
            flow.mark_computed(req)
            if decode and job.output.shape[0]:
                for chunk in (job.output.split(1) if token_by_token else (job.output,)):
                    flow.extend(req, chunk)
                    flow.mark_computed(req)
            flow.finish(req)
        except BaseException:
            if flow.is_running(req):  # e.g. the pool ran out during decode: give its pages back
                flow.abort(req)
            raise
        st = flow.stats
        sample = Sample(step, st.prompt_tokens, st.reused_tokens, st.computed_tokens,
                        flow.manager.size_info.total_size, st.evicted_tokens,
                        flow.allocator.num_free_pages)
        samples.append(sample)
        if on_sample is not None:
            on_sample(sample)
    return samples
