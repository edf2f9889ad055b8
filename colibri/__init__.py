"""colibri: Mixture-of-Experts routing and expert paging for machines too small for the model.

>>> import colibri, numpy as np
>>> ctx = colibri.init(26, 2)
>>> ids, weights = ctx.route(np.random.default_rng(0).standard_normal((4, 26), np.float32))
>>> ids.shape, weights.dtype
((4, 2), dtype('float32'))
"""

from importlib import metadata as _metadata

try:
    from colibri._core import max_threads, openmp_enabled
except ImportError as _exc:  # pragma: no cover - what a user of the unbuilt tree sees
    import os as _os

    _here = _os.path.dirname(_os.path.abspath(__file__))
    if not _os.path.isfile(_os.path.join(_here, "_core.pyx")):
        raise  # an installed colibri that lost its extension: the original error says why
    raise ImportError(
        f"colibri is being imported from its source tree ({_here}), where its compiled "
        "extensions are not built. Install it with `pip install .` and run from outside the "
        "tree, or through the `colibri` and `pytest` commands, which do not put the current "
        "directory on sys.path (`python -m ...` from the repository root does). For "
        "development, `pip install --no-build-isolation -e .` builds it in place "
        "(README, Develop)."
    ) from _exc
from colibri._errors import BudgetError, ColibriError, FormatError
from colibri.layer import (
    DispatchPlan,
    ExpertWeights,
    InMemoryExperts,
    MoELayer,
    combine,
    dispatch,
    expert_ffn,
    gather,
    simd_path,
)
from colibri.pager import FileChangedError, Pager
from colibri.partition import Partition
from colibri.routing import Config, Context, UsageStats, init, route, route_from_dlpack

try:
    __version__ = _metadata.version("colibri-moe")  # one version: meson.build's project()
except _metadata.PackageNotFoundError:  # pragma: no cover - run from a build tree
    __version__ = "unknown"


def get_include() -> str:
    """The directory holding colibri's C headers (``colibri/route.h``, ``dlpack.h``, ...)."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "include")
    if os.path.isdir(installed):
        return installed
    # an editable install imports the source tree: the headers stay at the repository's top
    return os.path.join(os.path.dirname(here), "include")


__all__ = [
    "BudgetError",
    "ColibriError",
    "Config",
    "Context",
    "DispatchPlan",
    "ExpertWeights",
    "FileChangedError",
    "FormatError",
    "InMemoryExperts",
    "MoELayer",
    "Pager",
    "Partition",
    "UsageStats",
    "__version__",
    "combine",
    "dispatch",
    "expert_ffn",
    "gather",
    "get_include",
    "init",
    "max_threads",
    "openmp_enabled",
    "route",
    "route_from_dlpack",
    "simd_path",
]
