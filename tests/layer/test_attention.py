"""colibri.layer.attention against the formula in float64 (torch), with grouped heads,
masks, half precision in and out, and hostile input.

The kernel computes in float32 in a fixed order and rounds once: float32 results agree with
float64 to a few units of float32's last place; half-precision results lie within one unit
in the last place of the float64 result rounded to that type.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri.layer import attention

torch = pytest.importorskip("torch")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _numpy(t):
    return t.numpy() if t.dtype == torch.float32 else t.view(torch.uint16).numpy()


def _torch(a, dtype):
    return torch.from_numpy(a) if dtype == torch.float32 else torch.from_numpy(a).view(dtype)


def _reference(q, k, v, scale, mask=None):
    """float64 ``[T, Hq, D]``: softmax(scale q k^T + mask) v, key/value head h // G."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = scale * q @ k.transpose(1, 2)
    if mask is not None:
        s = s + torch.from_numpy(mask).double()
    return (s.softmax(-1) @ v).transpose(0, 1)


def _case(seed, hq, hkv, t, length, d, dtype, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(hq, t, d, generator=g) * spread).to(dtype)
    k = (torch.randn(hkv, length, d, generator=g) * spread).to(dtype)
    v = torch.randn(hkv, length, d, generator=g).to(dtype)
    return q, k, v


def _check(ours, want, dtype):
    if dtype == torch.float32:
        np.testing.assert_allclose(ours.double(), want, rtol=2e-5, atol=2e-6)
        return
    rounded = want.to(dtype).double()
    ulp = torch.finfo(dtype).eps * rounded.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((ours.double() - want).abs() <= ulp).all()


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize(
    "hq, hkv, t, length, d",
    [(1, 1, 1, 1, 8), (4, 4, 1, 7, 64), (16, 4, 1, 33, 64), (8, 2, 3, 50, 80), (6, 1, 2, 9, 5)],
)
def test_the_formula(name, hq, hkv, t, length, d):
    dtype = DTYPES[name]
    for seed, spread in [(0, 1.0), (1, 4.0)]:
        q, k, v = _case(seed + length, hq, hkv, t, length, d, dtype, spread)
        out = attention(_numpy(q), _numpy(k), _numpy(v), d**-0.5, name)
        assert out.shape == (t, hq, d)
        _check(_torch(out, dtype), _reference(q, k, v, d**-0.5), dtype)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_masks_and_out(name):
    dtype = DTYPES[name]
    q, k, v = _case(3, 8, 2, 3, 12, 64, dtype)
    mask = np.zeros((3, 12), np.float32)
    mask[0, 5:] = -np.inf  # causal-like rows, a large finite negative, a small bias
    mask[1, 9:] = -np.inf
    mask[2, :4] = np.finfo(np.float32).min
    mask[2, 4:] = np.linspace(-1, 1, 8, dtype=np.float32)
    out = np.full((3, 8, 64), 7, _numpy(q).dtype)
    got = attention(_numpy(q), _numpy(k), _numpy(v), 0.3, name, mask=mask, out=out)
    assert got is out
    _check(_torch(out, dtype), _reference(q, k, v, 0.3, mask), dtype)
    unmasked = attention(_numpy(q), _numpy(k), _numpy(v), 0.3, name)
    assert not np.array_equal(unmasked, out)  # the mask was applied


def test_same_bits_every_call_and_grouped_heads_share_keys():
    q, k, v = _case(4, 8, 2, 1, 40, 64, torch.bfloat16)
    a = attention(_numpy(q), _numpy(k), _numpy(v), 0.125, "bfloat16")
    b = attention(_numpy(q), _numpy(k), _numpy(v), 0.125, "bfloat16")
    assert np.array_equal(a, b)
    # heads 0-3 read key/value head 0, heads 4-7 head 1: the same query on both halves
    q2 = q.clone()
    q2[4:] = q2[:4]
    c = _torch(attention(_numpy(q2), _numpy(k), _numpy(v), 0.125, "bfloat16"), torch.bfloat16)
    kk, vv = k[[0, 0]], v[[0, 0]]
    want = _reference(q2[:4], kk[:1], vv[:1], 0.125)
    _check(c[:, :4], want, torch.bfloat16)
    assert not torch.equal(c[:, :4], c[:, 4:])


def test_fully_masked_rows_and_no_keys_give_zeros():
    q, k, v = _case(5, 4, 2, 2, 6, 32, torch.float32)
    mask = np.zeros((2, 6), np.float32)
    mask[1] = -np.inf
    out = attention(q.numpy(), k.numpy(), v.numpy(), 0.2, mask=mask)
    assert (out[1] == 0).all() and (out[0] != 0).any()
    empty = attention(q.numpy(), k.numpy()[:, :0], v.numpy()[:, :0], 0.2)
    assert empty.shape == (2, 4, 32) and (empty == 0).all()


@pytest.mark.parametrize("length", [6, 20])  # the keys' tail alone; blocks of eight too
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_values_are_not_hidden(bad, length):
    q, k, v = _case(6, 4, 2, 1, length, 32, torch.float32)
    k[1, 3, 0] = bad  # key/value head 1: query heads 2 and 3
    q[2, 0, 0] = 1.0
    out = attention(q.numpy(), k.numpy(), v.numpy(), 0.2)
    assert np.isfinite(out[0, :2]).all()
    assert np.isnan(out[0, 2:]).any()


@pytest.mark.parametrize("length", [6, 20])
def test_a_query_of_nan_gives_nan_not_zeros(length):
    """Every score of a NaN query is NaN: its row is NaN, not a fully masked row's zeros."""
    q, k, v = _case(12, 4, 2, 1, length, 32, torch.float32)
    q[1, 0, 5] = np.nan
    out = attention(q.numpy(), k.numpy(), v.numpy(), 0.2)
    assert np.isnan(out[0, 1]).all()
    assert np.isfinite(out[0, [0, 2, 3]]).all()


@pytest.mark.parametrize("at", [3, 17])  # in a block of eight scores, or in the tail
def test_a_nan_score_among_masked_keys_gives_nan_on_every_path(at):
    """A row whose keys are all masked but one with a NaN score: NaN, not the zeros of a
    fully masked row, whichever scores the vector loops see."""
    from colibri.layer import _attention, _ffn

    q, k, v = (t.numpy() for t in _case(13, 4, 2, 1, 18, 32, torch.float32))
    k[0, at, 7] = np.nan  # key/value head 0: query heads 0 and 1
    mask = np.full((1, 18), -np.inf, np.float32)
    for path in _ffn.runnable_paths():
        out = np.empty((1, 4, 32), np.float32)
        _attention.attention(q, k, v, 0.2, out, 0, mask, path)
        assert np.isnan(out[0, :2]).all(), path
        assert (out[0, 2:] == 0).all(), path


def test_bad_input_is_named():
    q, k, v = (_numpy(t) for t in _case(7, 6, 4, 1, 5, 16, torch.bfloat16))
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        attention(q, k, v, 0.1, "bfloat16")  # 4 key/value heads for 6 query heads
    q, k, v = (_numpy(t) for t in _case(7, 8, 4, 1, 5, 16, torch.bfloat16))
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        attention(q, k[:, :, :8], v, 0.1, "bfloat16")
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        attention(q, k, v[:, :4], 0.1, "bfloat16")
    with pytest.raises(ValueError, match="uint16 arrays for dtype='bfloat16'"):
        attention(q.astype(np.float32), k, v, 0.1, "bfloat16")
    with pytest.raises(ValueError, match="3-d"):
        attention(q[0], k, v, 0.1, "bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        attention(q, k, v, 0.1, "int8")
    with pytest.raises(ValueError, match="scale must be finite"):
        attention(q, k, v, float("nan"), "bfloat16")
    with pytest.raises(ValueError, match=r"mask must be \[1, 5\]"):
        attention(q, k, v, 0.1, "bfloat16", mask=np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match=r"mask must be \[T, L\]"):
        attention(q, k, v, 0.1, "bfloat16", mask=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"out must be C-contiguous uint16 \[1, 8, 16\]"):
        attention(q, k, v, 0.1, "bfloat16", out=np.empty((8, 1, 16), np.uint16))


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_simd_path_gives_the_same_bits(name):
    from colibri.layer import _attention, _ffn, _norm

    dtype, kind = DTYPES[name], {"float32": 0, "bfloat16": _norm.KIND_BFLOAT16,
                                 "float16": _norm.KIND_FLOAT16}[name]  # fmt: skip
    # heads of 64 (a block of 64 sums side by side), of 77 (64, then 8, then one by one), of 13
    for hq, hkv, t, length, d in [(16, 4, 1, 70, 64), (4, 2, 2, 21, 77), (6, 2, 3, 9, 13)]:
        q, k, v = (_numpy(a) for a in _case(8 + d, hq, hkv, t, length, d, dtype, 3.0))
        mask = np.where(np.arange(length) % 5 == 0, -np.inf, 0.25).astype(np.float32)
        mask = np.tile(mask, (t, 1))
        outs = []
        for path in _ffn.runnable_paths():
            out = np.empty((t, hq, d), q.dtype)
            _attention.attention(q, k, v, 0.2, out, kind, mask, path)
            outs.append(out)
        assert all(np.array_equal(o, outs[0]) for o in outs[1:])
        want = _reference(_torch(q, dtype), _torch(k, dtype), _torch(v, dtype), 0.2, mask)
        _check(_torch(outs[0], dtype), want, dtype)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_every_simd_path_keeps_nans_where_they_are(name):
    """Keys and values holding NaNs, quiet and signaling: every path's result is NaN at the
    same places and has the same bits elsewhere. (Which of two NaNs an operation passes on
    depends on its operands' order, which a compiler may swap: payloads are not compared.)"""
    from colibri.layer import _attention, _ffn, _norm

    dtype = DTYPES[name]
    kind = _norm.KIND_BFLOAT16 if name == "bfloat16" else _norm.KIND_FLOAT16
    q, k, v = (_numpy(a) for a in _case(3, 4, 2, 1, 24, 64, dtype, 1.0))
    nans = [0x7FC1, 0xFF81, 0x7F81] if name == "bfloat16" else [0x7E01, 0xFD01, 0x7C01]
    v[0, 5, 3], v[1, 17, 60], k[1, 9, 40] = nans  # a quiet NaN, signaling ones (one negative)
    outs = []
    for path in _ffn.runnable_paths():
        out = np.empty((1, 4, 64), np.uint16)
        _attention.attention(q, k, v, 0.2, out, kind, None, path)
        outs.append(out)
    nan = _torch(outs[0], dtype).float().isnan().numpy()
    assert nan.any() and not nan.all()
    for out in outs[1:]:
        assert np.array_equal(_torch(out, dtype).float().isnan().numpy(), nan)
        assert np.array_equal(out[~nan], outs[0][~nan])


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_heads_on_several_threads_give_the_same_bits(name):
    """Long enough caches run their key/value heads on colibri's pool: every thread count
    gives one thread's bits, the formula's values."""
    dtype = DTYPES[name]
    for hq, hkv, t, length, d in [(16, 4, 1, 300, 64), (8, 2, 3, 90, 80), (12, 3, 2, 700, 16)]:
        q, k, v = (_numpy(a) for a in _case(9 + d, hq, hkv, t, length, d, dtype))
        mask = np.where(np.arange(length) % 7 == 0, -np.inf, 0.5).astype(np.float32)
        mask = np.tile(mask, (t, 1))
        one = attention(q, k, v, 0.2, name, mask, num_threads=1)
        for threads in (2, 3, 8):
            assert np.array_equal(attention(q, k, v, 0.2, name, mask, num_threads=threads), one)
        want = _reference(_torch(q, dtype), _torch(k, dtype), _torch(v, dtype), 0.2, mask)
        _check(_torch(one, dtype), want, dtype)
    with pytest.raises(ValueError, match="num_threads must be >= 0"):
        attention(q, k, v, 0.2, name, num_threads=-1)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_a_cache_with_room_to_grow_is_read_in_place(name):
    """Keys and values as the first L rows of buffers [Hkv, capacity, D] (each head's rows
    packed, the heads apart): the bits of the same rows packed, on every path and thread
    count; the kernel refuses rows that are not packed, and ``attention`` copies them."""
    from colibri.layer import _attention, _ffn, _norm

    dtype, kind = DTYPES[name], {"float32": 0, "bfloat16": _norm.KIND_BFLOAT16,
                                 "float16": _norm.KIND_FLOAT16}[name]  # fmt: skip
    q, kb, vb = (_numpy(a) for a in _case(11, 16, 4, 1, 300, 64, dtype))
    length = 260  # of 300 rows: long enough for the pool's heads
    k, v = kb[:, :length], vb[:, :length]
    assert not k.flags.c_contiguous
    want = attention(q, k.copy(), v.copy(), 0.125, name)
    for path in _ffn.runnable_paths():
        for threads in (1, 2):
            out = np.empty_like(want)
            _attention.attention(q, k, v, 0.125, out, kind, None, path, threads)
            np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(attention(q, k, v, 0.125, name), want)
    odd = np.swapaxes(np.ascontiguousarray(np.swapaxes(k, 1, 2)), 1, 2)  # rows not packed
    with pytest.raises(ValueError, match="k must hold each head's"):
        _attention.attention(q, odd, v, 0.125, np.empty_like(want), kind)
    np.testing.assert_array_equal(attention(q, odd, v, 0.125, name), want)
