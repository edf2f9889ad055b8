"""Pager benchmark: cache policies against Belady's optimum, bytes read, throughput, peak RSS.

Run: ``python bench/bench_pager.py`` (about a minute; ``--quick`` for a smoke run).

For each model shape (26 experts top-2 over 24 layers; 64 experts top-8 over 24 layers) it
writes a weight file of random fp16 experts in colibri's raw format and generates a decoding
routing trace with numpy: per layer a Zipf expert popularity, plus a per-sequence offset
(topics) and a slowly drifting per-token offset (AR(1)), plus per-token Gumbel noise, top-k of
the sum. Then, for several budgets given as a share of all expert bytes:

1. hit rate of every policy (offline replay, identical to what the Pager does) beside Belady's
   MIN; ``hot`` learns its counts from a different trace (an "earlier run");
2. real Pager runs (FIFO and the best policy; ``populate=True``): bytes read per token, read
   throughput against one plain sequential read of the same file (both warm page cache), peak
   RSS growth (VmHWM reset before each run) against the budget, wall time per token; the
   Pager's hit count is checked against the replay.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from colibri.formats.raw import write_experts
from colibri.pager import Pager
from colibri.policies import Trace, belady, replay

POLICIES = ("fifo", "lru", "lfu", "lrfu", "nextuse", "hot")


def routing_trace(num_experts, top_k, num_layers, tokens, *, seed, seq_len=256, noise=1.0):
    """Decode-order steps ``(layer, ids [k])``: Zipf popularity + topic + drift + noise.

    ``noise`` scales the per-token Gumbel noise: the unpredictable part of routing.
    """
    rng = np.random.default_rng(seed)
    popularity = np.stack(
        [-np.log1p(np.random.default_rng(l).permutation(num_experts)) for l in range(num_layers)]
    )  # the same model for every seed: the popularity belongs to the weights
    steps = []
    for t in range(tokens):
        if t % seq_len == 0:
            topic = rng.normal(0.0, 1.0, (num_layers, num_experts))
            drift = rng.normal(0.0, 0.7, (num_layers, num_experts))
        drift = 0.9 * drift + np.sqrt(1 - 0.81) * rng.normal(0.0, 0.7, drift.shape)
        scores = popularity + topic + drift + noise * rng.gumbel(size=drift.shape)
        ids = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
        steps += [(layer, ids[layer]) for layer in range(num_layers)]
    return Trace(steps)


def write_model(folder, num_experts, num_layers, hidden, inter):
    rng = np.random.default_rng(0)
    one = rng.standard_normal(3 * hidden * inter).astype(np.float16)

    def experts():
        for layer in range(num_layers):
            for e in range(num_experts):
                v = np.roll(one, layer * num_experts + e)
                yield (
                    (layer, e),
                    (
                        v[: inter * hidden].reshape(inter, hidden),
                        v[inter * hidden : 2 * inter * hidden].reshape(inter, hidden),
                        v[2 * inter * hidden :].reshape(hidden, inter),
                    ),
                )

    path = os.path.join(folder, f"experts-{num_experts}x{num_layers}.colibri")
    return write_experts(path, experts(), overwrite=True)


def sequential_read_throughput(path):
    """Bytes/s of one plain sequential read of the whole file (after a warming read)."""
    buf = bytearray(8 << 20)
    best = 0.0
    for _ in range(4):  # the first pass warms the page cache; keep the best of the rest
        start, total = time.perf_counter(), 0
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
        best = max(best, total / (time.perf_counter() - start))
    return best


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def reset_peak_rss():
    """Restart VmHWM at the current RSS (Linux); returns the current RSS or None."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmRSS:")
    except OSError:
        return None


def run_pager(path, trace, budget, policy, policy_options, tokens):
    base = reset_peak_rss()
    start = time.perf_counter()
    with Pager(path, budget_bytes=budget, page_size_kb=64, policy=policy,
               policy_options=policy_options, populate=True) as pager:  # fmt: skip
        capacity = pager.capacity
        for layer, ids in trace:
            with pager.load(layer, ids) as batch:
                sum(float(w.down[0, 0]) for w in batch.values())  # touch; keep no view
        stats = pager.stats
    elapsed = time.perf_counter() - start
    peak = _status("VmHWM:") - base if base is not None else None
    expected = replay(trace, capacity, policy, **(policy_options or {}))
    assert stats.hits == expected.hits, (stats.hits, expected.hits)
    return {
        "hit": stats.hit_rate,
        "mib_per_token": stats.bytes_read / tokens / 2**20,
        "throughput": stats.read_throughput,
        "peak_rss": peak,
        "resident": stats.peak_resident_bytes,
        "ms_per_token": 1e3 * elapsed / tokens,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000, help="tokens in the replay traces")
    ap.add_argument("--io-tokens", type=int, default=200, help="tokens in the real Pager runs")
    ap.add_argument("--quick", action="store_true", help="tiny run for smoke testing")
    ap.add_argument("--dir", default=None, help="where to write the weight files")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.io_tokens = 100, 30
    shapes = [  # experts, top-k, layers, hidden, intermediate
        (26, 2, 24, 256, 128),
        (64, 8, 24, 128, 128),
    ]
    budgets = (0.25, 0.375, 0.5, 0.75)
    folder = args.dir or tempfile.mkdtemp(prefix="colibri-bench-")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, files in {folder}\n")
    for num_experts, top_k, num_layers, hidden, inter in shapes:
        path = write_model(folder, num_experts, num_layers, hidden, inter)
        expert_bytes = 3 * hidden * inter * 2
        total = expert_bytes * num_experts * num_layers
        seq = sequential_read_throughput(path)
        trace = routing_trace(num_experts, top_k, num_layers, args.tokens, seed=1)
        earlier = routing_trace(num_experts, top_k, num_layers, args.tokens, seed=2).counts()
        print(
            f"## {num_experts} experts, top-{top_k}, {num_layers} layers: "
            f"{expert_bytes // 1024} KiB per expert, {total / 2**20:.0f} MiB of experts, "
            f"{args.tokens} tokens\n"
        )
        head = "| budget | slots | " + " | ".join(POLICIES) + " | Belady | best - Belady |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        best = {}
        for frac in budgets:
            capacity = int(frac * total) // expert_bytes  # 64 KiB pages: slot == expert here
            rates = {}
            for policy in POLICIES:
                opts = {"counts": earlier} if policy == "hot" else {}
                rates[policy] = replay(trace, capacity, policy, **opts).hit_rate
            optimum = belady(trace, capacity).hit_rate
            best[frac] = max(rates, key=rates.get)
            cells = " | ".join(f"{100 * rates[p]:.1f}" for p in POLICIES)
            gap = 100 * (rates[best[frac]] - optimum)
            print(
                f"| {100 * frac:.1f}% | {capacity} | {cells} | {100 * optimum:.1f} | "
                f"{gap:+.1f} ({best[frac]}) |"
            )
        print(
            f"\nReal Pager runs ({args.io_tokens} tokens, page_size_kb=64, warm page cache; "
            f"plain sequential read of the file, 8 MiB chunks: {seq / 1e9:.2f} GB/s, measured "
            "again before each run for the ratio):\n"
        )
        print(
            "| budget | policy | hit % | MiB read / token | read GB/s | vs sequential | "
            "peak RSS growth | budget | ms / token |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        io_trace = Trace(trace.steps[: args.io_tokens * num_layers])
        for frac in budgets:
            budget = int(frac * total)
            for policy in ("fifo", best[frac]):
                seq = sequential_read_throughput(path)  # right before: the machine is shared
                r = run_pager(path, io_trace, budget, policy, None, args.io_tokens)
                rss = f"{r['peak_rss'] / 2**20:.1f} MiB" if r["peak_rss"] is not None else "n/a"
                print(
                    f"| {100 * frac:.1f}% | {policy} | {100 * r['hit']:.1f} | "
                    f"{r['mib_per_token']:.2f} | {r['throughput'] / 1e9:.2f} | "
                    f"{r['throughput'] / seq:.2f}x | {rss} | {budget / 2**20:.1f} MiB | "
                    f"{r['ms_per_token']:.1f} |"
                )
        print()
        os.unlink(path)
        os.unlink(path + ".json")
    print(
        "## Gap to Belady against per-token randomness (26 experts, top-2, 24 layers; "
        "replay)\n\nnoise scales the per-token Gumbel term of the trace (1.0 above).\n"
    )
    print("| noise | " + " | ".join(f"{100 * f:.1f}%: best / Belady" for f in budgets[:3]) + " |")
    print("|---|---|---|---|")
    for noise in (1.0, 0.5, 0.25):
        trace = routing_trace(26, 2, 24, args.tokens, seed=1, noise=noise)
        cells = []
        for frac in budgets[:3]:
            capacity = int(frac * 26 * 24)
            rate = max(replay(trace, capacity, p).hit_rate for p in POLICIES if p != "hot")
            optimum = belady(trace, capacity).hit_rate
            cells.append(f"{100 * rate:.1f} / {100 * optimum:.1f} ({100 * (rate - optimum):+.1f})")
        print(f"| {noise} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
