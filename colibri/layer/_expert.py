"""One gated-FFN expert, ``y = down @ (act(gate @ x) * (up @ x))``, on numpy rows.

float16/bfloat16 weights run colibri's fused kernel (``_ffn``: each weight read once in its
stored dtype, float32 accumulation) for up to ``_ffn.MAX_ROWS`` float32 rows; block-scaled
float8 experts (``"float8_e4m3_b128"``) run ``_fp8``'s kernel for up to
``FP8_KERNEL_MAX_ROWS`` rows; everything else runs numpy GEMMs (BLAS), half-precision weights
converted to float32 one cache-sized block at a time, quantized and float8 ones dequantized.
:func:`expert_ffn` is the public entry point for any framework's tensors.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from colibri._dlpack import bf16_to_float32, float32_to_bf16, import_host, to_caller
from colibri._errors import FormatError
from colibri.formats import FP8_BLOCKED, ExpertWeights
from colibri.layer import _attention, _ffn, _fp8, _norm, _quant, _rope, _rows, _step

__all__ = [
    "activation_function",
    "attention",
    "expert_ffn",
    "half_linear",
    "post_attention",
    "pre_attention",
    "quant_linear",
    "rms_norm",
]


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7), numpy only."""
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def _silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x) without overflow warnings for large negative x
    return x * (0.5 * (1.0 + np.tanh(0.5 * x)))


_ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "silu": _silu,
    "swiglu": _silu,
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)).astype(x.dtype)),
    "gelu_tanh": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "geglu": _gelu_tanh,
    "relu": lambda x: np.maximum(x, 0),
}

#: The activations the fused kernel computes itself (include/colibri/ffn.h), by name.
KERNEL_ACTIVATIONS = {
    "silu": "silu",
    "swiglu": "silu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "geglu": "gelu_tanh",
    "relu": "relu",
}
#: The weight dtypes the fused kernel reads, as its ``kind`` argument.
KERNEL_KINDS = _ffn.WEIGHT_KINDS
#: The half types (``"bfloat16"``, ``"float16"``) this CPU computes natively, as oneDNN's
#: GEMMs under torch use them: bfloat16 with AVX512_BF16 (Cooper Lake, Zen 4; AMX where
#: present), float16 with AVX512_FP16 (Sapphire Rapids on). Without, torch's GEMMs of that
#: type read about 1 GB/s: a [256, 1024] x [1024, 1024] bfloat16 ``F.linear`` took 26 ms on a
#: 2-core Zen 3, the same in float32 (the weight converted at each call) 4.1; on a Zen 4
#: (AVX512_BF16, no AVX512_FP16), 2 threads, float16 12.9 ms, bfloat16 1.2, float32 3.0.
NATIVE_HALF = frozenset(
    name
    for name, native in (
        ("bfloat16", _ffn.detected_path() == "avx512_bf16"),
        ("float16", _ffn.has_avx512fp16()),
    )
    if native
)
#: Rows up to which block-quantized experts (``q4_k``, ...) run the quantized kernel (in runs
#: of ``_ffn.MAX_ROWS``); more are dequantized to float32 for BLAS, whose reuse of each weight
#: across rows then pays for the dequantization: one Q4_0 or Q6_K expert of 1024 x 1280 on
#: a 2-core Zen 3 took 5.3 ms in the kernel at 64 rows against 14 for dequantization and
#: torch, and about as long as them at 256.
QUANT_KERNEL_MAX_ROWS = 192
#: Rows up to which float8 experts run their kernel (``_fp8``); more are dequantized to
#: float32 for BLAS (the same expert in float8: 16 ms at 48 rows, dequantized 21).
FP8_KERNEL_MAX_ROWS = 48


def activation_function(activation: str | Callable) -> Callable[[np.ndarray], np.ndarray]:
    """The gate activation as a function on float numpy arrays.

    Parameters
    ----------
    activation : str or callable
        ``"silu"`` (SwiGLU), ``"gelu"`` (exact, GeGLU), ``"gelu_tanh"``, ``"relu"``, their
        aliases (``"swiglu"``, ``"geglu"``, ``"gelu_pytorch_tanh"``), or a callable, returned
        as it is.

    Raises
    ------
    ValueError
        An unknown name; the message lists the known ones.
    """
    if callable(activation):
        return activation
    try:
        return _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"unknown activation {activation!r}; choose one of "
            f"{sorted(_ACTIVATIONS)} or pass a callable"
        ) from None


def kernel_enabled() -> bool:
    """Whether the fused kernel may run: ``COLIBRI_EXPERT_KERNEL=0`` sends every expert to
    GEMMs instead (torch's in the transformers integration, BLAS in numpy), to compare or to
    rule the kernel out in a bug report."""
    value = os.environ.get("COLIBRI_EXPERT_KERNEL", "1")
    if value not in ("0", "1"):
        raise ValueError(f'COLIBRI_EXPERT_KERNEL must be "0" or "1" (got {value!r})')
    return value == "1"


def gpt_oss_experts(
    x: np.ndarray,
    experts: list[tuple],
    bounds: np.ndarray,
    rows: np.ndarray,
    scale: np.ndarray,
    y: np.ndarray,
    *,
    alpha: float,
    limit: float,
    num_threads: int = 0,
) -> bool:
    """gpt-oss's MXFP4 experts in colibri's fused kernel: ``y[rows[i]] += scale[i] *
    expert_j(x[rows[i]])`` for ``i`` in ``[bounds[j], bounds[j + 1])``.

    Parameters
    ----------
    x, y : numpy.ndarray
        float32 ``[T, H]`` (``y`` added to in place).
    experts : list of tuple
        Per expert ``(gate_up, gate_up_scales, gate_up_bias, down, down_scales, down_bias)``
        as gpt-oss stores them: blocks uint8 ``[2I, H / 2]`` and ``[H, I / 2]``, e8m0 scales
        uint8 ``[2I, H / 32]`` and ``[H, I / 32]``, biases float32 ``[2I]`` and ``[H]``.
    bounds : numpy.ndarray
        int64 ``[len(experts) + 1]`` from 0; each expert takes at least 1 assignment.
    rows, scale : numpy.ndarray
        int64 and float32 ``[bounds[-1]]``: each assignment's row of ``x`` and weight.
    alpha, limit : float
        The clamped SwiGLU's slope and clamp.
    num_threads : int
        0: colibri's default.

    Returns
    -------
    bool
        False (nothing computed) where ``COLIBRI_EXPERT_KERNEL=0`` rules the kernel out.
    """
    if not kernel_enabled():
        return False
    bounds, owner = runs(bounds)
    experts = [experts[j] for j in owner]
    _quant.ffn_sum(x, experts, _quant.MXFP4_OSS, "gpt_oss", bounds, rows, scale, y,
                   num_threads, alpha=alpha, limit=limit)  # fmt: skip
    return True


def half_bits(w: Any) -> np.ndarray:
    """A float16/bfloat16 matrix (numpy, ml_dtypes or raw bits) as its uint16 bits, no copy."""
    return np.asarray(w).view(np.uint16)


# Weight rows converted per block: about 256 KiB of float32, so the block stays in cache
# between its conversion and its GEMM (a whole converted matrix would go to DRAM and back).
_BLOCK_BYTES = 1 << 18


def half_linear(
    x: np.ndarray,
    bits: np.ndarray,
    dtype: str,
    bias: np.ndarray | None = None,
    num_threads: int = 0,
) -> np.ndarray:
    """``x @ W.T + bias`` on colibri's linear kernel (float32 accumulation, each output
    summed by one thread in a fixed order: the same bits for any thread count).

    Parameters
    ----------
    x : numpy.ndarray
        ``[n, in]`` float32 rows.
    bits : numpy.ndarray
        ``[out, in]`` ``uint16``: the weight's ``dtype`` bits, rows contiguous.
    dtype : str
        ``"bfloat16"`` or ``"float16"``.
    bias : numpy.ndarray, optional
        ``[out]`` float32.
    num_threads : int
        Threads (0: colibri's default).

    Returns
    -------
    numpy.ndarray
        ``[n, out]`` float32.
    """
    y = np.empty((x.shape[0], bits.shape[0]), np.float32)
    _ffn.linear(x, bits, KERNEL_KINDS[dtype], y, num_threads, bias)
    return y


#: What an array of values holds, as the kernels take it: float32 (0), or the uint16 bits of
#: float16 / bfloat16 (half.h's COLIBRI_W_F16 / COLIBRI_W_BF16).
VALUE_KINDS = {"float32": _norm.KIND_PLAIN, "bfloat16": _norm.KIND_BFLOAT16,
               "float16": _norm.KIND_FLOAT16}  # fmt: skip


def rms_norm(
    x: np.ndarray,
    weight: np.ndarray,
    eps: float,
    dtype: str = "float32",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """RMSNorm of each row as transformers' Llama-family ``*RMSNorm`` computes it:
    ``weight * round(x * (1 / sqrt(mean(x^2) + eps)))``, ``round`` to ``dtype``.

    Parameters
    ----------
    x : numpy.ndarray
        ``[T, n]``: float32, or the ``uint16`` bits of ``dtype``.
    weight : numpy.ndarray
        ``[n]``, stored as ``x`` is.
    eps : float
        Added to the mean of squares.
    dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``: what ``x``, ``weight`` and the result
        hold.
    out : numpy.ndarray, optional
        ``[T, n]`` C-contiguous, stored as ``x`` is: where the result goes (may be ``x``).

    Returns
    -------
    numpy.ndarray
        ``[T, n]`` like ``x``. The mean of squares is exact to float32's rounding; torch's
        own sum order may differ in its last place, so results match torch's bit for bit
        almost always and within one unit in the last place of ``dtype`` always.
    """
    kind = VALUE_KINDS.get(dtype)
    if kind is None:
        raise ValueError(f"rms_norm(): dtype must be one of {sorted(VALUE_KINDS)} (got {dtype!r})")
    storage = np.float32 if kind == _norm.KIND_PLAIN else np.uint16
    x, weight = np.asarray(x), np.asarray(weight)
    if x.ndim != 2 or weight.ndim != 1 or x.dtype != storage or weight.dtype != storage:
        raise ValueError(
            f"rms_norm(): x must be [T, n] and weight [n], both {np.dtype(storage).name} for "
            f"dtype={dtype!r} (got x {x.dtype} {list(x.shape)}, weight {weight.dtype} "
            f"{list(weight.shape)})"
        )
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"rms_norm(): eps must be a finite number >= 0 (got {eps})")
    x, weight = np.ascontiguousarray(x), np.ascontiguousarray(weight)
    if out is None:
        out = np.empty_like(x)
    elif out.shape != x.shape or out.dtype != storage or not out.flags.c_contiguous:
        raise ValueError(
            f"rms_norm(): out must be C-contiguous {np.dtype(storage).name} "
            f"{list(x.shape)} (got {out.dtype} {list(out.shape)})"
        )
    _norm.rms_norm(x, weight, eps, out, kind)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """Rotary position embedding of each row, in place, as transformers computes it.

    ``round(x * cos) + round(rotate_half(x) * sin)`` with ``rotate_half(x) = [-x[d/2:],
    x[:d/2]]``, each product rounded to ``dtype`` (transformers' ``apply_rotary_pos_emb``).

    Parameters
    ----------
    x : numpy.ndarray
        ``[R, d]`` C-contiguous, ``d`` even (one row per head): float32, or the ``uint16``
        bits of ``dtype``. Overwritten with the result.
    cos, sin : numpy.ndarray
        ``[d]``, stored as ``x`` is: the position's rotation.
    dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    Returns
    -------
    numpy.ndarray
        ``x``, rotated: equal to torch's elementwise result bit for bit.
    """
    kind = VALUE_KINDS.get(dtype)
    if kind is None:
        raise ValueError(f"rope(): dtype must be one of {sorted(VALUE_KINDS)} (got {dtype!r})")
    storage = np.float32 if kind == _norm.KIND_PLAIN else np.uint16
    cos, sin = np.asarray(cos), np.asarray(sin)
    if (
        not isinstance(x, np.ndarray)
        or x.ndim != 2
        or not x.flags.c_contiguous
        or not x.flags.writeable
        or x.dtype != storage
        or cos.dtype != storage
        or sin.dtype != storage
    ):
        raise ValueError(
            f"rope(): x must be a writeable C-contiguous [R, d] array, x, cos and sin "
            f"{np.dtype(storage).name} for dtype={dtype!r} (got x "
            f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', ()))}, cos "
            f"{cos.dtype}, sin {sin.dtype})"
        )
    _rope.rope(x, np.ascontiguousarray(cos).reshape(-1), np.ascontiguousarray(sin).reshape(-1),
               kind)  # fmt: skip
    return x


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    dtype: str = "float32",
    mask: np.ndarray | None = None,
    out: np.ndarray | None = None,
    num_threads: int = 0,
) -> np.ndarray:
    """Attention of a few query rows over a key/value cache, as a decoding step needs it.

    ``out[t, h] = softmax_j(scale * q[h, t] . k[g, j] + mask[t, j]) @ v[g]``, ``g = h // G``.

    Parameters
    ----------
    q : numpy.ndarray
        ``[Hq, T, D]``: float32, or the ``uint16`` bits of ``dtype``.
    k, v : numpy.ndarray
        ``[Hkv, L, D]``, stored as ``q`` is; ``Hkv`` divides ``Hq`` (``G = Hq / Hkv`` query
        heads share a key/value head).
    scale : float
        Multiplies the dot products (``1 / sqrt(D)`` in most models).
    dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``: what ``q``, ``k``, ``v`` and the
        result hold.
    mask : numpy.ndarray, optional
        ``[T, L]`` float32 added to the scaled scores (``-inf``: not attended).
    out : numpy.ndarray, optional
        ``[T, Hq, D]`` C-contiguous, stored as ``q`` is: where the result goes.
    num_threads : int
        The most threads the key/value heads run on, once the cache is long enough to be
        worth it (0: colibri's default); the result's bits do not depend on it.

    Returns
    -------
    numpy.ndarray
        ``[T, Hq, D]`` (the token-major layout a model's output projection reads). float32
        arithmetic in a fixed order, rounded once to ``dtype``; a row with every key masked
        gets zeros.
    """
    kind = VALUE_KINDS.get(dtype)
    if kind is None:
        raise ValueError(f"attention(): dtype must be one of {sorted(VALUE_KINDS)} (got {dtype!r})")
    storage = np.float32 if kind == _norm.KIND_PLAIN else np.uint16
    q, k, v = np.ascontiguousarray(q), _heads(k), _heads(v)
    if any(a.ndim != 3 or a.dtype != storage for a in (q, k, v)):
        raise ValueError(
            f"attention(): q, k and v must be 3-d {np.dtype(storage).name} arrays for "
            f"dtype={dtype!r} (got {', '.join(f'{a.dtype} {list(a.shape)}' for a in (q, k, v))})"
        )
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"attention(): scale must be finite (got {scale})")
    if mask is not None:
        mask = np.ascontiguousarray(mask, np.float32)
        if mask.ndim != 2:
            raise ValueError(f"attention(): mask must be [T, L] (got {list(mask.shape)})")
    shape = (q.shape[1], q.shape[0], q.shape[2])
    if out is None:
        out = np.empty(shape, storage)
    elif out.shape != shape or out.dtype != storage or not out.flags.c_contiguous:
        raise ValueError(
            f"attention(): out must be C-contiguous {np.dtype(storage).name} {list(shape)} "
            f"(got {out.dtype} {list(out.shape)})"
        )
    if num_threads < 0:
        raise ValueError(f"attention(): num_threads must be >= 0 (got {num_threads})")
    _attention.attention(q, k, v, scale, out, kind, mask, None, int(num_threads))
    return out


# How each kind's values are stored: float32, or the uint16 bits of a half type.
_STORAGE = {kind: np.dtype(np.float32 if kind == _norm.KIND_PLAIN else np.uint16)
            for kind in VALUE_KINDS.values()}  # fmt: skip


def _storage(dtype: str, where: str) -> tuple[int, np.dtype]:
    kind = VALUE_KINDS.get(dtype)
    if kind is None:
        raise ValueError(f"{where}: dtype must be one of {sorted(VALUE_KINDS)} (got {dtype!r})")
    return kind, _STORAGE[kind]


def _checked(a: Any, storage: np.dtype, what: str, where: str) -> np.ndarray:
    if type(a) is np.ndarray and a.dtype is storage:  # a decoding step's every call
        return a
    a = np.asarray(a)
    if a.dtype != storage:
        raise ValueError(f"{where}: {what} must be {storage.name} for this dtype "
                         f"(got {a.dtype})")  # fmt: skip
    return a


def _values(a: Any, storage: np.dtype, what: str, where: str) -> np.ndarray:
    a = _checked(a, storage, what, where)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _heads(a: Any) -> np.ndarray:
    """Keys or values ``[Hkv, L, D]`` as the attention kernel reads them, without a copy when
    each head's rows are packed (the first ``L`` rows of a cache ``[Hkv, capacity, D]``)."""
    a = np.asarray(a)
    packed = a.ndim == 3 and a.strides[2] == a.itemsize and a.strides[1] == a.shape[2] * a.itemsize
    return a if packed and a.strides[0] >= a.strides[1] * a.shape[1] else np.ascontiguousarray(a)


def pre_attention(
    x: np.ndarray,
    norm: tuple[np.ndarray, float],
    projections: tuple[tuple, tuple, tuple],
    cos: np.ndarray,
    sin: np.ndarray,
    q_norm: tuple[np.ndarray, float] | None = None,
    k_norm: tuple[np.ndarray, float] | None = None,
    dtype: str = "float32",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A decoder layer's one-token step up to its attention, in one call.

    ``h = rms_norm(x)``; ``q, k, v`` its three projections; ``q``, ``k`` normed per head
    (``q_norm``, ``k_norm``) and rotated (:func:`rope`). The values equal those kernels called
    one by one bit for bit (each result rounded to ``dtype`` as they round it), without the
    interpreter between them.

    Parameters
    ----------
    x : numpy.ndarray
        ``[H]``: float32, or the ``uint16`` bits of ``dtype``.
    norm : tuple
        ``(weight [H], eps)``, the weight stored as ``x``.
    projections : tuple
        ``(q, k, v)``, each ``(weight, code, bias, num_threads)``: ``code`` a quantized type
        of :func:`quant_linear` for rows of blocks ``[out, row_bytes]`` uint8, or
        ``"bfloat16"`` / ``"float16"`` for a weight's ``uint16`` bits ``[out, H]``;
        ``bias`` float32 ``[out]`` or None; ``num_threads`` (0: colibri's default).
    cos, sin : numpy.ndarray
        ``[D]``, stored as ``x``: the position's rotation (``D`` the head size).
    q_norm, k_norm : tuple, optional
        ``(weight, eps)``: an RMSNorm of every ``len(weight)`` values of ``q`` / ``k`` (a
        head's, or all of them); None: none.
    dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    Returns
    -------
    tuple of numpy.ndarray
        ``q [Hq, D]``, ``k [Hkv, D]``, ``v [Hkv, D]``, stored as ``x``.
    """
    where = "pre_attention()"
    kind, storage = _storage(dtype, where)
    x = _values(x, storage, "x", where)
    cos, sin = _values(cos, storage, "cos", where), _values(sin, storage, "sin", where)
    D = cos.size
    if len(projections) != 3:
        raise ValueError(f"{where}: projections must be (q, k, v) (got {len(projections)})")
    nq, nk, nv = projections[0][0].shape[0], projections[1][0].shape[0], projections[2][0].shape[0]
    if D == 0 or nq % D or nk % D or nk != nv:
        raise ValueError(f"{where}: the q, k, v projections give {[nq, nk, nv]} values: whole "
                         f"heads of cos's {D} values, as many for k as for v")  # fmt: skip
    q = np.empty((nq // D, D), storage)
    k, v = np.empty((nk // D, D), storage), np.empty((nk // D, D), storage)
    if norm is None:
        raise ValueError(f"{where}: norm must be (weight, eps)")
    _step.enter(x.reshape(-1), *_norm_of(norm, storage, where), tuple(projections),
                *_norm_of(q_norm, storage, where), *_norm_of(k_norm, storage, where),
                cos.reshape(-1), sin.reshape(-1), q, k, v, kind)  # fmt: skip
    return q, k, v


def _norm_of(norm: tuple | None, storage: np.dtype, where: str) -> tuple:
    """An optional norm ``(weight, eps)`` as the step's kernels take it (none: ``(None,
    0.0)``)."""
    if norm is None:
        return None, 0.0
    return _values(norm[0], storage, "a norm weight", where), float(norm[1])


def post_attention(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    scale: float,
    o_proj: tuple,
    x: np.ndarray,
    norm: tuple[np.ndarray, float],
    router: tuple | None = None,
    dtype: str = "float32",
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A decoder layer's one-token step from its attention to its router's logits, in one
    call.

    ``a = attention(q, keys, values)``; ``x = x + o_proj(a)``; ``h = rms_norm(x)``;
    ``logits = router(h)``: each result rounded to ``dtype`` as those kernels called one by
    one round it (:func:`attention`, :func:`quant_linear` / :func:`half_linear`,
    :func:`rms_norm`; the residual add rounded once, as torch adds), bit for bit theirs.

    Parameters
    ----------
    q : numpy.ndarray
        ``[Hq, D]`` (:func:`pre_attention`'s): float32, or the ``uint16`` bits of ``dtype``.
    keys, values : numpy.ndarray
        ``[Hkv, L, D]``, ``L > 0``: the cache, this token's row included (each head's rows
        packed, the heads any distance apart: a view of a cache with room to grow is not
        copied).
    scale : float
        The scores' scale (``D ** -0.5`` for most models).
    o_proj : tuple
        ``(weight, code, bias, num_threads)`` ``[H, Hq * D]`` (:func:`pre_attention`).
    x : numpy.ndarray
        ``[H]``: the residual stream before the attention.
    norm : tuple
        ``(weight [H], eps)``: the norm before the MoE block.
    router : tuple, optional
        ``(weight, code, bias, num_threads)`` ``[E, H]``; None: no logits.
    dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    Returns
    -------
    tuple
        ``x [H]`` (after the attention's residual add), ``h [H]`` (normed), ``logits [E]``
        or None; stored as ``q``.
    """
    where = "post_attention()"
    kind, storage = _storage(dtype, where)
    q, x = _values(q, storage, "q", where), _values(x, storage, "x", where)
    keys = _heads(_checked(keys, storage, "keys", where))
    values = _heads(_checked(values, storage, "values", where))
    if q.ndim != 2 or keys.ndim != 3 or values.ndim != 3:
        raise ValueError(f"{where}: q must be [Hq, D], keys and values [Hkv, L, D] (got "
                         f"{list(q.shape)}, {list(keys.shape)}, {list(values.shape)})")  # fmt: skip
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"{where}: scale must be finite (got {scale})")
    H = x.size
    out, h = np.empty(H, storage), np.empty(H, storage)
    logits = np.empty(0 if router is None else router[0].shape[0], storage)
    _step.leave(q, keys, values, scale, tuple(o_proj), x.reshape(-1),
                _values(norm[0], storage, "the norm weight", where), float(norm[1]),
                None if router is None else tuple(router), out, h, logits, kind)  # fmt: skip
    return out, h, None if router is None else logits


def quant_linear(
    x: np.ndarray,
    blocks: np.ndarray,
    qtype: str,
    bias: np.ndarray | None = None,
    num_threads: int = 0,
    dtype: str = "float32",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``x @ W.T + bias`` for a weight ``W`` block-quantized as stored (a GGUF tensor), on
    colibri's quantized linear kernel: ``x`` quantized to int8 blocks once (as ggml does),
    integer dot products, float32 accumulation in a fixed order (the same bits for any
    thread count and SIMD path). The weights are read once whatever the rows.

    Parameters
    ----------
    x : numpy.ndarray
        ``[n, in]`` float32 rows, or the ``uint16`` bits of ``dtype``.
    blocks : numpy.ndarray
        ``[out, row_bytes]`` ``uint8``, C-contiguous: each row ``in`` values as whole
        ``qtype`` blocks.
    qtype : str
        ``"q8_0"``, ``"q4_0"``, ``"q4_k"``, ``"q5_k"``, ``"q6_k"``, ``"iq4_xs"``,
        ``"mxfp4"``, or ``"q4_0x8"`` (Q4_0 in :func:`fast_layout`'s layout).
    bias : numpy.ndarray, optional
        ``[out]`` float32.
    num_threads : int
        Threads (0: colibri's default).
    dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``: what ``x`` and the result hold (half
        precision: the float32 sums rounded once, to nearest even).
    out : numpy.ndarray, optional
        ``[n, out]`` C-contiguous, stored as ``x`` is: where the result goes.

    Returns
    -------
    numpy.ndarray
        ``[n, out]``, stored as ``x`` is.
    """
    kind = VALUE_KINDS.get(dtype)
    if kind is None:
        raise ValueError(
            f"quant_linear(): dtype must be one of {sorted(VALUE_KINDS)} (got {dtype!r})"
        )
    storage = np.float32 if kind == _norm.KIND_PLAIN else np.uint16
    if out is None:
        out = np.empty((x.shape[0], blocks.shape[0]), storage)
    if x.dtype != storage or out.dtype != storage:
        raise ValueError(
            f"quant_linear(): x and out must be {np.dtype(storage).name} for dtype={dtype!r} "
            f"(got x {x.dtype}, out {out.dtype})"
        )
    _quant.linear(qtype, blocks, x, out, num_threads, bias, kind=kind)
    return out


def fast_layout(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, str]:
    """A quantized weight in the layout :func:`quant_linear` reads fastest in this build.

    Q4_0 with a multiple of 8 rows, where this build has the kernel for it (x86): a copy
    with eight rows' blocks together, ``"q4_0x8"`` (the same values and results, 1.7-1.9x
    the speed on a Zen 3 core). Anything else: ``blocks`` and ``qtype`` themselves.

    Parameters
    ----------
    blocks : numpy.ndarray
        ``[out, row_bytes]`` ``uint8``: rows of whole ``qtype`` blocks.
    qtype : str
        The type as stored (one of :func:`quant_linear`'s).

    Returns
    -------
    tuple of (numpy.ndarray, str)
        The weight (``[out, row_bytes]`` ``uint8``) and its type, for :func:`quant_linear`.
    """
    if qtype == "q4_0" and _quant.INTERLEAVE_FAST and blocks.shape[0] % 8 == 0:
        return _quant.interleave(blocks), _quant.Q4_0X8
    return blocks, qtype


def linear(x: np.ndarray, w: Any, dtype: str) -> np.ndarray:
    """``x @ w.T`` for rows ``x [n, in]`` and a weight ``w [out, in]`` stored as ``dtype``.

    Computed as ``(w @ x.T).T`` (BLAS gemv for one row, several times faster than the
    row-vector form); float16/bfloat16 weights are converted to float32 block by block.
    """
    arr = np.asarray(w)
    if arr.ndim != 2 or arr.shape[1] != x.shape[1]:
        raise ValueError(
            f"expert weight of shape {arr.shape} does not match rows of width {x.shape[1]}"
        )
    if dtype not in KERNEL_KINDS:
        if arr.dtype.kind in "ui" and dtype.startswith("f8"):
            raise ValueError(
                f"expert weights are {dtype.upper()} held as raw {arr.dtype} bits: "
                "pip install ml-dtypes (it comes with jax) to compute them"
            )
        return (arr.astype(x.dtype, copy=False) @ x.T).T
    if x.dtype != np.float32:  # float64 rows: convert the weights whole
        whole = bf16_to_float32(half_bits(arr)) if dtype == "bfloat16" else arr.view(np.float16)
        return (whole.astype(x.dtype) @ x.T).T
    bits = np.ascontiguousarray(half_bits(arr))
    rows, cols = bits.shape
    block = max(8, _BLOCK_BYTES // (4 * cols))
    buf = np.empty((min(block, rows), cols), np.float32)
    out = np.empty((rows, x.shape[0]), np.float32)
    xt = x.T
    for r in range(0, rows, block):
        b = buf[: min(block, rows - r)]
        _rows.to_float32(bits[r : r + len(b)], KERNEL_KINDS[dtype], 1, b)
        np.matmul(b, xt, out=out[r : r + len(b)])
    return out.T


def runs(bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``bounds`` (int64 ``[count + 1]``, each expert's assignments) cut into runs of at most
    ``_ffn.MAX_ROWS``, the rows a kernel call takes an expert: the runs' bounds, and for each
    run the index of its expert (int64 ``[runs]``). Rows are independent in the kernels, so
    the runs give the same bits as one call would."""
    sizes = np.diff(bounds)
    if sizes.size == 0 or sizes.max() <= _ffn.MAX_ROWS:
        return bounds, np.arange(sizes.size)
    per = np.maximum(-(-sizes // _ffn.MAX_ROWS), 1)  # an empty expert stays, to be refused
    owner = np.repeat(np.arange(sizes.size), per)
    first = np.repeat(np.cumsum(per) - per, per)
    cuts = bounds[owner] + (np.arange(owner.size) - first) * _ffn.MAX_ROWS
    return np.append(cuts, bounds[-1]).astype(np.int64), owner


def gated_ffn(
    x: np.ndarray,
    expert: ExpertWeights,
    activation: str | Callable,
    *,
    num_threads: int = 0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``down @ (act(gate @ x) * (up @ x))`` for numpy rows ``x [n, H]`` (float32 or float64).

    The fused kernel runs for float16/bfloat16 weights, a kernel activation, float32 rows and
    at most ``_ffn.MAX_ROWS`` of them (it beats block conversion + BLAS there), writing into
    ``out`` ([n, H] float32, rows contiguous) when given; otherwise three BLAS GEMMs (``out``
    unused). Returns ``[n, H]`` in ``x``'s dtype.
    """
    kernel_act = KERNEL_ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    n = x.shape[0]
    if (
        kernel_act is not None
        and expert.dtype in KERNEL_KINDS
        and x.dtype == np.float32
        and 0 < n <= _ffn.MAX_ROWS
        and kernel_enabled()
    ):
        if out is None:
            out = np.empty((n, x.shape[1]), np.float32)
        g, u, d = (_contiguous_rows(half_bits(m)) for m in expert)
        _ffn.ffn(np.ascontiguousarray(x), g, u, d, KERNEL_KINDS[expert.dtype],
                 _ffn.ACTIVATIONS[kernel_act], out, num_threads)  # fmt: skip
        return out
    if expert.dtype in _quant.TYPES:
        if kernel_act is not None and x.dtype == np.float32 and 0 < n <= QUANT_KERNEL_MAX_ROWS:
            x = np.ascontiguousarray(x)
            return np.concatenate([
                _quant.ffn(expert.dtype, *expert, x[i : i + _ffn.MAX_ROWS], kernel_act,
                           num_threads, down_type=expert.down_dtype)
                for i in range(0, n, _ffn.MAX_ROWS)
            ])  # fmt: skip
        expert = dequantized(expert)
    if expert.dtype == FP8_BLOCKED:
        if kernel_act is not None and x.dtype == np.float32 and 0 < n <= FP8_KERNEL_MAX_ROWS:
            parts = fp8_parts(expert)
            y = _fp8.ffn(*parts[:3], parts[3:], x, kernel_act, num_threads)  # <= MAX_ROWS
            check_fp8(parts, x, y, "float8 expert")
            return y
        expert = dequantized(expert)
    act = activation_function(activation)
    h = act(linear(x, expert.gate, expert.dtype))
    h *= linear(x, expert.up, expert.dtype)
    return linear(np.ascontiguousarray(h), expert.down, expert.dtype)


def dequantized(expert: ExpertWeights, where: str = "float8 expert") -> ExpertWeights:
    """A block-quantized expert (``q4_k``, ...) as float32 matrices, exactly the values GGUF's
    dequantization gives; a float8 one (``"float8_e4m3_b128"``) as its values times their
    block scales, rounded once to float32 (a :class:`FormatError` naming ``where`` when one
    is not finite: a NaN byte or scale of a corrupt file)."""
    if expert.dtype == FP8_BLOCKED:
        parts = fp8_parts(expert)
        mats = [_fp8.dequantize(w, s) for w, s in zip(parts[:3], parts[3:], strict=True)]
        if not all(np.isfinite(m).all() for m in mats):
            fp8_nonfinite(parts, where)
        return ExpertWeights(*mats, "float32")
    gate, up = (_quant.dequantize(expert.dtype, m) for m in (expert.gate, expert.up))
    return ExpertWeights(gate, up, _quant.dequantize(expert.down_dtype, expert.down), "float32")


def fp8_parts(expert: ExpertWeights) -> tuple[np.ndarray, ...]:
    """A float8 expert as its kernel takes it: gate, up, down ``uint8`` (no copy when
    contiguous), then their block scales float32 (bfloat16 ones converted: they are small)."""
    mats = tuple(np.ascontiguousarray(np.asarray(m).view(np.uint8)) for m in expert)
    scales = []
    for s in expert.scales:
        arr = np.asarray(s)
        if arr.dtype == np.uint16 or arr.dtype.name == "bfloat16":  # bfloat16 (or its bits)
            arr = bf16_to_float32(np.ascontiguousarray(arr.view(np.uint16)))
        scales.append(np.ascontiguousarray(arr, np.float32))
    return (*mats, *scales)


def check_fp8(parts: tuple, x: np.ndarray, y: np.ndarray, where: str) -> None:
    """After the float8 kernel: non-finite ``y`` from finite ``x`` is a corrupt file (a NaN
    byte or a NaN / infinite block scale), raised as a :class:`FormatError` naming it."""
    if np.isfinite(y).all() or not np.isfinite(x).all():
        return
    fp8_nonfinite(parts, where)


def fp8_nonfinite(parts: tuple, where: str) -> None:
    """A :class:`FormatError` naming ``where``, the matrix and the block scale or byte that
    makes a float8 expert (:func:`fp8_parts`) non-finite; nothing when none does."""
    for name, w, s in zip(("gate", "up", "down"), parts[:3], parts[3:], strict=True):
        found = _fp8.find_nonfinite(w, s)
        if found is None:
            continue
        what, i, j = found
        problem = (
            f"its block scale ({name}_proj.weight_scale_inv) [{i}, {j}] is {s[i, j]}"
            if what == "scale"
            else f"its e4m3 byte [{i}, {j}] is 0x{int(w[i, j]):02X}, which e4m3fn reads as NaN"
        )
        raise FormatError(
            f"{where}: {name}_proj.weight: {problem}; the weight file is corrupt (re-download it)"
        )


def _contiguous_rows(w: np.ndarray) -> np.ndarray:
    return w if w.shape[1] == 1 or w.strides[1] == w.itemsize else np.ascontiguousarray(w)


_FLOATS = ("float32", "float64", "float16", "bfloat16")


def float_host(obj: Any, what: str, func: str) -> tuple[np.ndarray, str]:
    """``obj`` (numpy or any host DLPack tensor, detached) as numpy and its dtype name, no
    copy (bfloat16 as uint16 bits); refused unless float32, float64, float16 or bfloat16."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        obj = obj.detach()  # weights and inputs are constants here: no autograd
    arr, name = import_host(obj)
    if name not in _FLOATS:
        raise ValueError(
            f"{func}(): {what} must be float32, float64, float16 or bfloat16 (got {name})"
        )
    return arr, name


def compute_rows(arr: np.ndarray, name: str) -> np.ndarray:
    """Rows in the compute dtype, C-contiguous: float64 stays, everything else float32."""
    if name == "bfloat16":
        return bf16_to_float32(arr)
    return np.ascontiguousarray(arr, np.float64 if name == "float64" else np.float32)


def round_to(x: np.ndarray, name: str) -> np.ndarray:
    """Computed rows rounded once into ``name`` (bfloat16 as uint16 bits)."""
    if name == "bfloat16":
        return float32_to_bf16(x)
    return x.astype(name, copy=False)


def check_expert(func: str, H: int, expert: ExpertWeights) -> None:
    """gate and up ``[I, H]``, down ``[H, I]``, one float dtype, or a ValueError saying which."""
    g, u, d = (np.shape(m) for m in expert)
    if len(g) != 2 or g[1] != H:
        raise ValueError(f"{func}(): gate must be [I, {H}] (got {tuple(g)})")
    if tuple(u) != tuple(g):
        raise ValueError(f"{func}(): up must be [{g[0]}, {H}] like gate (got {tuple(u)})")
    if tuple(d) != (H, g[0]):
        raise ValueError(f"{func}(): down must be [{H}, {g[0]}] (got {tuple(d)})")
    if expert.dtype not in _FLOATS:
        raise ValueError(
            f"{func}(): expert weights must be float32, float64, float16 or bfloat16 (got "
            f"{expert.dtype})"
        )


def host_expert(expert: Any, func: str) -> ExpertWeights:
    """An expert's three matrices (any framework, one dtype) as numpy views, no copy."""
    if not isinstance(expert, ExpertWeights):
        expert = ExpertWeights(*expert)
    views = [float_host(m, w, func) for m, w in zip(expert, ("gate", "up", "down"), strict=True)]
    names = [name for _, name in views]
    if len(set(names)) != 1:
        raise ValueError(
            f"{func}(): gate, up and down must share one dtype (got {', '.join(names)})"
        )
    return ExpertWeights(*(arr for arr, _ in views), dtype=names[0])


def expert_ffn(
    x: Any,
    gate: Any,
    up: Any,
    down: Any,
    *,
    activation: str | Callable = "silu",
    out: Any = None,
    num_threads: int | None = None,
) -> Any:
    """One gated-FFN expert: ``y = down @ (act(gate @ x) * (up @ x))`` for each row of x.

    float16 and bfloat16 weights with up to 64 rows run colibri's fused kernel (each weight
    read once in its stored dtype, float32 accumulation, the SIMD path of
    ``colibri.simd_path()``); more rows, float32/float64 weights or a callable activation
    run block conversion + BLAS.

    Parameters
    ----------
    x : [n, H] or [H]
        float32, float64, float16 or bfloat16; numpy or any host DLPack tensor (torch, jax).
    gate, up : [I, H]
    down : [H, I]
        The transformers convention (``nn.Linear`` weights, ``[out, in]``); all one dtype.
    activation : str or callable
        "silu" (SwiGLU), "gelu" (exact), "gelu_tanh", "relu", their aliases in
        ``activation_function``, or a callable on a float numpy array.
    out : like x, optional
        Written in place (same shape and dtype as x) and returned.
    num_threads : int or None
        Threads for the fused kernel (None: colibri's default).

    Returns
    -------
    y : same shape, dtype and framework as x (torch in, torch out, zero-copy)

    Raises
    ------
    ValueError
        Shapes that do not make an expert, mixed or non-float dtypes, a bad ``out`` or
        ``num_threads``; the message names the argument.
    """
    arr, name = float_host(x, "x", "expert_ffn")
    if arr.ndim not in (1, 2):
        raise ValueError(f"expert_ffn(): x must be [n, H] or [H] (got shape {tuple(arr.shape)})")
    rows2d = arr.reshape(1, -1) if arr.ndim == 1 else arr
    n, H = rows2d.shape
    if num_threads is not None and (
        isinstance(num_threads, bool)
        or not isinstance(num_threads, (int, np.integer))
        or num_threads < 1
    ):
        raise ValueError(
            f"expert_ffn(): num_threads must be a positive int or None (got {num_threads!r})"
        )
    expert = host_expert((gate, up, down), "expert_ffn")
    check_expert("expert_ffn", H, expert)
    out_arr = None
    if out is not None:
        out_arr, out_name = import_host(out, writable=True)
        if out_name != name or tuple(out_arr.shape) != tuple(arr.shape):
            raise ValueError(
                f"expert_ffn(): out must be {name} of shape {tuple(arr.shape)} like x (got "
                f"{out_name} of shape {tuple(out_arr.shape)})"
            )
    compute = np.float64 if name == "float64" and expert.dtype == "float64" else np.float32
    x_c = compute_rows(rows2d, name).astype(compute, copy=False)
    if n == 0:
        y = np.empty((0, H), compute)
    else:
        direct = out_arr is not None and name == "float32" and out_arr.strides[-1] == 4
        into = out_arr.reshape(n, H) if direct else None
        y = gated_ffn(x_c, expert, activation, num_threads=num_threads or 0, out=into)
        if direct and y is into:
            return out
    y = y.reshape(arr.shape)
    if out_arr is not None:
        out_arr[...] = round_to(y, name).reshape(out_arr.shape)
        return out
    return to_caller(round_to(y, name), x, name)
