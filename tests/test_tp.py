"""TP attention over 2 gloo ranks on the CPU equals the single-process result."""

from __future__ import annotations

import pytest
import torch

from kvcache.storage.distributed import reset_tp_info, set_tp_info, try_get_tp_info
from kvcache.examples.tp_attention import TPConfig, make_batch, run_single_process, run_tp_attention


@pytest.fixture(scope="module")
def two_ranks():
    cfg = TPConfig(num_kv_heads=4, num_q_heads=8, head_dim=16, page_size=4, kv_layout="PageFirst",
                   seq_lens=(7, 12, 3), q_lens=(3, 1, 3), seed=11)
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
    expected = 2 * cfg.num_layers * cfg.num_pages * cfg.page_size * (cfg.num_kv_heads // 2) * cfg.head_dim * 4
    assert tp.pool_nbytes[0] == expected


def test_single_process_matches_dense_attention():
    """Guards the comparison above: the single-process side is itself right."""
    import torch.nn.functional as F

    cfg = TPConfig(seed=3)
    k, v, q, _ = make_batch(cfg)
    out = run_single_process(cfg).output
    ks, vs = k.split(list(cfg.seq_lens)), v.split(list(cfg.seq_lens))
    rows, start = [], 0
    for kr, vr, ql in zip(ks, vs, cfg.q_lens):
        t = kr.shape[0]
        mask = torch.ones(ql, t, dtype=torch.bool).tril(t - ql)
        o = F.scaled_dot_product_attention(q[start : start + ql].transpose(0, 1)[None], kr.transpose(0, 1)[None],
                                           vr.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
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
    ],
)
def test_bad_config_raises_before_any_process_starts(monkeypatch, world_size, cfg, match):
    import torch.multiprocessing as mp

    def no_spawn(*a, **k):  # pragma: no cover - reaching it is the failure
        raise AssertionError("a process was started")

    monkeypatch.setattr(mp, "spawn", no_spawn)
    with pytest.raises(ValueError, match=match):
        run_tp_attention(world_size, cfg, device="cpu")


def test_cli_reports(capsys):
    from kvcache.examples.tp_attention import main

    with pytest.raises(SystemExit):
        main(["--world-size", "3", "--num-kv-heads", "4"])
    assert "num_kv_heads=4" in capsys.readouterr().err
