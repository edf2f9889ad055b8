"""A decoding step's attention on colibri's kernel (:func:`colibri.layer.attention`).

transformers' ``"sdpa"`` attention runs torch's ``scaled_dot_product_attention``, whose CPU
kernel is built for long query blocks: one bfloat16 query row of 16 heads over a 4-head cache
takes ~90 us at 32 keys and ~1 ms at 512 (one thread), 15-60 layers a token. colibri's
kernel reads the cache once per key/value head, ~19 us and ~0.13 ms.

A model from :func:`from_pretrained` whose attention is ``"sdpa"`` gets ``"colibri"``: the
masks sdpa's (the same ``AttentionMaskInterface`` entry), the same arguments. A call of at
most :data:`MAX_QUERIES` query rows on the CPU, float32 or half precision, without
gradients, dropout, a causal flag (prefill without a mask) or a position bias runs colibri's
kernel; every other call, and every call inside a compiled graph, runs sdpa's function
unchanged. Results differ from sdpa's in the sum order only (float32, rounded once).
"""

from __future__ import annotations

import torch
from torch import nn

from colibri.integrations.transformers._ops import HALF_NAMES, values_of
from colibri.layer import attention

__all__ = ["MAX_QUERIES", "NAME", "install", "plain"]

#: The attention implementation's name in transformers' registries.
NAME = "colibri"
#: Most query rows a call runs on colibri's kernel (decoding steps; more: sdpa).
MAX_QUERIES = 8


def _mask(mask: torch.Tensor | None, b: int, length: int):
    """Batch ``b``'s ``[T, L]`` float32 mask to add to the scores (None: none)."""
    if mask is None:
        return None
    m = mask[b if mask.shape[0] > 1 else 0, 0, :, :length]
    if m.dtype == torch.bool:
        if m.all():  # a decoding step's usual mask: every key visible
            return None
        return torch.zeros(m.shape).masked_fill_(~m, float("-inf")).numpy()
    return m.to(torch.float32).numpy()


def plain(kwargs: dict) -> bool:
    """Whether a call's extra arguments leave it on colibri's kernel (no position bias, no
    cache object, no softcap)."""
    return all(kwargs.get(name) is None for name in ("position_bias", "cache", "softcap"))


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call: ``query [B, Hq, T, D]``, ``key``/``value``
    ``[B, Hkv, L, D]`` -> ``([B, T, Hq, D], None)``, as sdpa's."""
    B, Hq, T, D = query.shape
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    dtype = query.dtype
    mask = attention_mask
    if (
        torch.compiler.is_compiling()
        or T > MAX_QUERIES
        or (T > 1 and mask is None and causal)
        or dropout
        or query.device.type != "cpu"
        or not (dtype == torch.float32 or dtype in HALF_NAMES)
        or key.dtype != dtype
        or value.dtype != dtype
        or key.shape[-1] != D
        or value.shape[-1] != D
        or (mask is not None and (mask.ndim != 4 or mask.shape[1] != 1))
        or not plain(kwargs)
        or (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
    ):
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout,
                     scaling=scaling, is_causal=is_causal, **kwargs)  # fmt: skip
    scale = D**-0.5 if scaling is None else float(scaling)
    name = "float32" if dtype == torch.float32 else HALF_NAMES[dtype]
    length = key.shape[2]
    out = torch.empty((B, T, Hq, D), dtype=dtype)
    for b in range(B):
        attention(values_of(query[b].contiguous()), values_of(key[b].contiguous()),
                  values_of(value[b].contiguous()), scale, name, _mask(mask, b, length),
                  values_of(out[b]))  # fmt: skip
    return out, None


def install(model: nn.Module) -> bool:
    """Put ``model``'s attention on colibri's kernel for decoding steps when it is sdpa's;
    whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
