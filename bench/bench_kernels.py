"""Expert FFN kernels: colibri's fused kernel against torch, block conversion + BLAS and the
memory floor, measured in one run.

    python bench/bench_kernels.py                  # demo, Qwen3-30B-A3B and Mixtral shapes
    python bench/bench_kernels.py --quick          # the demo and Qwen3 shapes, fewer rows
    python bench/bench_kernels.py --busy           # stall table beside a process on every core
    python bench/bench_kernels.py --stalls-only --busy
    python bench/bench_kernels.py --avx2-machine   # each shape also as an AVX2-only CPU runs it

One expert is y = down @ (silu(gate @ x) * (up @ x)), gate/up [I, H], down [H, I]. Each
figure is milliseconds per expert, the best of several rounds over a pool of experts larger
than the last-level cache (so weights come from memory, as when decoding a large model):

    floor      one read pass over the expert's bytes (colibri.layer._ffn.read_pass)
    colibri    colibri.expert_ffn's kernel on the dispatched SIMD path (colibri.simd_path())
    avx2 ...   the same kernel forced onto a lower path (what an AVX2-only CPU runs)
    torch      three torch.nn.functional.linear calls in the weights' dtype, torch threads
    blas       the block-convert + BLAS path (float32 blocks of the weights, numpy matmul)

Ratios: "x floor" = colibri / floor, "x torch" = torch / colibri.

--avx2-machine emulates an AVX2-only CPU for both sides: after each shape's native rows, a
child process runs it again with COLIBRI_SIMD=avx2 (colibri's kernel on its AVX2 path),
ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN without AVX-512 and AMX: torch then has no oneDNN bf16/fp16
matmul and runs its own kernels) and ATEN_CPU_CAPABILITY=avx2 (torch's own kernels on AVX2).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

import colibri
from colibri._dlpack import float32_to_bf16
from colibri.layer import _expert, _ffn, combine, dispatch, gather

AVX2_MACHINE = {"COLIBRI_SIMD": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
SHAPES = {"demo": (2048, 1680), "qwen3-30b-a3b": (2048, 768), "mixtral": (4096, 14336)}
POOL_BYTES = 640 << 20  # about twice a large server's last-level cache
DISPATCH_CASE = "dispatch T=16384 k=2 H=64"


def best_ms(fn, rounds):
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def make_pool(H, I, dtype_name, pool_bytes, rng):
    """Experts as (gate, up, down) uint16 bits, and each expert's bytes as one uint64 array
    for the floor; distinct memory for every expert."""
    nbytes = 3 * H * I * 2
    count = max(1, min(64, pool_bytes // nbytes))
    base = rng.standard_normal(1 << 20).astype(np.float32) * 0.02
    if dtype_name == "float16":
        base = base.astype(np.float16).view(np.uint16)
    else:
        base = float32_to_bf16(base)
    experts = []
    for e in range(count):
        flat = np.resize(np.roll(base, 977 * e), 3 * H * I)  # a copy: memory of its own
        g, u, d = flat[: I * H], flat[I * H : 2 * I * H], flat[2 * I * H :]
        experts.append((g.reshape(I, H), u.reshape(I, H), d.reshape(H, I), flat.view(np.uint64)))
    return experts


def run_avx2_machine(name, dtype_name, args):
    """The shape's rows again in a child process that sees an AVX2-only CPU (AVX2_MACHINE)."""
    command = [
        sys.executable, __file__, "--no-stalls", "--label", "avx2-machine", "--shapes", name,
        "--dtypes", dtype_name, "--batches", *map(str, args.batches), "--threads",
        str(args.threads), "--rounds", str(args.rounds), "--pool-mb", str(args.pool_mb),
        "--paths",
    ]  # fmt: skip
    if args.no_torch:
        command.append("--no-torch")
    done = subprocess.run(
        command, env=dict(os.environ, **AVX2_MACHINE), capture_output=True, text=True, check=True
    )
    print(done.stdout, end="", flush=True)


def run_shape(name, H, I, dtype_name, batches, args, rng, torch):
    experts = make_pool(H, I, dtype_name, args.pool_mb << 20, rng)
    count, nbytes = len(experts), 3 * H * I * 2
    kind = _ffn.WEIGHT_KINDS[dtype_name]
    rounds = args.rounds if nbytes < 100 << 20 else max(2, args.rounds // 2)
    floor = best_ms(lambda: [_ffn.read_pass(e[3], args.threads) for e in experts], rounds)
    floor /= count
    rows = []
    for n in batches:
        x = rng.standard_normal((n, H)).astype(np.float32)
        y = np.empty((n, H), np.float32)
        cells = {}
        for label, path in [("colibri", None)] + [(p, p) for p in args.paths]:
            if n > _ffn.MAX_ROWS:
                cells[label] = float("nan")
                continue
            cells[label] = (
                best_ms(
                    lambda path=path, x=x, y=y: [
                        _ffn.ffn(x, g, u, d, kind, 0, y, args.threads, path)
                        for g, u, d, _ in experts
                    ],
                    rounds,
                )
                / count
            )
        act = _expert.activation_function("silu")
        ex = [colibri.ExpertWeights(g, u, d, dtype_name) for g, u, d, _ in experts]

        def blas(x=x, ex=ex, act=act):
            for e in ex:
                h = act(_expert.linear(x, e.gate, dtype_name))
                h *= _expert.linear(x, e.up, dtype_name)
                _expert.linear(h, e.down, dtype_name)

        cells["blas"] = best_ms(blas, rounds) / count
        if torch is not None:
            tdt = torch.bfloat16 if dtype_name == "bfloat16" else torch.float16
            tw = [
                tuple(torch.from_numpy(w.view(np.int16)).view(tdt) for w in e[:3]) for e in experts
            ]
            tx = torch.from_numpy(x).to(tdt)
            F = torch.nn.functional

            def torch_ffn(tw=tw, tx=tx, F=F):
                with torch.no_grad():
                    for g, u, d in tw:
                        F.linear(F.silu(F.linear(tx, g)) * F.linear(tx, u), d)

            cells["torch"] = best_ms(torch_ffn, max(1, rounds // 2)) / count
        rows.append((n, cells))
    for n, cells in rows:
        c = cells["colibri"]
        best_other = min(v for k, v in cells.items() if k in ("blas", "torch"))
        line = (
            f"{args.label}{name:<14} {dtype_name:<9} {n:>3}  floor {floor:8.3f}  "
            + "  ".join(f"{k} {v:8.3f}" for k, v in cells.items())
            + f"  | x floor {c / floor:5.2f}"
        )
        if "torch" in cells:
            line += f"  x torch {cells['torch'] / c:5.2f}"
        line += f"  x best-other {best_other / c:5.2f}"
        print(line, flush=True)
    print(
        f"{args.label}{'':<14} ({count} experts of {nbytes / 2**20:.1f} MiB; floor "
        f"{nbytes / floor / 1e6:.1f} GB/s, colibri at batch 1 "
        f"{nbytes / rows[0][1]['colibri'] / 1e6:.1f} GB/s)",
        flush=True,
    )


def median_us(fn, hook, rounds=31):
    """Median of rounds calls of fn (microseconds), each right after hook() (untimed): a
    stall shows in the median, where a best-of would hide it."""
    fn()
    times = []
    for _ in range(rounds):
        hook()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def stall_table(args, rng, torch, modes):
    """Routing and one expert at batch 1, per mode: quiet, beside busy processes, right
    after torch's thread pool ran; "x serial" = time / the quiet single-thread time."""
    bias = rng.standard_normal(256).astype(np.float32)
    ds = dict(
        scoring="sigmoid",
        correction_bias=bias,
        num_groups=8,
        topk_groups=4,
        group_score="top2_sum",
        scale=2.5,
    )
    cases = []
    for T in (64, 4096, 65536):
        x = rng.standard_normal((T, 64)).astype(np.float32)
        cases.append((f"route E=64 k=2 T={T}", 64, 2, {}, x))
    for T in (64, 4096):
        x = rng.standard_normal((T, 256)).astype(np.float32)
        cases.append((f"route DeepSeek-V3 T={T}", 256, 8, ds, x))
    H, I = SHAPES["qwen3-30b-a3b"]
    experts = make_pool(H, I, "bfloat16", 64 << 20, rng)
    xf = rng.standard_normal((1, H)).astype(np.float32)
    yf = np.empty((1, H), np.float32)
    kind = _ffn.WEIGHT_KINDS["bfloat16"]

    def ffn_call(threads):
        def run():
            for g, u, d, _ in experts:
                _ffn.ffn(xf, g, u, d, kind, 0, yf, threads, None)

        return run

    # colibri.dispatch's plan, gather and combine: enough slots and bytes for several chunks
    ids = rng.integers(0, 64, (16384, 2)).astype(np.int32)
    hidden = rng.standard_normal((16384, 64)).astype(np.float32)
    w = rng.random((16384, 2)).astype(np.float32)

    def dispatch_call(threads):
        def run():
            plan = dispatch(ids, 64, num_threads=threads)
            combine(gather(hidden, plan, num_threads=threads), plan, w, num_threads=threads)

        return run

    a = torch.randn(384, 384) if torch is not None else None
    hooks = {
        "quiet": lambda: None,
        "busy": lambda: None,
        "after torch": (lambda: torch.mm(a, a)) if torch is not None else None,
    }
    serial, results = {}, {}
    for mode in modes:
        if hooks.get(mode) is None:
            continue
        spinners, stop = _start_spinners() if mode == "busy" else ([], None)
        try:
            for name, E, k, opts, x in cases:
                for threads in (1, args.threads):
                    ctx = colibri.init(E, k, routing_threads=threads, **opts)
                    out = ctx.buffers(len(x))
                    t = median_us(lambda ctx=ctx, x=x, out=out: ctx.route(x, out=out), hooks[mode])
                    results[mode, name, threads] = t
            for threads in (1, args.threads):
                t = median_us(ffn_call(threads), hooks[mode], rounds=10) / len(experts)
                results[mode, "expert Qwen3 bf16 batch 1", threads] = t
                t = median_us(dispatch_call(threads), hooks[mode])
                results[mode, DISPATCH_CASE, threads] = t
        finally:
            _stop_spinners(spinners, stop)
    names = [c[0] for c in cases] + ["expert Qwen3 bf16 batch 1", DISPATCH_CASE]
    probe = colibri.init(64, 2)
    route_path = "avx512" if probe.use_avx512 else "avx2" if probe.use_avx2 else "sse2"
    for name in names:
        serial[name] = results["quiet", name, 1]
    print(
        f"\nstalls: us per call (median of rounds), threads={args.threads} unless marked; "
        f"'x serial' = / quiet 1-thread; routing path "
        f"{route_path}"
    )
    header = f"{'':<30}{'quiet 1t':>10}" + "".join(
        f"{m:>14}{'x serial':>9}" for m in modes if hooks.get(m) is not None
    )
    print(header)
    for name in names:
        line = f"{name:<30}{serial[name]:>10.1f}"
        for m in modes:
            if hooks.get(m) is None:
                continue
            t = results[m, name, args.threads]
            line += f"{t:>14.1f}{t / serial[name]:>9.2f}"
        print(line, flush=True)


def _start_spinners():
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,)) for _ in range(os.cpu_count())]
    for p in spinners:
        p.start()
    time.sleep(0.2)
    return spinners, stop


def _stop_spinners(spinners, stop):
    if stop is not None:
        stop.set()
        for p in spinners:
            p.join()


def _spin(stop):
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, batch 1 and 16")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=colibri.max_threads())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pool-mb", type=int, default=POOL_BYTES >> 20)
    parser.add_argument(
        "--paths",
        nargs="*",
        default=None,
        help="lower SIMD paths to force as well (default: avx2 if it runs)",
    )
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--busy", action="store_true", help="the stall table beside a spinning process per core too"
    )
    parser.add_argument("--stalls-only", action="store_true", help="only the stall table")
    parser.add_argument("--no-stalls", action="store_true", help="no stall table")
    parser.add_argument(
        "--avx2-machine",
        action="store_true",
        help="each shape again in a child process that sees an AVX2-only CPU (colibri, torch)",
    )
    parser.add_argument("--label", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.label:
        args.label += " "
    if args.quick:
        args.shapes, args.batches = ["demo", "qwen3-30b-a3b"], [1, 16]
    runs = _ffn.runnable_paths()
    if args.paths is None:
        args.paths = [
            p for p in ("avx2", "avx512", "avx512_bf16") if p in runs and p != _ffn.ffn_path()
        ]
    torch = None
    if not args.no_torch:
        import torch

        torch.set_num_threads(args.threads)
    torch_isa = ""
    if torch is not None:
        # whether torch's bf16 linear goes through oneDNN (AVX512_BF16 / AMX kernels here)
        onednn = "on" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "off"
        torch_isa = f" (oneDNN bf16 {onednn}, aten {torch.backends.cpu.get_cpu_capability()})"
    print(
        f"{args.label}colibri {colibri.__version__}: kernel path {_ffn.ffn_path()} (simd "
        f"{colibri.simd_path()}, runs {', '.join(runs)}); {args.threads} threads; "
        f"torch {torch.__version__ if torch else '-'}{torch_isa}; load {os.getloadavg()[0]:.2f}"
    )
    rng = np.random.default_rng(0)
    if not args.stalls_only:
        for name in args.shapes:
            H, I = SHAPES[name]
            for dtype_name in args.dtypes:
                run_shape(name, H, I, dtype_name, args.batches, args, rng, torch)
                if args.avx2_machine:
                    run_avx2_machine(name, dtype_name, args)
    if not args.no_stalls:
        modes = ["quiet", "busy", "after torch"] if args.busy else ["quiet", "after torch"]
        stall_table(args, rng, torch, modes)


if __name__ == "__main__":
    main()
