"""A radix tree as text: `tree_text`, and the one-line forms of keys and slots every picture uses.

`format_tokens` shortens a key to about ``max_chars`` (head … tail, whole tokens), as text when a
``decode`` callable or tokenizer is given and as ids otherwise; `format_indices` writes slots as
runs (``4–9, 12``). `tree_text` draws the whole tree with box-drawing characters, one node a
line, deterministically, so notebooks can compare it. The helpers without a leading underscore
(`as_decoder`, `one_line`, `shorten_middle`, `shorten_tokens`, `age_text`, `change_marks`) are
shared with the graphviz drawings and the recorder of this package.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .._validate import check_positive_int, check_size
from .snapshot import NodeSnapshot, Tree, TreeSnapshot, as_snapshot, evict_order

__all__ = ["Decode", "DecodeLike", "format_tokens", "format_indices", "tree_text"]

Decode = Callable[[List[int]], str]
DecodeLike = Union[Decode, Any, None]  # a callable, or an object with ``.decode(ids)``

_ESCAPES = {"\r": "\\r", "\n": "\\n", "\t": "\\t"}


def as_decoder(decode: DecodeLike) -> Optional[Decode]:
    """``decode`` as a function of a list of ids: its ``.decode`` method, itself, or ``None``."""
    if decode is None:
        return None
    method = getattr(decode, "decode", None)
    if callable(method):
        return lambda ids: _text_of(method(list(ids)))
    if callable(decode):
        return lambda ids: _text_of(decode(list(ids)))
    raise TypeError(f"decode must be a callable or have a .decode method, got {type(decode).__name__}")


def _text_of(text: Any) -> str:
    if not isinstance(text, str):
        raise TypeError(f"decode must return a str, got {type(text).__name__}")
    return text


def _escape_char(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    if ch == " " or ch.isprintable():
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def one_line(text: str) -> str:
    """``text`` with line breaks, tabs and every other invisible or control character escaped
    (``\\n``, ``\\x01``, ``\\u202e``), so it prints as one visible line."""
    if text.isprintable():
        return text
    return "".join(_escape_char(ch) for ch in text)


def shorten_middle(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` around ``…`` (two thirds head, one third tail)."""
    if len(text) <= max_chars:
        return text
    head = max(1, (max_chars - 1) * 2 // 3)
    tail = max(1, max_chars - 1 - head)
    return text[:head] + "…" + text[-tail:]


def shorten_tokens(tokens: Sequence[int], decode: DecodeLike, max_chars: int,
                   max_tokens: int = 64) -> Tuple[str, bool]:
    """``(text, shortened)``: see `format_tokens`."""
    dec = as_decoder(decode)
    tokens = list(tokens)
    show = (lambda ids: one_line(dec(ids))) if dec else (lambda ids: ", ".join(map(str, ids)))
    gap = "…" if dec else ", …, "
    if len(tokens) <= max_tokens:
        full = show(tokens)
        if len(full) <= max_chars:
            return full, False
    budget = max(2, max_chars - len(gap))
    head_budget = max(1, budget * 2 // 3)
    tail_budget = max(1, budget - head_budget)
    limit = min(len(tokens) - 1, max_tokens)
    k = 0
    while k < limit and len(show(tokens[:k + 1])) <= head_budget:
        k += 1
    j = 0
    while j < min(limit, len(tokens) - k - 1) and len(show(tokens[-(j + 1):])) <= tail_budget:
        j += 1
    head = show(tokens[:k]) if k else show(tokens[:1])[:head_budget]
    tail = show(tokens[-j:]) if j else show(tokens[-1:])[-tail_budget:]
    return head + gap + tail, True


def _int_list(values: Any, name: str) -> List[int]:
    """``values`` (a sequence, 1-D tensor or 1-D array of integers) as a list of Python ints."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor, got {values.dtype} of shape "
                            f"{tuple(values.shape)}")
        return values.tolist()
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a 1-D integer array, got {values.dtype} of shape {values.shape}")
        return values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    for v in values:  # numpy integers are Integral too
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must hold ints, got {type(v).__name__} {v!r}")
    return [int(v) for v in values]


def format_tokens(tokens: Sequence[int], decode: DecodeLike = None, *, max_chars: int = 24) -> str:
    """A key on one line: its text if ``decode`` is given, ``1, 2, 3`` otherwise.

    A key whose rendering is longer than ``max_chars`` keeps whole tokens from its start (about
    two thirds of the width) and its end around ``…`` (a single token too long is cut), so the
    result stays about ``max_chars`` wide; callers show the token count next to it. Control
    characters are escaped, so the result is one line.
    """
    ids = _int_list(tokens, "tokens")
    check_positive_int(max_chars, "max_chars")
    return shorten_tokens(ids, decode, max_chars)[0]


def format_indices(indices: Sequence[int], max_runs: int = 4) -> str:
    """Slots as runs of consecutive values: ``[4, 5, 6, 7, 8, 9, 12]`` → ``4–9, 12``.

    More than ``max_runs`` runs keep the first ``max_runs - 1`` and the last around ``…``.
    An empty list gives ``""``.
    """
    values = _int_list(indices, "indices")
    check_positive_int(max_runs, "max_runs")
    runs: List[Tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    parts = [str(a) if a == b else f"{a}–{b}" for a, b in runs]
    if len(parts) > max_runs:
        parts = parts[:max(1, max_runs - 1)] + ["…", parts[-1]]
    return ", ".join(parts)


def age_text(node: NodeSnapshot, policy: str, sep: str) -> str:
    """``t{sep}T``, plus ``in{sep}I`` (the insert time) under FIFO."""
    age = f"t{sep}{node.timestamp}"
    if policy == "fifo":
        age += f" in{sep}{node.insert_time}"
    return age


def change_marks(snap: TreeSnapshot, uuid: int, order: Dict[int, int]) -> List[str]:
    """What the last call did to node ``uuid``: ``new``, ``split``, ``evict #k`` (from ``order``)."""
    marks = []
    if uuid in snap.new:
        marks.append("new")
    if uuid in snap.split or uuid in snap.shrunk:
        marks.append("split")
    if uuid in order:
        marks.append(f"evict #{order[uuid]}")
    return marks


def tree_text(tree: Tree, decode: DecodeLike = None, *,
              max_chars: int = 40, evict_size: Optional[int] = None) -> str:
    """The tree as box-drawing text, one node a line, children in insertion order.

    Each line reads ``[tokens] → [slots] ref=R t=T`` (FIFO adds ``in=I``; tokens as in
    `format_tokens`, slots as in `format_indices`), then in one parenthesis: ``n tokens`` when
    the key was shortened, and what the last call did: ``new``, ``split``, and ``evict #k`` for
    the leaves ``evict(evict_size)`` would take. Deterministic: the same tree gives the same
    string, so notebooks can compare it. Any depth: the walk is a loop, not a recursion.
    """
    snap = as_snapshot(tree)
    as_decoder(decode)
    check_positive_int(max_chars, "max_chars")
    if evict_size is not None:
        check_size(evict_size, "evict_size")
    order = evict_order(snap, evict_size)
    lines = ["root"]

    def pushes(uuid: int, prefix: str) -> List[Tuple[int, str, bool]]:
        kids = snap.by_uuid[uuid].children
        return [(c, prefix, i == len(kids) - 1) for i, c in reversed(list(enumerate(kids)))]

    stack = pushes(snap.root.uuid, "")
    while stack:  # depth first, children in order: each is pushed last-first
        uuid, prefix, last = stack.pop()
        n = snap.by_uuid[uuid]
        tokens, shortened = shorten_tokens(n.tokens, decode, max_chars)
        text = (f"[{tokens}] → [{format_indices(n.indices)}] ref={n.ref_count} "
                f"{age_text(n, snap.eviction_policy, '=')}")
        marks = ([f"{n.length} tokens"] if shortened else []) + change_marks(snap, uuid, order)
        if marks:
            text += " (" + ", ".join(marks) + ")"
        lines.append(prefix + ("└── " if last else "├── ") + text)
        stack.extend(pushes(uuid, prefix + ("    " if last else "│   ")))
    return "\n".join(lines)
