"""Expert partitions (minimal; the partition branch replaces this file)."""

from __future__ import annotations


class Partition:
    def __init__(self, groups):
        groups = tuple(tuple(sorted(int(e) for e in g)) for g in groups)
        flat = [e for g in groups for e in g]
        E = len(flat)
        if not groups or any(not g for g in groups):
            raise ValueError("partition groups must be non-empty")
        if sorted(flat) != list(range(E)):
            raise ValueError("partition must contain every expert 0..E-1 exactly once")
        self.groups = groups
        self.num_experts = E
        self.num_groups = len(groups)
