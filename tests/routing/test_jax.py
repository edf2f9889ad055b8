"""colibri's routing inside ``jax.jit`` and under ``jax.vmap``: the same ids and weights as
eager routing (the reference: ``ctx.route`` on each concrete array), bit for bit."""

import numpy as np
import pytest

import colibri

jax = pytest.importorskip("jax")
jnp = jax.numpy

CONTEXTS = {
    "softmax": dict(num_experts=8, top_k=2),
    "sigmoid_groups_bias": dict(
        num_experts=16,
        top_k=4,
        scoring="sigmoid",
        num_groups=4,
        topk_groups=2,
        correction_bias=np.linspace(-0.5, 0.5, 16, dtype=np.float32),
        scale=2.5,
    ),
}


def _logits(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 3, dtype)


def _assert_eager(ids, weights, ctx, logits):
    want_ids, want_weights = ctx.route(logits)
    assert ids.dtype == want_ids.dtype and weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(weights), np.asarray(want_weights))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("name", list(CONTEXTS))
def test_jit_equals_eager(name, dtype):
    options = dict(CONTEXTS[name])
    ctx = colibri.init(options.pop("num_experts"), options.pop("top_k"), **options)
    logits = _logits((7, ctx.num_experts), dtype)
    ids, weights = jax.jit(lambda x: colibri.route_from_dlpack(x, ctx))(logits)
    assert ids.shape == (7, ctx.top_k)
    _assert_eager(ids, weights, ctx, logits)
    one = logits[3]  # [E] -> [k]
    ids, weights = jax.jit(lambda x: colibri.route_from_dlpack(x, ctx))(one)
    assert ids.shape == (ctx.top_k,)
    _assert_eager(ids, weights, ctx, one)


@pytest.mark.parametrize("name", list(CONTEXTS))
def test_vmap_equals_eager_per_item(name):
    options = dict(CONTEXTS[name])
    ctx = colibri.init(options.pop("num_experts"), options.pop("top_k"), **options)
    batch = _logits((3, 5, ctx.num_experts), seed=1)  # 3 items of [T=5, E] logits
    route = jax.vmap(lambda x: colibri.route_from_dlpack(x, ctx))
    for fn in (route, jax.jit(route)):
        ids, weights = fn(batch)
        assert ids.shape == weights.shape == (3, 5, ctx.top_k)
        for b in range(3):
            _assert_eager(ids[b], weights[b], ctx, batch[b])
    # nested vmap, and vmap of [E] rows
    ids, weights = jax.vmap(jax.vmap(lambda x: colibri.route_from_dlpack(x, ctx)))(batch)
    for b in range(3):
        _assert_eager(ids[b], weights[b], ctx, batch[b])
    ids, weights = jax.vmap(lambda x: colibri.route_from_dlpack(x, ctx))(batch[0])
    _assert_eager(ids, weights, ctx, batch[0])


def test_one_shot_route_under_jit_and_vmap():
    batch = _logits((2, 4, 6), seed=2)
    ids, weights = jax.jit(jax.vmap(lambda x: colibri.route(x, 3, scoring="sigmoid")))(batch)
    for b in range(2):
        want_ids, want_weights = colibri.route(batch[b], 3, scoring="sigmoid")
        np.testing.assert_array_equal(np.asarray(ids[b]), np.asarray(want_ids))
        np.testing.assert_array_equal(np.asarray(weights[b]), np.asarray(want_weights))


def test_traced_errors_name_the_fix():
    ctx = colibri.init(8, 2)
    logits = _logits((4, 8))
    with pytest.raises(ValueError, match="drop out="):
        jax.jit(lambda x: colibri.route_from_dlpack(x, ctx, out=ctx.buffers(4)))(logits)
    with pytest.raises(ValueError, match=r"E=8 .*got shape \(4, 6\)"):
        jax.jit(lambda x: colibri.route_from_dlpack(x, ctx))(logits[:, :6])
    with pytest.raises(TypeError, match="floating point.*int32"):
        jax.jit(lambda x: colibri.route_from_dlpack(x, ctx))(logits.astype(jnp.int32))
    if not jax.config.read("jax_enable_x64"):
        wide = colibri.init(8, 2, ids_dtype="int64")
        with pytest.raises(TypeError, match="jax_enable_x64"):
            jax.jit(lambda x: colibri.route_from_dlpack(x, wide))(logits)
