"""The one memo of the cost model and the planner: bounded, keyed by an owner object's identity plus values.

The planner costs ~10^5 layouts per search, and most of what each needs (a cluster's topology, a rank's
links, a layer's cost, a stack's data-parallel behaviour) repeats. The owners (cluster, topology,
calibration, stack, a list of rank environments) are frozen but too costly to hash on every call, so an
entry is keyed by the owner's id() and keeps the owner alive: an id is never reused while its entry lives,
and a hit is checked to be the same object. A full cache is cleared: one search's working set is small.
"""

from __future__ import annotations

from typing import Generic, Hashable, TypeVar

V = TypeVar("V")


class Missing:
    """What `get` returns on a miss (None can be a cached value)."""


MISSING = Missing()


class IdentityCache(Generic[V]):
    __slots__ = ("limit", "entries")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: dict[tuple[int, Hashable], tuple[object, V]] = {}

    def get(self, owner: object, key: Hashable = None) -> V | Missing:
        """The value stored for (owner, key), or MISSING."""
        entry = self.entries.get((id(owner), key))
        return entry[1] if entry is not None and entry[0] is owner else MISSING

    def put(self, owner: object, key: Hashable, value: V) -> V:
        """Store and return `value`."""
        if len(self.entries) >= self.limit:
            self.entries.clear()
        self.entries[(id(owner), key)] = (owner, value)
        return value
