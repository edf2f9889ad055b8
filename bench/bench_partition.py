"""Static Expert Partitioning: fidelity of learned groups, time to learn them, cost of stats.

Run: ``python bench/bench_partition.py`` (``--quick`` for a smaller, faster run).

1. Fidelity on held-out tokens. For each shape, statistics are collected while routing a
   training draw of the structured workload (``colibri.workload.Workload``), a partition is
   learned from them, and partitioned routing is compared with exact top-k on a different
   draw (other token seed), beside contiguous groups and a random partition of the same sizes.
   Three latent workloads (seeds) per shape; the target is recall >= 0.95 for the learned
   partition. The same table on iid logits, where no partition can help.
2. Time to learn a partition for E = 256 from 10**6 routed tokens' statistics (target < 1 s).
3. Slowdown of batched routing with ``collect_stats=True`` (target <= 10%).

Routing goes through colibri's router; the numbers are printed as markdown tables.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import colibri
from colibri.partition import Partition, evaluate
from colibri.routing import UsageStats
from colibri.workload import Workload

SHAPES = [  # (E, k, groups, topk_groups)
    (26, 2, 4, 1),
    (64, 8, 8, 2),
]


def route_ids(logits: np.ndarray, k: int) -> np.ndarray:
    ids, _ = colibri.route(logits, k)
    return np.asarray(ids)


def learn_stats(logits: np.ndarray, k: int) -> UsageStats:
    """Statistics as the router collects them (``collect_stats=True``) when it can."""
    e = logits.shape[1]
    try:
        ctx = colibri.init(e, k, collect_stats=True)
    except (AttributeError, TypeError):  # a router without statistics: count its ids
        return UsageStats.from_ids(route_ids(logits, k), e)
    ctx.route(logits)
    return ctx.stats


def random_partition(e: int, m: int, seed: int) -> Partition:
    order = np.random.default_rng(seed).permutation(e)
    return Partition([order[list(g)] for g in Partition.contiguous(e, m).groups])


def workload_for(e: int, k: int, structure: str, seed: int) -> Workload:
    # Latent clusters of about 1.5 k experts: a token type draws its k experts from a pool a
    # little larger than k. Sizes vary (a Dirichlet split) and ids are shuffled, so clusters
    # match neither the group sizes nor contiguous ranges.
    return Workload(e, structure, num_clusters=max(2, round(e / (1.5 * k))), seed=seed)


def fidelity_table(structure: str, train_tokens: int, test_tokens: int) -> None:
    print(f"\n### Held-out fidelity, {structure} workload\n")
    print(
        "| E | k | groups | topk_groups | partition | recall (mean, min) | mass kept (mean) "
        "| spans >1 group | spans >topk_groups | max group load / fair |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e, k, m, topk_groups in SHAPES:
        rows: dict[str, list] = {}
        for seed in range(3):
            workload = workload_for(e, k, structure, seed)
            stats = learn_stats(workload.logits(train_tokens, seed=1), k)
            held_out = workload.logits(test_tokens, seed=2)
            candidates = {
                "learned (default, load_tolerance=1.0)": Partition.from_usage(stats, m),
                "learned, load_tolerance=0.25": Partition.from_usage(stats, m, load_tolerance=0.25),
                "learned, load_tolerance=None": Partition.from_usage(stats, m, load_tolerance=None),
                "contiguous": Partition.contiguous(e, m),
                "random": random_partition(e, m, seed),
            }
            for name, partition in candidates.items():
                report = evaluate(partition, held_out, k, topk_groups=topk_groups)
                fair = np.asarray(partition.sizes) / e
                imbalance = max(np.asarray(report.group_load) / fair)
                rows.setdefault(name, []).append(
                    (
                        report.recall,
                        report.mass_kept,
                        report.spanning_share,
                        report.unreachable_share,
                        imbalance,
                    )
                )
        for name, values in rows.items():
            v = np.array(values)
            print(
                f"| {e} | {k} | {m} | {topk_groups} | {name} | {v[:, 0].mean():.4f}, "
                f"{v[:, 0].min():.4f} | {v[:, 1].mean():.4f} | {v[:, 2].mean():.3f} "
                f"| {v[:, 3].mean():.3f} | {v[:, 4].mean():.2f} |"
            )


def learning_time(tokens: int) -> None:
    e, k = 256, 8
    workload = Workload(e, num_clusters=round(e / 12), seed=0)
    stats = UsageStats.empty(e)
    chunk = 100_000
    start = time.perf_counter()
    for index, first in enumerate(range(0, tokens, chunk)):
        logits = workload.logits(min(chunk, tokens - first), seed=index)
        stats = stats + learn_stats(logits, k)
    collect = time.perf_counter() - start
    print(f"\n### Learning a partition, E={e}, k={k}, {stats.tokens} routed tokens\n")
    print(f"(drawing, routing and counting those tokens took {collect:.1f} s)\n")
    print(
        "| groups | load_tolerance | from_usage wall time (best of 3) | CPU time "
        "| co-activation kept inside groups |"
    )
    print("|---|---|---|---|---|")
    pairs = (stats.coactivation.sum() - stats.counts.sum()) / 2
    for m in (8, 16, 32):
        for tolerance in (1.0, None):
            best, cpu = np.inf, np.inf
            for _ in range(3):
                start, start_cpu = time.perf_counter(), time.process_time()
                partition = Partition.from_usage(stats, m, load_tolerance=tolerance)
                best = min(best, time.perf_counter() - start)
                cpu = min(cpu, time.process_time() - start_cpu)
            print(
                f"| {m} | {tolerance} | {best * 1000:.0f} ms | {cpu * 1000:.0f} ms "
                f"| {partition.inside_mass(stats) / pairs:.3f} |"
            )


def stats_overhead(tokens: int, repeats: int) -> None:
    print(f"\n### Cost of collect_stats=True, batched routing of {tokens} tokens\n")
    try:
        colibri.init(8, 2, collect_stats=True)
    except (AttributeError, TypeError):
        print("(the router does not accept collect_stats yet: skipped)")
        return
    print("(off and on runs interleaved, best of each; the machine may be shared)\n")
    print("| E | k | routing_threads | off (ms, best) | on (ms, best) | slowdown |")
    print("|---|---|---|---|---|---|")
    for e, k in ((26, 2), (64, 8), (256, 8)):
        logits = Workload(e, seed=0).logits(tokens, seed=3)
        for threads in sorted({1, colibri.max_threads()}):
            contexts = {
                on: colibri.init(e, k, collect_stats=on, routing_threads=threads)
                for on in (False, True)
            }
            ids = np.empty((tokens, k), np.int32)
            weights = np.empty((tokens, k), np.float32)
            best = {False: np.inf, True: np.inf}
            for _ in range(repeats):
                for on, ctx in contexts.items():
                    start = time.perf_counter()
                    ctx.route(logits, out=(ids, weights))
                    best[on] = min(best[on], time.perf_counter() - start)
            print(
                f"| {e} | {k} | {threads} | {best[False] * 1e3:.2f} | {best[True] * 1e3:.2f} "
                f"| {(best[True] / best[False] - 1) * 100:+.1f}% |"
            )
    print("\nSingle token (`[E]` logits, the latency path), best of 5 x 1000 calls:\n")
    print("| E | k | off (us per call) | on (us per call) | slowdown |")
    print("|---|---|---|---|---|")
    for e, k in ((26, 2), (256, 8)):
        one = Workload(e, seed=0).logits(1, seed=3)[0]
        per_call = {}
        for on in (False, True):
            ctx = colibri.init(e, k, collect_stats=on)
            best_time = np.inf
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(1000):
                    ctx.route(one)
                best_time = min(best_time, (time.perf_counter() - start) / 1000)
            per_call[on] = best_time
        print(
            f"| {e} | {k} | {per_call[False] * 1e6:.1f} | {per_call[True] * 1e6:.1f} "
            f"| {per_call[True] / per_call[False]:.1f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens")
    args = parser.parse_args()
    if not hasattr(colibri, "route"):
        raise SystemExit("bench_partition needs colibri's router (colibri.route)")
    train, test = (20_000, 20_000) if args.quick else (50_000, 50_000)
    fidelity_table("clustered", train, test)
    fidelity_table("iid", train, test)
    learning_time(200_000 if args.quick else 1_000_000)
    stats_overhead(16_384 if args.quick else 65_536, 5 if args.quick else 20)


if __name__ == "__main__":
    main()
