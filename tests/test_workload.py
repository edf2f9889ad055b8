"""Workload: seeded, documented structure (clusters, skew, drift) and the iid mode."""

import numpy as np
import pytest

from colibri.routing import UsageStats
from colibri.workload import Workload, generate_logits


def top_ids(logits, k):
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


def test_shape_dtype_and_seeds():
    w = Workload(26, seed=3)
    a = w.logits(500, seed=1)
    assert a.shape == (500, 26) and a.dtype == np.float32
    np.testing.assert_array_equal(a, Workload(26, seed=3).logits(500, seed=1))
    assert not np.array_equal(a, w.logits(500, seed=2))
    assert Workload(26, seed=4).clusters != w.clusters
    np.testing.assert_array_equal(generate_logits(500, 26, seed=3, token_seed=1), a)
    assert w.logits(0).shape == (0, 26)
    iid = Workload(26, "iid").logits(400)
    assert iid.shape == (400, 26) and iid.dtype == np.float32 and Workload(26, "iid").clusters == ()


def test_clusters_cover_experts_and_are_not_id_ranges():
    w = Workload(64, num_clusters=5, seed=0)
    members = sorted(x for c in w.clusters for x in c)
    assert members == list(range(64))
    assert len(w.clusters) == 5
    assert len({len(c) for c in w.clusters}) > 1  # unequal sizes
    for cluster in w.clusters:
        assert cluster != tuple(range(cluster[0], cluster[0] + len(cluster)))


def test_experts_of_a_cluster_fire_together():
    w = Workload(26, num_clusters=6, seed=1)
    stats = UsageStats.from_ids(top_ids(w.logits(20_000), 2), 26)
    label = np.empty(26, int)
    for i, cluster in enumerate(w.clusters):
        label[list(cluster)] = i
    same = label[:, None] == label[None, :]
    np.fill_diagonal(same, False)
    other = ~same
    np.fill_diagonal(other, False)
    pairs = stats.coactivation
    # Mass per pair inside clusters dwarfs mass per pair across clusters.
    assert pairs[same].mean() > 10 * pairs[other].mean()
    iid = UsageStats.from_ids(top_ids(Workload(26, "iid").logits(20_000), 2), 26)
    assert iid.coactivation[same].mean() < 1.5 * iid.coactivation[other].mean()


def test_popularity_is_skewed_only_when_structured():
    clustered = UsageStats.from_ids(top_ids(Workload(32, seed=2).logits(20_000), 4), 32)
    iid = UsageStats.from_ids(top_ids(Workload(32, "iid").logits(20_000), 4), 32)
    assert clustered.counts.max() > 4 * clustered.counts.min()
    assert iid.counts.max() < 1.3 * iid.counts.min()


def test_topics_are_sticky_and_drift():
    w = Workload(40, num_clusters=8, seed=5, noise=0.3)
    logits = w.logits(40_000, seed=1)
    label = np.empty(40, int)
    for i, cluster in enumerate(w.clusters):
        label[list(cluster)] = i
    topic = label[np.argmax(logits, axis=1)]  # the top expert's cluster
    repeat = np.mean(topic[1:] == topic[:-1])
    share = np.bincount(topic, minlength=8) / len(topic)
    assert repeat > 0.8 and repeat > np.sum(share**2) + 0.3  # far above chance
    first = np.bincount(topic[:10_000], minlength=8) / 10_000
    last = np.bincount(topic[-10_000:], minlength=8) / 10_000
    assert np.abs(first - last).sum() > 0.3  # the topic mix moves along the sequence
    shuffled = Workload(40, num_clusters=8, seed=5, noise=0.3, stickiness=0.0).logits(40_000)
    topic0 = label[np.argmax(shuffled, axis=1)]
    assert np.mean(topic0[1:] == topic0[:-1]) < 0.6


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_experts": 0}, ValueError, "num_experts"),
        ({"num_experts": 8.0}, TypeError, "num_experts"),
        ({"num_experts": 8, "structure": "zipf"}, ValueError, "structure"),
        ({"num_experts": 8, "noise": -1.0}, ValueError, "noise"),
        ({"num_experts": 8, "strength": float("nan")}, ValueError, "strength"),
        ({"num_experts": 8, "stickiness": 1.0}, ValueError, "stickiness"),
        ({"num_experts": 8, "shared": 2.0}, ValueError, "shared"),
        ({"num_experts": 8, "num_clusters": 0}, ValueError, "num_clusters"),
        ({"num_experts": 8, "seed": -1}, ValueError, "seed"),
    ],
)
def test_invalid_parameters(kwargs, error, message):
    with pytest.raises(error, match=message):
        Workload(**kwargs)


def test_invalid_token_counts():
    with pytest.raises(ValueError, match="num_tokens"):
        Workload(8).logits(-1)
    with pytest.raises(TypeError, match="num_tokens"):
        Workload(8).logits(1.5)


def test_more_clusters_than_experts_is_capped():
    w = Workload(3, num_clusters=10)
    assert len(w.clusters) == 3 and sorted(x for c in w.clusters for x in c) == [0, 1, 2]
