"""TinyLlama on the paged cache: every served logit equals a dense, cache-free recomputation.

Each scenario runs on both pool layouts and on page sizes 1 and 16, and proves the page
partition (`check_integrity`) after every step. Text is byte-level: ids are the UTF-8 bytes.

Speed: under ``TRITON_INTERPRET=1`` the Triton store kernel costs ~20 ms per token and layer on
this CPU, so the scenarios take the ``torch_store`` fixture (the bit-identical torch store; the
Triton one is checked against it in ``tests/kernels/test_store_cache.py``), while
``test_cached_prefill_on_empty_cache_equals_dense`` runs the store the test command selects and
``test_triton_decode_kernel_matches_torch_path`` the decode kernel. One torch thread: tiny
matmuls on a shared 2-core machine are otherwise dominated by thread hand-offs.
"""

from __future__ import annotations

import pytest
import torch

from kvcache import KVCacheLayout, NaiveCacheManager, PageAllocator, RadixCacheManager
from kvcache.serving.engine import Engine
from kvcache.serving.model import TinyLlama, TinyLlamaConfig

TOL = dict(atol=1e-5, rtol=1e-5)
SYSTEM = "You are a terse assistant. "
PROMPT30 = (
    "Explain paged KV caches, now: "  # 30 bytes: page size 16 decode fills a tail, then a new page
)
COMBOS = [
    (KVCacheLayout.LayerFirst, 1),
    (KVCacheLayout.PageFirst, 1),
    (KVCacheLayout.LayerFirst, 16),
    (KVCacheLayout.PageFirst, 16),
]
IDS = [f"{layout.name}-ps{ps}" for layout, ps in COMBOS]


def ids(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(TinyLlamaConfig(num_layers=2, seed=0))


def make_engine(
    model: TinyLlama, layout: KVCacheLayout, page_size: int, num_slots: int = 256, **kw
) -> Engine:
    pages = num_slots // page_size
    return Engine(
        model,
        model.new_kv_cache(pages, page_size, layout),
        RadixCacheManager(page_size=page_size),
        PageAllocator(pages, page_size),
        **kw,
    )


def reused(shared: int, page_size: int) -> int:
    """Tokens a prompt can reuse when its first ``shared`` tokens are cached (whole pages only)."""
    return shared // page_size * page_size


def prefill_checked(engine: Engine, prompt: torch.Tensor):
    """Prefill ``prompt``; its logits must equal the dense recomputation of the whole prompt."""
    before = engine.computed_tokens
    req, logits = engine.prefill(prompt)
    torch.testing.assert_close(logits, engine.model.reference_logits(prompt)[-1], **TOL)
    assert engine.computed_tokens - before == len(prompt) - req.reused_len
    engine.flow.check_integrity()
    return req


# ------------------------------------------------------------------------------------ (1)
@pytest.mark.parametrize("layout,page_size", COMBOS, ids=IDS)
def test_cached_prefill_on_empty_cache_equals_dense(model, layout, page_size):
    e = make_engine(model, layout, page_size)
    prompts = [ids("Hi, KV cache!"), ids("Paged attention.")]
    reqs = [e.flow.begin(p, compute_last=True) for p in prompts]
    assert [r.reused_len for r in reqs] == [0, 0]
    logits = model(
        torch.cat(prompts), [r.indices for r in reqs], [len(p) for p in prompts], e.kv_cache
    )
    torch.testing.assert_close(
        logits, torch.cat([model.reference_logits(p) for p in prompts]), **TOL
    )


# ------------------------------------------------------------------------------------ (2) (4)
@pytest.mark.parametrize("layout,page_size", COMBOS, ids=IDS)
def test_shared_prefix_computes_only_new_tokens(model, torch_store, layout, page_size):
    e = make_engine(model, layout, page_size)
    a, b = ids(SYSTEM + "What is a KV cache?"), ids(SYSTEM + "How to page it?")
    shared = len(SYSTEM)
    ra = prefill_checked(e, a)
    assert ra.reused_len == 0 and e.computed_tokens == len(a)
    e.finish(ra)
    rb = prefill_checked(e, b)  # logits equal recomputing all of b from scratch
    assert rb.reused_len == reused(shared, page_size)
    assert e.computed_tokens == len(a) + len(b) - reused(shared, page_size)
    e.finish(rb)
    # The same prompt again: all but the last token (rounded down to whole pages) is reused.
    ra2 = prefill_checked(e, a)
    assert ra2.reused_len == reused(len(a) - 1, page_size)
    e.finish(ra2)
    e.flow.check_integrity()
    assert e.reused_tokens == e.stats.reused_tokens and e.computed_tokens == e.stats.computed_tokens


# ------------------------------------------------------------------------------------ (3)
@pytest.mark.parametrize("layout,page_size", COMBOS, ids=IDS)
def test_evicted_prefix_is_recomputed_and_still_matches(model, torch_store, layout, page_size):
    e = make_engine(model, layout, page_size, num_slots=128)
    prefix = SYSTEM + "Context: pages. "  # 43 bytes
    for q in ("Q1?", "Q2!"):
        e.finish(prefill_checked(e, ids(prefix + q)))
    # An unrelated long prompt needs more slots than are free: every cached leaf goes.
    long = ids("".join(chr(ord("a") + i % 26) for i in range(100)))
    e.finish(prefill_checked(e, long))
    assert e.stats.evicted_tokens > 0
    rc = prefill_checked(e, ids(prefix + "Q3."))  # its prefix was evicted: recomputed, still exact
    assert rc.reused_len == 0
    e.finish(rc)
    rd = prefill_checked(e, ids(prefix + "Q4;"))  # and cached again for the next one
    assert rd.reused_len == reused(len(prefix) + 1, page_size)
    e.finish(rd)
    e.flow.check_integrity()


@pytest.mark.parametrize("layout,page_size", COMBOS, ids=IDS)
def test_random_interleaved_workload_with_evictions(model, torch_store, layout, page_size):
    """Seeded mix of admits, batched decodes and finishes, up to 3 requests in flight, over three
    shared prefixes in a pool too small to keep them all; every logit checked, every step proven."""
    g = torch.Generator().manual_seed(1)
    rand = lambda n: int(torch.randint(n, (1,), generator=g))  # noqa: E731
    e = make_engine(model, layout, page_size, num_slots=96)
    prefixes = [SYSTEM, "Translate to French: ", "def f(x):\n    return "]
    running, seqs, logits = [], [], None
    for _ in range(40):
        op = rand(3)
        if op == 0 or not running:  # admit
            prompt = torch.cat(
                [ids(prefixes[rand(3)]), torch.randint(32, 127, (1 + rand(12),), generator=g)]
            )
            try:
                req = prefill_checked(e, prompt)
            except (
                RuntimeError
            ) as err:  # the running requests hold the pool: refused, nothing moved
                assert "out of KV pages" in str(err)
                e.flow.check_integrity()
                continue
            running.append(req)
            seqs.append(prompt)
        elif op == 1:  # one batched decode step for everyone in flight
            toks = torch.stack([model.reference_logits(s)[-1].argmax() for s in seqs])
            try:
                logits = e.decode_batch(running, toks)
            except RuntimeError as err:  # refused before any request grew
                assert "out of KV pages" in str(err)
                assert [len(r) for r in running] == [len(s) for s in seqs]
                continue
            seqs = [torch.cat([s, t.view(1)]) for s, t in zip(seqs, toks, strict=True)]
            torch.testing.assert_close(
                logits, torch.stack([model.reference_logits(s)[-1] for s in seqs]), **TOL
            )
        if (op == 2 or len(running) > 3) and running:
            i = rand(len(running))
            e.finish(running.pop(i))
            seqs.pop(i)
        e.flow.check_integrity()
    for r in running:
        e.finish(r)
    e.flow.check_integrity()
    assert e.stats.evictions > 0 and e.stats.reused_tokens > 0
    assert e.computed_tokens == e.stats.computed_tokens


# ------------------------------------------------------------------------------------ (5)
@pytest.mark.parametrize("layout,page_size", COMBOS, ids=IDS)
def test_greedy_decode_matches_full_recompute(model, torch_store, layout, page_size):
    e = make_engine(model, layout, page_size)
    prompt = ids(PROMPT30)
    req, logits = e.prefill(prompt)
    seq = prompt
    for _ in range(5):
        torch.testing.assert_close(logits, model.reference_logits(seq)[-1], **TOL)
        tok = int(logits.argmax())
        assert tok == int(model.reference_logits(seq)[-1].argmax())
        seq = torch.cat([seq, torch.tensor([tok])])
        logits = e.decode(req, tok)
        e.flow.check_integrity()
    e.finish(req)
    # generate() gives the same tokens, and a second turn reuses the first, answer included.
    new = e.generate(prompt, 5)
    assert new.tolist() == seq[len(prompt) :].tolist()
    turn2 = torch.cat([seq, ids(" More?")])
    before = e.computed_tokens
    r2 = prefill_checked(e, turn2)
    assert r2.reused_len == reused(len(seq), page_size)
    assert e.computed_tokens - before == len(turn2) - r2.reused_len
    e.finish(r2)
    e.flow.check_integrity()


@pytest.mark.parametrize("layout,page_size", COMBOS[1:3], ids=IDS[1:3])
def test_batched_prefill_and_decode(model, torch_store, layout, page_size):
    e = make_engine(model, layout, page_size)
    e.finish(prefill_checked(e, ids(SYSTEM + "Warm the cache.")))
    prompts = [ids(SYSTEM + "One?"), ids("Two, unrelated."), ids(SYSTEM + "Three!")]
    reqs, logits = e.prefill_batch(prompts)
    assert [r.reused_len for r in reqs] == [
        reused(len(SYSTEM), page_size),
        0,
        reused(len(SYSTEM), page_size),
    ]
    seqs = list(prompts)
    for _ in range(2):
        torch.testing.assert_close(
            logits, torch.stack([model.reference_logits(s)[-1] for s in seqs]), **TOL
        )
        toks = logits.argmax(-1)
        seqs = [torch.cat([s, t.view(1)]) for s, t in zip(seqs, toks, strict=True)]
        logits = e.decode_batch(reqs, toks)
        e.flow.check_integrity()
    for r in reqs:
        e.finish(r)
    e.flow.check_integrity()


def test_triton_decode_kernel_matches_torch_path(model, torch_store):
    """Under TRITON_INTERPRET=1 (or on CUDA) decode runs `paged_decode_attention`; same logits."""
    runs = []
    for kernel in (False, True):
        e = make_engine(model, KVCacheLayout.PageFirst, 16, decode_kernel=kernel)
        req, logits = e.prefill(ids(PROMPT30))
        out = [logits]
        for _ in range(3):
            out.append(e.decode(req, int(out[-1].argmax())))
        runs.append(torch.stack(out))
    torch.testing.assert_close(runs[1], runs[0], **TOL)


# ------------------------------------------------------------------------------------ cache is the only memory
def test_kv_lives_only_in_the_pool(model, torch_store):
    e = make_engine(model, KVCacheLayout.LayerFirst, 1)
    req, logits = e.prefill(ids(SYSTEM))
    e.kv_cache.buffer.zero_()  # forget every stored K/V: decode must now see garbage
    seq = torch.cat([ids(SYSTEM), logits.argmax().view(1)])
    assert not torch.allclose(
        e.decode(req, int(logits.argmax())), model.reference_logits(seq)[-1], atol=1e-3
    )


def test_naive_manager_recomputes_everything(model, torch_store):
    pool = model.new_kv_cache(64)
    e = Engine(model, pool, NaiveCacheManager("cpu"), PageAllocator(64))
    for _ in range(2):
        r = prefill_checked(e, ids(SYSTEM))
        e.finish(r)
    assert e.reused_tokens == 0 and e.computed_tokens == 2 * len(SYSTEM)


# ------------------------------------------------------------------------------------ construction and misuse
def test_weights_are_seeded_and_leave_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = (TinyLlama(TinyLlamaConfig(seed=s)) for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), state)
    x = ids("abc")
    assert torch.equal(a.reference_logits(x), b.reference_logits(x))
    assert not torch.allclose(a.reference_logits(x), c.reference_logits(x))


def test_misuse_raises(model, torch_store):
    with pytest.raises(ValueError, match="num_q_heads"):
        TinyLlamaConfig(num_q_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="head_dim"):
        TinyLlamaConfig(head_dim=15)
    bad = TinyLlama(TinyLlamaConfig(num_layers=3)).new_kv_cache(16)
    with pytest.raises(ValueError, match="the model needs"):
        Engine(model, bad, RadixCacheManager(), PageAllocator(16))
    with pytest.raises(ValueError, match="does not fit"):
        Engine(model, model.new_kv_cache(16), RadixCacheManager(), PageAllocator(32))
    e = make_engine(model, KVCacheLayout.LayerFirst, 1, num_slots=32)
    with pytest.raises(ValueError, match="vocab_size"):
        model.reference_logits(torch.tensor([1, 256]))
    with pytest.raises(ValueError, match="sum\\(q_lens\\)"):
        model(ids("ab"), [torch.arange(3, dtype=torch.int32)], [3], e.kv_cache)
    with pytest.raises(ValueError, match="q_lens\\[0\\]"):
        model(ids("ab"), [torch.arange(1, dtype=torch.int32)], [2], e.kv_cache)
    with pytest.raises(RuntimeError, match="out of KV pages"):
        e.prefill(ids("x" * 40))
    assert not e.flow.running and e.flow.allocator.num_free_pages == 32  # nothing leaked
    req, _logits = e.prefill(ids("x" * 32))
    with pytest.raises(RuntimeError, match="out of KV pages"):
        e.decode(req, 0)
    with pytest.raises(ValueError, match="vocab_size"):
        e.decode(req, 256)
    with pytest.raises(RuntimeError, match="each listed once"):
        e.decode_batch([req, req], [1, 2])
    assert len(req) == 32  # each refused before extending
    e.finish(req)
    e.flow.check_integrity()


def test_forward_checks_slots_once_not_per_request_and_layer(model, torch_store, read_backs):
    """The model checks a batch's slots with one read-back (a host sync on a GPU), and its
    layers' attention skips its own; each layer's ``store_kv`` (the pool's contract, called with
    its four arguments) keeps one. A bad slot still raises, naming its request."""
    e = make_engine(model, KVCacheLayout.LayerFirst, 1)
    a, b = e.prefill(ids(SYSTEM))[0], e.prefill(ids("Hi!"))[0]
    calls = read_backs
    slots = [torch.arange(len(SYSTEM), dtype=torch.int32), torch.arange(3, dtype=torch.int32)]
    for decode_kernel in (False, True):
        before = calls[0]
        model(ids("ab"), slots, [1, 1], e.kv_cache, decode_kernel=decode_kernel)
        # one for the batch, one per layer's store; none per request, none in attention
        assert calls[0] - before == 1 + model.config.num_layers
    with pytest.raises(ValueError, match=r"slots\[1\]: 999 is outside"):
        model(ids("ab"), [slots[0], torch.tensor([0, 999])], [1, 1], e.kv_cache)
    e.finish(a), e.finish(b)
