"""The cache-policy protocol, and the lazy heaps policies keep their order in.

The cache unit is one expert, keyed ``(layer, expert)``; every expert takes one slot of the
pager's pool. A policy only orders keys; the pager (or :func:`replay`) owns residency. Protocol:

``insert(key)`` after a miss made ``key`` resident; ``touch(key)`` on a hit; ``remove(key)`` when
it leaves; ``victim(evictable)`` names the key to evict among those for which
``evictable(key)`` is true (pinned experts are skipped), or ``None``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

__all__ = ["CachePolicy"]

Key = tuple[int, int]


class CachePolicy:
    """Base class: orders resident keys for eviction (see the module docstring)."""

    name = "base"

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)

    def begin_step(self, layer: int, keys: list[Key]) -> None:
        """A step of ``layer`` needing ``keys`` starts (before its touches and inserts).
        A pager with a slot for every expert never evicts and does not call it."""

    def insert(self, key: Key) -> None:
        raise NotImplementedError

    def touch(self, key: Key) -> None:
        raise NotImplementedError

    def remove(self, key: Key) -> None:
        raise NotImplementedError

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        raise NotImplementedError

    def eviction_order(self) -> list[Key]:
        """Resident keys, the next victim first (used when switching policies)."""
        raise NotImplementedError


# A lazy heap: ``scores`` maps each live key to its score, ``heap`` holds ``(score, key)``
# entries, the stale ones (an old score, or a key gone) dropped when met.


def _heap_push(scores: dict[Key, object], heap: list[tuple], key: Key, score: object) -> None:
    """Give ``key`` a new ``score``; rebuild the heap when stale entries outnumber the live
    ones four to one."""
    scores[key] = score
    heapq.heappush(heap, (score, key))
    if len(heap) > 4 * len(scores) + 64:
        heap[:] = [(v, k) for k, v in scores.items()]
        heapq.heapify(heap)


def _lowest_evictable(heap: list[tuple], scores: dict[Key, object], evictable) -> Key | None:
    """The live key of lowest score for which ``evictable(key)`` is true, or None. Stale
    entries met on the way are dropped; live ones stay."""
    skipped, found = [], None
    while heap:
        entry = heapq.heappop(heap)
        if scores.get(entry[1]) != entry[0]:
            continue  # stale
        skipped.append(entry)
        if evictable(entry[1]):
            found = entry[1]
            break
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found


def _log2_add(old: float | None, t: float) -> float:
    """``log2(2**old + 2**t)`` without overflow (``old`` None: the first access)."""
    if old is None:
        return t
    return max(old, t) + math.log2(1 + 2 ** -abs(old - t))
