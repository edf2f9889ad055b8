"""Quantized expert FFNs: colibri's fused quantized kernel per block type against the memory
floor of its stored bytes, the bfloat16 kernel on the same shape, and dequantize + BLAS,
measured in one run.

    python bench/bench_quant.py                    # Qwen3-30B-A3B's and OLMoE's expert shapes
    python bench/bench_quant.py --types q4_k q8_0 --batches 1 --threads 1
    python bench/bench_quant.py --types fp8 --batches 1   # float8 experts (e4m3fn, 128 x 128)

One expert is y = down @ (silu(gate @ x) * (up @ x)). Figures are milliseconds per expert,
the best of several rounds over a pool of experts larger than the last-level cache (weights
from memory, as when decoding a large model):

    floor      one read pass over the expert's stored bytes (colibri.layer._ffn.read_pass)
    colibri    the quantized kernel on the dispatched SIMD path; avx2 ...: forced lower paths
    bf16       colibri's bfloat16 kernel on the same shape (what the same model costs unquantized)
    deq+blas   dequantize to float32, then numpy GEMMs (what larger batches run)

Ratios: "x floor" = colibri / floor (the target is <= 1.3 at batch 1), "x bf16" = bf16 /
colibri.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_kernels import best_ms  # bench/ is the script's folder: on sys.path

from colibri._dlpack import float32_to_bf16
from colibri.layer import _ffn, _fp8, _quant

# (H, I) of experts whose rows are whole blocks of every type (256 values)
SHAPES = {"qwen3-30b-a3b": (2048, 768), "olmoe": (2048, 1024)}


def quantized_pool(qtype, H, I, pool_bytes, rng):
    """Experts as (gate, up, down) uint8 blocks with small finite scales, each with memory of
    its own, and the bytes of each as one uint64 array for the floor."""
    blk, size = _quant.BLOCK[qtype], _quant.BLOCK_BYTES[qtype]
    nbytes = 2 * I * (H // blk * size) + H * (I // blk * size)
    count = max(1, min(64, pool_bytes // nbytes))
    experts = []
    for _ in range(count):
        flat = rng.integers(0, 256, nbytes, dtype=np.uint8)
        view = flat[: (nbytes // size) * size].reshape(-1, size)
        if qtype == "mxfp4":
            view[:, 0] = 120
        else:  # every float16 scale small and normal (Q6_K's is at the block's end)
            fields = {"q6_k": [size - 2], "q4_k": [0, 2], "q5_k": [0, 2]}.get(qtype, [0])
            for at in fields:
                view[:, at : at + 2] = np.array([1e-3], np.float16).view(np.uint8)
        a, b = I * (H // blk * size), 2 * I * (H // blk * size)
        g = flat[:a].reshape(I, -1)
        u = flat[a:b].reshape(I, -1)
        d = flat[b:].reshape(H, -1)
        experts.append((g, u, d, flat[: nbytes // 8 * 8].view(np.uint64)))
    return experts, nbytes


def fp8_pool(H, I, pool_bytes, rng):
    """float8 (e4m3fn, no NaN) experts with small 128 x 128 block scales, as
    quantized_pool's, and their (gate, up, down) scales."""
    nbytes = 3 * H * I
    experts = []
    for _ in range(max(1, min(64, pool_bytes // nbytes))):
        flat = rng.integers(0, 256, nbytes, dtype=np.uint8)
        flat[(flat & 0x7F) == 0x7F] = 0x3C
        g, u, d = flat[: I * H].reshape(I, H), flat[I * H : 2 * I * H], flat[2 * I * H :]
        experts.append((g, u.reshape(I, H), d.reshape(H, I), flat.view(np.uint64)))
    gu, dn = _fp8.scale_shape(I, H), _fp8.scale_shape(H, I)
    scales = (np.full(gu, 1e-3, np.float32), np.full(gu, 1e-3, np.float32),
              np.full(dn, 1e-3, np.float32))  # fmt: skip
    return experts, scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=[*_quant.TYPES, "fp8"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pool-mb", type=int, default=640)
    parser.add_argument("--paths", nargs="*", default=None,
                        help="lower SIMD paths to force as well (default: every one this CPU "
                             "runs below its own, from avx2)")  # fmt: skip
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    runnable = _ffn.runnable_paths()
    paths = args.paths
    if paths is None:
        paths = [p for p in ("avx2", "avx512") if p in runnable and _ffn.ffn_path() != p]
    print(f"dispatched path: {_ffn.ffn_path()}  threads: {args.threads or 'all'}")
    print(f"{'shape':14} {'type':7} {'n':>3} {'floor':>7} {'colibri':>8} "
          + "".join(f"{p:>8}" for p in paths)
          + f" {'bf16':>7} {'deq+blas':>9} {'x floor':>8} {'x bf16':>7}")  # fmt: skip
    for shape in args.shapes:
        H, I = SHAPES[shape]
        bf16 = []  # a pool of bfloat16 experts as large as the quantized ones
        for _ in range(max(1, min(64, (args.pool_mb << 20) // (6 * H * I)))):
            bits = float32_to_bf16(rng.standard_normal(3 * H * I).astype(np.float32) * 0.02)
            bf16.append((bits[: I * H].reshape(I, H), bits[I * H : 2 * I * H].reshape(I, H),
                         bits[2 * I * H :].reshape(H, I)))  # fmt: skip
        for qtype in args.types:
            if qtype == "fp8":
                experts, scales = fp8_pool(H, I, args.pool_mb << 20, rng)
            else:
                (experts, _), scales = quantized_pool(qtype, H, I, args.pool_mb << 20, rng), None
            for n in args.batches:
                row = measure(qtype, experts, bf16, rng.standard_normal((n, H)).astype(np.float32),
                              paths, args, scales)  # fmt: skip
                floor, cells, half, blas = row
                print(f"{shape:14} {qtype:7} {n:3d} {floor:7.3f} {cells[0]:8.3f} "
                      + "".join(f"{c:8.3f}" for c in cells[1:])
                      + f" {half:7.3f} {blas:9.3f} {cells[0] / floor:8.2f} "
                      f"{half / cells[0]:7.2f}", flush=True)  # fmt: skip


def measure(qtype, experts, bf16, x, paths, args, scales=None):
    """(floor, [colibri, *paths], bf16, dequantize + BLAS): ms per expert; ``scales``: the
    float8 experts' block scales."""
    count, threads, rounds = len(experts), args.threads, args.rounds
    floor = best_ms(lambda: [_ffn.read_pass(e[3], threads) for e in experts], rounds) / count

    def kernel(g, u, d, path):
        if scales is not None:
            return _fp8.ffn(g, u, d, scales, x, "silu", threads, path)
        return _quant.ffn(qtype, g, u, d, x, "silu", threads, path)

    cells = [
        best_ms(lambda path=path: [kernel(g, u, d, path) for g, u, d, _ in experts], rounds) / count
        for path in [None, *paths]
    ]
    y = np.empty(x.shape, np.float32)
    half = best_ms(lambda: [_ffn.ffn(x, *e, 2, 0, y, threads) for e in bf16], rounds) / len(bf16)
    g, u, d, _ = experts[0]

    def dequantize(w, i):
        return _quant.dequantize(qtype, w) if scales is None else _fp8.dequantize(w, scales[i])

    def deq():
        gf, uf = dequantize(g, 0), dequantize(u, 1)
        h = x @ gf.T
        h = h / (1 + np.exp(-np.clip(h, -80, 80))) * (x @ uf.T)
        return h @ dequantize(d, 2).T

    return floor, cells, half, best_ms(deq, rounds)


if __name__ == "__main__":
    main()
