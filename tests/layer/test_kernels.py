"""The fused gated-FFN kernel (include/colibri/ffn.h) against a float64 reference, on every
SIMD path this CPU runs, and its public entry colibri.expert_ffn."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import colibri
from colibri.layer import _ffn

ml_dtypes = pytest.importorskip("ml_dtypes")

PATHS = _ffn.runnable_paths()
U = 2.0**-24  # float32 unit roundoff
SPLIT = 2.0**-17  # x as two bfloat16 parts (the avx512_bf16 path, bfloat16 weights)
HALVES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _act64(name: str, g: np.ndarray) -> np.ndarray:
    from math import erf

    if name == "silu":
        return g / (1.0 + np.exp(-g))
    if name == "gelu_tanh":
        return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))
    if name == "gelu":
        return 0.5 * g * (1.0 + np.vectorize(erf)(g / np.sqrt(2.0)))
    return np.maximum(g, 0.0)


def reference(x, gate, up, down, act="silu"):
    """float64 result and the error bound the kernel must meet, elementwise.

    Every dot product of length K in float32 (exact products of float32 x and half
    weights) is within K u sum |w x| of the exact one (u = 2^-24); the bf16 path adds
    2^-17 sum |w x| for x's split. The activation's slope is below 1.2 in magnitude, and
    expf/tanhf/erff add a few ulps. The bound doubles the sum of both passes' terms."""
    x = np.asarray(x, np.float64)
    g, u, d = (np.asarray(w, np.float64) for w in (gate, up, down))
    a, b = x @ g.T, x @ u.T
    h = _act64(act, a) * b
    H, I = g.shape[1], g.shape[0]
    ga, ua = np.abs(x) @ np.abs(g).T, np.abs(x) @ np.abs(u).T
    e1 = (H * U + SPLIT) * np.maximum(ga, ua)
    eh = 1.2 * e1 * np.abs(b) + np.abs(_act64(act, a)) * e1 + 8 * U * np.abs(h) + 1.2 * e1 * e1
    ey = (I * U + SPLIT) * (np.abs(h) @ np.abs(d).T) + eh @ np.abs(d).T
    return h @ d.T, 2 * ey + 1e-30


def _weights(rng, H, I, dtype, scale=1.0):
    t = HALVES[dtype]
    g = (rng.standard_normal((I, H)) * scale / np.sqrt(H)).astype(t)
    u = (rng.standard_normal((I, H)) * scale / np.sqrt(H)).astype(t)
    d = (rng.standard_normal((H, I)) / np.sqrt(I)).astype(t)
    return g, u, d


def _run(x, g, u, d, act="silu", path=None, threads=0):
    y = np.empty((x.shape[0], d.shape[0]), np.float32)
    kind = _ffn.WEIGHT_KINDS[g.dtype.name]
    bits = [w.view(np.uint16) for w in (g, u, d)]
    _ffn.ffn(x, *bits, kind, _ffn.ACTIVATIONS[act], y, threads, path)
    return y


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "H, I, n",
    [(64, 48, 1), (37, 29, 3), (33, 70, 5), (128, 200, 16), (1, 1, 1), (31, 17, 64), (512, 96, 2)],
)
def test_every_path_within_the_stated_bound(path, dtype, H, I, n):
    rng = np.random.default_rng(H * 1000 + I + n)
    g, u, d = _weights(rng, H, I, dtype)
    x = rng.standard_normal((n, H)).astype(np.float32)
    ref, bound = reference(x, g, u, d)
    y = _run(x, g, u, d, path=path)
    assert np.all(np.abs(y - ref) <= bound), np.max(np.abs(y - ref) / bound)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu", "relu"])
@pytest.mark.parametrize("path", PATHS)
def test_activations(act, path):
    rng = np.random.default_rng(7)
    g, u, d = _weights(rng, 96, 80, "bfloat16", scale=4.0)  # gates well into both tails
    x = rng.standard_normal((4, 96)).astype(np.float32)
    ref, bound = reference(x, g, u, d, act)
    y = _run(x, g, u, d, act, path=path)
    assert np.all(np.abs(y - ref) <= bound)


@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_simd_paths_agree_with_plain_c(path, dtype):
    rng = np.random.default_rng(3)
    g, u, d = _weights(rng, 300, 130, dtype)
    x = rng.standard_normal((7, 300)).astype(np.float32)
    scalar = _run(x, g, u, d, path="scalar")
    _, bound = reference(x, g, u, d)
    np.testing.assert_array_less(np.abs(_run(x, g, u, d, path=path) - scalar), bound)


@pytest.mark.parametrize("path", PATHS)
def test_special_values_propagate(path):
    rng = np.random.default_rng(5)
    g, u, d = _weights(rng, 40, 24, "float16")
    x = rng.standard_normal((3, 40)).astype(np.float32)
    x[1, 7] = np.nan
    u = u.copy()
    u[5, :] = np.inf  # row 5 of h is +-inf or nan for every row
    y = _run(x, g, u, d, path=path)
    assert np.isnan(y[1]).all()
    with np.errstate(all="ignore"):
        ref, _ = reference(x, g, u, d)
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_give_the_same_bits(threads):
    rng = np.random.default_rng(11)
    g, u, d = _weights(rng, 256, 700, "bfloat16")
    x = rng.standard_normal((2, 256)).astype(np.float32)
    np.testing.assert_array_equal(_run(x, g, u, d, threads=threads), _run(x, g, u, d, threads=1))


def test_strided_weight_rows_and_outputs():
    rng = np.random.default_rng(2)
    g, u, d = _weights(rng, 64, 40, "float16")
    wide = np.zeros((40, 80), np.float16)
    wide[:, :64] = g
    x = rng.standard_normal((3, 64)).astype(np.float32)
    out = np.zeros((3, 100), np.float32)
    y = colibri.expert_ffn(x, wide[:, :64], u, d, out=out[:, :64])
    assert y is not None
    np.testing.assert_array_equal(out[:, :64], _run(x, g, u, d))
    assert not out[:, 64:].any()


# ---- colibri.expert_ffn ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 4, 16, 17, 40])
def test_expert_ffn_numpy(dtype, n):
    """Kernel rows (n <= 16) and the GEMM path beyond: both within the bound."""
    rng = np.random.default_rng(n)
    g, u, d = _weights(rng, 72, 56, dtype)
    x = rng.standard_normal((n, 72)).astype(np.float32)
    ref, bound = reference(x, g, u, d)
    y = colibri.expert_ffn(x, g, u, d)
    assert y.dtype == np.float32 and y.shape == (n, 72)
    assert np.all(np.abs(y - ref) <= bound)


def test_expert_ffn_one_row_and_input_dtypes():
    rng = np.random.default_rng(4)
    g, u, d = _weights(rng, 48, 32, "bfloat16")
    x = rng.standard_normal(48).astype(np.float32)
    y = colibri.expert_ffn(x, g, u, d, activation="gelu_tanh")
    assert y.shape == (48,)
    ref, bound = reference(x[None], g, u, d, "gelu_tanh")
    assert np.all(np.abs(y - ref[0]) <= bound[0])
    y16 = colibri.expert_ffn(x.astype(np.float16), g, u, d, activation="gelu_tanh")
    assert y16.dtype == np.float16
    np.testing.assert_allclose(y16.astype(np.float32), y, rtol=2e-3, atol=1e-3)
    y64 = colibri.expert_ffn(x.astype(np.float64), g, u, d, activation="gelu_tanh")
    assert y64.dtype == np.float64


def test_expert_ffn_torch_bf16_in_torch_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    g, u, d = _weights(rng, 64, 48, "bfloat16")
    tg, tu, td = (torch.from_numpy(w.view(np.int16)).view(torch.bfloat16) for w in (g, u, d))
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    y = colibri.expert_ffn(x, tg, tu, td)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.shape == (3, 64)
    with torch.no_grad():
        xf = x.float()
        want = torch.nn.functional.linear(
            torch.nn.functional.silu(torch.nn.functional.linear(xf, tg.float()))
            * torch.nn.functional.linear(xf, tu.float()),
            td.float(),
        )
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)  # bf16 output rounding
    out = torch.empty(3, 64, dtype=torch.float32)
    got = colibri.expert_ffn(xf.detach(), tg, tu, td, out=out)
    assert got is out
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_expert_ffn_float32_weights_and_callable_activation():
    rng = np.random.default_rng(9)
    g, u, d = (w.astype(np.float32) for w in _weights(rng, 40, 30, "float16"))
    x = rng.standard_normal((2, 40)).astype(np.float32)
    ref, _ = reference(x, g, u, d, "relu")
    np.testing.assert_allclose(
        colibri.expert_ffn(x, g, u, d, activation="relu"), ref, rtol=1e-4, atol=1e-5
    )
    y = colibri.expert_ffn(
        x,
        g.astype(np.float16),
        u.astype(np.float16),
        d.astype(np.float16),
        activation=lambda v: np.maximum(v, 0),
    )
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "x": a["x"][:, :5]}, r"gate must be \[I, 5\]"),
        (lambda a: {**a, "up": a["up"][:10]}, r"up must be \[30, 40\]"),
        (lambda a: {**a, "down": a["down"].T}, r"down must be \[40, 30\]"),
        (lambda a: {**a, "down": a["down"].astype(np.float32)}, "share one dtype"),
        (lambda a: {**a, "gate": a["gate"].view(np.int16)}, "gate must be float32"),
        (lambda a: {**a, "x": a["x"].astype(np.int32)}, "x must be float32"),
        (lambda a: {**a, "x": a["x"][None]}, r"x must be \[n, H\] or \[H\]"),
        (lambda a: {**a, "num_threads": 0}, "num_threads must be a positive int"),
        (lambda a: {**a, "activation": "swish"}, "unknown activation"),
        (lambda a: {**a, "out": np.empty((2, 40), np.float64)}, "out must be float32"),
    ],
)
def test_expert_ffn_bad_input(change, message):
    rng = np.random.default_rng(1)
    g, u, d = _weights(rng, 40, 30, "float16")
    args = {"x": rng.standard_normal((2, 40)).astype(np.float32), "gate": g, "up": u, "down": d}
    args = change(args)
    with pytest.raises(ValueError, match=message):
        colibri.expert_ffn(
            args.pop("x"), args.pop("gate"), args.pop("up"), args.pop("down"), **args
        )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ffn_sum_is_the_weighted_sum_of_experts(path, dtype):
    """A layer's experts in one call: y[row] += scale * expert(x[row]) for every assignment,
    within the kernel's bound of float64, and bit for bit the single-expert kernel's rows
    summed in assignment order (experts of different widths, rows shared and repeated)."""
    rng = np.random.default_rng(11)
    H, T = 40, 5
    experts = [_weights(rng, H, I, dtype) for I in (24, 56, 24, 8)]
    groups = [[0, 3], [3], [1, 2, 4, 0], [4, 4]]  # expert j's rows (a row twice: allowed)
    scale = rng.uniform(0.1, 1.0, sum(map(len, groups))).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    y0 = rng.standard_normal((T, H)).astype(np.float32)  # accumulated into, not overwritten
    rows = np.concatenate(groups).astype(np.int64)
    bounds = np.cumsum([0] + [len(g) for g in groups]).astype(np.int64)
    y = y0.copy()
    bits = [tuple(w.view(np.uint16) for w in e) for e in experts]
    kind = _ffn.WEIGHT_KINDS[dtype]
    _ffn.ffn_sum(x, bits, kind, _ffn.ACTIVATIONS["silu"], bounds, rows, scale, y, 0, path)
    want, bound, at = y0.astype(np.float64), np.zeros((T, H)), 0
    same = y0.copy()
    for (g, u, d), group in zip(experts, groups):  # noqa: B905 (4 and 4)
        ref, err = reference(x[group], g, u, d)
        one = _run(np.ascontiguousarray(x[group]), g, u, d, path=path)
        for r, row in enumerate(group):
            want[row] += scale[at] * ref[r]
            bound[row] += scale[at] * err[r]
            same[row] += scale[at] * one[r]
            at += 1
    assert np.all(np.abs(y - want) <= bound + 4 * U * np.abs(want) + 1e-30)
    np.testing.assert_array_equal(y, same)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(bounds=[0, 2]), r"bounds must be \[3\] from 0"),
        (dict(bounds=[1, 1, 2]), r"bounds must be \[3\] from 0"),
        (dict(rows=[0, 9]), r"row 9 outside x's 3 rows"),
        (dict(rows=[0, -1]), r"row -1 outside"),
        (dict(scale=[1.0]), r"rows and scale must be \[2\]"),
        (dict(bounds=[0, 0, 2]), r"expert 0 has 0 rows"),
        (dict(y=np.zeros((3, 7), np.float32)), r"y must be \[3, 16\] like x"),
        (dict(second=(np.zeros((4, 16)), np.zeros((4, 16)), np.zeros((15, 4)))),
         r"expert 1 must be gate/up \[I, 16\] and down \[16, I\]"),
    ],
)  # fmt: skip
def test_ffn_sum_bad_input(change, message):
    rng = np.random.default_rng(2)
    e = tuple(w.view(np.uint16) for w in _weights(rng, 16, 4, "bfloat16"))
    args = dict(bounds=[0, 1, 2], rows=[0, 2], scale=[1.0, 0.5], y=np.zeros((3, 16), np.float32))
    second = change.pop("second", None)
    args.update(change)
    experts = [e, tuple(np.asarray(w, np.uint16) for w in second) if second else e]
    with pytest.raises(ValueError, match=message):
        _ffn.ffn_sum(np.ones((3, 16), np.float32), experts, 2, 0,
                     np.asarray(args["bounds"], np.int64), np.asarray(args["rows"], np.int64),
                     np.asarray(args["scale"], np.float32), args["y"], 0)  # fmt: skip


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path must be one of"):
        _ffn.path_index("avx3")


def test_moelayer_runs_the_kernel(monkeypatch):
    """MoELayer with bfloat16 experts: the fused kernel and the GEMM path agree, and both
    match a float64 evaluation of the routed experts."""
    rng = np.random.default_rng(12)
    E, H, I, k = 6, 48, 40, 2
    gate_w = rng.standard_normal((E, H)).astype(np.float32)
    experts = [_weights(rng, H, I, "bfloat16") for _ in range(E)]
    store = colibri.InMemoryExperts(*(np.stack([e[j] for e in experts]) for j in range(3)))
    x = rng.standard_normal((5, H)).astype(np.float32)
    moe = colibri.MoELayer(gate_w, store, k)
    y = moe(x)
    ids, w = moe.route(x)
    want, tol = np.zeros((5, H)), np.zeros((5, H))
    for t in range(5):
        for j in range(k):
            ref, bound = reference(x[t : t + 1], *experts[ids[t, j]])
            want[t] += w[t, j] * ref[0]
            tol[t] += w[t, j] * bound[0] + 1e-6 * np.abs(w[t, j] * ref[0])  # + combine
    assert np.all(np.abs(y - want) <= tol)
    monkeypatch.setenv("COLIBRI_EXPERT_KERNEL", "0")  # every expert through BLAS
    gemm = moe(x)
    assert np.all(np.abs(gemm - want) <= tol)
    assert not np.array_equal(gemm, y), "the kernel and BLAS sum in different orders"
    monkeypatch.setenv("COLIBRI_EXPERT_KERNEL", "off")
    with pytest.raises(ValueError, match="COLIBRI_EXPERT_KERNEL must be"):
        moe(x)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )


@pytest.mark.parametrize("path", PATHS)
def test_colibri_simd_caps_the_path(path):
    r = _python("import colibri; print(colibri.simd_path())", COLIBRI_SIMD=path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == path


def test_colibri_simd_rejects_unknown_names():
    r = _python(
        "import colibri, numpy as np\n"
        "try:\n    colibri.simd_path()\nexcept ValueError as e:\n    print(e)",
        COLIBRI_SIMD="avx9000",
    )
    assert "COLIBRI_SIMD must be one of" in r.stdout and "'avx9000'" in r.stdout


def _cpuinfo() -> dict:
    """The first processor's fields in /proc/cpuinfo ({} where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    pairs = (line.partition(":") for line in first.splitlines())
    return {key.strip(): value.strip() for key, _, value in pairs}


def test_the_kernels_default_path_follows_the_cpu():
    """avx512 where the CPU runs 512-bit vectors whole, avx2 on AMD family 25 with AVX-512
    (Zen 4: two 256-bit halves), as /proc/cpuinfo tells it, against the kernels' own cpuid;
    COLIBRI_SIMD still caps it."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    if not {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        pytest.skip("no AVX-512 here (or no /proc/cpuinfo)")
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_SIMD"}
    code = "from colibri.layer import ffn_path; print(ffn_path())"
    halves = info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
    for cap, want in [(None, "avx2" if halves else "avx512"), ("avx2", "avx2"), ("sse2", "sse2")]:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env if cap is None else {**env, "COLIBRI_SIMD": cap})  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want, (cap, info.get("vendor_id"), info.get("cpu family"))


def test_native_halves_follow_the_cpu():
    """The half types torch computes natively (NATIVE_HALF), and so the rows an expert of
    each takes the fused kernel for (KERNEL_MAX_ROWS: fewer only for native bfloat16), as
    /proc/cpuinfo's flags tell them against the kernels' own cpuid: bfloat16 with
    avx512_bf16, float16 with avx512_fp16 apart (a Zen 4 has the first only)."""
    from colibri.layer import KERNEL_MAX_ROWS, NATIVE_HALF

    info = _cpuinfo()
    if "flags" not in info:
        pytest.skip("no /proc/cpuinfo here")
    flags = set(info["flags"].split())
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags
    want = {"bfloat16"} if avx512 and "avx512_bf16" in flags else set()
    want |= {"float16"} if avx512 and "avx512_fp16" in flags else set()
    assert want == NATIVE_HALF
    assert _ffn.has_avx512fp16() == ("float16" in want)
    rows = {"float16": _ffn.MAX_ROWS, "bfloat16": 2 if "bfloat16" in want else _ffn.MAX_ROWS}
    assert rows == KERNEL_MAX_ROWS


def test_read_pass_reads_every_word():
    words = np.arange(1, 100_001, dtype=np.uint64)
    assert _ffn.read_pass(words, 2) == int(words.sum())


def test_concurrent_callers_share_the_pool():
    """Calls from several Python threads at once (one holds the helpers, the others run
    alone): every result is right."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(13)
    g, u, d = _weights(rng, 256, 300, "bfloat16")
    xs = [rng.standard_normal((2, 256)).astype(np.float32) for _ in range(16)]
    want = [_run(x, g, u, d, threads=1) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: _run(x, g, u, d, threads=2), xs * 4))
    for i, y in enumerate(got):
        np.testing.assert_array_equal(y, want[i % len(xs)])


# ---- aarch64 (NEON) under emulation: a cross compiler and qemu-user ------------------

FFN_PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include "colibri/ffn.h"

/* argv: in.bin n H I kind act path out.bin */
int main(int argc, char **argv)
{
    if (argc != 9) return 2;
    int n = atoi(argv[2]), H = atoi(argv[3]), I = atoi(argv[4]);
    size_t nx = (size_t)n * H, nw = (size_t)I * H;
    float *x = malloc(4 * nx), *h = malloc(4 * (size_t)n * I), *y = malloc(4 * nx);
    uint16_t *w = malloc(2 * 3 * nw);
    FILE *f = fopen(argv[1], "rb");
    if (!f || fread(x, 4, nx, f) != nx || fread(w, 2, 3 * nw, f) != 3 * nw) return 3;
    fclose(f);
    colibri_ffn_t p = {0};
    p.n = n, p.H = H, p.I = I, p.kind = atoi(argv[5]), p.act = atoi(argv[6]);
    p.path = atoi(argv[7]);
    if (!colibri_path_runs(p.path)) return 7;
    p.x = x, p.ldx = H, p.gate = w, p.up = w + nw, p.ldg = p.ldu = H;
    p.down = w + 2 * nw, p.ldd = I, p.h = h, p.y = y, p.ldy = H;
    colibri_ffn_run(&p, 2);
    f = fopen(argv[8], "wb");
    fwrite(y, 4, nx, f);
    fclose(f);
    puts(colibri_path_names[colibri_cpu_detect()]);
    return 0;
}
"""


@pytest.fixture(scope="module")
def aarch64_ffn(tmp_path_factory):
    import shutil

    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cc is None or qemu is None:
        pytest.skip("no aarch64 cross compiler (gcc-aarch64-linux-gnu) or qemu-user")
    folder = tmp_path_factory.mktemp("arm")
    (folder / "ffn.c").write_text(FFN_PROGRAM)
    exe = folder / "ffn"
    subprocess.run(
        [
            cc,
            "-O2",
            "-std=c11",
            "-ffp-contract=off",
            "-static",
            "-pthread",
            "-I",
            colibri.get_include(),
            str(folder / "ffn.c"),
            "-o",
            str(exe),
            "-lm",
        ],
        check=True,
        capture_output=True,
    )
    return qemu, exe


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("H, I, n", [(37, 29, 3), (128, 96, 5)])
def test_neon_and_plain_c_on_aarch64(aarch64_ffn, tmp_path, dtype, H, I, n):
    qemu, exe = aarch64_ffn
    rng = np.random.default_rng(H + n)
    g, u, d = _weights(rng, H, I, dtype)
    x = rng.standard_normal((n, H)).astype(np.float32)
    blob = tmp_path / "in.bin"
    blob.write_bytes(x.tobytes() + b"".join(w.view(np.uint16).tobytes() for w in (g, u, d)))
    ref, bound = reference(x, g, u, d)
    kind = _ffn.WEIGHT_KINDS[dtype]
    results = {}
    for path in ("neon", "scalar"):
        out = tmp_path / f"{path}.bin"
        r = subprocess.run(
            [
                qemu,
                str(exe),
                str(blob),
                str(n),
                str(H),
                str(I),
                str(kind),
                "0",
                str(_ffn.PATHS.index(path)),
                str(out),
            ],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, (r.returncode, r.stderr)
        assert r.stdout.strip() == "neon"  # what cpu.h detects there
        results[path] = np.fromfile(out, np.float32).reshape(n, H)
        assert np.all(np.abs(results[path] - ref) <= bound), path
    assert not np.array_equal(results["neon"], results["scalar"]) or H < 8
