"""Fault injection for the all-or-nothing tests: make the calls an object makes on its
dependencies raise, one call at a time.

A `Faults` counts, in one sequence, every call made through what it wraps: the methods and
properties of an object seen through `Faults.wrap` (a `Proxy`), and callbacks made with
`Faults.callback`. Call number ``fail_at`` (0-based) raises ``error`` before it goes through, so
the dependency changes nothing (a dependency that fails halfway is its own atomicity's job; calls
an object makes on itself do not go through its proxy). Run a scenario once with
``fail_at=None`` to learn its calls (``faults.calls``, their names in order), then once per call
with that call failing::

    dry = Faults()
    scenario(dry)                       # e.g. flow.manager = dry.wrap(manager, MANAGER_CALLS)
    for n, name in enumerate(dry.calls):
        for error in (RuntimeError, KeyboardInterrupt):
            faults = Faults(fail_at=n, error=error)
            ...  # a fresh scenario with `faults`: it must raise `faults.raised`, then check

Reusable for any object that talks to others through attributes it holds (the flow's manager and
allocator, a scheduler's flow, an engine's model, a tier's host pool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Faults", "Proxy"]


class Faults:
    """The call counter and the fault: call ``fail_at`` raises ``error(message)``."""

    def __init__(
        self, fail_at: int | None = None, error: type[BaseException] = RuntimeError
    ) -> None:
        self.fail_at = fail_at
        self.error = error
        self.calls: list[str] = []  # the name of every call made through a wrapper, in order
        self.raised: BaseException | None = None  # the fault, once raised

    def tick(self, name: str) -> None:
        """Count a call to ``name``; raise the fault if it is call ``fail_at``."""
        n = len(self.calls)
        self.calls.append(name)
        if n == self.fail_at:
            self.raised = self.error(f"injected fault at call {n} ({name})")
            raise self.raised

    def wrap(self, target: Any, names: Iterable[str], label: str | None = None) -> Any:
        """``target`` seen through a `Proxy` that counts its methods and properties ``names``."""
        return Proxy(target, frozenset(names), self, label or type(target).__name__)

    def callback(self, fn: Callable[..., Any], name: str = "callback") -> Callable[..., Any]:
        """``fn``, counted as ``name`` on every call."""

        def call(*args: Any, **kwargs: Any) -> Any:
            self.tick(name)
            return fn(*args, **kwargs)

        return call


class Proxy:
    """Forwards every attribute to ``target``; those in ``names`` are counted by ``faults``: a
    method on each call, a property on each read (before it is read)."""

    def __init__(self, target: Any, names: frozenset[str], faults: Faults, label: str) -> None:
        self._target = target
        self._names = names
        self._faults = faults
        self._label = label

    def __getattr__(self, name: str) -> Any:  # reached only for names the proxy lacks
        target = self.__dict__["_target"]
        if name not in self.__dict__["_names"]:
            return getattr(target, name)
        label = f"{self.__dict__['_label']}.{name}"
        faults = self.__dict__["_faults"]
        if isinstance(getattr(type(target), name, None), property):
            faults.tick(label)
            return getattr(target, name)
        method = getattr(target, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            faults.tick(label)
            return method(*args, **kwargs)

        return call
