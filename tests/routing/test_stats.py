"""UsageStats: counting against a per-token reference, validation, merging, files."""

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.routing import UsageStats


def reference_stats(ids: np.ndarray, num_experts: int):
    """Token by token, pair by pair: the definition, with no vectorisation."""
    counts = np.zeros(num_experts, np.int64)
    co = np.zeros((num_experts, num_experts), np.int64)
    for row in ids.tolist():
        for a in row:
            counts[a] += 1
            for b in row:
                co[a, b] += 1
    return counts, co


def random_ids(rng, tokens, num_experts, k):
    return np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :k].astype(np.int32)


@pytest.mark.parametrize(("tokens", "num_experts", "k"), [(1, 4, 1), (37, 8, 3), (500, 26, 2)])
def test_from_ids_matches_reference(tokens, num_experts, k):
    ids = random_ids(np.random.default_rng(tokens), tokens, num_experts, k)
    stats = UsageStats.from_ids(ids, num_experts)
    counts, co = reference_stats(ids, num_experts)
    assert stats.tokens == tokens
    np.testing.assert_array_equal(stats.counts, counts)
    np.testing.assert_array_equal(stats.coactivation, co)
    assert stats.counts.dtype == np.int64 and stats.coactivation.dtype == np.int64


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 12).flatmap(
        lambda e: st.tuples(
            st.just(e),
            st.lists(
                st.lists(st.integers(0, e - 1), min_size=1, max_size=e, unique=True),
                min_size=0,
                max_size=30,
            ),
        )
    )
)
def test_from_ids_property(case):
    num_experts, rows = case
    k = min((len(r) for r in rows), default=1)
    ids = np.array([r[:k] for r in rows], np.int64).reshape(len(rows), k)
    stats = UsageStats.from_ids(ids, num_experts)
    counts, co = reference_stats(ids, num_experts)
    np.testing.assert_array_equal(stats.coactivation, co)
    np.testing.assert_array_equal(stats.coactivation, stats.coactivation.T)
    assert stats.counts.sum() == ids.size


def test_chunking_and_merge_agree():
    rng = np.random.default_rng(0)
    ids = random_ids(rng, 70_000, 16, 4)  # more than one chunk
    whole = UsageStats.from_ids(ids, 16)
    parts = UsageStats.from_ids(ids[:30_000], 16) + UsageStats.from_ids(ids[30_000:], 16)
    assert whole == parts
    assert UsageStats.sum([UsageStats.from_ids(ids[i::3], 16) for i in range(3)]) == whole
    assert whole.merge() == whole
    counts, co = reference_stats(ids[:2000], 16)
    np.testing.assert_array_equal(UsageStats.from_ids(ids[:2000], 16).coactivation, co)


def test_keyword_constructor_and_read_only():
    stats = UsageStats(counts=np.array([2, 1]), coactivation=np.array([[2, 1], [1, 1]]), tokens=2)
    assert stats.num_experts == 2 and stats.tokens == 2
    np.testing.assert_allclose(stats.frequency, [1.0, 0.5])
    with pytest.raises(ValueError):
        stats.counts[0] = 5
    source = np.array([2, 1])
    stats = UsageStats(source, np.array([[2, 1], [1, 1]]), 2)
    source[0] = 0
    assert stats.counts[0] == 2  # a copy, not a view of the caller's array


@pytest.mark.parametrize(
    ("counts", "co", "tokens", "message"),
    [
        ([1.0, 1.0], [[1, 0], [0, 1]], 1, "integer"),
        ([1, 1], [[1, 0], [0, 1], [0, 0]], 1, "shape"),
        ([1, 1], [[1, 1], [0, 1]], 1, "symmetric"),
        ([1, 1], [[2, 0], [0, 1]], 2, "diagonal"),
        ([-1, 1], [[-1, 0], [0, 1]], 1, "negative"),
        ([3, 1], [[3, 0], [0, 1]], 2, "only 2 tokens"),
        ([1, 1], [[1, 2], [2, 1]], 2, "chosen together"),
        (np.zeros(0, int), np.zeros((0, 0), int), 0, "empty"),
        ([True, False], [[1, 0], [0, 0]], 1, "integer"),
    ],
)
def test_invalid_fields_are_named(counts, co, tokens, message):
    with pytest.raises((TypeError, ValueError), match=message):
        UsageStats(np.array(counts), np.array(co), tokens)


def test_invalid_tokens():
    with pytest.raises(TypeError, match="tokens"):
        UsageStats([1], [[1]], 1.5)
    with pytest.raises(ValueError, match="tokens"):
        UsageStats([0], [[0]], -1)


def test_from_ids_rejects_bad_ids():
    with pytest.raises(ValueError, match="out of range"):
        UsageStats.from_ids([[0, 4]], 4)
    with pytest.raises(ValueError, match="out of range"):
        UsageStats.from_ids([[0, -1]], 4)
    with pytest.raises(ValueError, match="twice"):
        UsageStats.from_ids([[0, 1], [2, 2]], 4)
    with pytest.raises(TypeError, match="integers"):
        UsageStats.from_ids([[0.0, 1.0]], 4)
    with pytest.raises(ValueError, match="num_experts"):
        UsageStats.from_ids([[0]], 0)
    one = UsageStats.from_ids([3, 1], 4)  # a single token as [k]
    assert one.tokens == 1 and one.coactivation[1, 3] == 1
    empty = UsageStats.from_ids(np.zeros((0, 2), np.int32), 4)
    assert empty.tokens == 0 and empty == UsageStats.empty(4)


def test_merge_rejects_different_experts():
    with pytest.raises(ValueError, match="4 and 5 experts"):
        UsageStats.empty(4) + UsageStats.empty(5)
    with pytest.raises(ValueError, match="nothing to merge"):
        UsageStats.sum([])


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_save_load_round_trip(tmp_path, suffix):
    stats = UsageStats.from_ids(random_ids(np.random.default_rng(1), 300, 10, 3), 10)
    path = tmp_path / f"stats{suffix}"
    stats.save(path)
    assert UsageStats.load(path) == stats
    assert os.listdir(tmp_path) == [path.name]  # no temporary file left behind
    with pytest.raises(FileExistsError, match="overwrite=True"):
        stats.save(path)
    other = UsageStats.empty(10)
    other.save(path, overwrite=True)
    assert UsageStats.load(path) == other


def test_bad_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"\.npz or \.json"):
        UsageStats.empty(2).save(tmp_path / "stats.txt")


def test_corrupt_files_name_the_file(tmp_path):
    good = UsageStats.from_ids([[0, 1], [1, 2]], 3)
    path = tmp_path / "s.json"
    good.save(path)
    document = json.loads(path.read_text())

    def write(doc):
        path.write_text(json.dumps(doc))

    write({**document, "coactivation": [[2, 1, 0], [0, 2, 1], [0, 1, 1]]})
    with pytest.raises(ValueError, match=r"s\.json.*symmetric"):
        UsageStats.load(path)
    write({**document, "format": "something else"})
    with pytest.raises(ValueError, match=r"s\.json.*not colibri usage statistics"):
        UsageStats.load(path)
    write({**document, "version": 99})
    with pytest.raises(ValueError, match="version"):
        UsageStats.load(path)
    write({k: v for k, v in document.items() if k != "counts"})
    with pytest.raises(ValueError, match="'counts' is missing"):
        UsageStats.load(path)
    write({**document, "counts": [1.5, 2, 1]})
    with pytest.raises(ValueError, match=r"'counts\[0\]' must be an integer"):
        UsageStats.load(path)
    write({**document, "coactivation": [[1, 1], [1, 2, 1]]})
    with pytest.raises(ValueError, match="square"):
        UsageStats.load(path)
    write({**document, "num_experts": 4})
    with pytest.raises(ValueError, match="num_experts"):
        UsageStats.load(path)
    path.write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=r"s\.json.*JSON"):
        UsageStats.load(path)
    npz = tmp_path / "s.npz"
    npz.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match=r"s\.npz.*npz"):
        UsageStats.load(npz)
    np.savez(npz, counts=np.array([1]), coactivation=np.array([[1]]), tokens=np.array(1))
    with pytest.raises(ValueError, match="not colibri usage statistics"):
        UsageStats.load(npz)


def test_router_statistics_match_from_ids():
    """ctx.stats, counted inside the router's parallel loop, equals counting its ids here."""
    import colibri

    rng = np.random.default_rng(4)
    ctx = colibri.init(26, 3, collect_stats=True, routing_threads=2)
    first = rng.standard_normal((5000, 26)).astype(np.float32)
    second = rng.standard_normal(26).astype(np.float32)  # one token, the latency path
    ids_first, _ = ctx.route(first)
    ids_second, _ = ctx.route(second)
    expected = UsageStats.from_ids(np.vstack([ids_first, ids_second[None, :]]), 26)
    assert ctx.stats == expected
    counts, co = reference_stats(np.asarray(ids_first[:300]), 26)
    small = colibri.init(26, 3, collect_stats=True)
    small.route(first[:300])
    np.testing.assert_array_equal(small.stats.coactivation, co)
    ctx.reset_stats()
    assert ctx.stats == UsageStats.empty(26)
    assert colibri.init(26, 3).stats is None


def test_atomic_write_leaves_nothing_behind_on_failure(tmp_path):
    from colibri._atomic_file import write_atomically

    path = tmp_path / "out.bin"

    def broken(file):
        file.write(b"half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_atomically(path, broken, overwrite=False)
    assert os.listdir(tmp_path) == []  # neither the file nor a temporary

    def racing(file):  # someone else creates the destination while we write
        path.write_bytes(b"theirs")
        file.write(b"ours")

    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_atomically(path, racing, overwrite=False)
    assert path.read_bytes() == b"theirs" and os.listdir(tmp_path) == ["out.bin"]
    write_atomically(path, lambda f: f.write(b"ours"), overwrite=True)
    assert path.read_bytes() == b"ours" and os.listdir(tmp_path) == ["out.bin"]
