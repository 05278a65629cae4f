"""Fault injection: make any dependency raise on its N-th call, for every N a scenario reaches.

A `Faults` counts the calls made through the methods it wraps, all of them together, and makes
call number ``fail_at`` raise ``exc`` *instead of* running (a dependency that fails before it
does anything; one that fails part-way is a later call of the same scenario failing, e.g. the
pool's ``store_kv`` of the second layer). Run a scenario once with ``Faults()`` to count its
calls, then once for every ``n`` in ``range(1, faults.calls + 1)`` with ``Faults(n, exc)``::

    faults = Faults(fail_at=n, exc=KeyboardInterrupt)
    faults.patch(manager, "manager")        # every public method of the object
    faults.patch(flow, "flow", ["begin", "finish"])
    runner = faults.wrap(runner, "runner")  # a callable, its attributes (vocab_size) kept
    ...
    with faults.paused():                   # the test's own checks are not counted
        flow.check_integrity()

``raised`` is the exception it raised (``None`` before), ``where`` the label of that call.
Exceptions it raises carry the label, so a failing test says which call it was.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Faults", "public_methods"]


def public_methods(obj: object) -> list[str]:
    """Names of ``obj``'s public methods (not properties, not dunders), sorted."""
    names = []
    for name in dir(type(obj)):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(type(obj), name)
        if isinstance(attr, property) or not callable(getattr(obj, name, None)):
            continue
        names.append(name)
    return sorted(names)


class Faults:
    """Counts the calls of wrapped methods; call ``fail_at`` (1-based) raises ``exc``."""

    def __init__(self, fail_at: int | None = None, exc: type[BaseException] = RuntimeError):
        self.fail_at = fail_at
        self.exc = exc
        self.calls = 0
        self.raised: BaseException | None = None
        self.where: str | None = None
        self._paused = 0

    def wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        """``fn``, counted (and failing at call ``fail_at``)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._paused:
                self.calls += 1
                if self.calls == self.fail_at:
                    self.where = label
                    self.raised = self.exc(f"injected fault: call {self.calls}, {label}")
                    raise self.raised
            return fn(*args, **kwargs)

        functools.update_wrapper(call, fn)  # keeps attributes such as a runner's vocab_size
        return call

    def patch(self, obj: Any, label: str, names: Iterable[str] | None = None) -> Any:
        """Wrap ``names`` (default: every public method) of ``obj`` in place; returns ``obj``."""
        for name in public_methods(obj) if names is None else names:
            setattr(obj, name, self.wrap(getattr(obj, name), f"{label}.{name}"))
        return obj

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Calls made inside are neither counted nor failed."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def is_mine(self, error: BaseException) -> bool:
        """Whether ``error`` is the fault this raised (or was raised while handling it)."""
        while error is not None:
            if error is self.raised:
                return True
            error = error.__context__  # type: ignore[assignment]
        return False
