"""include/colibri/route.h from a C program: the SIMD and the plain-C paths (what ARM builds
run, tested nowhere else) give the same bits as colibri's own router."""

import os
import shutil
import subprocess

import numpy as np
import pytest

import colibri

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "colibri/route.h"

/* argv: logits.bin T E k scoring normalize scale groups topk_groups group_score bias.bin out.bin */
int main(int argc, char **argv)
{
#ifdef COLIBRI_SSE2
    puts("sse2");
#else
    puts("plain C");
#endif
    if (argc != 13) return 2;
    int T = atoi(argv[2]), E = atoi(argv[3]), k = atoi(argv[4]), G = atoi(argv[8]), t, g;
    float *x = malloc(sizeof(float) * T * E), *bias = malloc(sizeof(float) * E);
    int32_t *start = malloc(sizeof(int32_t) * (G + 1)), *members = malloc(sizeof(int32_t) * E);
    FILE *f = fopen(argv[1], "rb");
    if (!f || fread(x, sizeof(float), (size_t)T * E, f) != (size_t)T * E) return 3;
    fclose(f);
    colibri_router_t r = {0};
    r.num_experts = E;
    r.top_k = k;
    r.scoring = atoi(argv[5]);
    r.normalize = atoi(argv[6]);
    r.norm_p = 1.0f;
    r.scale = (float)atof(argv[7]);
    r.num_groups = G;
    r.topk_groups = atoi(argv[9]);
    r.group_score = atoi(argv[10]);
    r.groups_in_order = 1;
    for (g = 0; g <= G; g++) /* contiguous groups, the larger first */
        start[g] = g * (E / G) + (g < E % G ? g : E % G);
    for (t = 0; t < E; t++)
        members[t] = t;
    r.group_start = start;
    r.group_members = members;
    { /* COLIBRI_TEST_WIDE=avx2|avx512: the wider kernels where this CPU runs them */
        const char *wide = getenv("COLIBRI_TEST_WIDE");
        if (wide != NULL && strcmp(wide, "avx2") == 0) {
            if (!colibri_cpu_has_avx2()) return 6;
            r.use_avx2 = 1;
        }
        if (wide != NULL && strcmp(wide, "avx512") == 0) {
            if (!colibri_cpu_has_avx512()) return 6;
            r.use_avx512 = 1;
        }
    }
    if (argv[11][0] != '-') {
        f = fopen(argv[11], "rb");
        if (!f || fread(bias, sizeof(float), E, f) != (size_t)E) return 4;
        fclose(f);
        r.bias = bias;
    }
    void *scratch = malloc(colibri_scratch_bytes(&r));
    int32_t *ids = malloc(sizeof(int32_t) * T * k);
    float *w = malloc(sizeof(float) * T * k);
    for (t = 0; t < T; t++)
        if (colibri_route_row(&r, x + (size_t)t * E, scratch, ids + t * k, w + t * k))
            return 5;
    f = fopen(argv[12], "wb");
    fwrite(ids, sizeof(int32_t), (size_t)T * k, f);
    fwrite(w, sizeof(float), (size_t)T * k, f);
    fclose(f);
    return 0;
}
"""

# the wider x86 kernels routing runs here (COLIBRI_SIMD caps them), each checked against the
# same router answers
_ROUTER = colibri.init(8, 2)
WIDE = [w for w, on in (("avx2", _ROUTER.use_avx2), ("avx512", _ROUTER.use_avx512)) if on]

CASES = [
    dict(E=64, k=2),
    dict(E=26, k=8, scoring="sigmoid", normalize=False, scale=2.0),
    dict(E=37, k=3, num_groups=4, topk_groups=2),
    dict(E=64, k=6),  # the top-k candidate bound
    dict(E=45, k=4, scoring="sqrtsoftplus", bias=True),
    dict(E=72, k=8, scoring="softmax", bias=True),
    dict(
        E=256,
        k=8,
        scoring="sigmoid",
        num_groups=8,
        topk_groups=4,
        group_score="top2_sum",
        scale=2.5,
        bias=True,
    ),
]


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("c")
    source = folder / "route.c"
    source.write_text(PROGRAM)
    built = {}
    for name, flags in (("simd", []), ("plain", ["-U__SSE2__"])):
        exe = folder / name
        subprocess.run(
            [
                compiler,
                "-O2",
                "-std=c99",
                "-ffp-contract=off",
                *flags,
                "-I",
                colibri.get_include(),
                str(source),
                "-o",
                str(exe),
                "-lm",
            ],
            check=True,
            capture_output=True,
        )
        built[name] = exe
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is not None and qemu is not None:  # aarch64's path, run under emulation
        exe = folder / "aarch64"
        subprocess.run(
            [
                cross,
                "-O2",
                "-std=c99",
                "-ffp-contract=off",
                "-static",
                "-I",
                colibri.get_include(),
                str(source),
                "-o",
                str(exe),
                "-lm",
            ],
            check=True,
            capture_output=True,
        )
        built["aarch64"] = (qemu, exe)
    return built


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c['E']}k{c['k']}")
def test_c_program_matches_the_router_bit_for_bit(programs, case, tmp_path):
    case = dict(case)
    E, k = case.pop("E"), case.pop("k")
    rng = np.random.default_rng(E * 100 + k)
    x = (rng.standard_normal((300, E)) * 3).astype(np.float32)
    x[::5] = rng.choice([-np.inf, -1.0, 0.0, 0.5, 2.0, np.inf], size=x[::5].shape)
    x[:, 0] = np.maximum(x[:, 0], 0.0)  # keep softmax defined
    x.tofile(tmp_path / "x.bin")
    bias = "-"
    if case.pop("bias", False):
        case["correction_bias"] = rng.standard_normal(E).astype(np.float32)
        case["correction_bias"].tofile(tmp_path / "b.bin")
        bias = str(tmp_path / "b.bin")
    ids, weights = colibri.init(E, k, **case).route(x)
    args = [
        str(tmp_path / "x.bin"),
        "300",
        str(E),
        str(k),
        str({"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}[case.get("scoring", "softmax")]),
        str(int(case.get("normalize", True))),
        str(case.get("scale", 1.0)),
        str(case.get("num_groups", 1)),
        str(case.get("topk_groups", 1)),
        str(int(case.get("group_score") == "top2_sum")),
        bias,
        str(tmp_path / "out.bin"),
    ]
    runs = [(name, exe, None) for name, exe in programs.items()]
    runs += [(f"simd {w}", programs["simd"], w) for w in WIDE]
    for name, exe, wide in runs:
        env = {**os.environ, "COLIBRI_TEST_WIDE": wide or ""}
        command = [str(e) for e in exe] if isinstance(exe, tuple) else [str(exe)]
        path = subprocess.run(
            [*command, *args], check=True, capture_output=True, text=True, env=env
        )
        if name in ("plain", "aarch64"):
            assert path.stdout.strip() == "plain C"
        out = np.fromfile(tmp_path / "out.bin", np.uint8)
        c_ids = out[: 300 * k * 4].view(np.int32).reshape(300, k)
        c_weights = out[300 * k * 4 :].view(np.float32).reshape(300, k)
        np.testing.assert_array_equal(c_ids, ids, err_msg=name)
        np.testing.assert_array_equal(c_weights, weights, err_msg=name)


EXP_SWEEP = r"""
#include <stdio.h>
#include "colibri/route.h"

/* colibri_exp16 (roundscale, scalef) against plain C's colibri_exp (magic-number rounding,
 * two power-of-two scalings): every float of magnitude in [2^-24, 2^8) (where the answers
 * vary), and every 61st bit pattern elsewhere. Prints the count of differing answers. */
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
        _mm512_storeu_ps(y, colibri_exp16(_mm512_castsi512_ps(bits)));
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


@pytest.mark.slow
@pytest.mark.skipif(not colibri.init(8, 2).use_avx512, reason="this CPU (or build) has no AVX-512F")
def test_exp16_gives_plain_c_bits_for_every_float_in_range(tmp_path):
    """colibri_exp16 computes n with roundscale and scales with scalef (fewer operations than
    the 4-lane code); the answers must stay plain C's, bit for bit (a full 2^32 sweep of the
    header's first version of this found no difference either)."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler")
    src = tmp_path / "exp.c"
    src.write_text(EXP_SWEEP)
    exe = tmp_path / "exp"
    subprocess.run(
        [
            compiler,
            "-O2",
            "-std=gnu11",
            "-ffp-contract=off",
            f"-I{colibri.get_include()}",
            str(src),
            "-o",
            str(exe),
            "-lm",
        ],
        check=True,
    )
    checked, differ = map(
        int, subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    )
    assert checked > 400_000_000
    assert differ == 0
