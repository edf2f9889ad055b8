"""Decode attention: colibri's kernel on every SIMD path against torch, one query row.

One bfloat16 query of ``--heads`` heads over ``--kv-heads`` key/value heads of ``--dim``
(the demo's Qwen3-MoE shape by default), over caches of ``--keys`` rows: colibri's
``colibri.layer._attention.attention`` (every path this CPU runs), torch's
``scaled_dot_product_attention`` (what transformers' ``"sdpa"`` runs) and the formula in
float32 eager (``q @ k^T``, softmax, ``@ v``). Best of ``--repeat`` x 50 calls, us a call,
and each torch figure over colibri's dispatched one.

    python bench/bench_attention.py                  # one thread
    python bench/bench_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import torch
import torch.nn.functional as F

from colibri.layer import _attention, _ffn, _norm


def _best(fn, repeat: int, calls: int = 50) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _eager(q, k, v, scale: float):
    """The formula in float32 eager: softmax(scale q k^T) v."""
    return ((q @ k.transpose(-1, -2)) * scale).softmax(-1) @ v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--keys", default="32,128,320,512,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d = args.heads, args.kv_heads, args.dim
    paths = _ffn.runnable_paths()
    print(f"# {hq} query heads over {hkv} key/value heads of {d}, bfloat16, one query row, "
          f"{args.threads} thread(s); us a call, best of {args.repeat} x 50")  # fmt: skip
    print("| keys | sdpa | eager float32 | " + " | ".join(f"colibri {p}" for p in paths)
          + " | sdpa / colibri | eager / colibri |")  # fmt: skip
    print("| ---: " * (len(paths) + 5) + "|")
    for keys in (int(k) for k in args.keys.split(",")):
        g = torch.Generator().manual_seed(keys)
        q = torch.randn(1, hq, 1, d, generator=g).to(torch.bfloat16)
        k = torch.randn(1, hkv, keys, d, generator=g).to(torch.bfloat16)
        v = torch.randn(1, hkv, keys, d, generator=g).to(torch.bfloat16)
        scale = d**-0.5
        kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)

        sdpa = functools.partial(F.scaled_dot_product_attention, q, kr, vr, scale=scale)
        eager = functools.partial(_eager, *(t.float() for t in (q, kr, vr)), scale)
        bits = [t[0].view(torch.uint16).numpy() for t in (q, k, v)]
        out = np.empty((1, hq, d), np.uint16)
        ours = [_best(functools.partial(_attention.attention, *bits, scale, out,
                                        _norm.KIND_BFLOAT16, None, path, args.threads),
                      args.repeat) for path in paths]  # fmt: skip
        with torch.inference_mode():
            theirs = _best(sdpa, args.repeat), _best(eager, args.repeat)
        mine = ours[paths.index(_ffn.PATHS[_ffn.path_index(None)])]
        print(f"| {keys:,} | {theirs[0]:.1f} | {theirs[1]:.1f} | "
              + " | ".join(f"{t:.1f}" for t in ours)
              + f" | {theirs[0] / mine:.1f}x | {theirs[1] / mine:.1f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
