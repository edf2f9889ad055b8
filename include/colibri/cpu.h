/*
 * colibri's one dispatch mechanism: which SIMD path the kernels (route.h, ffn.h) take.
 *
 * The CPU's features are read once (cpuid and xgetbv on x86, so a feature the OS has not
 * enabled counts as absent; NEON is part of aarch64), and the environment variable
 * COLIBRI_SIMD caps the path (scalar | sse2 | avx2 | avx512 | avx512_bf16 | neon), for
 * tests and bug reports: a cap above what the CPU runs changes nothing, an unknown name is
 * reported by colibri_simd_env_valid() (the Python layer raises on it) and ignored here.
 *
 * Paths, lowest first (each includes the features of those below it on its architecture):
 *   scalar       plain C
 *   sse2         x86-64 baseline
 *   avx2         AVX2 + FMA + F16C (Haswell, Zen and later)
 *   avx512       AVX-512 F/BW/VL/DQ
 *   avx512_bf16  avx512 + AVX512_BF16 (native bfloat16 dot products: Cooper Lake, Zen 4)
 *   neon         aarch64 Advanced SIMD
 * Plain C99, header-only.
 */
#ifndef COLIBRI_CPU_H
#define COLIBRI_CPU_H

#include <stdlib.h>
#include <string.h>

enum {
    COLIBRI_PATH_SCALAR = 0,
    COLIBRI_PATH_SSE2 = 1,
    COLIBRI_PATH_AVX2 = 2,
    COLIBRI_PATH_AVX512 = 3,
    COLIBRI_PATH_AVX512_BF16 = 4,
    COLIBRI_PATH_NEON = 5,
    COLIBRI_PATH_COUNT = 6
};

static const char *const colibri_path_names[COLIBRI_PATH_COUNT] = {"scalar", "sse2",        "avx2",
                                                                   "avx512", "avx512_bf16", "neon"};

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define COLIBRI_X86_GNU 1
#elif defined(_M_X64) && defined(_MSC_VER)
#include <intrin.h>
#define COLIBRI_X86_MSVC 1
#endif

#if defined(COLIBRI_X86_GNU) || defined(COLIBRI_X86_MSVC)
static inline void colibri_cpuid(unsigned leaf, unsigned sub, unsigned r[4])
{
#ifdef COLIBRI_X86_GNU
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
#else
    int v[4];
    __cpuidex(v, (int)leaf, (int)sub);
    r[0] = (unsigned)v[0], r[1] = (unsigned)v[1], r[2] = (unsigned)v[2], r[3] = (unsigned)v[3];
#endif
}

/* The register state the OS saves (XCR0); call only when OSXSAVE is set. */
static inline unsigned long long colibri_xgetbv0(void)
{
#ifdef COLIBRI_X86_GNU
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
#else
    return _xgetbv(0);
#endif
}
#endif

/* The best path this CPU (and OS) runs, read from the hardware (not cached). */
static inline int colibri_cpu_detect(void)
{
#if defined(COLIBRI_X86_GNU) || defined(COLIBRI_X86_MSVC)
    unsigned r[4], max_leaf;
    int path = COLIBRI_PATH_SSE2; /* x86-64 baseline */
    colibri_cpuid(0, 0, r);
    max_leaf = r[0];
    colibri_cpuid(1, 0, r);
    {
        const unsigned ecx1 = r[2];
        const int fma = (ecx1 >> 12) & 1, osxsave = (ecx1 >> 27) & 1;
        const int avx = (ecx1 >> 28) & 1, f16c = (ecx1 >> 29) & 1;
        unsigned long long xcr0;
        unsigned ebx7, eax7_1 = 0;
        if (!osxsave || !avx || max_leaf < 7)
            return path;
        xcr0 = colibri_xgetbv0();
        if ((xcr0 & 0x6) != 0x6) /* XMM and YMM state */
            return path;
        colibri_cpuid(7, 0, r);
        ebx7 = r[1];
        if (r[0] >= 1) {
            colibri_cpuid(7, 1, r);
            eax7_1 = r[0];
        }
        if (!((ebx7 >> 5) & 1) || !fma || !f16c) /* AVX2 */
            return path;
        path = COLIBRI_PATH_AVX2;
        /* F (16), DQ (17), BW (30), VL (31); opmask, ZMM_Hi256 and Hi16_ZMM state */
        if ((ebx7 & 0xc0030000u) != 0xc0030000u || (xcr0 & 0xe0) != 0xe0)
            return path;
        path = COLIBRI_PATH_AVX512;
        if ((eax7_1 >> 5) & 1) /* AVX512_BF16 */
            path = COLIBRI_PATH_AVX512_BF16;
    }
    return path;
#elif defined(__aarch64__) || defined(_M_ARM64)
    return COLIBRI_PATH_NEON;
#else
    return COLIBRI_PATH_SCALAR;
#endif
}

/* Bit `bit` of cpuid leaf 7 (subleaf 0) register `reg` (0 eax, 1 ebx, 2 ecx, 3 edx) on a CPU
 * of the AVX-512 path (its state enabled by the OS); 0 on any other. */
static inline int colibri_cpu_avx512_feature(int reg, int bit)
{
#if defined(COLIBRI_X86_GNU) || defined(COLIBRI_X86_MSVC)
    unsigned r[4];
    if (colibri_cpu_detect() < COLIBRI_PATH_AVX512)
        return 0;
    colibri_cpuid(7, 0, r);
    return (int)((r[reg] >> bit) & 1);
#else
    (void)reg;
    (void)bit;
    return 0;
#endif
}

/* Whether the CPU has AVX512_VNNI (int8 dot products; on the avx512 path, quant.h uses them). */
static inline int colibri_cpu_has_avx512vnni(void)
{
    return colibri_cpu_avx512_feature(2, 11);
}

/* Whether the CPU has AVX512_FP16 (float16 arithmetic: Sapphire Rapids on), with which
 * torch's oneDNN GEMMs compute float16 natively; colibri's own kernels do not use it. */
static inline int colibri_cpu_has_avx512fp16(void)
{
    return colibri_cpu_avx512_feature(3, 23);
}

/* The path COLIBRI_SIMD names (-1: unset or empty, -2: not a path name). */
static inline int colibri_simd_env(void)
{
    const char *v = getenv("COLIBRI_SIMD");
    int i;
    if (v == NULL || *v == '\0')
        return -1;
    for (i = 0; i < COLIBRI_PATH_COUNT; i++)
        if (strcmp(v, colibri_path_names[i]) == 0)
            return i;
    return -2;
}

static inline int colibri_simd_env_valid(void)
{
    return colibri_simd_env() != -2;
}

/* The detected path capped at `cap`: the highest path on this architecture <= cap. */
static inline int colibri_path_capped(int detected, int cap)
{
    if (cap < 0 || cap >= detected)
        return detected;
    if (detected == COLIBRI_PATH_NEON) /* aarch64: neon or scalar */
        return COLIBRI_PATH_SCALAR;
    return cap == COLIBRI_PATH_NEON ? detected : cap;
}

/* The path the kernels take: detected once per module, capped by COLIBRI_SIMD. */
/* colibri_cpu_detect's answer, computed once: cpuid traps into the hypervisor in VMs
 * (~25 us a call measured in one), and explicit paths are checked on every kernel call. */
static inline int colibri_cpu_path(void)
{
    static int path = -1;
    if (path < 0) /* racing first calls compute the same value */
        path = colibri_cpu_detect();
    return path;
}

static inline int colibri_simd_path(void)
{
    static int path = -1;
    if (path < 0) /* racing first calls compute the same value */
        path = colibri_path_capped(colibri_cpu_path(), colibri_simd_env());
    return path;
}

/* Whether the CPU runs each 512-bit vector operation as two 256-bit halves: AMD family 0x19
 * with AVX-512 (Zen 4; Zen 3, the same family, has none). The memory-bound kernels (half
 * and block-quantized weights) ran 10-40% slower on 512-bit vectors there than on 256-bit
 * ones (bench/README.md), so their default path is avx2 on such a CPU. Computed once. */
static inline int colibri_cpu_halves512(void)
{
    static int halves = -1;
#if defined(COLIBRI_X86_GNU) || defined(COLIBRI_X86_MSVC)
    if (halves < 0) { /* racing first calls compute the same value */
        unsigned r[4], family;
        colibri_cpuid(0, 0, r); /* vendor: ebx edx ecx */
        if (r[1] != 0x68747541u || r[3] != 0x69746e65u || r[2] != 0x444d4163u) { /* AMD */
            halves = 0;
            return halves;
        }
        colibri_cpuid(1, 0, r);
        family = (r[0] >> 8) & 0xf;
        if (family == 0xf)
            family += (r[0] >> 20) & 0xff;
        halves = family == 0x19 && colibri_cpu_path() >= COLIBRI_PATH_AVX512;
    }
#else
    halves = 0;
#endif
    return halves;
}

/* Whether `path` runs on this CPU (what tests iterate over). */
static inline int colibri_path_runs(int path)
{
    int detected = colibri_cpu_path();
    if (path == COLIBRI_PATH_SCALAR)
        return 1;
    if (detected == COLIBRI_PATH_NEON || path == COLIBRI_PATH_NEON)
        return path == detected;
    return path >= 0 && path <= detected;
}

#endif /* COLIBRI_CPU_H */
