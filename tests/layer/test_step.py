"""``pre_attention`` / ``post_attention``: a decoder layer's one-token step in two native
calls, against the same public kernels called one by one (rms_norm, quant_linear /
half_linear, rope, attention, numpy's residual add) bit for bit, and their errors;
``AttentionStep``, the two with the cache update between them, against the two."""

from __future__ import annotations

import numpy as np
import pytest

from _support.blocks import random_blocks
from colibri.layer import (
    AttentionStep,
    _quant,
    attention,
    half_linear,
    post_attention,
    pre_attention,
    quant_linear,
    rms_norm,
    rope,
)

H, HQ, HKV, D, L, E = 256, 4, 2, 64, 5, 12
KINDS = {"float32": 0, "bfloat16": 2, "float16": 1}


def _store(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to ``dtype``'s storage (float32, or uint16 bits)."""
    x = np.asarray(x, np.float32)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    bits = x.view(np.uint32).astype(np.uint64)  # round to nearest even, as torch does
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _load(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.view(np.float16).astype(np.float32)
    return (values.astype(np.uint32) << 16).view(np.float32)


def _projection(rng, code: str, out: int, inp: int, bias: bool, dtype: str):
    """A projection ``(weight, code, bias, threads)`` and its reference call on rows."""
    b = rng.standard_normal(out).astype(np.float32) if bias else None
    if code in ("bfloat16", "float16"):
        bits = _store(rng.standard_normal((out, inp)) * inp**-0.5, code)

        def run(rows):
            return _store(half_linear(_load(rows, dtype), bits, code, b, 2), dtype)

        return (bits, code, b, 2), run
    if code == _quant.Q4_0X8:  # Q4_0 interleaved by eight, against Q4_0 as stored
        blocks = random_blocks(rng, "q4_0", out, inp // 32)
        packed = (_quant.interleave(blocks), code, b, 2)
        return packed, lambda rows: quant_linear(rows, blocks, "q4_0", b, 2, dtype)
    blocks = random_blocks(rng, code, out, inp // _quant.BLOCK[code])
    return (blocks, code, b, 2), lambda rows: quant_linear(rows, blocks, code, b, 2, dtype)


def _case(dtype: str, codes: tuple[str, str, str, str, str], bias: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    c = {
        "x": _store(rng.standard_normal(H) * 3, dtype),
        "norm": _store(rng.uniform(0.5, 1.5, H), dtype),
        "post": _store(rng.uniform(0.5, 1.5, H), dtype),
        "q_norm": _store(rng.uniform(0.5, 1.5, D), dtype),
        "k_norm": _store(rng.uniform(0.5, 1.5, D), dtype),
        "cos": _store(np.cos(rng.uniform(0, 50, D)), dtype),
        "sin": _store(np.sin(rng.uniform(0, 50, D)), dtype),
        "keys": _store(rng.standard_normal((HKV, L, D)), dtype),
        "values": _store(rng.standard_normal((HKV, L, D)), dtype),
    }
    shapes = [(HQ * D, H), (HKV * D, H), (HKV * D, H), (H, HQ * D), (E, H)]
    made = [_projection(rng, code, o, i, bias, dtype)
            for code, (o, i) in zip(codes, shapes, strict=True)]  # fmt: skip
    c["proj"], c["ref"] = [m[0] for m in made], [m[1] for m in made]
    return c


def _enter_reference(c, dtype):
    h = rms_norm(c["x"][None], c["norm"], 1e-6, dtype)
    q, k, v = (ref(h) for ref in c["ref"][:3])
    q = rms_norm(q.reshape(HQ, D), c["q_norm"], 1e-5, dtype)
    k = rms_norm(k.reshape(HKV, D), c["k_norm"], 1e-5, dtype)
    rope(q, c["cos"], c["sin"], dtype)
    rope(k, c["cos"], c["sin"], dtype)
    return q, k, v.reshape(HKV, D)


def _enter(c, dtype, q_norm=True):
    norms = ((c["q_norm"], 1e-5), (c["k_norm"], 1e-5)) if q_norm else (None, None)
    return pre_attention(c["x"], (c["norm"], 1e-6), c["proj"][:3], c["cos"], c["sin"], *norms,
                         dtype)  # fmt: skip


CODES = [
    ("q8_0", "q8_0", "q8_0", "q8_0", "bfloat16"),  # a GGUF model: quantized, a bf16 router
    ("q4_k", "q6_k", "q4_0", "q5_k", "q8_0"),
    ("bfloat16", "bfloat16", "bfloat16", "bfloat16", "bfloat16"),  # a bf16 checkpoint
    ("float16", "q8_0", "bfloat16", "iq4_xs", "float16"),  # q, k, v projected one by one
    ("float16", "float16", "float16", "q8_0", "bfloat16"),  # an f16 GGUF model
    ("q4_0x8", "q4_0x8", "q4_0x8", "q4_0x8", "bfloat16"),  # Q4_0 on x86: interleaved
]


@pytest.mark.parametrize("dtype", list(KINDS))
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("bias", [False, True])
def test_enter_is_the_calls_one_by_one(dtype, codes, bias):
    c = _case(dtype, codes, bias)
    for ours, theirs in zip(_enter(c, dtype), _enter_reference(c, dtype), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dtype", list(KINDS))
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("routed", [False, True])
def test_leave_is_the_calls_one_by_one(dtype, codes, routed):
    c = _case(dtype, codes, bias=True, seed=1)
    q, _, _ = _enter(c, dtype)
    storage = q.dtype
    out = attention(q.reshape(HQ, 1, D), c["keys"], c["values"], 0.125, dtype)
    o = c["ref"][3](out.reshape(1, HQ * D))[0]
    x = _store(_load(c["x"], dtype) + _load(o, dtype), dtype)  # torch's add: one rounding
    h = rms_norm(x[None], c["post"], 1e-6, dtype)[0]
    logits = c["ref"][4](h[None])[0]

    x_out, h_out, got = post_attention(q, c["keys"], c["values"], 0.125, c["proj"][3], c["x"],
                                       (c["post"], 1e-6), c["proj"][4] if routed else None,
                                       dtype)  # fmt: skip
    assert x_out.dtype == h_out.dtype == storage
    np.testing.assert_array_equal(x_out, x)
    np.testing.assert_array_equal(h_out, h)
    if routed:
        np.testing.assert_array_equal(got, logits)
    else:
        assert got is None


def test_norms_may_be_left_out_or_span_every_head():
    """No q / k norm (None); a norm weight of all of q's values (OLMoE's) norms q whole."""
    c = _case("bfloat16", CODES[0], bias=False)
    q, _, _ = _enter(c, "bfloat16", q_norm=False)
    h = rms_norm(c["x"][None], c["norm"], 1e-6, "bfloat16")
    want_q = c["ref"][0](h).reshape(HQ, D)
    rope(want_q, c["cos"], c["sin"], "bfloat16")
    np.testing.assert_array_equal(q, want_q)
    wide = _store(np.linspace(0.5, 1.5, HQ * D), "bfloat16")
    q, _, _ = pre_attention(c["x"], (c["norm"], 1e-6), c["proj"][:3], c["cos"], c["sin"],
                            (wide, 1e-5), None, "bfloat16")  # fmt: skip
    want_q = rms_norm(c["ref"][0](h), wide, 1e-5, "bfloat16").reshape(HQ, D)
    rope(want_q, c["cos"], c["sin"], "bfloat16")
    np.testing.assert_array_equal(q, want_q)


def test_bad_input_is_named():
    c = _case("bfloat16", CODES[0], bias=False)
    q, _, _ = _enter(c, "bfloat16")
    proj = tuple(c["proj"][:3])

    def enter(**change):
        args = dict(x=c["x"], norm=(c["norm"], 1e-6), projections=proj, cos=c["cos"],
                    sin=c["sin"], q_norm=(c["q_norm"], 1e-5), k_norm=(c["k_norm"], 1e-5),
                    dtype="bfloat16")  # fmt: skip
        args.update(change)
        pre_attention(**args)

    with pytest.raises(ValueError, match=r"norm must be \[H\]"):
        enter(norm=(c["norm"][:-1], 1e-6))
    with pytest.raises(ValueError, match="cos and sin"):
        enter(sin=c["sin"][:-2])
    with pytest.raises(ValueError, match="whole heads of cos's 62 values"):
        enter(cos=c["cos"][:-2])
    with pytest.raises(ValueError, match="q_norm .* must divide"):
        enter(q_norm=(c["q_norm"][:-1], 1e-5))
    with pytest.raises(ValueError, match=r"projections must be \(q, k, v\)"):
        enter(projections=proj[:2])
    with pytest.raises(ValueError, match="as many for k as for v"):
        enter(projections=(proj[0], proj[0], proj[2]))
    wide_k = (random_blocks(np.random.default_rng(0), "q8_0", HKV * D, 2 * H // 32), "q8_0",
              None, 2)  # fmt: skip
    with pytest.raises(ValueError, match=r"k: the weight must be 128 rows of 256 q8_0 values"):
        enter(projections=(proj[0], wide_k, proj[2]))
    with pytest.raises(ValueError, match="weight type must be one of"):
        enter(projections=((proj[0][0], "q9_9", None, 2), proj[1], proj[2]))
    with pytest.raises(ValueError, match="whole blocks"):
        enter(projections=((proj[0][0][:, :-1].copy(), "q8_0", None, 2), proj[1], proj[2]))
    with pytest.raises(ValueError, match="the bias must be float32"):
        enter(projections=((*proj[0][:2], np.zeros(3, np.float32), 2), proj[1], proj[2]))
    with pytest.raises(ValueError, match="dtype must be one of"):
        enter(dtype="int8")
    with pytest.raises(ValueError, match="x must be uint16 for this dtype"):
        enter(x=_load(c["x"], "bfloat16"))  # float32 values, bfloat16 asked for
    with pytest.raises(ValueError, match="norm must be"):
        enter(norm=None)

    def leave(**change):
        args = dict(q=q, keys=c["keys"], values=c["values"], scale=0.125, o_proj=c["proj"][3],
                    x=c["x"], norm=(c["post"], 1e-6), router=c["proj"][4],
                    dtype="bfloat16")  # fmt: skip
        args.update(change)
        post_attention(**args)

    with pytest.raises(ValueError, match="L > 0"):
        leave(keys=c["keys"][:, :0], values=c["values"][:, :0])
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        three = np.concatenate([c["keys"], c["keys"][:1]])
        leave(keys=three, values=three)
    with pytest.raises(ValueError, match=r"keys and values \[Hkv, L, D\]"):
        leave(keys=c["keys"][0])
    with pytest.raises(ValueError, match="o_proj: the weight must be 256 rows of 256"):
        leave(o_proj=c["proj"][1])
    with pytest.raises(ValueError, match=r"router: the weight must be \[12, 256\]"):
        leave(router=(c["proj"][4][0][:, :-1].copy(), *c["proj"][4][1:]))
    with pytest.raises(ValueError, match="scale must be finite"):
        leave(scale=float("nan"))
    with pytest.raises(ValueError, match="keys must be uint16"):
        leave(keys=_load(c["keys"], "bfloat16"))


def _planned(c, dtype, routed=True, capacity=8):
    """An AttentionStep of case ``c``, and a cache ``[HKV, capacity, D]`` holding its L rows."""
    step = AttentionStep((c["norm"], 1e-6), tuple(c["proj"][:3]), (c["q_norm"], 1e-5),
                         (c["k_norm"], 1e-5), c["proj"][3], (c["post"], 1e-6),
                         c["proj"][4] if routed else None, (HQ, HKV, D), dtype)  # fmt: skip
    cache = []
    for name in ("keys", "values"):
        buffer = np.full((HKV, capacity, D), 7, c[name].dtype)  # rows past L: never read
        buffer[:, :L] = c[name]
        cache.append(buffer)
    return step, cache


@pytest.mark.parametrize("dtype", list(KINDS))
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("routed", [False, True])
def test_attention_step_is_enter_the_cache_update_and_leave(dtype, codes, routed):
    c = _case(dtype, codes, bias=True, seed=2)
    step, (keys, values) = _planned(c, dtype, routed)
    q, k, v = _enter(c, dtype)
    want_keys = np.concatenate([c["keys"], k[:, None]], axis=1)
    want_values = np.concatenate([c["values"], v[:, None]], axis=1)
    want = post_attention(q, want_keys, want_values, 0.125, c["proj"][3], c["x"],
                          (c["post"], 1e-6), c["proj"][4] if routed else None,
                          dtype)  # fmt: skip
    storage = c["x"].dtype
    x_out, h = np.empty(H, storage), np.empty(H, storage)
    logits = np.empty(E, storage) if routed else None
    for again in range(2):  # the same again: the arguments read once hold
        if again:
            step.warm()  # a hint between calls: the same values
        step(c["x"], c["cos"], c["sin"], keys, values, L, 0.125, x_out, h, logits)
        np.testing.assert_array_equal(keys[:, : L + 1], want_keys)
        np.testing.assert_array_equal(values[:, : L + 1], want_values)
        assert (keys[:, L + 1 :] == 7).all() and (values[:, L + 1 :] == 7).all()
        np.testing.assert_array_equal(x_out, want[0])
        np.testing.assert_array_equal(h, want[1])
        if routed:
            np.testing.assert_array_equal(logits, want[2])
    assert (step.H, step.Hq, step.Hkv, step.D, step.E) == (H, HQ, HKV, D, E if routed else 0)


def test_attention_step_bad_input_is_named():
    c = _case("bfloat16", CODES[0], bias=False)
    step, (keys, values) = _planned(c, "bfloat16", capacity=L + 1)
    x_out, h, logits = (np.empty(n, np.uint16) for n in (H, H, E))
    with pytest.raises(ValueError, match=r"row 6 must be in \[0, capacity=6\)"):
        step(c["x"], c["cos"], c["sin"], keys, values, L + 1, 0.125, x_out, h, logits)
    with pytest.raises(ValueError, match=r"logits must be \[12\]"):
        step(c["x"], c["cos"], c["sin"], keys, values, L, 0.125, x_out, h, None)
    with pytest.raises(ValueError, match=r"keys and values \[2, capacity, 64\]"):
        step(c["x"], c["cos"], c["sin"], keys[:1].copy(), values, L, 0.125, x_out, h, logits)
    with pytest.raises(ValueError, match="dtype mismatch"):
        step(c["x"].astype(np.float32), c["cos"], c["sin"], keys, values, L, 0.125, x_out, h,
             logits)  # fmt: skip
    args = [(c["norm"], 1e-6), tuple(c["proj"][:3]), None, None, c["proj"][3],
            (c["post"], 1e-6), None, (HQ, HKV, D), "bfloat16"]  # fmt: skip
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16"):
        AttentionStep(*args[:-1], "int8")
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        AttentionStep(*args[:-2], (HQ, 3, D), "bfloat16")
    with pytest.raises(ValueError, match=r"must be \[H\] like norm"):
        AttentionStep(*args[:5], (c["post"][:-1], 1e-6), *args[6:])
    with pytest.raises(ValueError, match="o_proj: the weight must be"):
        AttentionStep(*args[:4], c["proj"][4], *args[5:])
