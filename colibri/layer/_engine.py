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

When the budget holds every expert, :class:`HeldExperts` keeps each layer's experts once
loaded and runs a step with no load: the same plan and kernel calls (for block-quantized
experts, the whole step in one native call), the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate
from typing import Any, Protocol

import numpy as np

from colibri._errors import BudgetError, FormatError
from colibri.formats import FP8_BLOCKED, ExpertWeights
from colibri.layer import _ffn, _fp8, _quant, _rows
from colibri.layer._expert import (
    FP8_KERNEL_MAX_ROWS,
    KERNEL_ACTIVATIONS,
    KERNEL_KINDS,
    NATIVE_HALF,
    QUANT_KERNEL_MAX_ROWS,
    VALUE_KINDS,
    compute_rows,
    dequantized,
    fp8_nonfinite,
    fp8_parts,
    gated_ffn,
    half_bits,
    kernel_enabled,
    round_to,
    runs,
)

__all__ = ["KERNEL_MAX_ROWS", "ExpertStore", "Fallback", "HeldExperts", "run_experts"]

#: Rows of one float16 or bfloat16 expert up to which the fused kernel computes it, by weight
#: dtype; more rows go to the fallback GEMMs, which reuse each weight across rows. Where the
#: CPU computes bfloat16 natively (:data:`NATIVE_HALF`: oneDNN's AMX or AVX512_BF16 GEMMs)
#: they win from 4 rows on, so 2; elsewhere, and for float16 everywhere, the kernel's rows a
#: call, 64. torch's GEMMs of bfloat16 without native support, or of float16 on any CPU
#: without native float16, read ~1 GB/s (an expert of 1024 x 1280 on a 2-core Zen 3: 6.1
#: ms at 64 rows, torch 24.8); float16 with AVX512_FP16 (no AMX for it) takes over from the
#: kernel at ~14 rows in a lone linear, yet a 256-token float16 prompt of the demo's shape
#: ran 0.85-1.04 s with every expert on the kernel against 1.38-1.40 s from 2 rows on (2-core
#: Sapphire Rapids; bench/bench_kernels.py measures the crossover).
KERNEL_MAX_ROWS = {
    "float16": _ffn.MAX_ROWS,
    "bfloat16": 2 if "bfloat16" in NATIVE_HALF else _ffn.MAX_ROWS,
}


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


class HeldExperts:
    """One layer's experts held resident across steps: each is loaded from ``store`` once and
    kept (its views pin it), and a step whose experts all take the fused kernel computes
    with no load at all, the same sums as :func:`run_experts`, bit for bit. A layer of
    experts of one kind (block-quantized, float16 or bfloat16) runs a step in one native
    call.

    Only for a store that never has to evict (a :class:`colibri.Pager` whose budget holds
    every expert of the model, :class:`InMemoryExperts`): held experts keep their slots until
    :meth:`release`. A pager still counts each step's experts as hits and checks their files
    (:meth:`colibri.Pager.reuse`).

    Parameters
    ----------
    store : ExpertStore
    layer : int
    num_experts : int
        ``E``; ids must be in ``[0, E)`` or negative (no expert).
    activation : str
        The fused kernel's gate activation (``"silu"``, ...).
    num_threads : int
        Threads of colibri's kernels (0: colibri's default).
    """

    def __init__(
        self,
        store: ExpertStore,
        layer: int,
        *,
        num_experts: int,
        activation: str = "silu",
        num_threads: int = 0,
    ) -> None:
        if activation not in KERNEL_ACTIVATIONS:
            raise ValueError(
                f"HeldExperts(): activation must be one of {sorted(KERNEL_ACTIVATIONS)} (got "
                f"{activation!r})"
            )
        self.store, self.layer, self.num_experts = store, int(layer), int(num_experts)
        self.num_threads, self._act = num_threads, KERNEL_ACTIVATIONS[activation]
        self._forms: dict[int, tuple | None] = {}  # expert -> _kernel_form: views that pin it
        self._native: Any = None  # _quant.Held: the layer's quantized experts, one kind
        self._mixed = False  # experts the native step cannot take: never again

    def __call__(
        self,
        x: np.ndarray,
        ids: np.ndarray,
        weights: np.ndarray,
        *,
        dtype: str = "float32",
        out: np.ndarray | None = None,
        residual: np.ndarray | None = None,
        reused: list | None = None,
        rounded: bool = False,
    ) -> np.ndarray | None:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` as :func:`run_experts`
        computes it, rounded once to ``dtype``; plus ``residual`` if given.

        Parameters
        ----------
        x : [T, H] float32, or the uint16 bits of ``dtype``, C-contiguous
        ids : [T, k] int32 or int64
        weights : [T, k] float32, or the uint16 bits of ``dtype``, C-contiguous
        dtype : str
            ``"float32"``, ``"bfloat16"`` or ``"float16"``: what ``x`` and the result hold.
        out : [T, H] like ``x``, optional
            Where the result goes.
        residual : [T, H] like ``x``, optional
            Added to the rounded sum, the result rounded to ``dtype`` again: torch's add of
            two tensors of ``dtype`` (a decoder layer's residual stream).
        reused : list, optional
            Where a step served by held experts appends ``(layer, experts)`` rather than
            telling a :class:`colibri.Pager` store now (:meth:`colibri.Pager.reuse`): for a
            caller that tells it once for several layers (:meth:`colibri.Pager.reuse_many`)
            before it uses their results. Experts this step loads are counted by the load.
        rounded : bool
            float32 ``weights`` rounded to ``dtype`` first, as a router's ``.to(dtype)``
            rounds them (the rounding done here, with no array made for it).

        Returns
        -------
        y : [T, H] like ``x``, or None
            None (``out`` untouched) when an expert of the step does not take the fused
            kernel at its row count: run :func:`run_experts` then.
        """
        kind, native, code = VALUE_KINDS.get(dtype), self._native, None
        if native is not None and out is not None and kind is not None and kernel_enabled():
            # the steady state, every expert held: one native call, which checks the arrays
            # (a failure named by the checks below)
            try:
                code = native.step(x, ids, weights, out, kind, self.num_threads, residual,
                                   rounded)  # fmt: skip
            except (ValueError, TypeError):
                code = None
            if code == 0:
                self._reused(native.active, reused)
                return out
        if kind is None:
            raise ValueError(
                f"HeldExperts(): dtype must be one of {sorted(VALUE_KINDS)} ({dtype!r})"
            )
        storage = np.float32 if kind == 0 else np.uint16
        if x.dtype != storage or x.ndim != 2 or not x.flags.c_contiguous:
            raise ValueError(
                f"HeldExperts(): x must be a C-contiguous [T, H] {np.dtype(storage).name} array "
                f"for dtype={dtype!r} (got {x.dtype} {list(x.shape)})"
            )
        if weights.dtype not in (np.float32, storage) or not weights.flags.c_contiguous:
            raise ValueError(
                f"HeldExperts(): weights must be C-contiguous float32 or {np.dtype(storage).name}"
                f" (got {weights.dtype})"
            )
        if not kernel_enabled():
            return None
        if out is None:
            out = np.empty(x.shape, storage)
        elif out.shape != x.shape or out.dtype != storage or not out.flags.c_contiguous:
            raise ValueError(
                f"HeldExperts(): out must be like x (got {out.dtype} {list(out.shape)})"
            )
        if residual is not None and (
            residual.shape != x.shape
            or residual.dtype != storage
            or not residual.flags.c_contiguous
        ):
            raise ValueError(
                f"HeldExperts(): residual must be like x (got {residual.dtype} "
                f"{list(residual.shape)})"
            )
        if native is not None and code is None:  # as above, the arrays now checked
            ids64 = np.ascontiguousarray(ids, np.int64)
            if native.step(x, ids64, weights, out, kind, self.num_threads, residual,
                           rounded) == 0:  # fmt: skip
                self._reused(native.active, reused)
                return out
        if rounded and kind and weights.dtype == np.float32:
            weights = round_to(weights, dtype).view(np.uint16)
        sums = out if residual is None else np.empty_like(out)  # out may be residual itself
        # the loads are released once the step computed: their reads checked
        with contextlib.ExitStack() as loads:
            y = self._step(x, ids, weights, dtype, kind, sums, loads, reused)
        if y is None or residual is None:
            return y
        total = _values(residual, dtype) + _values(y, dtype)
        out[...] = total if kind == 0 else round_to(total, dtype).view(np.uint16)
        return out

    def hold(self, experts=None) -> None:
        """Load and hold ``experts`` now (every expert of the layer when None), as a step
        routing to them would (a pager counts their reads): a first step that routes to
        them does no load, and no copy where the kernel takes a layout of its own (a
        loader's work, done before decoding rather than during it).

        Parameters
        ----------
        experts : sequence of int, optional
            Ids in ``[0, E)``; experts already held are skipped.
        """
        wanted = range(self.num_experts) if experts is None else [int(e) for e in experts]
        outside = [e for e in wanted if not 0 <= e < self.num_experts]
        if outside:
            raise ValueError(
                f"HeldExperts.hold(): experts {outside[:8]} outside [0, {self.num_experts})"
            )
        with contextlib.ExitStack() as loads:  # the views taken keep the experts held
            self._hold(list(dict.fromkeys(wanted)), loads)

    def _step(self, x, ids, weights, dtype, kind, out, loads, reused) -> np.ndarray | None:
        fresh: set[int] = set()  # experts this step loads: counted by the load, not as hits
        native = self._native
        if native is not None or not self._forms:
            ids64 = np.ascontiguousarray(ids, np.int64)
            code = 1 if native is None else native.step(x, ids64, weights, out, kind,
                                                        self.num_threads)  # fmt: skip
            if code == 1:  # experts not held yet
                missing = native.missing if native is not None else np.unique(ids64[ids64 >= 0])
                fresh = self._hold([int(e) for e in missing if e < self.num_experts], loads)
                native = self._native
                if native is not None:
                    code = native.step(x, ids64, weights, out, kind, self.num_threads)
            if code == 0:
                self._reused([e for e in native.active if e not in fresh], reused)
                return out
        sums = self._sums(_values(x, dtype), ids, _values(weights, dtype), loads, fresh, reused)
        if sums is None:
            return None
        out[...] = sums if kind == 0 else round_to(sums, dtype).view(np.uint16)
        return out

    def _sums(self, x, ids, weights, loads, fresh, reused) -> np.ndarray | None:
        """The step in float32 (any kind of experts), or None."""
        _check(x, ids, weights)
        plan = _Plan(ids, self.num_experts, self.num_threads)
        fresh |= self._hold([int(e) for e in plan.active], loads)
        group = []
        for e in plan.active:
            e = int(e)
            form, rows = self._forms[e], plan.rows(e)
            if form is None or rows.stop - rows.start > form[2]:
                return None
            group.append((form[0], form[1], plan.sorted[rows], e))
        out = np.zeros(x.shape, np.float32)
        if group:
            _fuse(x, weights.reshape(-1), plan.k, group, self._act, out, self.num_threads,
                  self.layer)  # fmt: skip
        self._reused([f[3] for f in group if f[3] not in fresh], reused)
        return out

    def _hold(self, missing: list[int], loads: contextlib.ExitStack) -> set[int]:
        """Load the ``missing`` experts not held yet and keep their views (which pin them)
        after ``loads`` releases the batch; the experts loaded."""
        missing = [e for e in missing if e not in self._forms]
        if missing:
            batch = loads.enter_context(self.store.load(self.layer, missing))
            for e in missing:
                form = self._forms[e] = _kernel_form(batch[e])
                self._native_hold(e, form)
        return set(missing)

    def _native_hold(self, e: int, form: tuple | None) -> None:
        if self._mixed:
            return
        kind = None if form is None else form[1]
        quantized = isinstance(kind, tuple) and kind[0] in _quant.TYPES
        if not quantized and kind not in KERNEL_KINDS.values():  # float8, or no kernel
            self._mixed, self._native = True, None
            return
        if self._native is None:
            hidden = form[0][2].shape[0]  # down: H rows
            # held before in another form, or quantized rows not whole blocks of 32
            if len(self._forms) > 1 or (quantized and hidden % 32):
                self._mixed = True
                return
            self._native = _quant.Held(
                self.num_experts, hidden, self._act, min(form[2], _ffn.MAX_ROWS)
            )
        if quantized:
            held = self._native.hold(e, form[0], kind[0], kind[1])
        else:
            held = self._native.hold_half(e, form[0], kind)
        if not held:
            self._mixed, self._native = True, None

    def _reused(self, experts, reused: list | None = None) -> None:
        """Tell a store that counts hits (a Pager) that the step used these held experts, or
        append ``(layer, experts)`` to ``reused`` for the caller to tell it."""
        if not len(experts) or getattr(self.store, "reuse", None) is None:
            return
        if reused is not None:
            reused.append((self.layer, experts))
        else:
            self.store.reuse(self.layer, experts)

    def release(self) -> None:
        """Drop every held expert (idempotent): the store may reuse their slots."""
        self._forms, self._native, self._mixed = {}, None, False  # the views go: the pins too


def _values(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 rows, or the uint16 bits of ``dtype``, as float32 (:func:`compute_rows`)."""
    if a.dtype == np.float32:
        return a
    return compute_rows(a.view(np.float16) if dtype == "float16" else a, dtype)


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
        """Every decode-size expert of a chunk in one fused-kernel call per kind."""
        if self.fused is None:
            self.fused = np.zeros(self.x.shape, np.float32)
        _fuse(self.x, self.flat_weights, self.plan.k, group, act, self.fused, self.num_threads,
              self.layer)  # fmt: skip

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


def _fuse(x, flat_weights, k, group, act, out, num_threads, layer) -> None:
    """``out += `` the weighted sums of ``group`` (``(mats, kind, assignments, expert)``,
    ascending experts) in one fused-kernel call per kind: a half precision (an int), a pair
    of quantized types (gate/up's, down's) or float8 block-scaled."""
    for kind in sorted({f[1] for f in group}, key=str):
        same = [f for f in group if f[1] == kind]
        assignments = np.concatenate([f[2] for f in same])
        bounds = np.fromiter(accumulate((len(f[2]) for f in same), initial=0), np.int64)
        bounds, owner = runs(bounds)
        mats, rows = [same[j][0] for j in owner], assignments // k
        scale = flat_weights[assignments]
        if kind == FP8_BLOCKED:
            _fp8.ffn_sum(x, mats, act, bounds, rows, scale, out, num_threads)
            if not np.isfinite(out[rows]).all() and np.isfinite(x[rows]).all():
                for parts, _, _, e in same:  # a corrupt file: name the expert
                    fp8_nonfinite(parts, f"layer {layer} expert {e}")
        elif isinstance(kind, tuple):
            _quant.ffn_sum(x, mats, kind[0], act, bounds, rows, scale, out, num_threads,
                           down_type=kind[1])  # fmt: skip
            _check_finite(x, out, rows, same)
        else:
            _ffn.ffn_sum(x, mats, kind, _ffn.ACTIVATIONS[act], bounds, rows, scale, out,
                         num_threads)  # fmt: skip


def _kernel_form(expert: ExpertWeights) -> tuple[tuple, object, int] | None:
    """How the fused kernel takes ``expert``: ``(matrices, kind, most rows)``, or None when
    it cannot (an ``expert_fn``, float32, strided half-precision rows)."""
    dtype = getattr(expert, "dtype", None)  # None: an expert_fn
    if dtype in _quant.TYPES:
        return tuple(expert), (expert.dtype, expert.down_dtype), QUANT_KERNEL_MAX_ROWS
    if dtype == FP8_BLOCKED:
        return fp8_parts(expert), FP8_BLOCKED, FP8_KERNEL_MAX_ROWS
    bits = _kernel_bits(expert) if dtype is not None else None
    if bits is None:
        return None
    return bits, KERNEL_KINDS[expert.dtype], KERNEL_MAX_ROWS[expert.dtype]


def _run_chunk(batch, part, sums: _Sums, activation, kernel_act, fallback) -> None:
    """One loaded chunk: decode-size experts in one fused-kernel call, the rest one by one."""
    plan = sums.plan
    fused = []
    for e in part:
        e = int(e)
        expert = batch[e]
        rows = plan.rows(e)
        form = _kernel_form(expert) if kernel_act is not None else None
        if form is not None and rows.stop - rows.start <= form[2]:
            fused.append((form[0], form[1], plan.sorted[rows], e))
        elif fallback is not None:
            assignments = plan.sorted[rows]
            dtype = getattr(expert, "dtype", None)
            if dtype in _quant.TYPES or dtype == FP8_BLOCKED:
                expert = dequantized(expert, f"layer {sums.layer} expert {e}")
            fallback(e, expert, assignments // plan.k, assignments)
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
