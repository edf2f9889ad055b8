"""Routing traces, and their offline replay through a policy or Belady's MIN.

The cache unit is one expert, keyed ``(layer, expert)``; every expert takes one slot of the
pager's pool, so the problem is unit-size paging and Belady's MIN is the exact offline optimum
(for demand paging: every expert of a step must be resident at once, none is bypassed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from colibri.pager._policies import _HeapPolicy, make_policy
from colibri.pager._policy_base import CachePolicy, Key
from colibri.pager._stats import _HitRate

__all__ = ["ReplayCache", "ReplayResult", "Trace", "belady", "replay"]


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
class ReplayResult(_HitRate):
    """Outcome of replaying a trace through a cache of ``capacity`` slots."""

    policy: str
    capacity: int
    hits: int
    misses: int
    evictions: int


class ReplayCache:
    """A cache of ``capacity`` slots that serves routing steps through a policy exactly as a
    :class:`~colibri.Pager` serves loads, with no weights and no I/O.

    :func:`replay` and :func:`belady` run a whole :class:`Trace` through one; step one by
    hand to watch a policy decide: its victims, its hits step by step, its state between
    the start of a step and its service.

    Parameters
    ----------
    capacity : int
        Slots: experts resident at once.
    policy : str or CachePolicy
        A name of :data:`~colibri.pager.POLICIES` or a policy instance.
    **options
        Passed to the policy's constructor.

    Attributes
    ----------
    policy : CachePolicy
        The policy that orders the cache.
    hits, misses, evictions : int
        Counted since construction.

    Examples
    --------
    >>> from colibri.pager import ReplayCache
    >>> cache = ReplayCache(2, "lru")
    >>> [cache.step(0, [e]) for e in (0, 1, 0, 2)]  # 2 evicts 1, the least recently used
    [[], [], [], [(0, 1)]]
    >>> cache.hits, cache.misses, sorted(cache.resident)
    (1, 3, [(0, 0), (0, 2)])
    """

    def __init__(self, capacity: int, policy: str | CachePolicy = "lru", **options) -> None:
        self.capacity = int(capacity)
        self.policy = make_policy(policy, self.capacity, **options)
        self.hits = self.misses = self.evictions = 0
        self._resident: set[Key] = set()
        self._begun: list[Key] | None = None

    @property
    def resident(self) -> frozenset[Key]:
        """The keys held now."""
        return frozenset(self._resident)

    def step(self, layer: int, ids) -> list[Key]:
        """Serve one step: :meth:`begin` it, then :meth:`serve` it.

        Parameters
        ----------
        layer : int
            The step's layer.
        ids : array-like of int
            The step's expert ids, any shape (duplicates collapse).

        Returns
        -------
        list of (int, int)
            The keys evicted, in order.
        """
        self.begin(layer, ids)
        return self.serve()

    def begin(self, layer: int, ids) -> None:
        """Start a step: the policy's ``begin_step`` sees it, nothing is served yet.

        Raises
        ------
        ValueError
            The step has more experts than the cache has slots.
        RuntimeError
            The step begun before was not served.
        """
        unique = np.unique(np.asarray(ids, dtype=np.int64).ravel())
        self._begin(int(layer), [(int(layer), int(e)) for e in unique])

    def _begin(self, layer: int, keys: list[Key]) -> None:
        if self._begun is not None:
            raise RuntimeError("ReplayCache.begin(): serve() the step begun before")
        if len(keys) > self.capacity:
            raise ValueError(
                f"capacity {self.capacity} is below the widest step ({len(keys)} experts)"
            )
        self.policy.begin_step(layer, keys)
        self._begun = keys

    def serve(self) -> list[Key]:
        """Serve the step begun: its hits are touched, then its misses inserted (each in
        ascending id order), each miss in a full cache evicting the policy's victim among
        the keys this step does not use.

        Returns
        -------
        list of (int, int)
            The keys evicted, in order.
        """
        keys, self._begun = self._begun, None
        if keys is None:
            raise RuntimeError("ReplayCache.serve(): begin() a step first")
        policy, resident = self.policy, self._resident
        for key in keys:
            if key in resident:
                self.hits += 1
                policy.touch(key)
        step, evicted = set(keys), []
        for key in keys:
            if key in resident:
                continue
            self.misses += 1
            if len(resident) >= self.capacity:
                victim = policy.victim(lambda k: k not in step)
                if victim is None:
                    raise RuntimeError(f"policy {policy.name!r} named no victim in a full cache")
                policy.remove(victim)
                resident.discard(victim)
                evicted.append(victim)
            resident.add(key)
            policy.insert(key)
        self.evictions += len(evicted)
        return evicted

    def result(self) -> ReplayResult:
        """The counters so far."""
        return ReplayResult(self.policy.name, self.capacity, self.hits, self.misses,
                            self.evictions)  # fmt: skip


def _check_capacity(trace: Trace, capacity: int) -> None:
    widest = max((len(ids) for _, ids in trace.steps), default=0)
    if capacity < widest:
        raise ValueError(f"capacity {capacity} is below the widest step ({widest} experts)")


def replay(
    trace: Trace, capacity: int, policy: str | CachePolicy = "lru", **options
) -> ReplayResult:
    """Replay ``trace`` through ``policy`` exactly as a :class:`~colibri.Pager` would serve it.

    Per step: ``begin_step``, then hits are touched (ascending id), then misses are inserted
    (ascending id), each evicting the policy's victim among keys not used by the step (see
    :class:`ReplayCache`, which this runs).
    """
    _check_capacity(trace, capacity)
    cache = ReplayCache(capacity, policy, **options)
    for layer, ids in trace.steps:
        cache._begin(layer, [(layer, e) for e in ids])  # a Trace's ids: unique, ascending
        cache.serve()
    return cache.result()


class _Furthest(_HeapPolicy):
    """Belady's MIN as a policy: it knows the trace, and evicts the resident expert whose next
    use is furthest away (never used again first; ties to the lowest key)."""

    name = "belady"

    def __init__(self, capacity: int, trace: Trace) -> None:
        super().__init__(capacity)
        never = len(trace.steps)
        last: dict[Key, int] = {}
        self._next: list[dict[Key, int]] = [{}] * never  # step -> key -> its next use after it
        for i in range(never - 1, -1, -1):
            layer, ids = trace.steps[i]
            keys = [(layer, e) for e in ids]
            self._next[i] = {key: last.get(key, never) for key in keys}
            for key in keys:
                last[key] = i
        self._step = -1

    def begin_step(self, layer: int, keys: list[Key]) -> None:
        self._step += 1

    def _access(self, key: Key) -> None:
        self._push(key, (-self._next[self._step][key],))  # lowest score: furthest next use

    insert = touch = _access


def belady(trace: Trace, capacity: int) -> ReplayResult:
    """Belady's MIN: on a miss evict the resident expert whose next use is furthest away.

    The optimum hit count for this trace and capacity (unit-size experts, demand paging).
    """
    _check_capacity(trace, capacity)
    return replay(trace, capacity, _Furthest(capacity, trace))
