"""include/colibri/quant.h compiled as a plain C program, on every platform the toolchains
reach (native, aarch64 NEON and plain C under qemu, Windows x86-64 under wine): every path
gives the bits of colibri's own scalar path."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

import colibri
from _support.toolchains import AARCH64_CC, COMMON, HOST_CC, MINGW_CC, QEMU, WINE, settle_wine
from colibri.layer import _ffn, _quant

# the C header built for every platform the toolchains reach: the same
# header whatever the Python build, so CI runs these once, in the README job
pytestmark = pytest.mark.slow

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include "colibri/quant.h"

/* argv: in.bin out.bin path... in.bin: int32 count, then per case int32 type rows K n, the
 * weight rows' bytes (COLIBRI_MXFP4_OSS: then their scales, K / 32 bytes a row;
 * COLIBRI_Q4_0X8: rows interleaved by eight, a multiple of 8 of them) and float32
 * x [n, K]. out.bin: per case, per path, float32 y [n, rows]: the rows of x quantized to q8
 * (in colibri_q8_oss_order's order for COLIBRI_MXFP4_OSS) and multiplied. */
int main(int argc, char **argv)
{
    FILE *f = argc > 3 ? fopen(argv[1], "rb") : NULL, *out = fopen(argv[2], "wb");
    int32_t count, c, p, r, o;
    if (!f || !out || fread(&count, 4, 1, f) != 1)
        return 2;
    for (c = 0; c < count; c++) {
        int32_t h[4];
        if (fread(h, 4, 4, f) != 4)
            return 4;
        {
            const int32_t type = h[0], rows = h[1], K = h[2], n = h[3], G = K / 32;
            const size_t rb = (size_t)(K / colibri_q_block[type]) * (size_t)colibri_q_bytes[type];
            const size_t eb = type == COLIBRI_MXFP4_OSS ? (size_t)G : 0;
            uint8_t *w = malloc((rb + eb) * (size_t)rows), *e = eb ? w + rb * (size_t)rows : NULL;
            float *x = malloc(4 * (size_t)n * K), *y = malloc(4 * (size_t)n * rows);
            float *d = malloc(4 * (size_t)n * G);
            int8_t *q = malloc((size_t)n * K);
            int32_t *s = malloc(4 * (size_t)n * G);
            if (!w || !x || !y || !d || !q || !s)
                return 3;
            if (fread(w, 1, (rb + eb) * (size_t)rows, f) != (rb + eb) * (size_t)rows ||
                fread(x, 4, (size_t)n * K, f) != (size_t)n * K)
                return 4;
            for (r = 0; r < n; r++) {
                colibri_q8_row(x + (size_t)r * K, K, d + (size_t)r * G, q + (size_t)r * K,
                               s + (size_t)r * G);
                if (e)
                    colibri_q8_oss_order(q + (size_t)r * K, K);
            }
            for (p = 3; p < argc; p++) {
                for (r = 0; r < n; r += COLIBRI_Q_ROW_BLOCK) {
                    const int32_t nb = n - r < COLIBRI_Q_ROW_BLOCK ? n - r : COLIBRI_Q_ROW_BLOCK;
                    const int32_t step = type == COLIBRI_Q4_0X8 ? 8 : 1; /* its groups */
                    for (o = 0; o < rows; o += step)
                        colibri_q_dot_rows(atoi(argv[p]), type, w + (size_t)o * rb, (int64_t)rb,
                                           e ? e + (size_t)o * eb : NULL, 0, step, K,
                                           d + (size_t)r * G, q + (size_t)r * K,
                                           s + (size_t)r * G, nb, y + (size_t)r * rows + o, 1,
                                           rows);
                }
                if (fwrite(y, 4, (size_t)n * rows, out) != (size_t)n * rows)
                    return 5;
            }
            free(w), free(x), free(y), free(d), free(q), free(s);
        }
    }
    fclose(f);
    return fclose(out) == 0 ? 0 : 5;
}
"""

PATH = {name: i for i, name in enumerate(_ffn.PATHS)}
X86 = [p for p in ("avx2", "avx512") if p in _ffn.runnable_paths()]
# name: (compiler, flags, runner, the paths to run)
TOOLCHAINS = {
    "host": (HOST_CC, [], None, ["scalar", *X86] if os.uname().machine == "x86_64" else None),
    "aarch64-qemu": (AARCH64_CC, ["-static"], QEMU, ["neon", "scalar"]),
    "win64-wine": (MINGW_CC, ["-static"], [WINE] if WINE else None, ["scalar", *X86]),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(TOOLCHAINS))
def program(request, tmp_path_factory):
    name = request.param
    compiler, flags, runner, paths = TOOLCHAINS[name]
    if compiler is None or (name != "host" and runner is None) or paths is None:
        pytest.skip(f"{name}: toolchain not installed (.ci/toolchains.sh installs it)")
    env = request.getfixturevalue("wine_env") if name.endswith("wine") else {}
    folder = tmp_path_factory.mktemp(name)
    (folder / "quant.c").write_text(PROGRAM)
    exe = folder / ("quant.exe" if name.startswith("win") else "quant")
    built = subprocess.run(
        [compiler, *COMMON, *flags, "-I", colibri.get_include(), "quant.c", "-o", exe.name,
         "-lm"], cwd=folder, capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0 and "warning:" not in built.stderr, built.stderr[-4000:]
    return [*(runner or []), str(exe)], paths, env


def test_every_platform_and_path_gives_the_scalar_bits(program, tmp_path):
    command, paths, wine = program
    rng = np.random.default_rng(7)
    cases = []
    with open(tmp_path / "in.bin", "wb") as f:
        types = {name: t for t, name in _quant.TYPE_NAMES.items()}  # mxfp4_oss, q4_0x8 too
        f.write(np.array([len(types)], "<i4").tobytes())
        for qtype, t in types.items():
            oss, x8 = qtype == _quant.MXFP4_OSS, qtype == _quant.Q4_0X8
            stored = "q4_0" if x8 else qtype  # q4_0x8: q4_0's rows, interleaved
            block, nbytes = (32, 16) if oss else (_quant.BLOCK[stored], _quant.BLOCK_BYTES[stored])
            K = 512 + (96 if block == 32 else 0)  # 32-value types: a lane tail
            rows, n = 16 if x8 else 9, 6
            w = rng.integers(0, 256, (rows, K // block * nbytes)).astype(np.uint8)
            # any bytes: NaN and inf scales too (mxfp4_oss: its scales apart, 0xFF is NaN)
            e = rng.integers(0, 256, (rows, K // 32)).astype(np.uint8) if oss else None
            x = rng.standard_normal((n, K)).astype(np.float32)
            x[2, :64] *= 1e-20
            f.write(np.array([t, rows, K, n], "<i4").tobytes()
                    + (_quant.interleave(w) if x8 else w).tobytes()
                    + (e.tobytes() if oss else b"") + x.tobytes())  # fmt: skip
            cases.append((qtype, _quant.matmul(stored, w, x, path="scalar", scales=e)))
    run = [*command, "in.bin", "out.bin", *(str(PATH[p]) for p in paths)]
    done = subprocess.run(run, cwd=tmp_path, env={**os.environ, **wine}, capture_output=True,
                          timeout=300)  # fmt: skip
    if wine and (done.returncode, done.stdout, done.stderr) == (1, b"", b""):
        settle_wine(wine)  # wine gave up before the program started: once more
        done = subprocess.run(run, cwd=tmp_path, env={**os.environ, **wine},
                              capture_output=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    out, at = np.fromfile(tmp_path / "out.bin", np.float32), 0
    for qtype, want in cases:
        assert np.isfinite(want).any()
        for path in paths:
            got = out[at : at + want.size].reshape(want.shape)
            at += want.size
            same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
            assert same.all(), (qtype, path, np.argwhere(~same)[:5])
    assert at == out.size
