"""The router under failure and misuse (issue 27, items 7 and 8).

- `Faults` makes the N-th call the router makes into a replica's scheduler (``submit``,
  ``step``) or its event source (``take_events``) raise ``RuntimeError`` or
  ``KeyboardInterrupt``, for every N a script of submits, steps and syncs reaches, over replicas
  with and without a host tier, page sizes 1 and 16. A failed submit leaves everything as it was
  (the events it delivered taken back); a failed step either changed nothing or, when the event
  source failed after the step, left the step standing and its events for later; afterwards
  every replica is sound, a `sync` makes every mirror equal its cache, and every request
  finishes once with its forced output.
- A refused ``submit(..., at=t)`` delivers nothing; `run` refuses a job that can never fit
  before it submits any.
- Property tests (hypothesis) of the validation classes: `PrefixMirror.match` takes a tensor or
  a sequence of real integers and refuses anything else by name, changing nothing;
  `multi_tenant` checks every argument before it draws; a refused `submit` changes nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cache_mirror import cached_pages
from conftest import ids, observe
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import (
    BlockStored,
    KVCacheLayout,
    MHAKVCache,
    PageAllocator,
    PrefixMirror,
    RadixCacheManager,
    RequestFlow,
    Router,
    Scheduler,
    TieredCacheManager,
    multi_tenant,
)
from kvcache.serving.workloads import Job
from kvcache.system import router as router_module

pytestmark = pytest.mark.usefixtures("torch_store")

ROUTER_FILE = str(Path(router_module.__file__).resolve())


class Injected(RuntimeError):
    pass


class Interrupt(KeyboardInterrupt):
    pass


class Faults:
    """Raise ``exc`` at the ``n``-th call (while armed) the router makes into patched methods."""

    def __init__(self, exc: type[BaseException], n: int) -> None:
        self.exc, self.n = exc, n
        self.calls = 0
        self.armed = False
        self.fired: str | None = None

    def patch(self, obj: object, name: str) -> None:
        orig = getattr(obj, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if self.armed and str(Path(caller).resolve()) == ROUTER_FILE:
                self.calls += 1
                if self.calls == self.n:
                    self.fired = name
                    self.armed = False
                    raise self.exc(f"injected at call {self.n} ({name})")
            return orig(*a, **k)

        setattr(obj, name, wrapper)


def replica(ps: int, tiered: bool, pages: int = 8) -> Scheduler:
    manager: Any = RadixCacheManager(page_size=ps, events=True)
    alloc = PageAllocator(pages, ps)
    if tiered:
        pool = MHAKVCache(1, 1, 2, pages, torch.float32, KVCacheLayout.LayerFirst, "cpu", ps)
        manager = TieredCacheManager(manager, pool, alloc, 4 * pages, events=True)
    return Scheduler(RequestFlow(manager, alloc), token_budget=4 * ps, max_batch=2)


def caches(router: Router) -> list[dict[Any, Any]]:
    out = []
    for s in router.replicas:
        m = s.flow.manager
        if isinstance(m, TieredCacheManager):
            ps = m.page_size
            pre = m.device_prefixes()
            out.append({k: tuple(range(p * ps, (p + 1) * ps)) for k, p in pre.items()})
        else:
            out.append(cached_pages(m))
    return out


def state(router: Router) -> Any:
    """Everything a failed or refused call must leave as it was."""
    return (
        list(router.placement),
        router.report(),
        router.loads(),
        router.now,
        router.events_in_flight(),
        [(m.pages(), m.events_applied) for m in router.mirrors],
        [observe(s.flow) for s in router.replicas],
        [(list(s.requests), s.clock, s.steps) for s in router.replicas],
    )


def script(ps: int) -> list[tuple[str, tuple[Any, ...]]]:
    a, b = [1 + i for i in range(2 * ps)], [50 + i for i in range(2 * ps)]
    return [
        ("submit", ([*a, 7], 2, 0.0)),
        ("submit", ([*b, 8], 1, 0.0)),
        ("drain", ()),
        ("submit", ([*a, 9], 2, 1.0)),  # the mirror knows a now: cache-aware routing
        ("submit", ([*b[:ps], 5], 1, 1.0)),
        ("step", ()),
        ("sync", ()),
        ("drain", ()),
        ("submit", ([*a, 9, 9], 1, 2.0)),
        ("drain", ()),
    ]


def run_script(ps: int, tiered: bool, part: str, exc: type[BaseException], n: int) -> bool:
    reps = [replica(ps, tiered), replica(ps, tiered)]
    faults = Faults(exc, n)
    for s in reps:
        if part == "scheduler":
            faults.patch(s, "submit")
            faults.patch(s, "step")
        else:
            faults.patch(s.flow.manager, "take_events")
    router = Router(reps, event_delay_s=0.01, balance_abs_threshold=4)
    sent: list[tuple[list[int], list[int]]] = []

    def call(what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, again after an injected failure, which must leave what the router documents."""
        while True:
            before = state(router)
            try:
                return fn()
            except (Injected, Interrupt):
                assert faults.fired is not None
                router.check_integrity()
                if what == "submit" or faults.fired == "step":
                    assert state(router) == before  # taken back / the scheduler's own promise
                elif what == "step":  # the event source failed after its step: the step
                    return None  # stands (its events come with the next), not to be run again

    for step, args in script(ps):
        faults.armed = faults.fired is None
        if step == "submit":
            prompt, k, dt = args
            out = [30 + k] * k
            at = router.now + dt
            rid = call(
                "submit",
                lambda p=prompt, k=k, o=out, at=at: router.submit(ids(*p), k, ids(*o), at=at),
            )
            assert rid == len(sent)
            sent.append((prompt, out))
        elif step == "step":
            call("step", router.step)
        elif step == "sync":
            call("sync", router.sync)
        else:
            while any(not s.idle for s in router.replicas):
                call("step", router.step)
        faults.armed = False
        router.check_integrity()
    router.sync()
    assert [m.pages() for m in router.mirrors] == caches(router)
    assert router.report().requests == len(sent)
    for rid, (r, sid) in enumerate(router.placement):
        sreq = router.replicas[r].requests[sid]
        assert sreq.status == "finished" and sreq.output == sent[rid][1]
    return faults.fired is not None


@pytest.mark.parametrize("exc", [Injected, Interrupt], ids=["RuntimeError", "KeyboardInterrupt"])
@pytest.mark.parametrize("part", ["scheduler", "events"])
@pytest.mark.parametrize("tiered", [False, True], ids=["radix", "tiered"])
@pytest.mark.parametrize("ps", [1, 16])
def test_every_router_call_is_all_or_nothing(ps: int, tiered: bool, part: str, exc: type) -> None:
    n = 1
    while run_script(ps, tiered, part, exc, n):
        n += 1
    assert n > 3, f"the script made only {n - 1} calls into the {part}"


# ------------------------------------------------------------------ item 7
def test_a_refused_submit_delivers_no_event() -> None:
    router = Router([replica(1, False, 32), replica(1, False, 32)], event_delay_s=0.5)
    router.submit(ids(1, 2, 3, 4, 5), 1, ids(9), at=0.0)
    while any(not s.idle for s in router.replicas):
        router.step()
    in_flight = router.events_in_flight()
    assert in_flight and all(m.cached_tokens == 0 for m in router.mirrors)
    before = state(router)
    with pytest.raises(ValueError, match="never fit"):
        router.submit(ids(*range(40)), 1, ids(9), at=10.0)  # events due by 10.0: not delivered
    with pytest.raises(ValueError, match="forced"):
        router.submit(ids(1, 2), 3, ids(9), at=10.0)
    assert state(router) == before
    router.submit(ids(1, 2, 3, 4, 6), 1, ids(9), at=10.0)  # taken: now they are
    assert router.events_in_flight() == 0
    assert max(m.match(ids(1, 2, 3, 4)) for m in router.mirrors) == 4


def test_run_refuses_a_job_that_can_never_fit_before_submitting_any() -> None:
    router = Router([replica(1, False, 32), replica(1, False, 16)])
    jobs = [Job(ids(1, 2, 3), ids(4)), Job(ids(*range(20)), ids(1)), Job(ids(5), ids(6))]
    before = state(router)
    with pytest.raises(ValueError, match=r"jobs\[1\].*replica 1"):
        router.run(jobs)
    with pytest.raises(ValueError, match=r"jobs\[0\].prompt must hold"):
        router.run([Job(ids(), ids(1))])
    assert state(router) == before and not router.placement
    assert router.run(jobs[::2]).requests == 2


# ------------------------------------------------------------------ item 8
NOT_INTEGERS = st.one_of(
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
    st.just(np.float64(2.0)),
    st.just(np.bool_(True)),
    st.lists(st.integers(), max_size=2),
    st.complex_numbers(),
)


@settings(max_examples=100, deadline=None)
@given(
    good=st.lists(st.integers(-5, 40), max_size=6),
    bad=NOT_INTEGERS,
    where=st.integers(0, 6),
)
def test_prefix_mirror_match_refuses_every_item_that_is_not_an_integer(good, bad, where):
    """`match` was 0 for ``[1.5]``, ``"ab"`` and a float array and 2 for ``[True, 2]``: every
    item is now a real integer or the call is refused, naming it, with the mirror unchanged."""
    m = PrefixMirror(2)
    m.apply([BlockStored(None, (1, 2, 3, 4), (0, 1, 2, 3))])
    before = (m.pages(), m.events_applied)
    tokens = list(good)
    tokens.insert(min(where, len(tokens)), bad)
    with pytest.raises(TypeError, match=r"tokens\[\d+\] must be an integer"):
        m.match(tokens)
    assert (m.pages(), m.events_applied) == before
    assert m.match(good) == (4 if good[:4] == [1, 2, 3, 4] else 2 if good[:2] == [1, 2] else 0)


@pytest.mark.parametrize(
    "tokens",
    ["ab", b"ab", np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), [1.5], [True, 2], [1, "2"]],
    ids=["str", "bytes", "float-array", "float-tensor", "float", "bool", "digit-string"],
)
def test_prefix_mirror_match_refuses_the_cases_of_the_issue(tokens):
    m = PrefixMirror(1)
    m.apply([BlockStored(None, (1, 2), (0, 1))])
    with pytest.raises(TypeError, match="tokens"):
        m.match(tokens)
    assert m.match(np.array([1, 2])) == 2 and m.match((1, 2)) == 2  # integer sequences: taken


SPANS = st.tuples(st.integers(-3, 6), st.integers(-3, 6))


@settings(max_examples=100, deadline=None)
@given(
    counts=st.tuples(st.integers(-1, 3), st.integers(-1, 3), st.integers(-1, 2)),
    system_len=st.one_of(st.integers(-2, 5), st.floats(0, 3), st.booleans()),
    spans=st.tuples(SPANS, SPANS, SPANS),
    vocab=st.integers(-1, 50),
)
def test_multi_tenant_checks_every_argument_before_it_draws(counts, system_len, spans, vocab):
    """Reversed ranges gave 'empty range for randrange()'; ``system_len=-1`` and negative
    ranges were taken. Every argument is now a valid one or refused by name."""
    num_requests, num_tenants, contexts = counts
    context_len, question_len, output_len = spans
    kw = {
        "num_requests": num_requests,
        "num_tenants": num_tenants,
        "system_len": system_len,
        "context_len": context_len,
        "contexts_per_tenant": contexts,
        "question_len": question_len,
        "output_len": output_len,
        "vocab": vocab,
    }
    valid = (
        min(num_requests, num_tenants, contexts, vocab) >= 1
        and type(system_len) is int
        and system_len >= 0
        and all(0 <= lo <= hi for lo, hi in spans)
    )
    if not valid:
        with pytest.raises((TypeError, ValueError)) as err:
            multi_tenant(**kw)
        assert any(name in str(err.value) for name in kw), err.value
        return
    jobs = multi_tenant(**kw)
    assert len(jobs) == num_requests
    for job in jobs:
        lo = system_len + context_len[0] + question_len[0]
        hi = system_len + context_len[1] + question_len[1]
        assert lo <= len(job.prompt) <= hi and job.public_len == system_len
        assert output_len[0] <= len(job.output) <= output_len[1]
        assert 0 <= job.tenant < num_tenants
        assert int(job.prompt.max()) < vocab if len(job.prompt) else True


BAD_SUBMITS: list[tuple[Callable[[Router], object], type[Exception]]] = [
    (lambda r: r.submit(ids(*range(40)), 1, ids(9), at=r.now + 1), ValueError),
    (lambda r: r.submit(ids(), 1, ids(9), at=r.now + 1), ValueError),
    (lambda r: r.submit(ids(1, 2), 0, ids(9), at=r.now + 1), ValueError),
    (lambda r: r.submit(ids(1, 2), 2, ids(9), at=r.now + 1), ValueError),
    (lambda r: r.submit(torch.tensor([1.0]), 1, ids(9), at=r.now + 1), TypeError),
    (lambda r: r.submit(ids(1, 2), 1, ids(9), at=r.now - 1), ValueError),
    (lambda r: r.submit(ids(1, 2), 1.5, ids(9), at=r.now + 1), TypeError),  # type: ignore[arg-type]
]


@settings(max_examples=30, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=6), min_size=1, max_size=4),
    bad=st.integers(0, len(BAD_SUBMITS) - 1),
    steps=st.integers(0, 6),
)
def test_a_refused_submit_changes_nothing(prompts, bad, steps):
    router = Router([replica(1, False, 24), replica(1, False, 24)], event_delay_s=0.01)
    for i, p in enumerate(prompts):
        router.submit(ids(*p), 1, ids(9), at=0.005 * i)
    for _ in range(steps):
        if all(s.idle for s in router.replicas):
            break
        router.step()
    before = state(router)
    call, err = BAD_SUBMITS[bad]
    with pytest.raises(err):
        call(router)
    assert state(router) == before
