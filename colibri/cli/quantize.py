"""``colibri quantize SRC DST --type q4_k``: a checkpoint's routed experts block-quantized.

SRC is a transformers checkpoint directory with float32, float16 or bfloat16 experts; DST the
same checkpoint with its routed experts as GGUF blocks of ``--type``, written atomically and
checked (:func:`colibri.integrations.transformers.quantize_checkpoint`).
``colibri generate DST`` and ``from_pretrained(DST, budget=...)`` then load it.
"""

from __future__ import annotations

import argparse

__all__ = ["TYPES", "add_arguments", "run"]

#: The ``--type`` choices: the block types colibri computes.
TYPES = ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``SRC DST --type TYPE [--force] [--threads N]``."""
    parser.add_argument("src", metavar="SRC", help="checkpoint directory (bf16/f16/f32 experts)")
    parser.add_argument("dst", metavar="DST", help="directory to write (must not exist)")
    parser.add_argument("--type", required=True, choices=TYPES, dest="qtype",
                        help="block type of the routed experts")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace an existing DST")
    parser.add_argument("--threads", type=int, default=0, help="threads (default: all)")


def run(args: argparse.Namespace) -> int:
    from colibri.integrations.transformers import quantize_checkpoint

    if args.threads < 0:
        raise ValueError(f"quantize: --threads must be >= 0 (0: all; got {args.threads})")
    done = quantize_checkpoint(args.src, args.dst, args.qtype, force=args.force,
                               num_threads=args.threads, progress=True)  # fmt: skip
    print(f"{args.dst}: {done['experts']} expert tensors as {args.qtype} "
          f"({done['source_bytes']} -> {done['expert_bytes']} bytes), checked: largest "
          f"relative RMS error {done['max_error']:.4f} (bound {done['bound']})")  # fmt: skip
    return 0
