"""include/colibri/route.h built as C for every platform this machine can run, under every
routing option, against colibri's own router bit for bit.

Builds: the host compiler with its SIMD path and as plain C (``-U__SSE2__``); aarch64 with a
cross compiler, run under qemu-user, once on its NEON path and once with ``COLIBRI_SIMD=scalar``
(plain C, chosen at run time through cpu.h); Windows x86-64 with mingw-w64, run under wine. A
build whose toolchain is missing is skipped (``.ci/toolchains.sh`` installs them for CI).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

import colibri

PROGRAM = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "colibri/route.h"

/* case.bin: int32 T E k scoring normalize bias_on_logits G topk_groups group_score
 * groups_in_order has_bias has_expert_scale; float32 norm_p norm_eps scale; float32 logits
 * [T, E]; float32 bias [E] if any; float32 expert_scale [E] if any; int32 group_start [G + 1];
 * int32 group_members [E].  out.bin: int32 status [T], int32 ids [T, k], float32 w [T, k]. */
static void *take(FILE *f, size_t size, size_t n)
{
    void *p = malloc(size * (n ? n : 1));
    if (!p || fread(p, size, n, f) != n)
        exit(3);
    return p;
}

int main(int argc, char **argv)
{
#if defined(COLIBRI_NEON)
    puts(colibri_neon_on() ? "neon" : "plain C");
#elif defined(COLIBRI_SSE2)
    puts("sse2");
#else
    puts("plain C");
#endif
    if (argc != 3)
        return 2;
    FILE *f = fopen(argv[1], "rb");
    if (!f)
        return 4;
    int32_t *h = take(f, sizeof(int32_t), 12);
    float *fl = take(f, sizeof(float), 3);
    int32_t T = h[0], E = h[1], k = h[2], G = h[6], t;
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
    float *x = take(f, sizeof(float), (size_t)T * E);
    if (h[10])
        r.bias = take(f, sizeof(float), (size_t)E);
    if (h[11])
        r.expert_scale = take(f, sizeof(float), (size_t)E);
    r.group_start = take(f, sizeof(int32_t), (size_t)G + 1);
    r.group_members = take(f, sizeof(int32_t), (size_t)E);
    fclose(f);
    void *scratch = malloc(colibri_scratch_bytes(&r));
    int32_t *status = calloc((size_t)T, sizeof(int32_t));
    int32_t *ids = calloc((size_t)T * k, sizeof(int32_t));
    float *w = calloc((size_t)T * k, sizeof(float));
    for (t = 0; t < T; t++)
        status[t] = colibri_route_row(&r, x + (size_t)t * E, scratch, ids + (size_t)t * k,
                                      w + (size_t)t * k);
    f = fopen(argv[2], "wb");
    if (!f)
        return 5;
    fwrite(status, sizeof(int32_t), (size_t)T, f);
    fwrite(ids, sizeof(int32_t), (size_t)T * k, f);
    fwrite(w, sizeof(float), (size_t)T * k, f);
    fclose(f);
    return 0;
}
"""

WINE = shutil.which("wine64") or (
    "/usr/lib/wine/wine64" if os.path.exists("/usr/lib/wine/wine64") else None
)
HOST_CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
COMMON = ["-O2", "-std=c11", "-ffp-contract=off", "-Wall"]

AARCH64_CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = [shutil.which("qemu-aarch64")] if shutil.which("qemu-aarch64") else None

# name: (compiler, extra flags, runner prefix or None for native, environment, the path the
# program prints)
TOOLCHAINS = {
    "host": (HOST_CC, [], None, {}, "sse2"),
    "plain-c": (HOST_CC, ["-U__SSE2__"], None, {}, "plain C"),
    "aarch64-neon-qemu": (AARCH64_CC, ["-static"], QEMU, {}, "neon"),
    "aarch64-plain-qemu": (AARCH64_CC, ["-static"], QEMU, {"COLIBRI_SIMD": "scalar"}, "plain C"),
    "win64-wine": (
        shutil.which("x86_64-w64-mingw32-gcc"), ["-static"], [WINE] if WINE else None, {}, "sse2",
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
        "sigmoid-k8": dict(E=26, k=8, scoring="sigmoid", normalize=False, scale=2.0),
        "softmax-bias": dict(E=40, k=4, correction_bias=bias[:40], normalize=False),
        "sqrtsoftplus-logit-bias-p2": dict(
            E=48, k=6, scoring="sqrtsoftplus", correction_bias=bias[:48], bias_on="logits",
            norm_p=2.0, normalize_eps=1e-6,
        ),
        "groups-max": dict(E=26, k=2, num_groups=4),
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
LIBM_CASES = {"sqrtsoftplus-logit-bias-p2"}
GLIBC = {"host", "plain-c", "aarch64-neon-qemu", "aarch64-plain-qemu"}


def _logits(rng, T, E):
    x = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    x[::7] = rng.choice([-np.inf, -1.0, 0.0, 0.5, 2.0, np.inf], size=x[::7].shape)
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


@pytest.fixture(scope="module", params=list(TOOLCHAINS))
def program(request, tmp_path_factory):
    name = request.param
    compiler, flags, runner, env, path = TOOLCHAINS[name]
    if compiler is None or (name.endswith(("qemu", "wine")) and runner is None):
        pytest.skip(f"{name}: toolchain not installed (.ci/toolchains.sh installs it)")
    folder = tmp_path_factory.mktemp(name)
    (folder / "route.c").write_text(PROGRAM)
    exe = folder / ("route.exe" if name.startswith("win") else "route")
    subprocess.run(
        [compiler, *COMMON, *flags, "-I", colibri.get_include(), "route.c", "-o", exe.name, "-lm"],
        cwd=folder, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return name, [*(runner or []), str(exe)], env, path


@pytest.mark.parametrize("case", list(CASES))
def test_route_h_matches_the_router_bit_for_bit(program, case, tmp_path):
    name, command, program_env, path = program
    options = dict(CASES[case])
    E, k = options.pop("E"), options.pop("k")
    config = colibri.Config(num_experts=E, top_k=k, **options)
    rng = np.random.default_rng(E * 1000 + k)
    x = _logits(rng, 200, E)
    ids, weights = colibri.init(config=config).route(x)
    _write_case(tmp_path / "case.bin", x, config)
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_SIMD"}
    env.update(WINEDEBUG="-all", **program_env)
    done = subprocess.run(
        [*command, "case.bin", "out.bin"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (name, done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == path, done.stdout
    out = np.fromfile(tmp_path / "out.bin", np.uint8)
    T = len(x)
    status = out[: T * 4].view("<i4")
    c_ids = out[T * 4 : T * 4 * (1 + k)].view("<i4").reshape(T, k)
    c_weights = out[T * 4 * (1 + k) :].view("<f4").reshape(T, k)
    assert (status == 0).all(), f"{name}: rows {np.flatnonzero(status)} failed"
    np.testing.assert_array_equal(c_ids, ids, err_msg=f"{name} {case}")
    if case in LIBM_CASES and name not in GLIBC:
        np.testing.assert_array_max_ulp(c_weights, weights, maxulp=4)
    else:
        np.testing.assert_array_equal(c_weights.view("<i4"), weights.view(np.int32), err_msg=name)
