"""Partition: validation, contiguous groups, learning from usage, files, fidelity."""

import itertools
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import FormatError
from colibri.partition import Partition, evaluate, fidelity
from colibri.routing import UsageStats

# -- an independent numpy reference of exact and partitioned top-k ------------------------------


def reference_topk(logits: np.ndarray, k: int) -> np.ndarray:
    """Top-k by descending logit, ties to the lower expert id."""
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


def reference_partitioned_topk(logits, k, groups, topk_groups):
    """Best ``topk_groups`` groups by their max logit (ties: lower group), then top-k inside."""
    t, e = logits.shape
    group_score = np.stack([logits[:, list(g)].max(axis=1) for g in groups], axis=1)
    kept = np.argsort(-group_score, axis=1, kind="stable")[:, :topk_groups]
    allowed = np.zeros((t, e), bool)
    for g, members in enumerate(groups):
        allowed[:, list(members)] |= (kept == g).any(axis=1)[:, None]
    return reference_topk(np.where(allowed, logits, -np.inf), k)


def inside_mass_reference(groups, stats):
    return sum(
        int(stats.coactivation[a, b]) for g in groups for a, b in itertools.combinations(g, 2)
    )


def planted_stats(cluster_sizes, tokens, k, seed, leak=0.05):
    """Tokens choose k experts of one planted cluster (sometimes one expert elsewhere)."""
    rng = np.random.default_rng(seed)
    e = sum(cluster_sizes)
    order = rng.permutation(e)
    bounds = np.cumsum([0, *cluster_sizes])
    clusters = [sorted(order[bounds[i] : bounds[i + 1]].tolist()) for i in range(len(bounds) - 1)]
    popularity = rng.permutation(len(clusters)) + 1.0
    rows = []
    for _ in range(tokens):
        c = clusters[rng.choice(len(clusters), p=popularity / popularity.sum())]
        row = list(rng.choice(c, size=k, replace=False))
        if rng.random() < leak:
            row[-1] = int(rng.choice([x for x in range(e) if x not in row]))
        rows.append(row)
    return clusters, UsageStats.from_ids(np.array(rows), e)


# -- construction and validation -----------------------------------------------------------------


def test_groups_keep_order_and_sort_ids():
    p = Partition([[5, 2], [0, 4, 1], [3]])
    assert p.groups == ((2, 5), (0, 1, 4), (3,))
    assert p.num_experts == 6 and p.num_groups == 3 and p.sizes == (2, 3, 1)
    assert p.group_of.dtype == np.int32
    assert p.group_of.tolist() == [1, 1, 0, 2, 1, 0]
    with pytest.raises(ValueError):
        p.group_of[0] = 2
    assert Partition(np.array([[1, 0], [2, 3]])) == Partition([(0, 1), (3, 2)])
    assert eval(repr(p), {"Partition": Partition}) == p


@pytest.mark.parametrize(
    ("groups", "error", "message"),
    [
        ([[0, 1], [1, 2]], ValueError, "expert 1 appears twice"),
        ([[0, 1], [3]], ValueError, "out of range"),
        ([[0, -1], [1]], ValueError, "out of range"),
        ([[0, 1], []], ValueError, "group 1 is empty"),
        ([], ValueError, "at least one group"),
        ([[0, 1.0]], TypeError, "must be ints"),
        ([[0, True]], TypeError, "must be ints"),
        ([[0, "1"]], TypeError, "must be ints"),
        ("01", TypeError, "list of lists"),
        ([0, 1], TypeError, "group 0 must be a list"),
        (None, TypeError, "list of lists"),
    ],
)
def test_invalid_groups(groups, error, message):
    with pytest.raises(error, match=message):
        Partition(groups)


def test_missing_experts_with_num_experts():
    with pytest.raises(ValueError, match=r"experts 2, 3 are in no group"):
        Partition([[0], [1]], num_experts=4)


def test_contiguous_26_in_4():
    p = Partition.contiguous(26, 4)
    assert p.sizes == (7, 7, 6, 6)
    assert p.groups[0] == tuple(range(7)) and p.groups[3] == tuple(range(20, 26))


@given(st.integers(1, 300), st.integers(1, 300))
def test_contiguous_sizes(num_experts, num_groups):
    if num_groups > num_experts:
        with pytest.raises(ValueError, match="must not exceed"):
            Partition.contiguous(num_experts, num_groups)
        return
    p = Partition.contiguous(num_experts, num_groups)
    assert max(p.sizes) - min(p.sizes) <= 1
    assert list(p.sizes) == sorted(p.sizes, reverse=True)
    assert [x for g in p.groups for x in g] == list(range(num_experts))


def test_contiguous_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_groups"):
        Partition.contiguous(4, 0)
    with pytest.raises(TypeError, match="num_experts"):
        Partition.contiguous(4.0, 2)


# -- learning from usage ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "k", "seed"), [((7, 7, 6, 6), 2, 0), ((8,) * 8, 3, 1), ((4, 4, 3), 2, 2)]
)
def test_from_usage_recovers_planted_clusters(sizes, k, seed):
    clusters, stats = planted_stats(list(sizes), 4000, k, seed)
    learned = Partition.from_usage(stats, len(sizes), load_tolerance=None)
    assert sorted(learned.groups) == sorted(tuple(c) for c in clusters)
    assert learned.inside_mass(stats) == inside_mass_reference(learned.groups, stats)


def test_from_usage_finds_clusters_smaller_than_groups():
    """Clusters of 3, 2, 4, ... must be packed into groups of 7/6 without being split."""
    clusters, stats = planted_stats([3, 4, 2, 3, 4, 3, 3, 4], 6000, 2, 7, leak=0.02)
    learned = Partition.from_usage(stats, 4, load_tolerance=None)
    for cluster in clusters:
        assert len({learned.group_of[x] for x in cluster}) == 1, cluster
    assert sorted(learned.sizes) == [6, 6, 7, 7]


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 14), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_from_usage_property(num_experts, num_groups, k, seed):
    """Any statistics: a valid partition, sizes within one, deterministic, swap-optimal."""
    num_groups = min(num_groups, num_experts)
    k = min(k, num_experts)
    rng = np.random.default_rng(seed)
    popularity = rng.random(num_experts) ** 3 + 1e-3
    ids = np.array(
        [
            rng.choice(num_experts, size=k, replace=False, p=popularity / popularity.sum())
            for _ in range(rng.integers(0, 60))
        ],
        dtype=np.int64,
    ).reshape(-1, k)  # zero tokens included
    stats = UsageStats.from_ids(ids, num_experts)
    for tolerance in (None, 0.3):
        p = Partition.from_usage(stats, num_groups, load_tolerance=tolerance)
        assert p.num_experts == num_experts and p.num_groups == num_groups
        assert max(p.sizes) - min(p.sizes) <= 1
        assert p == Partition.from_usage(stats, num_groups, load_tolerance=tolerance)
    free = Partition.from_usage(stats, num_groups, load_tolerance=None)
    mass = free.inside_mass(stats)
    groups = [list(g) for g in free.groups]
    for a, b in itertools.combinations(range(num_groups), 2):  # no single swap gains
        for x in groups[a]:
            for y in groups[b]:
                swapped = [list(g) for g in groups]
                swapped[a][swapped[a].index(x)] = y
                swapped[b][swapped[b].index(y)] = x
                assert inside_mass_reference(swapped, stats) <= mass


def brute_force_best(stats, sizes):
    e = stats.num_experts
    best = -1
    for labels in itertools.product(range(len(sizes)), repeat=e):
        if labels[0] != 0 or sorted(np.bincount(labels, minlength=len(sizes))) != sorted(sizes):
            continue
        groups = [[x for x in range(e) if labels[x] == g] for g in range(len(sizes))]
        best = max(best, inside_mass_reference(groups, stats))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_from_usage_matches_brute_force_on_small_cases(seed):
    rng = np.random.default_rng(seed)
    e, m = 9, 3
    weights = rng.random(e) ** 2
    ids = np.stack(
        [rng.choice(e, size=3, replace=False, p=weights / weights.sum()) for _ in range(300)]
    )
    stats = UsageStats.from_ids(ids, e)
    learned = Partition.from_usage(stats, m, load_tolerance=None)
    assert learned.inside_mass(stats) == brute_force_best(stats, [3, 3, 3])


def test_from_usage_is_a_local_optimum_and_deterministic():
    rng = np.random.default_rng(3)
    e, m = 20, 3
    ids = np.stack([rng.choice(e, size=4, replace=False) for _ in range(2000)])
    stats = UsageStats.from_ids(ids, e)
    learned = Partition.from_usage(stats, m, load_tolerance=None)
    assert learned == Partition.from_usage(stats, m, load_tolerance=None)
    mass = learned.inside_mass(stats)
    groups = [list(g) for g in learned.groups]
    for a, b in itertools.combinations(range(m), 2):
        for x in groups[a]:
            for y in groups[b]:
                swapped = [list(g) for g in groups]
                swapped[a][swapped[a].index(x)] = y
                swapped[b][swapped[b].index(y)] = x
                assert inside_mass_reference(swapped, stats) <= mass


def test_from_usage_respects_the_load_bound():
    rng = np.random.default_rng(5)
    e, m, k = 24, 4, 2
    hot = rng.random(e) ** 4  # very skewed popularity
    ids = np.stack([rng.choice(e, size=k, replace=False, p=hot / hot.sum()) for _ in range(4000)])
    stats = UsageStats.from_ids(ids, e)
    fair = stats.counts.sum() / m
    for tolerance in (0.1, 0.5):
        p = Partition.from_usage(stats, m, load_tolerance=tolerance)
        loads = [stats.counts[list(g)].sum() for g in p.groups]
        assert max(loads) <= (1 + tolerance) * fair
    free = Partition.from_usage(stats, m, load_tolerance=None)
    tight = Partition.from_usage(stats, m, load_tolerance=0.1)
    assert free.inside_mass(stats) >= tight.inside_mass(stats)


def test_from_usage_edge_cases():
    stats = UsageStats.from_ids([[0, 1], [2, 3]], 5)
    assert Partition.from_usage(stats, 1).groups == ((0, 1, 2, 3, 4),)
    assert sorted(Partition.from_usage(stats, 5).sizes) == [1] * 5
    empty = Partition.from_usage(UsageStats.empty(7), 3)
    assert sorted(empty.sizes) == [2, 2, 3]
    assert empty == Partition.from_usage(UsageStats.empty(7), 3)
    many = Partition.from_usage(UsageStats.empty(450), 3)  # 450 lone experts to pack
    assert many.sizes == (150, 150, 150)
    with pytest.raises(ValueError, match="must not exceed"):
        Partition.from_usage(stats, 6)
    with pytest.raises(TypeError, match="UsageStats"):
        Partition.from_usage(np.eye(3, dtype=int), 2)
    with pytest.raises(ValueError, match="load_tolerance"):
        Partition.from_usage(stats, 2, load_tolerance=-0.5)


# -- files ---------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    p = Partition([[4, 0], [1, 3], [2]])
    path = tmp_path / "p.json"
    p.save(path)
    assert Partition.load(path) == p
    assert json.loads(path.read_text())["groups"] == [[0, 4], [1, 3], [2]]
    assert os.listdir(tmp_path) == ["p.json"]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        Partition.contiguous(5, 2).save(path)
    assert Partition.load(path) == p  # refused save left the file alone
    Partition.contiguous(5, 2).save(path, overwrite=True)
    assert Partition.load(path) == Partition.contiguous(5, 2)
    with pytest.raises(ValueError, match="expected 6"):
        Partition.load(path, num_experts=6)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"format": "colibri.Partition", "version": 1, "groups": [[0, 1], [1]]}, "twice"),
        ({"format": "colibri.Partition", "version": 1, "groups": [[0], [2]]}, "out of range"),
        (
            {"format": "colibri.Partition", "version": 1, "num_experts": 3, "groups": [[0], [1]]},
            r"'num_experts' is 3 but the groups list 2 expert ids \(in no group: 2\)",
        ),
        (
            {
                "format": "colibri.Partition",
                "version": 1,
                "num_experts": 4,
                "groups": [[0, 1], [1, 2, 3]],
            },
            r"groups list 5 expert ids \(listed twice: 1\)",
        ),  # fmt: skip
        (
            {
                "format": "colibri.Partition",
                "version": 1,
                "num_experts": 3,
                "groups": [[0, 1], [5, 7, 2]],
            },
            r"groups list 5 expert ids \(out of range \[0, 3\): 5, 7\)",
        ),  # fmt: skip
        (
            {
                "format": "colibri.Partition",
                "version": 1,
                "num_experts": 2**40,
                "groups": [[0, 2], [0]],
            },
            r"\(listed twice: 0; in no group: 1, 3, 4, 5, 6, 7, 8, 9 \.\.\.\)",
        ),  # fmt: skip
        (
            {"format": "colibri.Partition", "version": 1, "groups": [[0, 0.5]]},
            r"'groups\[0\]\[1\]' must be an integer",
        ),
        (
            {"format": "colibri.Partition", "version": 1, "groups": {"a": 1}},
            "'groups' must be a list",
        ),
        ({"format": "colibri.Partition", "version": 2, "groups": [[0]]}, "version"),
        ({"groups": [[0]]}, "not a colibri partition"),
        ([1, 2], "not a colibri partition"),
    ],
)
def test_invalid_files_name_the_file(tmp_path, document, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(FormatError, match=rf"bad\.json: (invalid partition: )?.*{message}"):
        Partition.load(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_or_directory_is_refused_unopened(tmp_path):
    """A FIFO given as the partition file is refused by type (opening it would wait for a
    writer forever); so is a directory."""
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "dir.json").mkdir()
    for name, kind in (("fifo.json", "a FIFO"), ("dir.json", "a directory")):
        with pytest.raises(FormatError, match=rf"{name}: the partition is {kind}"):
            Partition.load(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="missing"):
        Partition.load(tmp_path / "none.json")


def test_garbage_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match=r"bad\.json.*JSON"):
        Partition.load(path)


# -- fidelity ------------------------------------------------------------------------------------


def test_fidelity_by_hand():
    p = Partition([[0, 1], [2, 3]])
    logits = np.log(np.array([[0.4, 0.1, 0.3, 0.2], [0.1, 0.2, 0.3, 0.4]]))
    exact = np.array([[0, 2], [3, 2]])
    partitioned = np.array([[0, 1], [3, 2]])
    report = fidelity(p, logits, exact, partitioned)
    assert report.recall == pytest.approx(3 / 4)
    assert report.mass_kept == pytest.approx((0.5 + 0.7) / (0.7 + 0.7))
    assert report.exact_share == pytest.approx(0.5)
    assert report.spanning_share == pytest.approx(0.5)
    assert report.unreachable_share == pytest.approx(0.5)
    assert report.group_load == pytest.approx((0.5, 0.5))
    assert report.exact_group_load == pytest.approx((0.25, 0.75))
    text = str(report)
    assert "recall of exact top-k       0.7500" in text and "2 groups" in text


def test_fidelity_with_reference_routing():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2000, 12)).astype(np.float32)
    p = Partition([[0, 5, 7], [1, 2, 3, 4], [6, 8], [9, 10, 11]])
    exact = reference_topk(logits, 3)
    for topk_groups in (1, 2, 4):
        part = reference_partitioned_topk(logits, 3, p.groups, topk_groups)
        report = fidelity(p, logits, exact, part, topk_groups=topk_groups)
        kept = [len(set(a) & set(b)) for a, b in zip(exact.tolist(), part.tolist(), strict=False)]
        assert report.recall == pytest.approx(sum(kept) / exact.size)
        assert 0 < report.mass_kept <= 1 + 1e-12
        assert sum(report.group_load) == pytest.approx(1.0)
        if topk_groups == 4:
            assert report.recall == 1.0 and report.mass_kept == pytest.approx(1.0)


@pytest.mark.parametrize(("k", "topk_groups"), [(2, 1), (3, 2)])
def test_evaluate_through_the_router_matches_reference(k, topk_groups):
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((3000, 26)).astype(np.float32)
    p = Partition(np.array_split(rng.permutation(26), 4))
    report = evaluate(p, logits, k, topk_groups=topk_groups, group_score="max")
    expected = fidelity(
        p,
        logits,
        reference_topk(logits, k),
        reference_partitioned_topk(logits, k, p.groups, topk_groups),
        topk_groups=topk_groups,
    )
    assert report == expected
    assert evaluate([list(g) for g in p.groups], logits, k, topk_groups=topk_groups) == expected


def test_evaluate_rejects_bad_input():
    p = Partition.contiguous(8, 2)
    with pytest.raises(ValueError, match="E = 8"):
        evaluate(p, np.zeros((4, 9), np.float32), 2)
    with pytest.raises(ValueError, match="topk_groups"):
        evaluate(p, np.zeros((4, 8), np.float32), 2, topk_groups=3)
    with pytest.raises(TypeError, match="partition="):
        evaluate(p, np.zeros((4, 8), np.float32), 2, partition=p)
    with pytest.raises(TypeError, match="num_groups="):
        evaluate(p, np.zeros((4, 8), np.float32), 2, num_groups=2)


# -- command line --------------------------------------------------------------------------------


def run_cli(argv):
    from colibri.cli import main

    return main(["partition", *argv])


def test_cli_learns_and_saves(tmp_path, capsys):
    clusters, stats = planted_stats([7, 7, 6, 6], 3000, 2, 11)
    first, second = tmp_path / "a.npz", tmp_path / "b.json"
    UsageStats.from_ids(np.zeros((0, 2), np.int32), 26).save(first)
    stats.save(second)
    out = tmp_path / "groups.json"
    assert run_cli([str(first), str(second), "--groups", "4", "--out", str(out)]) == 0
    assert sorted(Partition.load(out).groups) == sorted(tuple(c) for c in clusters)
    text = capsys.readouterr().out
    assert "3000 tokens, 26 experts, from 2 statistics file(s)" in text and "wrote" in text
    assert run_cli([str(second), "--groups", "4", "--out", str(out)]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert run_cli([str(second), "--groups", "3", "--out", str(out), "--overwrite"]) == 0
    assert Partition.load(out).num_groups == 3


def test_cli_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "s.json"
    bad.write_text("{}")
    assert run_cli([str(bad), "--groups", "2"]) == 1
    assert "s.json" in capsys.readouterr().err
    good = tmp_path / "t.json"
    UsageStats.empty(4).save(good)
    assert run_cli([str(good), "--groups", "9"]) == 1
    assert run_cli([str(good), "--groups", "2", "--top-k", "1", "--workload", "iid"]) == 1
    assert "drop the statistics files" in capsys.readouterr().err
    assert run_cli(["--groups", "2", "--workload", "iid", "--experts", "8"]) == 1
    assert "--top-k" in capsys.readouterr().err
    assert run_cli(["--groups", "2"]) == 1
    assert "--workload" in capsys.readouterr().err
    logits = tmp_path / "l.npy"
    np.save(logits, np.zeros((3, 5), np.float32))
    assert run_cli([str(good), "--groups", "2", "--top-k", "1", "--logits", str(logits)]) == 1
    assert "E = 4" in capsys.readouterr().err


def test_cli_evaluates(tmp_path, capsys):
    _, stats = planted_stats([7, 7, 6, 6], 3000, 2, 11)
    path = tmp_path / "s.npz"
    stats.save(path)
    logits = tmp_path / "l.npy"
    np.save(logits, np.random.default_rng(0).standard_normal((200, 26)).astype(np.float32))
    argv = [str(path), "--groups", "4", "--top-k", "2", "--logits", str(logits)]
    assert run_cli(argv) == 0
    text = capsys.readouterr().out
    assert text.count("recall of exact top-k") == 2
    argv = ["--workload", "clustered", "--experts", "26", "--top-k", "2", "--groups", "4"]
    assert run_cli([*argv, "--tokens", "3000", "--out", str(tmp_path / "g.json")]) == 0
    text = capsys.readouterr().out
    assert "3000 tokens, 26 experts, from clustered workload (seed 0)" in text
    assert Partition.load(tmp_path / "g.json").num_experts == 26


def test_evaluate_passes_routing_options():
    """sigmoid scoring with a selection bias: both routings choose by sigmoid(x) + bias."""
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((2000, 16)).astype(np.float32)
    bias = (rng.standard_normal(16) * 0.5).astype(np.float32)
    p = Partition(np.array_split(rng.permutation(16), 4))
    keys = (1 / (1 + np.exp(-logits.astype(np.float64)))).astype(np.float32) + bias
    report = evaluate(p, logits, 3, topk_groups=2, scoring="sigmoid", correction_bias=bias)
    expected = fidelity(
        p,
        logits,
        reference_topk(keys, 3),
        reference_partitioned_topk(keys, 3, p.groups, 2),
        topk_groups=2,
        scoring="sigmoid",
    )
    assert report.recall == pytest.approx(expected.recall, abs=2e-3)  # float32 near-ties
    assert report.mass_kept == pytest.approx(expected.mass_kept, abs=2e-3)
