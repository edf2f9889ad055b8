"""Synthetic router logits with the latent structure of real MoE traffic, for tests and benchmarks.

The clustered model (``Workload(..., structure="clustered")``), per token ``t`` and expert ``e``::

    logits[t, e] = popularity[e] + strength * affinity[topic(t), e] + noise * N(0, 1)

- **Clusters of experts that fire together.** The experts are split at random (a seeded
  permutation, so a cluster is never a contiguous id range) into ``num_clusters`` clusters of
  unequal sizes (drawn around ``E / num_clusters``; they need not match any group size). Each
  topic favours one cluster: ``affinity`` is ``U(0.6, 1.0)`` inside it and 0 elsewhere, and a
  few "generalist" experts (``shared``, a fraction of ``E``) also get a weaker affinity to a
  second, random cluster, so clusters overlap as they do in trained routers.
- **Skewed popularity.** Topics are drawn with Zipf-like probabilities ``1 / rank ** skew``, and
  every expert has a popularity bias ``-bias_skew * log(rank)`` (a few hot experts, a long
  tail).
- **Drift along the sequence.** Topics are sticky: a token keeps the previous token's topic with
  probability ``stickiness`` (runs of one topic, as a document has), and the topic
  probabilities themselves drift from one Zipf ranking to another over the sequence.
- ``noise`` blurs everything: some tokens' top-k leave their topic's cluster.

``structure="iid"`` gives independent ``N(0, 1)`` logits: no clusters, no skew, no drift.

The latent structure (clusters, popularity, rankings) is fixed by the workload's ``seed``; the
tokens drawn by :meth:`Workload.logits` depend on its own ``seed``, so a partition learned on
one draw can be checked on another (held out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from colibri._validate import check_int

__all__ = ["Workload", "generate_logits"]


def _fraction(value: float, name: str, upper_open: bool = False) -> float:
    value = float(value)
    if not (0.0 <= value < 1.0 if upper_open else 0.0 <= value <= 1.0):
        bound = "[0, 1)" if upper_open else "[0, 1]"
        raise ValueError(f"Workload: {name} must lie in {bound} (got {value})")
    return value


@dataclass(frozen=True)
class Workload:
    """A seeded generator of router logits ``[T, E]`` (see the module docstring for the model).

    Parameters
    ----------
    num_experts : int
        ``E``.
    structure : {"clustered", "iid"}
        Latent clusters, skew and drift, or independent standard normal logits.
    num_clusters : int, optional
        Number of latent clusters (topics); default ``max(2, round(E / 5))``.
    strength : float
        Logit boost of a topic's cluster (default 3.0).
    noise : float
        Standard deviation of the per-logit Gaussian noise (default 0.6).
    skew : float
        Zipf exponent of topic popularity (default 1.0).
    bias_skew : float
        Scale of the per-expert popularity bias ``-bias_skew * log(rank)`` (default 0.3).
    shared : float
        Fraction of experts that also lean towards a second cluster (default 0.1).
    stickiness : float
        Probability that a token keeps the previous token's topic (default 0.9).
    seed : int
        Fixes the latent structure.
    """

    num_experts: int
    structure: Literal["clustered", "iid"] = "clustered"
    num_clusters: int | None = None
    strength: float = 3.0
    noise: float = 0.6
    skew: float = 1.0
    bias_skew: float = 0.3
    shared: float = 0.1
    stickiness: float = 0.9
    seed: int = 0
    _latent: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        e = check_int("Workload: num_experts", self.num_experts, 1)
        if self.structure not in ("clustered", "iid"):
            raise ValueError(
                f"Workload: structure must be 'clustered' or 'iid' (got {self.structure!r})"
            )
        clusters = max(2, round(e / 5)) if self.num_clusters is None else self.num_clusters
        clusters = min(check_int("Workload: num_clusters", clusters, 1), e)
        for name in ("strength", "noise", "skew", "bias_skew"):
            value = float(getattr(self, name))
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"Workload: {name} must be finite and >= 0 (got {value})")
        _fraction(self.shared, "shared")
        _fraction(self.stickiness, "stickiness", upper_open=True)
        check_int("Workload: seed", self.seed, 0)
        object.__setattr__(self, "num_clusters", clusters)
        object.__setattr__(self, "_latent", self._draw_latent())

    def _draw_latent(self) -> dict:
        e, c = self.num_experts, self.num_clusters
        rng = np.random.default_rng([self.seed, 0x5EED])
        # Unequal cluster sizes: a Dirichlet split of E, each cluster at least one expert.
        shares = rng.dirichlet(np.full(c, 10.0))
        sizes = 1 + np.floor(shares * (e - c)).astype(np.int64)
        sizes[np.argsort(-shares, kind="stable")[: e - int(sizes.sum())]] += 1
        order = rng.permutation(e)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        clusters = tuple(
            tuple(sorted(int(x) for x in order[bounds[i] : bounds[i + 1]])) for i in range(c)
        )
        affinity = np.zeros((c, e))
        for i, members in enumerate(clusters):
            affinity[i, list(members)] = rng.uniform(0.6, 1.0, len(members))
        home = np.empty(e, np.int64)
        for i, members in enumerate(clusters):
            home[list(members)] = i
        if c > 1:
            for expert in rng.permutation(e)[: int(round(self.shared * e))]:
                other = (home[expert] + rng.integers(1, c)) % c
                affinity[other, expert] = rng.uniform(0.3, 0.6)
        popularity = -self.bias_skew * np.log1p(rng.permutation(e))
        ranks_start = 1 + rng.permutation(c)
        ranks_end = 1 + rng.permutation(c)
        return {
            "clusters": clusters,
            "affinity": affinity,
            "popularity": popularity,
            "log_topic_start": -self.skew * np.log(ranks_start),
            "log_topic_end": -self.skew * np.log(ranks_end),
        }

    @property
    def clusters(self) -> tuple[tuple[int, ...], ...]:
        """The latent clusters (each cluster's expert ids ascending); ``()`` for iid."""
        return () if self.structure == "iid" else self._latent["clusters"]

    def logits(self, num_tokens: int, *, seed: int = 0) -> np.ndarray:
        """Draw ``num_tokens`` consecutive tokens' router logits.

        Parameters
        ----------
        num_tokens : int
            ``T``.
        seed : int
            Seeds the tokens (topics, noise); the latent structure stays the workload's.

        Returns
        -------
        numpy.ndarray
            ``[T, E]`` float32.
        """
        t = check_int("Workload: num_tokens", num_tokens, 0)
        check_int("Workload: seed", seed, 0)
        e = self.num_experts
        rng = np.random.default_rng([self.seed, seed, 0x70C])
        if self.structure == "iid":
            return rng.standard_normal((t, e), dtype=np.float32)
        latent = self._latent
        # Sticky topics: a new run starts with probability 1 - stickiness; each run's topic is
        # drawn from the topic probabilities at its start, which drift along the sequence.
        starts = rng.random(t) >= self.stickiness
        if t:
            starts[0] = True
        run_start = np.flatnonzero(starts)
        progress = run_start / max(t - 1, 1)
        log_p = (1 - progress)[:, None] * latent["log_topic_start"] + (
            progress[:, None] * latent["log_topic_end"]
        )
        p = np.exp(log_p - log_p.max(axis=1, keepdims=True))
        cumulative = np.cumsum(p, axis=1)
        draws = rng.random(len(run_start))[:, None] * cumulative[:, -1:]
        run_topic = np.minimum((draws > cumulative).sum(axis=1), self.num_clusters - 1)
        topic = run_topic[np.cumsum(starts) - 1] if t else np.zeros(0, np.int64)
        out = rng.standard_normal((t, e), dtype=np.float32)
        out *= np.float32(self.noise)
        out += latent["popularity"].astype(np.float32)
        out += (self.strength * latent["affinity"]).astype(np.float32)[topic]
        return out


def generate_logits(
    num_tokens: int,
    num_experts: int,
    *,
    structure: Literal["clustered", "iid"] = "clustered",
    seed: int = 0,
    token_seed: int = 0,
    **options: float,
) -> np.ndarray:
    """One-shot ``Workload(num_experts, structure, seed=seed, **options).logits(T, seed=...)``.

    Returns
    -------
    numpy.ndarray
        ``[T, E]`` float32 router logits.
    """
    workload = Workload(num_experts, structure, seed=seed, **options)
    return workload.logits(num_tokens, seed=token_seed)
