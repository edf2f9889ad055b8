"""Dispatch and combine: from routing ids to expert-ordered rows and back.

::

    ids [T, k] ──dispatch──► DispatchPlan (counts [E], offsets [E+1],
                                           sorted_assignments [N], inverse [T*k])
    hidden [T, H] ──gather──► rows [N, H] in expert order (expert e owns rows
                                           offsets[e] : offsets[e] + counts[e])
    expert outputs [N, H] ──combine(weights [T, k])──► out [T, H]

An *assignment* is one (token, choice) pair, numbered ``a = t * k + j``. The plan follows
vLLM's ``moe_align_block_size`` / ``moe_permute`` contracts: ``sorted_assignments`` lists the
assignments grouped by expert, in token order within an expert (stable), each expert padded
to a multiple of ``block_size`` with the sentinel ``T * k``; ``inverse[a]`` is the row of
assignment ``a``; ``offsets`` is vLLM's ``expert_first_token_offset``. Everything is
deterministic and independent of the thread count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri._dlpack import bf16_to_float32, import_host, to_caller
from colibri._validate import check_int
from colibri.layer import _rows

__all__ = ["DispatchPlan", "combine", "dispatch", "gather"]

_KINDS = {
    "float32": _rows.KIND_PLAIN,
    "float64": _rows.KIND_PLAIN,
    "float16": _rows.KIND_FLOAT16,
    "bfloat16": _rows.KIND_BFLOAT16,
}
_STORAGE = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "bfloat16": np.uint16,
}


@dataclass(frozen=True)
class DispatchPlan:
    """Where each (token, choice) assignment goes in expert order.

    Attributes
    ----------
    num_tokens, top_k, num_experts, block_size : int
    counts : [E] int64
        Slots routed to each expert.
    offsets : [E + 1] int64
        First row of each expert; ``offsets[E]`` is the number of rows ``N`` (padding
        included).
    sorted_assignments : [N] int64
        Slot ``t * k + j`` of each row; padding rows hold ``T * k``.
    inverse : [T * k] int64
        Row of each assignment.
    """

    num_tokens: int
    top_k: int
    num_experts: int
    block_size: int
    counts: np.ndarray
    offsets: np.ndarray
    sorted_assignments: np.ndarray
    inverse: np.ndarray

    @property
    def num_rows(self) -> int:
        """Rows in expert order, padding included (``N``)."""
        return int(self.offsets[-1])

    @property
    def token_ids(self) -> np.ndarray:
        """[N] int64: the token of each row; padding rows hold ``T``."""
        return self.sorted_assignments // max(self.top_k, 1)

    @property
    def active_experts(self) -> np.ndarray:
        """[A] int64: experts with at least one assignment, ascending."""
        return np.flatnonzero(self.counts)

    @property
    def block_expert_ids(self) -> np.ndarray:
        """[N / block_size] int64: the expert of each block (vLLM's ``expert_ids``)."""
        blocks = (self.offsets[1:] - self.offsets[:-1]) // self.block_size
        return np.repeat(np.arange(self.num_experts, dtype=np.int64), blocks)

    def expert_rows(self, expert: int) -> slice:
        """The rows of ``expert`` (without its padding)."""
        start = int(self.offsets[expert])
        return slice(start, start + int(self.counts[expert]))


def dispatch(
    ids: Any, num_experts: int, *, block_size: int = 1, num_threads: int | None = None
) -> DispatchPlan:
    """Group the assignments of ``ids`` by expert (stable counting sort, parallel).

    Parameters
    ----------
    ids : [T, k] int32 or int64, any DLPack producer
        Routing result: expert id of each token's k choices.
    num_experts : int
        ``E``; every id must lie in ``[0, E)``.
    block_size : int
        Pad each expert's rows to a multiple of this (1: no padding).
    num_threads : int or None
        OpenMP threads (None: OpenMP's default). The result does not depend on it.

    Returns
    -------
    DispatchPlan

    Raises
    ------
    ValueError
        Out-of-range ids (naming the token), wrong shape or dtype, bad sizes.
    """
    arr, name = import_host(ids)
    if name not in ("int32", "int64"):
        raise ValueError(f"dispatch(): ids must be int32 or int64 (got {name})")
    if arr.ndim != 2:
        raise ValueError(f"dispatch(): ids must have shape [T, k] (got shape {arr.shape})")
    num_experts = check_int("dispatch(): num_experts", num_experts, 1)
    block_size = check_int("dispatch(): block_size", block_size, 1)
    threads = _rows.resolve_threads(num_threads)
    arr = np.ascontiguousarray(arr)
    T, k = arr.shape
    n = T * k
    capacity = n + num_experts * (block_size - 1) if block_size > 1 else n
    counts = np.empty(num_experts, np.int64)
    offsets = np.empty(num_experts + 1, np.int64)
    sorted_assignments = np.empty(capacity, np.int64)
    inverse = np.empty(n, np.int64)
    _rows.build_plan(
        arr, num_experts, block_size, threads, counts, offsets, sorted_assignments, inverse
    )
    return DispatchPlan(
        T, k, num_experts, block_size, counts, offsets, sorted_assignments[: offsets[-1]], inverse
    )


def gather(
    hidden: Any,
    plan: DispatchPlan,
    *,
    dtype: str | None = None,
    num_threads: int | None = None,
) -> Any:
    """Copy each assignment's token row into expert order.

    Parameters
    ----------
    hidden : [T, H] float32, float64, float16 or bfloat16, any DLPack producer
    plan : DispatchPlan
    dtype : None or "float32"
        None keeps ``hidden``'s dtype; "float32" converts while gathering.
    num_threads : int or None

    Returns
    -------
    [N, H] in ``hidden``'s framework; padding rows are zero.
    """
    arr, name = import_host(hidden)
    _check_float(name, "gather(): hidden")
    if arr.ndim != 2 or arr.shape[0] != plan.num_tokens:
        raise ValueError(
            f"gather(): hidden must have shape [{plan.num_tokens}, H] to match "
            f"the plan (got {arr.shape})"
        )
    threads = _rows.resolve_threads(num_threads)
    arr = np.ascontiguousarray(arr)
    rows, H = plan.num_rows, arr.shape[1]
    if dtype is None or dtype == name:
        out = np.empty((rows, H), arr.dtype)
        if arr.size and rows:
            _rows.gather_rows(
                arr.view(np.uint8), plan.sorted_assignments, plan.top_k, threads, out.view(np.uint8)
            )
        return to_caller(out, hidden, name)
    if dtype != "float32":
        raise ValueError(f'gather(): dtype must be None or "float32" (got {dtype!r})')
    out = np.empty((rows, H), np.float32)
    _rows.gather_rows_float32(
        _kernel_view(arr), _KINDS[name], plan.sorted_assignments, plan.top_k, threads, out
    )
    return to_caller(out, hidden)


def combine(
    expert_out: Any,
    plan: DispatchPlan,
    weights: Any,
    *,
    dtype: str | None = None,
    out: Any = None,
    num_threads: int | None = None,
) -> Any:
    """Sum each token's k expert outputs times their weights, in fixed k order.

    ``out[t] = sum_j weights[t, j] * expert_out[plan.inverse[t * k + j]]``, accumulated in
    float32 (float64 for float64 inputs) without atomics: deterministic.

    Parameters
    ----------
    expert_out : [N, H] float32, float64, float16 or bfloat16
        Expert outputs in expert order (rows as in ``gather``).
    plan : DispatchPlan
    weights : [T, k] float32 (other float dtypes are converted)
    dtype : str or None
        Output dtype ("float32", "float64", "float16", "bfloat16"); None: ``expert_out``'s.
    out : [T, H] writable array or None
        Buffer to fill (its dtype wins over ``dtype``).
    num_threads : int or None

    Returns
    -------
    [T, H] in ``expert_out``'s framework (or ``out`` itself).
    """
    src, src_name = import_host(expert_out)
    _check_float(src_name, "combine(): expert_out")
    if src.ndim != 2 or src.shape[0] != plan.num_rows:
        raise ValueError(
            f"combine(): expert_out must have shape [{plan.num_rows}, H] to match "
            f"the plan (got {src.shape})"
        )
    w, w_name = import_host(weights)
    _check_float(w_name, "combine(): weights")
    if w.shape != (plan.num_tokens, plan.top_k):
        raise ValueError(
            f"combine(): weights must have shape [{plan.num_tokens}, "
            f"{plan.top_k}] (got {tuple(w.shape)})"
        )
    w = _to_float32(w, w_name)
    threads = _rows.resolve_threads(num_threads)
    src = np.ascontiguousarray(src)
    H = src.shape[1]
    if out is not None:
        dst, dst_name = import_host(out, writable=True)
        _check_float(dst_name, "combine(): out")
        if dst.shape != (plan.num_tokens, H) or not dst.flags.c_contiguous:
            raise ValueError(
                f"combine(): out must be a C-contiguous [{plan.num_tokens}, {H}] "
                f"array (got shape {tuple(dst.shape)})"
            )
        result = out
    else:
        dst_name = src_name if dtype is None else dtype
        _check_float(dst_name, "combine(): dtype")
        dst = np.empty((plan.num_tokens, H), _STORAGE[dst_name])
        result = None
    _rows.combine_rows(
        _kernel_view(src),
        _KINDS[src_name],
        plan.inverse,
        w,
        threads,
        _kernel_view(dst),
        _KINDS[dst_name],
    )
    return result if result is not None else to_caller(dst, expert_out, dst_name)


def _kernel_view(arr: np.ndarray) -> np.ndarray:
    """float16 data reach the kernels as uint16 (Cython has no half type)."""
    return arr.view(np.uint16) if arr.dtype == np.float16 else arr


def _to_float32(arr: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        return bf16_to_float32(arr)
    return np.ascontiguousarray(arr, dtype=np.float32)


def _check_float(name: str, what: str) -> None:
    if name not in _KINDS:
        raise ValueError(f"{what} must be float32, float64, float16 or bfloat16 (got {name})")
