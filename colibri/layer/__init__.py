"""The expert engine and the MoE layer over it.

::

    hidden [T, H] -> route -> run_experts: plan -> load chunks from an ExpertStore
                    -> fused kernel (decode-size experts) or fallback GEMMs -> combine

:func:`run_experts` is the one expert engine: :class:`MoELayer` (numpy and any DLPack
framework) and the transformers integration both run their experts through it, over any
:class:`ExpertStore` (a :class:`colibri.Pager`, or :class:`InMemoryExperts`);
:class:`HeldExperts` is its steady state when the budget holds every expert (nothing loaded
a step).
:func:`expert_ffn` is the fused half-precision expert kernel on its own; :func:`half_linear`
and :func:`quant_linear` are colibri's linear kernels for half-precision and block-quantized
weights (:func:`fast_layout` the quantized layout it reads fastest),
:func:`rms_norm` transformers' RMSNorm in one call, :func:`rope` its rotary
embedding, :func:`attention` a decoding step's attention over its key/value cache;
:func:`pre_attention` and :func:`post_attention` a decoder layer's one-token step around
its attention in two calls, :class:`AttentionStep` the same with the cache update between
them in one call, its arguments read once; :func:`warm` has the idle helper thread bring
the next call's weights toward the caches while the caller's own code runs;
:func:`dispatch`,
:func:`gather` and :func:`combine` are vLLM-style token-reordering steps, usable with any
expert implementation.
"""

from colibri.formats import ExpertWeights
from colibri.layer._dispatch import DispatchPlan, combine, dispatch, gather
from colibri.layer._engine import KERNEL_MAX_ROWS, ExpertStore, HeldExperts, run_experts
from colibri.layer._expert import (
    NATIVE_HALF,
    QUANT_KERNEL_MAX_ROWS,
    activation_function,
    attention,
    expert_ffn,
    fast_layout,
    gpt_oss_experts,
    half_linear,
    post_attention,
    pre_attention,
    quant_linear,
    rms_norm,
    rope,
)
from colibri.layer._ffn import detected_path, ffn_path, simd_path
from colibri.layer._moe import InMemoryExperts, MoELayer
from colibri.layer._quant import check_row_values, dequantize, nonfinite_block, quantize
from colibri.layer._step import WARM_MAX, AttentionStep, warm

__all__ = [
    "KERNEL_MAX_ROWS",
    "AttentionStep",
    "NATIVE_HALF",
    "QUANT_KERNEL_MAX_ROWS",
    "WARM_MAX",
    "DispatchPlan",
    "ExpertStore",
    "ExpertWeights",
    "HeldExperts",
    "InMemoryExperts",
    "MoELayer",
    "activation_function",
    "attention",
    "check_row_values",
    "combine",
    "detected_path",
    "dequantize",
    "dispatch",
    "expert_ffn",
    "fast_layout",
    "ffn_path",
    "gather",
    "gpt_oss_experts",
    "half_linear",
    "nonfinite_block",
    "post_attention",
    "pre_attention",
    "quant_linear",
    "quantize",
    "rms_norm",
    "rope",
    "run_experts",
    "simd_path",
    "warm",
]
