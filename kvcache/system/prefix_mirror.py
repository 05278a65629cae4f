"""`PrefixMirror`: a replica's cached prefixes, rebuilt outside it from its cache events only.

A router cannot read a replica's radix tree or block table (in a real deployment they live in
another process, on another machine); what it can read is the replica's event stream
(``manager.take_events()``: `BlockStored`, `BlockRemoved`, `AllCleared`). The mirror replays
that stream into a trie of pages, one node per cached page, keyed by the page's tokens under
its parent, one trie per namespace (``extra_key``). `match` then says how many leading tokens
of a prompt the replica holds, as far as the events delivered so far tell.

It is *approximate* only in time: after the events up to some moment are applied it equals the
replica's cached set at that moment exactly (page for page, with the same slots; the tests check
this after every step), but events in flight (network latency, batching of publications) are
not seen yet, so a prefix stored a moment ago looks absent and one evicted a moment ago looks
present.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

import torch

from .._validate import as_int, as_list, check_positive_int, token_ids
from ..managers.cache_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    check_extra_key,
)

__all__ = ["PrefixMirror", "TierEvent", "TieredPrefixMirror", "MEDIA"]

Page = tuple[int, ...]

#: Where a tiered replica holds a page: the names SGLang's KV events give their ``medium``
#: (``StorageMedium.GPU`` / ``CPU``; ``hiradix_cache.py``, ``_record_remove_event(node,
#: medium=...)``).
MEDIA = ("device", "host")


class TierEvent(NamedTuple):
    """A cache event of one tier of a tiered replica: ``event`` (`BlockStored`, `BlockRemoved`,
    `AllCleared`) happened in ``medium`` (one of `MEDIA`); a host event's slots are host slots."""

    medium: str
    event: CacheEvent


def _token_list(tokens: object) -> list[int]:
    """``tokens`` as a list of Python ints: a 1-D integer tensor on the CPU (`token_ids`), or a
    sequence whose every item is a real integer (`as_int`: no ``bool``, float or string). A
    ``str`` or ``bytes`` is refused whole: it is a sequence of characters, not of token ids."""
    if isinstance(tokens, torch.Tensor):
        ids: list[int] = token_ids(tokens, "tokens").tolist()
        return ids
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"tokens must be token ids, got {type(tokens).__name__} {tokens!r:.40}")
    items = as_list(tokens, "tokens", "token ids")
    if all(type(t) is int for t in items):  # the common case: one pass, no conversion
        return items
    return [as_int(t, f"tokens[{i}]") for i, t in enumerate(items)]


class _Node:
    """One page of a prefix: ``slots`` where the replica holds it, ``None`` when it holds it no
    more but the node is still the path to cached descendants (kept until they leave)."""

    __slots__ = ("children", "page", "parent", "slots")

    def __init__(self, parent: _Node | None, page: Page) -> None:
        self.children: dict[Page, _Node] = {}
        self.slots: Page | None = None
        self.parent = parent
        self.page = page


class PrefixMirror:
    """The pages a replica caches, per namespace, as its events tell (see the module docstring).

    Args:
        page_size: the replica's page size (tokens per page), >= 1; every event's runs are whole
            pages of it.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = check_positive_int(page_size, "page_size")
        self._roots: dict[Hashable, _Node] = {}
        self._num_pages = 0
        self.events_applied = 0

    # ------------------------------------------------------------------ reading
    @property
    def cached_tokens(self) -> int:
        """Tokens the replica caches (whole pages), all namespaces together."""
        return self._num_pages * self.page_size

    def match(self, tokens: torch.Tensor | Sequence[int], extra_key: Hashable = None) -> int:
        """Leading tokens of ``tokens`` (1-D) held under ``extra_key``: a multiple of the page
        size, the longest run of whole pages cached from the first one on. ``tokens``: a 1-D
        integer tensor on the CPU or a sequence of integers (each a real integer: ``True``,
        ``1.5`` and ``"a"`` are refused, not looked up); ``TypeError``/``ValueError`` otherwise,
        naming the first item that is not one."""
        toks = _token_list(tokens)
        check_extra_key(extra_key)
        node, ps, n = self._roots.get(extra_key), self.page_size, 0
        while node is not None and n + ps <= len(toks):
            node = node.children.get(tuple(toks[n : n + ps]))
            if node is None or node.slots is None:
                break
            n += ps
        return n

    def held_pages(
        self, tokens: torch.Tensor | Sequence[int], extra_key: Hashable = None
    ) -> list[bool]:
        """For each whole page of ``tokens`` from the first on, as far as the mirror's trie
        goes, whether the replica holds it (a page may be held below one it does not hold:
        another tier holds that one). Same ``tokens`` as `match`."""
        toks = _token_list(tokens)
        check_extra_key(extra_key)
        node, ps, n, out = self._roots.get(extra_key), self.page_size, 0, []
        while node is not None and n + ps <= len(toks):
            node = node.children.get(tuple(toks[n : n + ps]))
            if node is None:
                break
            out.append(node.slots is not None)
            n += ps
        return out

    def pages(self) -> dict[tuple[Hashable, Page], Page]:
        """Every cached page: ``(extra_key, tokens from the prefix's start through the page) ->
        slots`` (the form the event tests compare with a manager's cached set)."""
        out: dict[tuple[Hashable, Page], Page] = {}
        for key, root in self._roots.items():
            stack: list[tuple[_Node, Page]] = [(root, ())]
            while stack:
                node, prefix = stack.pop()
                for page, child in node.children.items():
                    toks = prefix + page
                    if child.slots is not None:
                        out[(key, toks)] = child.slots
                    stack.append((child, toks))
        return out

    # ------------------------------------------------------------------ writing
    def apply(self, events: Iterable[CacheEvent]) -> None:
        """Replay ``events``, oldest first. Each event is checked before it changes anything
        (``ValueError`` for one that does not fit the mirror: a run that is not whole pages, a
        page stored twice, a removal of a page not held or held at other slots); the events
        before it stay applied, as they would on a subscriber reading a stream."""
        if isinstance(events, (BlockStored, BlockRemoved, AllCleared)):  # a tuple: iterable
            raise TypeError(
                f"events must be an iterable of events, got one {type(events).__name__}"
            )
        try:
            stream = iter(events)
        except TypeError:
            raise TypeError(
                f"events must be an iterable of cache events, got {type(events).__name__}"
            ) from None
        for ev in stream:
            if isinstance(ev, AllCleared):
                self._roots.clear()
                self._num_pages = 0
            elif isinstance(ev, BlockStored):
                self._store(ev)
            elif isinstance(ev, BlockRemoved):
                self._remove(ev)
            else:
                raise TypeError(f"events must hold cache events, got {type(ev).__name__}")
            self.events_applied += 1

    def _pages_of(self, ev: BlockStored | BlockRemoved) -> tuple[list[Page], list[Page]]:
        """The event's prefix before its run and the run itself, as pages (checked)."""
        check_extra_key(ev.extra_key)
        ps, n, m = self.page_size, len(ev.tokens), len(ev.slots)
        if m == 0 or m % ps or n % ps or m > n:
            raise ValueError(
                f"{type(ev).__name__} must cover whole pages of {ps} tokens: {n} tokens, {m} slots"
            )
        pages = [ev.tokens[i : i + ps] for i in range(0, n, ps)]
        slots = [ev.slots[i : i + ps] for i in range(0, m, ps)]
        return pages, slots

    def _store(self, ev: BlockStored) -> None:
        pages, slots = self._pages_of(ev)
        head = len(pages) - len(slots)
        node = self._roots.get(ev.extra_key)
        for page in pages[:head]:  # the path to the run; missing nodes are made below
            node = None if node is None else node.children.get(page)
        for i, page in enumerate(pages[head:]):  # check every page of the run first
            node = None if node is None else node.children.get(page)
            if node is not None and node.slots is not None:
                raise ValueError(f"BlockStored: page {head + i} of {ev.tokens!r} is held already")
        node = self._roots.setdefault(ev.extra_key, _Node(None, ()))
        for page in pages[:head]:
            node = node.children.setdefault(page, _Node(node, page))
        for page, page_slots in zip(pages[head:], slots, strict=True):
            node = node.children.setdefault(page, _Node(node, page))
            node.slots = page_slots
            self._num_pages += 1

    def _remove(self, ev: BlockRemoved) -> None:
        pages, slots = self._pages_of(ev)
        head = len(pages) - len(slots)
        node: _Node | None = self._roots.get(ev.extra_key)
        run: list[_Node] = []
        for i, page in enumerate(pages):
            node = None if node is None else node.children.get(page)
            if i >= head:
                if node is None or node.slots != slots[i - head]:
                    held = None if node is None else node.slots
                    raise ValueError(
                        f"BlockRemoved: page {i} of {ev.tokens!r} is held at {held}, "
                        f"not {slots[i - head]}"
                    )
                run.append(node)
        for n in run:
            n.slots = None
        self._num_pages -= len(run)
        self._prune(run[-1])

    def _prune(self, node: _Node) -> None:
        """Drop ``node`` and its ancestors while they hold nothing and lead nowhere."""
        while node.parent is not None and node.slots is None and not node.children:
            parent = node.parent
            del parent.children[node.page]
            node = parent
        if node.parent is None and not node.children:  # an empty namespace
            for key, root in list(self._roots.items()):
                if root is node:
                    del self._roots[key]


class TieredPrefixMirror:
    """A tiered replica's pages in each of its tiers, rebuilt from its `TierEvent` stream
    (``TieredCacheManager.take_tier_events()``): one `PrefixMirror` per medium (``mirrors``).

    `match` says how many leading tokens of a prompt the replica holds in *some* tier: a page on
    the host serves a request for the cost of a copy, not a recompute (SGLang's scheduler counts
    host hits in a request's matched prefix too).
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = check_positive_int(page_size, "page_size")
        self.mirrors = {m: PrefixMirror(self.page_size) for m in MEDIA}
        self.events_applied = 0

    @property
    def cached_tokens(self) -> int:
        """Tokens the replica holds on the device (its cache proper)."""
        return self.mirrors["device"].cached_tokens

    def apply(self, events: Iterable[TierEvent]) -> None:
        """Replay ``events``, oldest first, each into its medium's mirror (see
        `PrefixMirror.apply`; ``TypeError``/``ValueError`` for an event that does not fit,
        the events before it staying applied)."""
        if isinstance(events, TierEvent):
            raise TypeError("events must be an iterable of TierEvents, got one TierEvent")
        for ev in events:
            if not isinstance(ev, TierEvent) or ev.medium not in MEDIA:
                raise TypeError(
                    f"events must hold TierEvents of a medium in {MEDIA}, got {ev!r:.80}"
                )
            self.mirrors[ev.medium].apply([ev.event])
            self.events_applied += 1

    def match(self, tokens: torch.Tensor | Sequence[int], extra_key: Hashable = None) -> int:
        """Leading tokens of ``tokens`` held under ``extra_key`` in some tier: whole pages,
        each on the device or the host, from the first one on."""
        held = [m.held_pages(tokens, extra_key) for m in self.mirrors.values()]
        n = 0
        while any(n < len(h) and h[n] for h in held):
            n += 1
        return n * self.page_size

    def pages(self, medium: str) -> dict[tuple[Hashable, Page], Page]:
        """Every page held in ``medium`` (see `PrefixMirror.pages`)."""
        if medium not in MEDIA:
            raise ValueError(f"medium must be one of {MEDIA}, got {medium!r}")
        return self.mirrors[medium].pages()
