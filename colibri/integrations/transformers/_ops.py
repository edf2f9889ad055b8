"""colibri's routing and paged experts as torch custom operators, for compiled graphs.

``torch.compile`` cannot trace colibri's routing (Cython on numpy views) or the pager's
experts (numpy, Python state, file reads); as custom operators they are opaque nodes of the
graph, run eagerly by the compiled code, with fake (meta) implementations giving dynamo and
inductor their output shapes and dtypes. Custom operators take only tensors and scalars, so
the routing state (a patched router's ``_Routing``) and the paged experts module are found
from an integer handle in a registry of weak references: a freed model frees its entries,
and a handle that outlives them raises a clear error.

Eager calls do not go through the operators (their dispatch costs more than the tiny
layers' routing itself); :func:`torch.compiler.is_compiling` picks them while tracing.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import numpy as np
import torch

from colibri.layer import half_linear, quant_linear

__all__ = ["bits_of", "compute", "compute_quantized", "experts", "handle", "lookup", "route"]

_REGISTRY: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def handle(obj: Any) -> int:
    """Register ``obj`` (held by a weak reference) and return its new handle.

    Parameters
    ----------
    obj : object
        A patched router's routing state or a paged experts module.

    Returns
    -------
    int
        A positive handle, never reused in this process.
    """
    number = next(_NEXT)
    _REGISTRY[number] = obj
    return number


def lookup(number: int, what: str) -> Any:
    """The object registered under handle ``number``.

    Raises
    ------
    RuntimeError
        The object was freed (its model was deleted) or the handle was never issued.
    """
    obj = _REGISTRY.get(number)
    if obj is None:
        raise RuntimeError(
            f"colibri::{what}: handle {number} names no live colibri {what} state (its model "
            "was freed, or the handle comes from another process); compile the model you run "
            "again, from a model that is alive"
        )
    return obj


# -- routing ------------------------------------------------------------------------------

_TENSOR_OPTIONS = ("correction_bias", "expert_scale")  # the operator's optional arguments


@torch.library.custom_op("colibri::route", mutates_args=())
def _route_op(
    logits: torch.Tensor,
    handle: int,
    correction_bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    routing = lookup(handle, "route")
    given = {
        name: tensor
        for name, tensor in zip(_TENSOR_OPTIONS, (correction_bias, expert_scale), strict=True)
        if tensor is not None
    }
    return routing.context(given).route(logits.detach())


@_route_op.register_fake
def _(logits, handle, correction_bias=None, expert_scale=None):
    k = lookup(handle, "route").top_k
    shape = (logits.shape[0], k)
    return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape, dtype=torch.float32)


def route(
    number: int, logits: torch.Tensor, live: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``colibri::route``: route ``[T, E]`` logits with the routing state of handle ``number``.

    Parameters
    ----------
    number : int
        The handle of a patched router's routing state (``_Routing.handle``).
    logits : torch.Tensor
        ``[T, E]`` router logits on the CPU, any float dtype.
    live : dict
        The tensor options read now (``correction_bias``, ``expert_scale``: ``[E]``); the
        context is rebuilt when one of them changed, as in eager calls.

    Returns
    -------
    ids : torch.Tensor
        ``[T, k]`` int64, each row by descending score.
    weights : torch.Tensor
        ``[T, k]`` float32.
    """
    unknown = set(live) - set(_TENSOR_OPTIONS)
    if unknown:  # a new family's tensor option: the operator's schema must name it
        raise NotImplementedError(
            f"colibri::route takes the tensor options {_TENSOR_OPTIONS}, not {sorted(unknown)}"
        )
    return torch.ops.colibri.route(logits, number, *(live.get(name) for name in _TENSOR_OPTIONS))


# -- paged experts ------------------------------------------------------------------------


@torch.library.custom_op("colibri::experts", mutates_args=())
def _experts_op(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, handle: int
) -> torch.Tensor:
    # the module's own forward (transformers' dispatch to colibri's, eager here), no hooks
    return lookup(handle, "experts").forward(hidden, ids, weights)


@_experts_op.register_fake
def _(hidden, ids, weights, handle):
    return torch.empty_like(hidden)


def experts(
    number: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``colibri::experts``: the paged experts module of handle ``number`` on ``hidden``.

    Parameters
    ----------
    number : int
        The handle of a paged experts module (``_Layer.handle``).
    hidden : torch.Tensor
        ``[T, H]`` hidden states, the model's dtype.
    ids : torch.Tensor
        ``[T, k]`` int64 expert ids (out-of-range ids: no expert).
    weights : torch.Tensor
        ``[T, k]`` routing weights.

    Returns
    -------
    torch.Tensor
        ``[T, H]``, ``hidden``'s dtype: the weighted sum of each token's experts. The pager
        serves the experts under its budget; the read-ahead guesses the next layer's.
    """
    return torch.ops.colibri.experts(hidden, ids, weights, number)


# -- non-expert linears -------------------------------------------------------------------


#: The half precisions colibri's kernels take as bits, by torch dtype: their names.
HALF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def bits_of(weight: torch.Tensor) -> np.ndarray:
    """The uint16 bits of a half-precision tensor (a view, no copy)."""
    return weight.detach().view(torch.uint16).numpy()


def values_of(t: torch.Tensor) -> np.ndarray:
    """``t`` as colibri's kernels read it, no copy: float32 as is, half types as bits."""
    return t.detach().numpy() if t.dtype == torch.float32 else bits_of(t)


def compute(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_threads: int,
    bits: np.ndarray | None = None,
    bias32: np.ndarray | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` on colibri's kernel.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., in]`` on the CPU, any float dtype.
    weight : torch.Tensor
        ``[out, in]`` bfloat16 or float16, rows contiguous, on the CPU.
    bias : torch.Tensor or None
        ``[out]``, added in float32.
    num_threads : int
        colibri's threads (0: colibri's default).
    bits, bias32 : numpy.ndarray, optional
        ``weight``'s uint16 bits and ``bias`` as float32, when the caller holds them.

    Returns
    -------
    torch.Tensor
        ``[..., out]``, ``x``'s dtype (float32 accumulation, rounded once).
    """
    if bits is None:
        bits = bits_of(weight)
    if bias32 is None and bias is not None:
        bias32 = bias.detach().to(torch.float32).numpy()
    rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    dtype = str(weight.dtype).removeprefix("torch.")
    y = torch.from_numpy(half_linear(rows.numpy(), bits, dtype, bias32, num_threads))
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("colibri::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """``x @ weight.T + bias`` on colibri's linear kernel (:func:`compute`): ``x``
    ``[..., in]``, ``weight`` ``[out, in]`` bfloat16/float16; ``[..., out]`` in ``x``'s dtype."""
    return compute(x, weight, bias, num_threads)


@_linear_op.register_fake
def _(x, weight, bias, num_threads):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def compute_quantized(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: str,
    bias32: np.ndarray | None,
    num_threads: int,
) -> torch.Tensor:
    """``x @ W.T + bias`` on colibri's quantized linear kernel, ``W`` as stored.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., in]`` on the CPU, any float dtype.
    blocks : torch.Tensor
        ``[out, row_bytes]`` uint8: ``W``'s rows as whole ``qtype`` blocks, contiguous.
    qtype : str
        The blocks' type (``colibri.layer.quant_linear``'s).
    bias32 : numpy.ndarray or None
        ``[out]`` float32.
    num_threads : int
        colibri's threads (0: colibri's default).

    Returns
    -------
    torch.Tensor
        ``[..., out]``, ``x``'s dtype (float32 accumulation, rounded once).
    """
    rows = x.detach().reshape(-1, x.shape[-1])
    dtype = HALF_NAMES.get(x.dtype)
    if dtype is None:  # float32 (or another float: computed in float32)
        rows = rows.to(torch.float32).contiguous()
        y = quant_linear(rows.numpy(), blocks.numpy(), qtype, bias32, num_threads)
        return torch.from_numpy(y).to(x.dtype).reshape(*x.shape[:-1], blocks.shape[0])
    rows = rows.contiguous()  # half precision in and out as bits: converted in the kernel
    out = rows.new_empty((rows.shape[0], blocks.shape[0]))
    quant_linear(bits_of(rows), blocks.numpy(), qtype, bias32, num_threads, dtype, bits_of(out))
    return out.view(*x.shape[:-1], blocks.shape[0])


@torch.library.custom_op("colibri::quant_linear", mutates_args=())
def _quant_linear_op(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` block-quantized as stored (:func:`compute_quantized`)."""
    bias32 = None if bias is None else bias.detach().to(torch.float32).numpy()
    return compute_quantized(x, blocks, qtype, bias32, num_threads)


@_quant_linear_op.register_fake
def _(x, blocks, qtype, bias, num_threads):
    return x.new_empty((*x.shape[:-1], blocks.shape[0]))
