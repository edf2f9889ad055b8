"""Groups of experts, with every expert in exactly one group: the one check.

``colibri.Partition`` and ``Config(partition=...)`` take their groups through :func:`check`;
``colibri.formats.repack`` reads :func:`coverage` to word its own message per layer. A leaf:
it imports nothing of colibri's but the argument checks, so routing, partition and formats
can all build on it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import NamedTuple

import numpy as np

from colibri._validate import check_int

__all__ = ["Coverage", "check", "contiguous", "coverage", "parse", "sizes"]

Groups = tuple[tuple[int, ...], ...]


def parse(groups: object, where: str) -> list[tuple[int, ...]]:
    """``groups`` as tuples of int ids, in the order given; a TypeError names what is not a
    list of lists of ints (a bool is not an id). ``where`` starts the message."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
        raise TypeError(f"{where}: groups must be a list of lists of expert ids (got {groups!r})")
    parsed = []
    for index, group in enumerate(groups):
        if isinstance(group, (str, bytes, dict)) or not isinstance(group, Iterable):
            raise TypeError(f"{where}: group {index} must be a list of expert ids (got {group!r})")
        ids = []
        for expert in group:
            if isinstance(expert, (bool, np.bool_)) or not isinstance(expert, (int, np.integer)):
                raise TypeError(f"{where}: group {index} holds {expert!r}; expert ids must be ints")
            ids.append(int(expert))
        parsed.append(tuple(ids))
    return parsed


class Coverage(NamedTuple):
    """How groups fall short of listing each of some experts exactly once (all empty: they
    do not). Problems are in the order the groups list them."""

    empty: tuple[int, ...]  # indexes of empty groups
    unknown: tuple[tuple[int, int], ...]  # (expert, group): an id not among the experts
    repeated: tuple[tuple[int, int, int], ...]  # (expert, first group, later group)
    missing: tuple[int, ...]  # experts in no group, ascending

    def __bool__(self) -> bool:  # true when something is wrong
        return any(self)


def coverage(groups: Iterable[Iterable[int]], experts: Collection[int]) -> Coverage:
    """Check that ``groups`` list every id of ``experts`` exactly once, in non-empty groups."""
    empty, unknown, repeated = [], [], []
    group_of: dict[int, int] = {}
    for index, group in enumerate(groups):
        size = 0
        for expert in group:
            size += 1
            if expert not in experts:
                unknown.append((expert, index))
            elif expert in group_of:
                repeated.append((expert, group_of[expert], index))
            else:
                group_of[expert] = index
        if not size:
            empty.append(index)
    missing = sorted(e for e in experts if e not in group_of)
    return Coverage(tuple(empty), tuple(unknown), tuple(repeated), tuple(missing))


def check(groups: object, num_experts: int | None = None, *, where: str = "Partition") -> Groups:
    """Groups of ``0 .. E-1`` with every expert in exactly one, each group's ids ascending.

    ``E`` is ``num_experts``, or the number of ids listed. A TypeError or ValueError names the
    first problem; ``where`` starts the message.
    """
    parsed = [tuple(sorted(g)) for g in parse(groups, where)]
    if not parsed:
        raise ValueError(f"{where}: groups is empty; give at least one group")
    total = sum(len(g) for g in parsed)
    e = total if num_experts is None else check_int(f"{where}: num_experts", num_experts, 1)
    problems = coverage(parsed, range(e))
    once = "every expert must be in exactly one group"
    if problems.empty:
        raise ValueError(
            f"{where}: group {problems.empty[0]} is empty; every group needs an expert"
        )
    if problems.unknown:
        expert, index = problems.unknown[0]
        raise ValueError(
            f"{where}: expert id {expert} in group {index} is out of range [0, {e}) for {e} experts"
        )
    if problems.repeated:
        expert, first, index = problems.repeated[0]
        raise ValueError(
            f"{where}: expert {expert} appears twice (groups {first} and {index}); {once}"
        )
    if problems.missing:
        missing = problems.missing
        shown = ", ".join(str(x) for x in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(
            f"{where}: experts {shown} are in no group ({len(missing)} of {e} missing); {once}"
        )
    return tuple(parsed)


def sizes(num_experts: int, num_groups: int) -> list[int]:
    """Sizes differing by at most one, larger first: 26 in 4 -> [7, 7, 6, 6]."""
    base, extra = divmod(num_experts, num_groups)
    return [base + 1] * extra + [base] * (num_groups - extra)


def contiguous(num_experts: int, num_groups: int) -> Groups:
    """Consecutive id ranges of :func:`sizes` (callers check ``1 <= num_groups <= E``)."""
    bounds = np.cumsum([0, *sizes(num_experts, num_groups)]).tolist()
    return tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(num_groups))
