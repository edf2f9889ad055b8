"""The catalogue of transformers routers: each routing implementation colibri reproduces.

A router kind pairs the fingerprint of a transformers routing method with the colibri
options it maps to (``configure``) and the forward that replaces it; routers that are
recognised but cannot be expressed are listed with the reason.

One file although over 600 lines: it is a table, one entry per routing implementation of
transformers, read top to bottom; splitting it would scatter the catalogue.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from colibri._errors import ColibriError
from colibri.integrations.transformers._linears import linear


class UnsupportedRouterError(ColibriError, NotImplementedError):
    """A router whose routing colibri cannot reproduce exactly."""


# Where colibri's routing is not bit-identical to transformers' own code.
DIFFERENCES: dict[str, str] = {
    "selection on logits": (
        "Without a selection bias colibri picks the top-k of the logits (every score "
        "function is increasing). Routers that take the top-k of softmax probabilities "
        "(Mixtral, Qwen, OLMoE, Jamba, DBRX, Gemma4, ...) tie where several probabilities "
        "underflow to 0 in float32 and torch.topk then picks any of them; colibri picks "
        "the largest logit. The tied experts' weights are 0 either way, so the block "
        "output is the same. Routers that select on logits (gpt-oss, GraniteMoE, Llama4, "
        "Cohere2-MoE) are matched exactly, sigmoid saturation included."
    ),
    "softmax over k": (
        "A renormalised softmax is computed by colibri as exp(x - max of the k) over the k "
        "chosen logits, normalised: gpt-oss's formula exactly, and within a few float32 "
        "ulps of softmax-over-all-then-renormalise (Mixtral, Qwen, ...)."
    ),
    "low-precision routing math": (
        "colibri computes scores and weights in float32 and casts the weights to the dtype "
        "transformers returns. DBRX, gpt-oss, Mistral4 and DeepSeek-V4 compute their "
        "softmax/sigmoid in the model dtype, so for bfloat16/float16 models their weights "
        "differ by the rounding of that dtype."
    ),
    "renormalisation epsilon": (
        "Ernie4.5 divides by max(sum, 1e-12) (a clamp, not an added epsilon); colibri divides "
        "by the sum. The results differ only when the k selected scores sum to less than "
        "1e-12. (DeepSeek-V3's sum + 1e-20 and LFM2-MoE's sum + 1e-6 are reproduced with "
        "normalize_eps.)"
    ),
    "masked groups": (
        "DeepSeek-V2 and Mistral4 fill the scores of dropped groups with 0.0 before the "
        "top-k; colibri never selects an expert of a dropped group. Softmax scores are "
        "positive, so this differs only if a kept expert's probability underflows to 0."
    ),
    "ties": (
        "Equal selection keys go to the lower expert id in colibri; torch.topk leaves the "
        "choice unspecified. Exact ties are rare in float32 and common in bfloat16 logits."
    ),
}


# The transformers release whose routing code the fingerprints below were read from.
CHECKED_VERSION = "5.23.0"


# --------------------------------------------------------------------------------------
# Router kinds: which code they replace, which options they map to.


@functools.cache  # a function's code does not change: each is read and tokenized once
def _fingerprint(func: Callable) -> str:
    """A hash of a function's code tokens, blind to comments, docstrings and layout."""
    source = textwrap.dedent(inspect.getsource(func))
    kept = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            continue
        if tok.type == tokenize.NEWLINE:
            kept.append(";")
        elif not (tok.type == tokenize.STRING and tok.string.startswith(('"""', "'''"))):
            kept.append(tok.string)
    return hashlib.sha256(" ".join(kept).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class _Kind:
    """A routing implementation colibri reproduces.

    ``configure(module)`` returns ``(num_experts, top_k, options, tensors)`` or raises
    ``UnsupportedRouterError``; ``forward(module, routing, *args)`` replaces
    ``module.<method>`` and must return exactly what the original returned.
    """

    name: str
    method: str
    fingerprints: frozenset[str]
    configure: Callable[[Any], tuple[int, int, dict[str, Any], dict[str, Callable]]]
    forward: Callable[..., Any]


def _attr(name: str) -> Callable[[Any], Any]:
    return lambda module: getattr(module, name)


def _float(value: Any, what: str, module: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UnsupportedRouterError(
            f"{type(module).__name__}: {what}={value!r} is not a number colibri can use"
        ) from None


def _groups(module: Any, num_groups: Any, topk_groups: Any, group_score: str) -> dict:
    """Group-limited routing options; ``{}`` when there is a single group."""
    num_experts = module.num_experts
    if num_groups is None or int(num_groups) <= 1:
        return {}
    num_groups = int(num_groups)
    if num_experts % num_groups:
        raise UnsupportedRouterError(
            f"{type(module).__name__}: n_group={num_groups} does not divide "
            f"num_experts={num_experts} (transformers itself cannot run this config)"
        )
    return {"num_groups": num_groups, "topk_groups": int(topk_groups), "group_score": group_score}


def _scale(value: Any, module: Any, what: str = "routed_scaling_factor") -> dict:
    value = _float(value, what, module)
    return {} if value == 1.0 else {"scale": value}


# Softmax -> top-k -> optional renormalisation (Mixtral, Qwen2/3-MoE, OLMoE, ...). -------


def _softmax_topk(normalize: Callable[[Any], bool]) -> Callable:
    def configure(module):
        return module.num_experts, module.top_k, {"normalize": bool(normalize(module))}, {}

    return configure


def _fw_linear_softmax(out_dtype: str) -> Callable:
    """Router ``F.linear(h, weight)`` in the model dtype; weights cast as transformers does."""

    def routed(self, routing, router_logits):
        ids, weights = routing.route(self, router_logits)
        if out_dtype == "logits":
            weights = weights.to(router_logits.dtype)
        return router_logits, weights, ids

    def forward(self, routing, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        return routed(self, routing, linear(self, hidden_states))

    forward.routed = routed  # the rest once the logits are known (_patch.routed)
    routed.weights = out_dtype  # its weights' dtype, for a caller that routes itself (_patch.plain)
    return forward


def _fw_jamba(self, routing, hidden_states):
    router_logits = linear(self, hidden_states)
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.to(hidden_states.dtype), ids


def _fw_hunyuan(self, routing, hidden_states):
    hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
    if self.wg.weight.dtype == torch.float32:
        hidden_states = hidden_states.float()
    router_logits = self.wg(hidden_states)
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.to(router_logits.dtype), ids


# Top-k of the logits -> softmax over the k (gpt-oss, GraniteMoE, Cohere2-MoE). ---------


def _cfg_topk_softmax(module):
    return module.num_experts, module.top_k, {"normalize": True}, {}


def _fw_gpt_oss(self, routing, hidden_states):
    router_logits = linear(self, hidden_states, self.bias)
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.to(router_logits.dtype), ids


def _fw_granite(self, routing, hidden_states):
    router_logits = linear(self, hidden_states).float()
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.type_as(hidden_states), ids


def _cfg_cohere2(module):
    fn = module.expert_selection_fn
    if fn == "softmax":
        options = {"normalize": True}
    elif fn == "sigmoid":
        options = {"scoring": "sigmoid", "normalize": bool(module.norm_topk_prob)}
    else:
        raise UnsupportedRouterError(
            f"{type(module).__name__}: expert_selection_fn={fn!r} (transformers knows "
            "'softmax' and 'sigmoid')"
        )
    return module.num_experts, module.top_k, options, {}


def _fw_cohere2(self, routing, hidden_states):
    router_logits = linear(self, hidden_states)
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.to(hidden_states.dtype), ids


# Llama4: top-k of the logits -> sigmoid, returned as a dense [T, E] score matrix. -------


def _cfg_llama4(module):
    return module.num_experts, module.top_k, {"scoring": "sigmoid", "normalize": False}, {}


def _fw_llama4(self, routing, hidden_states):
    router_logits = linear(self, hidden_states, self.bias)
    ids, weights = routing.route(self, router_logits)
    router_scores = torch.zeros_like(router_logits).scatter_(
        1, ids, weights.to(router_logits.dtype)
    )
    return router_scores, router_logits


# DBRX: softmax -> top-k -> p-norm renormalisation (a method of the FFN block). ---------


def _cfg_dbrx(module):
    p = module.moe_normalize_expert_weights
    options: dict[str, Any] = {"normalize": p is not None}
    if p is not None:
        p = _float(p, "moe_normalize_expert_weights", module)
        if not p > 0:
            raise UnsupportedRouterError(
                f"{type(module).__name__}: moe_normalize_expert_weights={p} (colibri "
                "renormalises by a p-norm with p > 0)"
            )
        if p != 1.0:
            options["norm_p"] = p
    return module.experts.num_experts, module.top_k, options, {}


def _fw_dbrx(self, routing, router_logits):
    ids, weights = routing.route(self, router_logits)
    return weights.to(router_logits.dtype), ids


# Gemma4: softmax -> top-k -> renormalise -> per-expert scale. ---------------------------


def _cfg_gemma4(module):
    num_experts = module.per_expert_scale.shape[0]
    return (
        num_experts,
        module.config.top_k_experts,
        {"normalize": True},
        {"expert_scale": _attr("per_expert_scale")},
    )


def _fw_gemma4(self, routing, hidden_states):
    hidden_states = self.norm(hidden_states)
    hidden_states = hidden_states * self.scale * self.scalar_root_size
    expert_scores = self.proj(hidden_states)
    # Index 0 is what transformers records as `router_logits` (aux loss): the probabilities.
    router_probabilities = nn.functional.softmax(expert_scores, dim=-1, dtype=torch.float32)
    ids, weights = routing.route(self, expert_scores)
    dtype = torch.promote_types(torch.float32, self.per_expert_scale.dtype)
    return router_probabilities, weights.to(dtype), ids


# DeepSeek-V2: softmax -> (group max, greedy) -> top-k, no renormalisation, scale. -------


def _cfg_deepseek_v2(module):
    options: dict[str, Any] = {"normalize": False, **_scale(module.routed_scaling_factor, module)}
    if module.topk_method == "group_limited_greedy":
        options.update(_groups(module, module.num_group, module.topk_group, "max"))
    elif module.topk_method != "greedy":
        raise UnsupportedRouterError(
            f"{type(module).__name__}: topk_method={module.topk_method!r} (transformers' "
            "DeepSeek-V2 router knows 'greedy' and 'group_limited_greedy')"
        )
    return module.num_experts, module.top_k, options, {}


def _fw_fp32_logits(self, routing, hidden_states):
    """DeepSeek-style routers: float32 logits, float32 weights."""

    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights, ids


# DeepSeek-V3 and its many descendants: sigmoid + selection bias, top-2-sum groups. ------


def _cfg_deepseek_v3(module):
    options: dict[str, Any] = {
        "scoring": "sigmoid",
        "normalize": bool(module.norm_topk_prob),
        **_scale(module.routed_scaling_factor, module),
        **_groups(module, module.num_group, module.topk_group, "top2_sum"),
    }
    if module.norm_topk_prob:
        options["normalize_eps"] = 1e-20  # topk_weights.sum() + 1e-20
    tensors = {"correction_bias": _attr("e_score_correction_bias")}
    return module.num_experts, module.top_k, options, tensors


# Mistral4: softmax, top-2-sum groups without a bias, renormalise, scale. ----------------


def _cfg_mistral4(module):
    options: dict[str, Any] = {
        "normalize": bool(module.norm_topk_prob),
        **_scale(module.routed_scaling_factor, module),
        **_groups(module, module.num_group, module.topk_group, "top2_sum"),
    }
    return module.num_experts, module.top_k, options, {}


def _fw_mistral4(self, routing, hidden_states):
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = linear(self, hidden_states)
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.to(router_logits.dtype), ids


# Ernie4.5: softmax + selection bias -> top-k -> renormalise (clamped). ------------------


def _cfg_ernie(module):
    bias = module.moe_statics.e_score_correction_bias
    if bias.shape[0] != 1:
        raise UnsupportedRouterError(
            f"{type(module).__name__}: {bias.shape[0]} bias groups (colibri takes one [E] "
            "correction bias per router)"
        )
    tensors = {"correction_bias": lambda m: m.moe_statics.e_score_correction_bias[0]}
    return module.num_experts, module.top_k, {"normalize": True}, tensors


def _fw_ernie(self, routing, hidden_states):
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.to(hidden_states.dtype), ids


# Sigmoid + selection bias given by the block (MiniMax-M2, HY-V3, AFMoE). ---------------


def _cfg_sigmoid_bias(scale_attr: str | None) -> Callable:
    def configure(module):
        options: dict[str, Any] = {"scoring": "sigmoid", "normalize": True}
        if scale_attr is not None:
            options.update(_scale(getattr(module, scale_attr), module, scale_attr))
        num_experts = getattr(module, "num_experts", None) or module.config.num_experts
        return num_experts, module.top_k, options, {}

    return configure


def _fw_minimax_m2(self, routing, hidden_states, e_score_correction_bias):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = linear(self, hidden_states.to(self.weight.dtype))
    ids, weights = routing.route(self, router_logits, correction_bias=e_score_correction_bias)
    return router_logits, weights, ids


def _fw_hy_v3(self, routing, hidden_states, e_score_correction_bias):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    ids, weights = routing.route(self, router_logits, correction_bias=e_score_correction_bias)
    return router_logits, weights, ids


def _fw_afmoe(self, routing, hidden_states, expert_bias):
    hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
    router_logits = self.gate(hidden_states).to(torch.float32)
    ids, weights = routing.route(self, router_logits, correction_bias=expert_bias)
    return router_logits, weights, ids


# Longcat-Flash: softmax + selection bias, no renormalisation, scale. --------------------


def _cfg_longcat(module):
    options = {"normalize": False, **_scale(module.routed_scaling_factor, module)}
    tensors = {"correction_bias": _attr("e_score_correction_bias")}
    return module.n_routed_experts, module.top_k, options, tensors


def _fw_longcat(self, routing, hidden_states):
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(
        hidden_states.type(torch.float32), self.classifier.weight.type(torch.float32)
    )
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.to(router_logits.dtype), ids


# Laguna: optional tanh soft-capping of the logits, sigmoid + bias, renormalise. ---------


def _cfg_laguna(module):
    options = {"scoring": "sigmoid", "normalize": True}
    tensors = {"correction_bias": _attr("e_score_correction_bias")}
    return module.num_experts, module.top_k, options, tensors


def _fw_laguna(self, routing, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = linear(self, hidden_states).float()
    if self.router_logit_softcapping > 0.0:
        cap = self.router_logit_softcapping
        router_logits = torch.tanh(router_logits / cap) * cap
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.to(hidden_states.dtype), ids


# DeepSeek-V4 (learned router): sigmoid or sqrt-softplus + bias, renormalise, scale. -----


def _cfg_deepseek_v4(module):
    scoring = {"Sigmoid": "sigmoid", "SqrtSoftplusActivation": "sqrtsoftplus"}.get(
        type(module.score_fn).__name__
    )
    if scoring is None:
        raise UnsupportedRouterError(
            f"{type(module).__name__}: scoring_func {type(module.score_fn).__name__} "
            "(colibri has 'sigmoid' and 'sqrtsoftplus')"
        )
    options = {
        "scoring": scoring,
        "normalize": True,
        **_scale(module.routed_scaling_factor, module),
    }
    tensors = {"correction_bias": _attr("e_score_correction_bias")}
    return module.num_experts, module.top_k, options, tensors


def _fw_deepseek_v4(self, routing, hidden_states):
    flat = hidden_states.reshape(-1, self.hidden_dim)
    logits = linear(self, flat)
    ids, weights = routing.route(self, logits)
    return logits, weights.to(logits.dtype), ids


# Aria: top-k of the logits -> softmax over the k, weights in the logits' dtype. ---------


def _fw_aria(self, routing, hidden_states):
    router_logits = linear(self, hidden_states)
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights.to(router_logits.dtype), ids


# Mistral-Large-4: float32 logits, softmax, top-2-sum groups, always renormalise, scale. --


def _cfg_mistral_large4(module):
    options: dict[str, Any] = {
        "normalize": True,
        **_scale(module.routed_scaling_factor, module),
        **_groups(module, module.num_group, module.topk_group, "top2_sum"),
    }
    return module.num_experts, module.top_k, options, {}


# MiniMax-M3-VL, Step-3.7: sigmoid + the router's own bias, renormalise. -----------------


def _cfg_sigmoid_own_bias(module):
    options = {"scoring": "sigmoid", "normalize": True}
    tensors = {"correction_bias": _attr("e_score_correction_bias")}
    return module.num_experts, module.top_k, options, tensors


def _fw_minimax_m3(self, routing, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = linear(self, hidden_states.to(self.weight.dtype))
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights, ids


# Beam: DeepSeek-V3 routing with the scale applied by the block, not the router. ---------


def _cfg_beam(module):
    options: dict[str, Any] = {
        "scoring": "sigmoid",
        "normalize": bool(module.norm_topk_prob),
        **_groups(module, module.num_group, module.topk_group, "top2_sum"),
    }
    tensors = {"correction_bias": _attr("e_score_correction_bias")}
    return module.num_experts, module.top_k, options, tensors


# Flint: float32 logits, sigmoid without a bias, optional renormalisation. ---------------


def _cfg_flint(module):
    options = {"scoring": "sigmoid", "normalize": bool(module.norm_topk_prob)}
    return module.num_experts, module.top_k, options, {}


def _fw_float32_logits_reshape(self, routing, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.float(), self.weight.float())
    ids, weights = routing.route(self, router_logits)
    return router_logits, weights, ids


# LFM2-MoE: sigmoid (+ the block's expert bias, for selection), renormalise by sum + 1e-6,
# scale. ---------------------------------------------------------------------------------


def _cfg_lfm2(module):
    options: dict[str, Any] = {"scoring": "sigmoid", "normalize": bool(module.norm_topk_prob)}
    if module.norm_topk_prob:
        options["normalize_eps"] = 1e-6
    options.update(_scale(module.routed_scaling_factor, module))
    return module.num_experts, module.top_k, options, {}


def _fw_lfm2(self, routing, hidden_states, expert_bias=None):
    router_logits = linear(self, hidden_states)
    given = {"correction_bias": expert_bias} if self.use_expert_bias else {}
    ids, weights = routing.route(self, router_logits, **given)
    return router_logits, weights.type_as(router_logits), ids


# Kolibri1: select on logits + bias, weights sigmoid(logits), optional renormalisation. --


def _cfg_kolibri1(module):
    options = {"scoring": "sigmoid", "normalize": bool(module.norm_topk_prob),
               "bias_on": "logits"}  # fmt: skip
    tensors = {"correction_bias": _attr("e_score_correction_bias")}
    return module.num_experts, module.top_k, options, tensors


def _kind(name, method, fingerprints, configure, forward) -> _Kind:
    return _Kind(name, method, frozenset(fingerprints.split()), configure, forward)


# Fingerprints of transformers 5.23's routing methods (see _fingerprint), with the
# classes that carry each one.
_KINDS: tuple[_Kind, ...] = (
    # Mixtral, MiniMax: always renormalise, float32 weights.
    _kind("softmax_topk_renorm_fp32", "forward", "acac3352d4cf",
          _softmax_topk(lambda m: True), _fw_linear_softmax("float32")),
    # Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE, FlexOlmo, Mellum, Qwen3-Omni, Qwen4-Exp.
    _kind("softmax_topk_norm_topk_prob", "forward", "c8bd844d7629",
          _softmax_topk(_attr("norm_topk_prob")), _fw_linear_softmax("logits")),
    # Qwen3.5-MoE, Qwen3-VL-MoE, Qwen3-Omni text: always renormalise.
    _kind("softmax_topk_renorm", "forward", "29f329118d25",
          _softmax_topk(lambda m: True), _fw_linear_softmax("logits")),
    # Jamba: no renormalisation.
    _kind("softmax_topk", "forward", "0f1f39244f2b",
          _softmax_topk(lambda m: False), _fw_jamba),
    # HunYuan-MoE-V1.
    _kind("softmax_topk_renorm_hunyuan", "forward", "c86a511c187b",
          _softmax_topk(lambda m: True), _fw_hunyuan),
    # gpt-oss: router linear with a bias.
    _kind("topk_logits_softmax_bias", "forward", "4508a4a10b89", _cfg_topk_softmax, _fw_gpt_oss),
    # GraniteMoE, GraniteMoeShared, GraniteMoeHybrid, GraniteMoE-SWA.
    _kind("topk_logits_softmax", "forward", "20b9b7f45ac3", _cfg_topk_softmax, _fw_granite),
    # Cohere2-MoE.
    _kind("topk_logits_softmax_or_sigmoid", "forward", "7da871f4b550", _cfg_cohere2, _fw_cohere2),
    # Llama4.
    _kind("topk_logits_sigmoid_dense", "forward", "65d84fbc7537", _cfg_llama4, _fw_llama4),
    # DBRX (DbrxFFN.route_tokens_to_experts).
    _kind("softmax_topk_pnorm", "route_tokens_to_experts", "0439fea25dfc", _cfg_dbrx, _fw_dbrx),
    # Gemma4, DiffusionGemma.
    _kind("softmax_topk_renorm_expert_scale", "forward", "57c3a333883c", _cfg_gemma4, _fw_gemma4),
    # DeepSeek-V2, DeepSeek-OCR-2, UnlimitedOCR.
    _kind("softmax_group_max_scale", "forward", "638283574ab3",
          _cfg_deepseek_v2, _fw_fp32_logits),
    # DeepSeek-V3/V3.2, GLM-4.5/4.6 (Glm4Moe, Glm4MoeLite, Glm4vMoe, GlmMoeDsa, Glm5Next),
    # Kimi-Linear, dots1, dots3, EXAONE-MoE, MiMo-V2-Flash, Solar-Open, Nemotron-H,
    # BailingHybrid, HY-V4, AXK1.
    _kind("sigmoid_bias_group_top2_scale", "forward", "254368df33b8",
          _cfg_deepseek_v3, _fw_fp32_logits),
    # Mistral4.
    _kind("softmax_group_top2_scale", "forward", "157fffaf926c", _cfg_mistral4, _fw_mistral4),
    # Ernie4.5-MoE, Ernie4.5-VL-MoE.
    _kind("softmax_bias_renorm", "forward", "e212e7a76de2", _cfg_ernie, _fw_ernie),
    # MiniMax-M2.
    _kind("sigmoid_block_bias_renorm", "forward", "8bd9aee097d7",
          _cfg_sigmoid_bias(None), _fw_minimax_m2),
    # HY-V3, dots3 vision.
    _kind("sigmoid_block_bias_renorm_scale", "forward", "4d3c5ff8a1aa",
          _cfg_sigmoid_bias("router_scaling_factor"), _fw_hy_v3),
    # AFMoE.
    _kind("sigmoid_block_bias_renorm_route_scale", "forward", "466fbbf6a011",
          _cfg_sigmoid_bias("route_scale"), _fw_afmoe),
    # Longcat-Flash.
    _kind("softmax_bias_scale", "forward", "a3c5d3e07c8d", _cfg_longcat, _fw_longcat),
    # Laguna.
    _kind("softcap_sigmoid_bias_renorm", "forward", "f395da3a5039", _cfg_laguna, _fw_laguna),
    # DeepSeek-V4 learned router.
    _kind("score_fn_bias_renorm_scale", "forward", "f8915089a044",
          _cfg_deepseek_v4, _fw_deepseek_v4),
    # Aria.
    _kind("topk_logits_softmax_aria", "forward", "b8f5a0bdc62b", _cfg_topk_softmax, _fw_aria),
    # Mistral-Large-4.
    _kind("softmax_fp32_group_top2_renorm_scale", "forward", "99d68baf9a42",
          _cfg_mistral_large4, _fw_fp32_logits),
    # MiniMax-M3-VL, Step-3.7.
    _kind("sigmoid_bias_renorm", "forward", "3c2e7930d431",
          _cfg_sigmoid_own_bias, _fw_minimax_m3),
    # Beam.
    _kind("sigmoid_bias_group_top2", "forward", "1d199881acd1", _cfg_beam, _fw_fp32_logits),
    # Flint.
    _kind("sigmoid_topk_norm_topk_prob", "forward", "9481bf5ddeae",
          _cfg_flint, _fw_float32_logits_reshape),
    # LFM2-MoE.
    _kind("sigmoid_block_bias_renorm_eps_scale", "forward", "9e0ccf5e45e6", _cfg_lfm2, _fw_lfm2),
    # Kolibri1.
    _kind("logits_bias_sigmoid_renorm", "forward", "d28139c8518f",
          _cfg_kolibri1, _fw_float32_logits_reshape),
)  # fmt: skip

# Routers that are recognised but whose routing colibri cannot express; why, precisely.
_UNSUPPORTED: dict[str, str] = {
    "2866c431cb6d": (
        "PhiMoE's sparsemixer masks every logit more than 2*router_jitter_noise (relative) "
        "below the maximum before a softmax, separately for the first and second choice; "
        "colibri has no relative-threshold masking option"
    ),
    "65e2a986e26e": (
        "DeepSeek-V4's hash router selects experts from a fixed token-id table "
        "(tid2eid[input_ids]); there is no routing decision for colibri to make"
    ),
    "2ea991c3d360": (
        "Zaya's router is an MLP over carried router states with a skip expert "
        "(index num_experts) whose weight is zeroed; not a top-k over gate logits"
    ),
    "945740df260a": (
        "JetMoE's router returns expert-sorted token slots (index_sorted_experts, "
        "batch_index, batch_gates, expert_size) instead of per-token ids and weights"
    ),
}
