"""Routing against the numpy reference: every option, adversarial values, determinism."""

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import colibri
from _support import reference as ref


def check(logits, k, **options):
    ctx = colibri.init(np.shape(logits)[-1], k, **options)
    ids, weights = ctx.route(logits)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    ref_options = {name: options[name] for name in ref.OPTIONS if name in options}
    ref.assert_same_routes(ids, weights, logits, k, **ref_options)
    return ids, weights


@st.composite
def routing_case(draw):
    E = draw(st.one_of(st.integers(1, 12), st.integers(13, 80), st.sampled_from([256, 512])))
    T = draw(st.integers(1, 6))
    style = draw(st.sampled_from(["normal", "ties", "huge", "tiny", "mixed_inf"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if style == "normal":
        x = rng.standard_normal((T, E)) * draw(st.sampled_from([0.1, 1.0, 5.0]))
    elif style == "ties":
        x = rng.choice([-1.0, 0.0, 0.5, 0.5, 2.0], size=(T, E))
    elif style == "huge":
        x = rng.choice([-1e30, 1e30, 3e38, -3e38, 0.0, 1.0], size=(T, E))
    elif style == "tiny":
        x = rng.choice([1e-30, -1e-30, 0.0, 1e-38, 5e-45], size=(T, E))
    else:
        x = rng.standard_normal((T, E))
        x[rng.random((T, E)) < 0.2] = -np.inf
        x[:, 0] = np.maximum(x[:, 0], 0.0)  # keep softmax defined
    x = x.astype(np.float32)
    options = {
        "scoring": draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"])),
        "normalize": draw(st.booleans()),
        "scale": draw(st.sampled_from([1.0, 2.5, 0.5])),
    }
    if draw(st.booleans()):
        options["norm_p"] = draw(st.sampled_from([1.0, 2.0, 0.5]))
    if draw(st.booleans()):
        options["correction_bias"] = (
            rng.standard_normal(E) * draw(st.sampled_from([0.01, 1.0, 100.0]))
            - draw(st.sampled_from([0.0, 50.0]))
        ).astype(np.float32)
        options["bias_on"] = draw(st.sampled_from(["scores", "logits"]))
    if draw(st.booleans()):
        options["normalize_eps"] = draw(st.sampled_from([1e-6, 1e-20, 0.1]))
    if draw(st.booleans()):
        options["expert_scale"] = rng.uniform(0.5, 2.0, E).astype(np.float32)
    grouping = draw(st.sampled_from(["none", "contiguous", "partition"]))
    if grouping != "none" and E >= 2:
        G = draw(st.integers(2, min(E, 16)))
        if grouping == "contiguous":
            options["num_groups"] = G
            groups = ref.contiguous_groups(E, G)
        else:
            perm = rng.permutation(E)
            cuts = np.sort(rng.choice(np.arange(1, E), size=G - 1, replace=False))
            groups = [sorted(g.tolist()) for g in np.split(perm, cuts)]
            options["partition"] = groups
        options["topk_groups"] = draw(st.integers(1, G))
        if min(len(g) for g in groups) >= 2 and draw(st.booleans()):
            options["group_score"] = "top2_sum"
        sizes = sorted(len(g) for g in groups)
        reachable = sum(sizes[: options["topk_groups"]])
    else:
        reachable = E
    k = draw(st.integers(1, reachable))
    return x, k, options


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing_case())
def test_matches_reference(case):
    x, k, options = case
    # an all -inf softmax row is refused (tested on its own): hypothesis counts these as filtered
    assume(not (options["scoring"] == "softmax" and np.isneginf(x).all(axis=1).any()))
    check(x, k, **options)


def test_seed_shape_contiguous_groups():
    assert colibri.Config(num_experts=26, top_k=2, num_groups=4).groups() == (
        tuple(range(0, 7)),
        tuple(range(7, 14)),
        tuple(range(14, 20)),
        tuple(range(20, 26)),
    )
    x = np.random.default_rng(1).standard_normal((300, 26)).astype(np.float32)
    ids, _ = check(x, 2, num_groups=4)
    groups = np.searchsorted([7, 14, 20], ids, side="right")
    assert (groups[:, 0] == groups[:, 1]).all()  # topk_groups=1: both picks in one group


def test_ties_go_to_lower_index():
    ctx = colibri.init(8, 3)
    ids, w = ctx.route(np.zeros(8, np.float32))
    assert ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(w, 1 / 3, rtol=1e-6)
    ids, _ = ctx.route(np.array([1, 5, 5, 1, 5, 5, 0, 0], np.float32))
    assert ids.tolist() == [1, 2, 4]


def test_equal_groups_go_to_lower_group():
    x = np.array([0, 3, 3, 0, 3, 0, 0, 3], np.float32)  # every group scores 3
    assert colibri.init(8, 2, num_groups=4).route(x)[0].tolist() == [1, 0]
    assert colibri.init(8, 2, num_groups=4, topk_groups=2).route(x)[0].tolist() == [1, 2]


@pytest.mark.parametrize("bias_sign", [-1.0, 1.0])
def test_dropped_group_never_chosen_whatever_the_bias(bias_sign):
    """Regression for the 0.0-mask bug: every key of the kept group is negative."""
    E = 8
    bias = np.full(E, 100.0 * bias_sign, np.float32)
    bias[:4] = -1000.0  # group 0's keys are very negative, but its group score is highest?
    logits = np.zeros((1, E), np.float32)
    logits[0, :4] = 50.0
    ctx = colibri.init(
        E, 4, scoring="sigmoid", correction_bias=bias, num_groups=2, group_score="max"
    )
    ids, _ = ctx.route(logits)
    ref_ids, _, keys = ref.route(logits, 4, scoring="sigmoid", correction_bias=bias, num_groups=2)
    assert ids.tolist() == ref_ids.tolist()
    kept = {0, 1, 2, 3} if keys[0, :4].max() > keys[0, 4:].max() else {4, 5, 6, 7}
    assert set(ids[0].tolist()) == kept


def test_deepseek_v3_shape():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    bias = (rng.standard_normal(256) * 0.1).astype(np.float32)
    check(
        x,
        8,
        scoring="sigmoid",
        correction_bias=bias,
        num_groups=8,
        topk_groups=4,
        group_score="top2_sum",
        scale=2.5,
    )


def test_infinities():
    ctx = colibri.init(4, 2)
    ids, w = ctx.route(np.array([np.inf, 0, np.inf, -np.inf], np.float32))
    assert ids.tolist() == [0, 2] and w.tolist() == [0.5, 0.5]
    ids, w = ctx.route(np.array([-np.inf, 1.0, -np.inf, -np.inf], np.float32))
    assert ids.tolist() == [1, 0] and w.tolist() == [1.0, 0.0]
    sig = colibri.init(4, 2, scoring="sigmoid", normalize=False)
    ids, w = sig.route(np.array([-np.inf, np.inf, 0.0, -np.inf], np.float32))
    assert ids.tolist() == [1, 2] and w.tolist() == [1.0, 0.5]
    sp = colibri.init(3, 2, scoring="sqrtsoftplus")
    ids, w = sp.route(np.array([np.inf, 1.0, np.inf], np.float32))
    assert ids.tolist() == [0, 2] and w.tolist() == [0.5, 0.5]


def test_subnormal_scores_renormalise_exactly():
    """Scores of 1e-44 are float32 subnormals with few bits; renormalising must not overflow
    (1 / norm would) and must match float32 arithmetic on those scores."""
    x = np.array([-100.0, -101.0, -150.0], np.float32)
    with np.errstate(under="ignore"):
        z = np.exp(x)
        s32 = z / (np.float32(1) + z)  # float32 sigmoid: ~3.8e-44, 1.4e-44, 0
    ids, w = colibri.init(3, 2, scoring="sigmoid").route(x)
    assert ids.tolist() == [0, 1]
    np.testing.assert_allclose(w, s32[:2] / s32[:2].sum(), rtol=1e-6)
    ids, w = colibri.init(3, 3, scoring="sigmoid", norm_p=2.0).route(x)
    np.testing.assert_allclose(w, s32 / np.sqrt((s32.astype(np.float64) ** 2).sum()), rtol=1e-6)


def test_all_neg_inf_softmax_is_an_error():
    with pytest.raises(ValueError, match="row 1.*-inf"):
        colibri.init(3, 1).route(np.array([[0, 1, 2], [-np.inf] * 3], np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_is_an_error_naming_the_row(dtype):
    x = np.zeros((5, 6), dtype)
    x[3, 2] = np.nan
    with pytest.raises(ValueError, match="row 3 contains NaN"):
        colibri.init(6, 2).route(x)
    big = np.zeros((5000, 6), dtype)
    big[4321, 5] = np.nan
    big[4999, 0] = np.nan
    with pytest.raises(ValueError, match="row 4321 contains NaN"):
        colibri.init(6, 2, routing_threads=2).route(big)


def test_batch_and_thread_invariance():
    rng = np.random.default_rng(7)
    x = rng.choice([-1.0, 0.0, 1.0, 2.5], size=(3001, 33)).astype(np.float32)
    opts = dict(
        scoring="sigmoid",
        correction_bias=rng.standard_normal(33).astype(np.float32),
        num_groups=3,
        topk_groups=2,
        group_score="top2_sum",
    )
    ids1, w1 = colibri.init(33, 4, routing_threads=1, **opts).route(x)
    ids2, w2 = colibri.init(33, 4, routing_threads=2, **opts).route(x)
    assert np.array_equal(ids1, ids2) and np.array_equal(w1, w2)
    ctx = colibri.init(33, 4, **opts)
    for t in (0, 17, 3000):
        i, w = ctx.route(x[t])
        assert np.array_equal(i, ids1[t]) and np.array_equal(w, w1[t])
    i, w = ctx.route(x[100:357])
    assert np.array_equal(i, ids1[100:357]) and np.array_equal(w, w1[100:357])


def test_single_token_shapes_and_int64_ids():
    ctx = colibri.init(26, 2, ids_dtype="int64")
    ids, w = ctx.route(np.arange(26, dtype=np.float32))
    assert ids.shape == (2,) and ids.dtype == np.int64 and ids.tolist() == [25, 24]
    assert w.shape == (2,)


def test_empty_batch():
    ids, w = colibri.init(5, 2).route(np.zeros((0, 5), np.float32))
    assert ids.shape == (0, 2) and w.shape == (0, 2)


def test_one_shot_route_and_route_from_dlpack():
    x = np.random.default_rng(0).standard_normal((7, 10)).astype(np.float32)
    i1, w1 = colibri.route(x, 3, scoring="sigmoid")
    ctx = colibri.init(10, 3, scoring="sigmoid")
    i2, w2 = colibri.route_from_dlpack(x, ctx)
    assert np.array_equal(i1, i2) and np.array_equal(w1, w2)
    with pytest.raises(TypeError, match="colibri.Context"):
        colibri.route_from_dlpack(x, "ctx")
    i3, w3 = colibri.route(x.__dlpack__(max_version=(1, 0)), 3, scoring="sigmoid")
    assert np.array_equal(i1, i3) and np.array_equal(w1, w3)  # a capsule, consumed once
    torch = pytest.importorskip("torch")
    i4, _ = colibri.route(torch.from_numpy(x), 3, scoring="sigmoid")
    assert isinstance(i4, torch.Tensor) and np.array_equal(i1, i4.numpy())


def test_config_object_and_overrides():
    cfg = colibri.Config(num_experts=26, top_k=2, batch_size=4, page_size_kb=32, routing_threads=2)
    ctx = colibri.init(config=cfg)
    assert ctx.config is cfg and ctx.routing_threads == 2
    ids, w = ctx.buffers()
    assert ids.shape == (4, 2) and w.dtype == np.float32
    assert colibri.init(config=cfg, scoring="sigmoid").config.scoring == "sigmoid"
    with pytest.raises(ValueError, match="contradicts"):
        colibri.init(8, 2, config=cfg)


def test_usage_counts_match_the_routes_and_failed_calls_count_nothing():
    rng = np.random.default_rng(4)
    ctx = colibri.init(16, 3, collect_stats=True, routing_threads=2)
    x = rng.standard_normal((5000, 16)).astype(np.float32)
    ids, _ = ctx.route(x)
    one, _ = ctx.route(x[0])
    bad = x[:700].copy()
    bad[650, 3] = np.nan  # two chunks: rows routed in both are counted, then taken back
    with pytest.raises(ValueError, match="row 650"):
        ctx.route(bad)
    with pytest.raises(ValueError, match="row 50"):
        ctx.route(bad[600:700])  # one chunk, the latency path
    stats = ctx.stats
    all_ids = np.concatenate([ids, one[None]])
    assert stats.tokens == 5001
    np.testing.assert_array_equal(stats.counts, np.bincount(all_ids.ravel(), minlength=16))
    pairs = np.zeros((16, 16), np.int64)
    for row in all_ids:
        pairs[np.ix_(row, row)] += 1
    np.testing.assert_array_equal(stats.coactivation, pairs)
    ctx.reset_stats()
    assert ctx.stats == colibri.UsageStats.empty(16)


@pytest.mark.parametrize("E", [2, 3, 5, 8, 26, 64, 96, 97])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_eight_row_path_equals_row_by_row(E, k, scoring):
    """Plain routing with k <= 2 runs 8 rows per SSE pass: bit-identical to single rows."""
    rng = np.random.default_rng(E * 10 + k)
    x = rng.choice([-np.inf, -2.0, 0.0, 0.5, 0.5, 1.0, 3.0, np.inf], size=(203, E))
    x[::3] = rng.standard_normal((len(x[::3]), E)) * 4
    x = x.astype(np.float32)
    x[:, 0] = np.where(np.isneginf(x).all(axis=1), 0.0, x[:, 0])  # keep softmax defined
    for normalize in (True, False):
        ctx = colibri.init(E, k, scoring=scoring, normalize=normalize, routing_threads=1)
        ids, w = ctx.route(x)
        singles = [ctx.route(row) for row in x]
        np.testing.assert_array_equal(ids, np.stack([i for i, _ in singles]))
        np.testing.assert_array_equal(w, np.stack([v for _, v in singles]))
        ref.assert_same_routes(ids, w, x, k, scoring=scoring, normalize=normalize)
    bad = x[:19].copy()
    bad[13, E - 1] = np.nan  # inside the second block of 8
    with pytest.raises(ValueError, match="row 13 contains NaN"):
        ctx.route(bad)


def test_the_reference_check_weighs_a_tie_broken_choice():
    """Where colibri breaks a near-tie of keys the other way than the reference, the check
    still compares the weights: with those the reference gives the experts colibri chose."""
    x = np.array([[0.0, 2.0, -1.0]], np.float32)
    scores = 1.0 / (1.0 + np.exp(-x[0].astype(np.float64)))
    bias = np.array([scores[1] - scores[0], 0.0, 0.0], np.float32)  # keys of 0 and 1 tie
    options = dict(scoring="sigmoid", normalize=False, correction_bias=bias)
    ref_ids, ref_w, _ = ref.route(x, 1, **options)
    other = 1 - ref_ids  # the other of the two tied experts
    ref.assert_same_routes(other, ref.weigh(x, other, **options), x, 1, **options)
    with pytest.raises(AssertionError, match="row 0"):  # the other choice, the first's weight
        ref.assert_same_routes(other, ref_w, x, 1, **options)
    check(x, 1, **options)  # and colibri passes it, whichever it takes


@pytest.mark.parametrize("E", [5, 8, 26, 64, 256])
@pytest.mark.parametrize("grouping", ["none", "contiguous", "partition", "partition_bias"])
def test_exact_ties_pick_exactly_the_reference_ids(E, grouping):
    """Keys that tie exactly (small integers: exact in float32 and float64) must give exactly
    the reference's ids: lower id first, lower group first. Rows range from a handful of
    tied candidates (counted ranks) to whole rows of one value (the insertion fallback)."""
    rng = np.random.default_rng(E)
    levels = rng.integers(2, 6, size=(60, 1))
    x = rng.integers(0, levels, size=(60, E)).astype(np.float32)
    x[:5] = 1.0  # every key equal
    options = {}
    if grouping == "contiguous":
        options = dict(num_groups=min(4, E), topk_groups=2)
    elif grouping.startswith("partition"):
        perm = rng.permutation(E)
        options = dict(
            partition=[sorted(g.tolist()) for g in np.array_split(perm, 4)], topk_groups=3
        )
        if grouping == "partition_bias":  # keys = logits + bias, still small integers
            options.update(
                correction_bias=rng.integers(-2, 3, E).astype(np.float32),
                bias_on="logits",
                group_score="top2_sum" if E >= 8 else "max",
            )
    sizes = sorted(len(g) for g in colibri.Config(num_experts=E, top_k=1, **options).groups())
    reachable = sum(sizes[: options.get("topk_groups", 1)])
    for k in sorted({min(k, reachable) for k in (1, 2, 3, 8, 12)}):
        ids, _ = colibri.init(E, k, **options).route(x)
        ref_ids, _, _ = ref.route(x, k, **options)
        np.testing.assert_array_equal(ids, ref_ids, err_msg=f"k={k}")


@pytest.mark.skipif(not colibri.init(8, 2).use_avx512, reason="this CPU (or build) has no AVX-512F")
@pytest.mark.parametrize("E", [16, 37, 256])
@pytest.mark.parametrize("bias_on", ["scores", "logits"])
def test_avx512_score_pass_equals_sse2_bit_for_bit(E, bias_on):
    """The sigmoid pass runs 16 lanes wide where the CPU allows: the same bits as 4 lanes."""
    rng = np.random.default_rng(E)
    x = rng.standard_normal((300, E)) * rng.choice([0.1, 1.0, 30.0], size=(300, 1))
    x[::7] = rng.choice([-np.inf, np.inf, -104.5, -90.0, -87.0, 0.0, -0.0, 88.0], (43, E))
    x = x.astype(np.float32)
    options = dict(
        scoring="sigmoid",
        correction_bias=rng.standard_normal(E).astype(np.float32),
        bias_on=bias_on,
        scale=2.5,
    )
    if E % 8 == 0:
        options.update(num_groups=8, topk_groups=4, group_score="top2_sum")
    ctx = colibri.init(E, 8, use_avx512=True, **options)
    wide = ctx.route(x)
    narrow = colibri.init(E, 8, use_avx512=False, **options).route(x)
    np.testing.assert_array_equal(wide[0], narrow[0])
    np.testing.assert_array_equal(wide[1], narrow[1])
    ref.assert_same_routes(wide[0], wide[1], x, 8, **options)
    bad = x[:20].copy()
    bad[11, E - 1] = np.nan  # in the SSE2 tail when E % 16
    with pytest.raises(ValueError, match="row 11 contains NaN"):
        ctx.route(bad)


def test_undefined_group_score_ranks_last():
    """inf + -inf (keys on the logits) gives a NaN group score: after every number, as the
    reference's numpy sort puts it, never a slot taken by accident."""
    x = np.array([[np.inf, -np.inf, 1, 0, 2, 1, 0, 0]], np.float32)
    options = dict(
        num_groups=4,
        topk_groups=2,
        group_score="top2_sum",
        bias_on="logits",
        correction_bias=np.zeros(8, np.float32),
    )
    ids, _ = colibri.init(8, 2, **options).route(x)
    assert ids.tolist() == [[4, 2]]  # groups 2 (score 3) and 1 (score 1); group 0 last
    np.testing.assert_array_equal(ids, ref.route(x, 2, **options)[0])


@pytest.mark.skipif(not colibri.init(8, 2).use_avx512, reason="this CPU (or build) has no AVX-512F")
@pytest.mark.parametrize("E", [16, 26, 64, 100, 256])
@pytest.mark.parametrize("k", [1, 2])
def test_avx512_top2_equals_sse2(E, k):
    """Plain k <= 2 takes its top two 16 lanes wide where the CPU allows: the same answers."""
    rng = np.random.default_rng(E + k)
    x = rng.choice([-np.inf, -2.0, 0.0, -0.0, 0.5, 0.5, 1.0, 3.0, np.inf], size=(205, E))
    x[::3] = rng.standard_normal((len(x[::3]), E)) * 4
    x = x.astype(np.float32)
    x[:, 0] = np.where(np.isneginf(x).all(axis=1), 0.0, x[:, 0])  # keep softmax defined
    ctx = colibri.init(E, k, use_avx512=True)
    wide = ctx.route(x)
    narrow = colibri.init(E, k, use_avx512=False).route(x)
    np.testing.assert_array_equal(wide[0], narrow[0])
    np.testing.assert_array_equal(wide[1], narrow[1])
    bad = x[:21].copy()
    bad[17, E - 1] = np.nan  # in the masked tail when E % 16
    with pytest.raises(ValueError, match="row 17 contains NaN"):
        ctx.route(bad)


HAS_AVX2 = colibri.init(8, 2).use_avx2  # the path routing runs here (COLIBRI_SIMD caps it)


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU (or build) has no AVX2")
@pytest.mark.parametrize("E", [16, 26, 37, 64, 256])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"scoring": "sigmoid", "bias": "scores"},
        {"scoring": "sigmoid", "bias": "logits", "groups": True},
        {"scoring": "softmax", "bias": "scores"},
        {"scoring": "softmax", "normalize": False},
        {"scoring": "sqrtsoftplus", "bias": "scores"},
        {"scoring": "sqrtsoftplus", "groups": True},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain",
)
def test_avx2_paths_equal_sse2_bit_for_bit(E, options):
    """The 8-lane score passes, top two and top-k bound give SSE2's bits (and AVX-512's)."""
    options = dict(options)
    rng = np.random.default_rng(E)
    x = rng.standard_normal((203, E)) * rng.choice([0.1, 1.0, 30.0], size=(203, 1))
    x[::7] = rng.choice([-np.inf, np.inf, -104.5, -90.0, 0.0, -0.0, 88.0, 25.0], (29, E))
    x[::5] = rng.choice([-1.0, 0.5, 0.5, 2.0], (41, E))  # ties
    x = x.astype(np.float32)
    x[:, 0] = np.where(np.isfinite(x[:, 0]), x[:, 0], 0.0)  # keep softmax defined
    kw = {}
    if "bias" in options:
        kw.update(
            correction_bias=rng.standard_normal(E).astype(np.float32), bias_on=options.pop("bias")
        )
    if options.pop("groups", False) and E % 8 == 0:
        kw.update(num_groups=8, topk_groups=4, group_score="top2_sum")
    kw.update(options)
    for k in (1, 2, 3, 6, 8, 12):
        if "num_groups" in kw and k > E // 2:
            continue
        wide = colibri.init(E, k, use_avx512=False, use_avx2=True, **kw)
        narrow = colibri.init(E, k, use_avx512=False, use_avx2=False, **kw)
        got, want = wide.route(x), narrow.route(x)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"k={k}")
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"k={k}")
        if colibri.init(8, 2).use_avx512:
            best = colibri.init(E, k, use_avx512=True, use_avx2=True, **kw).route(x)
            np.testing.assert_array_equal(best[0], want[0], err_msg=f"avx512 k={k}")
            np.testing.assert_array_equal(best[1], want[1], err_msg=f"avx512 k={k}")
        bad = x[:20].copy()
        bad[13, E - 1] = np.nan  # in the tail when E % 8
        with pytest.raises(ValueError, match="row 13 contains NaN"):
            wide.route(bad)


def test_colibri_simd_caps_the_routing_kernels():
    import os
    import subprocess
    import sys

    def run(code):
        env = {**os.environ, "COLIBRI_SIMD": "sse2"}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)

    r = run("import colibri; c = colibri.init(64, 2); print(c.use_avx2, c.use_avx512)")
    assert r.stdout.split() == ["False", "False"], r.stderr
    r = run("import colibri; colibri.init(8, 2, use_avx2=True)")
    assert r.returncode != 0 and "use_avx2=True, but" in r.stderr


@pytest.mark.parametrize("E", [2, 3, 5, 8, 12, 16, 26, 37, 64, 100, 256])
@pytest.mark.parametrize("scaled", [False, True])
def test_block_path_equals_one_row_at_a_time(E, scaled):
    """Batches of k = 2 softmax rows go 16 (AVX-512F) or 8 (AVX2) rows per kernel call, the
    rows' lanes merged across rows; every path gives the bits of routing each row alone."""
    rng = np.random.default_rng(E)
    wide = np.zeros((133, E + 3), np.float32)  # rows 4 floats apart: a stride other than E
    x = wide[:, 1 : E + 1]
    x[:] = rng.standard_normal((133, E)) * rng.choice([0.1, 1.0, 30.0], size=(133, 1))
    x[::5] = rng.choice([-1.0, 0.5, 0.5, 2.0, 0.0, -0.0], (27, E))  # ties, signed zeros
    x[40:56] = rng.choice([-np.inf, -2.0, 1.0], (16, E))  # one block with -inf logits
    x[60, 1] = np.inf  # and one whose best logit is +inf
    x[:, 0] = np.where(np.isfinite(x[:, 0]), x[:, 0], 0.0)  # keep softmax defined
    kw = {}
    if scaled:
        kw = {"expert_scale": rng.uniform(0.5, 2.0, E).astype(np.float32), "scale": 2.5}
    lone = colibri.init(E, 2, **kw)
    want = np.stack([lone.route(row)[0] for row in x]), np.stack([lone.route(row)[1] for row in x])
    paths = [{"use_avx512": False, "use_avx2": False}]
    if HAS_AVX2:
        paths.append({"use_avx512": False, "use_avx2": True})
    if colibri.init(8, 2).use_avx512:
        paths.append({"use_avx512": True})
    for path in paths:
        ctx = colibri.init(E, 2, routing_threads=1, **path, **kw)
        got = ctx.route(x)
        np.testing.assert_array_equal(got[0], want[0], err_msg=str(path))
        np.testing.assert_array_equal(got[1], want[1], err_msg=str(path))
        bad = x[:40].copy()
        bad[29, E - 1] = np.nan  # the second block, in the masked tail when E % 16
        with pytest.raises(ValueError, match="row 29 contains NaN"):
            ctx.route(bad)
