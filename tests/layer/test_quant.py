"""Quantized weight blocks (include/colibri/quant.h) against the ``gguf`` package's
dequantization and a float64 product."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.layer import _ffn, _quant, fast_layout, quant_linear

gguf = pytest.importorskip("gguf")
from _support.blocks import F16_FIELDS, GGUF_TYPES  # noqa: E402
from _support.blocks import random_blocks as _blocks  # noqa: E402
from _support.blocks import write_gguf as _write_gguf  # noqa: E402


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "any-bytes"])
@pytest.mark.parametrize("qtype", list(GGUF_TYPES))
def test_dequantize_is_ggufs_bit_for_bit(qtype, finite):
    rng = np.random.default_rng(len(qtype) + 7 * finite)
    w = _blocks(rng, qtype, 6, 4, finite)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = gguf.quants.dequantize(w, GGUF_TYPES[qtype]).astype(np.float32)
    got = _quant.dequantize(qtype, w)
    assert got.shape == ref.shape == (6, 4 * _quant.BLOCK[qtype])
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    assert same.all(), np.argwhere(~same)[:5]


def test_q8_rows_round_half_away_from_zero():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 96)) * 4).astype(np.float32)
    x[0, :32] = np.arange(32) - 15.5  # amax 16: halves of d = 16/127 are not all exact
    x[1, 32:64] = 0.0
    d, q, s = _quant.quantize_q8(x)
    blocks = x.reshape(3, 3, 32)
    want_d = np.abs(blocks).max(-1) / np.float32(127)
    np.testing.assert_array_equal(d, want_d.astype(np.float32))
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = blocks / d[..., None]
    want_q = np.where(d[..., None] > 0, np.sign(ratio) * np.floor(np.abs(ratio) + 0.5), 0)
    np.testing.assert_array_equal(q.reshape(3, 3, 32), want_q.astype(np.int8))
    np.testing.assert_array_equal(s, q.reshape(3, 3, 32).astype(np.int32).sum(-1))
    assert np.abs(q).max() == 127


@pytest.mark.parametrize("qtype", list(GGUF_TYPES))
def test_matmul_within_the_activation_rounding_of_a_float64_product(qtype):
    rng = np.random.default_rng(11 + len(qtype))
    w = _blocks(rng, qtype, 24, 512 // _quant.BLOCK[qtype])
    x = rng.standard_normal((5, 512)).astype(np.float32)
    x[2] *= 1e-3
    x[3, :64] = 0.0
    got = _quant.matmul(qtype, w, x).astype(np.float64)
    W = _quant.dequantize(qtype, w).astype(np.float64)  # [24, 512]
    d, q, _ = _quant.quantize_q8(x)
    xq = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    # 1. the integer products are exact: only float32 summation separates the kernel from
    #    the float64 product of the dequantized weights and the q8 activations
    exact = xq @ W.T
    slack = (np.abs(xq) @ np.abs(W).T) * (512 / 32 + 16) * 2.0**-24
    assert (np.abs(got - exact) <= slack).all(), np.abs(got - exact).max()
    # 2. against the float activations: at most half a q8 step per value, plus that slack
    ref = x.astype(np.float64) @ W.T
    half_step = np.repeat(d.astype(np.float64) / 2, 32, axis=1)
    bound = half_step @ np.abs(W).T + slack
    assert (np.abs(got - ref) <= bound).all()


def test_matmul_is_wrong_when_a_level_is_wrong():
    """The bound above is tight enough to see one wrong level in a row."""
    rng = np.random.default_rng(5)
    w = _blocks(rng, "q8_0", 4, 8)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    good = _quant.matmul("q8_0", w, x)
    w[1, 2 + 34 * 3] ^= 0x40  # one int8 level of row 1, block 3
    bad = _quant.matmul("q8_0", w, x)
    assert (good[:, [0, 2, 3]] == bad[:, [0, 2, 3]]).all()
    assert (good[:, 1] != bad[:, 1]).all()


def test_non_finite_activations_give_nan_in_their_rows_only():
    rng = np.random.default_rng(9)
    w = _blocks(rng, "q4_k", 3, 2)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[0, 40] = np.inf
    x[2, 300] = np.nan
    y = _quant.matmul("q4_k", w, x)
    assert np.isnan(y[0]).all() and np.isnan(y[2]).all() and np.isfinite(y[1]).all()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda w, x: _quant.matmul("q3_k", w, x), ValueError, "must be one of q8_0"),
        (lambda w, x: _quant.matmul("q8_0", w[:, :-1], x), ValueError, "whole blocks of 34"),
        (lambda w, x: _quant.matmul("q8_0", w.view(np.int8), x), TypeError, "uint8"),
        (lambda w, x: _quant.matmul("q8_0", w, x.astype(np.float64)), ValueError, "float32"),
        (lambda w, x: _quant.matmul("q8_0", w, x[:, :32]), ValueError, r"\[n, 64\]"),
        (lambda w, x: _quant.dequantize("q4_k", w), ValueError, "whole blocks of 144"),
    ],
    ids=["type", "truncated-row", "dtype", "x-dtype", "x-width", "not-k-blocks"],
)
def test_bad_input_is_a_clear_error(call, error, match):
    w = _blocks(np.random.default_rng(0), "q8_0", 2, 2)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(error, match=match):
        call(w, x)


def _silu64(g):
    return g / (1.0 + np.exp(-np.clip(g, -500, 500)))


@pytest.mark.parametrize("qtype", list(GGUF_TYPES))
def test_ffn_within_its_stated_bound_of_a_float64_ffn(qtype):
    """|y - y64| is bounded by the q8 rounding of x and of h, carried through silu (whose
    slope lies in [-0.1, 1.1]), plus float32 summation slack."""
    rng = np.random.default_rng(21 + len(qtype))
    H, I, n = 512, 256, 3
    k = 512 // _quant.BLOCK[qtype]
    gate = _blocks(rng, qtype, I, k)
    up = _blocks(rng, qtype, I, k)
    down = _blocks(rng, qtype, H, 256 // _quant.BLOCK[qtype])
    x = rng.standard_normal((n, H)).astype(np.float32)
    y = _quant.ffn(qtype, gate, up, down, x).astype(np.float64)

    Wg, Wu, Wd = (_quant.dequantize(qtype, w).astype(np.float64) for w in (gate, up, down))
    x64 = x.astype(np.float64)
    g, u = x64 @ Wg.T, x64 @ Wu.T
    h64 = _silu64(g) * u
    y64 = h64 @ Wd.T

    def q8_bound(v, W):  # half a q8 step per value of v, plus summation slack
        d, q, _ = _quant.quantize_q8(v.astype(np.float32))
        step = np.repeat(d.astype(np.float64) / 2, 32, axis=1)
        vq = np.abs(q.astype(np.float64)) * np.repeat(d.astype(np.float64), 32, axis=1)
        return step @ np.abs(W).T + (vq @ np.abs(W).T) * (W.shape[1] / 32 + 16) * 2.0**-24

    eg, eu = q8_bound(x, Wg), q8_bound(x, Wu)
    eh = 1.1 * eg * (np.abs(u) + eu) + np.abs(_silu64(g)) * eu + 1e-6 * np.abs(h64)
    h_hi = np.abs(h64) + eh
    bound = eh @ np.abs(Wd).T + q8_bound(h_hi, Wd) * 1.01
    err = np.abs(y - y64)
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # q8 activations: not the float64 product itself


def test_ffn_gives_the_same_bits_on_any_threads_and_rows_one_at_a_time():
    rng = np.random.default_rng(4)
    gate, up = _blocks(rng, "q4_k", 96, 2), _blocks(rng, "q4_k", 96, 2)
    down = _blocks(rng, "q8_0", 512, 3)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    with pytest.raises(ValueError, match="not whole q4_k blocks of 256"):
        _quant.ffn("q4_k", gate, up, down, x)
    gate, up = _blocks(rng, "q8_0", 96, 16), _blocks(rng, "q8_0", 96, 16)
    one = _quant.ffn("q8_0", gate, up, down, x, num_threads=1)
    two = _quant.ffn("q8_0", gate, up, down, x, num_threads=2)
    rows = np.concatenate([_quant.ffn("q8_0", gate, up, down, x[i : i + 1]) for i in range(6)])
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(one, rows)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(up=slice(0, 64)), "expert shapes disagree"),
        (dict(down=slice(0, 256)), "expert shapes disagree"),
        (dict(act="swish"), "act must be one of silu"),
        (dict(x=np.ones((65, 512), np.float32)), r"65 rows \(1 to 64\)"),
        (dict(x=np.ones((1, 256), np.float32)), "gate must be 96 rows of 256 q8_0 values"),
    ],
    ids=["up-rows", "down-rows", "act", "rows", "x-width"],
)
def test_ffn_bad_input(change, match):
    rng = np.random.default_rng(6)
    args = dict(
        gate=_blocks(rng, "q8_0", 96, 16), up=_blocks(rng, "q8_0", 96, 16),
        down=_blocks(rng, "q8_0", 512, 3), x=np.ones((2, 512), np.float32), act="silu",
    )  # fmt: skip
    for key, value in change.items():
        args[key] = args[key][value] if isinstance(value, slice) else value
    with pytest.raises(ValueError, match=match):
        _quant.ffn("q8_0", **args)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k", "iq4_xs"])
def test_ffn_is_its_two_products_bit_for_bit(qtype):
    """With relu (exact in float32), the fused kernel is matmul, relu * up, then matmul."""
    rng = np.random.default_rng(8 + len(qtype))
    H, I = 512, 768
    gate = _blocks(rng, qtype, I, H // _quant.BLOCK[qtype])
    up = _blocks(rng, qtype, I, H // _quant.BLOCK[qtype])
    down = _blocks(rng, qtype, H, I // _quant.BLOCK[qtype])
    x = rng.standard_normal((5, H)).astype(np.float32)
    g, u = _quant.matmul(qtype, gate, x), _quant.matmul(qtype, up, x)
    h = np.where(g > 0, g, np.float32(0) * g) * u
    want = _quant.matmul(qtype, down, h)
    np.testing.assert_array_equal(_quant.ffn(qtype, gate, up, down, x, act="relu"), want)


PATHS = _ffn.runnable_paths()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", list(GGUF_TYPES))
def test_every_simd_path_gives_the_scalar_bits(qtype, path):
    rng = np.random.default_rng(30 + len(qtype) + len(path))
    K = 1024 + (32 * 3 if _quant.BLOCK[qtype] == 32 else 0)  # a tail beyond groups of 8
    w = _blocks(rng, qtype, 37, K // _quant.BLOCK[qtype])
    if qtype == "q8_0":
        w[:, 2:34] = 0x80  # level -128 (a file may hold it)
    x = rng.standard_normal((7, K)).astype(np.float32)
    x[1, :32] *= 1e-30
    x[4, 100] = np.nan
    want = _quant.matmul(qtype, w, x, path="scalar")
    got = _quant.matmul(qtype, w, x, path=path)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", list(GGUF_TYPES))
def test_every_simd_path_gives_the_scalar_bits_at_extreme_levels(qtype, path):
    """Every byte 0x00, 0xff, 0x80 or 0x7f (the largest levels of each sign: no int16
    saturation, no wrong offset in the unsigned-byte dot products) against q8 rows of
    +-127 of one sign, alternating signs, and random."""
    K = 512
    size, blocks = _quant.BLOCK_BYTES[qtype], K // _quant.BLOCK[qtype]
    w = np.repeat(np.array([0x00, 0xFF, 0x80, 0x7F], np.uint8), blocks * size).reshape(4, -1)
    finite = _blocks(np.random.default_rng(3), qtype, 4, blocks).reshape(4, blocks, size)
    w = w.reshape(4, blocks, size)
    for at in F16_FIELDS[qtype]:
        w[:, :, at : at + 2] = finite[:, :, at : at + 2]
    if qtype == "mxfp4":
        w[:, :, 0] = finite[:, :, 0]
    w = w.reshape(4, -1)
    x = np.ones((5, K), np.float32)
    x[1] = -1
    x[2, 1::2] = -1
    x[3, ::3] = -1
    x[4] = np.random.default_rng(4).standard_normal(K)
    want = _quant.matmul(qtype, w, x, path="scalar")
    got = _quant.matmul(qtype, w, x, path=path)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("path", PATHS)
def test_held_q4_0_experts_give_ffn_sums_bits(path):
    """Held Q4_0 experts (on x86 a copy with rows interleaved by eight) give ffn_sum's bits
    on every path: random blocks, blocks of the largest levels against q8 values of +-127
    (the int16 sums of eight products at their largest), rows not whole groups of 8 blocks
    (H = 1120: 35 blocks; I = 160: 5), one and three rows."""
    rng = np.random.default_rng(len(path))
    E, H, I = 3, 1120, 160
    experts = [(_blocks(rng, "q4_0", I, H // 32), _blocks(rng, "q4_0", I, H // 32),
                _blocks(rng, "q4_0", H, I // 32)) for _ in range(E)]  # fmt: skip
    for nibbles in (0xFF, 0x00):  # levels +7 and -8 in every row of expert 1's gate and down
        for w, values in ((experts[1][0], H), (experts[1][2], I)):
            blocks = w.reshape(w.shape[0], values // 32, 18)
            blocks[nibbles // 0xFF :: 2, :, 2:] = nibbles
    held = _quant.Held(E, H, "silu", 4, path=path)
    for e, mats in enumerate(experts):
        assert held.hold(e, mats, "q4_0", "q4_0")
    for T, ids in ((1, [[2, 1]]), (3, [[0, 1], [1, 2], [2, 0]])):
        ids = np.array(ids, np.int64)
        x = rng.standard_normal((T, H)).astype(np.float32)
        x[0, : H // 2] = 1.0  # q8 values of 127
        x[T - 1, H // 2 :] = -1.0
        weights = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
        got = np.empty((T, H), np.float32)
        assert held.step(x, ids, weights, got, 0, 2) == 0
        order = np.argsort(ids.ravel(), kind="stable")  # expert by expert, tokens in order
        active = np.unique(ids)
        bounds = np.searchsorted(ids.ravel()[order], [*active, E]).astype(np.int64)
        want = np.zeros((T, H), np.float32)
        _quant.ffn_sum(x, [experts[e] for e in active], "q4_0", "silu", bounds,
                       (order // 2).astype(np.int64), weights.ravel()[order], want, 2,
                       path)  # fmt: skip
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_paged_gguf_experts_run_in_the_engine(tmp_path):
    """Q4_K gate/up and Q6_K down (as Q4_K_M files mix them), paged from a GGUF file under a
    two-expert budget: experts with up to QUANT_KERNEL_MAX_ROWS rows are the fused kernel's,
    bit for bit (in runs of 64 rows), and a long prefill's dequantizes into the numpy path,
    within float32 rounding."""
    from colibri import Pager
    from colibri.layer import QUANT_KERNEL_MAX_ROWS, run_experts

    rng = np.random.default_rng(12)
    big = QUANT_KERNEL_MAX_ROWS + 1
    E, H, I, T = 6, 512, 256, big + 2

    def stack(qtype, rows, values):
        return np.stack([_blocks(rng, qtype, rows, values // 256) for _ in range(E)])

    gate, up, down = stack("q4_k", I, H), stack("q4_k", I, H), stack("q6_k", H, I)
    _write_gguf(tmp_path / "m.gguf", [(("q4_k", gate), ("q4_k", up), ("q6_k", down))])
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.integers(0, E, (T, 2))
    ids[:, 0] = np.where(np.arange(T) < big, 5, ids[:, 0])  # expert 5: big rows, the rest few
    ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % E, ids[:, 1])
    weights = rng.uniform(0.1, 1.0, (T, 2)).astype(np.float32)
    expert_bytes = gate[0].nbytes + up[0].nbytes + down[0].nbytes
    with Pager(tmp_path / "m.gguf", budget_bytes=2 * expert_bytes, page_size_kb=4) as pager:
        y = run_experts(pager, 0, x, ids, weights, num_experts=E)

    fused = np.zeros((T, H), np.float32)
    plain = np.zeros((T, H), np.float64)
    for e in range(E):
        tokens, slots = np.nonzero(ids == e)
        if not len(tokens):
            continue
        if len(tokens) <= QUANT_KERNEL_MAX_ROWS:  # the fused kernel, added in expert order
            out = np.concatenate([
                _quant.ffn("q4_k", gate[e], up[e], down[e], x[tokens[i : i + 1]],
                           down_type="q6_k") for i in range(len(tokens))
            ])  # fmt: skip
            fused[tokens] += weights[tokens, slots][:, None] * out
        else:
            Wg, Wu = _quant.dequantize("q4_k", gate[e]), _quant.dequantize("q4_k", up[e])
            Wd = _quant.dequantize("q6_k", down[e])
            g, u = x[tokens] @ Wg.T, x[tokens] @ Wu.T
            h = g / (1 + np.exp(-np.clip(g, -80, 80))) * u
            plain[tokens] += weights[tokens, slots][:, None] * (h @ Wd.T)
    assert np.abs(plain).max() > 0 and np.abs(fused).max() > 0
    np.testing.assert_allclose(y, fused + plain, rtol=1e-4, atol=1e-4 * np.abs(plain).max())
    with Pager(tmp_path / "m.gguf", budget_bytes=2 * expert_bytes, page_size_kb=4) as pager:
        alone = run_experts(pager, 0, x[big:], ids[big:], weights[big:], num_experts=E)
    np.testing.assert_array_equal(alone, fused[big:])  # the last 2 rows: fused experts only


def test_a_corrupt_block_scale_is_an_error_naming_the_expert(tmp_path):
    """A NaN float16 scale in a file gives NaN sums from finite rows: the engine names the
    expert and the block instead of returning them; non-finite rows stay NaN, no error."""
    from colibri import FormatError, Pager
    from colibri.layer import run_experts

    rng = np.random.default_rng(13)
    E, H, I = 3, 256, 256
    gate = np.stack([_blocks(rng, "q4_k", I, 1) for _ in range(E)])
    up = np.stack([_blocks(rng, "q4_k", I, 1) for _ in range(E)])
    down = np.stack([_blocks(rng, "q8_0", H, 8) for _ in range(E)])
    down[2, 5, 34 * 3 : 34 * 3 + 2] = np.array([np.nan], np.float16).view(np.uint8)
    _write_gguf(tmp_path / "m.gguf", [(("q4_k", gate), ("q4_k", up), ("q8_0", down))])
    x = rng.standard_normal((2, H)).astype(np.float32)
    ids, weights = np.array([[0, 1], [1, 2]]), np.full((2, 2), 0.5, np.float32)
    with Pager(tmp_path / "m.gguf", budget_bytes=1 << 20, page_size_kb=4) as pager:
        y = run_experts(pager, 0, x[:1], ids[:1], weights[:1], num_experts=E)
        assert np.isfinite(y).all()
        with pytest.raises(FormatError, match=r"expert 2: its down weights hold a non-finite "
                           r"q8_0 block scale \(row 5, byte 102\)"):  # fmt: skip
            run_experts(pager, 0, x, ids, weights, num_experts=E)
        x[1, 0] = np.inf
        y = run_experts(pager, 0, x, ids, weights, num_experts=E)
        assert np.isfinite(y[0]).all() and not np.isfinite(y[1]).all()


@pytest.mark.parametrize("qtype", list(GGUF_TYPES))
def test_quant_linear_is_matmuls_bits_on_every_path_and_thread_count(qtype):
    """The pooled linear kernel gives matmul's bits (themselves bounded against a float64
    product above) plus the bias in float32: 300 output rows are several chunks, 9 input
    rows three passes of at most 4."""
    rng = np.random.default_rng(21 + len(qtype))
    w = _blocks(rng, qtype, 300, 1024 // _quant.BLOCK[qtype])
    x = rng.standard_normal((9, 1024)).astype(np.float32)
    bias = rng.standard_normal(300).astype(np.float32)
    want = _quant.matmul(qtype, w, x, path="scalar")
    for n in (1, 4, 9):
        for threads in (1, 2, 3):
            np.testing.assert_array_equal(quant_linear(x[:n], w, qtype, None, threads), want[:n])
        got = quant_linear(x[:n], w, qtype, bias, 2)
        np.testing.assert_array_equal(got, want[:n] + bias)
    for path in PATHS:
        y = np.empty((9, 300), np.float32)
        _quant.linear(qtype, w, x, y, 2, path=path)
        np.testing.assert_array_equal(y, want)
    assert quant_linear(x[:0], w, qtype).shape == (0, 300)


def test_interleaved_q4_0_is_q4_0s_bits_on_every_path():
    """Q4_0 rows interleaved by eight give matmul's Q4_0 bits: 304 rows (38 groups, several
    chunks), 9 input rows, K = 1120 (35 blocks: not whole groups of 8 blocks), the largest
    levels against q8 values of 127, every path and thread count; a row count that is not
    whole groups, a truncated row and the other functions are refused."""
    rng = np.random.default_rng(40)
    w = _blocks(rng, "q4_0", 304, 35)
    w.reshape(304, 35, 18)[:8, :, 2:] = 0xFF  # level +7 in every value of group 0
    x = rng.standard_normal((9, 1120)).astype(np.float32)
    x[0] = 1.0
    want = _quant.matmul("q4_0", w, x, path="scalar")
    packed = _quant.interleave(w)
    assert packed.shape == w.shape and not np.array_equal(packed, w)
    for path in PATHS:
        for threads in (1, 2):
            y = np.empty((9, 304), np.float32)
            _quant.linear(_quant.Q4_0X8, packed, x, y, threads, path=path)
            np.testing.assert_array_equal(y, want)
    fast, qtype = fast_layout(w, "q4_0")  # the public way: interleaved where it is faster
    assert qtype == (_quant.Q4_0X8 if _quant.INTERLEAVE_FAST else "q4_0")
    np.testing.assert_array_equal(quant_linear(x, fast, qtype, num_threads=2), want)
    assert fast_layout(w[:12], "q4_0")[1] == "q4_0"  # not whole groups: as stored
    assert fast_layout(w, "q8_0")[0] is w
    with pytest.raises(ValueError, match="q4_0x8 weights hold their rows in groups of 8"):
        _quant.interleave(w[:12])
    with pytest.raises(ValueError, match="q4_0x8 weights hold their rows in groups of 8"):
        _quant.linear(_quant.Q4_0X8, packed[:12], x, np.empty((9, 12), np.float32))
    with pytest.raises(ValueError, match="whole blocks of 18 bytes"):
        _quant.interleave(w[:, :-1].copy())
    with pytest.raises(ValueError, match="quantized type must be one of"):
        _quant.matmul(_quant.Q4_0X8, packed, x)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quant_linear_in_half_precision_rounds_the_float32_result_once(dtype):
    """Half-precision bits in and out: the float32 product of the same values, rounded once
    to nearest even (as torch's ``.to(dtype)`` rounds), on every thread count."""
    from colibri._dlpack import bf16_to_float32, float32_to_bf16
    from colibri.layer import quant_linear

    rng = np.random.default_rng(21)
    w = _blocks(rng, "q4_k", 96, 4)
    x = rng.standard_normal((3, 1024)).astype(np.float32) * 4
    if dtype == "bfloat16":
        bits, values = float32_to_bf16(x), bf16_to_float32
        rounded = float32_to_bf16
    else:
        bits = x.astype(np.float16).view(np.uint16)
        values = lambda b: b.view(np.float16).astype(np.float32)  # noqa: E731
        rounded = lambda y: y.astype(np.float16).view(np.uint16)  # noqa: E731
    bias = rng.standard_normal(96).astype(np.float32)
    want = rounded(quant_linear(values(bits), w, "q4_k", bias))
    for threads in (1, 2):
        out = np.zeros((3, 96), np.uint16)
        got = quant_linear(bits, w, "q4_k", bias, threads, dtype=dtype, out=out)
        assert got is out
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"x and out must be uint16 for dtype='bfloat16'"):
        quant_linear(x, w, "q4_k", dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        quant_linear(bits, w, "q4_k", dtype="int8")
    with pytest.raises(ValueError, match="kind must be 0"):
        _quant.linear("q4_k", w, bits, np.zeros((3, 96), np.uint16), kind=7)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(x=np.zeros((2, 512), np.float32)), ValueError, r"x \[n, in\].*w 3 rows of 1024"),
        (dict(y=np.zeros((2, 4), np.float32)), ValueError, r"y \[n, out\]"),
        (dict(bias=np.zeros(4, np.float32)), ValueError, r"bias must be float32 \[3\]"),
        (dict(w=np.zeros((3, 1089), np.uint8)), ValueError, "whole blocks of 34 bytes"),
        (dict(qtype="q5_0"), ValueError, "quantized type must be one of"),
        (dict(x=np.zeros((2, 1024))), ValueError, "dtype mismatch"),
        (dict(x=np.zeros((1024, 2), np.float32).T), ValueError, "contiguous"),
    ],
    ids=["in", "out", "bias", "truncated-rows", "type", "float64", "strided"],
)
def test_quant_linear_bad_input(change, error, match):
    args = dict(qtype="q8_0", w=np.zeros((3, 1088), np.uint8), x=np.zeros((2, 1024), np.float32),
                y=np.zeros((2, 3), np.float32), bias=None)  # fmt: skip
    args.update(change)
    with pytest.raises(error, match=match):
        _quant.linear(args["qtype"], args["w"], args["x"], args["y"], 1, args["bias"])
