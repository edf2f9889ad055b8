"""The expert engine on its own: run_experts against a float64 reference, its kernel-or-
fallback rule, chunking, read-ahead and the errors it raises."""

import contextlib

import numpy as np
import pytest

import colibri
from colibri.layer import KERNEL_MAX_ROWS, InMemoryExperts, run_experts

E, H, I, K = 6, 32, 48, 2


def _silu(x):
    return x / (1.0 + np.exp(-x))


class Store:
    """InMemoryExperts with a chosen capacity, recording loads and read-ahead."""

    def __init__(self, experts, capacity=E):
        self.inner, self.capacity, self.slot_bytes = experts, capacity, experts.slot_bytes
        self.loads, self.advised = [], []

    @contextlib.contextmanager
    def load(self, layer, ids):
        self.loads.append([int(e) for e in ids])
        with self.inner.load(layer, ids) as batch:
            yield batch

    def advise(self, layer, ids):
        self.advised.append((layer, [int(e) for e in ids]))
        return len(ids)


def _experts(dtype, seed=0):
    rng = np.random.default_rng(seed)
    mats = [rng.standard_normal(s) / s[-1] ** 0.5 for s in ((E, I, H), (E, I, H), (E, H, I))]
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        stored = [m.astype(np.float32).astype(ml_dtypes.bfloat16) for m in mats]
    else:
        stored = [m.astype(dtype) for m in mats]
    return InMemoryExperts(*stored), [np.asarray(m, np.float64) for m in stored]


def _reference(x, ids, weights, mats):
    gate, up, down = mats
    out = np.zeros(x.shape)
    for t in range(len(x)):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e >= 0:
                h = _silu(gate[e] @ x[t]) * (up[e] @ x[t])
                out[t] += weights[t, j] * (down[e] @ h)
    return out


def _routing(T, seed=1, k=K):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
    weights = rng.dirichlet(np.ones(k), T).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    return x, ids, weights


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T", [1, 3, 40])
def test_matches_a_float64_reference(dtype, T):
    experts, mats = _experts(dtype)
    x, ids, weights = _routing(T)
    ids[0, 1] = -1  # no expert: contributes nothing
    out = run_experts(experts, 0, x, ids, weights, num_experts=E)
    np.testing.assert_allclose(out, _reference(x, ids, weights, mats), rtol=1e-4, atol=1e-5)


def test_decode_size_experts_take_the_kernel_and_the_rest_the_fallback():
    """An expert with at most KERNEL_MAX_ROWS rows (of its dtype) and half-precision weights
    is computed by the fused kernel (the fallback never sees it); every other expert reaches
    the fallback with exactly its rows; float32 weights always go to the fallback."""
    most = KERNEL_MAX_ROWS["float16"]
    T = 3 * most + 4  # experts 0-4: more than `most` rows each
    x, _, weights = _routing(T)
    t = np.arange(T)
    ids = np.stack([t % 5, np.where(t < most, 5, (t + 1) % 5)], 1)  # 5 is small
    counts = np.bincount(ids.ravel(), minlength=E)
    assert 0 < counts[5] <= most and (counts[:5] > most).any()
    for dtype, small_in_fallback in (("float16", False), ("float32", True)):
        experts, mats = _experts(dtype)
        seen, out = {}, np.zeros_like(x)

        def fallback(e, w, tokens, assignments, mats=mats, seen=seen, out=out):
            np.testing.assert_array_equal(tokens, assignments // K)
            seen[e] = sorted(tokens.tolist())
            h = _silu(x[tokens] @ mats[0][e].T) * (x[tokens] @ mats[1][e].T)
            np.add.at(out, tokens, weights.reshape(-1)[assignments, None] * (h @ mats[2][e].T))

        fused = run_experts(experts, 0, x, ids, weights, num_experts=E, fallback=fallback)
        active = set(np.flatnonzero(counts))
        want = active if small_in_fallback else {e for e in active if counts[e] > most}
        assert set(seen) == want
        if small_in_fallback:
            assert fused is None  # every expert went to the fallback
        else:
            out += fused
        for e, tokens in seen.items():
            assert tokens == sorted(np.nonzero((ids == e).any(1))[0].tolist())
        np.testing.assert_allclose(out, _reference(x, ids, weights, mats), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_change_no_bit(dtype):
    """Whatever the store's capacity (so the chunking), the same bits, top-3 (where the
    order of three additions shows in the bits), experts of 1 to 6 rows (both the fused
    kernel and numpy for bfloat16); later chunks are read ahead, the first one loaded first."""
    experts, _ = _experts(dtype)
    x, _, weights = _routing(9, k=3)
    ids = 5 - np.array([[0, 1, 2], [2, 1, 0], [0, 2, 1], [1, 2, 0], [4, 1, 0], [2, 3, 1],
                        [3, 4, 5], [5, 0, 2], [1, 2, 0]])  # fmt: skip
    # experts 0, 1, 2 take the kernel (2 rows each) and share token 6; token 4 mixes paths
    assert list(np.bincount(ids.ravel())) == [2, 2, 2, 7, 7, 7]
    results = []
    for capacity in (E, 4, 2, 1):
        store = Store(experts, capacity)
        results.append(run_experts(store, 0, x, ids, weights, num_experts=E))
        active = sorted(set(ids.ravel().tolist()))
        assert store.loads == [active[i : i + capacity] for i in range(0, len(active), capacity)]
        assert store.advised == ([(0, active[capacity:])] if capacity < len(active) else [])
    for out in results[1:]:
        np.testing.assert_array_equal(out, results[0])


def test_the_next_layers_guess_is_read_ahead_once_after_the_first_load():
    experts, _ = _experts("float32")
    x, ids, weights = _routing(9)
    store, calls = Store(experts, 2), []

    def next_layer():
        calls.append(len(store.loads))
        return 7, np.array([3, 1])

    run_experts(store, 0, x, ids, weights, num_experts=E, next_layer=next_layer,
                read_ahead=False)  # fmt: skip
    assert calls == [1] and store.advised == [(7, [3, 1])]


def test_an_expert_out_of_range_is_named():
    experts, _ = _experts("float32")
    x, ids, weights = _routing(3)
    ids[2, 0] = E
    with pytest.raises(ValueError, match="slot 4|assignment 4|token 2"):
        run_experts(experts, 0, x, ids, weights, num_experts=E)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(x=np.zeros((3, H), np.float16)), "x must be a"),
        (dict(x=np.zeros((H, 3), np.float32).T), "x must be C-contiguous"),
        (dict(ids=np.zeros((2, K), np.int64)), r"ids must be an integer \[3, k\]"),
        (dict(ids=np.zeros((3, K), np.float32)), "ids must be an integer"),
        (dict(weights=np.zeros((3, K), np.float64)), "weights must be C-contiguous float32"),
        (dict(weights=np.zeros((3, K + 1), np.float32)), "weights must be C-contiguous float32"),
        (dict(weights=np.zeros((K, 3), np.float32).T), "weights must be C-contiguous float32"),
    ],
)
def test_bad_arguments_are_named(change, message):
    experts, _ = _experts("float32")
    x, ids, weights = _routing(3)
    args = dict(x=x, ids=ids, weights=weights)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        run_experts(experts, 0, args["x"], args["ids"], args["weights"], num_experts=E)


def test_a_store_that_cannot_hold_one_expert_raises():
    class Full(Store):
        @contextlib.contextmanager
        def load(self, layer, ids):
            self.loads.append(len(ids))
            raise colibri.BudgetError("every slot is pinned")
            yield

    experts, _ = _experts("float32")
    x, ids, weights = _routing(9)
    store = Full(experts, 4)
    with pytest.raises(colibri.BudgetError, match="every slot is pinned"):
        run_experts(store, 0, x, ids, weights, num_experts=E)
    assert store.loads == [4, 2, 1]
