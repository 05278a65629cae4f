"""Seeded request workloads of the kinds that make prefix caching pay, and a driver for them.

Each generator returns a list of `Job` (prompt token ids and the tokens the model "generates").
`replay` drives a `RequestFlow` through them one request at a time, the way a server with a
batch of one would, and records what the cache did after every request. Like a server, it never
takes a prompt's last token from the cache (``compute_last=True``): the model must run at least
that token to get the logits of the next one, so a prompt that is cached in full still costs one
computed token (mini-sglang matches ``input_ids[: input_len - 1]`` for the same reason).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..managers.base import BaseCacheHandle, BaseCacheManager, InsertResult, SizeInfo
from .request_flow import RequestFlow, check_manager
from .workload_checks import checked_workload

__all__ = [
    "Job",
    "Sample",
    "shared_system_prompts",
    "few_shot",
    "multi_turn_chat",
    "branching",
    "mixed",
    "long_few_shot",
    "agent",
    "replay",
    "WORKLOADS",
    "TimedManager",
]


class Job(NamedTuple):
    """One request: ``prompt`` is sent, ``output`` is what the model produces (decoded one by one)."""

    prompt: torch.Tensor
    output: torch.Tensor


class Sample(NamedTuple):
    """The cache after request ``step``: cumulative token counts and what the manager holds.

    ``prompt_tokens``, ``reused_tokens`` and ``computed_tokens`` add up over requests
    ``0..step`` (the flow's `FlowStats`): ``computed = prompt + decoded - reused``, where
    ``reused`` never includes a prompt's last token (see `replay`), so every request adds at
    least one computed token, plus its output when decoded. ``cached_tokens`` (what the manager
    holds), ``evicted_tokens`` (cumulative) and ``free_pages`` are read after the request.
    """

    step: int
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    cached_tokens: int
    evicted_tokens: int
    free_pages: int


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _job(prompt: list[int], output: list[int]) -> Job:
    return Job(torch.tensor(prompt, dtype=torch.int64), torch.tensor(output, dtype=torch.int64))


@checked_workload
def shared_system_prompts(
    num_requests: int = 200,
    num_prompts: int = 4,
    system_len: int = 300,
    question_len: tuple[int, int] = (20, 80),
    output_len: tuple[int, int] = (10, 40),
    vocab: int = 32000,
    seed: int = 0,
) -> list[Job]:
    """Many users, a few system prompts: every request is ``system + question``."""
    rng = random.Random(seed)
    systems = [_tokens(rng, system_len, vocab) for _ in range(num_prompts)]
    return [
        _job(
            rng.choice(systems) + _tokens(rng, rng.randint(*question_len), vocab),
            _tokens(rng, rng.randint(*output_len), vocab),
        )
        for _ in range(num_requests)
    ]


@checked_workload
def few_shot(
    num_requests: int = 200,
    num_tasks: int = 3,
    shots: int = 5,
    shot_len: int = 60,
    question_len: tuple[int, int] = (10, 40),
    output_len: tuple[int, int] = (5, 20),
    vocab: int = 32000,
    seed: int = 0,
) -> list[Job]:
    """Each task has a fixed list of worked examples; requests differ only in the final question."""
    rng = random.Random(seed)
    tasks = [
        [t for _ in range(shots) for t in _tokens(rng, shot_len, vocab)] for _ in range(num_tasks)
    ]
    return [
        _job(
            rng.choice(tasks) + _tokens(rng, rng.randint(*question_len), vocab),
            _tokens(rng, rng.randint(*output_len), vocab),
        )
        for _ in range(num_requests)
    ]


@checked_workload
def multi_turn_chat(
    num_conversations: int = 20,
    turns: int = 8,
    system_len: int = 200,
    message_len: tuple[int, int] = (20, 60),
    output_len: tuple[int, int] = (20, 60),
    vocab: int = 32000,
    seed: int = 0,
) -> list[Job]:
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


@checked_workload
def branching(
    num_requests: int = 200,
    depth: int = 4,
    fanout: int = 3,
    segment_len: int = 40,
    output_len: tuple[int, int] = (5, 20),
    vocab: int = 32000,
    seed: int = 0,
) -> list[Job]:
    """Tree-shaped prompts (e.g. tree-of-thought or agents retrying): a random root-to-leaf path."""
    rng = random.Random(seed)
    segments: dict[tuple[int, ...], list[int]] = {}

    def segment(path: tuple[int, ...]) -> list[int]:
        if path not in segments:
            segments[path] = _tokens(rng, segment_len, vocab)
        return segments[path]

    jobs = []
    for _ in range(num_requests):
        path: tuple[int, ...] = ()
        prompt: list[int] = []
        for _ in range(rng.randint(1, depth)):
            path = (*path, rng.randrange(fanout))
            prompt += segment(path)
        jobs.append(_job(prompt, _tokens(rng, rng.randint(*output_len), vocab)))
    return jobs


@checked_workload
def mixed(num_requests: int = 400, seed: int = 0, vocab: int = 32000) -> list[Job]:
    """The four kinds above interleaved, plus one request in ten with no shared prefix at all."""
    rng = random.Random(seed)
    quarter = num_requests // 4
    pools = [
        shared_system_prompts(quarter, seed=seed + 1, vocab=vocab),
        few_shot(quarter, seed=seed + 2, vocab=vocab),
        multi_turn_chat(max(1, quarter // 8), 8, seed=seed + 3, vocab=vocab),
        branching(quarter, seed=seed + 4, vocab=vocab),
    ]
    jobs: list[Job] = []
    while any(pools) and len(jobs) < num_requests:
        if rng.random() < 0.1:
            jobs.append(_job(_tokens(rng, rng.randint(50, 300), vocab), _tokens(rng, 20, vocab)))
            continue
        pool = rng.choice([p for p in pools if p])
        jobs.append(pool.pop(0))  # keep each kind's own order (turns of a chat stay in order)
    return jobs


@checked_workload
def long_few_shot(
    num_requests: int = 800,
    num_tasks: int = 6,
    prefix_len: tuple[int, int] = (2048, 8192),
    question_len: tuple[int, int] = (20, 200),
    output_len: tuple[int, int] = (10, 120),
    vocab: int = 32000,
    seed: int = 0,
) -> list[Job]:
    """Few-shot serving at today's prompt sizes: a few tasks, each a 2-8k-token shared prefix
    of worked examples, and requests that differ only in the question at the end."""
    rng = random.Random(seed)
    tasks = [_tokens(rng, rng.randint(*prefix_len), vocab) for _ in range(num_tasks)]
    return [
        _job(
            rng.choice(tasks) + _tokens(rng, rng.randint(*question_len), vocab),
            _tokens(rng, rng.randint(*output_len), vocab),
        )
        for _ in range(num_requests)
    ]


@checked_workload
def agent(
    num_requests: int = 800,
    num_agents: int = 8,
    system_len: tuple[int, int] = (500, 1500),
    step_len: tuple[int, int] = (30, 300),
    output_len: tuple[int, int] = (20, 150),
    branch_prob: float = 0.25,
    vocab: int = 32000,
    seed: int = 0,
) -> list[Job]:
    """Agents in branching multi-turn sessions: each session resends its whole history plus a
    new observation; one step in four forks a new session from an earlier turn of a random one
    (a retry, or a tree search over tool calls), so the cached prefixes form a deep, bushy tree."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(*system_len), vocab) for _ in range(num_agents)]
    # A session: its history and the lengths at which each of its turns started (fork points).
    sessions: list[tuple[list[int], list[int]]] = [(list(s), [len(s)]) for s in systems]
    jobs: list[Job] = []
    while len(jobs) < num_requests:
        history, starts = rng.choice(sessions)
        if rng.random() < branch_prob:
            cut = rng.choice(starts)
            history, starts = history[:cut], [s for s in starts if s <= cut]
            sessions.append((history, starts))
            history, starts = sessions[-1]
        prompt = history + _tokens(rng, rng.randint(*step_len), vocab)
        output = _tokens(rng, rng.randint(*output_len), vocab)
        jobs.append(_job(prompt, output))
        history[:] = prompt + output
        starts.append(len(prompt))
    return jobs


WORKLOADS: dict[str, Callable[..., list[Job]]] = {
    "system prompts": shared_system_prompts,
    "few-shot": few_shot,
    "multi-turn chat": multi_turn_chat,
    "branching": branching,
    "mixed": mixed,
}


class TimedManager(BaseCacheManager):
    """Forwards everything to ``manager``, adding up the time and calls of its hot operations.

    Pass it wherever a manager goes (e.g. ``RequestFlow(TimedManager(m), allocator)``): it
    changes nothing the manager does, and it forwards the flow's combined calls
    (``match_and_lock``, ``insert_and_unlock``) as they are, so that a manager that makes them
    faster than its separate calls is timed on its own path. ``seconds[op]`` and ``calls[op]``
    per operation in ``OPS``; a combined call is counted as itself, not as the calls it makes.
    ``clock`` is what each call is timed with: wall time by default, ``time.thread_time`` for the
    CPU time of the calling thread (steadier on a machine shared with other jobs).
    """

    OPS = (
        "match_prefix",
        "lock_handle",
        "insert_prefix",
        "insert_and_match",
        "match_and_lock",
        "insert_and_unlock",
        "evict",
    )

    def __init__(
        self, manager: BaseCacheManager, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        check_manager(manager)
        if not callable(clock):
            raise TypeError(f"clock must be a function returning seconds, got {clock!r}")
        self.manager = manager
        self.clock = clock
        self.seconds: dict[str, float] = dict.fromkeys(self.OPS, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(self.OPS, 0)
        self._bound = {op: getattr(manager, op) for op in self.OPS}

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def _timed(self, op: str, *args: Any, **kwargs: Any) -> Any:
        clock = self.clock
        t0 = clock()
        try:
            return self._bound[op](*args, **kwargs)
        finally:
            self.seconds[op] += clock() - t0
            self.calls[op] += 1

    def match_prefix(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("match_prefix", *args, **kwargs)

    def lock_handle(self, *args: Any, **kwargs: Any) -> None:
        self._timed("lock_handle", *args, **kwargs)

    def insert_prefix(self, *args: Any, **kwargs: Any) -> int:
        cached_len: int = self._timed("insert_prefix", *args, **kwargs)
        return cached_len

    def insert_and_match(self, *args: Any, **kwargs: Any) -> InsertResult:
        result: InsertResult = self._timed("insert_and_match", *args, **kwargs)
        return result

    def match_and_lock(self, *args: Any, **kwargs: Any) -> tuple[BaseCacheHandle, torch.Tensor]:
        matched: tuple[BaseCacheHandle, torch.Tensor] = self._timed(
            "match_and_lock", *args, **kwargs
        )
        return matched

    def insert_and_unlock(self, *args: Any, **kwargs: Any) -> InsertResult:
        result: InsertResult = self._timed("insert_and_unlock", *args, **kwargs)
        return result

    def evict(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        evicted: torch.Tensor = self._timed("evict", *args, **kwargs)
        return evicted

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
        if name in ("manager", "_bound", "clock"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.manager, name)


def replay(
    flow: RequestFlow,
    jobs: list[Job],
    *,
    decode: bool = True,
    token_by_token: bool = False,
    on_sample: Callable[[Sample], None] | None = None,
) -> list[Sample]:
    """Run ``jobs`` through ``flow`` one after another: begin, store, (decode), finish.

    ``begin`` is called with ``compute_last=True``, as a server does: the prompt's last token is
    always computed (its logits give the first output token), so at most ``len(prompt) - 1``
    tokens of a request are reused (rounded down to whole pages), even when the whole prompt is
    cached.
    With ``decode=True`` the output is appended with `RequestFlow.extend` (one token per call
    with ``token_by_token=True``, as a server decodes; all at once otherwise, which leaves the
    cache in the same state), so the cached sequence is prompt + output, what the next turn of a
    chat resends. Returns one `Sample` per request.

    A request that fails (e.g. ``RuntimeError`` when the pool runs out) is aborted before the
    error propagates: no request is left running and its pages are free again.
    """
    samples = []
    for step, job in enumerate(jobs):
        req = flow.begin(job.prompt, compute_last=True)
        try:
            flow.mark_computed(req)
            if decode and job.output.shape[0]:
                for chunk in torch.split(job.output, 1) if token_by_token else (job.output,):
                    flow.extend(req, chunk)
                    flow.mark_computed(req)
            flow.finish(req)
        except BaseException:
            if flow.is_running(req):  # e.g. the pool ran out during decode: give its pages back
                flow.abort(req)
            raise
        st = flow.stats
        sample = Sample(
            step,
            st.prompt_tokens,
            st.reused_tokens,
            st.computed_tokens,
            flow.manager.size_info.total_size,
            st.evicted_tokens,
            flow.allocator.num_free_pages,
        )
        samples.append(sample)
        if on_sample is not None:
            on_sample(sample)
    return samples
