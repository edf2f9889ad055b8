"""gpt-oss's MXFP4 experts in the fused kernel (``mxfp4_oss``: include/colibri/quant.h, qffn.h).

gpt-oss stores MXFP4 with values interleaved in each byte (low nibble even, high odd) and the
e8m0 scales apart; the kernel reads those bytes as GGUF's MXFP4 and takes x's q8 values
reordered to match. So its products are GGUF MXFP4's bit for bit on the same values (repacked
here by numpy), on every SIMD path; the experts (interleaved gate/up rows, biases, clamped
SwiGLU) are within a stated q8 bound of transformers' ``GptOssExperts`` in float64, on
weights dequantized by :func:`colibri.formats.gpt_oss.dequantize_mxfp4`.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri.formats import FormatError
from colibri.formats.gpt_oss import dequantize_mxfp4
from colibri.layer import _ffn, _quant, gpt_oss_experts

PATHS = _ffn.runnable_paths()
ALPHA, LIMIT = 1.702, 7.0


def _mxfp4(rng, rows, values, low=124, high=129):
    """Random gpt-oss MXFP4: blocks uint8 [rows, values / 2], scales uint8 [rows, values / 32]."""
    blocks = rng.integers(0, 256, (rows, values // 2), dtype=np.uint8)
    return blocks, rng.integers(low, high, (rows, values // 32), dtype=np.uint8)


def _as_gguf(blocks, scales):
    """The same values as GGUF's MXFP4 blocks (a scale byte, then value j | value j + 16 << 4)."""
    rows, groups = scales.shape
    b = blocks.reshape(rows, groups, 16)
    codes = np.empty((rows, groups, 32), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = b & 15, b >> 4
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], packed], -1).reshape(rows, groups * 17)


def _values(blocks, scales):
    return dequantize_mxfp4(blocks, scales).astype(np.float64)


@pytest.mark.parametrize("path", PATHS)
def test_matmul_is_gguf_mxfp4_bit_for_bit_on_every_path(path):
    rng = np.random.default_rng(3)
    blocks, scales = _mxfp4(rng, 37, 32 * 19, 100, 140)  # 19 blocks: the 8-block tail too
    x = rng.standard_normal((6, 32 * 19)).astype(np.float32)
    x[1] *= 1e-30
    x[4, :40] = 0.0
    got = _quant.matmul("mxfp4_oss", blocks, x, path=path, scales=scales)
    want = _quant.matmul("mxfp4", _as_gguf(blocks, scales), x, path="scalar")
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    # and within half a q8 step per value of the float64 product (plus float32 summation)
    W = _values(blocks, scales)
    d, q, _ = _quant.quantize_q8(x)
    step = np.repeat(d.astype(np.float64), 32, axis=1)
    bound = (step / 2) @ np.abs(W).T + (np.abs(q) * step) @ np.abs(W).T * 40 * 2.0**-24
    assert (np.abs(got - x.astype(np.float64) @ W.T) <= bound).all()


def _experts(rng, E, H, I):
    """E gpt-oss experts: (gate_up, its scales, its bias, down, its scales, its bias)."""
    out = []
    for _ in range(E):
        gu, gus = _mxfp4(rng, 2 * I, H)
        d, ds = _mxfp4(rng, H, I)
        gub = rng.standard_normal(2 * I).astype(np.float32)
        db = rng.standard_normal(H).astype(np.float32)
        out.append((gu, gus, gub, d, ds, db))
    return out


def _reference(experts, x, ids, w):
    """transformers' GptOssExperts in float64 on the dequantized weights."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    H, I = x.shape[1], experts[0][0].shape[0] // 2
    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=len(experts),
                          swiglu_limit=LIMIT)  # fmt: skip
    module = GptOssExperts(config).double()
    with torch.no_grad():
        for e, (gu, gus, gub, d, ds, db) in enumerate(experts):
            module.gate_up_proj[e] = torch.from_numpy(_values(gu, gus).T)
            module.gate_up_proj_bias[e] = torch.from_numpy(gub.astype(np.float64))
            module.down_proj[e] = torch.from_numpy(_values(d, ds).T)
            module.down_proj_bias[e] = torch.from_numpy(db.astype(np.float64))
        y = module(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(ids),
                   torch.from_numpy(w.astype(np.float64)))  # fmt: skip
    return y.numpy()


def _q8_bound(v, W, known=False):
    """|v W^T - q8(v) W^T| bounded: half a q8 step per value of v (known: v's own q8
    rounding) through |W|, plus float32 summation slack."""
    d, q, _ = _quant.quantize_q8(v.astype(np.float32))
    step = np.repeat(d.astype(np.float64), 32, axis=1)
    rounding = np.abs(v - q * step) if known else step / 2
    slack = (np.abs(q) * step) @ np.abs(W).T * (W.shape[1] / 32 + 16) * 2.0**-24
    return rounding @ np.abs(W).T + slack


def _bound(expert, x):
    """|y - y64| of one expert: the q8 rounding of x and of h carried through the clamps
    (1-Lipschitz) and g * sigmoid(alpha g) (slope in [-0.1, 1.1]), plus float32 slack."""
    gu, gus, gub, d, ds, db = expert
    Wgu, Wd = _values(gu, gus), _values(d, ds)
    h = x.astype(np.float64) @ Wgu.T + gub
    e = _q8_bound(x, Wgu, known=True) + 1e-6 * np.abs(h)
    g, u = np.minimum(h[:, ::2], LIMIT), np.clip(h[:, 1::2], -LIMIT, LIMIT)
    eg, eu = e[:, ::2], e[:, 1::2]
    glu = g / (1.0 + np.exp(-ALPHA * g))
    eh = 1.1 * eg * (np.abs(u) + 1 + eu) + np.abs(glu) * eu + 1e-6 * np.abs((u + 1) * glu)
    h_hi = np.abs((u + 1) * glu) + eh
    y = (u + 1) * glu @ Wd.T + db
    return eh @ np.abs(Wd).T + _q8_bound(h_hi, Wd) * 1.01 + 1e-6 * np.abs(y)


def _q8_values(x):
    """x's q8 rounding as float32: rows that q8 holds exactly."""
    d, q, _ = _quant.quantize_q8(x)
    return (q * np.repeat(d, 32, axis=1)).astype(np.float32)


def _routing(rng, T, E, k):
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    return ids, w


def _ffn_sum(experts, x, ids, w, **kwargs):
    """Every expert's rows in one ffn_sum call, as the integration makes them."""
    E = len(experts)
    order = np.argsort(ids.reshape(-1), kind="stable")
    counts = np.bincount(ids.reshape(-1), minlength=E)
    used = [e for e in range(E) if counts[e]]
    bounds = np.concatenate([[0], np.cumsum(counts[used])]).astype(np.int64)
    rows = (order // ids.shape[1]).astype(np.int64)
    scale = w.reshape(-1)[order].astype(np.float32)
    y = np.zeros(x.shape, np.float32)
    _quant.ffn_sum(x, [experts[e] for e in used], "mxfp4_oss", "gpt_oss", bounds, rows, scale,
                   y, alpha=ALPHA, limit=LIMIT, **kwargs)  # fmt: skip
    return y


def test_experts_within_their_stated_bound_of_transformers_in_float64():
    rng = np.random.default_rng(7)
    E, H, I, T, k = 4, 96, 64, 7, 2
    experts = _experts(rng, E, H, I)
    x = rng.standard_normal((T, H)).astype(np.float32)
    x[:4] = _q8_values(x[:4])  # rows the q8 rounding leaves as they are: a tight bound
    ids, w = _routing(rng, T, E, k)
    got = _ffn_sum(experts, x, ids, w).astype(np.float64)
    want = _reference(experts, x, ids, w)
    bound = np.zeros_like(want)
    for t in range(T):
        for j in range(k):
            bound[t] += w[t, j] * _bound(experts[ids[t, j]], x[t : t + 1])[0]
    err = np.abs(got - want)
    assert (err <= bound + 1e-6 * np.abs(want)).all(), (err / bound).max()
    assert (err[:4] <= bound[:4] / 2).all()  # tight enough to see a wrong bias or scale
    assert err.max() > 0
    # the clamps bite: some gate values above the limit, some up values beyond +-limit
    h = x.astype(np.float64) @ _values(*experts[0][:2]).T + experts[0][2]
    assert (h[:, ::2] > LIMIT).any() and (np.abs(h[:, 1::2]) > LIMIT).any()


def test_an_expert_past_one_calls_rows_runs_in_runs():
    """gpt_oss_experts takes more rows an expert than one kernel call does (a prefill's):
    each row's bits as when it runs alone."""
    rng = np.random.default_rng(11)
    expert = _experts(rng, 1, 96, 64)[0]
    T = 2 * _ffn.MAX_ROWS + 5
    x = rng.standard_normal((T, 96)).astype(np.float32)
    scale = rng.random(T).astype(np.float32)
    rows = rng.permutation(T).astype(np.int64)
    y = np.zeros_like(x)
    assert gpt_oss_experts(x, [expert], np.array([0, T], np.int64), rows, scale, y,
                           alpha=ALPHA, limit=LIMIT)  # fmt: skip
    want = np.zeros_like(x)
    for i in range(T):
        one = rows[i : i + 1], scale[i : i + 1]
        _quant.ffn_sum(x, [expert], "mxfp4_oss", "gpt_oss", np.array([0, 1], np.int64), *one,
                       want, alpha=ALPHA, limit=LIMIT)  # fmt: skip
    np.testing.assert_array_equal(y, want)
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("path", PATHS)
def test_experts_give_the_same_bits_on_every_path_and_thread_count(path):
    rng = np.random.default_rng(8)
    experts = _experts(rng, 3, 32 * 9, 96)  # 9 blocks a row: the 8-block tail
    x = rng.standard_normal((9, 32 * 9)).astype(np.float32)
    ids, w = _routing(rng, 9, 3, 2)
    want = _ffn_sum(experts, x, ids, w, path="scalar", num_threads=1)
    got = _ffn_sum(experts, x, ids, w, path=path)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("path", PATHS)
def test_a_nan_scale_byte_gives_nan_and_dequantize_names_it(path):
    rng = np.random.default_rng(9)
    blocks, scales = _mxfp4(rng, 4, 32 * 9)
    scales[2, 1] = 0xFF  # e8m0's NaN (a block the SIMD paths take; the ninth: the tail's)
    scales[3, 8] = 0xFF
    x = rng.standard_normal((2, 32 * 9)).astype(np.float32)
    y = _quant.matmul("mxfp4_oss", blocks, x, path=path, scales=scales)
    assert np.isnan(y[:, 2:]).all() and np.isfinite(y[:, :2]).all()
    with pytest.raises(FormatError, match=r"down_proj_scales: .* row 2, block 1 is 0xFF"):
        dequantize_mxfp4(blocks, scales, "down_proj_scales")


def _one(expert, x, **kwargs):
    n = x.shape[0]
    y = np.zeros(x.shape, np.float32)
    args = dict(alpha=ALPHA, limit=LIMIT) | kwargs
    qtype, act = args.pop("qtype", "mxfp4_oss"), args.pop("act", "gpt_oss")
    _quant.ffn_sum(x, [expert], qtype, act, np.array([0, n], np.int64),
                   np.arange(n, dtype=np.int64), np.ones(n, np.float32), y, **args)  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda e: (e[0][:, :-1].copy(), *e[1:]), "whole mxfp4_oss blocks|must be 128 rows"),
        (lambda e: (e[0][:-1].copy(), *e[1:]), "gate_up has 127 rows"),
        (lambda e: (e[0], e[1][:, :-1].copy(), *e[2:]), r"scales must be uint8 \[128, 2\]"),
        (lambda e: (*e[:4], e[4].astype(np.int8), e[5]), r"scales must be uint8 \[64, 2\]"),
        (lambda e: (*e[:5], e[5][:-1].copy()), r"biases must be float32 \[128\] and \[64\]"),
        (lambda e: e[:3], "gate_up, gate_up_scales, gate_up_bias"),
    ],
    ids=["truncated-blocks", "odd-rows", "truncated-scales", "scales-dtype", "bias", "arity"],
)
def test_bad_experts_are_clear_errors(change, match):
    expert = _experts(np.random.default_rng(1), 1, 64, 64)[0]
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match=match):
        _one(change(expert), x)


def test_types_and_activations_that_do_not_go_together_are_errors():
    expert = _experts(np.random.default_rng(2), 1, 64, 64)[0]
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="mxfp4_oss weights with act 'gpt_oss', both or neither"):
        _one(expert, x, act="silu")
    with pytest.raises(ValueError, match="both or neither"):
        _one(expert, x, qtype="mxfp4")
    blocks, scales = _mxfp4(np.random.default_rng(2), 2, 64)
    with pytest.raises(ValueError, match="scales= goes with mxfp4_oss"):
        _quant.matmul("mxfp4_oss", blocks, x)
    with pytest.raises(ValueError, match="keeps its scales apart"):
        _quant.dequantize("mxfp4_oss", blocks)
    with pytest.raises(ValueError, match="keeps its scales apart"):
        _quant.quantize(x, "mxfp4_oss")
