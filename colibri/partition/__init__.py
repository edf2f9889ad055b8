"""Static Expert Partitioning: groups of experts, learned from usage, and what they cost.

A :class:`Partition` splits ``E`` experts into groups (every expert in exactly one). Routing
with ``partition=`` first picks each token's best ``topk_groups`` groups, then its top-k experts
inside them, so a token's expert reads stay in few contiguous blocks. That trades routing
fidelity for locality; :func:`evaluate` measures the trade on real or generated logits.
"""

from colibri.partition._fidelity import FidelityReport, evaluate, fidelity
from colibri.partition._partition import Partition

__all__ = ["FidelityReport", "Partition", "evaluate", "fidelity"]
