"""What partitioned routing keeps of exact top-k routing: ``fidelity`` and ``evaluate``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from colibri._validate import check_int
from colibri.partition._partition import Partition
from colibri.routing import route

__all__ = ["FidelityReport", "evaluate", "fidelity"]


@dataclass(frozen=True)
class FidelityReport:
    """What partitioned routing kept of exact (unrestricted) top-k routing.

    Attributes
    ----------
    tokens, top_k, num_groups, topk_groups : int
        The routing that was measured.
    recall : float
        Share of the exact top-k choices (token, expert) that partitioned routing also made.
    mass_kept : float
        ``sum_t sum_{e in P_t} s[t, e] / sum_t sum_{e in X_t} s[t, e]``, with ``X_t`` the
        exact top-k set, ``P_t`` the partitioned one and ``s`` the router's scores over all
        ``E`` experts before any renormalisation (the full softmax for ``scoring="softmax"``,
        the sigmoid or sqrt-softplus otherwise; no correction bias). At most 1 unless a
        ``correction_bias`` made the exact choice differ from the highest scores.
    exact_share : float
        Share of tokens whose partitioned choice is exactly the exact top-k set.
    spanning_share : float
        Share of tokens whose exact top-k spans more than one group.
    unreachable_share : float
        Share of tokens whose exact top-k spans more than ``topk_groups`` groups: these can
        never be routed exactly under the partition.
    group_load : tuple of float
        Share of the partitioned selections that fall in each group (sums to 1).
    exact_group_load : tuple of float
        The same for exact routing.
    """

    tokens: int
    top_k: int
    num_groups: int
    topk_groups: int
    recall: float
    mass_kept: float
    exact_share: float
    spanning_share: float
    unreachable_share: float
    group_load: tuple[float, ...]
    exact_group_load: tuple[float, ...]

    def __str__(self) -> str:
        loads = " ".join(f"{x:.3f}" for x in self.group_load)
        exact_loads = " ".join(f"{x:.3f}" for x in self.exact_group_load)
        return "\n".join(
            [
                f"fidelity of partitioned routing: {self.tokens} tokens, top-{self.top_k}, "
                f"{self.num_groups} groups, topk_groups={self.topk_groups}",
                f"  recall of exact top-k       {self.recall:.4f}",
                f"  routing mass kept           {self.mass_kept:.4f}",
                f"  tokens routed exactly       {self.exact_share:.4f}",
                f"  exact top-k spans >1 group  {self.spanning_share:.4f}",
                f"  ... > topk_groups groups    {self.unreachable_share:.4f}",
                f"  load per group (partitioned) {loads}",
                f"  load per group (exact)       {exact_loads}",
            ]
        )


def _scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    x = logits.astype(np.float64)
    if scoring == "softmax":
        x = np.exp(x - x.max(axis=1, keepdims=True))
        return x / x.sum(axis=1, keepdims=True)
    if scoring == "sigmoid":
        return 0.5 * (1.0 + np.tanh(0.5 * x))
    if scoring == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, x))
    raise ValueError(
        f"evaluate(): scoring must be 'softmax', 'sigmoid' or 'sqrtsoftplus' (got {scoring!r})"
    )


def fidelity(
    partition: Partition,
    logits: np.ndarray,
    exact_ids: np.ndarray,
    partitioned_ids: np.ndarray,
    *,
    topk_groups: int = 1,
    scoring: str = "softmax",
) -> FidelityReport:
    """Compare two routings of the same logits (see :class:`FidelityReport`).

    Parameters
    ----------
    partition : Partition
    logits : numpy.ndarray
        ``[T, E]`` router logits.
    exact_ids, partitioned_ids : numpy.ndarray
        ``[T, k]`` expert ids chosen by unrestricted and by partitioned routing.
    """
    logits = np.asarray(logits)
    exact_ids = np.asarray(exact_ids).astype(np.intp)
    partitioned_ids = np.asarray(partitioned_ids).astype(np.intp)
    t, e = logits.shape
    if exact_ids.shape != partitioned_ids.shape or exact_ids.shape[0] != t:
        raise ValueError(
            f"fidelity(): ids must both be [T, k] with T = {t} (got {exact_ids.shape} and "
            f"{partitioned_ids.shape})"
        )
    k = exact_ids.shape[1]
    m = partition.num_groups
    rows = np.arange(t)[:, None]
    chosen = np.zeros((t, e), bool)
    chosen[rows, exact_ids] = True
    kept = chosen[rows, partitioned_ids]  # [T, k]: partitioned choice also exact
    scores = _scores(logits, scoring)
    exact_mass = scores[rows, exact_ids].sum()
    mass = scores[rows, partitioned_ids].sum()
    group_of = partition.group_of.astype(np.intp)
    groups_hit = np.zeros((t, m), bool)
    groups_hit[rows, group_of[exact_ids]] = True
    spans = groups_hit.sum(axis=1)
    selections = max(t * k, 1)
    return FidelityReport(
        tokens=t,
        top_k=k,
        num_groups=m,
        topk_groups=topk_groups,
        recall=float(kept.sum() / selections),
        mass_kept=float(mass / exact_mass) if exact_mass > 0 else 1.0,
        exact_share=float(kept.all(axis=1).mean()) if t else 1.0,
        spanning_share=float((spans > 1).mean()) if t else 0.0,
        unreachable_share=float((spans > topk_groups).mean()) if t else 0.0,
        group_load=tuple(
            float(x)
            for x in np.bincount(group_of[partitioned_ids].ravel(), minlength=m) / selections
        ),
        exact_group_load=tuple(
            float(x) for x in np.bincount(group_of[exact_ids].ravel(), minlength=m) / selections
        ),
    )


def evaluate(
    partition: Partition | Sequence[Sequence[int]],
    logits: object,
    top_k: int,
    /,
    *,
    topk_groups: int = 1,
    **options: object,
) -> FidelityReport:
    """Measure what routing inside ``partition`` keeps of exact top-k routing on ``logits``.

    Both routings run through colibri's router (``colibri.route``): exact top-k, and top-k
    inside each token's best ``topk_groups`` groups of ``partition``, with the same routing
    ``options`` (``scoring``, ``correction_bias``, ...; ``group_score`` only applies to the
    partitioned routing).

    Parameters
    ----------
    partition : Partition or list of lists of int
    logits : array_like
        ``[T, E]`` router logits (numpy, or anything ``numpy.asarray`` reads).
    top_k : int
        Experts per token.
    topk_groups : int
        Groups each token may use (default 1).

    Returns
    -------
    FidelityReport
        Recall, routing mass kept, load per group, share of tokens spanning several groups.
    """
    if not isinstance(partition, Partition):
        partition = Partition(partition)
    for name in ("partition", "num_groups", "collect_stats"):
        if name in options:
            raise TypeError(f"evaluate(): {name}= is set by evaluate itself; do not pass it")
    array = np.asarray(logits)
    if array.ndim != 2 or array.shape[1] != partition.num_experts:
        raise ValueError(
            f"evaluate(): logits must be [T, E] with E = {partition.num_experts} (the "
            f"partition's experts); got shape {array.shape}"
        )
    topk_groups = check_int("evaluate(): topk_groups", topk_groups, 1)
    if topk_groups > partition.num_groups:
        raise ValueError(
            f"evaluate(): topk_groups ({topk_groups}) exceeds the partition's "
            f"{partition.num_groups} groups"
        )
    group_options = {"group_score": options.pop("group_score")} if "group_score" in options else {}
    exact_ids, _ = route(array, top_k, **options)
    partitioned_ids, _ = route(
        array, top_k, partition=partition, topk_groups=topk_groups, **group_options, **options
    )
    return fidelity(
        partition,
        array,
        np.asarray(exact_ids),
        np.asarray(partitioned_ids),
        topk_groups=topk_groups,
        scoring=str(options.get("scoring", "softmax")),
    )
