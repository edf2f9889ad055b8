"""The MoE layer: dispatch and combine, the expert FFN kernel, and the layer that joins them.

::

    hidden [T, H] -> route -> dispatch -> per expert: down @ (act(gate @ x) * (up @ x))
                                        -> combine(weights) -> out [T, H]

:class:`MoELayer` runs the whole step over any :class:`ExpertStore` (a
:class:`colibri.Pager`, or :class:`InMemoryExperts`); :func:`expert_ffn` is the fused
half-precision expert kernel on its own; :func:`dispatch`, :func:`gather` and
:func:`combine` are the token-reordering steps, usable with any expert implementation.
"""

from colibri.layer._dispatch import DispatchPlan, combine, dispatch, gather
from colibri.layer._ffn import simd_path
from colibri.layer._moe import (
    ExpertFFN,
    ExpertStore,
    InMemoryExperts,
    MoELayer,
    activation_function,
    expert_ffn,
)

__all__ = [
    "DispatchPlan",
    "ExpertFFN",
    "ExpertStore",
    "InMemoryExperts",
    "MoELayer",
    "activation_function",
    "combine",
    "dispatch",
    "expert_ffn",
    "gather",
    "simd_path",
]
