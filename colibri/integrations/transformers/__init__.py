"""Route the MoE blocks of a Hugging Face transformers model with colibri.

``patch(model)`` finds every MoE router of a loaded transformers model and
replaces its routing (score function, top-k, groups, selection bias,
renormalisation, scale) with a colibri context built from the router's own
configuration. The router's gate projection still computes the logits in torch
and the model's own expert modules still compute the experts; only the
decision "which experts, with which weights" moves to colibri.

A router is recognised by the exact code of its routing method, not by its
class name: colibri holds a fingerprint of every routing implementation it was
checked against (transformers 5.23), so the families that share an
implementation (DeepSeek-V3, GLM-4.5, Kimi, dots1, ... share one) are covered
together, and a transformers release that changes a router's code is refused
with a clear error instead of being routed differently.

Example
-------
>>> from colibri.integrations.transformers import patch, unpatch
>>> patched = patch(model)            # list of PatchedRouter
>>> model.generate(input_ids, do_sample=False, max_new_tokens=20)
>>> unpatch(model)

Semantics that colibri reproduces within float32 rounding rather than bit for
bit are listed in :data:`DIFFERENCES`.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - transformers cannot run without torch
    raise ImportError(
        "colibri.integrations.transformers needs torch and transformers: "
        "pip install colibri-moe[transformers]"
    ) from err

from colibri.integrations.transformers._checkpoint import CheckpointError
from colibri.integrations.transformers._experts import Paging, UnsupportedCheckpointError
from colibri.integrations.transformers._families import (
    CHECKED_VERSION,
    DIFFERENCES,
    UnsupportedRouterError,
)
from colibri.integrations.transformers._load import from_pretrained
from colibri.integrations.transformers._patch import (
    PatchedRouter,
    patch,
    patched_routers,
    supported_routers,
    unpatch,
)
from colibri.integrations.transformers._predict import PredictionStats
from colibri.integrations.transformers._quantize import quantize_checkpoint

__all__ = [
    "CHECKED_VERSION",
    "DIFFERENCES",
    "CheckpointError",
    "PagedExperts",
    "PatchedRouter",
    "Paging",
    "PredictionStats",
    "UnsupportedCheckpointError",
    "UnsupportedRouterError",
    "from_pretrained",
    "patch",
    "patched_routers",
    "quantize_checkpoint",
    "supported_routers",
    "unpatch",
]
