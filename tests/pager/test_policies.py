"""The cache policies, trace replay and Belady's MIN, without a Pager.

Each policy's eviction order is checked on traces computed by hand: one layer, one expert per
step unless said otherwise, so every miss past the capacity evicts exactly the victim named in
the comment. A policy whose order is broken (an LRU whose touch does nothing is FIFO) gives a
different victim and fails here.
"""

import itertools
from functools import cache

import numpy as np
import pytest

from colibri.pager import LRUPolicy, ReplayCache, Trace, belady, make_policy, replay


def victims(policy, steps, capacity):
    """Serve ``steps`` (lists of expert ids of layer 0); the experts evicted, in order."""
    cache = ReplayCache(capacity, policy)
    return [e for ids in steps for _, e in cache.step(0, ids)]


def test_fifo_evicts_the_first_in_whatever_hits_came_since():
    # 0, 1 in; 0 hit; 2 evicts 0 (first in); 0 evicts 1
    assert victims("fifo", [[0], [1], [0], [2], [0]], 2) == [0, 1]


def test_lru_evicts_the_least_recently_used():
    # 0, 1 in; 0 hit (1 is now least recent); 2 evicts 1; 0 hits; 1 evicts 2
    assert victims("lru", [[0], [1], [0], [2], [0], [1]], 2) == [1, 2]


def test_lru_and_fifo_hit_counts_on_replay():
    trace = Trace((0, [e]) for e in [0, 1, 0, 2, 0])
    assert replay(trace, 2, "fifo").hits == 1  # the second 0 only
    assert replay(trace, 2, "lru").hits == 2  # both later 0s


def test_lfu_counts_survive_eviction_and_ties_go_to_the_least_recent():
    # counts after 0,0,1: {0: 2, 1: 1}; 2 evicts 1 (fewest uses; LRU would evict 0)
    # 1 again (count 2, survived its eviction) evicts 2 (count 1)
    # 2 again: 0 and 1 both have 2 uses, 0 is the less recent: evict 0
    assert victims("lfu", [[0], [0], [1], [2], [1], [2]], 2) == [1, 2, 0]


@pytest.mark.parametrize(("half_life", "expected"), [(1e9, [1]), (0.01, [0])])
def test_lrfu_spans_lfu_to_lru(half_life, expected):
    # 0,0,1 then 2: a long half-life ranks by frequency (evict 1, like LFU), a short one by
    # recency (evict 0, like LRU)
    pol = make_policy("lrfu", 2, half_life=half_life)
    assert victims(pol, [[0], [0], [1], [2]], 2) == expected


def test_nextuse_evicts_the_expert_expected_furthest_ahead():
    # 0 used 4 steps running, then 1 once: 2 evicts 1 (rarely used), where LRU evicts 0
    steps = [[0], [0], [0], [0], [1], [2]]
    assert victims("nextuse", steps, 2) == [1]
    assert victims("lru", steps, 2) == [0]


def test_hot_keeps_the_hot_set_and_runs_lru_on_the_rest():
    # expert 5 is hot (half of 2 slots); 1 is cold: 2 evicts 1 although 5 is least recent
    pol = make_policy("hot", 2, counts={(0, 5): 100, (0, 1): 1})
    assert victims(pol, [[5], [1], [2]], 2) == [1]
    assert victims("lru", [[5], [1], [2]], 2) == [5]


def test_hot_takes_usage_as_a_mapping_an_array_or_usage_stats_per_layer():
    from colibri import UsageStats

    counts = np.zeros((1, 8), np.int64)
    counts[0, 5], counts[0, 1] = 100, 1
    stats = UsageStats(counts[0], np.diag(counts[0]), 101)
    for given in (counts, [stats]):
        assert victims(make_policy("hot", 2, counts=given), [[5], [1], [2]], 2) == [1]
    with pytest.raises(ValueError, match="one layer: pass \\[stats\\]"):
        make_policy("hot", 2, counts=stats)


def test_belady_evicts_the_expert_used_furthest_ahead():
    # 0,1 in; 0 hits; 2 evicts 0 (never used again; LRU evicts 1, used next); 1 hits
    trace = Trace((0, [e]) for e in [0, 1, 0, 2, 1])
    best = belady(trace, 2)
    assert (best.hits, best.misses, best.evictions) == (2, 3, 1)
    assert replay(trace, 2, "lru").hits == 1


def test_replay_cache_serves_steps_as_replay_does():
    rng = np.random.default_rng(7)
    trace = Trace((int(rng.integers(2)), rng.choice(10, 3, replace=False)) for _ in range(200))
    cache = ReplayCache(5, "lfu")
    evicted = []
    for layer, ids in trace:
        out = cache.step(layer, np.array(ids[::-1] * 2).reshape(2, -1))  # any order and shape
        assert len(cache.resident) <= 5 and not set(out) & cache.resident
        evicted += out
    assert cache.result() == replay(trace, 5, "lfu") and len(evicted) == cache.evictions > 0
    with pytest.raises(ValueError, match=r"capacity 2 is below the widest step \(3 experts\)"):
        ReplayCache(2).step(0, [0, 1, 2])
    with pytest.raises(RuntimeError, match=r"begin\(\) a step first"):
        ReplayCache(2).serve()
    cache = ReplayCache(2)
    cache.begin(0, [1])
    with pytest.raises(RuntimeError, match=r"serve\(\) the step begun before"):
        cache.begin(0, [2])

    class Stubborn(LRUPolicy):
        def victim(self, evictable):
            return None

    cache = ReplayCache(1, Stubborn(1))
    cache.step(0, [0])
    with pytest.raises(RuntimeError, match="named no victim"):
        cache.step(0, [1])


def test_adaptive_converges_to_its_leader_and_trails_it_by_at_most_one_fill():
    # While a candidate leads, adaptive evicts what that candidate's shadow cache has already
    # dropped: the real residents outside the shadow never grow in number and (cache full)
    # fall by one on every access the shadow hits and the real cache misses, so over each
    # lead the real cache has at most `capacity` fewer hits than the leader's shadow. Checked
    # step by step on Zipf traffic whose popular set jumps (the leader changes many times).
    rng = np.random.default_rng(0)
    capacity, experts = 12, 40
    pol = make_policy("adaptive", capacity, z=0.0, stake=10**9)  # switch on any lead
    cache = ReplayCache(capacity, pol)
    lead = outside = lead_real = lead_shadow = None
    for t in range(3000):
        perm = np.random.default_rng(t // 300).permutation(experts)
        ids = sorted(set(perm[rng.zipf(1.3, 2) % experts].tolist()))
        keys = [(0, e) for e in ids]
        shadow_before = pol.shadow(pol.leader)
        cache.begin(0, ids)
        resident = cache.resident
        if pol.leader != lead:  # a new lead starts: measure from here
            lead, lead_real, lead_shadow = pol.leader, 0, 0
            outside = len(resident - pol.shadow(lead))
            shadow_before = None
        step_shadow_hits = None if shadow_before is None else sum(k in shadow_before for k in keys)
        full = len(resident) == capacity
        caught_up = sum(k in (shadow_before or ()) and k not in resident for k in keys)
        hits = cache.hits
        cache.serve()
        hits = cache.hits - hits
        now = len(cache.resident - pol.shadow(lead))
        assert now <= outside - (caught_up if full else 0), f"step {t}: did not converge"
        outside = now
        if step_shadow_hits is not None:
            lead_real, lead_shadow = lead_real + hits, lead_shadow + step_shadow_hits
            assert lead_real >= lead_shadow - capacity, f"step {t}: trails its leader by more"
    assert pol.switches >= 5  # the property was exercised across several leads


def popular_then_turns(seed, first=1000, then=3000, experts=40, length=60):
    """Zipf popularity (frequency wins), then three hot sets of 7 new experts that take
    turns every ``length`` steps (recency wins, old frequency misleads): a challenger that
    led on the first part goes on leading into losses, and the stake has to stop it."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1)
    for _ in range(first):
        yield sorted(rng.choice(experts, 2, replace=False, p=p / p.sum()).tolist())
    for t in range(then):
        base = experts + 7 * ((t // length) % 3)
        yield sorted((base + rng.choice(7, 2, replace=False)).tolist())


@pytest.mark.parametrize(("stake", "seed"), [(4, 0), (4, 1), (8, 2), (6, 3), (0, 0), (None, 0)])
def test_adaptive_never_trails_lru_by_more_than_its_stake(stake, seed):
    # The stake rule: D = adaptive's hits - LRU's, out = adaptive's residents that LRU lacks.
    # D - out never falls while LRU leads and falls by at most a step's width otherwise, so
    # letting a non-LRU leader serve a step only when D - out - width >= -stake keeps
    # D - out >= -stake after every step. Checked against a separate LRU cache run in
    # lockstep (not adaptive's own shadow). z = 0 and a memory that never forgets keep the
    # challenger leading long after it went wrong, so that only the stake stops it (without
    # the rule D - out reaches -13 here); stake 0 is LRU hit for hit; None is the default.
    capacity = 12
    options = {} if stake is None else dict(z=0.0, memory=1e6, stake=stake)
    pol = make_policy("adaptive", capacity, **options)
    stake = capacity if stake is None else stake
    real, lru = ReplayCache(capacity, pol), ReplayCache(capacity, "lru")
    closest, led = 0, 0
    for t, ids in enumerate(popular_then_turns(seed)):
        before = real.hits - lru.hits - len(real.resident - lru.resident)
        leader = pol.leader
        real.begin(0, ids)
        if pol.leader not in (0, leader):
            # a switch to a non-LRU candidate is paid from the stake left: its cost (the real
            # residents outside its shadow) within what the step may still lose
            cost = len(real.resident - pol.shadow(pol.leader))
            assert before - len(ids) + stake >= cost, f"step {t}: unpaid switch"
        real.serve()
        lru.step(0, ids)
        margin = real.hits - lru.hits - len(real.resident - lru.resident)
        assert margin >= -stake, f"step {t}: D - out = {margin} < -{stake}"
        assert real.hits >= lru.hits - stake, f"step {t}: {real.hits} hits, LRU {lru.hits}"
        if pol.leader == 0:
            assert margin >= before, f"step {t}: D - out fell while LRU led"
        led += pol.leader != 0
        closest = min(closest, margin)
    if stake == 0:
        assert led == 0 and real.hits == lru.hits
    elif options:
        # exercised: challengers led for many steps, and the stake was spent to within less
        # than a step's width (2 experts here): the rule stopped the leader, not the stop-loss
        assert led > 1000 and pol.switches >= 3 and closest < -stake + 2, (led, closest)


def test_adaptive_lru_shadow_is_an_lru_cache():
    # The stake rule compares the real cache with LRU's shadow, so the shadow must be LRU
    # exactly, step for step, although the real cache (following another leader) has other
    # hits: within a step the shadow orders accesses by its own hits, not the real cache's.
    rng = np.random.default_rng(5)
    capacity = 12
    pol = make_policy("adaptive", capacity, z=0.0, stake=10**9, memory=4 * capacity)
    real, lru = ReplayCache(capacity, pol), ReplayCache(capacity, "lru")
    for t in range(3000):
        perm = np.random.default_rng(t // 300).permutation(40)
        ids = sorted(set(perm[rng.zipf(1.3, 4) % 40].tolist()))
        real.step(0, ids)
        lru.step(0, ids)
        assert pol.shadow(0) == lru.resident, f"step {t}"
        assert pol.lru_hits == lru.hits
    assert pol.switches >= 3 and real.hits != lru.hits  # the real cache went its own way


def brute_force_optimum(trace, capacity):
    steps = [[(lay, e) for e in ids] for lay, ids in trace.steps]

    @cache
    def best(i, resident):
        if i == len(steps):
            return 0
        keys = steps[i]
        hits = sum(k in resident for k in keys)
        others = [k for k in resident if k not in keys]
        need = max(0, len(resident) + sum(k not in resident for k in keys) - capacity)
        return hits + max(
            best(i + 1, frozenset((set(resident) - set(ev)) | set(keys)))
            for ev in itertools.combinations(others, need)
        )

    return best(0, frozenset())


def test_belady_is_the_optimum():
    rng = np.random.default_rng(1)
    for _ in range(60):
        trace = Trace(
            (int(rng.integers(2)), rng.choice(5, size=int(rng.integers(1, 3)), replace=False))
            for _ in range(9)
        )
        capacity = int(rng.integers(2, 5))
        optimum = belady(trace, capacity).hits
        assert optimum == brute_force_optimum(trace, capacity)
        for policy in ("fifo", "lru", "lfu", "lrfu", "nextuse"):
            assert replay(trace, capacity, policy).hits <= optimum


def test_trace_save_load(tmp_path):
    rng = np.random.default_rng(0)
    trace = Trace((s % 3, rng.integers(8, size=(2, 3))) for s in range(20))
    trace.save(tmp_path / "t.json")
    assert Trace.load(tmp_path / "t.json").steps == trace.steps
    (tmp_path / "bad.json").write_text('{"nope": 1}')
    with pytest.raises(ValueError, match="'steps' is missing"):
        Trace.load(tmp_path / "bad.json")


def test_lru_and_fifo_evict_in_their_order():
    # capacity 3; expert 0 is touched again before the fourth expert arrives
    trace = Trace([(0, [0]), (0, [1]), (0, [2]), (0, [0]), (0, [3]), (0, [0]), (0, [1])])
    lru, fifo = replay(trace, 3, "lru"), replay(trace, 3, "fifo")
    # lru: 3 evicts 1 (0 was just used): hits 0, 0 -> then 1 misses
    # fifo: 3 evicts 0 (first in): 0 misses again, 1 is evicted for it, 1 misses
    assert (lru.hits, lru.misses) == (2, 5)
    assert (fifo.hits, fifo.misses) == (1, 6)


def zipf_iid(steps, experts, seed):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1)
    return Trace((0, rng.choice(experts, 2, replace=False, p=p / p.sum())) for _ in range(steps))


def phases(steps, seed, length=150):
    """Recency is all there is: two disjoint hot sets of 7 experts take turns."""
    rng = np.random.default_rng(seed)
    return Trace(
        (0, 7 * ((s // length) % 2) + rng.choice(7, 2, replace=False)) for s in range(steps)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adaptive_follows_the_better_of_recency_and_frequency(seed):
    pop, turns = zipf_iid(3000, 40, seed), phases(3000, seed)
    # popularity that lasts: frequency wins (+20%) and adaptive finds it
    lru, lrfu = replay(pop, 8, "lru").hits, replay(pop, 8, "lrfu", half_life=64).hits
    assert lrfu > 1.2 * lru and replay(pop, 8, "adaptive").hits > 1.15 * lru
    # hot sets that take turns: old frequency misleads (-12%), adaptive stays with LRU
    lru, lrfu = replay(turns, 8, "lru").hits, replay(turns, 8, "lrfu", half_life=64).hits
    assert lrfu < 0.9 * lru and replay(turns, 8, "adaptive").hits >= 0.99 * lru


def test_adaptive_options_are_checked():
    with pytest.raises(ValueError, match="half_lives must be positive"):
        replay(Trace([(0, [0])]), 2, "adaptive", half_lives=[0])
    with pytest.raises(ValueError, match="memory must be >= 1"):
        replay(Trace([(0, [0])]), 2, "adaptive", memory=0.5)
