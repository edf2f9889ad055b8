"""End-to-end MoE layer benchmark: colibri (paged and resident) against transformers.

Measures tokens/s and peak RSS of a stack of MoE layers (26 experts, top-2, SwiGLU,
float32) at several batch sizes, for:

- ``colibri paged``     MoELayer with expert weights paged from a raw file by ``Pager``
                        under a budget (about one layer's experts plus two);
- ``colibri resident``  MoELayer with every expert in memory (``InMemoryExperts``), numpy;
- ``transformers``      transformers' eager ``MixtralSparseMoeBlock`` (torch, CPU) with the
                        same weights.

Each (implementation, batch size) runs in its own subprocess so peak RSS is its own;
tokens/s come from the median step time. Ratios are against ``transformers`` measured in
the same run.

    python bench/bench_layer.py                      # H=1024, I=512, 4 layers
    python bench/bench_layer.py --hidden 2048 --inter 1408 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from colibri._units import process_memory

IMPLS = ("colibri-paged", "colibri-resident", "transformers")


def router_weight(args, layer: int) -> np.ndarray:
    """Router [E, H] float32 for one layer (seeded)."""
    rng = np.random.default_rng(500 + layer)
    return rng.standard_normal((args.experts, args.hidden), np.float32) / args.hidden**0.5


def weights(args, layer: int):
    """Router [E, H], gate/up [E, I, H], down [E, H, I] float32 for one layer (seeded)."""
    rng = np.random.default_rng(1000 + layer)
    E, H, I = args.experts, args.hidden, args.inter
    return (
        router_weight(args, layer),
        rng.standard_normal((E, I, H), np.float32) / H**0.5,
        rng.standard_normal((E, I, H), np.float32) / H**0.5,
        rng.standard_normal((E, H, I), np.float32) / I**0.5,
    )


def write_file(args, path: str) -> None:
    """The experts of every layer into a colibri raw file, one layer in memory at a time."""
    from colibri.formats.raw import write_experts

    def experts():
        for layer in range(args.layers):
            _, gate, up, down = weights(args, layer)
            for e in range(args.experts):
                yield (layer, e), (gate[e], up[e], down[e])

    write_experts(path, experts(), overwrite=True)


def router(args):
    import colibri

    return colibri.init(args.experts, args.top_k)


def build(args, impl: str, path: str):
    """A callable ``step(h [B, H]) -> h`` running all layers, plus a closer."""
    if impl == "transformers":
        import torch
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        torch.set_num_threads(args.threads)
        cfg = MixtralConfig(
            hidden_size=args.hidden,
            intermediate_size=args.inter,
            num_local_experts=args.experts,
            num_experts_per_tok=args.top_k,
        )
        blocks = []
        for layer in range(args.layers):
            r, gate, up, down = weights(args, layer)
            block = MixtralSparseMoeBlock(cfg).eval()
            with torch.no_grad():
                block.gate.weight.copy_(torch.from_numpy(r))
                block.experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([gate, up], 1)))
                block.experts.down_proj.copy_(torch.from_numpy(down))
            blocks.append(block)
            del r, gate, up, down

        def step(h):
            with torch.inference_mode():
                x = torch.from_numpy(h)[None]
                for block in blocks:
                    x = x + block(x)
                return x[0].numpy()

        return step, lambda: None

    import colibri

    route = router(args)
    if impl == "colibri-paged":
        store = colibri.Pager(path, budget_bytes=args.budget, policy="lru")
        close = store.close
    else:
        L, E, H, I = args.layers, args.experts, args.hidden, args.inter
        gate, up = np.empty((L, E, I, H), np.float32), np.empty((L, E, I, H), np.float32)
        down = np.empty((L, E, H, I), np.float32)
        for layer in range(L):
            _, gate[layer], up[layer], down[layer] = weights(args, layer)
        store = colibri.InMemoryExperts(gate, up, down)
        close = lambda: None  # noqa: E731
    layers = [
        colibri.MoELayer(
            router_weight(args, layer),
            store,
            args.top_k,
            layer=layer,
            router=route,
            num_threads=args.threads,
        )
        for layer in range(args.layers)
    ]

    def step(h):
        for layer in layers:
            h = h + layer(h)
        return h

    return step, close


def worker(args) -> None:
    """Measure one (implementation, batch size); print a JSON line."""
    step, close = build(args, args.worker, args.file)
    rng = np.random.default_rng(7)
    B = args.batch
    tokens = rng.standard_normal((args.warmup + args.steps, B, args.hidden), np.float32)
    for i in range(args.warmup):
        step(tokens[i])
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        start = time.perf_counter()
        step(tokens[i])
        times.append(time.perf_counter() - start)
    # median step: robust to other processes stealing the CPU for a moment
    elapsed = float(np.median(times)) * args.steps
    close()
    print(json.dumps({"tokens_per_s": B * args.steps / elapsed, "peak_rss": peak_rss()}))


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM on Linux (ru_maxrss would include the parent's
    peak: it survives fork and exec)."""
    return process_memory().peak


def bench_dispatch(args) -> None:
    """dispatch + gather + combine against the same steps in numpy (stable argsort, fancy
    indexing, weighted sum over k), on a prefill-sized batch."""
    import colibri

    T, k, E, H = args.dispatch_tokens, 8, 256, 1024
    rng = np.random.default_rng(3)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
    w = rng.random((T, k)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)

    def best(f, n=5):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    def numpy_path():
        order = np.argsort(ids.ravel(), kind="stable")
        rows = x[order // k]
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return np.einsum("tk,tkh->th", w, rows[inverse].reshape(T, k, H))

    def colibri_path():
        plan = colibri.dispatch(ids, E, num_threads=args.threads)
        rows = colibri.gather(x, plan, num_threads=args.threads)
        return colibri.combine(rows, plan, w, num_threads=args.threads)

    np.testing.assert_allclose(colibri_path(), numpy_path(), rtol=1e-5, atol=1e-5)
    plan_ms = best(lambda: colibri.dispatch(ids, E, num_threads=args.threads))
    sort_ms = best(lambda: np.argsort(ids.ravel(), kind="stable"))
    c, n = best(colibri_path), best(numpy_path)
    print(
        f"# dispatch T={T} k={k} E={E}: plan {plan_ms:.2f} ms (numpy stable argsort "
        f"{sort_ms:.2f} ms); plan+gather+combine H={H} {c:.1f} ms vs numpy {n:.1f} ms "
        f"({n / c:.1f}x)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=26)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 64])
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: by batch)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="pager budget in bytes (default: experts + 2 of one layer)",
    )
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument(
        "--dispatch-tokens",
        type=int,
        default=16384,
        help="tokens for the dispatch/combine comparison (0: skip it)",
    )
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    args = p.parse_args()
    expert_bytes = 3 * args.hidden * args.inter * 4
    if args.budget is None:
        args.budget = (args.experts + 2) * (-(-expert_bytes // 65536) * 65536)
    if args.worker:
        worker(args)
        return 0

    if args.dispatch_tokens:
        bench_dispatch(args)
    file_bytes = args.layers * args.experts * expert_bytes
    print(
        f"# {args.layers} layers x {args.experts} experts, top-{args.top_k}, H={args.hidden} "
        f"I={args.inter}, float32 SwiGLU; weights {file_bytes / 2**20:.0f} MiB, "
        f"budget {args.budget / 2**20:.0f} MiB; {args.threads} threads"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.colibri")
        if "colibri-paged" in args.impls:
            write_file(args, path)
        rows = []
        for B in args.batch_sizes:
            steps = args.steps or max(5, 200 // B)
            result = {}
            for impl in args.impls:
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    impl,
                    "--batch",
                    str(B),
                    "--file",
                    path,
                    "--steps",
                    str(steps),
                    "--warmup",
                    str(args.warmup),
                    "--hidden",
                    str(args.hidden),
                    "--inter",
                    str(args.inter),
                    "--experts",
                    str(args.experts),
                    "--top-k",
                    str(args.top_k),
                    "--layers",
                    str(args.layers),
                    "--threads",
                    str(args.threads),
                    "--budget",
                    str(args.budget),
                ]
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if done.returncode != 0:
                    print(done.stderr, file=sys.stderr)
                    raise SystemExit(f"worker {impl} batch {B} failed")
                result[impl] = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append((B, result))
    base = "transformers" if "transformers" in args.impls else None
    print("| batch | implementation | tokens/s | vs transformers | peak RSS (MiB) |")
    print("|---:|---|---:|---:|---:|")
    for B, result in rows:
        for impl, r in result.items():
            ratio = f"{r['tokens_per_s'] / result[base]['tokens_per_s']:.2f}x" if base else "-"
            print(
                f"| {B} | {impl} | {r['tokens_per_s']:,.1f} | {ratio} | "
                f"{r['peak_rss'] / 2**20:,.0f} |"
            )
    if "colibri-paged" in args.impls:
        worst = max(r["colibri-paged"]["peak_rss"] for _, r in rows)
        print(
            f"# colibri-paged peak RSS {worst / 2**20:.0f} MiB vs budget + 64 MiB = "
            f"{(args.budget + (64 << 20)) / 2**20:.0f} MiB: "
            f"{'OK' if worst <= args.budget + (64 << 20) else 'OVER'}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
