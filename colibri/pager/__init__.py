"""Expert paging: the :class:`Pager` (weights paged from their files under a hard budget)
and the cache policies that choose what it evicts, with trace replay and Belady's optimum.
"""

from colibri.pager._backends import DEFAULT_IO, IO_BACKENDS
from colibri.pager._pager import BudgetError, FileChangedError, Pager
from colibri.pager._policies import (
    POLICIES,
    AdaptivePolicy,
    CachePolicy,
    FIFOPolicy,
    HotSetPolicy,
    LFUPolicy,
    LRFUPolicy,
    LRUPolicy,
    NextUsePolicy,
    make_policy,
)
from colibri.pager._replay import ReplayCache, ReplayResult, Trace, belady, replay
from colibri.pager._stats import LayerStats, PagerStats
from colibri.pager._views import ExpertBatch

__all__ = [
    "DEFAULT_IO",
    "IO_BACKENDS",
    "POLICIES",
    "AdaptivePolicy",
    "BudgetError",
    "CachePolicy",
    "ExpertBatch",
    "FIFOPolicy",
    "FileChangedError",
    "HotSetPolicy",
    "LFUPolicy",
    "LRFUPolicy",
    "LRUPolicy",
    "LayerStats",
    "NextUsePolicy",
    "Pager",
    "PagerStats",
    "ReplayCache",
    "ReplayResult",
    "Trace",
    "belady",
    "make_policy",
    "replay",
]
