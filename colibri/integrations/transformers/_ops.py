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

import torch

__all__ = ["experts", "handle", "lookup", "route"]

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


@torch.library.custom_op("colibri::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """``x @ weight.T + bias`` on colibri's linear kernel (``_linears.compute``): ``x``
    ``[..., in]``, ``weight`` ``[out, in]`` bfloat16/float16; ``[..., out]`` in ``x``'s dtype."""
    from colibri.integrations.transformers._linears import compute

    return compute(x, weight, bias, num_threads)


@_linear_op.register_fake
def _(x, weight, bias, num_threads):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
