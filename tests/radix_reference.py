"""A deliberately simple reference for prefix caches: a dict from every cached page-aligned prefix
to the slots of its last page and its last-use / insert times. No tree, no heap, no splits."""

from __future__ import annotations

from dataclasses import dataclass

Prefix = tuple[int, ...]


@dataclass
class Entry:
    slots: tuple[int, ...]
    used: int
    inserted: int


class ReferenceCache:
    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.entries: dict[Prefix, Entry] = {}
        self.locks: dict[Prefix, int] = {}  # locked prefix -> number of locks
        self.clock = 0

    def _aligned(self, seq: Prefix) -> Prefix:
        return seq[: len(seq) // self.ps * self.ps]

    def longest(self, seq: Prefix) -> int:
        seq, k = self._aligned(seq), 0
        while k < len(seq) and seq[: k + self.ps] in self.entries:
            k += self.ps
        return k

    def slots(self, seq: Prefix, k: int) -> list[int]:
        return [s for i in range(self.ps, k + 1, self.ps) for s in self.entries[seq[:i]].slots]

    def match(self, seq: Prefix) -> tuple[int, list[int]]:
        self.clock += 1
        k = self.longest(seq)
        for i in range(self.ps, k + 1, self.ps):
            self.entries[seq[:i]].used = self.clock
        return k, self.slots(seq, k)

    def insert(self, seq: Prefix, slots: list[int]) -> int:
        k = self.match(seq)[0]
        seq = self._aligned(seq)
        for i in range(k + self.ps, len(seq) + 1, self.ps):
            self.entries[seq[:i]] = Entry(tuple(slots[i - self.ps : i]), self.clock, self.clock)
        return k

    def locked(self, prefix: Prefix) -> bool:
        return any(lock[: len(prefix)] == prefix for lock in self.locks)

    def sizes(self) -> tuple[int, int]:
        protected = sum(self.ps for p in self.entries if self.locked(p))
        return len(self.entries) * self.ps - protected, protected

    def leaves(self) -> list[Prefix]:
        return [
            p for p in self.entries if not any(q[: len(p)] == p and q != p for q in self.entries)
        ]

    def owner_of_slots(self) -> dict[int, Prefix]:
        return {s: p for p, e in self.entries.items() for s in e.slots}
