"""gpt-oss's experts paged: transformers' ``GptOssExperts`` computed on what the pager serves.

gpt-oss's experts are unlike every other family's (see :mod:`colibri.formats.gpt_oss` for
how they are stored, plain or MXFP4): one fused ``gate_up`` projection with gate and up
interleaved, biases, and a clamped SwiGLU::

    h = x @ gate_up + gate_up_bias                      # [n, 2I]
    gate, up = h[:, ::2].clamp(max=limit), h[:, 1::2].clamp(-limit, limit)
    y = ((up + 1) * gate * sigmoid(alpha * gate)) @ down + down_bias

Each paged expert is read from the checkpoint as stored (MXFP4 blocks and scales, or the plain
dtype) and computed in torch, in the model's dtype, exactly as ``GptOssExperts.forward`` does;
MXFP4 experts are dequantized to float32 first (exact) and the interleave is kept, as
transformers keeps it. The biases are resident (loaded with the non-expert tensors into the
module). No fused kernel takes gpt-oss experts yet: every expert goes through torch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from colibri.formats.gpt_oss import GptOssLayout, GptOssWeights, dequantize_mxfp4
from colibri.integrations.transformers import _ops
from colibri.integrations.transformers._checkpoint import CheckpointError, layer_index
from colibri.integrations.transformers._experts import (
    OWN_PAGING,
    Paging,
    _Layer,
    _spans,
    _torch_view,
    attach,
    next_guess,
    paged_state,
    routed,
)
from colibri.layer import run_experts

__all__ = ["GPT_OSS", "IMPLEMENTATION", "check_experts", "forward", "page", "servable"]

#: transformers' experts class of gpt-oss.
GPT_OSS = "GptOssExperts"
#: gpt-oss's experts implementation's name in transformers' ``ExpertsInterface``.
IMPLEMENTATION = "colibri_gpt_oss"


@dataclass
class _GptOssLayer(_Layer):
    """A paged gpt-oss experts module: the clamped SwiGLU's ``alpha`` and ``limit`` too."""

    alpha: float = 1.702
    limit: float = 7.0


def servable(module: nn.Module) -> str | None:
    """None if colibri computes ``module`` (a ``GptOssExperts``) exactly, else why."""
    for attr in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        if not isinstance(getattr(module, attr, None), torch.Tensor):
            return f"{GPT_OSS} has no {attr} parameter"
    for attr in ("alpha", "limit"):
        if not isinstance(getattr(module, attr, None), (int, float)):
            return f"{GPT_OSS}.{attr} is no number"
    return None


def page(name: str, module: nn.Module, paging: Paging) -> int:
    """Make ``module`` (a ``GptOssExperts``) a paged experts module of ``paging``: its
    weights go, its biases stay (loaded resident), its forward becomes :func:`forward`."""
    state = _GptOssLayer(
        layer=layer_index(name),
        num_experts=int(module.gate_up_proj.shape[0]),
        activation=None,
        paging=paging,
        handle=_ops.handle(module),
        alpha=float(module.alpha),
        limit=float(module.limit),
    )
    return attach(module, state, IMPLEMENTATION, forward)


def check_experts(name: str, module: nn.Module, source, checkpoint) -> None:
    """Every expert of the ``GptOssExperts`` ``module`` is in ``source``, shaped as the
    config gives (plain ``[H, 2I]`` / ``[I, H]``, or MXFP4 blocks and scales)."""
    layer = layer_index(name)
    num, hidden, inter2 = module.gate_up_proj.shape
    inter = inter2 // 2
    for e in range(num):
        layout: GptOssLayout | None = source.experts.get((layer, e))
        if layout is None:
            raise CheckpointError(
                f"{checkpoint.weights}: no tensors for layer {layer} expert {e} (the model "
                f"{name} has {num} experts, the checkpoint stores {source.num_experts(layer)} "
                f"for that layer; expected '{name}.gate_up_proj' or '{name}.gate_up_proj_blocks' "
                f"[{num}, ...]); fix: {checkpoint.config_fix}"
            )
        if layout.gate_up_scales is None:
            want = [(layout.gate_up, (hidden, inter2)), (layout.down, (inter, hidden))]
        elif hidden % 32 or inter % 32:
            raise CheckpointError(
                f"{checkpoint.config_path}: hidden_size {hidden} and intermediate_size {inter} "
                f"must be multiples of 32 for the MXFP4 experts of {layout.gate_up.path}; fix: "
                f"{checkpoint.config_fix}"
            )
        else:
            want = [
                (layout.gate_up, (inter2, hidden // 32, 16)),
                (layout.gate_up_scales, (inter2, hidden // 32)),
                (layout.down, (hidden, inter // 32, 16)),
                (layout.down_scales, (hidden, inter // 32)),
            ]
        for ref, shape in want:
            if tuple(ref.shape) != shape:
                raise CheckpointError(
                    f"{ref.path}: expert tensor {ref.name.split('[', 1)[0]!r} is "
                    f"{list(ref.shape)} per expert but {checkpoint.config_name} (hidden "
                    f"{hidden}, expert intermediate {inter}) needs {list(shape)}; fix: "
                    f"{checkpoint.config_fix}"
                )


def _gated(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on interleaved ``[n, 2I]`` -> ``[n, I]``."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _matrices(w: GptOssWeights, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [H, 2I]`` and ``down [I, H]`` in ``like``'s dtype (``x @ W``), as
    transformers holds them: MXFP4 dequantized (a copy), plain ones viewed where they can."""
    if w.gate_up_scales is not None:
        gate_up = dequantize_mxfp4(w.gate_up, w.gate_up_scales)  # [2I, H] float32
        down = dequantize_mxfp4(w.down, w.down_scales)  # [H, I]
        return (torch.from_numpy(np.ascontiguousarray(gate_up.T)).to(like.dtype),
                torch.from_numpy(np.ascontiguousarray(down.T)).to(like.dtype))  # fmt: skip
    with warnings.catch_warnings():  # torch warns: the pager's arrays are read-only
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        gate_up, down = (_torch_view(m, w.dtype, like) for m in (w.gate_up, w.down))
    return gate_up.to(like.dtype), down.to(like.dtype)


def forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts call for a paged ``GptOssExperts``, ``[T, H], [T, k], [T, k]
    -> [T, H]``: ``y[t] = sum_j w[t, j] * expert_e(x[t])`` over ``e = top_k_index[t, j]``,
    each expert as ``GptOssExperts.forward`` computes it, on what the pager serves."""
    state = paged_state(self, IMPLEMENTATION)
    if torch.compiler.is_compiling():  # an opaque node of the graph
        return _ops.experts(state.handle, hidden_states, top_k_index, top_k_weights)
    ids, weights, ids_np = routed(state, top_k_index, top_k_weights)
    out = torch.zeros_like(hidden_states)

    def compute(e: int, w: GptOssWeights, tokens: np.ndarray, assignments: np.ndarray) -> None:
        token_t = torch.from_numpy(tokens)
        slot_t = torch.from_numpy(assignments % ids.shape[1])
        x_e = hidden_states[token_t]
        gate_up, down = _matrices(w, x_e)
        scale = weights[token_t, slot_t, None]
        start = 0
        for size in _spans(len(tokens)):  # one oneDNN kernel per power of two (_experts.py)
            rows = slice(start, start + size)
            h = _gated(x_e[rows] @ gate_up + self.gate_up_proj_bias[e], state.alpha, state.limit)
            y = h @ down + self.down_proj_bias[e]
            out.index_add_(0, token_t[rows], (y * scale[rows]).to(out.dtype))
            start += size

    paging = state.paging
    run_experts(
        paging.open_pager(),
        state.layer,
        hidden_states.detach().float().numpy(),
        ids_np,
        weights.detach().float().numpy(),
        num_experts=state.num_experts,
        num_threads=paging.num_threads,
        fallback=compute,
        kernel=False,  # no fused kernel for gpt-oss experts: all go to compute()
        read_ahead=paging.read_ahead != "off",
        next_layer=next_guess(state, hidden_states),
    )
    return out


OWN_PAGING[GPT_OSS] = (servable, page)
