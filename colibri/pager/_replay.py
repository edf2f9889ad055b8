"""Routing traces, and their offline replay through a policy or Belady's MIN.

The cache unit is one expert, keyed ``(layer, expert)``; every expert takes one slot of the
pager's pool, so the problem is unit-size paging and Belady's MIN is the exact offline optimum
(for demand paging: every expert of a step must be resident at once, none is bypassed).
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from colibri.pager._policies import make_policy
from colibri.pager._policy_base import CachePolicy, Key

__all__ = ["ReplayResult", "Trace", "belady", "replay"]


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
