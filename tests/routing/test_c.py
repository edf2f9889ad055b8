"""include/colibri/route.h built as C for every platform this machine can run, under every
routing option, against colibri's own router bit for bit.

Each build routes every case twice, row by row (``colibri_route_row``) and as the batch
driver does (``colibri_route_block`` on blocks of rows, the rest row by row), so every ISA's
primitives and its block kernels are checked:

- the host compiler with its SIMD path (SSE2 on x86-64), with the AVX2 kernels, the AVX-512F
  kernels alone and both together (where this CPU runs them and ``COLIBRI_SIMD`` allows), and
  as plain C (``-U__SSE2__``);
- aarch64 with a cross compiler, run under qemu-user, once on its NEON path and once with
  ``COLIBRI_SIMD=scalar`` (plain C, chosen at run time through cpu.h);
- Windows x86-64 with mingw-w64, run under wine, on SSE2 and with the AVX2 kernels.

A build whose toolchain is missing is skipped (``.ci/toolchains.sh`` installs them for CI).
Every build is strict C99 with ``-Wall``, warning-free under GCC. A slow test sweeps the
AVX-512F exponential against plain C's over the floats where the answers vary.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

import colibri
from _support.toolchains import AARCH64_CC, COMMON, HOST_CC, MINGW_CC, QEMU, WINE, settle_wine

# the C header built for every platform the toolchains reach: the same
# header whatever the Python build, so CI runs these once, in the README job
pytestmark = pytest.mark.slow

PROGRAM = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "colibri/route.h"

/* wide: a comma list of avx2, avx512 (the kernels to allow). case.bin: int32 T E k
 * scoring normalize bias_on_logits G topk_groups group_score groups_in_order has_bias
 * has_expert_scale; float32 norm_p norm_eps scale; float32 logits [T, E]; float32 bias [E]
 * if any; float32 expert_scale [E] if any; int32 group_start [G + 1]; int32 group_members
 * [E].  out.bin, once row by row, then once by blocks: int32 status [T], int32 ids [T, k],
 * float32 w [T, k]. */
static void *take(FILE *f, size_t size, size_t n)
{
    void *p = malloc(size * (n ? n : 1));
    if (!p || fread(p, size, n, f) != n)
        exit(3);
    return p;
}

/* The batch driver's order (colibri/_core.pyx): blocks while the router allows them, then
 * the rest one row at a time, from the first block that did not route. */
static void route_blocks(const colibri_router_t *r, const float *x, int32_t T, void *scratch,
                         int32_t *status, int32_t *ids, float *w)
{
    const int32_t E = r->num_experts, k = r->top_k;
    int32_t t = 0;
    if (colibri_rows8_eligible(r)) {
        const int32_t block = colibri_block_rows(r);
        for (; t + block <= T; t += block)
            if (colibri_route_block(r, x + (size_t)t * E, E, scratch, ids + (size_t)t * k,
                                    w + (size_t)t * k) != COLIBRI_OK)
                break;
    }
    for (; t < T; t++)
        status[t] = colibri_route_row(r, x + (size_t)t * E, scratch, ids + (size_t)t * k,
                                      w + (size_t)t * k);
}

/* One case: case.bin in, out.bin out; 0, or the code of what failed (3 to 5). */
static int route_case(const char *in, const char *out, int use_avx2, int use_avx512)
{
    FILE *f = fopen(in, "rb");
    if (!f)
        return 4;
    int32_t *h = take(f, sizeof(int32_t), 12);
    float *fl = take(f, sizeof(float), 3);
    int32_t T = h[0], E = h[1], k = h[2], G = h[6], t, pass;
    colibri_router_t r;
    memset(&r, 0, sizeof r);
    r.num_experts = E;
    r.top_k = k;
    r.scoring = h[3];
    r.normalize = h[4];
    r.bias_on_logits = h[5];
    r.num_groups = G;
    r.topk_groups = h[7];
    r.group_score = h[8];
    r.groups_in_order = h[9];
    r.norm_p = fl[0];
    r.norm_eps = fl[1];
    r.scale = fl[2];
    r.use_avx2 = use_avx2;
    r.use_avx512 = use_avx512;
    float *x = take(f, sizeof(float), (size_t)T * E);
    float *bias = h[10] ? take(f, sizeof(float), (size_t)E) : NULL;
    float *expert_scale = h[11] ? take(f, sizeof(float), (size_t)E) : NULL;
    int32_t *start = take(f, sizeof(int32_t), (size_t)G + 1);
    int32_t *members = take(f, sizeof(int32_t), (size_t)E);
    fclose(f);
    r.bias = bias;
    r.expert_scale = expert_scale;
    r.group_start = start;
    r.group_members = members;
    void *scratch = malloc(colibri_scratch_bytes(&r));
    int32_t *status = calloc((size_t)T, sizeof(int32_t));
    int32_t *ids = calloc((size_t)T * k, sizeof(int32_t));
    float *w = calloc((size_t)T * k, sizeof(float));
    if (!scratch || !status || !ids || !w)
        return 3;
    f = fopen(out, "wb");
    if (!f)
        return 5;
    for (pass = 0; pass < 2; pass++) {
        memset(status, 0, sizeof(int32_t) * (size_t)T);
        memset(ids, 0xff, sizeof(int32_t) * (size_t)T * k);
        memset(w, 0xff, sizeof(float) * (size_t)T * k);
        if (pass == 0)
            for (t = 0; t < T; t++)
                status[t] = colibri_route_row(&r, x + (size_t)t * E, scratch,
                                              ids + (size_t)t * k, w + (size_t)t * k);
        else
            route_blocks(&r, x, T, scratch, status, ids, w);
        fwrite(status, sizeof(int32_t), (size_t)T, f);
        fwrite(ids, sizeof(int32_t), (size_t)T * k, f);
        fwrite(w, sizeof(float), (size_t)T * k, f);
    }
    fclose(f);
    free(h), free(fl), free(x), free(bias), free(expert_scale), free(start), free(members);
    free(scratch), free(status), free(ids), free(w);
    return 0;
}

/* argv: wide, then pairs of case.bin out.bin (one start for every case: a start under wine
 * costs seconds). Prints the base path, then the wide kernels on. */
int main(int argc, char **argv)
{
    int use_avx2 = 0, use_avx512 = 0, i, failed;
#if defined(COLIBRI_NEON)
    fputs(colibri_neon_on() ? "neon" : "plain C", stdout);
#elif defined(COLIBRI_SSE2)
    fputs("sse2", stdout);
#else
    fputs("plain C", stdout);
#endif
    if (argc < 4 || argc % 2)
        return 2;
    if (strstr(argv[1], "avx2") != NULL) {
        if (!colibri_cpu_has_avx2())
            return 6;
        use_avx2 = 1;
        fputs(" avx2", stdout);
    }
    if (strstr(argv[1], "avx512") != NULL) {
        if (!colibri_cpu_has_avx512())
            return 6;
        use_avx512 = 1;
        fputs(" avx512", stdout);
    }
    puts("");
    for (i = 2; i < argc; i += 2)
        if ((failed = route_case(argv[i], argv[i + 1], use_avx2, use_avx512)) != 0) {
            fprintf(stderr, "%s: failed (%d)\n", argv[i], failed);
            return failed;
        }
    return 0;
}
"""

# the host's base path: what a native build prints
HOST_BASE = {"x86_64": "sse2", "amd64": "sse2", "aarch64": "neon", "arm64": "neon"}.get(
    platform.machine().lower(), "plain C"
)

# The wider x86 kernels this CPU runs (COLIBRI_SIMD caps them), from colibri's own router.
_ROUTER = colibri.init(8, 2)
HOST_WIDE = {"avx2": _ROUTER.use_avx2, "avx512": _ROUTER.use_avx512}

# name: (compiler, extra flags, runner prefix or None for native, environment, the wide
# kernels allowed, what the program prints: its base path, then the wide kernels)
TOOLCHAINS = {
    "host": (HOST_CC, [], None, {}, "", HOST_BASE),
    "host-avx2": (HOST_CC, [], None, {}, "avx2", "sse2 avx2"),
    "host-avx512": (HOST_CC, [], None, {}, "avx512", "sse2 avx512"),
    "host-avx512-avx2": (HOST_CC, [], None, {}, "avx2,avx512", "sse2 avx2 avx512"),
    # plain C: compiled without SSE2 on x86-64, chosen at run time on aarch64
    "plain-c": (HOST_CC, ["-U__SSE2__"], None, {"COLIBRI_SIMD": "scalar"}, "", "plain C"),
    "aarch64-neon-qemu": (AARCH64_CC, ["-static"], QEMU, {}, "", "neon"),
    "aarch64-plain-qemu": (
        AARCH64_CC, ["-static"], QEMU, {"COLIBRI_SIMD": "scalar"}, "", "plain C",
    ),
    "win64-wine": (MINGW_CC, ["-static"], [WINE] if WINE else None, {}, "", "sse2"),
    "win64-avx2-wine": (
        MINGW_CC, ["-static"], [WINE] if WINE else None, {}, "avx2", "sse2 avx2",
    ),
}  # fmt: skip


def _rng_partition(rng, E, G):
    members = rng.permutation(E)
    cuts = np.sort(rng.choice(np.arange(2, E - 1), G - 1, replace=False))
    return [sorted(int(e) for e in g) for g in np.split(members, cuts)]


def _cases():
    rng = np.random.default_rng(2026)
    bias = rng.standard_normal(256).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 256).astype(np.float32)
    return {
        "top2": dict(E=64, k=2),
        "top1-E8": dict(E=8, k=1),
        "top2-E100-scaled": dict(E=100, k=2, expert_scale=scale[:100], scale=1.5),
        "sigmoid-k8": dict(E=26, k=8, scoring="sigmoid", normalize=False, scale=2.0),
        "softmax-bias": dict(E=40, k=4, correction_bias=bias[:40], normalize=False),
        "softmax-bias-k8": dict(E=72, k=8, correction_bias=bias[:72]),
        "bound-k6": dict(E=64, k=6),
        "sqrtsoftplus-bias": dict(E=45, k=4, scoring="sqrtsoftplus", correction_bias=bias[:45]),
        "sqrtsoftplus-logit-bias-p2": dict(
            E=48, k=6, scoring="sqrtsoftplus", correction_bias=bias[:48], bias_on="logits",
            norm_p=2.0, normalize_eps=1e-6,
        ),
        "groups-max": dict(E=26, k=2, num_groups=4),
        "groups-max-k3": dict(E=37, k=3, num_groups=4, topk_groups=2),
        "groups-top2-k3": dict(E=37, k=3, num_groups=4, topk_groups=2, group_score="top2_sum"),
        "deepseek-v3": dict(
            E=256, k=8, scoring="sigmoid", correction_bias=bias, num_groups=8, topk_groups=4,
            group_score="top2_sum", scale=2.5,
        ),
        "partition-expert-scale": dict(
            E=30, k=4, partition=_rng_partition(rng, 30, 5), topk_groups=2,
            expert_scale=scale[:30], scale=0.5,
        ),
        "k16-no-bound": dict(E=64, k=16, scoring="sigmoid"),
    }  # fmt: skip


CASES = _cases()
# sqrt-softplus scores call the C library's log1pf, which is not correctly rounded everywhere:
# mingw/wine's differs from glibc's by an ulp now and then. Everything else in route.h is
# exact IEEE arithmetic or colibri's own exp, the same bits on every platform.
LIBM_CASES = {"sqrtsoftplus-bias", "sqrtsoftplus-logit-bias-p2"}
GLIBC = {name for name in TOOLCHAINS if name.startswith("aarch64")}  # under qemu
if sys.platform == "linux":  # and the native builds
    GLIBC |= {name for name in TOOLCHAINS if name.startswith(("host", "plain"))}


def _logits(rng, T, E):
    x = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    # special values in every 7th row of the first half (a block holding one takes the scalar
    # weights' rules); the second half's blocks are finite, so they take the block kernels
    head = x[: T // 2]
    head[::7] = rng.choice([-np.inf, -1.0, 0.0, 0.5, 2.0, np.inf], size=head[::7].shape)
    x[::11] = np.round(x[::11])  # exact ties
    x[::13] *= 1e-38  # subnormal logits
    x[:, 0] = np.maximum(x[:, 0], 0.0)  # no all -inf row: softmax stays defined
    return x


def _write_case(path, x, config: colibri.Config):
    T, E = x.shape
    groups = config.groups()
    start = np.cumsum([0] + [len(g) for g in groups]).astype(np.int32)
    members = np.concatenate([np.asarray(g, np.int32) for g in groups])
    header = [
        T, E, config.top_k, colibri._core.SCORINGS[config.scoring], int(config.normalize),
        int(config.bias_on == "logits"), len(groups), config.topk_groups,
        colibri._core.GROUP_SCORES[config.group_score],
        int(np.array_equal(members, np.arange(E))), int(config.correction_bias is not None),
        int(config.expert_scale is not None),
    ]  # fmt: skip
    with open(path, "wb") as f:
        f.write(np.asarray(header, "<i4").tobytes())
        f.write(np.asarray([config.norm_p, config.normalize_eps, config.scale], "<f4").tobytes())
        f.write(x.astype("<f4").tobytes())
        for vector in (config.correction_bias, config.expert_scale):
            if vector is not None:
                f.write(np.asarray(vector, "<f4").tobytes())
        f.write(start.astype("<i4").tobytes())
        f.write(members.astype("<i4").tobytes())


def _version(compiler):
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module", params=list(TOOLCHAINS))
def program(request, tmp_path_factory):
    name = request.param
    compiler, flags, runner, env, wide, prints = TOOLCHAINS[name]
    if compiler is None or (name.endswith(("qemu", "wine")) and runner is None):
        pytest.skip(f"{name}: toolchain not installed (.ci/toolchains.sh installs it)")
    if name.endswith("wine"):
        env = {**env, **request.getfixturevalue("wine_env")}
    if not all(HOST_WIDE[w] for w in wide.split(",") if w):
        pytest.skip(f"{name}: this CPU (or COLIBRI_SIMD) does not run the {wide} kernels")
    folder = tmp_path_factory.mktemp(name)
    (folder / "route.c").write_text(PROGRAM)
    exe = folder / ("route.exe" if name.startswith("win") or os.name == "nt" else "route")
    built = subprocess.run(
        [compiler, *COMMON, *flags, "-I", colibri.get_include(), "route.c", "-o", exe.name, "-lm"],
        cwd=folder, capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    if "warning:" in built.stderr and "Free Software Foundation" in _version(compiler):
        pytest.fail(f"{name}: route.h warns under {' '.join(COMMON)}:\n{built.stderr[-4000:]}")
    return name, [*(runner or []), str(exe)], env, wide, prints


@pytest.fixture(scope="module")
def routed(program, tmp_path_factory):
    """Every case routed by one run of the program (a wine start costs seconds): the
    folder of ``<case>.out`` files, and what the program printed."""
    name, command, program_env, wide, prints = program
    folder = tmp_path_factory.mktemp(f"{name}-cases")
    pairs = []
    for case in CASES:
        x, config = _case(case)
        _write_case(folder / f"{case}.bin", x, config)
        pairs += [f"{case}.bin", f"{case}.out"]
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_SIMD"}
    env.update(program_env)
    run = [*command, wide, *pairs]
    done = subprocess.run(run, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    if name.endswith("wine") and (done.returncode, done.stdout, done.stderr) == (1, "", ""):
        # wine gave up before the program started (the program prints before anything else,
        # and its own failures exit 2 to 6): once more, after wineserver settles
        settle_wine(program_env)
        done = subprocess.run(run, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    return folder, done


def _case(case):
    options = dict(CASES[case])
    E, k = options.pop("E"), options.pop("k")
    rng = np.random.default_rng(E * 1000 + k)
    return _logits(rng, 200, E), colibri.Config(num_experts=E, top_k=k, **options)


@pytest.mark.parametrize("case", list(CASES))
def test_route_h_matches_the_router_bit_for_bit(program, routed, case):
    name, prints, k = program[0], program[4], CASES[case]["k"]
    folder, done = routed
    assert done.returncode == 0, (name, done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == prints, done.stdout
    x, config = _case(case)
    ids, weights = colibri.init(config=config).route(x)
    out = np.fromfile(folder / f"{case}.out", np.uint8)
    T = len(x)
    per_pass = T * 4 * (1 + 2 * k)
    assert out.size == 2 * per_pass
    for driver, part in (("rows", out[:per_pass]), ("blocks", out[per_pass:])):
        status = part[: T * 4].view("<i4")
        c_ids = part[T * 4 : T * 4 * (1 + k)].view("<i4").reshape(T, k)
        c_weights = part[T * 4 * (1 + k) :].view("<f4").reshape(T, k)
        where = f"{name} {case} {driver}"
        assert (status == 0).all(), f"{where}: rows {np.flatnonzero(status)} failed"
        np.testing.assert_array_equal(c_ids, ids, err_msg=where)
        if case in LIBM_CASES and name not in GLIBC:
            np.testing.assert_array_max_ulp(c_weights, weights, maxulp=4)
        else:
            np.testing.assert_array_equal(
                c_weights.view("<i4"), weights.view(np.int32), err_msg=where
            )


EXP_SWEEP = r"""
#include <stdio.h>
#include "colibri/route.h"

/* colibri_exp_avx512 (roundscale, scalef) against plain C's colibri_exp (magic-number
 * rounding, two power-of-two scalings): every float of magnitude in [2^-24, 2^8) (where the
 * answers vary), and every 61st bit pattern elsewhere. Prints the count of differing answers. */
__attribute__((target("avx512f"))) int main(void)
{
    unsigned long long differ = 0, checked = 0;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (unsigned long long b = 0; b < (1ull << 32); b += 16) {
        unsigned e = (unsigned)(b >> 23) & 0xff;
        if ((e < 127 - 24 || e >= 127 + 8) && (b / 16) % 61)
            continue;
        __m512i bits = _mm512_add_epi32(_mm512_set1_epi32((int32_t)b), lane);
        float x[16], y[16];
        _mm512_storeu_ps(x, _mm512_castsi512_ps(bits));
        _mm512_storeu_ps(y, colibri_exp_avx512(_mm512_castsi512_ps(bits)));
        for (int i = 0; i < 16; i++) {
            float want = colibri_exp(x[i]);
            if (x[i] != x[i]) /* NaN: the clamps keep it in C, max/min drop it: never routed */
                continue;
            checked++;
            differ += memcmp(&want, &y[i], 4) != 0;
        }
    }
    printf("%llu %llu\n", checked, differ);
    return 0;
}
"""


@pytest.mark.skipif(not HOST_WIDE["avx512"], reason="this CPU (or build) has no AVX-512F")
def test_exp_avx512_gives_plain_c_bits_for_every_float_in_range(tmp_path):
    """colibri_exp_avx512 computes n with roundscale and scales with scalef (fewer operations
    than the 4-lane code); the answers must stay plain C's, bit for bit (a full 2^32 sweep of
    the header's first version of this found no difference either)."""
    if HOST_CC is None:
        pytest.skip("no C compiler")
    src = tmp_path / "exp.c"
    src.write_text(EXP_SWEEP)
    exe = tmp_path / "exp"
    subprocess.run(
        [HOST_CC, "-O2", "-std=gnu11", "-ffp-contract=off", f"-I{colibri.get_include()}",
         str(src), "-o", str(exe), "-lm"],
        check=True,
    )  # fmt: skip
    checked, differ = map(
        int, subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    )
    assert checked > 400_000_000
    assert differ == 0
