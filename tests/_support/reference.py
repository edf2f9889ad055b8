"""An independent numpy reference of colibri's routing semantics (float64, full sorts)."""

from __future__ import annotations

import numpy as np


def scores_of(x: np.ndarray, scoring: str) -> np.ndarray:
    """Scores [T, E] in float64; softmax rows of all -inf give NaN (undefined)."""
    x = np.asarray(x, np.float64)
    if scoring == "softmax":
        m = x.max(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", over="ignore"):
            top = np.isposinf(m)
            e = np.where(top, np.isposinf(x).astype(np.float64), np.exp(x - np.where(top, 0, m)))
            return e / e.sum(axis=1, keepdims=True)
    if scoring == "sigmoid":
        with np.errstate(over="ignore"):
            return 1.0 / (1.0 + np.exp(-x))
    if scoring == "sqrtsoftplus":
        with np.errstate(over="ignore"):
            return np.sqrt(np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))))
    raise ValueError(scoring)


def contiguous_groups(E: int, G: int) -> list[list[int]]:
    base, extra = divmod(E, G)
    out, start = [], 0
    for g in range(G):
        size = base + (g < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


# colibri's routing options the reference knows (colibri's defaults when left out)
OPTIONS = (
    "scoring", "normalize", "norm_p", "normalize_eps", "correction_bias", "bias_on", "scale",
    "expert_scale", "num_groups", "topk_groups", "group_score", "partition",
)  # fmt: skip


def _keys(x: np.ndarray, scores: np.ndarray, grouped: bool, options: dict) -> np.ndarray:
    """The selection keys [T, E]: the logits, or the float32 scores (plus the bias)."""
    bias = options.get("correction_bias")
    if bias is None and not (grouped and options.get("group_score", "max") == "top2_sum"):
        return x.copy()
    keys = scores.astype(np.float32).astype(np.float64)
    if bias is not None:
        base = (
            x.astype(np.float32) if options.get("bias_on") == "logits" else keys.astype(np.float32)
        )
        keys = (base + np.asarray(bias, np.float32)).astype(np.float64)
    return keys


def _groups(E: int, options: dict) -> list:
    partition = options.get("partition")
    return (
        partition if partition is not None else contiguous_groups(E, options.get("num_groups", 1))
    )


def route(logits, k, **options):
    """Returns (ids [T, k] int64, weights [T, k] float64, keys [T, E] float64).

    ``options`` are colibri's routing options (``scoring``, ``normalize``, ``norm_p``,
    ``normalize_eps``, ``correction_bias``, ``bias_on``, ``scale``, ``expert_scale``,
    ``num_groups``, ``topk_groups``, ``group_score``, ``partition``) with its defaults.
    """
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"reference.route: unknown options {sorted(unknown)}")
    x = np.asarray(logits, np.float64)
    if x.ndim == 1:
        x = x[None]
    T, E = x.shape
    groups = _groups(E, options)
    grouped = len(groups) > 1
    keys = _keys(x, scores_of(x, options.get("scoring", "softmax")), grouped, options)
    group_score = options.get("group_score", "max")
    topk_groups = options.get("topk_groups", 1)
    ids = np.empty((T, k), np.int64)
    for t in range(T):
        allowed = np.ones(E, bool)
        if grouped:
            gs = []
            for g in groups:
                v = np.sort(keys[t, g])[::-1]
                # float32, as DeepSeek's reference sums its float32 scores (inf + -inf: NaN)
                with np.errstate(over="ignore", invalid="ignore"):
                    gs.append(
                        float(np.float32(v[0]) + np.float32(v[1]))
                        if group_score == "top2_sum"
                        else v[0]
                    )
            keep = np.argsort(-np.asarray(gs), kind="stable")[:topk_groups]
            allowed[:] = False
            for g in keep:
                allowed[groups[g]] = True
        cand = np.flatnonzero(allowed)
        ids[t] = cand[np.argsort(-keys[t, cand], kind="stable")][:k]
    return ids, weigh(x, ids, **options), keys


def weigh(logits, ids, **options) -> np.ndarray:
    """The weights [T, k] float64 routing gives the experts ``ids`` [T, k], in that order:
    a function of the chosen experts only, so it also weighs a choice the reference did not
    make (one of experts whose keys tie)."""
    x = np.asarray(logits, np.float64)
    if x.ndim == 1:
        x = x[None]
    ids = np.asarray(ids, np.int64).reshape(x.shape[0], -1)
    scoring = options.get("scoring", "softmax")
    normalize = options.get("normalize", True)
    norm_p = options.get("norm_p", 1.0)
    expert_scale = options.get("expert_scale")
    scores = scores_of(x, scoring)
    grouped = len(_groups(x.shape[1], options)) > 1
    need_scores = options.get("correction_bias") is not None or (
        grouped and options.get("group_score", "max") == "top2_sum"
    )
    weights = np.empty(ids.shape, np.float64)
    for t, order in enumerate(ids):
        if scoring == "softmax" and normalize and not need_scores:
            sel = x[t, order]
            m = sel.max()
            w = (sel == np.inf).astype(np.float64) if m == np.inf else np.exp(sel - m)
        else:
            w = scores[t, order].copy()
        if normalize:
            inf = np.isinf(w)
            if inf.any():
                w = np.where(inf, inf.sum() ** (-1.0 / norm_p), 0.0)
            else:
                norm = (w**norm_p).sum() ** (1.0 / norm_p)
                if norm > 0:
                    w = w / (norm + options.get("normalize_eps", 0.0))
        if expert_scale is not None:
            w = w * np.asarray(expert_scale, np.float64)[order]
        weights[t] = w * options.get("scale", 1.0)
    return weights


def assert_same_routes(ids, weights, logits, k, *, rtol=2e-6, atol=1e-6, **options):
    """colibri's ``(ids, weights)`` for ``logits`` against the reference: ids equal, except
    where the selection keys tie within float noise; and the weights always, those of a
    tie-broken choice against the reference's weights of the experts colibri chose."""
    x = np.asarray(logits, np.float64).reshape(-1, np.shape(logits)[-1])
    ref_ids, ref_weights, keys = route(x, k, **options)
    ids = np.asarray(ids).reshape(ref_ids.shape).astype(np.int64)
    weights = np.asarray(weights, np.float64).reshape(ref_weights.shape)
    differ = np.flatnonzero((ids != ref_ids).any(axis=1))
    for t in differ:
        # acceptable only when the chosen keys are equal to the reference's within noise
        got, want = keys[t, ids[t]], keys[t, ref_ids[t]]
        assert len(set(ids[t].tolist())) == len(ids[t]), f"row {t}: repeated id {ids[t]}"
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (
            f"row {t}: ids {ids[t]} != reference {ref_ids[t]} (keys {got} vs {want})"
        )
    if differ.size:
        ref_weights = ref_weights.copy()
        ref_weights[differ] = weigh(x[differ], ids[differ], **options)
    for t in range(ids.shape[0]):
        np.testing.assert_allclose(
            weights[t], ref_weights[t], rtol=rtol, atol=atol, err_msg=f"row {t}"
        )
