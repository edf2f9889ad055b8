"""The pager's counters: per layer and in all, with the faults its fetching threads take."""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    import resource
except ImportError:  # Windows
    resource = None

__all__ = ["LayerStats", "PagerStats"]


class _HitRate:
    """``hit_rate`` for counters of ``hits`` and ``misses`` (the pager's and a replay's)."""

    __slots__ = ()

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)``; 0.0 before any access."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class LayerStats(_HitRate):
    """Counters of one layer."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    evictions: int = 0
    pages_loaded: int = 0
    pages_evicted: int = 0
    minor_faults: int = 0
    major_faults: int = 0


@dataclass
class PagerStats(LayerStats):
    """Pager counters (a snapshot; see :attr:`Pager.stats`).

    ``hits``/``misses`` count demand accesses (one per unique expert per :meth:`Pager.load`);
    an expert found in flight from a prefetch counts as a hit and as an ``inflight_wait``.
    ``bytes_read`` counts the expert bytes fetched (prefetches included); ``read_seconds`` is
    the wall time spent fetching (summed over threads); ``read_throughput`` = ``bytes_read /
    read_seconds``. ``pages_loaded`` / ``pages_evicted`` count pages of ``page_size`` bytes
    the pager started / stopped holding (``resident_pages = pages_loaded - pages_evicted``);
    ``minor_faults`` / ``major_faults`` the page faults the fetching threads took while
    fetching (``getrusage``; 0 where unavailable). ``rss_file`` / ``rss_anon`` are the
    process's file-backed and anonymous resident bytes when the snapshot was taken
    (``/proc/self/status``; None elsewhere). ``usable_bytes`` is the part of ``budget_bytes``
    the slots can use (``capacity * slot_bytes``: whole slots, at most one per expert in the
    files). ``advised`` counts experts handed to the OS by
    :meth:`Pager.advise` (read-ahead into the page cache, not into the budget).
    """

    io: str = ""
    page_size: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    resident_pages: int = 0
    peak_resident_pages: int = 0
    pool_bytes: int = 0
    budget_bytes: int = 0
    usable_bytes: int = 0
    read_seconds: float = 0.0
    prefetched: int = 0
    prefetch_hits: int = 0
    advised: int = 0
    inflight_waits: int = 0
    rss_file: int | None = None
    rss_anon: int | None = None
    per_layer: dict[int, LayerStats] = field(default_factory=dict)

    @property
    def read_throughput(self) -> float:
        """Bytes per second while reading."""
        return self.bytes_read / self.read_seconds if self.read_seconds else 0.0

    @property
    def bytes_paged_in(self) -> int:
        """Bytes of the pages made resident (``pages_loaded * page_size``): the I/O unit;
        above ``bytes_read`` by the parts of pages that hold no byte of the expert loaded."""
        return self.pages_loaded * self.page_size


_RUSAGE_WHO = getattr(resource, "RUSAGE_THREAD", getattr(resource, "RUSAGE_SELF", None))


def _faults() -> tuple[int, int]:
    if _RUSAGE_WHO is None:
        return 0, 0
    r = resource.getrusage(_RUSAGE_WHO)
    return r.ru_minflt, r.ru_majflt
