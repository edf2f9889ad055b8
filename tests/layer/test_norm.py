"""colibri.layer.rms_norm against its formula in float64/torch and transformers' RMSNorm.

The kernel's mean of squares is exact to float32's rounding; the reference here computes the
same sum in float64 with torch, so the two agree bit for bit (the formula's every other step
is one IEEE operation). transformers' Qwen3MoeRMSNorm sums float32 squares in torch's order:
within one unit in the last place of the storage type, and equal for nearly every value.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri.layer import rms_norm

torch = pytest.importorskip("torch")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _numpy(t):
    return t.numpy() if t.dtype == torch.float32 else t.view(torch.int16).numpy().view(np.uint16)


def _torch(a, dtype):
    if dtype == torch.float32:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(np.int16)).view(dtype)


def _reference(x, w, eps):
    """The formula, the mean of squares summed in float64 and rounded once, each other step
    one IEEE float32 operation (numpy's: torch's vectorized float32 ``sqrt`` is one unit in
    the last place off for some inputs on some CPUs, e.g. AMD Zen 4)."""
    h = x.float()
    v = ((h.double() ** 2).sum(-1, keepdim=True) / h.shape[-1]).float().numpy()
    r = torch.from_numpy(np.float32(1) / np.sqrt(v + np.float32(eps)))
    return w * (h * r).to(x.dtype)


def _case(seed, rows, n, dtype, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * scale).to(dtype)
    w = (torch.rand(n, generator=g) * 2 - 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("rows, n", [(1, 1), (1, 3), (2, 64), (3, 1027), (8, 2048)])
def test_bits_of_the_formula(name, rows, n):
    dtype = DTYPES[name]
    for seed, scale in [(0, 3.0), (1, 1e-3), (2, 200.0)]:
        x, w = _case(seed + n, rows, n, dtype, scale)
        got = _torch(rms_norm(_numpy(x), _numpy(w), 1e-6, name), dtype)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(got, _reference(x, w, 1e-6))


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_within_one_ulp_of_transformers(name):
    transformers = pytest.importorskip("transformers")
    norm_cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm
    dtype = DTYPES[name]
    module = norm_cls(1024, eps=1e-6).to(dtype)
    x, w = _case(7, 64, 1024, dtype)
    with torch.no_grad():
        module.weight.copy_(w)
        want = module(x)
    got = _torch(rms_norm(_numpy(x), _numpy(w), 1e-6, name), dtype)
    # half types: one rounding of the same float32 value; float32: two (x r, then w h)
    ulp = (1 if dtype != torch.float32 else 4) * torch.finfo(dtype).eps * want.float().abs()
    assert ((got.float() - want.float()).abs() <= ulp).all()
    if dtype != torch.float32:
        assert (got == want).float().mean().item() >= 0.99


def test_in_place():
    x, w = _case(4, 5, 96, torch.bfloat16)
    want = _reference(x, w, 1e-5)
    bits = _numpy(x.clone())
    assert rms_norm(bits, _numpy(w), 1e-5, "bfloat16", out=bits) is bits
    assert torch.equal(_torch(bits, torch.bfloat16), want)
    with pytest.raises(ValueError, match=r"out must be C-contiguous uint16 \[5, 96\]"):
        rms_norm(_numpy(x), _numpy(w), 1e-5, "bfloat16", out=np.empty((5, 96), np.float32))


def test_nonfinite_rows_give_nan_as_torch_does():
    x, w = _case(3, 3, 16, torch.bfloat16)
    x[0, 5] = float("inf")
    x[1, 2] = float("nan")
    got = _torch(rms_norm(_numpy(x), _numpy(w), 1e-6, "bfloat16"), torch.bfloat16)
    want = _reference(x, w, 1e-6)
    assert torch.equal(got.isnan(), want.isnan())  # inf: NaN where it was, 0 elsewhere
    assert got[0, 5].isnan() and not got[0, :5].isnan().any() and got[1].isnan().all()
    keep = ~want.isnan()
    assert torch.equal(got[keep], want[keep])


def test_zero_rows_and_eps():
    x = np.zeros((2, 8), np.float32)
    w = np.ones(8, np.float32)
    np.testing.assert_array_equal(rms_norm(x, w, 1e-5), x)  # 0 * (1 / sqrt(eps))
    assert rms_norm(np.zeros((0, 8), np.float32), w, 1e-5).shape == (0, 8)


def test_bad_input():
    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        rms_norm(x, np.ones(7, np.float32), 1e-6)
    with pytest.raises(ValueError, match=r"both uint16 for dtype='bfloat16'"):
        rms_norm(x, w, 1e-6, "bfloat16")
    with pytest.raises(ValueError, match=r"x must be \[T, n\]"):
        rms_norm(np.ones(8, np.float32), w, 1e-6)
    with pytest.raises(ValueError, match="dtype must be one of"):
        rms_norm(x, w, 1e-6, "float64")
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            rms_norm(x, w, eps)
    y = rms_norm(np.asfortranarray(np.ones((3, 8), np.float32)), w, 1e-6)  # made contiguous
    np.testing.assert_allclose(y, 1.0, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_simd_path_gives_the_same_bits(name):
    """Eight values at a time (AVX2) or one (the base): rows of every length mod 8, out as x
    itself too, values that round up, subnormals, infinities."""
    from colibri.layer import _ffn, _norm

    dtype = DTYPES[name]
    kind = {"float32": 0, "bfloat16": _norm.KIND_BFLOAT16, "float16": _norm.KIND_FLOAT16}[name]
    for n in (3, 8, 13, 64, 1027):
        x, w = _case(n, 3, n, dtype, 30.0)
        x[1, n // 2] = float("inf") if n > 3 else 1e-40
        x, w = _numpy(x), _numpy(w)
        outs = []
        for path in _ffn.runnable_paths():
            out = np.empty_like(x)
            _norm.rms_norm(x, w, 1e-6, out, kind, path)
            same = x.copy()
            _norm.rms_norm(same, w, 1e-6, same, kind, path)
            assert same.tobytes() == out.tobytes()  # bits: a row with inf is NaN
            outs.append(out)
        assert all(o.tobytes() == outs[0].tobytes() for o in outs[1:]), n
