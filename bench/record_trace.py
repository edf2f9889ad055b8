"""Record a routing trace from a real checkpoint, for ``bench_pager.py``'s policy tables.

The checkpoint is the demo's generator (``colibri.demo.ensure_checkpoint``: random bf16
weights, a trained tokenizer) at a chosen shape, loaded through ``from_pretrained(...,
record_trace=True, read_ahead="off")``; two random prompts of 16 tokens, greedy decoding.

    python bench/record_trace.py --shape olmoe --out bench/traces/olmoe-shape-E64k8.json
"""

from __future__ import annotations

import argparse
import os

SHAPES = {
    # the demo checkpoint itself (bench/traces/demo-qwen3moe.json)
    "demo": dict(),
    # OLMoE's routing (64 experts, top-8, 16 layers) on small matrices: the trace depends on
    # the routing, and small experts keep the checkpoint to ~100 MiB
    "olmoe": dict(layers=16, hidden=256, expert_intermediate=128, num_experts=64, top_k=8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/colibri"))
    ap.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from colibri.cli.demo import DemoShape, ensure_checkpoint
    from colibri.integrations.transformers import from_pretrained

    shape = DemoShape(**SHAPES[args.shape])
    folder = ensure_checkpoint(args.cache_dir, shape)
    model = from_pretrained(
        str(folder), budget=shape.expert_bytes // 4, read_ahead="off", record_trace=True
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(2):
            ids = torch.randint(10, model.config.vocab_size, (1, 16), generator=gen)
            model.generate(ids, do_sample=False, max_new_tokens=args.tokens, pad_token_id=0)
    trace = model.colibri.pager.trace
    trace.save(args.out)
    print(f"{args.out}: {len(trace)} steps, {trace.accesses} expert accesses, from {folder}")


if __name__ == "__main__":
    main()
