"""colibri: Mixture-of-Experts routing and expert paging for machines too small for the model.

>>> import colibri, numpy as np
>>> ctx = colibri.init(26, 2)
>>> ids, weights = ctx.route(np.random.default_rng(0).standard_normal((4, 26), np.float32))
>>> ids.shape, weights.dtype
((4, 2), dtype('float32'))
"""

from colibri._core import max_threads, openmp_enabled
from colibri.config import Config
from colibri.dispatch import DispatchPlan, combine, dispatch, gather
from colibri.layer import ExpertFFN, InMemoryExperts, MoELayer
from colibri.pager import BudgetError, Pager
from colibri.partition import Partition
from colibri.routing import Context, init, route, route_from_dlpack
from colibri.stats import UsageStats

__version__ = "0.1.0"


def get_include() -> str:
    """The directory holding colibri's C headers (``colibri/route.h``, ``dlpack.h``, ...)."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "include")
    if os.path.isdir(installed):
        return installed
    # an editable install imports src/colibri: the headers stay at the repository's top
    return os.path.join(os.path.dirname(os.path.dirname(here)), "include")


__all__ = [
    "BudgetError",
    "Config",
    "Context",
    "DispatchPlan",
    "ExpertFFN",
    "InMemoryExperts",
    "MoELayer",
    "Pager",
    "Partition",
    "UsageStats",
    "__version__",
    "combine",
    "dispatch",
    "gather",
    "get_include",
    "init",
    "max_threads",
    "openmp_enabled",
    "route",
    "route_from_dlpack",
]
