"""Expert parallelism over torch.distributed: one model, its routed experts on several ranks.

Rank 0 runs the model (attention, routers, sampling); every rank (rank 0 too) owns a share of
each MoE layer's experts (a :class:`Placement`) and pages it from its own copy of the
checkpoint under its own budget. Per MoE layer rank 0 sends each rank the rows its experts
need and gets back each row's expert output, which it sums as one process sums them, so the
tokens are those of one process. Faults end in a :class:`DistributedError` naming the rank,
within the user's timeout. Start with ``from_pretrained(..., expert_parallel=True)`` on every
rank, or ``torchrun ... colibri generate``; see ``docs/distributed.md``.
"""

from colibri.distributed._group import launched
from colibri.distributed._options import DEFAULT_TIMEOUT, ExpertParallel
from colibri.distributed._placement import Placement, place
from colibri.distributed._start import start
from colibri.distributed._wire import DistributedError

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedError",
    "ExpertParallel",
    "Placement",
    "launched",
    "place",
    "start",
]
