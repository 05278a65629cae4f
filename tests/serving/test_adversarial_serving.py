"""Adversarial inputs to the serving classes around the flow (tokenizer, prefix mirror, host
link, cost model, scheduler, router, engine and model), by class of input: each is refused with
``TypeError``/``ValueError`` naming the argument, before anything changes, or taken as the
integer it is."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from conftest import ids, param_id, unchanged

from kvcache import (
    BlockStored,
    ByteTokenizer,
    CostModel,
    Engine,
    HostLink,
    PageAllocator,
    PrefixMirror,
    RadixCacheManager,
    RequestFlow,
    Router,
    Scheduler,
    TinyLlama,
    TinyLlamaConfig,
)
from kvcache.serving import workloads as W
from kvcache.serving.workloads import Job

#: Not iterable at all: a "sequence of ..." argument must name itself when given one of these.
NOT_ITERABLE = [None, 3, 2.5, True, np.int64(3), torch.tensor(3), np.array(3), object()]


def sparse_ids() -> torch.Tensor:
    return torch.tensor([1, 2, 3, 4]).to_sparse()


def scheduler(**kw: object) -> Scheduler:
    flow = RequestFlow(RadixCacheManager("cpu", 2, events=True), PageAllocator(32, 2))
    return Scheduler(flow, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama()


def engine(model: TinyLlama) -> Engine:
    return Engine(
        model, model.new_kv_cache(16, 2), RadixCacheManager("cpu", 2), PageAllocator(16, 2)
    )


# ------------------------------------------------------------------ sequences that are not
@pytest.mark.parametrize("value", NOT_ITERABLE, ids=param_id)
def test_sequence_arguments_name_themselves(value, model, torch_store):
    """Each was ``'int' object is not iterable`` (or the like), naming no argument. (A 0-d
    tensor is refused as a tensor that is not 1-D where a tensor is allowed: ``ValueError``.)"""
    with pytest.raises((TypeError, ValueError), match="ids must be"):
        ByteTokenizer().decode(value)
    mirror = PrefixMirror(2)
    with pytest.raises((TypeError, ValueError), match="tokens must be"):
        mirror.match(value)
    with pytest.raises(TypeError, match="events must be"):
        mirror.apply(value)
    e = engine(model)
    r, _ = e.prefill(ids(1, 2, 3))
    with unchanged(e), pytest.raises(TypeError, match="prompts must be a sequence"):
        e.prefill_batch(value)
    with unchanged(e), pytest.raises(TypeError, match="tokens must be a sequence"):
        e.decode_batch([r], value)
    with unchanged(e), pytest.raises(TypeError, match="reqs must be a sequence"):
        e.decode_batch(value, [1])
    slots = [torch.arange(2, dtype=torch.int32)]
    with unchanged(e), pytest.raises(TypeError, match="q_lens must be a sequence"):
        model(ids(1, 2), slots, value, e.kv_cache)
    with unchanged(e), pytest.raises(TypeError, match="slots must be a sequence"):
        model(ids(1, 2), value, [2], e.kv_cache)
    router = Router([scheduler(), scheduler()])
    with pytest.raises(TypeError, match="jobs must be a sequence"):
        router.run(value)
    if value is not None:  # None is arrivals' default: every job now
        with pytest.raises(TypeError, match="arrivals must be a sequence"):
            router.run([Job(ids(1, 2), ids(3))], value)
    assert router.report().requests == 0


# ------------------------------------------------------------------ prefix mirror, tokenizer
@pytest.mark.parametrize(
    "tokens",
    [sparse_ids(), torch.empty(3, dtype=torch.int64, device="meta")],
    ids=["sparse", "meta"],
)
def test_prefix_mirror_match_checks_tensor_tokens(tokens):
    """A sparse or meta tensor failed in ``tolist()`` (``NotImplementedError`` for meta)."""
    with pytest.raises((TypeError, ValueError), match="tokens must be"):
        PrefixMirror(2).match(tokens)


def test_prefix_mirror_refuses_unhashable_keys_and_single_events_unchanged():
    mirror = PrefixMirror(2)
    mirror.apply([BlockStored(None, (5, 6), (0, 1))])
    before = mirror.pages()
    with pytest.raises(TypeError, match="extra_key must be hashable"):
        mirror.match([5, 6], extra_key=[1])
    with pytest.raises(TypeError, match="extra_key must be hashable"):
        mirror.apply([BlockStored([1], (1, 2), (2, 3))])  # was: unhashable type: 'list'
    with pytest.raises(TypeError, match="events must be an iterable of events, got one"):
        mirror.apply(BlockStored(None, (1, 2), (2, 3)))  # a NamedTuple: iterating gave fields
    assert mirror.pages() == before and mirror.match([5, 6]) == 2


def test_tokenizer_encode_of_text_utf8_cannot_hold_names_text():
    with pytest.raises(ValueError, match="text must be encodable as UTF-8"):
        ByteTokenizer().encode("a\ud800")  # was a bare UnicodeEncodeError


# ------------------------------------------------------------------ host link, cost model
@pytest.mark.parametrize("num_bytes", [None, "1", True, [1], 1 + 0j], ids=param_id)
def test_host_link_seconds_refuses_non_numbers_by_name(num_bytes):
    with pytest.raises(TypeError, match="num_bytes must be a number"):
        HostLink("x", 1e9, "y").seconds(num_bytes)


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), None, "fast"], ids=param_id)
def test_host_link_with_no_bandwidth_is_refused_by_name(rate):
    """``bytes_per_s=0`` was a ``ZeroDivisionError``; a negative one gave negative seconds."""
    with pytest.raises(ValueError, match="bytes_per_s must be a number > 0"):
        HostLink("x", rate, "y").seconds(10)
    assert HostLink("x", 2.0, "y").seconds(np.int64(10)) == 5.0
    with pytest.raises(ValueError, match="num_bytes must be >= 0"):
        HostLink("x", 2.0, "y").seconds(-1)


@pytest.mark.parametrize(
    "num_tokens,exc",
    [(None, TypeError), ("3", TypeError), (1.5, TypeError), (True, TypeError), (-1, ValueError)],
    ids=param_id,
)
def test_step_seconds_takes_token_counts_only(num_tokens, exc):
    """``None``/``"3"`` failed in ``<=`` naming nothing; ``-1`` and ``True`` were accepted."""
    cm = CostModel(1e-3, 1e-2, 1e-3)
    with pytest.raises(exc, match="num_tokens"):
        cm.step_seconds(num_tokens)
    assert cm.step_seconds(np.int64(0)) == 0.0 and cm.step_seconds(torch.tensor(20)) == 0.021


# ------------------------------------------------------------------ scheduler, router
@pytest.mark.parametrize("runner", [True, 3, "model", [None], torch.tensor(1)], ids=param_id)
def test_scheduler_runner_must_be_callable(runner):
    """It was kept, and failed at the first step (``'int' object is not callable``)."""
    with pytest.raises(TypeError, match="runner must be callable or None"):
        scheduler(runner=runner)


@pytest.mark.parametrize(
    "out",
    [None, torch.zeros(0, 8), torch.zeros(8), "logits", torch.zeros(3, 8)],
    ids=["None", "no rows", "1-D", "str", "too many rows"],
)
def test_a_runner_without_logits_for_the_batch_leaves_it_requeued(out):
    """``None`` for a request that samples raised in the middle of `_advance`, after tokens had
    been marked computed and the clock moved; too few rows failed there with an IndexError."""
    s = scheduler(runner=lambda batch: out)
    sid = s.submit(ids(1, 2, 3), 2)
    with pytest.raises(RuntimeError, match="the runner"):
        s.step()
    s.check_integrity()
    s.flow.check_integrity()
    assert [w.sid for w in s.waiting] == [sid] and not s.running and s.clock == 0.0
    assert s.computed_tokens == 0 and s.flow.allocator.num_free_pages == 32


@pytest.mark.parametrize("sid", [True, [0], np.array([0]), 0.0], ids=param_id)
def test_scheduler_abort_takes_integer_ids_only(sid):
    """``True`` aborted request 1; a list raised ``unhashable type``."""
    s = scheduler()
    s.submit(ids(1, 2), 1, ids(5))
    s.submit(ids(3, 4), 1, ids(6))
    with pytest.raises(TypeError, match="sid must be an integer"):
        s.abort(sid)
    assert [w.sid for w in s.waiting] == [0, 1]
    s.abort(np.int64(1))
    assert [w.sid for w in s.waiting] == [0]


@pytest.mark.parametrize("bad", [3, None, "job", (ids(1), ids(2)), Job(ids(1), None)], ids=param_id)
def test_router_run_checks_every_job_before_the_first_runs(bad):
    """A bad job was found when its turn came (``AttributeError: no attribute 'output'``),
    after the jobs before it had run."""
    router = Router([scheduler(), scheduler()])
    with pytest.raises(TypeError, match=r"jobs\[1\]"):
        router.run([Job(ids(1, 2, 3), ids(4, 5)), bad])
    assert router.report().requests == 0 and router.loads() == [0, 0]


# ------------------------------------------------------------------ engine, model
def test_generate_that_can_never_fit_is_refused_before_it_runs(model, torch_store):
    """It decoded until the pool ran out (seconds for a huge ``max_new_tokens``), then aborted:
    a ``RuntimeError`` after the work, with the LRU clocks moved."""
    e = engine(model)
    e.generate(ids(1, 2, 3), 4)
    for n in (31, 2**31, 2**63, np.uint64(2**64 - 1)):
        with unchanged(e), pytest.raises(ValueError, match="it can never fit"):
            e.generate(ids(1, 2, 3), n)
    assert len(e.generate(ids(1, 2, 3), 30)) == 30  # 32 tokens stored: 16 pages of 2


@pytest.mark.parametrize("device", [None, 0, 1.5, "nope", b"cpu"], ids=param_id)
def test_model_device_is_checked_by_name(device):
    with pytest.raises((TypeError, ValueError)) as info:
        TinyLlama(device=device)
    assert str(info.value).startswith("device "), info.value


# ------------------------------------------------------------------ workload generators
GENERATORS = [
    W.shared_system_prompts,
    W.few_shot,
    W.multi_turn_chat,
    W.branching,
    W.mixed,
    W.long_few_shot,
    W.agent,
]


def _params(kind: str) -> list[tuple[object, str]]:
    return [
        (fn, name)
        for fn in GENERATORS
        for name, p in inspect.signature(fn).parameters.items()
        if p.annotation == kind and name != "seed"
    ]


@pytest.mark.parametrize("fn,name", _params("int"), ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("value", [-1, 2.0, float("-inf"), True, "3", None], ids=param_id)
def test_workload_counts_are_checked_by_name(fn, name, value):
    """``multi_turn_chat(turns=-1)`` looped for ever; ``vocab=-inf`` raised ``OverflowError``;
    ``vocab=2.0`` and ``True`` were taken."""
    with pytest.raises((TypeError, ValueError), match=name):
        fn(**{name: value})


@pytest.mark.parametrize(
    "fn,name", _params("tuple[int, int]"), ids=lambda x: getattr(x, "__name__", x)
)
@pytest.mark.parametrize("value", [(9, 2), (-1, 3), (1.5, 3), (1, 2, 3), 5, "ab"], ids=param_id)
def test_workload_length_ranges_are_checked_by_name(fn, name, value):
    """They reached ``randint``: "empty range", or a float where an int was needed."""
    with pytest.raises((TypeError, ValueError), match=name):
        fn(**{name: value})


def test_workloads_take_integers_of_every_library_and_stay_seeded():
    want = W.shared_system_prompts(5, 2, 10, (2, 4), (1, 3), 50, seed=3)
    got = W.shared_system_prompts(
        np.int64(5), torch.tensor(2), 10, (np.int32(2), 4), (1, 3), 50, seed=3
    )
    assert [(j.prompt.tolist(), j.output.tolist()) for j in got] == [
        (j.prompt.tolist(), j.output.tolist()) for j in want
    ]
    for p in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises((TypeError, ValueError), match="branch_prob"):
            W.agent(4, branch_prob=p)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"rope_theta": float("nan")}, ValueError, "rope_theta must be finite and > 0"),
        ({"rope_theta": -1.0}, ValueError, "rope_theta must be finite and > 0"),
        ({"rope_theta": "1e4"}, TypeError, "rope_theta must be a real number"),
        ({"rms_norm_eps": -1e-6}, ValueError, "rms_norm_eps must be finite and >= 0"),
        ({"rms_norm_eps": None}, TypeError, "rms_norm_eps must be a real number"),
        ({"seed": None}, TypeError, "seed must be an integer"),
        ({"seed": "0"}, TypeError, "seed must be an integer"),
        ({"seed": 1.0}, TypeError, "seed must be an integer"),
        ({"seed": 2**64}, ValueError, "seed must be in"),
    ],
    ids=param_id,
)
def test_model_config_numbers_are_checked_by_name(kw, exc, match):
    """NaN or negative theta/eps made every logit NaN; a string failed at the first forward;
    a bad seed raised torch's "manual_seed expected a long" (a RuntimeError)."""
    with pytest.raises(exc, match=match):
        TinyLlamaConfig(**kw)


def test_model_config_sizes_of_every_library_are_kept_as_python_ints():
    cfg = TinyLlamaConfig(hidden_size=np.int64(64), num_layers=torch.tensor(2), seed=np.int64(5))
    assert type(cfg.hidden_size) is int and type(cfg.num_layers) is int and type(cfg.seed) is int
    want = TinyLlama(TinyLlamaConfig(seed=5)).reference_logits(ids(1, 2, 3))
    torch.testing.assert_close(TinyLlama(cfg).reference_logits(ids(1, 2, 3)), want)


# ------------------------------------------------------------------ tenancy, TP demo, drawings
@pytest.mark.parametrize("value", [None, 3, 2.5, "ab", [1, 2], np.arange(3)], ids=param_id)
def test_public_prefix_cache_checks_ids_by_name(value):
    """``public_len`` of a non-tensor raised AttributeError (no ``shape``) or "tuple index out
    of range"; a non-iterable ``public`` raised "'int' object is not iterable"."""
    from kvcache.system.tenancy import PublicPrefixCache

    cache = PublicPrefixCache(RadixCacheManager(), [ids(1, 2)])
    with pytest.raises((TypeError, ValueError), match="input_ids must be"):
        cache.public_len(value)
    if not isinstance(value, (list, str, np.ndarray)):
        with pytest.raises(TypeError, match="public must be a sequence"):
            PublicPrefixCache(RadixCacheManager(), value)
    assert cache.public_len(ids(1, 2, 3)) == 2


@pytest.mark.parametrize("cfg", [3, "cfg", {"num_kv_heads": 4}, object()], ids=param_id)
def test_tp_demo_refuses_a_config_that_is_not_one(cfg):
    """Was AttributeError: no attribute 'validate'."""
    from kvcache import run_single_process, run_tp_attention

    with pytest.raises(TypeError, match="cfg must be a TPConfig or None"):
        run_single_process(cfg)
    with pytest.raises(TypeError, match="cfg must be a TPConfig or None"):
        run_tp_attention(1, cfg)
    with pytest.raises((TypeError, ValueError), match=r"^device "):
        run_single_process(None, device=2**63)  # was torch's "Overflow when unpacking long long"


def test_draw_sequence_builds_no_string_of_caption_width_characters():
    """``caption_width=2**31`` built a 2 GiB string (minutes); past 2**63, OverflowError."""
    from kvcache import draw_sequence, snapshot

    m = RadixCacheManager()
    m.insert_prefix(ids(1, 2, 3), torch.arange(3, dtype=torch.int32))
    snaps = [snapshot(m, "one")]
    for width in (2**31, 2**63, 10**30):
        assert draw_sequence(snaps, caption_width=width) is not None


@pytest.mark.parametrize("value", [torch.tensor(3), np.array(3)], ids=param_id)
def test_drawings_of_a_0d_tensor_name_their_argument(value):
    """A 0-d tensor or array passes ``isinstance(x, Iterable)`` and then raised "iteration over
    a 0-d tensor", naming no argument."""
    from kvcache import draw_sequence, step_player

    with pytest.raises(TypeError, match="snapshots must be"):
        draw_sequence(value)
    with pytest.raises(TypeError, match="source must be"):
        step_player(value)
