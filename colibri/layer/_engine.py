"""The expert engine: one MoE layer's routed experts, from the routing result to their sum.

::

    ids [T, k], weights [T, k] ──plan──► each active expert's assignments (stable, ascending)
        │
        ├─ read ahead: the step's later chunks, then the next layer's guess (store.advise)
        ├─ load chunks of at most store.capacity experts (halved while the store is short)
        │     per expert: rows <= KERNEL_MAX_ROWS and float16/bfloat16 weights, or rows
        │                 <= QUANT_KERNEL_MAX_ROWS and block-quantized weights (q4_k, ...),
        │                 or rows <= FP8_KERNEL_MAX_ROWS and float8 block-scaled weights
        │                    ──► the fused kernel: every such expert of a chunk in one call
        │                        per kind, weighted sums added in ascending expert order
        │                        (float32; quantized: on q8 activations)
        │                 otherwise ──► the front end's fallback (torch, jax; quantized
        │                        and float8 weights dequantized to float32 first), which adds
        │                        them to its own output, or numpy (BLAS) into expert-ordered
        │                        rows, combined at the end in fixed k order
        ▼
    y [T, H]: what colibri computed, for the front end to add to its own

Every front end (:class:`colibri.MoELayer`, the transformers integration) runs its experts
through :func:`run_experts`; what they add is converting tensors once and, optionally, a
fallback in their own framework and a guess of the next layer's experts. The result does not
depend on the budget, the chunking or the thread count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate
from typing import Protocol

import numpy as np

from colibri._errors import BudgetError, FormatError
from colibri.formats import FP8_BLOCKED, ExpertWeights
from colibri.layer import _ffn, _fp8, _quant, _rows
from colibri.layer._expert import (
    FP8_KERNEL_MAX_ROWS,
    KERNEL_ACTIVATIONS,
    KERNEL_KINDS,
    QUANT_KERNEL_MAX_ROWS,
    dequantized,
    fp8_nonfinite,
    fp8_parts,
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
    *,
    num_experts: int,
    activation: str | Callable = "silu",
    num_threads: int = 0,
    fallback: Fallback | None = None,
    kernel: bool = True,
    read_ahead: bool = True,
    next_layer: NextLayer | None = None,
) -> np.ndarray | None:
    """One MoE layer's routed experts: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.

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
    num_experts : int
        ``E``; an id in ``[E, ...)`` raises ``ValueError`` naming the token.
    activation : str or callable
        The gate activation (``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"relu"``, or a callable
        on float numpy arrays, which the fused kernel cannot take).
    num_threads : int
        Threads of colibri's kernels (0: colibri's default).
    fallback : Fallback, optional
        Computes the experts the fused kernel does not take and adds them to the front end's
        own output; default: numpy (BLAS), into the result.
    kernel : bool
        False: no expert takes the fused kernel (nor with ``COLIBRI_EXPERT_KERNEL=0``).
    read_ahead : bool
        Hand the experts of a step's later chunks to ``store.advise`` before loading the
        first one, so that they are read while earlier chunks compute.
    next_layer : callable, optional
        Called once the step's first chunk is resident (after this layer's own reads were
        asked for): the next layer's likely experts, which go to ``store.advise``.

    Returns
    -------
    y : [T, H] or None
        The weighted sum of the experts colibri computed: those of the fused kernel (float32,
        added in ascending expert order) and, without a ``fallback``, the others (``x``'s
        dtype, combined in fixed k order). None when every expert went to the fallback.

    Raises
    ------
    BudgetError
        The store cannot hold even one expert now.
    ValueError
        A wrong argument, or an id outside ``[0, E)`` other than a negative one; the message
        names it.
    """
    T, k = _check(x, ids, weights)
    plan = _Plan(ids, num_experts, num_threads)
    active = plan.active
    kernel_act = None
    if kernel and isinstance(activation, str) and x.dtype == np.float32 and kernel_enabled():
        kernel_act = KERNEL_ACTIVATIONS.get(activation)
    sums = _Sums(x, weights, plan, fallback is None, num_threads)
    sums.layer = layer
    chunk = max(1, min(int(store.capacity), len(active)))
    if read_ahead and chunk < len(active):  # read while the first chunks compute
        store.advise(layer, active[chunk:])
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
                _run_chunk(batch, part, sums, activation, kernel_act, fallback)
            finally:
                del batch  # no view of the chunk outlives it: the store may reuse its slots
        start += len(part)
    return sums.result()


def _check(x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> tuple:
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
        or not weights.flags.c_contiguous
    ):
        raise ValueError(
            f"run_experts(): weights must be C-contiguous float32 {list(ids.shape)} like ids "
            f"(got {getattr(weights, 'dtype', type(weights).__name__)} of shape "
            f"{np.shape(weights)})"
        )
    return ids.shape


class _Plan:
    """Each active expert's assignments ``a = t * k + j``, grouped by expert in ascending id
    order, token order within an expert (``_rows.build_plan``: a stable counting sort), and
    where each assignment's row is (``inverse``)."""

    __slots__ = ("active", "counts", "inverse", "k", "offsets", "sorted")

    def __init__(self, ids: np.ndarray, num_experts: int, num_threads: int) -> None:
        ids = np.ascontiguousarray(ids)
        if ids.dtype not in (np.int32, np.int64):
            ids = ids.astype(np.int64)
        buckets = num_experts
        if ids.size and ids.min() < 0:  # no expert: a bucket of its own, never run
            ids = np.where(ids < 0, num_experts, ids)
            buckets += 1
        n = ids.size
        self.k = ids.shape[1]
        self.counts = np.empty(buckets, np.int64)
        self.offsets = np.empty(buckets + 1, np.int64)
        self.sorted = np.empty(n, np.int64)
        self.inverse = np.empty(n, np.int64)
        _rows.build_plan(ids, buckets, 1, _rows.resolve_threads(num_threads or None),
                         self.counts, self.offsets, self.sorted, self.inverse)  # fmt: skip
        self.active = np.flatnonzero(self.counts[:num_experts])

    def rows(self, expert: int) -> slice:
        """Where ``expert``'s assignments are in ``sorted`` (its rows in expert order)."""
        start = int(self.offsets[expert])
        return slice(start, start + int(self.counts[expert]))


class _Sums:
    """What colibri computes of a layer, kept so that no chunking changes a bit: the fused
    kernel's weighted sums (float32, added in ascending expert order) and the numpy experts'
    outputs in expert order (combined in fixed k order at the end)."""

    def __init__(self, x, weights, plan, numpy_experts, num_threads) -> None:
        self.x, self.weights, self.plan, self.num_threads = x, weights, plan, num_threads
        self.flat_weights = weights.reshape(-1)
        self.numpy_experts = numpy_experts  # no fallback: the others are colibri's too
        self.fused: np.ndarray | None = None
        self.rows: np.ndarray | None = None  # [T * k, H] numpy experts' outputs, expert order
        self.layer = 0  # for messages

    def fuse(self, group: list, act: str) -> None:
        """Every decode-size expert of a chunk in one fused-kernel call per kind: a half
        precision (an int) or a pair of quantized types (gate/up's, down's)."""
        if self.fused is None:
            self.fused = np.zeros(self.x.shape, np.float32)
        k = self.plan.k
        for kind in sorted({f[1] for f in group}, key=str):
            same = [f for f in group if f[1] == kind]
            assignments = np.concatenate([f[2] for f in same])
            bounds = np.fromiter(accumulate((len(f[2]) for f in same), initial=0), np.int64)
            mats, rows = [f[0] for f in same], assignments // k
            scale = self.flat_weights[assignments]
            if kind == FP8_BLOCKED:
                _fp8.ffn_sum(self.x, mats, act, bounds, rows, scale, self.fused,
                             self.num_threads)  # fmt: skip
                if not np.isfinite(self.fused[rows]).all() and np.isfinite(self.x[rows]).all():
                    for parts, _, _, e in same:  # a corrupt file: name the expert
                        fp8_nonfinite(parts, f"layer {self.layer} expert {e}")
            elif isinstance(kind, tuple):
                _quant.ffn_sum(self.x, mats, kind[0], act, bounds, rows, scale, self.fused,
                               self.num_threads, down_type=kind[1])  # fmt: skip
                _check_finite(self.x, self.fused, rows, same)
            else:
                _ffn.ffn_sum(self.x, mats, kind, _ffn.ACTIVATIONS[act], bounds, rows, scale,
                             self.fused, self.num_threads)  # fmt: skip

    def compute(self, expert: ExpertWeights, rows: slice, activation) -> None:
        """One expert in numpy (BLAS; float16/bfloat16 weights through the kernel up to its
        capacity), into its rows in expert order."""
        if self.rows is None:
            self.rows = np.zeros((self.plan.sorted.size, self.x.shape[1]), self.x.dtype)
        tokens = self.plan.sorted[rows] // self.plan.k
        self.rows[rows] = gated_ffn(self.x[tokens], expert, activation,
                                    num_threads=self.num_threads)  # fmt: skip

    def result(self) -> np.ndarray | None:
        combined = None
        if self.rows is not None:
            combined = np.empty_like(self.x)
            _rows.combine_rows(self.rows, _rows.KIND_PLAIN, self.plan.inverse, self.weights,
                               _rows.resolve_threads(self.num_threads or None), combined,
                               _rows.KIND_PLAIN)  # fmt: skip
        if self.fused is None:
            return combined
        if combined is not None:
            self.fused += combined
        return self.fused


def _run_chunk(batch, part, sums: _Sums, activation, kernel_act, fallback) -> None:
    """One loaded chunk: decode-size experts in one fused-kernel call, the rest one by one."""
    plan = sums.plan
    fused = []
    for e in part:
        e = int(e)
        expert = batch[e]
        rows = plan.rows(e)
        n = rows.stop - rows.start
        bits = None
        dtype = getattr(expert, "dtype", None)  # None: an expert_fn
        quantized = dtype in _quant.TYPES or dtype == FP8_BLOCKED
        if dtype in _quant.TYPES and kernel_act is not None and n <= QUANT_KERNEL_MAX_ROWS:
            kind = (expert.dtype, expert.down_dtype)
            fused.append((tuple(expert), kind, plan.sorted[rows], e))
            continue
        if dtype == FP8_BLOCKED and kernel_act is not None and n <= FP8_KERNEL_MAX_ROWS:
            fused.append((fp8_parts(expert), FP8_BLOCKED, plan.sorted[rows], e))
            continue
        if kernel_act is not None and n <= KERNEL_MAX_ROWS:
            bits = _kernel_bits(expert)
        if bits is not None:
            fused.append((bits, KERNEL_KINDS[expert.dtype], plan.sorted[rows]))
        elif fallback is not None:
            assignments = plan.sorted[rows]
            where = f"layer {sums.layer} expert {e}"
            fallback(e, dequantized(expert, where) if quantized else expert,
                     assignments // plan.k, assignments)  # fmt: skip
        else:
            sums.compute(expert, rows, activation)
    if fused:
        sums.fuse(fused, kernel_act)


def _check_finite(x: np.ndarray, y: np.ndarray, rows: np.ndarray, group: list) -> None:
    """Quantized experts gave non-finite sums from finite rows: name the expert whose block
    scales are not finite numbers (a corrupt file) instead of returning NaN."""
    if np.isfinite(y[rows].sum()) or not np.isfinite(x[rows]).all():  # sum: one pass, no mask
        return
    for mats, (qtype, down_type), _, e in group:
        types = (qtype, qtype, down_type)
        for name, m, t in zip(("gate", "up", "down"), mats, types, strict=True):
            bad = _quant.nonfinite_block(t, m)
            if bad >= 0:
                raise FormatError(
                    f"expert {e}: its {name} weights hold a non-finite {t} block scale (row "
                    f"{bad // m.shape[1]}, byte {bad % m.shape[1]}): the weight file is corrupt"
                )


def _kernel_bits(expert: ExpertWeights) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The expert's matrices as uint16 bits for the fused kernel, None unless it stores
    float16 or bfloat16 with contiguous rows."""
    if expert.dtype not in KERNEL_KINDS:
        return None
    bits = tuple(half_bits(m) for m in expert)
    if any(b.ndim != 2 or (b.shape[1] > 1 and b.strides[1] != 2) for b in bits):
        return None
    return bits
