"""Expert cache policies: what the pager evicts.

Policies: ``fifo`` (evict the first in), ``lru``, ``lfu`` (frequencies kept across
evictions, ties to the least recent), ``lrfu`` (exponentially decayed frequency: recency and
frequency in one score), ``nextuse`` (an online estimate of Belady: evict the expert whose next
use, predicted from its layer's step cycle and its recent per-step use rate, is furthest away),
``hot`` (a hot set learned from saved usage counts stays pinned in part of the cache, the rest
is LRU) and ``adaptive`` (the default: follows whichever of LRU and two LRFU half-lives has had
the most hits lately, replaying each in a shadow cache).

Why ``adaptive`` is the default: on the bench's traces (``bench/bench_pager.py``: synthetic
generators at several settings, colibri's ``Workload``, topic and "sticky" models, sets held
out while its rules were made, and traces recorded from checkpoints, at several budgets) it
has the smallest mean gap to Belady, and it never trails LRU by more than its stake, a
theorem (:class:`AdaptivePolicy`), not a measurement. Each of the other policies loses to LRU
by a wide margin on some trace: use them only where measured on your own traffic. The
figures are in ``bench/README.md``.

The protocol every policy follows is :class:`~colibri.pager._policy_base.CachePolicy`'s;
``adaptive`` lives in :mod:`colibri.pager._adaptive`, trace replay and Belady's MIN in
:mod:`colibri.pager._replay`.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from colibri.pager._adaptive import AdaptivePolicy
from colibri.pager._policy_base import (
    CachePolicy,
    Key,
    _heap_push,
    _log2_add,
    _lowest_evictable,
)

__all__ = [
    "POLICIES",
    "AdaptivePolicy",
    "CachePolicy",
    "FIFOPolicy",
    "HotSetPolicy",
    "LFUPolicy",
    "LRFUPolicy",
    "LRUPolicy",
    "NextUsePolicy",
    "make_policy",
]


class FIFOPolicy(CachePolicy):
    """Evict the expert that became resident first; hits change nothing."""

    name = "fifo"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None

    def touch(self, key: Key) -> None:
        pass

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable):
        return next((k for k in self._order if evictable(k)), None)

    def eviction_order(self):
        return list(self._order)


class LRUPolicy(FIFOPolicy):
    """Evict the least recently used expert."""

    name = "lru"

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)


class _HeapPolicy(CachePolicy):
    """Evict the resident key of lowest score; a lazy heap keeps victim() cheap."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._score: dict[Key, tuple] = {}  # resident keys -> current score
        self._heap: list[tuple] = []

    def _push(self, key: Key, score: tuple) -> None:
        _heap_push(self._score, self._heap, key, score)

    def remove(self, key: Key) -> None:
        self._score.pop(key, None)

    def victim(self, evictable):
        return _lowest_evictable(self._heap, self._score, evictable)

    def eviction_order(self):
        return sorted(self._score, key=self._score.__getitem__)


class LFUPolicy(_HeapPolicy):
    """Evict the least frequently used expert; counts survive eviction ("perfect" LFU), ties
    go to the least recently used."""

    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._count: dict[Key, int] = {}
        self._clock = 0

    def _access(self, key: Key) -> None:
        self._clock += 1
        self._count[key] = self._count.get(key, 0) + 1
        self._push(key, (self._count[key], self._clock))

    insert = touch = _access


class LRFUPolicy(_HeapPolicy):
    """Least Recently/Frequently Used: score = sum over past accesses of ``2**(-age/half_life)``
    (age in accesses). Small ``half_life`` behaves like LRU, large like LFU.

    Scores are kept as ``log2`` of the undecayed sum, so they never need rescaling and the heap
    order stays valid between accesses.
    """

    name = "lrfu"

    def __init__(self, capacity: int, half_life: float | None = None) -> None:
        super().__init__(capacity)
        # Default: a few cache turnovers, long enough to learn popularity, short enough to drift.
        self.half_life = float(half_life) if half_life else 4.0 * max(capacity, 1)
        self._log: dict[Key, float] = {}
        self._clock = 0

    def _access(self, key: Key) -> None:
        self._clock += 1
        self._log[key] = _log2_add(self._log.get(key), self._clock / self.half_life)
        self._push(key, (self._log[key],))

    insert = touch = _access


class HotSetPolicy(LRUPolicy):
    """Pin a hot set learned from saved usage counts; LRU for the rest of the cache.

    Parameters
    ----------
    capacity : int
        Cache slots.
    counts : mapping, array [L, E] or sequence of UsageStats
        How often each expert was used: ``{(layer, expert): count}`` (what
        :meth:`colibri.Pager.usage` returns, saved from an earlier run), an array ``[L, E]``,
        or one :class:`colibri.UsageStats` per layer (their ``counts [E]`` stacked).
    hot_fraction : float
        Share of the slots reserved for the hottest experts (default 0.5).
    """

    name = "hot"

    def __init__(self, capacity: int, counts=None, hot_fraction: float = 0.5) -> None:
        super().__init__(capacity)
        if counts is None:
            raise ValueError(
                "the 'hot' policy needs usage counts: set_cache_policy('hot', counts=...) with "
                "Pager.usage() from an earlier run"
            )
        if not 0.0 <= hot_fraction <= 1.0:
            raise ValueError(f"hot_fraction must be in [0, 1] (got {hot_fraction!r})")
        ranked = sorted(_counts_mapping(counts).items(), key=lambda kv: (-kv[1], kv[0]))
        size = int(hot_fraction * capacity)
        self.hot = frozenset(k for k, c in ranked[:size] if c > 0)

    def victim(self, evictable):
        cold = next((k for k in self._order if k not in self.hot and evictable(k)), None)
        return cold if cold is not None else super().victim(evictable)


class NextUsePolicy(CachePolicy):
    """Online estimate of Belady's MIN: evict the expert expected to be needed furthest ahead.

    A layer's steps recur (once per token during decoding), so the time to an expert's next
    use is estimated as the time until its layer's next step, ``d``, plus whole periods while
    it is not picked: ``E[next use] = d + period * (1 - p) / p``, where ``p`` is the expert's
    share of its layer's recent steps (an exponential average over ``window`` steps of that
    layer, kept across evictions) and ``period`` the layer's average step interval.

    Within a layer the order by ``p`` does not change between that layer's steps, so each
    layer keeps a heap and a victim costs one heap look-up per layer, not a scan of the cache.

    Parameters
    ----------
    capacity : int
        Cache slots.
    window : float
        Memory of the per-layer use rate, in steps of that layer (default 32).
    """

    name = "nextuse"

    def __init__(self, capacity: int, window: float = 32.0) -> None:
        super().__init__(capacity)
        if window < 1:
            raise ValueError(f"window must be >= 1 (got {window!r})")
        self.decay = 1.0 - 1.0 / float(window)
        self._log_decay = math.log(self.decay) if window > 1 else -math.inf
        self._clock = 0
        self._visits: dict[int, int] = {}  # layer -> steps seen
        self._last_step: dict[int, int] = {}  # layer -> clock of its last step
        self._period: dict[int, float] = {}  # layer -> mean interval between its steps
        self._rate: dict[Key, tuple[float, int]] = {}  # key -> (rate, visit it was set at)
        # Resident keys per layer: time-invariant order key log(p) - visits * log(decay).
        self._score: dict[Key, float] = {}
        self._heaps: dict[int, list[tuple[float, Key]]] = {}

    def _invariant(self, key: Key) -> float:
        rate, at = self._rate.get(key, (0.0, 0))
        if rate <= 0.0:
            return -math.inf
        return math.log(rate) - at * self._log_decay

    def _push(self, key: Key) -> None:
        score = self._invariant(key)
        self._score[key] = score
        heap = self._heaps.setdefault(key[0], [])
        heapq.heappush(heap, (score, key))
        if len(heap) > 64 and len(heap) > 4 * sum(1 for k in self._score if k[0] == key[0]):
            heap[:] = [(v, k) for k, v in self._score.items() if k[0] == key[0]]
            heapq.heapify(heap)

    def begin_step(self, layer: int, keys: list[Key]) -> None:
        self._clock += 1
        last = self._last_step.get(layer)
        if last is not None:
            gap = self._clock - last
            old = self._period.get(layer)
            self._period[layer] = gap if old is None else 0.9 * old + 0.1 * gap
        self._last_step[layer] = self._clock
        visit = self._visits[layer] = self._visits.get(layer, 0) + 1
        for key in keys:
            rate, at = self._rate.get(key, (0.0, visit))
            self._rate[key] = (rate * self.decay ** (visit - at) + (1.0 - self.decay), visit)
            if key in self._score:
                self._push(key)

    def insert(self, key: Key) -> None:
        self._push(key)

    def touch(self, key: Key) -> None:
        pass

    def remove(self, key: Key) -> None:
        self._score.pop(key, None)

    def _expected_next_use(self, key: Key) -> float:
        layer = key[0]
        period = self._period.get(layer, 1.0)
        d = self._last_step.get(layer, self._clock) + period - self._clock
        score = self._score.get(key, self._invariant(key))
        if score == -math.inf:
            return math.inf
        p = math.exp(min(0.0, score + self._visits.get(layer, 0) * self._log_decay))
        return max(d, 0.0) + period * (1.0 - p) / max(p, 1e-300)

    def victim(self, evictable):
        best, best_t = None, -1.0
        for heap in self._heaps.values():
            found = _lowest_evictable(heap, self._score, evictable)
            if found is not None:
                t = self._expected_next_use(found)
                if t > best_t:
                    best, best_t = found, t
        return best

    def eviction_order(self):
        return sorted(self._score, key=self._expected_next_use, reverse=True)


def _counts_mapping(counts) -> dict[Key, float]:
    if isinstance(counts, Mapping):
        return {(int(k[0]), int(k[1])): float(v) for k, v in counts.items()}
    if isinstance(counts, (list, tuple)) and counts and hasattr(counts[0], "counts"):
        counts = np.stack([np.asarray(s.counts) for s in counts])  # one UsageStats per layer
    arr = np.asarray(getattr(counts, "counts", counts))
    if arr.ndim != 2:
        raise ValueError(
            f"counts must be a mapping {{(layer, expert): count}}, an array [L, E] or one "
            f"UsageStats per layer (got shape {arr.shape}; a single UsageStats is one layer: "
            "pass [stats])"
        )
    return {(int(layer), int(e)): float(arr[layer, e]) for layer, e in np.ndindex(arr.shape)}


POLICIES: dict[str, type[CachePolicy]] = {
    p.name: p
    for p in (
        FIFOPolicy,
        LRUPolicy,
        LFUPolicy,
        LRFUPolicy,
        NextUsePolicy,
        HotSetPolicy,
        AdaptivePolicy,
    )
}


def make_policy(name: str | CachePolicy, capacity: int, **options) -> CachePolicy:
    """Build a policy by name (a key of :data:`POLICIES`) or pass one through."""
    if isinstance(name, CachePolicy):
        return name
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown cache policy {name!r}; available: {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(capacity, **options)
