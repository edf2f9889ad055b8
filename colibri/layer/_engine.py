"""The expert engine: one MoE layer's routed experts, from the routing result to the output.

::

    ids [T, k], weights [T, k] ──plan──► each active expert's assignments (stable, ascending)
        │
        ├─ read ahead: the step's later chunks, then the next layer's guess (store.advise)
        ├─ load chunks of at most store.capacity experts (halved while the store is short)
        │     per expert: rows <= KERNEL_MAX_ROWS and float16/bfloat16 weights
        │                    ──► the fused kernel: every such expert of a chunk in one call
        │                 otherwise ──► the front end's fallback (torch, jax) or numpy BLAS
        ▼
    out[t] += weights[t, j] * expert(x[t]), experts in ascending id order

Every front end (:class:`colibri.MoELayer`, the transformers integration) runs its experts
through :func:`run_experts`; what they add is converting tensors once and, optionally, a
fallback in their own framework and a guess of the next layer's experts. The result does not
depend on the budget, the chunking or the thread count: each expert's contribution is added
in ascending expert order, the fused kernel's in float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from colibri._errors import BudgetError
from colibri.formats import ExpertWeights
from colibri.layer import _ffn, _rows
from colibri.layer._expert import (
    KERNEL_ACTIVATIONS,
    KERNEL_KINDS,
    gated_ffn,
    half_bits,
    kernel_enabled,
)

__all__ = ["KERNEL_MAX_ROWS", "ExpertStore", "Fallback", "run_experts"]

#: Rows of one expert up to which the fused kernel computes it; more rows go to the fallback
#: GEMMs, which reuse each weight across rows (bench/bench_kernels.py measures the crossover).
KERNEL_MAX_ROWS = 2


class ExpertStore(Protocol):
    """Where the engine gets expert weights: :class:`colibri.Pager`,
    :class:`colibri.InMemoryExperts`, or your own.

    Attributes
    ----------
    capacity : int
        Experts the store can hold at once; the engine loads a step in chunks of this size.
    slot_bytes : int
        Bytes one resident expert is charged.
    """

    capacity: int
    slot_bytes: int

    def load(
        self, layer: int, expert_ids: Sequence[int]
    ) -> contextlib.AbstractContextManager[Mapping[int, ExpertWeights]]:
        """Make ``expert_ids`` of ``layer`` resident, pinned for the ``with`` block.

        Raises :class:`colibri.BudgetError` when it cannot hold them all now (the engine
        then loads fewer at a time), ``KeyError`` for an expert it does not have.
        """
        ...

    def advise(self, layer: int, expert_ids: Sequence[int]) -> int:
        """Start reading experts likely needed soon without holding them (read-ahead);
        returns how many were handed on. Stores without I/O return 0."""
        ...


#: ``fallback(expert_id, weights, tokens, assignments)``: compute one expert on the rows
#: ``x[tokens]`` in the front end's framework and add ``weights.flat[assignments] * y`` to
#: the front end's own output (``tokens = assignments // k``, both int64 ``[n]``).
Fallback = Callable[[int, ExpertWeights, np.ndarray, np.ndarray], None]
#: ``next_layer()``: the next layer's likely experts, ``(layer, ids)``, or None.
NextLayer = Callable[[], "tuple[int, np.ndarray] | None"]


def run_experts(
    store: ExpertStore,
    layer: int,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    out: np.ndarray,
    *,
    num_experts: int,
    activation: str | Callable = "silu",
    num_threads: int = 0,
    fallback: Fallback | None = None,
    kernel: bool = True,
    read_ahead: bool = True,
    next_layer: NextLayer | None = None,
) -> int:
    """Add one MoE layer's routed experts to ``out``; returns how many the fused kernel ran.

    Parameters
    ----------
    store : ExpertStore
    layer : int
        The layer index passed to ``store``.
    x : [T, H] float32 or float64, C-contiguous
        The layer's input rows.
    ids : [T, k] int32 or int64
        Each row's experts; negative ids choose no expert.
    weights : [T, k] float32
        The routing weight of each choice.
    out : [T, H] like ``x``
        Accumulated into: ``out[t] += weights[t, j] * expert_{ids[t, j]}(x[t])``.
    num_experts : int
        ``E``; an id in ``[E, ...)`` raises ``ValueError`` naming the token.
    activation : str or callable
        The gate activation (``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"relu"``, or a callable
        on float numpy arrays, which the fused kernel cannot take).
    num_threads : int
        Threads of the fused kernel (0: colibri's default).
    fallback : Fallback, optional
        Computes the experts the fused kernel does not take; default: numpy (BLAS) into
        ``out``.
    kernel : bool
        False: every expert goes to the fallback (so does ``COLIBRI_EXPERT_KERNEL=0``).
    read_ahead : bool
        Hand the experts of a step's later chunks to ``store.advise`` before loading the
        first one, so that they are read while earlier chunks compute.
    next_layer : callable, optional
        Called once the step's first chunk is resident (after this layer's own reads were
        asked for): the next layer's likely experts, which go to ``store.advise``.

    Returns
    -------
    int
        Experts the fused kernel computed (into ``out``; the fallback's went where it put
        them).

    Raises
    ------
    BudgetError
        The store cannot hold even one expert now.
    ValueError
        An id outside ``[0, E)`` other than a negative one.
    """
    T, k = _check(x, ids, weights, out)
    plan = _Plan(ids, num_experts, num_threads)
    active = plan.active
    if not len(active):
        return 0
    kernel_act = None
    if kernel and isinstance(activation, str) and x.dtype == np.float32 and kernel_enabled():
        kernel_act = KERNEL_ACTIVATIONS.get(activation)
    chunk = max(1, min(int(store.capacity), len(active)))
    if read_ahead and chunk < len(active):  # read while the first chunks compute
        store.advise(layer, active[chunk:])
    flat_weights = weights.reshape(-1)
    fused = 0
    start = 0
    while start < len(active):
        part = active[start : start + chunk]
        with contextlib.ExitStack() as held:
            try:
                batch = held.enter_context(store.load(layer, part))
            except BudgetError:
                if chunk == 1:
                    raise
                chunk //= 2  # views kept elsewhere hold slots: load fewer at a time
                continue
            try:
                if next_layer is not None:
                    guess, next_layer = next_layer(), None
                    if guess is not None:
                        store.advise(*guess)
                fused += _run_chunk(batch, part, plan, x, k, flat_weights, out, activation,
                                    kernel_act, num_threads, fallback)  # fmt: skip
            finally:
                del batch  # no view of the chunk outlives it: the store may reuse its slots
        start += len(part)
    return fused


def _check(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, out: np.ndarray) -> tuple:
    """``(T, k)``, or a ValueError naming the argument that does not fit."""
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.dtype not in (np.float32, np.float64):
        raise ValueError(
            f"run_experts(): x must be a [T, H] float32 or float64 numpy array (got "
            f"{getattr(x, 'dtype', type(x).__name__)} of shape {np.shape(x)})"
        )
    if not x.flags.c_contiguous:
        raise ValueError("run_experts(): x must be C-contiguous (np.ascontiguousarray(x))")
    if (
        not isinstance(ids, np.ndarray)
        or ids.ndim != 2
        or ids.shape[0] != x.shape[0]
        or ids.dtype.kind not in "iu"
    ):
        raise ValueError(
            f"run_experts(): ids must be an integer [{x.shape[0]}, k] numpy array (got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {np.shape(ids)})"
        )
    if (
        not isinstance(weights, np.ndarray)
        or weights.shape != ids.shape
        or weights.dtype != np.float32
    ):
        raise ValueError(
            f"run_experts(): weights must be float32 {list(ids.shape)} like ids (got "
            f"{np.asarray(weights).dtype} of shape {np.shape(weights)})"
        )
    if (
        not isinstance(out, np.ndarray)
        or out.shape != x.shape
        or out.dtype != x.dtype
        or not out.flags.writeable
        or not out.flags.c_contiguous
    ):
        raise ValueError(
            f"run_experts(): out must be a writable C-contiguous {x.dtype} array of shape "
            f"{list(x.shape)} like x (got {getattr(out, 'dtype', type(out).__name__)} of "
            f"shape {np.shape(out)})"
        )
    return ids.shape


def _run_chunk(batch, part, plan, x, k, flat_weights, out, activation, kernel_act, num_threads,
               fallback) -> int:  # fmt: skip
    """One loaded chunk: decode-size experts in one fused-kernel call, the rest one by one."""
    fused = []
    for e in part:
        e = int(e)
        expert = batch[e]
        assignments = plan.assignments(e)
        bits = None
        if kernel_act is not None and len(assignments) <= KERNEL_MAX_ROWS:
            bits = _kernel_bits(expert)
        if bits is not None:
            fused.append((bits, KERNEL_KINDS[expert.dtype], assignments))
        elif fallback is not None:
            fallback(e, expert, assignments // k, assignments)
        else:
            _numpy_expert(x, expert, assignments, k, flat_weights, out, activation, num_threads)
    if fused:
        _fused_sum(x, fused, k, flat_weights, out, kernel_act, num_threads)
    return len(fused)


class _Plan:
    """Each active expert's assignments ``a = t * k + j``, grouped by expert in ascending id
    order, token order within an expert (``_rows.build_plan``: a stable counting sort)."""

    __slots__ = ("active", "counts", "offsets", "sorted")

    def __init__(self, ids: np.ndarray, num_experts: int, num_threads: int) -> None:
        ids = np.ascontiguousarray(ids)
        if ids.dtype not in (np.int32, np.int64):
            ids = ids.astype(np.int64)
        buckets = num_experts
        if ids.size and ids.min() < 0:  # no expert: a bucket of its own, never run
            ids = np.where(ids < 0, num_experts, ids)
            buckets += 1
        n = ids.size
        self.counts = np.empty(buckets, np.int64)
        self.offsets = np.empty(buckets + 1, np.int64)
        self.sorted = np.empty(n, np.int64)
        _rows.build_plan(ids, buckets, 1, _rows.resolve_threads(num_threads or None),
                         self.counts, self.offsets, self.sorted, np.empty(n, np.int64))  # fmt: skip
        self.active = np.flatnonzero(self.counts[:num_experts])

    def assignments(self, expert: int) -> np.ndarray:
        start = self.offsets[expert]
        return self.sorted[start : start + self.counts[expert]]


def _kernel_bits(expert: ExpertWeights) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The expert's matrices as uint16 bits for the fused kernel, None unless it stores
    float16 or bfloat16 with contiguous rows."""
    if expert.dtype not in KERNEL_KINDS:
        return None
    bits = tuple(half_bits(m) for m in expert)
    if any(b.ndim != 2 or (b.shape[1] > 1 and b.strides[1] != 2) for b in bits):
        return None
    return bits


def _fused_sum(x, fused, k, flat_weights, out, act, num_threads) -> None:
    """Every decode-size expert of a chunk in one fused-kernel call (one kind per call)."""
    for kind in sorted({f[1] for f in fused}):
        group = [f for f in fused if f[1] == kind]
        assignments = np.concatenate([f[2] for f in group])
        bounds = np.zeros(len(group) + 1, np.int64)
        np.cumsum([len(f[2]) for f in group], out=bounds[1:])
        _ffn.ffn_sum(x, [f[0] for f in group], kind, _ffn.ACTIVATIONS[act], bounds,
                     assignments // k, flat_weights[assignments], out, num_threads)  # fmt: skip


def _numpy_expert(x, expert, assignments, k, flat_weights, out, activation, num_threads) -> None:
    """The default fallback: numpy (BLAS) GEMMs in ``x``'s dtype, added into ``out``."""
    tokens = assignments // k
    y = gated_ffn(x[tokens], expert, activation, num_threads=num_threads)
    y *= flat_weights[assignments, None]
    if len(tokens) > 1 and np.any(tokens[1:] == tokens[:-1]):  # a router that repeats
        np.add.at(out, tokens, y)
    else:
        out[tokens] += y
