"""Cache events: replaying ``take_events()`` on an empty mirror rebuilds the manager's cached set.

The cached set is read through the public API, page by page:
``(extra_key, tokens from the prefix's start through the page) -> the page's slots``. A
hypothesis state machine inserts, matches (the radix tree splits), locks and unlocks, evicts
and resets under a few namespaces; after every step the events since the last step are
replayed on the mirror, which must then equal the cached set. The mirror and the machine are in
``tests/cache_mirror.py``, which the router tests share.
"""

from __future__ import annotations

import pytest
from cache_mirror import MAKERS, EventMirror
from conftest import ids, slots
from hypothesis import settings

from kvcache import (
    AllCleared,
    BaseCacheManager,
    BlockHashCacheManager,
    BlockRemoved,
    BlockStored,
    RadixCacheManager,
)


@pytest.mark.parametrize("make", list(MAKERS))
def test_replayed_events_mirror_the_cache(make: str) -> None:
    machine: type[EventMirror] = type(f"EventMirror_{make}", (EventMirror,), {"make": make})
    settings_ = settings(max_examples=40, stateful_step_count=30, deadline=None, derandomize=True)
    machine.TestCase.settings = settings_
    machine.TestCase().runTest()


@pytest.mark.parametrize("make", [RadixCacheManager, BlockHashCacheManager])
def test_events_are_off_by_default(make: type[BaseCacheManager]) -> None:
    m = make(page_size=2)  # type: ignore[call-arg]
    m.insert_prefix(ids(1, 2), slots(0, 1))
    with pytest.raises(RuntimeError, match="events=True"):
        m.take_events()  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="events must be a bool"):
        make(page_size=2, events=1)  # type: ignore[call-arg]


def test_a_split_sends_nothing_and_removal_names_the_whole_prefix() -> None:
    m = RadixCacheManager(page_size=1, events=True)
    m.insert_prefix(ids(1, 2, 3, 4), slots(10, 11, 12, 13), extra_key="t")
    m.match_prefix(ids(1, 2, 9), extra_key="t")  # splits the node after 2 tokens
    m.insert_prefix(ids(1, 2, 7), slots(20, 21, 22), extra_key="t")
    m.evict(1)  # the least recently used leaf: (3, 4)
    m.reset()
    assert m.take_events() == [
        BlockStored("t", (1, 2, 3, 4), (10, 11, 12, 13)),
        BlockStored("t", (1, 2, 7), (22,)),
        BlockRemoved("t", (1, 2, 3, 4), (12, 13)),
        AllCleared(),
    ]
