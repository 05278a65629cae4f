"""Tensor-parallel attention over sharded KV pools, end to end on one machine.

``run_tp_attention(world_size, ...)`` starts ``world_size`` processes with ``torch.distributed``
(gloo on CPU, NCCL on CUDA; rendezvous on 127.0.0.1 at a free port). Every rank:

1. calls ``set_tp_info(rank, world_size)`` and builds an :class:`MHAKVCache` for the model's
   ``num_kv_heads``: it keeps ``num_kv_heads / world_size`` heads, so 1/world_size of the bytes;
2. generates the same seeded batch as every other rank and stores *its slice of KV heads* of
   every token;
3. runs causal GQA attention for its slice of query heads (query heads
   ``[rank * Hq/N, (rank+1) * Hq/N)`` use exactly the KV heads ``[rank * Hkv/N, ...)`` it holds);
4. all-gathers the per-rank outputs along the head dimension.

Rank 0 hands back the gathered output and each rank's ``nbytes``. :func:`run_single_process`
computes the same output in this process with the whole model on one pool, for comparison.

Command line::

    python -m kvcache.examples.tp_attention --world-size 2 --num-kv-heads 4 --num-q-heads 8
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, field

import torch

from .._validate import check_device
from ..storage.base import KVCacheLayout
from ..storage.distributed import reset_tp_info, set_tp_info, try_get_tp_info

__all__ = [
    "TPConfig",
    "TPResult",
    "attend_shard",
    "run_tp_attention",
    "run_single_process",
    "make_batch",
]


def _int_field(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class TPConfig:
    """The model slice and batch each run uses. ``seq_lens[r]`` tokens per request, the last
    ``q_lens[r]`` of them queries (so ``seq_lens[r] - q_lens[r]`` form a cached prefix)."""

    num_kv_heads: int = 4
    num_q_heads: int = 8
    head_dim: int = 16
    num_layers: int = 2
    layer_id: int = 1
    page_size: int = 4
    kv_layout: str = "PageFirst"
    seq_lens: tuple[int, ...] = (7, 12, 3)
    q_lens: tuple[int, ...] = (3, 1, 3)
    seed: int = 0
    dtype: str = "float32"

    def validate(self, world_size: int) -> None:
        """Everything a rank would reject, checked here before any process starts.

        Raises ``TypeError`` for a field of the wrong type (bools are not ints) and ``ValueError``
        for a value out of range, naming the field, the value and the limit: every count >= 1,
        ``layer_id`` in ``[0, num_layers)``, ``kv_layout`` a :class:`KVCacheLayout` name, ``dtype``
        the name of a floating-point torch dtype, ``seed`` what ``torch.Generator.manual_seed``
        takes, ``seq_lens``/``q_lens`` equally long non-empty sequences of ints with
        ``1 <= q_len <= seq_len``, and the heads split evenly over ``world_size`` ranks.
        """
        _int_field(world_size, "world_size", 1)
        for name in ("num_kv_heads", "num_q_heads", "head_dim", "num_layers", "page_size"):
            _int_field(getattr(self, name), name, 1)
        _int_field(self.layer_id, "layer_id", 0)
        if self.layer_id >= self.num_layers:
            raise ValueError(
                f"layer_id {self.layer_id} is outside [0, num_layers={self.num_layers})"
            )
        _int_field(self.seed, "seed", -(2**63))
        if self.seed >= 2**64:
            raise ValueError(f"seed must be < 2**64 (torch.Generator.manual_seed), got {self.seed}")
        if not isinstance(self.kv_layout, str):
            raise TypeError(f"kv_layout must be a str, got {type(self.kv_layout).__name__}")
        if self.kv_layout not in KVCacheLayout.__members__:
            raise ValueError(
                f"kv_layout must be one of {list(KVCacheLayout.__members__)}, got {self.kv_layout!r}"
            )
        if not isinstance(self.dtype, str):
            raise TypeError(
                f"dtype must be the name of a torch dtype (a str), got {type(self.dtype).__name__}"
            )
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"dtype must name a floating-point torch dtype (e.g. 'float32'), got {self.dtype!r}"
            )
        for name in ("seq_lens", "q_lens"):
            lens = getattr(self, name)
            if not isinstance(lens, (tuple, list)):
                raise TypeError(f"{name} must be a tuple of ints, got {type(lens).__name__}")
            for i, x in enumerate(lens):
                _int_field(x, f"{name}[{i}]", 1)
        if len(self.seq_lens) != len(self.q_lens) or not self.seq_lens:
            raise ValueError(
                f"seq_lens {self.seq_lens} and q_lens {self.q_lens} must be non-empty and equally long"
            )
        for t, ql in zip(self.seq_lens, self.q_lens, strict=True):
            if not 1 <= ql <= t:
                raise ValueError(f"each q_len must be in [1, seq_len]; got q_len={ql}, seq_len={t}")
        for what, a, b in (
            ("num_kv_heads", self.num_kv_heads, world_size),
            ("num_q_heads", self.num_q_heads, world_size),
            ("num_q_heads (GQA groups over num_kv_heads)", self.num_q_heads, self.num_kv_heads),
        ):
            if a % b:
                raise ValueError(f"{what}={a} cannot be split evenly by {b} (remainder {a % b})")

    @property
    def num_pages(self) -> int:
        """Enough pages for every token, plus one spare page so slots are not simply 0..n-1."""
        return -(-sum(self.seq_lens) // self.page_size) + 1


@dataclass
class TPResult:
    """``output``: ``(sum(q_lens), num_q_heads, head_dim)`` on the CPU; ``pool_nbytes[r]``: rank r's pool bytes."""

    output: torch.Tensor
    pool_nbytes: list[int] = field(default_factory=list)
    backend: str = ""


def make_batch(
    cfg: TPConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Seeded full-model data, identical in every process: ``k``, ``v`` ``(sum(seq_lens), Hkv, D)``,
    ``q`` ``(sum(q_lens), Hq, D)`` and each request's slots (a random permutation of the pool)."""
    g = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    n = sum(cfg.seq_lens)
    k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)
    v = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)
    q = torch.randn(sum(cfg.q_lens), cfg.num_q_heads, cfg.head_dim, generator=g).to(dtype)
    perm = torch.randperm(cfg.num_pages * cfg.page_size, generator=g)[:n].to(torch.int32)
    return k, v, q, list(torch.split(perm, list(cfg.seq_lens)))


def attend_shard(
    cfg: TPConfig, rank: int, size: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """One rank's work, in this process: its pool shard, its heads' K/V stored, its query heads
    attended. Returns ``(output (sum(q_lens), num_q_heads // size, head_dim), pool nbytes)``.
    Call ``cfg.validate(size)`` first (the runners do)."""
    from ..kernels.attention import paged_attention
    from ..storage.mha_pool import MHAKVCache

    previous = (
        try_get_tp_info()
    )  # restored afterwards: run_single_process runs in the caller's process
    set_tp_info(rank, size)
    try:
        pool = MHAKVCache(
            cfg.num_kv_heads,
            cfg.num_layers,
            cfg.head_dim,
            cfg.num_pages,
            getattr(torch, cfg.dtype),
            KVCacheLayout[cfg.kv_layout],
            device,
            page_size=cfg.page_size,
        )
    finally:
        if previous is None:
            reset_tp_info()
        else:
            set_tp_info(previous.rank, previous.size)
    k, v, q, slots = make_batch(cfg)
    hk, hq = pool.local_kv_heads, cfg.num_q_heads // size
    flat = torch.cat(slots).to(device)
    pool.store_kv(
        k[:, rank * hk : (rank + 1) * hk].to(device),
        v[:, rank * hk : (rank + 1) * hk].to(device),
        flat,
        cfg.layer_id,
    )
    out = paged_attention(
        q[:, rank * hq : (rank + 1) * hq].to(device),
        pool.k_cache(cfg.layer_id),
        pool.v_cache(cfg.layer_id),
        [s.to(device) for s in slots],
        list(cfg.q_lens),
    )
    return out, pool.nbytes


def _worker(
    rank: int, world_size: int, port: int, cfg: TPConfig, use_cuda: bool, result_path: str
) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # ranks share the host's cores
    if use_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    try:
        out, nbytes = attend_shard(cfg, rank, world_size, device)
        parts = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(parts, out.contiguous())
        sizes: list[int | None] = [None] * world_size
        dist.all_gather_object(sizes, nbytes)
        if rank == 0:
            gathered = torch.cat(parts, dim=1).cpu()
            torch.save({"output": gathered, "pool_nbytes": sizes}, result_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(cfg: object) -> TPConfig:
    """``cfg`` if it is a `TPConfig`, the default one for ``None``; ``TypeError`` otherwise."""
    if cfg is None:
        return TPConfig()
    if not isinstance(cfg, TPConfig):
        raise TypeError(f"cfg must be a TPConfig or None, got {type(cfg).__name__}")
    return cfg


def run_tp_attention(
    world_size: int, cfg: TPConfig | None = None, *, device: str = "auto"
) -> TPResult:
    """Run TP attention on ``world_size`` local processes; return rank 0's gathered result.

    ``device``: ``"cpu"`` (gloo), ``"cuda"`` (NCCL, one GPU per rank) or ``"auto"`` (CUDA when
    there are at least ``world_size`` GPUs). A configuration that cannot be split (e.g. KV heads
    not divisible by ``world_size``, a non-float dtype, ``page_size=0``) raises ``ValueError``
    (``TypeError`` for a field of the wrong type) before any process starts: see :meth:`TPConfig.validate`.
    """
    import torch.multiprocessing as mp

    cfg = _config(cfg)
    cfg.validate(world_size)
    if not isinstance(device, str) or device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = device == "cuda" or (device == "auto" and n_gpu >= world_size)
    if use_cuda and n_gpu < world_size:
        raise ValueError(f"world_size={world_size} needs that many GPUs, found {n_gpu}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.pt")
        mp.spawn(  # type: ignore[attr-defined,no-untyped-call]  # torch's stubs: untyped, not re-exported
            _worker,
            args=(world_size, _free_port(), cfg, use_cuda, path),
            nprocs=world_size,
            join=True,
        )
        res = torch.load(path)
    return TPResult(res["output"], list(res["pool_nbytes"]), "nccl" if use_cuda else "gloo")


def run_single_process(cfg: TPConfig | None = None, device: str = "cpu") -> TPResult:
    """The same batch with the whole model on one pool in this process (TP size 1)."""
    cfg = _config(cfg)
    cfg.validate(1)
    out, nbytes = attend_shard(cfg, 0, 1, check_device(device))
    return TPResult(out.cpu(), [nbytes], "single-process")


def main(argv: list[str] | None = None) -> None:
    d = TPConfig()
    p = argparse.ArgumentParser(
        prog="python -m kvcache.examples.tp_attention", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--num-kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--num-q-heads", type=int, default=d.num_q_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--kv-layout", choices=list(KVCacheLayout.__members__), default=d.kv_layout)
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(d.seq_lens))
    p.add_argument("--q-lens", type=int, nargs="+", default=list(d.q_lens))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a = p.parse_args(argv)
    cfg = TPConfig(
        num_kv_heads=a.num_kv_heads,
        num_q_heads=a.num_q_heads,
        head_dim=a.head_dim,
        page_size=a.page_size,
        kv_layout=a.kv_layout,
        seq_lens=tuple(a.seq_lens),
        q_lens=tuple(a.q_lens),
        seed=a.seed,
    )
    try:
        cfg.validate(a.world_size)
    except ValueError as e:
        p.error(str(e))
    tp = run_tp_attention(a.world_size, cfg, device=a.device)
    single = run_single_process(cfg)
    print(f"config: {asdict(cfg)}")
    print(f"world size {a.world_size} over {tp.backend}: output {tuple(tp.output.shape)}")
    for r, b in enumerate(tp.pool_nbytes):
        print(f"  rank {r}: pool holds {b:,} bytes")
    print(f"single process pool: {single.pool_nbytes[0]:,} bytes")
    print(f"max |TP - single process| = {(tp.output - single.output).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
