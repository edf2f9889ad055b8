"""The ``adaptive`` policy (the default): follow whichever of LRU and a few LRFU half-lives
is winning, never more than a stake behind LRU."""

from __future__ import annotations

import math
from collections import OrderedDict

from colibri.pager._policy_base import (
    CachePolicy,
    Key,
    _heap_push,
    _log2_add,
    _lowest_evictable,
)

__all__ = ["AdaptivePolicy"]


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

    Cost: several LRFU updates per access, since every candidate scores each access and
    replays it in its shadow (``bench_pager.py --section cost``; figures in
    ``bench/README.md``).

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

    def _access(self, key: Key, clock: int | None = None, only: int | None = None) -> None:
        """Score an access of ``key`` at ``clock`` (default: the next tick) for every
        candidate, or for candidate ``only``."""
        if clock is None:
            self._clock = clock = self._clock + 1
        for i in range(len(self.half_lives)) if only is None else (only,):
            score = _log2_add(self._log[i].get(key), clock / self.half_lives[i])
            self._log[i][key] = score
            if key in self._real[i]:
                _heap_push(self._real[i], self._real_heap[i], key, score)
            if key in self._shadow[i]:
                _heap_push(self._shadow[i], self._shadow_heap[i], key, score)

    def _shadow_load(self, i: int, key: Key, step: set[Key]) -> bool:
        """Make ``key`` resident in shadow ``i`` (a miss there); False if nothing can go."""
        shadow, heap = self._shadow[i], self._shadow_heap[i]
        if len(shadow) >= self.capacity:
            victim = _lowest_evictable(heap, shadow, lambda k: k not in step)
            if victim is None:
                return False  # a step wider than the cache: replay refuses it anyway
            del shadow[victim]
            if victim in self._real[0]:
                self._out[i] += 1
                if i == self.leader:
                    self._outside[victim] = None
        _heap_push(shadow, heap, key, self._log[i][key])
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
            _heap_push(self._real[i], self._real_heap[i], key, self._log[i][key])
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
        return _lowest_evictable(self._real_heap[self.leader], self._real[self.leader], evictable)

    def shadow(self, candidate: int) -> frozenset[Key]:
        """The keys ``candidate``'s shadow cache holds now (0 is LRU, then the LRFU
        half-lives in :attr:`half_lives` order; :attr:`leader` is the one followed)."""
        return frozenset(self._shadow[candidate])

    def eviction_order(self):
        real = self._real[self.leader]
        rest = sorted((k for k in real if k not in self._outside), key=real.__getitem__)
        return [*self._outside, *rest]
