"""One layer's experts split by rank and put back together bit for bit as one process would.

One process (:func:`colibri.integrations.transformers._experts.experts_forward`) sums a
token's experts in two accumulators, each in ascending expert order: the fused kernel's
experts in float32 (``y += w * f_e(x)``, no fused multiply-add), the others (torch GEMMs) in
the model's dtype (``out.index_add_(w * f_e(x))``), then ``out += y``. Floating-point sums
depend on their order, so ranks do not send partial sums: each rank computes every row it is
sent with its own expert at weight 1 (which :func:`colibri.layer.run_experts` and the torch
path compute bit for bit as with any weight: ``0 + 1 * f = f``), and rank 0 replays both
accumulations in ascending expert order (:func:`combine`). The tokens are then identical to
one process's on the same machine; across machines with different CPUs the GEMMs of the
torch path (prefill rows) may round differently, as they would on those machines alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from colibri.layer import run_experts

__all__ = ["Rows", "combine", "compute", "split"]

_KERNEL_DTYPES = {torch.bfloat16, torch.float16}


@dataclass(frozen=True)
class Rows:
    """A layer's routed assignments in ascending expert order, token order within an expert.

    Attributes
    ----------
    assignments : [N] int64
        ``t * k + j`` of each row.
    experts : [N] int64
        The expert of each row (ascending).
    k : int
        Choices per token.
    """

    assignments: np.ndarray
    experts: np.ndarray
    k: int

    @property
    def tokens(self) -> np.ndarray:
        return self.assignments // self.k


def split(ids: np.ndarray) -> Rows:
    """The :class:`Rows` of routing ids ``[T, k]`` (negative ids: no expert)."""
    flat = ids.reshape(-1)
    valid = np.flatnonzero(flat >= 0)
    order = valid[np.argsort(flat[valid], kind="stable")]
    return Rows(order.astype(np.int64), flat[order].astype(np.int64), max(ids.shape[1], 1))


def compute(
    pager,
    layer: int,
    x: torch.Tensor,
    experts: np.ndarray,
    *,
    torch_path: Callable,
    kernel_activation: str | None,
    num_experts: int,
    num_threads: int = 0,
    read_ahead: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Each row of ``x`` through its expert, unweighted, as one process computes it.

    Parameters
    ----------
    pager : colibri.Pager
        Serves the experts (of ``layer``) named in ``experts``.
    x : [N, H] torch tensor, the model's dtype
        The rows, grouped by expert in ascending order.
    experts : [N] int64
        The expert of each row.
    torch_path : callable
        ``(expert weights, x [n, H]) -> [n, H]``: one expert in torch, as one process
        computes the experts the fused kernel does not take.
    kernel_activation : str or None
        The fused kernel's name for it (None: no expert takes the kernel).

    Returns
    -------
    y : [N, H] float32
        ``f_e(x)`` per row.
    torch_path : [N] bool
        Rows the torch path computed (their ``y`` is exact in the model's dtype).
    """
    n, hidden = x.shape
    y = np.zeros((n, hidden), np.float32)
    took = np.zeros(n, bool)
    if n == 0:
        return y, took

    def fallback(e: int, w, rows: np.ndarray, assignments: np.ndarray) -> None:
        y[rows] = torch_path(w, x[torch.from_numpy(rows)]).float().numpy()
        took[rows] = True

    sums = run_experts(
        pager,
        layer,
        np.ascontiguousarray(x.detach().float().numpy()),
        experts.reshape(-1, 1),
        np.ones((n, 1), np.float32),
        num_experts=num_experts,
        activation=kernel_activation or "silu",
        num_threads=num_threads,
        fallback=fallback,
        kernel=kernel_activation is not None and x.dtype in _KERNEL_DTYPES,
        read_ahead=read_ahead,
    )
    if sums is not None:
        y[~took] = sums[~took]
    return y, took


def combine(
    hidden_states: torch.Tensor,
    weights: torch.Tensor,
    rows: Rows,
    y: np.ndarray,
    torch_path: np.ndarray,
) -> torch.Tensor:
    """``[T, H]`` in ``hidden_states``' dtype: the weighted experts summed as one process sums
    them (see the module's docstring); ``y``, ``torch_path`` as :func:`compute` gives them,
    for every row of ``rows``. ``weights``: the routing weights ``[T, k]``."""
    out = torch.zeros_like(hidden_states)
    fused = None
    flat_w = weights.detach().float().numpy().reshape(-1)
    starts = np.flatnonzero(np.r_[True, rows.experts[1:] != rows.experts[:-1]])
    bounds = np.r_[starts, rows.experts.size]
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        a = rows.assignments[start:stop]
        tokens = a // rows.k
        if torch_path[start]:
            token_t = torch.from_numpy(tokens)
            h = torch.from_numpy(y[start:stop]).to(hidden_states.dtype)
            scale = weights[token_t, torch.from_numpy(a % rows.k), None]
            out.index_add_(0, token_t, (h * scale).to(out.dtype))
        else:
            if fused is None:
                fused = np.zeros(hidden_states.shape, np.float32)
            fused[tokens] += flat_w[a, None] * y[start:stop]
    if fused is not None:
        out += torch.from_numpy(fused).to(out.dtype)
    return out
