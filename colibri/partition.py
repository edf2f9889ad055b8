"""Static Expert Partitioning: groups of experts, learned from usage, and what they cost.

A :class:`Partition` splits ``E`` experts into groups (every expert in exactly one). Routing
with ``partition=`` first picks each token's best ``topk_groups`` groups, then its top-k experts
inside them, so a token's expert reads stay in few contiguous blocks. That trades routing
fidelity for locality; :func:`evaluate` measures the trade on real or generated logits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from colibri import _json
from colibri._atomic_file import write_atomically
from colibri._errors import FormatError
from colibri.stats import UsageStats

__all__ = ["FidelityReport", "Partition", "evaluate", "fidelity"]

_FORMAT = "colibri.Partition"
_VERSION = 1
_UNBOUNDED = np.iinfo(np.int64).max // 4  # a load cap that never binds


def _count(value: object, name: str, where: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {name} must be an int (got {value!r})")
    if value < 1:
        raise ValueError(f"{where}: {name} must be >= 1 (got {value})")
    return int(value)


def _group_sizes(num_experts: int, num_groups: int) -> list[int]:
    """Sizes differing by at most one, larger first: 26 in 4 -> [7, 7, 6, 6]."""
    base, extra = divmod(num_experts, num_groups)
    return [base + 1] * extra + [base] * (num_groups - extra)


class Partition:
    """Experts split into groups; every expert belongs to exactly one group.

    Parameters
    ----------
    groups : sequence of sequences of int
        The experts of each group, any membership and sizes. Together they must list
        ``0 .. E-1`` each exactly once. Group order is kept (between groups of equal score the
        router prefers the lower group index); ids within a group are sorted.
    num_experts : int, optional
        ``E``, checked when given (default: the number of ids listed).

    Raises
    ------
    TypeError
        ``groups`` is not a list of lists of integers.
    ValueError
        A group is empty, an id is negative or out of range, repeated, or missing.

    Examples
    --------
    >>> p = Partition([[0, 3], [1, 2]])
    >>> p.groups, p.group_of.tolist()
    (((0, 3), (1, 2)), [0, 1, 1, 0])
    """

    __slots__ = ("_group_of", "_groups")

    def __init__(self, groups: Iterable[Iterable[int]], *, num_experts: int | None = None) -> None:
        where = "Partition"
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
            raise TypeError(
                f"{where}: groups must be a list of lists of expert ids (got {groups!r})"
            )
        parsed: list[tuple[int, ...]] = []
        for index, group in enumerate(groups):
            if isinstance(group, (str, bytes, dict)) or not isinstance(group, Iterable):
                raise TypeError(
                    f"{where}: group {index} must be a list of expert ids (got {group!r})"
                )
            ids = []
            for expert in group:
                if isinstance(expert, (bool, np.bool_)) or not isinstance(
                    expert, (int, np.integer)
                ):
                    raise TypeError(
                        f"{where}: group {index} holds {expert!r}; expert ids must be ints"
                    )
                ids.append(int(expert))
            if not ids:
                raise ValueError(f"{where}: group {index} is empty; every group needs an expert")
            parsed.append(tuple(sorted(ids)))
        if not parsed:
            raise ValueError(f"{where}: groups is empty; give at least one group")
        total = sum(len(g) for g in parsed)
        e = total if num_experts is None else _count(num_experts, "num_experts", where)
        group_of = np.full(e, -1, np.int32)
        for index, group in enumerate(parsed):
            for expert in group:
                if not 0 <= expert < e:
                    raise ValueError(
                        f"{where}: expert id {expert} in group {index} is out of range "
                        f"[0, {e}) for {e} experts"
                    )
                if group_of[expert] >= 0:
                    raise ValueError(
                        f"{where}: expert {expert} appears twice (groups {group_of[expert]} and "
                        f"{index}); every expert must be in exactly one group"
                    )
                group_of[expert] = index
        missing = np.flatnonzero(group_of < 0)
        if missing.size:
            shown = ", ".join(str(x) for x in missing[:8]) + (" ..." if missing.size > 8 else "")
            raise ValueError(
                f"{where}: experts {shown} are in no group ({missing.size} of {e} missing); "
                f"every expert must be in exactly one group"
            )
        group_of.flags.writeable = False
        self._groups = tuple(parsed)
        self._group_of = group_of

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def contiguous(cls, num_experts: int, num_groups: int) -> Partition:
        """Consecutive id ranges, sizes differing by at most one, larger groups first.

        26 experts in 4 groups: ``0-6, 7-13, 14-19, 20-25`` (7, 7, 6, 6).
        """
        e = _count(num_experts, "num_experts", "Partition.contiguous")
        m = _count(num_groups, "num_groups", "Partition.contiguous")
        if m > e:
            raise ValueError(
                f"Partition.contiguous: num_groups ({m}) must not exceed num_experts ({e})"
            )
        bounds = np.cumsum([0, *_group_sizes(e, m)])
        return cls([range(bounds[i], bounds[i + 1]) for i in range(m)], num_experts=e)

    @classmethod
    def from_usage(
        cls, stats: UsageStats, num_groups: int, *, load_tolerance: float | None = 1.0
    ) -> Partition:
        """Learn groups that keep co-activated experts together, with balanced load.

        Objective. With ``A`` the co-activation matrix without its diagonal and ``load[e]`` the
        selection counts, find groups of near-equal size (sizes differ by at most one) that
        maximise the co-activation mass inside groups, ``sum over groups g of
        sum over {a, b} in g of A[a, b]`` (token-pairs that stay in one group), subject to every
        group's load staying within ``(1 + load_tolerance)`` of its fair share
        ``sum(load) * size(g) / E``. Keeping pairs together is what lets a token's exact top-k
        fit in its best group; the load bound keeps one group from taking most of the traffic
        (the balanced-packing idea of DeepSeek's EPLB). When the bound cannot be met the total
        excess load is minimised first.

        Algorithm. Three starts, each improved by local search without the load bound:

        1. *Seeded growth*: the busiest expert seeds the first group, each next seed is the
           expert least co-activated with the seeds so far; then, repeatedly, the unassigned
           expert with the largest co-activation with a group that has room (and load room)
           joins it.
        2. *Spectral order*: experts sorted by the Fiedler vector of the normalised
           co-activation graph, cut into consecutive groups.
        3. *Merge and pack*: average-linkage agglomeration of experts into clusters no larger
           than a group, then the clusters packed whole into the groups (largest first, a
           bounded depth-first search); while no packing is found, the latest (weakest) merge
           is undone. This start keeps clusters intact where single swaps cannot reunite them.

        Local search applies the best move until none improves ``(excess load, -inside
        mass)``: swapping two experts of different groups, or moving one from a group of size
        ``s + 1`` to one of size ``s``. Gains are computed for all pairs at once from the
        ``[E, num_groups]`` matrix of each expert's co-activation with each group, in exact
        integer arithmetic; ties go to the lower expert id, so the result is deterministic.
        With a load bound, the best unbounded result is then repaired by the same search under
        the bound (it moves only what the bound forces out), as is the load-aware growth
        start, and the better is kept. Cost: ``O(E**2)`` per move; well under a second for
        ``E = 256``. The spectral start uses LAPACK, so another platform may, on near-ties,
        return a different partition of equal quality.

        Parameters
        ----------
        stats : UsageStats
            Routing statistics (``ctx.stats``, or :meth:`UsageStats.from_ids`).
        num_groups : int
            Number of groups, ``1 <= num_groups <= E``.
        load_tolerance : float or None
            Allowed load above a group's fair share, as a fraction. The default 1.0 only stops
            a group from carrying more than twice its share: a tighter bound splits clusters
            of popular experts and costs fidelity when they are co-activated (measured in
            ``bench/bench_partition.py``). ``None`` ignores load.

        Returns
        -------
        Partition
            Groups ordered by their smallest expert id.
        """
        if not isinstance(stats, UsageStats):
            raise TypeError(
                f"Partition.from_usage: stats must be a colibri.UsageStats (got "
                f"{type(stats).__name__}); build one with UsageStats.from_ids(ids, num_experts)"
            )
        e = stats.num_experts
        m = _count(num_groups, "num_groups", "Partition.from_usage")
        if m > e:
            raise ValueError(
                f"Partition.from_usage: num_groups ({m}) must not exceed the {e} experts"
            )
        if load_tolerance is not None:
            load_tolerance = float(load_tolerance)
            if not np.isfinite(load_tolerance) or load_tolerance < 0:
                raise ValueError(
                    f"Partition.from_usage: load_tolerance must be >= 0 or None "
                    f"(got {load_tolerance})"
                )
        assignment = _learn_groups(stats, _group_sizes(e, m), load_tolerance)
        groups = [np.flatnonzero(assignment == g) for g in range(m)]
        groups.sort(key=lambda members: int(members[0]))
        return cls(groups, num_experts=e)

    # -- reading -------------------------------------------------------------------------------

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Each group's expert ids, ascending."""
        return self._groups

    @property
    def num_experts(self) -> int:
        """Number of experts ``E``."""
        return int(self._group_of.shape[0])

    @property
    def num_groups(self) -> int:
        """Number of groups."""
        return len(self._groups)

    @property
    def group_of(self) -> np.ndarray:
        """Group index of every expert, ``[E]`` int32 (read-only)."""
        return self._group_of

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of experts in each group."""
        return tuple(len(g) for g in self._groups)

    def inside_mass(self, stats: UsageStats) -> int:
        """Co-activations kept inside groups: tokens' expert pairs that share a group."""
        _check_experts(stats.num_experts, self.num_experts, "Partition.inside_mass")
        same = self._group_of[:, None] == self._group_of[None, :]
        np.fill_diagonal(same, False)
        return int(stats.coactivation[same].sum() // 2)

    def __repr__(self) -> str:
        return f"Partition({[list(g) for g in self._groups]})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return self._groups == other._groups

    def __hash__(self) -> int:
        return hash(self._groups)

    # -- files ---------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The JSON document :meth:`save` writes."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "num_experts": self.num_experts,
            "groups": [list(g) for g in self._groups],
        }

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the partition as JSON, atomically (temporary file, then rename).

        Raises
        ------
        FileExistsError
            ``path`` exists and ``overwrite`` is false.
        """
        payload = (json.dumps(self.to_dict(), indent=1) + "\n").encode()
        write_atomically(path, lambda f: f.write(payload), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, num_experts: int | None = None) -> Partition:
        """Read a partition written by :meth:`save`, validating it.

        Parameters
        ----------
        num_experts : int, optional
            Also require this ``E``.

        Raises
        ------
        FormatError
            (a ``ValueError``) The file is not a colibri partition, is not strict JSON, or is
            inconsistent; the message names the file and the key.
        """
        name = os.fspath(path)
        document = _json.load(name, what="the partition")
        try:
            if not isinstance(document, dict) or document.get("format") != _FORMAT:
                raise ValueError("not a colibri partition (missing 'format': 'colibri.Partition')")
            if document.get("version") != _VERSION:
                raise ValueError(
                    f"unsupported version {_json.show(document.get('version'))} (this colibri "
                    f"reads {_VERSION})"
                )
            groups = _json.sequence(_json.field(document, "groups", name), name, "groups")
            listed = 0
            for i, group in enumerate(groups):
                listed += len(_json.int_list(group, name, f"groups[{i}]", hi=_json.INT32_MAX))
            stored_e = _json.field(document, "num_experts", name, required=False)
            if stored_e is not None and _json.integer(stored_e, name, "num_experts") != listed:
                raise ValueError(
                    f"'num_experts' is {stored_e} but the groups list {listed} expert ids; "
                    "every expert must be in exactly one group"
                )
            partition = cls(groups, num_experts=stored_e)
            if num_experts is not None and partition.num_experts != num_experts:
                raise ValueError(f"it has {partition.num_experts} experts, expected {num_experts}")
        except FormatError:
            raise
        except (TypeError, ValueError) as error:
            message = str(error).removeprefix("Partition: ")
            raise FormatError(f"{name}: invalid partition: {message}") from None
        return partition


def _check_experts(got: int, expected: int, where: str) -> None:
    if got != expected:
        raise ValueError(f"{where}: statistics of {got} experts do not fit {expected} experts")


# -- learning groups ---------------------------------------------------------------------------


def _learn_groups(stats: UsageStats, sizes: list[int], tolerance: float | None) -> np.ndarray:
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


# -- fidelity ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FidelityReport:
    """What partitioned routing kept of exact (unrestricted) top-k routing.

    Attributes
    ----------
    tokens, top_k, num_groups, topk_groups : int
        The routing that was measured.
    recall : float
        Share of the exact top-k choices (token, expert) that partitioned routing also made.
    mass_kept : float
        ``sum_t sum_{e in P_t} s[t, e] / sum_t sum_{e in X_t} s[t, e]``, with ``X_t`` the
        exact top-k set, ``P_t`` the partitioned one and ``s`` the router's scores over all
        ``E`` experts before any renormalisation (the full softmax for ``scoring="softmax"``,
        the sigmoid or sqrt-softplus otherwise; no correction bias). At most 1 unless a
        ``correction_bias`` made the exact choice differ from the highest scores.
    exact_share : float
        Share of tokens whose partitioned choice is exactly the exact top-k set.
    spanning_share : float
        Share of tokens whose exact top-k spans more than one group.
    unreachable_share : float
        Share of tokens whose exact top-k spans more than ``topk_groups`` groups: these can
        never be routed exactly under the partition.
    group_load : tuple of float
        Share of the partitioned selections that fall in each group (sums to 1).
    exact_group_load : tuple of float
        The same for exact routing.
    """

    tokens: int
    top_k: int
    num_groups: int
    topk_groups: int
    recall: float
    mass_kept: float
    exact_share: float
    spanning_share: float
    unreachable_share: float
    group_load: tuple[float, ...]
    exact_group_load: tuple[float, ...]

    def __str__(self) -> str:
        loads = " ".join(f"{x:.3f}" for x in self.group_load)
        exact_loads = " ".join(f"{x:.3f}" for x in self.exact_group_load)
        return "\n".join(
            [
                f"fidelity of partitioned routing: {self.tokens} tokens, top-{self.top_k}, "
                f"{self.num_groups} groups, topk_groups={self.topk_groups}",
                f"  recall of exact top-k       {self.recall:.4f}",
                f"  routing mass kept           {self.mass_kept:.4f}",
                f"  tokens routed exactly       {self.exact_share:.4f}",
                f"  exact top-k spans >1 group  {self.spanning_share:.4f}",
                f"  ... > topk_groups groups    {self.unreachable_share:.4f}",
                f"  load per group (partitioned) {loads}",
                f"  load per group (exact)       {exact_loads}",
            ]
        )


def _scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    x = logits.astype(np.float64)
    if scoring == "softmax":
        x = np.exp(x - x.max(axis=1, keepdims=True))
        return x / x.sum(axis=1, keepdims=True)
    if scoring == "sigmoid":
        return 0.5 * (1.0 + np.tanh(0.5 * x))
    if scoring == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, x))
    raise ValueError(
        f"evaluate(): scoring must be 'softmax', 'sigmoid' or 'sqrtsoftplus' (got {scoring!r})"
    )


def fidelity(
    partition: Partition,
    logits: np.ndarray,
    exact_ids: np.ndarray,
    partitioned_ids: np.ndarray,
    *,
    topk_groups: int = 1,
    scoring: str = "softmax",
) -> FidelityReport:
    """Compare two routings of the same logits (see :class:`FidelityReport`).

    Parameters
    ----------
    partition : Partition
    logits : numpy.ndarray
        ``[T, E]`` router logits.
    exact_ids, partitioned_ids : numpy.ndarray
        ``[T, k]`` expert ids chosen by unrestricted and by partitioned routing.
    """
    logits = np.asarray(logits)
    exact_ids = np.asarray(exact_ids).astype(np.intp)
    partitioned_ids = np.asarray(partitioned_ids).astype(np.intp)
    t, e = logits.shape
    if exact_ids.shape != partitioned_ids.shape or exact_ids.shape[0] != t:
        raise ValueError(
            f"fidelity(): ids must both be [T, k] with T = {t} (got {exact_ids.shape} and "
            f"{partitioned_ids.shape})"
        )
    k = exact_ids.shape[1]
    m = partition.num_groups
    rows = np.arange(t)[:, None]
    chosen = np.zeros((t, e), bool)
    chosen[rows, exact_ids] = True
    kept = chosen[rows, partitioned_ids]  # [T, k]: partitioned choice also exact
    scores = _scores(logits, scoring)
    exact_mass = scores[rows, exact_ids].sum()
    mass = scores[rows, partitioned_ids].sum()
    group_of = partition.group_of.astype(np.intp)
    groups_hit = np.zeros((t, m), bool)
    groups_hit[rows, group_of[exact_ids]] = True
    spans = groups_hit.sum(axis=1)
    selections = max(t * k, 1)
    return FidelityReport(
        tokens=t,
        top_k=k,
        num_groups=m,
        topk_groups=topk_groups,
        recall=float(kept.sum() / selections),
        mass_kept=float(mass / exact_mass) if exact_mass > 0 else 1.0,
        exact_share=float(kept.all(axis=1).mean()) if t else 1.0,
        spanning_share=float((spans > 1).mean()) if t else 0.0,
        unreachable_share=float((spans > topk_groups).mean()) if t else 0.0,
        group_load=tuple(
            float(x)
            for x in np.bincount(group_of[partitioned_ids].ravel(), minlength=m) / selections
        ),
        exact_group_load=tuple(
            float(x) for x in np.bincount(group_of[exact_ids].ravel(), minlength=m) / selections
        ),
    )


def evaluate(
    partition: Partition | Sequence[Sequence[int]],
    logits: object,
    top_k: int,
    /,
    *,
    topk_groups: int = 1,
    **options: object,
) -> FidelityReport:
    """Measure what routing inside ``partition`` keeps of exact top-k routing on ``logits``.

    Both routings run through colibri's router (``colibri.route``): exact top-k, and top-k
    inside each token's best ``topk_groups`` groups of ``partition``, with the same routing
    ``options`` (``scoring``, ``correction_bias``, ...; ``group_score`` only applies to the
    partitioned routing).

    Parameters
    ----------
    partition : Partition or list of lists of int
    logits : array_like
        ``[T, E]`` router logits (numpy, or anything ``numpy.asarray`` reads).
    top_k : int
        Experts per token.
    topk_groups : int
        Groups each token may use (default 1).

    Returns
    -------
    FidelityReport
        Recall, routing mass kept, load per group, share of tokens spanning several groups.
    """
    import colibri

    if not isinstance(partition, Partition):
        partition = Partition(partition)
    for name in ("partition", "num_groups", "collect_stats"):
        if name in options:
            raise TypeError(f"evaluate(): {name}= is set by evaluate itself; do not pass it")
    array = np.asarray(logits)
    if array.ndim != 2 or array.shape[1] != partition.num_experts:
        raise ValueError(
            f"evaluate(): logits must be [T, E] with E = {partition.num_experts} (the "
            f"partition's experts); got shape {array.shape}"
        )
    topk_groups = _count(topk_groups, "topk_groups", "evaluate()")
    if topk_groups > partition.num_groups:
        raise ValueError(
            f"evaluate(): topk_groups ({topk_groups}) exceeds the partition's "
            f"{partition.num_groups} groups"
        )
    group_options = {"group_score": options.pop("group_score")} if "group_score" in options else {}
    exact_ids, _ = colibri.route(array, top_k, **options)
    partitioned_ids, _ = colibri.route(
        array, top_k, partition=partition, topk_groups=topk_groups, **group_options, **options
    )
    return fidelity(
        partition,
        array,
        np.asarray(exact_ids),
        np.asarray(partitioned_ids),
        topk_groups=topk_groups,
        scoring=str(options.get("scoring", "softmax")),
    )
