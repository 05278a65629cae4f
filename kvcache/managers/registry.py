"""Managers by name, as mini-sglang's scheduler picks one (``--cache-type radix``).

`SUPPORTED_CACHE_MANAGER` maps a name to a factory ``(device, **options) -> BaseCacheManager``:
``"naive"``, ``"radix"`` and ``"block_hash"``, registered where the package's managers are
gathered (``kvcache/managers/__init__.py``, as mini-sglang registers its own);
`create_cache_manager(device, type, **options)` builds one (the options are the manager's own
keywords, e.g. ``page_size``). `Registry` is the name table itself, with mini-sglang's methods,
for any kind of variant: the eviction policies (`EVICTION_POLICIES`) are one too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

from .base import BaseCacheManager

__all__ = [
    "Registry",
    "RegistryError",
    "CacheManagerFactory",
    "SUPPORTED_CACHE_MANAGER",
    "create_cache_manager",
]

T = TypeVar("T")


class RegistryError(KeyError, ValueError):
    """A name that is not registered, or registered twice. A `KeyError`, as mini-sglang's
    registry raises, and a `ValueError`, as this package raises for a bad argument."""

    def __str__(self) -> str:  # a KeyError would print its message quoted
        return str(self.args[0]) if self.args else ""


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a registry name must be a str, got {type(name).__name__}: {name!r:.60}")
    return name


class Registry(Generic[T]):
    """Named variants of one kind (``kind`` names it in messages): register, look up, list.

    ``register(name)`` is a decorator that files its argument under ``name`` and returns it
    unchanged; ``registry[name]`` looks it up. A name registered twice, or looked up but never
    registered, raises `RegistryError`; a name that is not a ``str``, ``TypeError``.
    """

    def __init__(self, kind: str) -> None:
        self._kind = _check_name(kind)
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """``@registry.register("name")``: file the decorated item under ``name``. A taken name
        raises at once, before anything is decorated."""
        if _check_name(name) in self._items:
            raise RegistryError(f"{self._kind} {name!r} is already registered")

        def file(item: T) -> T:
            if name in self._items:  # registered between the call and the decoration
                raise RegistryError(f"{self._kind} {name!r} is already registered")
            self._items[name] = item
            return item

        return file

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[_check_name(name)]
        except KeyError:
            raise RegistryError(
                f"unsupported {self._kind}: {name!r}; supported: {self.supported_names()}"
            ) from None

    def __delitem__(self, name: str) -> None:
        """Forget ``name`` (a test's own variant, say); `RegistryError` if it is not registered."""
        self[name]
        del self._items[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        """The registered names, in the order they were registered."""
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def supported_names(self) -> list[str]:
        """The registered names, in the order they were registered."""
        return list(self._items)

    def assert_supported(self, names: str | Iterable[str]) -> None:
        """`RegistryError` naming the first of ``names`` (one name or several) not registered;
        ``TypeError`` naming what was given when ``names`` is neither a ``str`` nor an iterable
        of them."""
        if isinstance(names, str):
            self[names]
            return
        given: object = names  # a caller may pass anything: checked here
        try:
            if isinstance(given, (bytes, bytearray)):  # iterable, but of ints
                raise TypeError
            listed = list(names)
        except TypeError:
            raise TypeError(
                f"names must be a str or an iterable of str, got {type(names).__name__}: "
                f"{names!r:.60}"
            ) from None
        for name in listed:
            self[name]

    def __repr__(self) -> str:
        return f"Registry({self._kind!r}, {self.supported_names()})"


#: What `SUPPORTED_CACHE_MANAGER` holds: ``(device, **options) -> BaseCacheManager`` (a class).
CacheManagerFactory = Callable[..., BaseCacheManager]

#: The managers by name (the package's own are registered in ``kvcache/managers/__init__.py``);
#: ``SUPPORTED_CACHE_MANAGER.register("name")`` adds one.
SUPPORTED_CACHE_MANAGER: Registry[CacheManagerFactory] = Registry("cache manager")


def create_cache_manager(device: torch.device | str, type: str, **options: Any) -> BaseCacheManager:
    """The manager registered as ``type``, on ``device``, built with ``options`` (its own
    keywords: ``page_size``, ``eviction_policy``, ``events``, ...).

    ``create_cache_manager(device, "radix")`` is mini-sglang's call. `RegistryError` (a
    `KeyError` and a `ValueError`) for an unknown ``type``, naming the supported ones; the
    manager's own errors for a bad ``device`` or option.
    """
    return SUPPORTED_CACHE_MANAGER[type](device, **options)
