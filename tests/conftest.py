"""Helpers and fixtures shared by the test files.

- `ids`, `slots`, `page_slots`: token-id and KV-slot tensors in the dtypes the API takes.
- `observe` and `unchanged`: the misuse harness. ``observe(x)`` turns a flow, manager, allocator,
  pool or engine into plain values (size_info, integrity verdict, cached slots, the manager's
  structure read through its public API, the allocator's free list in order, the pool buffer's
  bytes, stats, running requests); ``unchanged(*objs)`` is a context manager that asserts the
  observed state is the same after a refused call as before it::

      with unchanged(flow, pool), pytest.raises(ValueError, match="num_tokens"):
          flow.mark_computed(req, 1.5)

  Either nesting order works: the comparison runs on exit whether or not an exception passes.
  The same harness is the ``unchanged`` fixture, for tests that prefer fixtures.
- Fixtures: TP info is unset before and after every test (autouse: it is process-global state
  that `MHAKVCache` reads); ``torch_store`` makes the pool store through the bit-identical torch
  path instead of the Triton interpreter (about 40 ms a call on this CPU; the Triton store is
  checked against the torch one in ``tests/kernels/test_store_cache.py``); ``read_backs`` counts the
  range checks that read values back to the host (``torch.aminmax`` calls; each a sync on a GPU).

Test files import the functions with ``from conftest import ids, slots, unchanged`` (``tests/``
is on ``sys.path`` under pytest's default import mode, as for ``radix_reference``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import settings

import kvcache.kernels.store as store_module
from kvcache import (
    BaseCacheManager,
    BaseKVCache,
    BlockHashCacheManager,
    Engine,
    PageAllocator,
    RadixCacheManager,
    RequestFlow,
)
from kvcache.storage.distributed import reset_tp_info

__all__ = [
    "ids", "slots", "page_slots", "greedy", "observe", "unchanged", "integrity_error", "param_id",
]  # fmt: skip

# CI (``CI`` set, as CI services do) runs the same hypothesis examples every time, so that a red
# run is one anybody can repeat and a green one is not luck; a developer's run explores new ones.
# Loaded before the test modules are imported, so their own ``settings(...)`` inherit it.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


# ------------------------------------------------------------------ tensors
def ids(*xs: int) -> torch.Tensor:
    """Token ids: a 1-D int64 CPU tensor."""
    return torch.tensor(xs, dtype=torch.int64)


def slots(*xs: int) -> torch.Tensor:
    """KV slots: a 1-D int32 CPU tensor."""
    return torch.tensor(xs, dtype=torch.int32)


def page_slots(pages: list[int], page_size: int, n: int | None = None) -> torch.Tensor:
    """The slots of ``pages`` in order (``page * page_size + offset``), cut to the first ``n``."""
    out = [p * page_size + j for p in pages for j in range(page_size)]
    return torch.tensor(out[:n] if n is not None else out, dtype=torch.int32)


def greedy(model: Any, prompt: torch.Tensor, n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from ``model.reference_logits`` (dense attention,
    no cache): what any cached serving path must reproduce."""
    seq, out = prompt, []
    for _ in range(n):
        out.append(int(model.reference_logits(seq)[-1].argmax()))
        seq = torch.cat([seq, ids(out[-1])])
    return out


# ------------------------------------------------------------ misuse harness
def integrity_error(obj: Any) -> str | None:
    """``None`` when ``obj.check_integrity()`` passes, else its ``RuntimeError`` message."""
    try:
        obj.check_integrity()
    except RuntimeError as e:
        return str(e)
    return None


def _manager_structure(m: BaseCacheManager) -> Any:
    """The manager's whole structure, through its public API (LRU clocks included)."""
    if isinstance(m, RadixCacheManager):
        return (
            m.clock,
            m.num_nodes,
            [
                (
                    n.uuid,
                    None if n.parent is None else n.parent.uuid,
                    n.key.tolist(),
                    n.value.tolist(),
                    n.ref_count,
                    n.timestamp,
                    n.insert_time,
                    sorted(map(str, n.children)),
                )
                for n in m.nodes()
            ],
        )
    if isinstance(m, BlockHashCacheManager):
        return (
            m.clock,
            m.num_blocks,
            m.free_queue(),
            [
                (
                    b.block_hash,
                    b.parent_hash,
                    b.tokens,
                    b.page,
                    b.ref_count,
                    b.num_children,
                    b.last_use,
                    b.probe,
                )
                for b in m.blocks()
            ],
        )
    return None


def _tensor_state(x: torch.Tensor) -> Any:
    return (x.dtype, tuple(x.shape), str(x.device), x.detach().cpu().contiguous().numpy().tobytes())


def observe(obj: Any) -> Any:
    """Everything observable about ``obj`` as plain, comparable values.

    Knows `RequestFlow`, `Engine`, any `BaseCacheManager`, `PageAllocator`, any `BaseKVCache`
    (its buffer, or each layer's K and V views), a tensor, and a zero-argument callable (called:
    the caller's own extra state). Anything else raises ``TypeError``.
    """
    if isinstance(obj, Engine):
        return (
            "engine",
            observe(obj.flow),
            observe(obj.kv_cache),
            obj.computed_tokens,
            obj.reused_tokens,
        )
    if isinstance(obj, RequestFlow):
        running = [
            (
                rid,
                r.input_ids.tolist(),
                r.indices.tolist(),
                r.num_computed,
                r.tree_len,
                r.reused_len,
                r.finished,
                r.handle,
            )
            for rid, r in obj.running.items()
        ]
        return (
            "flow",
            observe(obj.manager),
            observe(obj.allocator),
            running,
            dataclasses.asdict(obj.stats),
            len(obj.events),
            integrity_error(obj),
        )
    if isinstance(obj, BaseCacheManager):
        return (
            "manager",
            type(obj).__name__,
            obj.size_info,
            sorted(obj.cached_indices().tolist()),
            _manager_structure(obj),
            integrity_error(obj),
        )
    if isinstance(obj, PageAllocator):
        return ("allocator", obj.num_free_pages, obj.free_pages().tolist())
    if isinstance(obj, BaseKVCache):
        buffer = getattr(obj, "buffer", None)
        if isinstance(buffer, torch.Tensor):
            return ("pool", _tensor_state(buffer))
        return (
            "pool",
            [
                (_tensor_state(obj.k_cache(i)), _tensor_state(obj.v_cache(i)))
                for i in range(obj.num_layers)
            ],
        )
    if isinstance(obj, torch.Tensor):
        return ("tensor", _tensor_state(obj))
    if callable(obj):
        return ("extra", obj())
    raise TypeError(
        f"observe: no rule for {type(obj).__name__}; pass a callable returning its state"
    )


def param_id(value: object) -> str:
    """A parameter's test id: its ``repr`` without memory addresses, so that every process
    collecting the tests (pytest-xdist's workers) names them alike."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


class unchanged:
    """Context manager: the observed state of ``objs`` is the same on exit as on entry.

    Meant around a call that must be refused (wrap it in ``pytest.raises`` too); it compares
    on exit whether or not an exception passes, and never swallows one.
    """

    def __init__(self, *objs: Any) -> None:
        if not objs:
            raise TypeError("unchanged needs at least one object to watch")
        self.objs = objs

    def __enter__(self) -> unchanged:
        self.before = [observe(o) for o in self.objs]
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        after = [observe(o) for o in self.objs]
        for obj, b, a in zip(self.objs, self.before, after, strict=False):
            if a != b:  # not `assert`: the harness must also work under `python -O`
                raise AssertionError(
                    f"{type(obj).__name__} changed by a refused call:\nbefore {b}\nafter  {a}"
                )
        return False


@pytest.fixture(name="unchanged")
def unchanged_fixture() -> Callable[..., unchanged]:
    """The `unchanged` context manager, as a fixture."""
    return unchanged


# ------------------------------------------------------------------ fixtures
@pytest.fixture(autouse=True)
def _tp_info_unset() -> Iterator[None]:
    """TP info is process-global: every test starts and ends with none set."""
    reset_tp_info()
    yield
    reset_tp_info()


@pytest.fixture
def torch_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Store K/V through the torch path even when ``TRITON_INTERPRET=1`` (much faster on a CPU)."""
    monkeypatch.setattr(store_module, "TRITON_INTERPRET", False)


@pytest.fixture
def read_backs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``[n]``: how many ``torch.aminmax`` calls ran since the test began (every range check
    reads its result back to the host: on a GPU, a sync)."""
    calls = [0]
    real = torch.aminmax

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "aminmax", counted)
    return calls
