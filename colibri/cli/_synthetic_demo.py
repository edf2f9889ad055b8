"""``colibri demo``: a model bigger than its memory budget, token by token.

On first run it writes a synthetic MoE weight file shaped like the seed's model (26
experts, top-2, several layers; float16; 2 GiB by default) into a cache folder, one expert
at a time. Then it streams tokens through ``MoELayer`` with expert weights paged from that
file under a budget well below its size, and reports tokens/s, the pager's hit rate, bytes
read per token and the process's peak RSS against the file size.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

NUM_EXPERTS = 26
TOP_K = 2
HIDDEN = 2048
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "2GB", "512M", "1.5GiB", "4096"."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GB, 512MiB, 65536)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    default_cache = os.environ.get("COLIBRI_CACHE", str(Path.home() / ".cache" / "colibri"))
    parser.add_argument(
        "--cache-dir",
        default=default_cache,
        help="where the synthetic weight file is kept (default: %(default)s)",
    )
    parser.add_argument(
        "--file-size",
        type=parse_size,
        default=parse_size("2GiB"),
        help="size of the synthetic weight file (default: 2GiB)",
    )
    parser.add_argument("--layers", type=int, default=4, help="MoE layers (default: 4)")
    parser.add_argument(
        "--hidden",
        type=int,
        default=HIDDEN,
        help="hidden size H; the expert size I follows from --file-size",
    )
    parser.add_argument(
        "--budget",
        type=parse_size,
        default=None,
        help="pager memory budget (default: 1/8 of the file size)",
    )
    parser.add_argument("--page-size-kb", type=int, default=64, help="pager page size (KiB)")
    parser.add_argument(
        "--policy",
        default="lru",
        choices=("fifo", "lru", "lfu", "lrfu", "nextuse"),
        help="pager cache policy (default: lru; 'hot' needs saved usage counts, so it is "
        "available from the Pager API, not here)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for dispatch/gather/combine (default: OpenMP's)",
    )
    parser.add_argument("--tokens", type=int, default=256, help="tokens to stream")
    parser.add_argument(
        "--batch-size", type=int, default=1, help="tokens per step (1: decode-like)"
    )
    parser.add_argument(
        "--partition",
        type=int,
        nargs="?",
        const=4,
        default=None,
        metavar="G",
        help="Static Expert Partitioning: route inside G groups of experts, "
        "grouped by usage measured on a warm-up stream (default G: 4)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and tokens")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def demo_shape(file_size: int, layers: int, hidden: int) -> int:
    """The expert intermediate size I that makes the float16 file about ``file_size``."""
    per_expert = file_size / (layers * NUM_EXPERTS)
    inter = int(per_expert // (3 * hidden * 2)) // 16 * 16
    if inter < 16:
        raise ValueError(
            f"--file-size {file_size} is too small for {layers} layers of "
            f"{NUM_EXPERTS} experts at hidden size {hidden}; raise it or lower "
            "--hidden / --layers"
        )
    return inter


def ensure_weight_file(
    cache_dir: str | os.PathLike,
    layers: int,
    hidden: int,
    inter: int,
    seed: int,
    progress: bool = True,
) -> Path:
    """The cached weight file for this shape, written (one expert at a time) if missing."""
    from colibri.formats.raw import manifest_path, write_experts

    folder = Path(cache_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"demo-L{layers}-E{NUM_EXPERTS}-H{hidden}-I{inter}-s{seed}-f16.colibri"
    if Path(manifest_path(path)).exists():  # the commit point of write_experts
        return path

    def experts() -> Iterator[tuple[tuple[int, int], tuple[np.ndarray, ...]]]:
        rng = np.random.default_rng(seed)
        bar = _progress(layers * NUM_EXPERTS, "writing weights", "expert", progress)
        for layer in range(layers):
            for e in range(NUM_EXPERTS):
                gate = rng.standard_normal((inter, hidden), np.float32) / hidden**0.5
                up = rng.standard_normal((inter, hidden), np.float32) / hidden**0.5
                down = rng.standard_normal((hidden, inter), np.float32) / inter**0.5
                yield (layer, e), tuple(m.astype(np.float16) for m in (gate, up, down))
                bar.update(1)
        bar.close()

    meta = {"generator": "colibri demo", "seed": seed, "num_experts": NUM_EXPERTS, "top_k": TOP_K}
    write_experts(path, experts(), metadata=meta, overwrite=True)
    return path


def _progress(total: int, desc: str, unit: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        raise ImportError(
            "the demo's progress bar needs tqdm: pip install colibri-moe[cli]"
        ) from None
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True)


def _router_weights(layers: int, hidden: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Gate weight [E, H] and bias [E] per layer; the bias makes some experts popular."""
    rng = np.random.default_rng(seed + 1)
    return [
        (
            rng.standard_normal((NUM_EXPERTS, hidden), np.float32) / hidden**0.5,
            rng.standard_normal(NUM_EXPERTS).astype(np.float32),
        )
        for _ in range(layers)
    ]


def _token_stream(tokens: int, hidden: int, seed: int, draw: int = 0) -> np.ndarray:
    """[tokens, H] float32 hidden states with topic drift: runs of 16 tokens on one of 8
    topics (fixed by ``seed``), plus noise; ``draw`` picks another stream of the same topics."""
    topics = np.random.default_rng(seed + 2).standard_normal((8, hidden), np.float32) * 2.0
    rng = np.random.default_rng([seed + 3, draw])
    which = np.repeat(rng.integers(0, len(topics), -(-tokens // 16)), 16)[:tokens]
    return topics[which] + rng.standard_normal((tokens, hidden), np.float32)


def _partitions(num_groups: int, gates: list, warmup: np.ndarray) -> list:
    """One partition per layer: experts that co-occur on a warm-up stream grouped together
    (``Partition.from_usage`` on that layer's routing statistics)."""
    import colibri

    partitions = []
    for weight, bias in gates:
        ctx = colibri.init(NUM_EXPERTS, TOP_K, collect_stats=True)
        ctx.route(warmup @ weight.T + bias)
        partitions.append(colibri.Partition.from_usage(ctx.stats, num_groups))
    return partitions


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit status."""
    import psutil

    import colibri

    for name, value in (
        ("--layers", args.layers),
        ("--tokens", args.tokens),
        ("--batch-size", args.batch_size),
        ("--hidden", args.hidden),
    ):
        if value < 1:
            raise SystemExit(f"colibri demo: {name} must be >= 1 (got {value})")
    progress = not args.no_progress
    inter = demo_shape(args.file_size, args.layers, args.hidden)
    path = ensure_weight_file(args.cache_dir, args.layers, args.hidden, inter, args.seed, progress)
    file_bytes = path.stat().st_size
    expert_bytes = 3 * inter * args.hidden * 2
    budget = args.budget if args.budget is not None else file_bytes // 8
    gates = _router_weights(args.layers, args.hidden, args.seed)
    stream = _token_stream(args.tokens, args.hidden, args.seed)

    partitions = [None] * args.layers
    if args.partition is not None:
        warmup = _token_stream(512, args.hidden, args.seed, draw=1)
        partitions = _partitions(args.partition, gates, warmup)

    process = psutil.Process()
    rss_before = process.memory_info().rss
    pager = colibri.Pager(
        path, budget_bytes=budget, page_size_kb=args.page_size_kb, policy=args.policy
    )
    with pager:
        layers = [
            colibri.MoELayer(
                weight,
                pager,
                TOP_K,
                layer=i,
                gate_bias=bias,
                activation="gelu_tanh",
                num_threads=args.threads,
                **({} if partition is None else {"partition": partition}),
            )
            for i, ((weight, bias), partition) in enumerate(zip(gates, partitions, strict=True))
        ]
        peak_rss = process.memory_info().rss
        bar = _progress(args.tokens, "tokens", "tok", progress)
        start = time.perf_counter()
        for lo in range(0, args.tokens, args.batch_size):
            h = stream[lo : lo + args.batch_size]
            for layer in layers:
                out = layer(h)
                h = h + out
                h = h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + 1e-6)  # RMS norm
            peak_rss = max(peak_rss, process.memory_info().rss)
            bar.update(len(h))
        elapsed = time.perf_counter() - start
        bar.close()
        stats = pager.stats

    print(
        f"model     : {args.layers} layers x {NUM_EXPERTS} experts (top-{TOP_K}), "
        f"H={args.hidden} I={inter} float16, {_mib(expert_bytes)} per expert"
    )
    print(f"file      : {path} ({_mib(file_bytes)})")
    print(
        f"budget    : {_mib(budget)} ({budget / file_bytes:.1%} of the file), "
        f"policy {args.policy}, {args.page_size_kb} KiB pages, pool {_mib(stats.pool_bytes)}"
        + (f", partition into {args.partition} groups" if args.partition else "")
    )
    print(
        f"tokens/s  : {args.tokens / elapsed:,.1f} ({args.tokens} tokens in {elapsed:.2f} s, "
        f"batch {args.batch_size})"
    )
    cached = (stats.hits - stats.prefetch_hits) / max(stats.hits + stats.misses, 1)
    print(
        f"hit rate  : {stats.hit_rate:.1%} ({stats.hits} hits, {stats.misses} misses; "
        f"{cached:.1%} already cached, the rest read ahead while earlier experts ran)"
    )
    print(f"read/token: {_mib(stats.bytes_read / args.tokens)}")
    print(
        f"peak RSS  : {_mib(peak_rss)} (before paging {_mib(rss_before)}; "
        f"growth {_mib(peak_rss - rss_before)} vs file {_mib(file_bytes)})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m colibri.demo``)."""
    parser = argparse.ArgumentParser(prog="colibri demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
