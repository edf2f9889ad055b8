"""MoELayer over a real Pager, read-ahead on and off, against a float64 reference.

The pager's budget holds fewer experts than a step activates, so the layer must chunk the
step and read the later chunks ahead; a float64 per-token numpy loop is the reference.
"""

import numpy as np
import pytest

from colibri import MoELayer, Pager
from colibri.formats.raw import write_experts

E, H, I, K, T = 8, 64, 48, 2, 24


def _silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    rng = np.random.default_rng(7)
    gate = (rng.standard_normal((E, I, H)) / H**0.5).astype(np.float32)
    up = (rng.standard_normal((E, I, H)) / H**0.5).astype(np.float32)
    down = (rng.standard_normal((E, H, I)) / I**0.5).astype(np.float32)
    router = rng.standard_normal((E, H)).astype(np.float32)
    path = write_experts(
        tmp_path_factory.mktemp("paged") / "experts.colibri",
        (((0, e), (gate[e], up[e], down[e])) for e in range(E)),
    )
    return path, router, gate, up, down


def reference(x, router, gate, up, down):
    x = x.astype(np.float64)
    logits = x @ router.T.astype(np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(len(x)):
        ids = sorted(range(E), key=lambda e: (-p[t, e], e))[:K]
        w = p[t, ids] / p[t, ids].sum()
        for e, we in zip(ids, w, strict=True):
            h = _silu(gate[e] @ x[t]) * (up[e] @ x[t])
            out[t] += we * (down[e] @ h)
    return out


@pytest.mark.parametrize("read_ahead", [True, False])
def test_layer_over_a_pager_smaller_than_a_step(model, read_ahead):
    path, router, gate, up, down = model
    expert_bytes = 3 * I * H * 4
    x = np.random.default_rng(1).standard_normal((T, H)).astype(np.float32)
    with Pager(path, budget_bytes=3 * expert_bytes, page_size_kb=4) as pager:
        assert pager.capacity < E  # a step of 24 tokens activates (nearly) all 8 experts
        layer = MoELayer(router, pager, K, read_ahead=read_ahead)
        out = layer(x)
        np.testing.assert_allclose(out, reference(x, router, gate, up, down), rtol=2e-5, atol=2e-5)
        stats = pager.stats
        active = len({int(e) for e in layer.route(x)[0].ravel()})
        assert stats.hits + stats.misses >= active  # every active expert was served
        assert stats.misses >= active - pager.capacity  # it could not hold them all
        assert stats.misses == active  # no chunk was refused: each expert read once
        if read_ahead:  # the step's later chunks went to the OS read-ahead first
            assert stats.advised == active - pager.capacity
        else:
            assert stats.advised == 0
        out2 = layer(x)  # again, with whatever stayed resident
        np.testing.assert_array_equal(out2, out)
        assert pager.drain(timeout=30)
