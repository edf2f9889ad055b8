"""gpt-oss's experts paged: transformers' ``GptOssExperts`` computed on what the pager serves.

gpt-oss's experts are unlike every other family's (see :mod:`colibri.formats.gpt_oss` for
how they are stored, plain or MXFP4): one fused ``gate_up`` projection with gate and up
interleaved, biases, and a clamped SwiGLU::

    h = x @ gate_up + gate_up_bias                      # [n, 2I]
    gate, up = h[:, ::2].clamp(max=limit), h[:, 1::2].clamp(-limit, limit)
    y = ((up + 1) * gate * sigmoid(alpha * gate)) @ down + down_bias

Each paged expert is read from the checkpoint as stored (MXFP4 blocks and scales, or the plain
dtype). An MXFP4 expert with at most ``QUANT_KERNEL_MAX_ROWS`` rows (decode) runs in colibri's
fused kernel (``include/colibri/qffn.h``, ``mxfp4_oss``: the blocks and scales read as paged, x
and h as q8 rows, float32 sums, the SwiGLU and biases fused), as GGUF experts do; within a
q8 bound of the float reference, not transformers' bits. Larger MXFP4 batches, plain experts
and ``COLIBRI_EXPERT_KERNEL=0`` go through torch, in the model's dtype, exactly as
``GptOssExperts.forward`` computes them (MXFP4 dequantized to float32 first, exact, the
interleave kept). The biases are resident (loaded with the non-expert tensors into the
module). An e8m0 scale byte 0xFF (NaN) is a :class:`~colibri.formats.FormatError` naming the
expert, on either path.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from colibri.formats.gpt_oss import GptOssLayout, GptOssWeights, check_scales, dequantize_mxfp4
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
from colibri.layer import QUANT_KERNEL_MAX_ROWS, gpt_oss_experts, run_experts

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


def _matrices(
    w: GptOssWeights, like: torch.Tensor, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [H, 2I]`` and ``down [I, H]`` in ``like``'s dtype (``x @ W``), as
    transformers holds them: MXFP4 dequantized (a copy), plain ones viewed where they can."""
    if w.gate_up_scales is not None:
        gate_up = dequantize_mxfp4(w.gate_up, w.gate_up_scales, f"{where} gate_up_proj_scales")
        down = dequantize_mxfp4(w.down, w.down_scales, f"{where} down_proj_scales")  # [H, I]
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
    x_np = hidden_states.detach().float().numpy()
    weights_np = weights.detach().float().numpy()
    fused: list[np.ndarray] = []  # the kernel's sums, once it has run

    def compute(e: int, w: GptOssWeights, tokens: np.ndarray, assignments: np.ndarray) -> None:
        where = f"layer {state.layer} expert {e}"
        mxfp4 = w.gate_up_scales is not None
        if mxfp4 and len(tokens) <= QUANT_KERNEL_MAX_ROWS:
            scale = weights_np[tokens, assignments % ids.shape[1]]
            sums = fused[0] if fused else np.zeros_like(x_np)
            if _fused(self, state, e, w, x_np, tokens, scale, sums, where):
                fused[:] = [sums]
                return
        token_t = torch.from_numpy(tokens)
        slot_t = torch.from_numpy(assignments % ids.shape[1])
        x_e = hidden_states[token_t]
        gate_up, down = _matrices(w, x_e, where)
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
        x_np,
        ids_np,
        weights_np,
        num_experts=state.num_experts,
        num_threads=paging.num_threads,
        fallback=compute,
        kernel=False,  # the engine knows no gpt-oss experts: compute() picks kernel or torch
        read_ahead=paging.read_ahead != "off",
        next_layer=next_guess(state, hidden_states),
    )
    if fused:
        out += torch.from_numpy(fused[0]).to(out.dtype)
    return out


def _fused(
    module: nn.Module,
    state: _GptOssLayer,
    e: int,
    w: GptOssWeights,
    x: np.ndarray,
    tokens: np.ndarray,
    scale: np.ndarray,
    y: np.ndarray,
    where: str,
) -> bool:
    """``y[tokens] += scale[:, None] * expert_e(x[tokens])`` for an MXFP4 expert, in colibri's
    fused kernel (``x``, ``y`` float32 ``[T, H]``; ``tokens`` int64, ``scale`` float32 ``[n]``);
    False where ``COLIBRI_EXPERT_KERNEL=0`` rules the kernel out (nothing computed).

    Raises
    ------
    FormatError
        The expert's sums are not finite from finite ``x``, and an e8m0 scale byte is 0xFF.
    """
    hidden, inter2 = x.shape[1], w.gate_up.shape[0]
    expert = (
        w.gate_up.reshape(inter2, -1),
        w.gate_up_scales,
        module.gate_up_proj_bias[e].detach().float().numpy(),
        w.down.reshape(hidden, -1),
        w.down_scales,
        module.down_proj_bias[e].detach().float().numpy(),
    )
    n = len(tokens)
    if not gpt_oss_experts(x, [expert], np.array([0, n], np.int64),
                           np.ascontiguousarray(tokens, np.int64),
                           np.ascontiguousarray(scale, np.float32), y, alpha=state.alpha,
                           limit=state.limit, num_threads=state.paging.num_threads):  # fmt: skip
        return False
    if not np.isfinite(y[tokens]).all() and np.isfinite(x[tokens]).all():
        check_scales(w.gate_up_scales, f"{where} gate_up_proj_scales")
        check_scales(w.down_scales, f"{where} down_proj_scales")
    return True


OWN_PAGING[GPT_OSS] = (servable, page)
