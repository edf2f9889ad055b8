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


def route(
    logits,
    k,
    *,
    scoring="softmax",
    normalize=True,
    norm_p=1.0,
    normalize_eps=0.0,
    correction_bias=None,
    bias_on="scores",
    scale=1.0,
    expert_scale=None,
    num_groups=1,
    topk_groups=1,
    group_score="max",
    partition=None,
):
    """Returns (ids [T, k] int64, weights [T, k] float64, keys [T, E] float64)."""
    x = np.asarray(logits, np.float64)
    if x.ndim == 1:
        x = x[None]
    T, E = x.shape
    groups = partition if partition is not None else contiguous_groups(E, num_groups)
    grouped = len(groups) > 1
    scores = scores_of(x, scoring)
    need_scores = correction_bias is not None or (grouped and group_score == "top2_sum")
    keys = x.copy()
    if need_scores:
        keys = scores.astype(np.float32).astype(np.float64)
        if correction_bias is not None:
            base = x.astype(np.float32) if bias_on == "logits" else keys.astype(np.float32)
            keys = (base + np.asarray(correction_bias, np.float32)).astype(np.float64)
    ids = np.empty((T, k), np.int64)
    weights = np.empty((T, k), np.float64)
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
        order = cand[np.argsort(-keys[t, cand], kind="stable")][:k]
        ids[t] = order
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
                    w = w / (norm + normalize_eps)
        if expert_scale is not None:
            w = w * np.asarray(expert_scale, np.float64)[order]
        weights[t] = w * scale
    return ids, weights, keys


def assert_same_routes(ids, weights, ref_ids, ref_weights, keys, *, rtol=2e-6, atol=1e-6):
    """ids equal to the reference's, except where selection keys tie within float noise."""
    ids = np.asarray(ids).reshape(ref_ids.shape).astype(np.int64)
    weights = np.asarray(weights, np.float64).reshape(ref_weights.shape)
    for t in range(ids.shape[0]):
        if not np.array_equal(ids[t], ref_ids[t]):
            # acceptable only when the chosen keys are equal to the reference's within noise
            got, want = keys[t, ids[t]], keys[t, ref_ids[t]]
            assert len(set(ids[t].tolist())) == len(ids[t]), f"row {t}: repeated id {ids[t]}"
            assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (
                f"row {t}: ids {ids[t]} != reference {ref_ids[t]} (keys {got} vs {want})"
            )
            continue
        np.testing.assert_allclose(
            weights[t], ref_weights[t], rtol=rtol, atol=atol, err_msg=f"row {t}"
        )
