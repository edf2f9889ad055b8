"""Dispatch / gather / combine against numpy and torch references."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri
from colibri.layer import combine, dispatch, gather


def reference_plan(ids: np.ndarray, E: int, block: int = 1):
    """Stable argsort by expert, padded per expert with the sentinel T * k."""
    flat = ids.reshape(-1).astype(np.int64)
    n = flat.size
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    padded = -(-counts // block) * block
    offsets = np.concatenate([[0], np.cumsum(padded)])
    sorted_assignments = np.full(offsets[-1], n, np.int64)
    start = np.concatenate([[0], np.cumsum(counts)])
    for e in range(E):
        sorted_assignments[offsets[e] : offsets[e] + counts[e]] = order[start[e] : start[e + 1]]
    inverse = np.empty(n, np.int64)
    valid = sorted_assignments < n
    inverse[sorted_assignments[valid]] = np.flatnonzero(valid)
    return counts, offsets, sorted_assignments, inverse


def check_plan(ids, E, block=1, **kw):
    plan = dispatch(ids, E, block_size=block, **kw)
    counts, offsets, sorted_assignments, inverse = reference_plan(np.asarray(ids), E, block)
    np.testing.assert_array_equal(plan.counts, counts)
    np.testing.assert_array_equal(plan.offsets, offsets)
    np.testing.assert_array_equal(plan.sorted_assignments, sorted_assignments)
    np.testing.assert_array_equal(plan.inverse, inverse)
    return plan


def reference_combine(expert_out: np.ndarray, inverse: np.ndarray, w: np.ndarray) -> np.ndarray:
    T, k = w.shape
    rows = inverse.reshape(T, k)
    acc = np.zeros((T, expert_out.shape[1]), np.float32)
    for j in range(k):  # fixed k order, float32, as the kernel does
        acc += w[:, j, None] * expert_out[rows[:, j]].astype(np.float32)
    return acc


@pytest.fixture
def rng():
    """A fresh generator per test: its inputs do not depend on which tests ran before."""
    return np.random.default_rng(1234)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("block", [1, 4, 16])
def test_plan_matches_stable_argsort(dtype, block, rng):
    ids = rng.integers(0, 26, (300, 2)).astype(dtype)
    plan = check_plan(ids, 26, block)
    assert plan.num_rows % block == 0
    # vLLM's per-block expert ids and the token view
    assert plan.block_expert_ids.size == plan.num_rows // block
    for b, e in enumerate(plan.block_expert_ids):
        rows = plan.sorted_assignments[b * block : (b + 1) * block]
        assert np.all((rows == ids.size) | (ids.reshape(-1)[np.minimum(rows, ids.size - 1)] == e))
    np.testing.assert_array_equal(plan.token_ids[plan.inverse], np.repeat(np.arange(300), 2))


@pytest.mark.parametrize(
    "ids, E",
    [
        (np.zeros((50, 1), np.int32), 1),  # E = 1
        (np.full((64, 2), 3, np.int32), 8),  # all tokens to one expert, rest empty
        (np.zeros((0, 2), np.int32), 5),  # T = 0
        (np.tile(np.arange(6, dtype=np.int64)[::-1], (7, 1)), 6),  # k = E
        (np.array([[9, 0]], np.int32), 10),  # one token, extreme ids
    ],
)
@pytest.mark.parametrize("block", [1, 3])
def test_adversarial_ids(ids, E, block, rng):
    plan = check_plan(ids, E, block)
    assert plan.counts.sum() == ids.size
    H = 5
    hidden = rng.standard_normal((ids.shape[0], H)).astype(np.float32)
    rows = gather(hidden, plan)
    w = rng.random(ids.shape).astype(np.float32)
    out = combine(rows, plan, w)
    np.testing.assert_allclose(out, hidden * w.sum(1, keepdims=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [-1, 26, 2**40])
def test_out_of_range_ids_raise(bad):
    ids = np.zeros((40, 2), np.int64)
    ids[17, 1] = bad
    with pytest.raises(ValueError, match=r"token 17, choice 1 is out of range \[0, 26\)"):
        dispatch(ids, 26)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="int32 or int64"):
        dispatch(np.zeros((3, 2), np.float32), 4)
    with pytest.raises(ValueError, match=r"shape \[T, k\]"):
        dispatch(np.zeros(3, np.int32), 4)
    with pytest.raises(ValueError, match="num_experts"):
        dispatch(np.zeros((3, 2), np.int32), 0)
    with pytest.raises(ValueError, match="block_size"):
        dispatch(np.zeros((3, 2), np.int32), 4, block_size=0)
    with pytest.raises(ValueError, match="num_threads"):
        dispatch(np.zeros((3, 2), np.int32), 4, num_threads=0)
    plan = dispatch(np.zeros((3, 2), np.int32), 4)
    with pytest.raises(ValueError, match=r"shape \[3, H\]"):
        gather(np.zeros((4, 2), np.float32), plan)
    with pytest.raises(ValueError, match="float32, float64, float16 or bfloat16"):
        gather(np.zeros((3, 2), np.int32), plan)
    with pytest.raises(ValueError, match=r"weights must have shape \[3, 2\]"):
        combine(np.zeros((6, 2), np.float32), plan, np.zeros((3, 1), np.float32))
    with pytest.raises(ValueError, match=r"expert_out must have shape \[6, H\]"):
        combine(np.zeros((5, 2), np.float32), plan, np.zeros((3, 2), np.float32))


def test_thread_count_invariance(rng):
    # enough assignments for several per-thread chunks; skewed so some experts are empty
    ids = (rng.zipf(1.5, (60_000, 2)) % 26).astype(np.int32)
    ids[ids == 7] = 0
    plans = [dispatch(ids, 26, block_size=8, num_threads=t) for t in (1, 2, 3, 4)]
    check_plan(ids, 26, 8, num_threads=3)
    hidden = rng.standard_normal((60_000, 8)).astype(np.float32)
    w = rng.random((60_000, 2)).astype(np.float32)
    outs = []
    for t, plan in zip((1, 2, 3, 4), plans, strict=True):
        np.testing.assert_array_equal(plan.sorted_assignments, plans[0].sorted_assignments)
        np.testing.assert_array_equal(plan.inverse, plans[0].inverse)
        outs.append(combine(gather(hidden, plan, num_threads=t), plan, w, num_threads=t))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_every_dtype_in_several_chunks(dtype, rng):
    # colibri/pool.h runs these in chunks of rows: each dtype's chunk kernels against one
    # chunk and against numpy (60,000 x 2 slots of 8 values: 4 chunks at num_threads=4)
    ids = rng.integers(0, 26, (60_000, 2)).astype(np.int64)
    hidden = torch.randn(60_000, 8, dtype=getattr(torch, dtype))
    w = rng.random((60_000, 2)).astype(np.float32)
    plan = check_plan(ids, 26, 1, num_threads=4)
    ref = reference_combine(hidden.float().numpy()[plan.sorted_assignments // 2], plan.inverse, w)
    for gather_dtype in (None, "float32"):
        one = gather(hidden, plan, dtype=gather_dtype, num_threads=1)
        many = gather(hidden, plan, dtype=gather_dtype, num_threads=4)
        torch.testing.assert_close(many, one, rtol=0, atol=0)
        for out_dtype in (None, "float32"):
            one_out = combine(one, plan, w, dtype=out_dtype, num_threads=1)
            many_out = combine(many, plan, w, dtype=out_dtype, num_threads=4)
            torch.testing.assert_close(many_out, one_out, rtol=0, atol=0)
            # half outputs round once: within a half ulp of |out| < 8
            got = many_out.float().numpy()
            np.testing.assert_allclose(got, ref, rtol=1e-2, atol=2e-2)


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(0, 40),
    k=st.integers(1, 4),
    extra=st.integers(0, 5),
    block=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_plan_property(T, k, extra, block, seed):
    E = k + extra
    r = np.random.default_rng(seed)
    ids = np.array([r.permutation(E)[:k] for _ in range(T)], np.int32).reshape(T, k)
    plan = check_plan(ids, E, block)
    x = r.standard_normal((T, 3)).astype(np.float32)
    rows = gather(x, plan)
    y = rows * 2.0 + 1.0
    w = r.random((T, k)).astype(np.float32)
    expected = reference_combine(y, plan.inverse, w)
    np.testing.assert_allclose(combine(y, plan, w), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_torch_dtypes_round_trip(dtype, rng):
    T, k, E, H = 37, 2, 6, 24
    ids = torch.from_numpy(rng.integers(0, E, (T, k)).astype(np.int64))
    plan = dispatch(ids, E, block_size=4)
    hidden = torch.randn(T, H, dtype=torch.float32).to(dtype)
    rows = gather(hidden, plan)
    assert isinstance(rows, torch.Tensor) and rows.dtype == dtype
    valid = torch.from_numpy(plan.sorted_assignments < T * k)
    token = torch.from_numpy(np.minimum(plan.token_ids, T - 1))
    assert torch.equal(rows[valid], hidden[token[valid]])
    assert torch.all(rows[~valid] == 0)
    rows32 = gather(hidden, plan, dtype="float32")
    assert rows32.dtype == torch.float32
    assert torch.equal(rows32, rows.float())
    w = torch.rand(T, k)
    out = combine(rows, plan, w)
    assert out.dtype == dtype
    # reference: float32 (float64 for float64) accumulation in k order, rounded once
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = torch.zeros(T, H, dtype=acc_dtype)
    inv = torch.from_numpy(plan.inverse).reshape(T, k)
    for j in range(k):
        acc += w[:, j, None].to(acc_dtype) * rows[inv[:, j]].to(acc_dtype)
    torch.testing.assert_close(out, acc.to(dtype), rtol=0, atol=0)


def test_numpy_float16_and_output_dtype(rng):
    T, k, E, H = 20, 3, 5, 7
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    plan = dispatch(ids, E)
    x = rng.standard_normal((T, H)).astype(np.float16)
    rows = gather(x, plan)
    assert rows.dtype == np.float16
    w = rng.random((T, k)).astype(np.float32)
    ref = reference_combine(rows, plan.inverse, w)
    np.testing.assert_array_equal(combine(rows, plan, w), ref.astype(np.float16))
    np.testing.assert_array_equal(combine(rows, plan, w, dtype="float32"), ref)
    out = np.empty((T, H), np.float32)
    assert combine(rows, plan, w, out=out) is out
    np.testing.assert_array_equal(out, ref)


def test_float_to_half_and_bfloat16_rounding_is_exact(rng):
    """combine's float32 -> float16/bfloat16 rounding equals numpy/torch (RNE), specials too."""
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            65504,
            65519.99,
            65520,
            2**-24,
            2**-25,
            3 * 2**-26,
            2**-14,
            2**-14 * (1 - 2**-11),
            1e-8,
            1.0 + 2**-11,
        ],
        np.float32,
    )
    small = (rng.standard_normal(100_000) * 1e-5).astype(np.float32)  # subnormal halves
    # the sum starts from +0.0 (as index_add_ into zeros does), so -0.0 comes out +0.0
    with np.errstate(invalid="ignore"):  # the NaN bit patterns
        values = np.float32(0) + np.concatenate([bits.view(np.float32), special, small, -small])
    n = values.size
    plan = dispatch(np.zeros((n, 1), np.int32), 1)
    src = values[:, None]
    ones = np.ones((n, 1), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        half = combine(src, plan, ones, dtype="float16")
        expected = values.astype(np.float16)[:, None]
    np.testing.assert_array_equal(
        half.view(np.uint16)[~np.isnan(expected)], expected.view(np.uint16)[~np.isnan(expected)]
    )
    assert np.isnan(half[np.isnan(expected)]).all()
    bf = combine(torch.from_numpy(src), plan, torch.from_numpy(ones), dtype="bfloat16")
    ref = torch.from_numpy(src).to(torch.bfloat16)
    nan = torch.isnan(ref)
    assert torch.equal(bf[~nan], ref[~nan]) and torch.isnan(bf[nan]).all()


def test_exports():
    assert colibri.dispatch is dispatch and colibri.gather is gather and colibri.combine is combine
    assert colibri.DispatchPlan is type(dispatch(np.zeros((1, 1), np.int32), 1))


def test_half_and_bfloat16_to_float32_exhaustive():
    """Every 16-bit pattern converts to the float32 it denotes (NaN payloads too)."""
    from colibri.layer import _rows

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    out = np.empty(bits.shape, np.float32)
    _rows.to_float32(bits, 1, 2, out)
    np.testing.assert_array_equal(
        out.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32)
    )
    _rows.to_float32(bits, 2, 2, out)
    np.testing.assert_array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)
    plan = dispatch(np.zeros((65536, 1), np.int32), 1)
    rows = gather(bits.reshape(-1, 1).view(np.float16), plan, dtype="float32")
    expected = bits.view(np.float16).astype(np.float32).reshape(-1, 1)
    np.testing.assert_array_equal(rows.view(np.uint32), expected.view(np.uint32))
