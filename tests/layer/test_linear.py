"""colibri's linear kernel (include/colibri/linear.h, ``_ffn.linear``): y = x @ W.T + b for
half-precision W, against a float64 numpy reference on every SIMD path this CPU runs."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.layer import _ffn

ml_dtypes = pytest.importorskip("ml_dtypes")

PATHS = _ffn.runnable_paths()
U = 2.0**-24  # float32 unit roundoff
SPLIT = 2.0**-17  # x as two bfloat16 parts (the avx512_bf16 path, bfloat16 weights)
HALVES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def reference(x, w, bias=None):
    """float64 result and the bound the kernel must meet, elementwise: a float32 dot
    product of length K (exact products of float32 x and half w) and the bias added after
    it are within (K + 1) u (sum |w x| + |b|) of the exact value; the bf16 path's split of
    x adds 2^-17 sum |w x|."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    b64 = np.zeros(w64.shape[0]) if bias is None else np.asarray(bias, np.float64)
    size = np.abs(x64) @ np.abs(w64).T + np.abs(b64)
    return x64 @ w64.T + b64, ((w64.shape[1] + 1) * U + SPLIT) * size + 1e-30


def _data(seed, n, inp, out, dtype, bias=True):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(HALVES[dtype])
    x = rng.standard_normal((n, inp)).astype(np.float32)
    b = rng.standard_normal(out).astype(np.float32) if bias else None
    return x, w, b


def _run(x, w, bias=None, path=None, threads=0):
    y = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    _ffn.linear(x, w.view(np.uint16), _ffn.WEIGHT_KINDS[w.dtype.name], y, threads, bias, path)
    return y


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "n, inp, out, bias",
    [(1, 64, 48, True), (3, 37, 29, False), (5, 33, 70, True), (8, 300, 130, True),
     (1, 1, 1, False), (2, 31, 700, True), (13, 96, 40, False)],
)  # fmt: skip
def test_every_path_within_the_stated_bound(path, dtype, n, inp, out, bias):
    x, w, b = _data(n * 1000 + inp + out, n, inp, out, dtype, bias)
    ref, bound = reference(x, w, b)
    y = _run(x, w, b, path)
    assert np.all(np.abs(y - ref) <= bound), np.max(np.abs(y - ref) / bound)


@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_simd_paths_agree_with_plain_c(path, dtype):
    """Paths differ only in summation order: each within twice the bound of plain C."""
    x, w, b = _data(3, 7, 300, 130, dtype)
    _, bound = reference(x, w, b)
    np.testing.assert_array_less(np.abs(_run(x, w, b, path) - _run(x, w, b, "scalar")), 2 * bound)


@pytest.mark.parametrize("path", PATHS)
def test_threads_give_the_same_bits(path):
    x, w, b = _data(11, 4, 256, 1500, "bfloat16")
    one = _run(x, w, b, path, threads=1)
    for threads in (2, 3, 0):
        np.testing.assert_array_equal(_run(x, w, b, path, threads), one)


def test_plain_c_sums_in_order():
    """The scalar path is a float32 loop over k in order, bit for bit (the expert kernel's
    dot product, which the linear reuses)."""
    x, w, _ = _data(4, 2, 40, 24, "float16", bias=False)
    y = _run(x, w, path="scalar")
    want = np.zeros_like(y)
    for r in range(2):
        for o in range(24):
            acc = np.float32(0)
            for k in range(40):
                acc = np.float32(acc + np.float32(w[o, k]) * x[r, k])
            want[r, o] = acc
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("path", PATHS)
def test_special_values_propagate(path):
    x, w, b = _data(5, 3, 40, 24, "float16")
    x[1, 7] = np.nan
    w = w.copy()
    w[5, :] = np.inf
    y = _run(x, w, b, path)
    assert np.isnan(y[1]).all()
    with np.errstate(all="ignore"):
        ref, _ = reference(x, w, b)
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))


def test_strided_rows():
    """Weight rows and x / y rows at any row stride (each row contiguous)."""
    x, w, b = _data(2, 3, 64, 40, "bfloat16")
    wide_w = np.zeros((40, 80), w.dtype)
    wide_w[:, :64] = w
    wide_x = np.zeros((3, 70), np.float32)
    wide_x[:, :64] = x
    y = np.zeros((3, 50), np.float32)
    kind = _ffn.WEIGHT_KINDS["bfloat16"]
    _ffn.linear(wide_x[:, :64], wide_w.view(np.uint16)[:, :64], kind, y[:, :40], 0, b)
    np.testing.assert_array_equal(y[:, :40], _run(x, w, b))
    assert not y[:, 40:].any()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(y=np.zeros((2, 5), np.float32)), r"y \[n, out\]"),
        (dict(w=np.zeros((6, 9), np.uint16)), r"w \[out, in\]"),
        (dict(bias=np.zeros(5, np.float32)), r"bias must be float32 \[6\]"),
        (dict(kind=7), "kind must be one of"),
        (dict(w=np.zeros((6, 16), np.uint16)[:, ::2]), "w rows must be contiguous"),
        (dict(x=np.zeros((2, 16), np.float32)[:, ::2]), "x and y rows must be contiguous"),
        (dict(x=np.zeros((2, 0), np.float32), w=np.zeros((6, 0), np.uint16)), "in = 0"),
        (dict(path="no_such_path"), "path must be one of"),
    ],
)
def test_bad_input(change, message):
    args = dict(
        x=np.zeros((2, 8), np.float32), w=np.zeros((6, 8), np.uint16), kind=2,
        y=np.zeros((2, 6), np.float32), bias=None, path=None,
    )  # fmt: skip
    args.update(change)
    with pytest.raises(ValueError, match=message):
        _ffn.linear(args["x"], args["w"], args["kind"], args["y"], 0, args["bias"], args["path"])


def test_no_rows_is_nothing():
    y = np.zeros((0, 6), np.float32)
    _ffn.linear(np.zeros((0, 8), np.float32), np.zeros((6, 8), np.uint16), 2, y, 0)
