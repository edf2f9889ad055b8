"""Learning a partition from usage statistics (``Partition.from_usage``).

Groups of near-equal size that keep the most co-activation inside groups, each group's load
within a cap: three deterministic starts (seeded growth, a spectral order, merge-and-pack of
average-linkage clusters), each improved by swaps and moves between groups.
"""

from __future__ import annotations

import numpy as np

from colibri._usage import UsageStats

_UNBOUNDED = np.iinfo(np.int64).max // 4  # a load cap that never binds


def learn_groups(stats: UsageStats, sizes: list[int], tolerance: float | None) -> np.ndarray:
    e, m = stats.num_experts, len(sizes)
    affinity = stats.coactivation.copy()
    np.fill_diagonal(affinity, 0)
    load = stats.counts
    total = int(load.sum())
    if tolerance is None or total == 0:
        caps = np.full(m, _UNBOUNDED, np.int64)
    else:  # integer caps keep every comparison exact
        caps = np.floor((1.0 + tolerance) * total * np.asarray(sizes) / e).astype(np.int64)
    if m == 1:
        return np.zeros(e, np.int64)
    unbounded = np.full(m, _UNBOUNDED, np.int64)
    starts = [
        _seeded_growth(affinity, load, sizes, caps),
        _spectral_cut(affinity, sizes),
        _merge_and_pack(affinity, sizes),
    ]
    free = [_local_search(affinity, load, unbounded, start) for start in starts]
    best = free[int(np.argmin([_score(affinity, load, unbounded, a)[1] for a in free]))]
    if tolerance is None or total == 0:
        return best
    # Under a load bound: repair the best unbounded grouping (it keeps whole clusters together
    # and moves only what the bound forces out), and search from the load-aware growth.
    repaired = [_local_search(affinity, load, caps, start) for start in (best, starts[0])]
    return min(repaired, key=lambda a: _score(affinity, load, caps, a))


def _excess(loads: np.ndarray, caps: np.ndarray) -> np.ndarray:
    return np.maximum(loads - caps, 0)


def _score(affinity, load, caps, assignment) -> tuple[int, int]:
    m = len(caps)
    loads = np.zeros(m, np.int64)
    np.add.at(loads, assignment, load)
    same = assignment[:, None] == assignment[None, :]
    return int(_excess(loads, caps).sum()), -int(affinity[same].sum())


def _seeded_growth(affinity, load, sizes, caps) -> np.ndarray:
    e, m = affinity.shape[0], len(sizes)
    assignment = np.full(e, -1, np.int64)
    room = np.asarray(sizes, np.int64).copy()
    group_load = np.zeros(m, np.int64)
    to_group = np.zeros((e, m), np.int64)  # co-activation of every expert with every group
    ids = np.arange(e)

    def place(expert: int, group: int) -> None:
        assignment[expert] = group
        room[group] -= 1
        group_load[group] += load[expert]
        to_group[:, group] += affinity[:, expert]

    # Seeds: the busiest expert, then each time the one least tied to the seeds so far
    # (ties: busier, then lower id).
    tie_to_seeds = np.zeros(e, np.int64)
    for group in range(m):
        free = ids[assignment < 0]
        order = np.lexsort((free, -load[free], tie_to_seeds[free]))
        seed = int(free[order[0]])
        place(seed, group)
        tie_to_seeds += affinity[:, seed]
    while (assignment < 0).any():
        free = ids[assignment < 0]
        open_groups = np.flatnonzero(room > 0)
        gain = to_group[np.ix_(free, open_groups)]
        fits = group_load[open_groups][None, :] + load[free][:, None] <= caps[open_groups][None, :]
        if fits.any():
            gain = np.where(fits, gain, -1)
        best = gain.max()
        rows, cols = np.nonzero(gain == best)
        # ties: the lighter group, then the lower expert id, then the lower group index
        pick = np.lexsort((open_groups[cols], free[rows], group_load[open_groups[cols]]))[0]
        place(int(free[rows[pick]]), int(open_groups[cols[pick]]))
    return assignment


def _merge_and_pack(affinity, sizes, node_limit: int = 400) -> np.ndarray:
    e, largest = affinity.shape[0], max(sizes)
    # Average-linkage agglomeration under the group-size cap.
    link = affinity.copy()
    size = np.ones(e, np.int64)
    alive = np.ones(e, bool)
    members = [[x] for x in range(e)]
    others = np.arange(e)
    # score[a, b] (a < b): average linkage of two live clusters that may merge, else -1.
    score = np.where(np.triu(link > 0, 1), link.astype(np.float64), -1.0)
    if largest < 2:
        score[:] = -1.0
    history = []  # (kept, absorbed, kept's members before): undone weakest-last
    while True:
        best = int(np.argmax(score))
        i, j = divmod(best, e)
        if score[i, j] <= 0:
            break
        history.append((i, j, len(members[i])))
        link[i, :] += link[j, :]
        link[:, i] += link[:, j]
        link[i, i] = 0
        link[j, :] = 0
        link[:, j] = 0
        alive[j] = False
        size[i] += size[j]
        members[i] += members[j]
        score[j, :] = -1.0
        score[:, j] = -1.0
        ok = alive & (others != i) & (link[i] > 0) & (size + size[i] <= largest)
        row = np.where(ok, link[i] / (size * size[i]), -1.0)
        score[i, i + 1 :] = row[i + 1 :]
        score[:i, i] = row[:i]
    # Pack the clusters whole; while no packing is found, undo the latest (weakest) merge.
    while True:
        clusters = [members[i] for i in np.flatnonzero(alive)]
        placed = _pack(affinity, sizes, clusters, node_limit)
        if placed is not None:
            assignment = np.empty(e, np.int64)
            for cluster, g in zip(clusters, placed, strict=True):
                assignment[cluster] = g
            return assignment
        i, j, keep = history.pop()
        members[j] = members[i][keep:]
        members[i] = members[i][:keep]
        alive[j] = True


def _pack(affinity, sizes, clusters, node_limit: int) -> list[int] | None:
    """A group for each whole cluster, or None when none is found within the step budget.

    Depth-first over the clusters, largest first; a cluster tries the groups it is most
    co-activated with first, then the fullest that fits.
    """
    e, m = affinity.shape[0], len(sizes)
    order = sorted(range(len(clusters)), key=lambda c: (-len(clusters[c]), min(clusters[c])))
    label = np.empty(e, np.int64)
    for rank, index in enumerate(order):
        label[clusters[index]] = rank
    onehot = np.zeros((e, len(clusters)), np.int64)
    onehot[np.arange(e), label] = 1
    between = onehot.T @ affinity @ onehot  # co-activation between clusters, in packing order
    lengths = [len(clusters[index]) for index in order]
    to_group = np.zeros((len(clusters), m), np.int64)
    rooms = list(sizes)
    placed = [-1] * len(clusters)
    nodes = 0

    def place(rank: int) -> bool:
        nonlocal nodes
        if rank == len(lengths):
            return True
        tried_empty = set()
        for g in sorted(range(m), key=lambda g: (-to_group[rank, g], rooms[g], g)):
            if rooms[g] < lengths[rank]:
                continue
            if rooms[g] == sizes[g]:  # empty groups of one size are interchangeable
                if sizes[g] in tried_empty:
                    continue
                tried_empty.add(sizes[g])
            nodes += 1
            if nodes > node_limit + len(lengths):  # a first descent always fits singletons
                return False
            rooms[g] -= lengths[rank]
            placed[order[rank]] = g
            to_group[:, g] += between[:, rank]
            if place(rank + 1):
                return True
            to_group[:, g] -= between[:, rank]
            rooms[g] += lengths[rank]
        return False

    return placed if place(0) else None


def _spectral_cut(affinity, sizes) -> np.ndarray:
    e = affinity.shape[0]
    weights = affinity.astype(np.float64)
    degree = weights.sum(axis=1)
    scale = 1.0 / np.sqrt(np.maximum(degree, 1.0))
    normalised = scale[:, None] * weights * scale[None, :]
    _, vectors = np.linalg.eigh(normalised)
    fiedler = vectors[:, -2] if e > 1 else vectors[:, -1]
    fiedler = np.round(fiedler * scale, 12)  # stable keys across BLAS builds
    if fiedler[np.argmax(np.abs(fiedler))] < 0:
        fiedler = -fiedler
    order = np.argsort(fiedler, kind="stable")
    assignment = np.empty(e, np.int64)
    assignment[order] = np.repeat(np.arange(len(sizes)), sizes)
    return assignment


def _local_search(affinity, load, caps, assignment, max_moves: int | None = None) -> np.ndarray:
    e, m = affinity.shape[0], len(caps)
    assignment = assignment.copy()
    onehot = np.zeros((e, m), np.int64)
    onehot[np.arange(e), assignment] = 1
    to_group = affinity @ onehot  # [E, m]: co-activation of each expert with each group
    group_load = onehot.T @ load
    sizes = onehot.sum(axis=0)
    ids = np.arange(e)
    max_moves = 20 * e if max_moves is None else max_moves
    bounded = bool(caps.max() < _UNBOUNDED)
    zeros = np.zeros((e, e), np.int64)
    for _ in range(max_moves):
        own = to_group[ids, assignment]  # [E]
        # Swap e <-> f (different groups): gain = (D[e, g_f] - D[e, g_e]) + (D[f, g_e] -
        # D[f, g_f]) - 2 A[e, f].
        cross = to_group[:, assignment] - own[:, None]  # [E, E]: D[e, g_f] - D[e, g_e]
        swap_gain = cross + cross.T - 2 * affinity
        old_a = _excess(group_load[assignment], caps[assignment])
        if bounded:
            load_a = group_load[assignment][:, None] - load[:, None] + load[None, :]  # e's group
            cap_a = caps[assignment][:, None]
            swap_excess = (
                _excess(load_a, cap_a)
                - old_a[:, None]
                + _excess(load_a.T, cap_a.T)
                - old_a[None, :]
            )
        else:
            swap_excess = zeros
        different = assignment[:, None] != assignment[None, :]
        upper = different & (ids[:, None] < ids[None, :])
        # Move e to group h when size(g_e) == size(h) + 1.
        move_gain = to_group - own[:, None]
        movable = sizes[assignment][:, None] == sizes[None, :] + 1
        if bounded:
            move_excess = (
                _excess(group_load[assignment] - load, caps[assignment])[:, None]
                - old_a[:, None]
                + _excess(group_load[None, :] + load[:, None], caps[None, :])
                - _excess(group_load, caps)[None, :]
            )
        else:
            move_excess = zeros[:, :m]
        candidate = _best(swap_excess, swap_gain, upper)
        move = _best(move_excess, move_gain, movable)
        if move is not None and (candidate is None or move[0] < candidate[0]):
            _, expert, group = move
            source = assignment[expert]
            assignment[expert] = group
            sizes[source] -= 1
            sizes[group] += 1
            group_load[source] -= load[expert]
            group_load[group] += load[expert]
            to_group[:, source] -= affinity[:, expert]
            to_group[:, group] += affinity[:, expert]
        elif candidate is not None:
            _, first, second = candidate
            a, b = assignment[first], assignment[second]
            assignment[first], assignment[second] = b, a
            shift = load[second] - load[first]
            group_load[a] += shift
            group_load[b] -= shift
            delta = affinity[:, second] - affinity[:, first]
            to_group[:, a] += delta
            to_group[:, b] -= delta
        else:
            break
    return assignment


def _best(excess: np.ndarray, gain: np.ndarray, allowed: np.ndarray):
    """The allowed entry that best improves ``(excess, -gain)``, or None when none improves."""
    if not allowed.any():
        return None
    excess = np.where(allowed, excess, np.iinfo(np.int64).max)
    lowest = excess.min()
    if lowest > 0:
        return None
    pool = allowed & (excess == lowest)
    gain = np.where(pool, gain, np.iinfo(np.int64).min)
    flat = int(np.argmax(gain))
    best_gain = gain.flat[flat]
    if lowest == 0 and best_gain <= 0:
        return None
    row, col = divmod(flat, gain.shape[1])
    return (int(lowest), -int(best_gain)), row, col
