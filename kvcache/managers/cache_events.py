"""Namespaces (``extra_key``) and the cache event log shared by the prefix-cache managers.

A *namespace* is any hashable ``extra_key`` (a tenant's cache salt, a LoRA adapter id; ``None``
is a namespace of its own, the default): prefixes cached under different keys never match each
other, as SGLang's ``extra_key`` and vLLM's ``cache_salt`` promise.

The *events* let something outside the process mirror a manager's cached set, defined per page:
``(extra_key, tokens from the start of the prefix up to the end of the page) -> the page's slots``.
`BlockStored` adds the pages of a run of new tokens, `BlockRemoved` drops those of a run that
left the cache, `AllCleared` drops everything. Replaying a manager's events, oldest first, on an
empty mirror gives its cached set (the radix tree's splits change no page, so they send nothing).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "check_extra_key",
    "BlockStored",
    "BlockRemoved",
    "AllCleared",
    "CacheEvent",
    "EventLog",
]


def check_extra_key(extra_key: object) -> Hashable:
    """``extra_key`` if it can name a namespace (any hashable); ``TypeError`` naming it otherwise,
    ``ValueError`` for a NaN float (equal to no other NaN: what is cached under one float("nan")
    could never be matched under the next)."""
    try:
        hash(extra_key)
    except TypeError:
        raise TypeError(
            f"extra_key must be hashable (str, int, bytes, None, ...), got "
            f"{type(extra_key).__name__} {extra_key!r}"
        ) from None
    if isinstance(extra_key, (float, np.floating)) and extra_key != extra_key:
        raise ValueError(f"extra_key must not be NaN (it equals no other NaN), got {extra_key!r}")
    return extra_key


class BlockStored(NamedTuple):
    """Pages entered the cache: the last ``len(slots)`` of ``tokens`` now sit at ``slots``.

    ``tokens`` is the whole prefix, from its first token to the end of the new run (whole
    pages); ``tokens[:-len(slots)]`` was cached already (under the same ``extra_key``).
    """

    extra_key: Hashable
    tokens: tuple[int, ...]
    slots: tuple[int, ...]


class BlockRemoved(NamedTuple):
    """Pages left the cache: the last ``len(slots)`` tokens of prefix ``tokens``, which sat at ``slots``."""

    extra_key: Hashable
    tokens: tuple[int, ...]
    slots: tuple[int, ...]


class AllCleared(NamedTuple):
    """Every cached prefix of every namespace was forgotten (``reset``)."""


#: One entry of `take_events()`: a `BlockStored`, `BlockRemoved` or `AllCleared`.
CacheEvent = BlockStored | BlockRemoved | AllCleared


class EventLog:
    """The events a manager recorded since the last `take`, oldest first."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[CacheEvent] = []

    def stored(self, extra_key: Hashable, tokens: list[int], slots: list[int]) -> None:
        self._events.append(BlockStored(extra_key, tuple(tokens), tuple(slots)))

    def removed(self, extra_key: Hashable, tokens: list[int], slots: list[int]) -> None:
        self._events.append(BlockRemoved(extra_key, tuple(tokens), tuple(slots)))

    def cleared(self) -> None:
        self._events.append(AllCleared())

    def take(self) -> list[CacheEvent]:
        out, self._events = self._events, []
        return out


def events_off(manager: str) -> RuntimeError:
    """The error `take_events` raises on a manager built without ``events=True``."""
    return RuntimeError(f"{manager} records no events; construct it with events=True")


def take_events(self: Any) -> list[CacheEvent]:
    """What was stored, removed and cleared since the last call, oldest first; empties the log.

    ``RuntimeError`` unless the manager was built with ``events=True``. A method of the radix
    and block-hash managers (each keeps its `EventLog`, or ``None``, as ``_events``).
    """
    log: EventLog | None = self._events
    if log is None:
        raise events_off(type(self).__name__)
    return log.take()
