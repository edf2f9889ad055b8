"""How much memory this process may use: its cgroup's limit, the system's ``MemAvailable``.

Facts only (the policy that sizes a budget from them is
:mod:`colibri.integrations.transformers._budget`); this process's own resident set is
:func:`colibri._units.process_memory`. Linux only: elsewhere every answer is None.

A cgroup limit applies to the cgroup and to everything below it, so the limit of a process is
the smallest one on the path from its cgroup up to the root: cgroup v2 ``memory.max``
(``max``: none) under the unified mount, v1 ``memory.limit_in_bytes`` (a huge number: none)
under the ``memory`` controller's mount. The path comes from ``/proc/self/cgroup``; inside a
container the mount may start below that path, so levels that do not exist are skipped.
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["MemoryLimit", "cgroup_limit", "mem_available", "usable_memory"]

#: Where the cgroup file systems are mounted, where the kernel says which cgroups this
#: process is in, and its memory counters (tests point these at fake trees).
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
PROC_MEMINFO = "/proc/meminfo"

_UNLIMITED_V1 = 1 << 62  # v1 says "no limit" as PAGE_COUNTER_MAX pages (~2**63 bytes)


class MemoryLimit(NamedTuple):
    """A limit on this process's memory: ``nbytes``, and the file that says so."""

    nbytes: int
    source: str


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # missing, or not readable: no limit known here
        return None


def _limits(base: str, path: str, name: str, kind: str) -> list[MemoryLimit]:
    """The limits in file ``name`` of cgroup ``path`` and its ancestors under ``base``."""
    found = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        file = os.path.join(base, *parts[:depth], name)
        text = _read(file)
        if text is None or text == "max":
            continue
        try:
            value = int(text)
        except ValueError:
            continue
        if kind == "v2" or value < _UNLIMITED_V1:
            found.append(MemoryLimit(value, f"cgroup {kind} {file}"))
    return found


def cgroup_limit(root: str | None = None, proc: str | None = None) -> MemoryLimit | None:
    """The smallest memory limit of this process's cgroups (v1 and v2), or None.

    Parameters
    ----------
    root : str, optional
        The cgroup mount point (default :data:`CGROUP_ROOT`).
    proc : str, optional
        The process's cgroup list (default :data:`PROC_CGROUP`).
    """
    root = CGROUP_ROOT if root is None else root
    text = _read(PROC_CGROUP if proc is None else proc)
    found: list[MemoryLimit] = []
    for line in (text or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2: the unified tree (hybrid: unified/)
            for base in (root, os.path.join(root, "unified")):
                found += _limits(base, path, "memory.max", "v2")
        elif "memory" in controllers.split(","):
            found += _limits(os.path.join(root, "memory"), path, "memory.limit_in_bytes", "v1")
    return min(found, default=None)


def mem_available(meminfo: str | None = None) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes: what the system can give without
    swapping (free memory plus reclaimable page cache), or None where it is not said."""
    for line in (_read(PROC_MEMINFO if meminfo is None else meminfo) or "").splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            return int(value.split()[0]) * 1024
    return None


def usable_memory(in_use: int) -> MemoryLimit | None:
    """What this process may use in all, holding ``in_use`` bytes now: the smaller of its
    cgroup limit (which counts what it holds) and ``MemAvailable + in_use``; None where the
    OS says neither."""
    limits = []
    cgroup = cgroup_limit()
    if cgroup is not None:
        limits.append(cgroup)
    available = mem_available()
    if available is not None:
        limits.append(MemoryLimit(available + in_use, "MemAvailable + in use"))
    return min(limits, default=None)
