"""Expert cache policies, a routing-trace recorder, and offline replay against Belady's MIN.

The cache unit is one expert, keyed ``(layer, expert)``; every expert takes one slot of the
pager's pool, so the problem is unit-size paging and Belady's MIN is the exact offline optimum
(for demand paging: every expert of a step must be resident at once, none is bypassed).

A policy only orders keys; the pager (or :func:`replay`) owns residency. Protocol:

``insert(key)`` after a miss made ``key`` resident; ``touch(key)`` on a hit; ``remove(key)`` when
it leaves; ``victim(evictable)`` names the key to evict among those for which
``evictable(key)`` is true (pinned experts are skipped), or ``None``.

Policies: ``fifo`` (the seed's default), ``lru``, ``lfu`` (frequencies kept across evictions,
ties to the least recent), ``lrfu`` (exponentially decayed frequency: recency and frequency in
one score), ``nextuse`` (an online estimate of Belady: evict the expert whose next use, predicted
from its layer's step cycle and its recent per-step use rate, is furthest away) and ``hot`` (a
hot set learned from saved usage counts stays pinned in part of the cache, the rest is LRU)
and ``adaptive`` (the default: follows whichever of LRU and two LRFU half-lives has had the
most hits lately, replaying each in a shadow cache).

On the bench's 108 trace x budget rows (``bench/bench_pager.py``: the bench's generator at
several settings, iid and Zipf-only traffic, colibri's ``Workload``, separate topic and
"sticky" models, four sets held out while ``adaptive``'s rules were made, and traces recorded
from checkpoints; 12.5-50% budgets) ``adaptive`` has the smallest mean gap to Belady and
never trails LRU by more than its stake (a theorem); it is at or above LRU on 106 rows and
below on two topic-model rows at 50%, by 0.36 and 0.17 points. ``lrfu``, ``nextuse``,
``lfu`` and ``hot`` each lose to LRU by 19 to 65 points on some trace, ``fifo`` by 14: use
them only where measured on your own traffic.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

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
    "ReplayResult",
    "Trace",
    "belady",
    "make_policy",
    "replay",
]

Key = tuple[int, int]


class CachePolicy:
    """Base class: orders resident keys for eviction (see the module docstring)."""

    name = "base"

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)

    def begin_step(self, layer: int, keys: list[Key]) -> None:
        """A step of ``layer`` needing ``keys`` starts (before its touches and inserts)."""

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


def _lowest_evictable(heap: list[tuple], current, evictable) -> Key | None:
    """The key (last item) of the lowest entry of a lazy heap that is ``current`` and
    ``evictable``, or None. Stale entries met on the way are dropped; live ones stay."""
    skipped, found = [], None
    while heap:
        entry = heapq.heappop(heap)
        if not current(entry):
            continue  # stale
        skipped.append(entry)
        if evictable(entry[-1]):
            found = entry[-1]
            break
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found


class _HeapPolicy(CachePolicy):
    """Evict the resident key of lowest score; a lazy heap keeps victim() cheap."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._score: dict[Key, tuple] = {}  # resident keys -> current score
        self._heap: list[tuple] = []

    def _push(self, key: Key, score: tuple) -> None:
        self._score[key] = score
        heapq.heappush(self._heap, (*score, key))
        if len(self._heap) > 4 * len(self._score) + 64:  # drop stale entries now and then
            self._heap = [(*s, k) for k, s in self._score.items()]
            heapq.heapify(self._heap)

    def remove(self, key: Key) -> None:
        self._score.pop(key, None)

    def victim(self, evictable):
        return _lowest_evictable(self._heap, lambda e: self._score.get(e[-1]) == e[:-1], evictable)

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
        t = self._clock / self.half_life
        old = self._log.get(key)
        self._log[key] = t if old is None else max(old, t) + math.log2(1 + 2 ** -abs(old - t))
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
            found = _lowest_evictable(heap, lambda e: self._score.get(e[1]) == e[0], evictable)
            if found is not None:
                t = self._expected_next_use(found)
                if t > best_t:
                    best, best_t = found, t
        return best

    def eviction_order(self):
        return sorted(self._score, key=self._expected_next_use, reverse=True)


def _log2_add(old: float | None, t: float) -> float:
    """``log2(2**old + 2**t)`` without overflow (``old`` None: the first access)."""
    if old is None:
        return t
    return max(old, t) + math.log2(1 + 2 ** -abs(old - t))


class AdaptivePolicy(CachePolicy):
    """Follow whichever of LRU and a few LRFU half-lives is winning, never far behind LRU.

    Every candidate keeps its LRFU score of each key (LRU is LRFU with a vanishing half-life:
    the latest access decides) and a shadow cache of the real capacity, replayed step by step
    exactly as the pager serves (prefetches included). This is the "multiple experts" scheme
    of ACME (Ari et al., 2002) with three rules.

    **The victim is a resident the leader's shadow no longer holds**, the one it dropped
    first; only when the real cache holds nothing but the shadow's keys does the leader's
    score choose. So the real cache converges to the leader's shadow and, over each lead,
    has at most ``capacity`` fewer hits than it. :attr:`switches` counts changes of leader.

    **A switch needs significant evidence.** Between two candidates, each step's accesses
    that exactly one of their shadows hits are the disagreements; under the hypothesis that
    neither is better, one's lead over the other after ``n`` disagreements is a sum of ``n``
    fair signs, of standard deviation ``sqrt(n)``. A candidate takes the lead only when its
    lead over the leader and over LRU (both exponentially averaged over ``memory`` steps),
    less the switch's cost (the real residents outside its shadow), exceeds ``z`` standard
    deviations; a non-LRU leader falls back to LRU as soon as LRU leads it by ``z``.

    **Only a stake is ever risked against LRU** (a theorem, checked step by step in the
    tests). Let ``D`` be the real cache's hits minus LRU's shadow's since the start and
    ``out`` the real residents LRU's shadow lacks. While LRU leads, ``D - out`` never falls
    (every real miss LRU hits evicts one of those outsiders), and in any step it falls by at
    most the step's width ``w``. So a non-LRU candidate leads a step only if
    ``D - out - w >= -stake``; otherwise LRU does. Then ``D >= out - stake >= -stake`` after
    every step, however many switches: adaptive is never more than ``stake`` hits behind
    LRU, a loss of hit rate that vanishes with the trace's length. A switch to a non-LRU
    candidate is also paid from the stake left (``D - out - w + stake >= its cost``), so
    that adaptive does not flap at the stake's edge. No online rule can promise
    ``D >= 0``: the first time it evicts another key than LRU, a trace that asks for that
    key and ends loses one hit (only LRU itself never does). The stake buys the right to
    try; once ``D`` is positive, the winnings are risked too, never more. The bound is exact
    for :func:`replay` and a Pager that serves each step whole; a prefetch while a challenger
    leads, or an expert pinned across steps, can cost one hit more each.

    Cost: about 5x an LRFU update per access (11 us against LRU's 0.6 and LRFU's 2.2 in
    ``bench_pager.py --section cost``).

    Parameters
    ----------
    capacity : int
        Cache slots.
    half_lives : sequence of float, optional
        The LRFU candidates besides LRU, in accesses (default ``capacity x (2, 8)``).
    memory : float, optional
        Steps over which leads and disagreements are averaged (default ``16 x capacity``:
        a small cache's few steps would hold too few disagreements for any edge to reach
        ``z`` deviations).
    z : float, optional
        Standard deviations a lead must exceed (default 3: one chance in 740 under the
        hypothesis of no difference).
    stake : int, optional
        Most hits adaptive may ever trail LRU by (default ``capacity``, one cache fill).
    """

    name = "adaptive"

    def __init__(
        self,
        capacity: int,
        half_lives=None,
        memory: float | None = None,
        z: float = 3.0,
        stake: int | None = None,
    ) -> None:
        super().__init__(capacity)
        c = max(self.capacity, 1)
        extra = tuple(float(h) for h in (half_lives or (2 * c, 8 * c)))
        if any(not h > 0 for h in extra):
            raise ValueError(f"half_lives must be positive (got {half_lives!r})")
        self.half_lives = (1e-3, *extra)  # 1e-3: each access outweighs all earlier ones
        memory = float(memory) if memory else 16.0 * c
        if memory < 1:
            raise ValueError(f"memory must be >= 1 (got {memory!r})")
        if not z >= 0:
            raise ValueError(f"AdaptivePolicy(): z must be >= 0 (got {z!r})")
        stake = c if stake is None else stake
        if not (isinstance(stake, int) and stake >= 0):
            raise ValueError(f"AdaptivePolicy(): stake must be an int >= 0 (got {stake!r})")
        self.decay = 1.0 - 1.0 / memory
        self.z, self.stake = float(z), stake
        n = len(self.half_lives)
        self._log: list[dict[Key, float]] = [{} for _ in range(n)]
        self._real: list[dict[Key, float]] = [{} for _ in range(n)]  # resident key -> score
        self._real_heap: list[list] = [[] for _ in range(n)]
        self._shadow: list[dict[Key, float]] = [{} for _ in range(n)]
        self._shadow_heap: list[list] = [[] for _ in range(n)]
        # Real residents the leader's shadow does not hold, in the order they left it.
        self._outside: OrderedDict[Key, None] = OrderedDict()
        self._out = [0] * n  # real residents outside each shadow: the most a switch costs
        self._lead = [[0.0] * n for _ in range(n)]  # [i][j]: i's hits minus j's, averaged
        self._disagree = [[0.0] * n for _ in range(n)]  # [i][j]: accesses one of i, j hit
        self.hits = self.lru_hits = 0  # the real cache's and LRU's shadow's, since the start
        self.leader = 0
        self.switches = 0
        self._clock = 0
        self._step: set[Key] = set()

    @staticmethod
    def _push(scores: dict, heap: list, key: Key, score: float) -> None:
        scores[key] = score
        heapq.heappush(heap, (score, key))
        if len(heap) > 4 * len(scores) + 64:  # drop stale entries now and then
            heap[:] = [(v, k) for k, v in scores.items()]
            heapq.heapify(heap)

    def _access(self, key: Key, clock: int | None = None, only: int | None = None) -> None:
        """Score an access of ``key`` at ``clock`` (default: the next tick) for every
        candidate, or for candidate ``only``."""
        if clock is None:
            self._clock = clock = self._clock + 1
        for i in range(len(self.half_lives)) if only is None else (only,):
            score = _log2_add(self._log[i].get(key), clock / self.half_lives[i])
            self._log[i][key] = score
            if key in self._real[i]:
                self._push(self._real[i], self._real_heap[i], key, score)
            if key in self._shadow[i]:
                self._push(self._shadow[i], self._shadow_heap[i], key, score)

    def _shadow_load(self, i: int, key: Key, step: set[Key]) -> bool:
        """Make ``key`` resident in shadow ``i`` (a miss there); False if nothing can go."""
        shadow, heap = self._shadow[i], self._shadow_heap[i]
        if len(shadow) >= self.capacity:
            victim = _lowest_evictable(
                heap, lambda e: shadow.get(e[1]) == e[0], lambda k: k not in step
            )
            if victim is None:
                return False  # a step wider than the cache: replay refuses it anyway
            del shadow[victim]
            if victim in self._real[0]:
                self._out[i] += 1
                if i == self.leader:
                    self._outside[victim] = None
        self._push(shadow, heap, key, self._log[i][key])
        if key in self._real[0]:
            self._out[i] -= 1
            if i == self.leader:
                self._outside.pop(key, None)
        return True

    def _follow(self, leader: int) -> None:
        """Make ``leader`` lead: its shadow's outsiders are the first victims, lowest first."""
        self.leader, self.switches = leader, self.switches + 1
        real, shadow = self._real[leader], self._shadow[leader]
        out = sorted((k for k in real if k not in shadow), key=real.__getitem__)
        self._outside = OrderedDict.fromkeys(out)

    def begin_step(self, layer: int, keys: list[Key]) -> None:
        self._step = step = set(keys)
        real = self._real[0]
        real_hits = sum(key in real for key in keys)
        # What LRU may still be owed before this step: the stake rule's D - out
        margin = self.hits - self.lru_hits - self._out[0]
        hit = []
        for i in range(len(self.half_lives)):
            shadow = self._shadow[i]
            # Each shadow orders a step as the pager would serve it there (its hits, then its
            # misses): LRU's shadow is then exactly an LRU cache, as the stake rule needs.
            order = sorted(keys, key=lambda k: k not in shadow)
            for tick, key in enumerate(order, self._clock + 1):
                self._access(key, tick, i)
            hit.append({key for key in keys if key in shadow})
            for key in keys:
                if key not in shadow and not self._shadow_load(i, key, step):
                    break
        self._clock += len(keys)
        d = self.decay
        for i, (lead, disagree) in enumerate(zip(self._lead, self._disagree, strict=True)):
            for j in range(len(hit)):
                lead[j] = lead[j] * d + (len(hit[i]) - len(hit[j]))
                disagree[j] = disagree[j] * d + len(hit[i] ^ hit[j])
        self.hits, self.lru_hits = self.hits + real_hits, self.lru_hits + len(hit[0])
        self._elect(margin - len(keys) + self.stake)

    def _ahead(self, i: int, j: int, cost: float = 0.0) -> bool:
        """Whether candidate ``i`` leads ``j`` by more than ``cost`` plus ``z`` deviations."""
        return self._lead[i][j] - cost > self.z * math.sqrt(self._disagree[i][j])

    def _elect(self, room: float) -> None:
        """Change leader by the rules of the class docstring; ``room``: what is left of the
        stake after the worst this step can do (a non-LRU leader needs ``room >= 0``)."""
        lead = self.leader
        if lead and (room < 0 or self._ahead(0, lead)):
            self._follow(0)  # the stake is spent, or LRU leads significantly
            return
        best, best_gain = lead, 0.0
        for j in range(len(self.half_lives)):
            cost = self._out[j]
            if j == lead or (j and room < cost):  # the stake left must pay for the switch
                continue
            if self._ahead(j, lead, cost) and (j == 0 or self._ahead(j, 0, cost)):
                gain = self._lead[j][lead] - cost
                if gain > best_gain:
                    best, best_gain = j, gain
        if best != lead:
            self._follow(best)

    def insert(self, key: Key) -> None:
        if key not in self._step:  # a prefetch: an access no step announced
            self._access(key)
            for i, shadow in enumerate(self._shadow):  # the shadows prefetch it too
                if key not in shadow:
                    self._shadow_load(i, key, self._step)
        for i in range(len(self.half_lives)):
            self._push(self._real[i], self._real_heap[i], key, self._log[i][key])
            self._out[i] += key not in self._shadow[i]
        if key not in self._shadow[self.leader]:
            self._outside[key] = None

    def touch(self, key: Key) -> None:
        if key not in self._step:
            self._access(key)

    def remove(self, key: Key) -> None:
        if key in self._real[0]:
            for i, shadow in enumerate(self._shadow):
                self._out[i] -= key not in shadow
        for real in self._real:
            real.pop(key, None)
        self._outside.pop(key, None)

    def victim(self, evictable):
        out = next((k for k in self._outside if evictable(k)), None)
        if out is not None:
            return out
        real = self._real[self.leader]
        return _lowest_evictable(
            self._real_heap[self.leader], lambda e: real.get(e[1]) == e[0], evictable
        )

    def eviction_order(self):
        real = self._real[self.leader]
        rest = sorted((k for k in real if k not in self._outside), key=real.__getitem__)
        return [*self._outside, *rest]


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


# -- traces, replay, Belady ---------------------------------------------------------------------


class Trace:
    """A routing trace: the ordered ``(layer, expert ids)`` steps a pager served.

    Steps hold each call's unique ids, ascending. Save with :meth:`save`, read with
    :meth:`load`; replay with :func:`replay` and :func:`belady`.
    """

    def __init__(self, steps: Iterable[tuple[int, Iterable[int]]] = ()) -> None:
        self.steps: list[tuple[int, tuple[int, ...]]] = []
        for layer, ids in steps:
            self.append(layer, ids)

    def append(self, layer: int, ids) -> None:
        """Record one step (duplicate ids collapse; order does not matter)."""
        unique = np.unique(np.asarray(ids, dtype=np.int64).ravel())
        self.steps.append((int(layer), tuple(int(e) for e in unique)))

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    @property
    def accesses(self) -> int:
        """Expert accesses (sum of unique ids per step)."""
        return sum(len(ids) for _, ids in self.steps)

    def counts(self) -> dict[Key, int]:
        """Accesses per ``(layer, expert)``, usable as the ``hot`` policy's counts."""
        out: dict[Key, int] = {}
        for layer, ids in self.steps:
            for e in ids:
                out[(layer, e)] = out.get((layer, e), 0) + 1
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write the trace as JSON."""
        with open(path, "w") as f:
            json.dump({"steps": [[layer, list(ids)] for layer, ids in self.steps]}, f)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        """Read a trace written by :meth:`save`.

        Raises
        ------
        FormatError
            (a ``ValueError``) The file is not strict JSON or not ``{"steps": [[layer, [ids]],
            ...]}`` with non-negative int32 layers and ids; the message names the step.
        """
        from colibri import _json

        name = os.fspath(path)
        data = _json.mapping(_json.load(name, what="the trace"), name, "the trace")
        steps = _json.sequence(_json.field(data, "steps", name), name, "steps")
        for i, step in enumerate(steps):
            layer, ids = _json.sequence(step, name, f"steps[{i}]", min_len=2, max_len=2)
            _json.integer(layer, name, f"steps[{i}][0]", hi=_json.INT32_MAX)
            _json.int_list(ids, name, f"steps[{i}][1]", hi=_json.INT32_MAX)
        return cls(steps)


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of replaying a trace through a cache of ``capacity`` slots."""

    policy: str
    capacity: int
    hits: int
    misses: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def _check_capacity(trace: Trace, capacity: int) -> None:
    widest = max((len(ids) for _, ids in trace.steps), default=0)
    if capacity < widest:
        raise ValueError(f"capacity {capacity} is below the widest step ({widest} experts)")


def replay(trace: Trace, capacity: int, policy: str | CachePolicy = "lru", **options):
    """Replay ``trace`` through ``policy`` exactly as a :class:`~colibri.Pager` would serve it.

    Per step: ``begin_step``, then hits are touched (ascending id), then misses are inserted
    (ascending id), each evicting the policy's victim among keys not used by the step.
    """
    _check_capacity(trace, capacity)
    pol = make_policy(policy, capacity, **options)
    resident: set[Key] = set()
    hits = misses = evictions = 0
    for layer, ids in trace.steps:
        keys = [(layer, e) for e in ids]
        step = set(keys)
        pol.begin_step(layer, keys)
        for key in keys:
            if key in resident:
                hits += 1
                pol.touch(key)
        for key in keys:
            if key in resident:
                continue
            misses += 1
            if len(resident) >= capacity:
                victim = pol.victim(lambda k, step=step: k not in step)
                pol.remove(victim)
                resident.discard(victim)
                evictions += 1
            resident.add(key)
            pol.insert(key)
    return ReplayResult(pol.name, capacity, hits, misses, evictions)


def belady(trace: Trace, capacity: int) -> ReplayResult:
    """Belady's MIN: on a miss evict the resident expert whose next use is furthest away.

    The optimum hit count for this trace and capacity (unit-size experts, demand paging).
    """
    _check_capacity(trace, capacity)
    steps = [[(layer, e) for e in ids] for layer, ids in trace.steps]
    never = len(steps)
    next_use: list[list[int]] = [[never] * len(keys) for keys in steps]
    last: dict[Key, int] = {}
    for i in range(len(steps) - 1, -1, -1):
        for j, key in enumerate(steps[i]):
            next_use[i][j] = last.get(key, never)
            last[key] = i
    resident: dict[Key, int] = {}  # key -> its next use
    heap: list[tuple[int, Key]] = []  # (-next use, key), lazily invalidated
    hits = misses = evictions = 0
    for i, keys in enumerate(steps):
        step = set(keys)
        for j, key in enumerate(keys):
            if key in resident:
                hits += 1
                resident[key] = next_use[i][j]
                heapq.heappush(heap, (-next_use[i][j], key))
        for j, key in enumerate(keys):
            if key in resident:
                continue
            misses += 1
            if len(resident) >= capacity:
                kept = []
                while True:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) != -neg:
                        continue  # stale entry
                    if victim in step:
                        kept.append((neg, victim))
                        continue
                    break
                for entry in kept:
                    heapq.heappush(heap, entry)
                del resident[victim]
                evictions += 1
            resident[key] = next_use[i][j]
            heapq.heappush(heap, (-next_use[i][j], key))
    return ReplayResult("belady", capacity, hits, misses, evictions)
