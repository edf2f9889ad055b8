"""float8 experts (include/colibri/fp8.h): e4m3fn weights with 128 x 128 block scales, against
independent references: ml_dtypes' and torch's e4m3fn decodings and a float64 numpy product.

Bounds: the kernel sums in float32 (products rounded, 128-column blocks in 16 lanes, then
scaled), so a product ``W x`` is within ``K * 2^-23`` (a float32 sum's worst case, K the row
length) of ``sum |W x|``; the tests use ``2e-6 * K`` times that sum. A whole FFN (two such
products and the activation): ``1e-4`` of its largest output. Every SIMD path and thread
count: the same bits as the scalar path.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri import Pager
from colibri.formats import FP8_BLOCKED, ExpertWeights, FormatError, open_weights
from colibri.layer import _ffn, _fp8
from colibri.layer._engine import run_experts
from colibri.layer._expert import FP8_KERNEL_MAX_ROWS, dequantized, gated_ffn

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")


def _weights(rng, rows, cols):
    """Random finite e4m3fn bytes (no NaN: 0x7F / 0xFF redrawn) and float32 block scales."""
    w = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x3C
    scale = rng.uniform(1e-3, 4e-3, _fp8.scale_shape(rows, cols)).astype(np.float32)
    return w, scale


def _reference(w, scale):
    """The real weight in float64, decoded by ml_dtypes (independent of colibri's table)."""
    values = w.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    full = np.kron(scale.astype(np.float64), np.ones((128, 128)))[: w.shape[0], : w.shape[1]]
    return values * full


def _silu(v):
    return v / (1.0 + np.exp(-v))


def test_table_is_e4m3fn():
    codes = np.arange(256, dtype=np.uint8)
    by_ml = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    by_torch = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(_fp8.table(), by_ml)
    np.testing.assert_array_equal(_fp8.table(), by_torch)
    assert np.isnan(_fp8.table()[[0x7F, 0xFF]]).all() and _fp8.table()[0x7E] == 448


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (7, 20), (130, 129)])
def test_matmul_every_path_same_bits(shape):
    rng = np.random.default_rng(sum(shape))
    w, scale = _weights(rng, *shape)
    x = rng.standard_normal((5, shape[1])).astype(np.float32)
    ref = x.astype(np.float64) @ _reference(w, scale).T
    bound = 2e-6 * shape[1] * (np.abs(x).astype(np.float64) @ np.abs(_reference(w, scale)).T)
    first = None
    for path in _ffn.runnable_paths():
        y = _fp8.matmul(w, scale, x, path)
        assert np.all(np.abs(y - ref) <= bound), path
        if first is None:
            first = y
        np.testing.assert_array_equal(y.view(np.uint32), first.view(np.uint32), err_msg=path)
    np.testing.assert_array_equal(
        _fp8.dequantize(w, scale), _reference(w, scale).astype(np.float32)
    )


def test_every_byte_decodes_as_ml_dtypes_on_every_path():
    """Each of the 256 bytes (subnormals, both zeros, NaN) as the one nonzero weight of its
    row, in every lane of a block (x one-hot at that column), on every path: the value
    ml_dtypes gives, NaN where it gives NaN, the same bits on every path."""
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = np.ones(_fp8.scale_shape(256, 160), np.float32)
    for column in [*range(16), 130, 159]:  # every lane of a SIMD block, and a partial tail
        w = np.zeros((256, 160), np.uint8)
        w[:, column] = codes
        x = np.zeros((1, 160), np.float32)
        x[0, column] = 1.0
        first = None
        for path in _ffn.runnable_paths():
            y = _fp8.matmul(w, scale, x, path)[0]
            np.testing.assert_array_equal(y, want, err_msg=f"{path}, column {column}")
            if first is None:
                first = y
            np.testing.assert_array_equal(y.view(np.uint32), first.view(np.uint32), err_msg=path)


def _expert(rng, H, I):
    (g, gs), (u, us), (d, ds) = _weights(rng, I, H), _weights(rng, I, H), _weights(rng, H, I)
    return ExpertWeights(g, u, d, FP8_BLOCKED, scales=(gs, us, ds))


def _ffn_reference(x, e):
    g, u, d = (_reference(m, s) for m, s in zip(e, e.scales, strict=True))
    x = x.astype(np.float64)
    return (_silu(x @ g.T) * (x @ u.T)) @ d.T


@pytest.mark.parametrize("H, I", [(256, 128), (160, 200)])
def test_ffn_against_float64_every_path_and_thread_count(H, I):
    rng = np.random.default_rng(H + I)
    e = _expert(rng, H, I)
    x = rng.standard_normal((3, H)).astype(np.float32)
    ref = _ffn_reference(x, e)
    y0 = _fp8.ffn(*e, e.scales, x, "silu", 1, "scalar")
    np.testing.assert_allclose(y0, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    for path in _ffn.runnable_paths():
        for threads in (1, 2, 3):
            y = _fp8.ffn(*e, e.scales, x, "silu", threads, path)
            np.testing.assert_array_equal(y.view(np.uint32), y0.view(np.uint32))
    # the numpy entry point: the kernel for few rows, dequantized float32 GEMMs for many
    np.testing.assert_array_equal(gated_ffn(x, e, "silu"), y0)
    many = rng.standard_normal((FP8_KERNEL_MAX_ROWS + 1, H)).astype(np.float32)
    ref_many = _ffn_reference(many, e)
    np.testing.assert_allclose(gated_ffn(many, e, "silu"), ref_many, rtol=0,
                               atol=1e-4 * np.abs(ref_many).max())  # fmt: skip


def test_bfloat16_scales_and_raw_bytes():
    rng = np.random.default_rng(3)
    e = _expert(rng, 128, 128)
    bf16 = tuple(s.astype(ml_dtypes.bfloat16) for s in e.scales)
    as_f32 = tuple(s.astype(np.float32) for s in bf16)
    fp8 = tuple(np.asarray(m).view(ml_dtypes.float8_e4m3fn) for m in e)
    x = rng.standard_normal((2, 128)).astype(np.float32)
    a = gated_ffn(x, ExpertWeights(*fp8, FP8_BLOCKED, scales=bf16), "silu")
    b = gated_ffn(x, ExpertWeights(*e, FP8_BLOCKED, scales=as_f32), "silu")
    np.testing.assert_array_equal(a, b)


def test_expert_weights_need_scales_exactly_for_fp8():
    w = np.zeros((128, 128), np.uint8)
    with pytest.raises(ValueError, match="need scales"):
        ExpertWeights(w, w, w, FP8_BLOCKED)
    with pytest.raises(ValueError, match="need scales"):
        ExpertWeights(w, w, w, "uint8", scales=(w, w, w))


@pytest.mark.parametrize("where, what", [("scale", "nan"), ("scale", "inf"), ("byte", 0x7F),
                                         ("byte", 0xFF)])  # fmt: skip
def test_nonfinite_is_named(where, what):
    rng = np.random.default_rng(5)
    e = _expert(rng, 128, 256)
    (g, u, d), (gs, us, ds) = (np.array(m) for m in e), (np.array(s) for s in e.scales)
    if where == "scale":
        us[1, 0] = float(what)
        match = r"up_proj.weight: its block scale \(up_proj.weight_scale_inv\) \[1, 0\] is"
    else:
        d[3, 200] = what
        match = rf"down_proj.weight: its e4m3 byte \[3, 200\] is 0x{what:02X}"
    bad = ExpertWeights(g, u, d, FP8_BLOCKED, scales=(gs, us, ds))
    x = rng.standard_normal((2, 128)).astype(np.float32)
    with pytest.raises(FormatError, match=match):
        gated_ffn(x, bad, "silu")  # the kernel
    with pytest.raises(FormatError, match=match):
        dequantized(bad, "layer 0 expert 1")  # many rows, fallbacks


def test_scale_shape_checked():
    w = np.zeros((130, 256), np.uint8)
    with pytest.raises(ValueError, match=r"scales must be \[2, 2\]"):
        _fp8.matmul(w, np.ones((1, 2), np.float32), np.zeros((1, 256), np.float32))


def test_paged_from_safetensors_through_the_engine(tmp_path):
    """Experts written as fp8 + weight_scale_inv, paged as stored under a budget of two
    experts, computed by the engine (kernel and dequantized paths) against float64."""
    from safetensors.torch import save_file

    rng = np.random.default_rng(7)
    H, I, E = 160, 136, 4
    experts = [_expert(rng, H, I) for _ in range(E)]
    tensors = {}
    for e, ex in enumerate(experts):
        for proj, m, s in zip(("gate_proj", "up_proj", "down_proj"), ex, ex.scales, strict=True):
            name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
            tensors[name] = torch.from_numpy(np.asarray(m)).view(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.from_numpy(np.asarray(s))
    save_file(tensors, tmp_path / "m.safetensors")
    source = open_weights(tmp_path / "m.safetensors")
    layout = source.layout(0, 1)
    assert layout.dtype == FP8_BLOCKED and len(layout.matrices) == 6
    assert layout.nbytes == 3 * H * I + 3 * (2 * 2) * 4  # bytes + three float32 [2, 2]
    T = FP8_KERNEL_MAX_ROWS + 4  # expert 2: T rows (dequantized path); the others few (kernel)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.array([[t % E, (t * 3 + 1) % E] for t in range(T)], np.int64)
    ids[ids[:, 0] != 2, 1] = 2
    weights = rng.uniform(0.2, 1, ids.shape).astype(np.float32)
    ref = np.zeros((T, H))
    for t in range(T):
        for j in range(2):
            ref[t] += weights[t, j] * _ffn_reference(x[t : t + 1], experts[ids[t, j]])[0]
    for io in ("read", "mmap"):
        with Pager(source, budget_bytes=2 * layout.nbytes + 8192, page_size_kb=4, io=io) as pager:
            y = run_experts(pager, 0, x, ids, weights, num_experts=E)
            with pager.load(0, [3]) as batch:
                assert batch[3].dtype == FP8_BLOCKED and batch[3].scales[2].shape == (2, 2)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
