"""colibri.layer.rope against transformers' apply_rotary_pos_emb (torch's elementwise
operations, each rounded to the tensor's dtype) bit for bit, and its errors."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.layer import rope

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _numpy(t):
    return t.numpy() if t.dtype == torch.float32 else t.view(torch.int16).numpy().view(np.uint16)


def _theirs(x, cos, sin):
    """transformers' rotation of ``x [R, d]`` (as heads of one token)."""
    q = x[None, :, None, :]
    out, _ = apply_rotary_pos_emb(q, q, cos[None, None], sin[None, None])
    return out[0, :, 0, :]


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("rows, d", [(1, 2), (16, 64), (4, 128), (3, 6), (5, 256)])
def test_rows_equal_transformers_bit_for_bit(name, rows, d):
    dtype = DTYPES[name]
    g = torch.Generator().manual_seed(rows * 1000 + d)
    x = (torch.randn(rows, d, generator=g) * 4).to(dtype)
    angle = torch.rand(d, generator=g) * 4000  # positions far out: cos, sin of any sign
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    want = _theirs(x, cos, sin)
    ours = _numpy(x.clone()).copy()
    assert rope(ours, _numpy(cos), _numpy(sin), name) is ours
    np.testing.assert_array_equal(ours, _numpy(want.contiguous()))


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_rounding_each_product_matters(name):
    """Values where rounding the sum once (not each product) gives other bits."""
    dtype = DTYPES[name]
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 64, generator=g) * 3).to(dtype)
    angle = torch.rand(64, generator=g) * 100
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    once = x.float() * cos.float() + torch.cat((-x[:, 32:], x[:, :32]), 1).float() * sin.float()
    want = _theirs(x, cos, sin)
    assert not torch.equal(once.to(dtype), want)  # the test can tell the two apart
    ours = _numpy(x.clone()).copy()
    rope(ours, _numpy(cos), _numpy(sin), name)
    np.testing.assert_array_equal(ours, _numpy(want.contiguous()))


def _values(bits, dtype):
    if dtype == torch.float32:
        return bits
    return torch.from_numpy(bits.view(np.int16)).view(dtype).float().numpy()


def test_nonfinite_values_propagate_as_torchs():
    """NaN where torch gives NaN (its bits may differ: torch writes the canonical NaN),
    infinities and overflow as torch's."""
    x = torch.tensor([[1.0, float("nan"), 3.0, 4.0], [float("inf"), 1.0, -2.0, 6e4]])
    cos = torch.tensor([0.5, 1.0, -1.0, 2.0])
    sin = torch.tensor([0.25, 0.0, 1.0, 3.0])
    for name in DTYPES:
        dtype = DTYPES[name]
        xs, cs, ss = x.to(dtype), cos.to(dtype), sin.to(dtype)
        ours = _numpy(xs.clone()).copy()
        rope(ours, _numpy(cs), _numpy(ss), name)
        want = _values(_numpy(_theirs(xs, cs, ss).contiguous()), dtype)
        assert np.isnan(want).any() and np.isinf(want).any()
        np.testing.assert_array_equal(_values(ours, dtype), want)


def test_bad_input_is_named():
    x = np.zeros((2, 4), np.float32)
    c = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="even"):
        rope(np.zeros((2, 5), np.float32), np.ones(5, np.float32), np.ones(5, np.float32))
    with pytest.raises(ValueError, match=r"cos, sin \[4\]"):
        rope(x, np.ones(3, np.float32), c)
    with pytest.raises(ValueError, match="dtype must be one of"):
        rope(x, c, c, "float64")
    with pytest.raises(ValueError, match="uint16 for dtype='bfloat16'"):
        rope(x, c, c, "bfloat16")
    with pytest.raises(ValueError, match="writeable C-contiguous"):
        rope(np.zeros((4, 2), np.float32).T, c, c)
    frozen = x.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        rope(frozen, c, c)
    with pytest.raises(ValueError, match=r"\[R, d\]"):
        rope(np.zeros(4, np.float32), c, c)
    # an empty block of rows is nothing to do
    empty = np.zeros((0, 4), np.float32)
    assert rope(empty, c, c).shape == (0, 4)


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_simd_path_gives_the_same_bits(name):
    """Eight pairs at a time (AVX2, half a row a multiple of 8) or one (the base)."""
    from colibri.layer import _ffn, _norm, _rope

    dtype = DTYPES[name]
    kind = {"float32": 0, "bfloat16": _norm.KIND_BFLOAT16, "float16": _norm.KIND_FLOAT16}[name]
    for rows, d in [(3, 6), (16, 64), (2, 48), (5, 256)]:
        g = torch.Generator().manual_seed(d)
        x = (torch.randn(rows, d, generator=g) * 300).to(dtype)
        angle = torch.rand(d, generator=g) * 4000
        cos, sin = _numpy(angle.cos().to(dtype)), _numpy(angle.sin().to(dtype))
        outs = []
        for path in _ffn.runnable_paths():
            out = _numpy(x).copy()
            _rope.rope(out, cos, sin, kind, path)
            outs.append(out)
        assert all(np.array_equal(o, outs[0]) for o in outs[1:]), d
