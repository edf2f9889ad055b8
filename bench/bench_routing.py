"""Routing speed: colibri against torch, numpy and the memory-read floor, in one run.

    python bench/bench_routing.py            # the full grid (about three minutes on 2 cores)
    python bench/bench_routing.py --quick    # a few shapes

Every figure is the best of several timed rounds (microseconds per call); ratios are
torch / colibri ("x torch") and colibri / floor ("x floor"). The floor is the fastest of one
read pass over the logits (torch.sum with the same threads, numpy.sum).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import colibri


def best_us(fn, min_time=0.3, rounds=7):
    fn()
    n, elapsed = 1, 0.0
    while True:  # calls per round so that a round lasts about min_time / rounds
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed > min_time / rounds or n >= 1 << 20:
            break
        n *= 4
    best = elapsed / n
    for _ in range(rounds - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def torch_topk(x, k):
    """What a user writes today (transformers' Mixtral/Qwen routers): softmax, topk, renorm."""
    p = torch.softmax(x, dim=-1, dtype=torch.float32)
    w, i = torch.topk(p, k, dim=-1)
    return i, w / w.sum(dim=-1, keepdim=True)


def numpy_topk(x, k):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    part = np.argpartition(-p, k - 1, axis=-1)[..., :k]
    w = np.take_along_axis(p, part, axis=-1)
    order = np.argsort(-w, axis=-1, kind="stable")
    i, w = np.take_along_axis(part, order, -1), np.take_along_axis(w, order, -1)
    return i, w / w.sum(axis=-1, keepdims=True)


def torch_deepseek_v3(x, bias, k=8, groups=8, topk_groups=4, scale=2.5):
    """DeepSeek-V3's gate as its reference code computes it (sigmoid, bias for selection,
    top-2-sum group scores, -inf masking, gather of unbiased scores, renorm, scale)."""
    scores = x.sigmoid()
    choice = scores + bias
    T, E = x.shape
    g = choice.view(T, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    keep = g.topk(topk_groups, dim=-1, sorted=False)[1]
    mask = torch.ones(T, groups, dtype=torch.bool).scatter_(1, keep, False)
    choice = choice.view(T, groups, -1).masked_fill(mask.unsqueeze(-1), float("-inf")).view(T, E)
    ids = choice.topk(k, dim=-1)[1]
    w = scores.gather(1, ids)
    return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale


def floor_us(x, xt):
    return min(best_us(lambda: xt.sum()), best_us(lambda: x.sum()))


def row(cells):
    return "| " + " | ".join(cells) + " |"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--threads", type=int, default=colibri.max_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(
        f"colibri {colibri.__version__}, torch {torch.__version__}, numpy {np.__version__}, "
        f"{args.threads} threads\n"
    )

    Ts = [1, 64, 4096, 65536] if not args.quick else [1, 4096, 65536]
    Es = [8, 26, 64, 128, 256] if not args.quick else [26, 64, 256]
    print(
        "softmax -> top-k -> renormalise, float32 logits [T, E], numpy in / numpy out "
        "(torch in / torch out for the torch column)\n"
    )
    print(
        row(["T", "E", "k", "colibri µs", "torch µs", "numpy µs", "floor µs", "x torch", "x floor"])
    )
    print(row(["---"] * 9))
    for T in Ts:
        for E in Es:
            for k in (2, 8):
                if k > E:
                    continue
                x = rng.standard_normal((T, E)).astype(np.float32)
                xt = torch.from_numpy(x)
                ctx = colibri.init(E, k, routing_threads=args.threads)
                c = best_us(lambda ctx=ctx, x=x: ctx.route(x))
                t = best_us(lambda xt=xt, k=k: torch_topk(xt, k))
                n = best_us(lambda x=x, k=k: numpy_topk(x, k))
                f = floor_us(x, xt)
                print(
                    row(
                        [
                            str(T),
                            str(E),
                            str(k),
                            f"{c:.2f}",
                            f"{t:.2f}",
                            f"{n:.2f}",
                            f"{f:.2f}",
                            f"{t / c:.1f}",
                            f"{c / f:.2f}",
                        ]
                    )
                )

    print(
        "\nDeepSeek-V3 routing: E=256, 8 groups, 4 kept (top-2 sum), k=8, sigmoid + bias, "
        "scale 2.5\n"
    )
    print(row(["T", "colibri µs", "torch µs", "x torch"]))
    print(row(["---"] * 4))
    bias = (rng.standard_normal(256) * 0.1).astype(np.float32)
    ctx = colibri.init(
        256,
        8,
        scoring="sigmoid",
        correction_bias=bias,
        num_groups=8,
        topk_groups=4,
        group_score="top2_sum",
        scale=2.5,
        routing_threads=args.threads,
    )
    tb = torch.from_numpy(bias)
    for T in Ts:
        x = rng.standard_normal((T, 256)).astype(np.float32)
        xt = torch.from_numpy(x)
        c = best_us(lambda ctx=ctx, x=x: ctx.route(x))
        t = best_us(lambda xt=xt: torch_deepseek_v3(xt, tb))
        print(row([str(T), f"{c:.1f}", f"{t:.1f}", f"{t / c:.1f}"]))
    # What bounds this case: the bias makes every expert's sigmoid a candidate, so exact
    # routing takes 256 sigmoids per token; torch's own vectorised sigmoid alone, for scale.
    scores = torch.empty_like(xt)
    s = best_us(lambda: torch.sigmoid(xt, out=scores))
    print(
        f"\nT={Ts[-1]}: torch.sigmoid of the logits alone takes {s:.0f} µs "
        f"({torch.backends.cpu.get_cpu_capability()}); 40x torch's routing would leave "
        f"{t / 40:.0f} µs for all of it"
    )

    print("\nSingle token, E=26, k=2 (the latency path)\n")
    print(row(["input -> output", "colibri µs", "torch µs", "x torch"]))
    print(row(["---"] * 4))
    one = rng.standard_normal(26).astype(np.float32)
    ctx = colibri.init(26, 2)
    ids, w = np.empty(2, np.int32), np.empty(2, np.float32)
    tone = torch.from_numpy(one)
    t = best_us(lambda: torch_topk(tone, 2))
    tids, tw = torch.empty(2, dtype=torch.int32), torch.empty(2)
    for name, fn in (
        ("numpy -> numpy, out=", lambda: ctx.route(one, out=(ids, w))),
        ("numpy -> numpy", lambda: ctx.route(one)),
        ("torch -> torch", lambda: ctx.route(tone)),
        ("torch -> torch, out=", lambda: ctx.route(tone, out=(tids, tw))),
    ):
        c = best_us(fn)
        print(row([name, f"{c:.2f}", f"{t:.2f}", f"{t / c:.1f}"]))


if __name__ == "__main__":
    main()
