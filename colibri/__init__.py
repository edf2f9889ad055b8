"""colibri: Mixture-of-Experts routing and expert paging for machines too small for the model."""

from colibri._core import max_threads, openmp_enabled
from colibri.dispatch import DispatchPlan, combine, dispatch, gather
from colibri.layer import ExpertFFN, InMemoryExperts, MoELayer

__version__ = "0.1.0"

__all__ = [
    "DispatchPlan",
    "ExpertFFN",
    "InMemoryExperts",
    "MoELayer",
    "__version__",
    "combine",
    "dispatch",
    "gather",
    "max_threads",
    "openmp_enabled",
]
