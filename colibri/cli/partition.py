"""``colibri partition``: learn groups from saved statistics, report their cost, save.

::

    colibri partition stats.npz --groups 4 --out groups.json
    colibri partition layer*.npz --groups 8 --top-k 8 --topk-groups 2 \\
        --logits heldout.npy --out groups.json
    colibri partition --workload clustered --experts 26 --top-k 2 --groups 4
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

__all__ = ["add_arguments", "run"]


def _tolerance(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none' (got {text!r})") from None
    if not np.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {text!r})")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``partition`` subcommand's arguments to ``parser``."""
    parser.description = (
        "Learn expert groups from saved usage statistics (Partition.from_usage), print how "
        "much of exact top-k routing they keep, and save them as JSON."
    )
    parser.add_argument(
        "stats",
        nargs="*",
        help="UsageStats files (.npz/.json); several are merged (runs, layers)",
    )
    parser.add_argument("--groups", type=int, required=True, help="number of groups")
    parser.add_argument(
        "--load-tolerance",
        type=_tolerance,
        default=1.0,
        metavar="X",
        help="allowed load above a group's fair share, as a fraction, or 'none' (default 1.0)",
    )
    parser.add_argument("--out", help="write the partition here (JSON)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--logits", help="evaluate on these router logits: a [T, E] .npy file")
    source.add_argument(
        "--workload",
        choices=["clustered", "iid"],
        help="instead of statistics files: learn on routed tokens of colibri.workload's "
        "generator and evaluate on a held-out draw (a try-out; needs --experts and --top-k)",
    )
    parser.add_argument("--experts", type=int, help="experts E for --workload")
    parser.add_argument("--tokens", type=int, default=20_000, help="tokens per --workload draw")
    parser.add_argument("--seed", type=int, default=0, help="latent structure of --workload")
    parser.add_argument("--top-k", type=int, help="experts per token (needed to evaluate)")
    parser.add_argument("--topk-groups", type=int, default=1, help="groups per token (default 1)")
    parser.add_argument(
        "--scoring", default="softmax", choices=["softmax", "sigmoid", "sqrtsoftplus"]
    )


def _load_logits(path: str, num_experts: int) -> np.ndarray:
    try:
        logits = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read logits as .npy ({error})") from None
    if logits.ndim != 2 or logits.shape[1] != num_experts:
        raise ValueError(
            f"{path}: logits must be [T, E] with E = {num_experts} (got shape {logits.shape})"
        )
    if logits.dtype.kind != "f":
        raise ValueError(f"{path}: logits must be floating point (got {logits.dtype})")
    return np.ascontiguousarray(logits)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit status (0 on success, 1 on bad input)."""
    import colibri
    from colibri.partition import Partition, evaluate
    from colibri.routing import UsageStats
    from colibri.workload import Workload

    try:
        if args.out and not args.overwrite and os.path.lexists(args.out):
            raise FileExistsError(f"{args.out} already exists; pass --overwrite to replace it")
        if args.workload is not None:
            if args.stats:
                raise ValueError(
                    "--workload learns from its own routed tokens; drop the statistics files "
                    "or evaluate on saved --logits instead"
                )
            if args.experts is None or args.top_k is None:
                raise ValueError("--workload needs --experts and --top-k")
            workload = Workload(args.experts, args.workload, seed=args.seed)
            ctx = colibri.init(args.experts, args.top_k, collect_stats=True, scoring=args.scoring)
            ctx.route(workload.logits(args.tokens, seed=1))
            stats, sources = ctx.stats, f"{args.workload} workload (seed {args.seed})"
        elif args.stats:
            stats = UsageStats.sum(UsageStats.load(path) for path in args.stats)
            sources = f"{len(args.stats)} statistics file(s)"
        else:
            raise ValueError("give statistics files, or --workload to try the tool")
        e = stats.num_experts
        evaluating = args.logits is not None or args.workload is not None
        if evaluating and args.top_k is None:
            raise ValueError("--top-k is needed to evaluate on --logits")
        learned = Partition.from_usage(stats, args.groups, load_tolerance=args.load_tolerance)
        contiguous = Partition.contiguous(e, args.groups)
        pair_mass = max(int(stats.coactivation.sum() - stats.counts.sum()) // 2, 1)
        load = stats.counts.sum() or 1
        print(f"{stats.tokens} tokens, {e} experts, from {sources}")
        for name, partition in (("learned", learned), ("contiguous", contiguous)):
            shares = " ".join(f"{stats.counts[list(g)].sum() / load:.3f}" for g in partition.groups)
            print(
                f"{name:>10}: co-activation kept inside groups "
                f"{partition.inside_mass(stats) / pair_mass:.4f}; load per group {shares}"
            )
        for index, group in enumerate(learned.groups):
            print(f"  group {index}: {list(group)}")
        if evaluating:
            if args.logits is not None:
                logits = _load_logits(args.logits, e)
            else:  # held out: another draw of the same latent structure
                logits = workload.logits(args.tokens, seed=2)
            for name, partition in (("learned", learned), ("contiguous", contiguous)):
                report = evaluate(
                    partition,
                    logits,
                    args.top_k,
                    topk_groups=args.topk_groups,
                    scoring=args.scoring,
                )
                print(f"\n[{name}] {report}")
        if args.out:
            learned.save(args.out, overwrite=args.overwrite)
            print(f"\nwrote {args.out}")
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as error:
        print(f"colibri partition: error: {error}", file=sys.stderr)
        return 1
    return 0
