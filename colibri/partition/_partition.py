"""The Partition value type: groups of experts, validated, saved and loaded as JSON.

A :class:`Partition` splits ``E`` experts into groups (every expert in exactly one). Routing
with ``partition=`` first picks each token's best ``topk_groups`` groups, then its top-k experts
inside them, so a token's expert reads stay in few contiguous blocks. That trades routing
fidelity for locality; :func:`evaluate` measures the trade on real or generated logits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import numpy as np

from colibri import _groups, _json
from colibri._atomic_file import write_atomically
from colibri._errors import FormatError
from colibri._regular import read_regular
from colibri._usage import UsageStats
from colibri._validate import check_int

__all__ = ["Partition"]

_FORMAT = "colibri.Partition"
_VERSION = 1


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
        self._groups = _groups.check(groups, num_experts, where="Partition")
        group_of = np.empty(sum(len(g) for g in self._groups), np.int32)
        for index, group in enumerate(self._groups):
            group_of[list(group)] = index
        group_of.flags.writeable = False
        self._group_of = group_of

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def contiguous(cls, num_experts: int, num_groups: int) -> Partition:
        """Consecutive id ranges, sizes differing by at most one, larger groups first.

        26 experts in 4 groups: ``0-6, 7-13, 14-19, 20-25`` (7, 7, 6, 6).
        """
        e = check_int("Partition.contiguous: num_experts", num_experts, 1)
        m = check_int("Partition.contiguous: num_groups", num_groups, 1)
        if m > e:
            raise ValueError(
                f"Partition.contiguous: num_groups ({m}) must not exceed num_experts ({e})"
            )
        return cls(_groups.contiguous(e, m), num_experts=e)

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

        Raises
        ------
        TypeError
            ``stats`` is not a :class:`UsageStats`, or ``num_groups`` not an int.
        ValueError
            ``num_groups`` outside ``[1, E]``, or a negative or non-finite ``load_tolerance``.

        Examples
        --------
        Experts 0-3 are always chosen in pairs inside {0, 1} and {2, 3}:

        >>> import numpy as np, colibri
        >>> ids = np.array([[0, 1], [2, 3], [1, 0], [3, 2]] * 50, np.int32)
        >>> stats = colibri.UsageStats.from_ids(ids, num_experts=4)
        >>> colibri.Partition.from_usage(stats, 2)
        Partition([[0, 1], [2, 3]])
        """
        if not isinstance(stats, UsageStats):
            raise TypeError(
                f"Partition.from_usage: stats must be a colibri.UsageStats (got "
                f"{type(stats).__name__}); build one with UsageStats.from_ids(ids, num_experts)"
            )
        e = stats.num_experts
        m = check_int("Partition.from_usage: num_groups", num_groups, 1)
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
        from colibri.partition._learn import learn_groups

        assignment = learn_groups(stats, _groups.sizes(e, m), load_tolerance)
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
        data = read_regular(name, "the partition", _json.MAX_BYTES)  # never a FIFO, bounded
        document = _json.parse(data, name, what="the partition")
        try:
            if not isinstance(document, dict) or document.get("format") != _FORMAT:
                raise ValueError("not a colibri partition (missing 'format': 'colibri.Partition')")
            if document.get("version") != _VERSION:
                raise ValueError(
                    f"unsupported version {_json.show(document.get('version'))} (this colibri "
                    f"reads {_VERSION})"
                )
            groups = _json.sequence(_json.field(document, "groups", name), name, "groups")
            ids = []
            for i, group in enumerate(groups):
                ids += _json.int_list(group, name, f"groups[{i}]", hi=_json.INT32_MAX)
            stored_e = _json.field(document, "num_experts", name, required=False)
            if stored_e is not None and _json.integer(stored_e, name, "num_experts") != len(ids):
                raise ValueError(
                    f"'num_experts' is {stored_e} but the groups list {len(ids)} expert ids "
                    f"({_misfits(ids, stored_e)}); every expert must be in exactly one group"
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


def _misfits(ids: list[int], num_experts: int) -> str:
    """Which ids keep ``ids`` from listing ``0 .. num_experts - 1`` once each: listed twice,
    out of range, in no group (at most 8 of each; the scan for missing ids stops after 8, so
    a huge ``num_experts`` costs nothing)."""
    seen: set[int] = set()
    twice = sorted({e for e in ids if e in seen or seen.add(e)})
    unknown = sorted({e for e in ids if e >= num_experts})
    missing = [e for e in range(min(num_experts, len(seen) + 9)) if e not in seen]

    def listed(xs: list[int]) -> str:
        return ", ".join(map(str, xs[:8])) + (" ..." if len(xs) > 8 else "")

    found = [("listed twice", twice), (f"out of range [0, {num_experts})", unknown),
             ("in no group", missing)]  # fmt: skip
    return "; ".join(f"{what}: {listed(xs)}" for what, xs in found if xs)


def _check_experts(got: int, expected: int, where: str) -> None:
    if got != expected:
        raise ValueError(f"{where}: statistics of {got} experts do not fit {expected} experts")
