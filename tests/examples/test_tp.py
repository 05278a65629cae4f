"""TP attention over 2 gloo ranks on the CPU equals the single-process result."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.examples.tp_attention import (
    TPConfig,
    attend_shard,
    make_batch,
    run_single_process,
    run_tp_attention,
)
from kvcache.storage.distributed import set_tp_info, try_get_tp_info


@pytest.fixture(scope="module")
def two_ranks():
    cfg = TPConfig(
        num_kv_heads=4,
        num_q_heads=8,
        head_dim=16,
        page_size=4,
        kv_layout="PageFirst",
        seq_lens=(7, 12, 3),
        q_lens=(3, 1, 3),
        seed=11,
    )
    return cfg, run_tp_attention(2, cfg, device="cpu")


def test_gathered_output_equals_single_process(two_ranks):
    cfg, tp = two_ranks
    single = run_single_process(cfg)
    assert tp.backend == "gloo"
    assert tp.output.shape == (sum(cfg.q_lens), cfg.num_q_heads, cfg.head_dim)
    torch.testing.assert_close(tp.output, single.output, rtol=0, atol=1e-6)
    assert tp.output.abs().sum() > 0


def test_each_rank_holds_half_the_bytes(two_ranks):
    cfg, tp = two_ranks
    single = run_single_process(cfg)
    assert len(tp.pool_nbytes) == 2
    assert tp.pool_nbytes[0] == tp.pool_nbytes[1] == single.pool_nbytes[0] // 2
    expected = (
        2
        * cfg.num_layers
        * cfg.num_pages
        * cfg.page_size
        * (cfg.num_kv_heads // 2)
        * cfg.head_dim
        * 4
    )
    assert tp.pool_nbytes[0] == expected


def test_single_process_matches_dense_attention():
    """Guards the comparison above: the single-process side is itself right."""
    import torch.nn.functional as F

    cfg = TPConfig(seed=3)
    k, v, q, _ = make_batch(cfg)
    out = run_single_process(cfg).output
    ks, vs = k.split(list(cfg.seq_lens)), v.split(list(cfg.seq_lens))
    rows, start = [], 0
    for kr, vr, ql in zip(ks, vs, cfg.q_lens, strict=True):
        t = kr.shape[0]
        mask = torch.ones(ql, t, dtype=torch.bool).tril(t - ql)
        o = F.scaled_dot_product_attention(
            q[start : start + ql].transpose(0, 1)[None],
            kr.transpose(0, 1)[None],
            vr.transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=True,
        )
        rows.append(o[0].transpose(0, 1))
        start += ql
    torch.testing.assert_close(out, torch.cat(rows), rtol=1e-5, atol=1e-5)


def test_single_process_restores_tp_info():
    set_tp_info(1, 4)
    run_single_process(TPConfig())
    info = try_get_tp_info()
    assert info is not None and (info.rank, info.size) == (1, 4)


@pytest.mark.parametrize(
    "world_size,cfg,match",
    [
        (3, TPConfig(num_kv_heads=4, num_q_heads=12), "num_kv_heads=4.*3"),
        (2, TPConfig(num_kv_heads=4, num_q_heads=6), "num_q_heads"),
        (0, TPConfig(), "world_size"),
        (2, TPConfig(seq_lens=(3,), q_lens=(4,)), "q_len"),
        # issue 9 item 10: settings that used to fail only inside a worker
        (2, TPConfig(page_size=0), "page_size"),
        (2, TPConfig(page_size=-4), "page_size"),
        (2, TPConfig(head_dim=0), "head_dim"),
        (2, TPConfig(dtype="int32"), "dtype"),
        (2, TPConfig(dtype="bool"), "dtype"),
        (2, TPConfig(dtype="complex64"), "dtype"),
        (2, TPConfig(dtype="no_such_dtype"), "dtype"),
        (2, TPConfig(num_layers=0, layer_id=0), "num_layers"),
        (2, TPConfig(layer_id=-1), "layer_id"),
        (2, TPConfig(num_kv_heads=0, num_q_heads=0), "num_kv_heads"),
        (2, TPConfig(seq_lens=(0,), q_lens=(0,)), "seq_lens"),
        (2, TPConfig(seq_lens=(), q_lens=()), "non-empty"),
        (2, TPConfig(seed=2**64), "seed"),
        (2, TPConfig(kv_layout="RowMajor"), "kv_layout"),
    ],
)
def test_bad_config_raises_before_any_process_starts(monkeypatch, world_size, cfg, match):
    import torch.multiprocessing as mp

    def no_spawn(*a, **k):  # pragma: no cover - reaching it is the failure
        raise AssertionError("a process was started")

    monkeypatch.setattr(mp, "spawn", no_spawn)
    with pytest.raises(ValueError, match=match):
        run_tp_attention(world_size, cfg, device="cpu")


@pytest.mark.parametrize(
    "cfg,match",
    [
        (TPConfig(page_size=2.0), "page_size"),
        (TPConfig(head_dim=True), "head_dim"),
        (TPConfig(dtype=torch.float32), "dtype"),
        (TPConfig(seq_lens=(3.0,), q_lens=(1,)), r"seq_lens\[0\]"),
        (TPConfig(seq_lens=3, q_lens=1), "seq_lens"),
        (TPConfig(kv_layout=None), "kv_layout"),
        (TPConfig(seed="0"), "seed"),
    ],
)
def test_wrong_field_type_raises_type_error(monkeypatch, cfg, match):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(TypeError, match=match):
        run_tp_attention(2, cfg, device="cpu")


# Each field: (values every rank can run with, the kinds of bad value a user could pass).
FIELDS = dict(
    num_kv_heads=([2, 4], [0, -2, 3, 3.0, "4"]),
    num_q_heads=([4, 8], [0, 6, -4, 2, 8.0]),
    head_dim=([1, 4, 8], [0, -1, True, 4.0]),
    num_layers=([2, 3], [0, -1, 1.0]),
    layer_id=([0, 1], [-1, 5, 3, False, 1.0]),
    page_size=([1, 3, 4], [0, -4, 2.5, None]),
    kv_layout=(["PageFirst", "LayerFirst"], ["pagefirst", "", None, 1]),
    seq_lens=([(7, 12, 3), (4, 9, 5)], [(0, 2, 1), (), (2.0, 2, 2), (-1, 3, 3), 7, (1, 1)]),
    q_lens=([(3, 1, 3), (1, 1, 1)], [(0, 1, 1), (13, 1, 1), (1.0, 1, 1), (1,)]),
    seed=([0, 7, -3, 2**63], [2**64, -(2**63) - 1, 1.5, "0", None]),
    dtype=(
        ["float32", "float64", "bfloat16", "float16"],
        [
            "int32",
            "int64",
            "bool",
            "uint8",
            "complex64",
            "float",
            "Tensor",
            "no_such",
            torch.float32,
        ],
    ),
)


@st.composite
def configs(draw):
    """A valid config with 0, 1 or 2 of its fields replaced by bad values."""
    fields = {name: draw(st.sampled_from(good)) for name, (good, _) in FIELDS.items()}
    broken = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=2))
    for name in sorted(broken):
        fields[name] = draw(st.sampled_from(FIELDS[name][1]))
    return TPConfig(**fields)


@settings(max_examples=80, derandomize=True, deadline=None)
@given(cfg=configs(), world_size=st.sampled_from([1, 2, 2, 4, 0, 3, True]))
def test_validate_accepts_only_what_every_rank_can_run(cfg, world_size):
    """validate(ws) passes  <=>  every one of the ws ranks runs its shard without an error."""
    try:
        cfg.validate(world_size)
    except (TypeError, ValueError):
        return
    outs = [
        attend_shard(cfg, rank, world_size, torch.device("cpu"))[0] for rank in range(world_size)
    ]
    assert torch.cat(outs, dim=1).shape == (sum(cfg.q_lens), cfg.num_q_heads, cfg.head_dim)
    assert try_get_tp_info() is None  # attend_shard leaves the process's TP info as it found it


def test_every_field_is_covered_by_the_property_test():
    assert set(FIELDS) == {f.name for f in dataclasses.fields(TPConfig)}


def test_cli_reports(capsys):
    from kvcache.examples.tp_attention import main

    with pytest.raises(SystemExit):
        main(["--world-size", "3", "--num-kv-heads", "4"])
    assert "num_kv_heads=4" in capsys.readouterr().err
