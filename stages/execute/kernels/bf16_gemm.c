/* bf16-weight GEMM for CPU linears: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W stored as bf16,
 * x and y fp32, fp32 accumulation. Built and loaded by stages/execute/native.py; used by
 * stages/execute/bf16.py's BF16Linear.
 *
 * The weight is packed once, at load, into panels of NR = 16 output columns, each panel
 * [K2 / 2][16][2] bf16 (K2: K rounded up to even, the pad zero): per pair of k, 16 columns'
 * (w[j, k], w[j, k + 1]), one 64-byte line. That is the operand layout of AVX512-BF16's
 * VDPBF16PS, which adds to each fp32 lane j the two products a[2j] * b[2j] + a[2j+1] * b[2j+1]
 * (products of two bf16 are exact in fp32).
 *
 * The activations are rounded to bf16 first (round to nearest even, NaN kept quiet), as torch
 * rounds a tensor to bf16 and as llama.cpp's BF16 vec_dot converts the activation row
 * (ggml-cpu: ggml_cpu_fp32_to_bf16 before ggml_vec_dot_bf16), then:
 *   - where the compiler targets AVX512-BF16 (``-march=native`` on a CPU that has it) and
 *     ACTORLINE_BF16_PORTABLE is not defined: one VDPBF16PS per panel line and row;
 *   - elsewhere (AVX2, AVX-512 without BF16, NEON): the portable path keeps the rounded
 *     activations as fp32, widens each bf16 weight to fp32 in registers (a 16-bit shift) and
 *     FMAs, so the two paths give the same sums up to their order.
 * The register blocking follows kernels/packed_gemm.c, sized per vector unit (see MR below):
 * VDPBF16PS MR rows x two neighbouring panels in accumulators, the portable path MR rows x one
 * panel; the panels split over threads, x cut into row blocks that stay in L2; at fewer than 4
 * rows a second accumulator set takes odd k pairs. A decode step reads every weight once: bf16
 * halves the bytes of fp32's kernel, and at many rows (prefill) the portable path does the fp32
 * kernel's FMAs plus two integer ops per 16 weights, which the panel's reuse across rows hides.
 * tests/stages/execute/test_bf16.py checks both paths against torch on bf16-rounded operands. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(ACTORLINE_BF16_PORTABLE)
#include <immintrin.h>
#define DPBF16 1
#else
#define DPBF16 0
#endif

#define NR 16
#define PREFETCH_LINES 32

#if DPBF16
#define MR 12
#define LANES 16
/* A k pair of an activation row: two bf16 in one word (x[2p] low), VDPBF16PS's operand. */
typedef uint32_t xpair_t;
#else
/* The widen-and-FMA path, sized per vector unit as kernels/packed_gemm.c (one panel per
 * micro-tile, MR rows x VPR vectors of accumulators, plus a second set at up to ODD_ROWS rows
 * where the registers hold both; one half line's VPR widened vectors and a broadcast beside):
 *   AVX-512 (32 zmm):   16-float vectors, MR = 14 (14 accumulators);
 *   AVX2/AVX (16 ymm):  two 8-float vectors, MR = 6 (12 accumulators + 3: BLIS's Haswell 6x16);
 *   NEON (32 q):        four 4-float vectors, MR = 6 (24 accumulators);
 *   other (SSE2, 16):   four 4-float vectors, MR = 2 (8 accumulators).
 * GCC splits a 16-float generic vector into two 256-bit halves on AVX2, so the earlier 16-float
 * blocking (12 rows x two panels: 48 ymm accumulators) spilled on every FMA there. */
#if defined(__AVX512F__)
#define LANES 16
#define MR 14
#define ODD_ROWS 3
#elif defined(__AVX__)
#define LANES 8
#define MR 6
#define ODD_ROWS 2 /* 3 rows' two sets (12) + 2 widened + broadcast + mask spilled */
#elif defined(__ARM_NEON) || defined(__aarch64__)
#define LANES 4
#define MR 6
#define ODD_ROWS 3
#else
#define LANES 4
#define MR 2
#define ODD_ROWS 1
#endif
#define VPR (NR / LANES) /* vectors per 16 columns */
/* A k pair of an activation row: the two values rounded to bf16, held as fp32 (x[2p] first),
 * so the micro-kernel broadcasts them straight from memory. */
typedef uint64_t xpair_t;
typedef float vw __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef uint32_t vwu __attribute__((vector_size(LANES * sizeof(uint32_t)), aligned(4)));
#endif

typedef float vf __attribute__((vector_size(NR * sizeof(float)), aligned(4)));

/* 1 where this build multiplies with VDPBF16PS, 0 on the portable path. */
int actorline_bf16_native(void) { return DPBF16; }
/* The floats per vector and rows per micro-tile this build chose (for tests and benchmarks). */
int actorline_bf16_lanes(void) { return LANES; }
int actorline_bf16_rows(void) { return MR; }

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* A row block's pairs (xpair_t: k pair p of row i at out[i * kp + p]), rounded to bf16. */
static void round_rows(const float *x, int64_t rows, int64_t k, int64_t kp, xpair_t *out) {
    for (int64_t i = 0; i < rows; ++i) {
        const float *row = x + i * k;
        xpair_t *dst = out + i * kp;
#if !DPBF16
        float *wide = (float *)dst;
#endif
        for (int64_t p = 0; p < kp; ++p) {
            const uint32_t lo = to_bf16(row[2 * p]);
            const uint32_t hi = 2 * p + 1 < k ? to_bf16(row[2 * p + 1]) : 0u;
#if DPBF16
            dst[p] = lo | (hi << 16);
#else
            const uint32_t bits[2] = {lo << 16, hi << 16};
            memcpy(wide + 2 * p, bits, sizeof bits);
#endif
        }
    }
}

#if DPBF16
typedef __m512 acc_t;
static inline __attribute__((always_inline)) acc_t madd(acc_t acc, uint32_t pair, const uint16_t *line) {
    const __m512i a = _mm512_set1_epi32((int)pair);
    const __m512i b = _mm512_loadu_si512((const void *)line);
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
static inline acc_t acc_load(const float *bias) { return bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps(); }
static inline acc_t acc_add(acc_t a, acc_t b) { return _mm512_add_ps(a, b); }
static inline void acc_store(float *y, acc_t a) { _mm512_storeu_ps(y, a); }
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }

/* ``mr`` rows of pairs ``xp`` (row stride kp words) times panel p0 (bias b0, output y0) and,
 * when np is 2, panel p1 (bias b1, output y1); outputs' rows ldy apart. */
static inline __attribute__((always_inline)) void
micro(const xpair_t *restrict xp, int64_t kp, const uint16_t *restrict p0,
      const uint16_t *restrict p1, const float *restrict b0, const float *restrict b1,
      float *restrict y0, float *restrict y1, int64_t ldy, const int mr, const int np) {
    acc_t acc0[MR], acc1[MR];
    const acc_t s0 = acc_load(b0), s1 = np > 1 ? acc_load(b1) : acc_zero();
    for (int i = 0; i < mr; ++i) {
        acc0[i] = s0;
        acc1[i] = s1;
    }
    int64_t p = 0;
    if (mr < 4) {
        /* Few rows: a second accumulator set for odd pairs doubles the independent chains. */
        acc_t odd0[MR], odd1[MR];
        for (int i = 0; i < mr; ++i) odd0[i] = odd1[i] = acc_zero();
        for (; p + 2 <= kp; p += 2) {
            const uint16_t *l0 = p0 + p * 2 * NR, *l1 = p1 + p * 2 * NR;
            __builtin_prefetch(l0 + PREFETCH_LINES * 2 * NR, 0, 2);
            __builtin_prefetch(l0 + (PREFETCH_LINES + 1) * 2 * NR, 0, 2);
            if (np > 1) {
                __builtin_prefetch(l1 + PREFETCH_LINES * 2 * NR, 0, 2);
                __builtin_prefetch(l1 + (PREFETCH_LINES + 1) * 2 * NR, 0, 2);
            }
            for (int i = 0; i < mr; ++i) {
                const uint32_t a = xp[i * kp + p], b = xp[i * kp + p + 1];
                acc0[i] = madd(acc0[i], a, l0);
                odd0[i] = madd(odd0[i], b, l0 + 2 * NR);
                if (np > 1) {
                    acc1[i] = madd(acc1[i], a, l1);
                    odd1[i] = madd(odd1[i], b, l1 + 2 * NR);
                }
            }
        }
        for (int i = 0; i < mr; ++i) {
            acc0[i] = acc_add(acc0[i], odd0[i]);
            acc1[i] = acc_add(acc1[i], odd1[i]);
        }
    }
    for (; p < kp; ++p) {
        const uint16_t *l0 = p0 + p * 2 * NR, *l1 = p1 + p * 2 * NR;
        __builtin_prefetch(l0 + PREFETCH_LINES * 2 * NR, 0, 2);
        if (np > 1) __builtin_prefetch(l1 + PREFETCH_LINES * 2 * NR, 0, 2);
        for (int i = 0; i < mr; ++i) {
            const uint32_t a = xp[i * kp + p];
            acc0[i] = madd(acc0[i], a, l0);
            if (np > 1) acc1[i] = madd(acc1[i], a, l1);
        }
    }
    for (int i = 0; i < mr; ++i) {
        acc_store(y0 + i * ldy, acc0[i]);
        if (np > 1) acc_store(y1 + i * ldy, acc1[i]);
    }
}
#else
/* ``mr`` rows of widened pairs ``xp`` (row stride kp pairs) times one panel (bias, output y,
 * rows ldy apart). Per line (k pair p, 16 columns) and vector v of it: the words' low halves
 * shifted up are the fp32 w[j, 2p] (a bf16 is the high half of its fp32), the words with their
 * low halves cleared the fp32 w[j, 2p + 1]; each row adds x[2p] * even + x[2p + 1] * odd. As
 * llama.cpp's AVX2 BF16 dot product widens (ggml-cpu/vec.cpp ggml_vec_dot_bf16: a 16-bit shift
 * of each bf16, FMA in fp32), here with the activations rounded to bf16 as the VDPBF16PS path
 * rounds them, so the two paths give the same sums up to their order. */
/* Row i's widened pair p times one line (its even-k and odd-k halves widened in turn), into
 * acc: BLIS's Haswell order (one broadcast feeds a row's VPR vectors), so the accumulators, one
 * half's VPR widened vectors and a broadcast are what is live (AVX2: 12 + 2 + 1 of 16 ymm). The
 * empty asm hides that ``again`` is ``line``, so the odd half reloads its words (from L1) rather
 * than keep the line's raw words live across the even half (two more registers: a spill). */
#define WIDEN_LINE(acc, line, p)                                                               \
    do {                                                                                       \
        vw half[VPR];                                                                          \
        for (int v = 0; v < VPR; ++v) half[v] = (vw)(*(const vwu *)((line) + v * LANES) << 16); \
        for (int i = 0; i < mr; ++i) {                                                         \
            const float even = x[2 * (i * kp + (p))];                                          \
            for (int v = 0; v < VPR; ++v) acc[i][v] += even * half[v];                         \
        }                                                                                      \
        const uint32_t *again = (line);                                                        \
        __asm__("" : "+r"(again));                                                             \
        for (int v = 0; v < VPR; ++v) half[v] = (vw)(*(const vwu *)(again + v * LANES) & 0xffff0000u); \
        for (int i = 0; i < mr; ++i) {                                                         \
            const float odd_k = x[2 * (i * kp + (p)) + 1];                                     \
            for (int v = 0; v < VPR; ++v) acc[i][v] += odd_k * half[v];                        \
        }                                                                                      \
    } while (0)

static inline __attribute__((always_inline)) void
micro1(const xpair_t *restrict xp, int64_t kp, const uint16_t *restrict panel,
       const float *restrict bias, float *restrict y, int64_t ldy, const int mr) {
    const float *restrict x = (const float *)xp; /* row i, pair p: x[2 * (i * kp + p)], + 1 */
    const uint32_t *restrict words = (const uint32_t *)panel; /* line p: words[p * NR + j] */
    vw acc[MR][VPR];
    for (int v = 0; v < VPR; ++v) {
        const vw start = bias ? *(const vw *)(bias + v * LANES) : (vw){0};
        for (int i = 0; i < mr; ++i) acc[i][v] = start;
    }
    int64_t p = 0;
    if (mr <= ODD_ROWS) {
        /* Few rows: a second accumulator set for odd pairs doubles the independent chains. */
        vw odd[MR][VPR];
        for (int i = 0; i < mr; ++i)
            for (int v = 0; v < VPR; ++v) odd[i][v] = (vw){0};
        for (; p + 2 <= kp; p += 2) {
            const uint32_t *line = words + p * NR;
            __builtin_prefetch(line + PREFETCH_LINES * NR, 0, 2);
            __builtin_prefetch(line + (PREFETCH_LINES + 1) * NR, 0, 2);
            WIDEN_LINE(acc, line, p);
            WIDEN_LINE(odd, line + NR, p + 1);
        }
        for (int i = 0; i < mr; ++i)
            for (int v = 0; v < VPR; ++v) acc[i][v] += odd[i][v];
    }
    for (; p < kp; ++p) {
        const uint32_t *line = words + p * NR;
        __builtin_prefetch(line + PREFETCH_LINES * NR, 0, 2);
        WIDEN_LINE(acc, line, p);
    }
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < VPR; ++v) *(vw *)(y + i * ldy + v * LANES) = acc[i][v];
}
/* ``mr`` rows of widened pairs times a panel already widened to fp32 (``wide``: [2 kp][16], row
 * kk holding w[j, kk]): kernels/packed_gemm.c's micro-kernel, the panel read from L1/L2. */
static inline __attribute__((always_inline)) void
micro_wide(const xpair_t *restrict xp, int64_t kp, const float *restrict wide,
           const float *restrict bias, float *restrict y, int64_t ldy, const int mr) {
    const float *restrict x = (const float *)xp; /* row i, k kk: x[i * 2 kp + kk] */
    vw acc[MR][VPR];
    for (int v = 0; v < VPR; ++v) {
        const vw start = bias ? *(const vw *)(bias + v * LANES) : (vw){0};
        for (int i = 0; i < mr; ++i) acc[i][v] = start;
    }
    for (int64_t kk = 0; kk < 2 * kp; ++kk) {
        vw w[VPR];
        for (int v = 0; v < VPR; ++v) w[v] = *(const vw *)(wide + kk * NR + v * LANES);
        for (int i = 0; i < mr; ++i) {
            const float xv = x[i * 2 * kp + kk];
            for (int v = 0; v < VPR; ++v) acc[i][v] += xv * w[v];
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < VPR; ++v) *(vw *)(y + i * ldy + v * LANES) = acc[i][v];
}

/* A panel's kp lines widened to fp32 rows [2 kp][16] (w[j, 2p], then w[j, 2p + 1]). */
static void widen_panel(const uint16_t *panel, int64_t kp, float *wide) {
    const uint32_t *words = (const uint32_t *)panel;
    for (int64_t p = 0; p < kp; ++p)
        for (int v = 0; v < VPR; ++v) {
            const vwu w = *(const vwu *)(words + p * NR + v * LANES);
            *(vw *)(wide + 2 * p * NR + v * LANES) = (vw)(w << 16);
            *(vw *)(wide + (2 * p + 1) * NR + v * LANES) = (vw)(w & 0xffff0000u);
        }
}

/* As the VDPBF16PS micro's arguments: panel p0, then p1 where np is 2, one at a time. */
static inline __attribute__((always_inline)) void
micro(const xpair_t *restrict xp, int64_t kp, const uint16_t *restrict p0,
      const uint16_t *restrict p1, const float *restrict b0, const float *restrict b1,
      float *restrict y0, float *restrict y1, int64_t ldy, const int mr, const int np) {
    micro1(xp, kp, p0, b0, y0, ldy, mr);
    if (np > 1) micro1(xp, kp, p1, b1, y1, ldy, mr);
}

static inline __attribute__((always_inline)) void
micro_w(const xpair_t *restrict xp, int64_t kp, const float *restrict w0,
        const float *restrict w1, const float *restrict b0, const float *restrict b1,
        float *restrict y0, float *restrict y1, int64_t ldy, const int mr, const int np) {
    micro_wide(xp, kp, w0, b0, y0, ldy, mr);
    if (np > 1) micro_wide(xp, kp, w1, b1, y1, ldy, mr);
}

/* From this many rows of a row block, its panels are widened to fp32 once (into a buffer of the
 * thread's) and the fp32 micro-kernel multiplies them (measured: docs/performance.md §12.3);
 * below, each micro-tile widens the lines it multiplies in registers. */
#ifndef WIDE_ROWS
#define WIDE_ROWS 20
#endif

/* A thread's buffer for widened panels, at least floats floats, kept between calls (NULL: out
 * of memory); apart from thread_scratch, which the SiLU epilogue holds across its GEMM calls. */
static float *thread_wide(size_t floats) {
    static __thread float *buffer = NULL;
    static __thread size_t capacity = 0;
    if (floats > capacity) {
        float *bigger = (float *)realloc(buffer, sizeof(float) * floats);
        if (!bigger) return NULL;
        buffer = bigger;
        capacity = floats;
    }
    return buffer;
}
#endif

/* One micro-kernel call per case: each gets mr as a constant and its own register allocation
 * (cases from MR on are never taken). */
#define TAIL(r)                                                                                \
    case r:                                                                                    \
        micro(xp + i * kp, kp, p0, p1, b0, b1, y0 + i * ldy, y1 + i * ldy, ldy,                \
              (r) < MR ? (r) : 1, np);                                                         \
        break;

#if !DPBF16
#define TAIL_W(r)                                                                              \
    case r:                                                                                    \
        micro_w(xp + i * kp, kp, w0, w1, b0, b1, y0 + i * ldy, y1 + i * ldy, ldy,              \
                (r) < MR ? (r) : 1, np);                                                       \
        break;

/* unit_rows with the unit's panels widened first; 0, or 1 when out of memory. */
static int wide_rows(const xpair_t *xp, int64_t rows, int64_t kp, const uint16_t *p0,
                     const uint16_t *p1, const float *b0, const float *b1, float *y0, float *y1,
                     int64_t ldy, const int np) {
    float *wide = thread_wide((size_t)(np * 2 * kp * NR));
    if (!wide) return 1;
    const float *w0 = wide, *w1 = wide + 2 * kp * NR;
    widen_panel(p0, kp, wide);
    if (np > 1) widen_panel(p1, kp, wide + 2 * kp * NR);
    int64_t i = 0;
    for (; i + MR <= rows; i += MR)
        micro_w(xp + i * kp, kp, w0, w1, b0, b1, y0 + i * ldy, y1 + i * ldy, ldy, MR, np);
    switch ((int)(rows - i)) {
        TAIL_W(1) TAIL_W(2) TAIL_W(3) TAIL_W(4) TAIL_W(5) TAIL_W(6) TAIL_W(7)
        TAIL_W(8) TAIL_W(9) TAIL_W(10) TAIL_W(11) TAIL_W(12) TAIL_W(13)
    default: break;
    }
    return 0;
}
#endif

/* All ``rows`` of a row block through one unit (panel p0, and p1 when ``np`` is 2). */
static inline __attribute__((always_inline)) void
unit_rows(const xpair_t *xp, int64_t rows, int64_t kp, const uint16_t *p0, const uint16_t *p1,
          const float *b0, const float *b1, float *y0, float *y1, int64_t ldy, const int np) {
#if !DPBF16
    if (rows >= WIDE_ROWS && wide_rows(xp, rows, kp, p0, p1, b0, b1, y0, y1, ldy, np) == 0)
        return; /* (out of memory: the in-register path, which needs none) */
#endif
    int64_t i = 0;
    for (; i + MR <= rows; i += MR)
        micro(xp + i * kp, kp, p0, p1, b0, b1, y0 + i * ldy, y1 + i * ldy, ldy, MR, np);
    switch ((int)(rows - i)) {
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
        TAIL(8) TAIL(9) TAIL(10) TAIL(11) TAIL(12) TAIL(13)
    default: break;
    }
}

/* Two panels of a row block: p0's columns into y0, p1's into y1 (neighbours or not). */
static void two_rows(const xpair_t *xp, int64_t rows, int64_t kp, const uint16_t *p0,
                     const uint16_t *p1, const float *b0, const float *b1, float *y0, float *y1,
                     int64_t ldy) {
    unit_rows(xp, rows, kp, p0, p1, b0, b1, y0, y1, ldy, 2);
}

static void pair_rows(const xpair_t *xp, int64_t rows, int64_t kp, const uint16_t *p0,
                      const float *bias, float *y, int64_t ldy) {
    two_rows(xp, rows, kp, p0, p0 + kp * 2 * NR, bias, bias ? bias + NR : 0, y, y + NR, ldy);
}

static void single_rows(const xpair_t *xp, int64_t rows, int64_t kp, const uint16_t *p0,
                        const float *bias, float *y, int64_t ldy) {
    unit_rows(xp, rows, kp, p0, p0, bias, 0, y, y, ldy, 1);
}

/* Rows per block, so that a block of pairs stays in L2 while the panels pass. */
static inline int64_t row_block(int64_t kp) {
    int64_t mb = 256 * 1024 / (int64_t)sizeof(xpair_t) / kp / MR * MR;
    return mb < 4 * MR ? 4 * MR : mb;
}

/* x: [M, K] fp32 contiguous; packed: [N / 16, ceil(K / 2), 16, 2] bf16 (see above); bias: [N]
 * or NULL; y: [M, N]. Returns 0; 1 when out of memory; 2 when N is not a multiple of 16. */
int actorline_bf16_gemm_f32(const float *x, int64_t m, int64_t k, const uint16_t *packed,
                            const float *bias, int64_t n, float *y, int num_threads) {
    if (n % NR != 0 || k < 1 || m < 0) return 2;
    if (m == 0) return 0;
    const int64_t kp = (k + 1) / 2;
    const int64_t panels = n / NR, pairs = panels / 2, units = pairs + (panels - 2 * pairs);
    xpair_t *xp = (xpair_t *)malloc((size_t)(m * kp) * sizeof(xpair_t));
    if (!xp) return 1;
    const int64_t mb = row_block(kp);
    if (num_threads < 1) num_threads = 1;
    const int threads = num_threads > units ? (int)units : num_threads;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; ++i) round_rows(x + i * k, 1, k, kp, xp + i * kp);
        for (int64_t m0 = 0; m0 < m; m0 += mb) {
            const int64_t rows = m - m0 < mb ? m - m0 : mb;
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < units; ++u) {
                const int64_t p = u < pairs ? 2 * u : 2 * pairs + (u - pairs);
                const uint16_t *panel = packed + p * kp * 2 * NR;
                const float *b = bias ? bias + p * NR : 0;
                float *yb = y + m0 * n + p * NR;
                if (u < pairs)
                    pair_rows(xp + m0 * kp, rows, kp, panel, b, yb, n);
                else
                    single_rows(xp + m0 * kp, rows, kp, panel, b, yb, n);
            }
        }
    }
    free(xp);
    return 0;
}

/* The same GEMM under the calling convention every native linear shares
 * (stages/execute/native.py: NativeGemm); ``format`` is unused here (bf16 panels). */
int actorline_bf16_gemm(const float *x, int64_t m, int64_t k, const void *packed, int format,
                        const float *bias, int64_t n, float *y, int num_threads) {
    (void)format;
    return actorline_bf16_gemm_f32(x, m, k, (const uint16_t *)packed, bias, n, y, num_threads);
}

/* The calling thread's bf16 pairs of x[m, k] (see round_rows), in a buffer of its own kept
 * between calls; with same_x (x holds the rows it held at this thread's last call) those of
 * that call where it had the same x, m and k. NULL: out of memory. */
static const xpair_t *thread_pairs(const float *x, int64_t m, int64_t k, int same_x) {
    static __thread xpair_t *pairs_buffer = NULL;
    static __thread size_t capacity = 0;
    static __thread const float *rounded_x = NULL; /* the rows the buffer holds: x, m, k */
    static __thread int64_t rounded_m = -1, rounded_k = -1;
    const int64_t kp = (k + 1) / 2;
    const size_t need = (size_t)(m * kp);
    if (need > capacity) {
        xpair_t *bigger = (xpair_t *)realloc(pairs_buffer, need * sizeof(xpair_t));
        if (!bigger) return NULL;
        pairs_buffer = bigger;
        capacity = need;
        rounded_x = NULL;
    }
    if (!(same_x && rounded_x == x && rounded_m == m && rounded_k == k)) {
        round_rows(x, m, k, kp, pairs_buffer);
        rounded_x = x, rounded_m = m, rounded_k = k;
    }
    return pairs_buffer;
}

/* Output columns [col0, col1) of the same GEMM on the calling thread, no OpenMP region: the CPU
 * step graph's threads each compute their share inside the one region of a step (stages/
 * execute/native.py: NativeGemm.part); col0 and col1 multiples of 16 (col1 at most n). Each
 * thread rounds the rows to bf16 pairs itself, into a buffer of its own kept between calls,
 * and with same_x (the caller's word that x holds the rows of this thread's last call) takes
 * the pairs of that call when it had the same x, m and k; the same results as the whole
 * call's, bit for bit (each column's sums do not depend on its neighbours). Returns 0; 1 when
 * out of memory; 2 on a range or shape it cannot serve. */
int actorline_bf16_gemm_part(const float *x, int64_t m, int64_t k, const void *weights,
                             int format, const float *bias, int64_t n, float *y, int64_t col0,
                             int64_t col1, int same_x) {
    (void)format;
    if (n % NR != 0 || k < 1 || m < 0 || col0 < 0 || col1 > n || col0 > col1 ||
        col0 % NR != 0 || col1 % NR != 0)
        return 2;
    if (m == 0 || col0 == col1) return 0;
    const uint16_t *packed = (const uint16_t *)weights;
    const int64_t kp = (k + 1) / 2;
    const xpair_t *xp = thread_pairs(x, m, k, same_x);
    if (!xp) return 1;
    const int64_t mb = row_block(kp);
    for (int64_t m0 = 0; m0 < m; m0 += mb) {
        const int64_t rows = m - m0 < mb ? m - m0 : mb;
        int64_t p = col0 / NR;
        for (; p + 2 <= col1 / NR; p += 2)
            pair_rows(xp + m0 * kp, rows, kp, packed + p * kp * 2 * NR, bias ? bias + p * NR : 0,
                      y + m0 * n + p * NR, n);
        if (p < col1 / NR)
            single_rows(xp + m0 * kp, rows, kp, packed + p * kp * 2 * NR,
                        bias ? bias + p * NR : 0, y + m0 * n + p * NR, n);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The SiLU-and-mul epilogue of a fused gate/up projection: packed = gate's n / 2 columns, then
 * up's (stages/execute/fused.py: FusedGatedMLP, packed by BF16GemmKernel.pack(gate, up)), and
 * the output act[M, n / 2] = silu(gate) * up, gate column j paired with up column n / 2 + j
 * (panel p with panel p + n / 32), so the fp32 gate/up product is never stored whole: each
 * 16-column pair is multiplied into a small buffer (or tiles) that stays in L1 and only its
 * activation goes out, half the columns (at 1,000 rows x 3,072 columns half the tiles' time
 * was storing the fp32 output, and the SiLU-and-mul pass then read it back: docs/
 * performance.md section 12.2). silu(g) * u = g / (1 + exp(-g)) * u with exp the vector
 * polynomial of kernels/fused_cpu.c (Cephes expf's; the same expression, so within a rounding
 * of that kernel's SiLU-and-mul; vLLM's silu_and_mul, csrc/cpu/activation.cpp, fuses it
 * likewise, after its GEMM). ------------------------------------------------------------ */

typedef int32_t vi __attribute__((vector_size(NR * sizeof(int32_t)), aligned(4)));

static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.33654f, hi = (vf){0} + 88.72283f;
    const vi below = x < lo, above = x > hi;
    x = (vf)(((vi)x & ~below) | ((vi)lo & below));
    x = (vf)(((vi)x & ~above) | ((vi)hi & above));
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

/* rows rows of 16 gate values (rows gu_stride floats apart, up's 16 values up_offset after
 * each) into out (rows out_stride apart): silu(gate) * up. */
static inline void silu_rows(const float *restrict gu, int64_t gu_stride, int64_t up_offset,
                             float *restrict out, int64_t out_stride, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
        const vf g = *(const vf *)(gu + r * gu_stride), u = *(const vf *)(gu + r * gu_stride + up_offset);
        *(vf *)(out + r * out_stride) = g / (1.0f + vexp(-g)) * u;
    }
}

/* Gate panels [first, last) of the epilogue on VDPBF16PS: each row block's gate panel and its
 * up panel into ``scratch`` (row_block rows x 32 floats), then their activation into act. */
static void silu_panels(const xpair_t *xp, int64_t m, int64_t kp, const uint16_t *packed,
                        const float *bias, int64_t inter, float *act, int64_t first,
                        int64_t last, float *scratch) {
    const int64_t mb = row_block(kp), half = inter / NR;
    for (int64_t m0 = 0; m0 < m; m0 += mb) {
        const int64_t rows = m - m0 < mb ? m - m0 : mb;
        for (int64_t p = first; p < last; ++p) {
            two_rows(xp + m0 * kp, rows, kp, packed + p * kp * 2 * NR,
                     packed + (p + half) * kp * 2 * NR, bias ? bias + p * NR : 0,
                     bias ? bias + (p + half) * NR : 0, scratch, scratch + NR, 2 * NR);
            silu_rows(scratch, 2 * NR, NR, act + m0 * inter + p * NR, inter, rows);
        }
    }
}

/* A thread's scratch of at least floats floats, kept between calls (NULL: out of memory). */
static float *thread_scratch(size_t floats) {
    static __thread float *buffer = NULL;
    static __thread size_t capacity = 0;
    if (floats > capacity) {
        float *bigger = (float *)realloc(buffer, sizeof(float) * floats);
        if (!bigger) return NULL;
        buffer = bigger;
        capacity = floats;
    }
    return buffer;
}

/* The epilogue on VDPBF16PS (any row count), threads splitting the gate panels: act[M, n / 2]
 * (see above); n: the fused projection's columns, a multiple of 32. */
static int silu_mul_dp(const float *x, int64_t m, int64_t k, const uint16_t *packed,
                       const float *bias, int64_t n, float *act, int num_threads) {
    const int64_t kp = (k + 1) / 2, inter = n / 2, panels = inter / NR, mb = row_block(kp);
    xpair_t *xp = (xpair_t *)malloc((size_t)(m * kp) * sizeof(xpair_t));
    if (!xp) return 1;
    if (num_threads < 1) num_threads = 1;
    const int threads = num_threads > panels ? (int)panels : num_threads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; ++i) round_rows(x + i * k, 1, k, kp, xp + i * kp);
        float *scratch = thread_scratch((size_t)(mb < m ? mb : m) * 2 * NR);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < m; m0 += mb) {
            const int64_t rows = m - m0 < mb ? m - m0 : mb;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; ++p)
                if (scratch)
                    silu_panels(xp + m0 * kp, rows, kp, packed, bias, inter, act + m0 * inter, p,
                                p + 1, scratch);
        }
    }
    free(xp);
    return failed;
}

/* Gate columns [col0, col1) of the epilogue on the calling thread (multiples of 16, col1 at
 * most n / 2), as actorline_bf16_gemm_part: act's other columns untouched. */
static int silu_mul_dp_part(const float *x, int64_t m, int64_t k, const uint16_t *packed,
                            const float *bias, int64_t n, float *act, int64_t col0, int64_t col1,
                            int same_x) {
    const int64_t kp = (k + 1) / 2, mb = row_block(kp);
    const xpair_t *xp = thread_pairs(x, m, k, same_x);
    float *scratch = thread_scratch((size_t)(mb < m ? mb : m) * 2 * NR);
    if (!xp || !scratch) return 1;
    silu_panels(xp, m, kp, packed, bias, n / 2, act, col0 / NR, col1 / NR, scratch);
    return 0;
}

static inline int silu_shape_ok(int64_t m, int64_t k, int64_t n) {
    return n % (2 * NR) == 0 && n > 0 && k >= 1 && m >= 0;
}

/* ---------------------------------------------------------------------------------------------
 * AMX-BF16: the same GEMM on tiles, reading the packed panels in place (no copy of W).
 *
 * TDPBF16PS C[16 x 16 fp32] += A[16 x 32 bf16] . B where B is 16 rows of 64 bytes, row r
 * holding for each of 16 columns the pair (w[j, 2r], w[j, 2r + 1]): sixteen consecutive k-pair
 * lines of one panel are exactly that tile (stride 64 bytes). A tile is 16 rows of 32 bf16 of
 * the activations, rounded to bf16 as above into a buffer whose rows are padded with zeros to a
 * multiple of 32 k (and whose row count to a multiple of 16). Products of two bf16 are exact in
 * fp32; the tile unit sums in fp32 with round to nearest even and treats bf16 denormals as zero
 * (Intel SDM, TDPBF16PS), the only numerical difference from the VDPBF16PS path.
 *
 * Blocking: tiles 0-3 hold a 32 x 32 block of C (two 16-row A tiles x two panels), 4-5 the A
 * tiles, 6-7 the B tiles; four TDPBF16PS per 32 k. The bias seeds the accumulators (a 16 x 16
 * tile of it replicated). A K tail (K not a multiple of 32: the panel has fewer than 16 lines
 * left) copies the remaining lines to a zero-padded scratch tile: a B tile is never read past
 * its panel (the next panel's values, or unmapped memory after the last, times the zero A pad
 * could give NaN). M tails: rows past m are zero in the A buffer and their C rows go through a
 * scratch tile, never stored into y. The panels are split over threads (32-column units) and
 * the rows into blocks whose bf16 activations stay in L2; from AMX_BLOCK_ROWS_FIRST rows the
 * threads split 32-row blocks instead, each walking a chunk of panels per block (below).
 *
 * Linux hands a process the tile data state only on request: actorline_bf16_amx_enable() asks
 * once with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), as llama.cpp's
 * ggml-cpu/amx/amx.cpp (ggml_amx_init) and oneDNN do, and the GEMM refuses (status 3) until it
 * was granted; without it a tile instruction would kill the process. Each call loads its tile
 * configuration on every thread and puts back what the thread had (oneDNN's brgemm configures
 * its own palette per call too). Layout of the configuration: Intel SDM, LDTILECFG; the tile
 * intrinsics as in Intel's AMX sample (Intel-tutorials amx_bf16) and llama.cpp's amx/mmq.cpp.
 * ------------------------------------------------------------------------------------------- */
#if DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#else
#define AMX 0
#endif

/* From this many rows on actorline_bf16_gemm_tiles multiplies on the tiles: measured against
 * the VDPBF16PS path on SmolLM2-135M's shapes (docs/performance.md section 12.2), the tiles
 * lose at 1-4 rows (0.8-0.95x, both read the weights once), win from ~6 (1.3x at 8, 2.3x at
 * 16, 6-9x at 32-64). */
#define AMX_ROWS 8
#define TILE_ROWS 16
#define TILE_K 32 /* bf16 per A tile row: 16 k pairs, one B tile */
#ifndef AMX_PASS_BYTES
#define AMX_PASS_BYTES (512 * 1024)
#endif
/* From this many rows amx_run walks 32-row blocks outside and chunks of panels of at most
 * AMX_CHUNK_BYTES inside (below: the panels outside, the rows in passes of AMX_PASS_BYTES).
 * With a unit's panels outside, a call over ~1,600 rows wrote its fp32 output as 32-column
 * strips down every row (12 KB apart at gate/up), stores that missed L2 and its TLB; rows
 * outside write each block's rows whole: 1.22-1.29x at 1,600-2,048 rows, within noise at
 * 128-512, over 30 layers' SmolLM2-135M linears with the weights streamed from memory
 * (docs/performance.md section 12.2, "Prefill GEMMs: row blocks outside"). */
#ifndef AMX_BLOCK_ROWS_FIRST
#define AMX_BLOCK_ROWS_FIRST 512
#endif
#ifndef AMX_CHUNK_BYTES
#define AMX_CHUNK_BYTES (512 * 1024)
#endif

int actorline_bf16_amx_rows(void) { return AMX_ROWS; }
int actorline_bf16_amx_block_rows_first(void) { return AMX_BLOCK_ROWS_FIRST; }

static int amx_granted __attribute__((unused)) = 0; /* 1 once the kernel granted the tile data state */

/* 1 where this build and this process can multiply on AMX tiles (asks Linux for the tile
 * state on the first call); 0 where the compiler did not target AMX-BF16, the CPU lacks it or
 * the kernel refused. */
int actorline_bf16_amx_enable(void) {
#if AMX
    if (amx_granted) return 1;
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    if (!(edx & (1u << 22)) || !(edx & (1u << 24))) return 0; /* AMX-BF16, AMX-TILE */
    unsigned long permitted = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &permitted) != 0) return 0;
    if (!(permitted & (1ul << XFEATURE_XTILEDATA))) return 0;
    __atomic_store_n(&amx_granted, 1, __ATOMIC_RELEASE);
    return 1;
#else
    return 0;
#endif
}

#if AMX
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tile_config;

/* Eight tiles of 16 rows x 64 bytes (palette 1). */
static void amx_config(tile_config *config) {
    memset(config, 0, sizeof *config);
    config->palette = 1;
    for (int t = 0; t < 8; ++t) {
        config->rows[t] = TILE_ROWS;
        config->colsb[t] = 64;
    }
}

/* Row i of x as bf16 into dst (kc values: x's k, then zeros), rounded as to_bf16. */
static void amx_round_row(const float *x, int64_t k, int64_t kc, uint16_t *dst) {
    const __m512i keep = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x40);
    for (int64_t j = 0; j < kc; j += 16) {
        const int64_t left = k - j;
        const __mmask16 valid = left >= 16 ? (__mmask16)0xffff
                                : left > 0 ? (__mmask16)((1u << left) - 1u) : (__mmask16)0;
        const __m512i bits = _mm512_maskz_loadu_epi32(valid, x + j);
        const __m512i high = _mm512_srli_epi32(bits, 16);
        __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(keep, _mm512_and_si512(high, one)));
        rounded = _mm512_srli_epi32(rounded, 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, magnitude), inf);
        rounded = _mm512_mask_or_epi32(rounded, nan, high, quiet);
        _mm256_storeu_si256((__m256i *)(dst + j), _mm512_cvtepi32_epi16(rounded));
    }
}

/* One block: ``ma`` (1-2) A tiles of 16 rows at ``a`` (row stride lda bf16) times panel p0 and,
 * when np is 2, panel p1, each panel's bias tile (16 x 16, replicated) seeding its
 * accumulators; ``valid`` rows of the block go out (rows ldy floats apart): p0's columns into
 * y0 and p1's into y1, or with ``silu`` (np 2: p0 a gate panel, p1 its up panel) silu(gate) *
 * up into y0. */
static void amx_block(const uint16_t *a, int64_t lda, int ma, const uint16_t *p0,
                      const uint16_t *p1, int np, int64_t kp, const float *bias0,
                      const float *bias1, float *y0, float *y1, int64_t ldy, int64_t valid,
                      int silu, uint16_t *tail, float *scratch) {
    const int64_t full = kp / 16, rest = kp - full * 16, stride_a = lda * 2;
    if (bias0) {
        _tile_loadd(0, bias0, NR * 4);
        _tile_loadd(2, bias0, NR * 4);
        if (np > 1) {
            _tile_loadd(1, bias1, NR * 4);
            _tile_loadd(3, bias1, NR * 4);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t c = 0; c <= full; ++c) {
        const uint16_t *b0 = p0 + c * 16 * 2 * NR, *b1 = p1 + c * 16 * 2 * NR;
        if (c == full) {
            if (rest == 0) break;
            /* The K tail: the panel's last lines, then zeros, in a tile of our own. */
            memset(tail, 0, 2 * 16 * 2 * NR * sizeof(uint16_t));
            memcpy(tail, b0, (size_t)rest * 2 * NR * sizeof(uint16_t));
            if (np > 1) memcpy(tail + 16 * 2 * NR, b1, (size_t)rest * 2 * NR * sizeof(uint16_t));
            b0 = tail;
            b1 = tail + 16 * 2 * NR;
        }
        _tile_loadd(4, a + c * TILE_K, stride_a);
        _tile_loadd(6, b0, 2 * NR * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (np > 1) {
            _tile_loadd(7, b1, 2 * NR * 2);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (ma > 1) {
            _tile_loadd(5, a + TILE_ROWS * lda + c * TILE_K, stride_a);
            _tile_dpbf16ps(2, 5, 6);
            if (np > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (silu) {
        /* gate and up tiles of each 16-row half into the scratch, their activation out */
#define SILU(tg, tu, i)                                                                         \
    do {                                                                                       \
        const int64_t rows = valid - (i) * TILE_ROWS;                                          \
        _tile_stored(tg, scratch, NR * 4);                                                     \
        _tile_stored(tu, scratch + TILE_ROWS * NR, NR * 4);                                    \
        silu_rows(scratch, NR, TILE_ROWS * NR, y0 + (i) * TILE_ROWS * ldy, ldy,                \
                  rows < TILE_ROWS ? rows : TILE_ROWS);                                        \
    } while (0)
        SILU(0, 1, 0);
        if (ma > 1) SILU(2, 3, 1);
#undef SILU
        return;
    }
    /* Full tiles straight into y; a tile with rows past m through the scratch. */
#define STORE(t, i, y)                                                                          \
    do {                                                                                       \
        float *dst = (y) + (i) * TILE_ROWS * ldy;                                              \
        const int64_t rows = valid - (i) * TILE_ROWS;                                          \
        if (rows >= TILE_ROWS) {                                                               \
            _tile_stored(t, dst, ldy * 4);                                                     \
        } else {                                                                               \
            _tile_stored(t, scratch, NR * 4);                                                  \
            for (int64_t r = 0; r < rows; ++r) memcpy(dst + r * ldy, scratch + r * NR, NR * 4); \
        }                                                                                      \
    } while (0)
    STORE(0, 0, y0);
    if (np > 1) STORE(1, 0, y1);
    if (ma > 1) {
        STORE(2, 1, y0);
        if (np > 1) STORE(3, 1, y1);
    }
#undef STORE
}

/* Per thread: the scratch tiles amx_block needs and the bias tiles of the unit it holds. */
typedef struct {
    uint16_t tail[2 * 16 * 2 * NR] __attribute__((aligned(64)));
    float scratch[2 * TILE_ROWS * NR] __attribute__((aligned(64)));
    float bias[2][TILE_ROWS * NR] __attribute__((aligned(64)));
    int64_t seeded; /* the panel whose bias bias[0] holds (-1: none) */
} amx_locals;

/* Unit u of a GEMM (silu 0: panels 2u and 2u + 1, the second where there is one) or of the
 * epilogue (silu 1: gate panel u and its up panel u + panels / 2) over the 32-row block at
 * ``row`` of the A buffer (mp rows, lda bf16 apart); y: [m, ldy], the GEMM's n or the
 * epilogue's n / 2 columns. */
static void amx_unit(const uint16_t *a, int64_t lda, int64_t mp, int64_t m, int64_t row,
                     const uint16_t *packed, int64_t kp, int64_t panels, const float *bias,
                     float *y, int64_t ldy, int64_t u, int silu, amx_locals *own) {
    const int64_t p0 = silu ? u : 2 * u, p1 = silu ? u + panels / 2 : 2 * u + 1;
    const int np = silu || p1 < panels ? 2 : 1, ma = mp - row > 16 ? 2 : 1;
    if (bias && own->seeded != p0) {
        for (int r = 0; r < TILE_ROWS; ++r) {
            memcpy(own->bias[0] + r * NR, bias + p0 * NR, NR * 4);
            if (np > 1) memcpy(own->bias[1] + r * NR, bias + p1 * NR, NR * 4);
        }
        own->seeded = p0;
    }
    float *out = y + row * ldy + (silu ? u * NR : p0 * NR);
    amx_block(a + row * lda, lda, ma, packed + p0 * kp * 2 * NR, packed + p1 * kp * 2 * NR, np,
              kp, bias ? own->bias[0] : 0, bias ? own->bias[1] : 0, out, out + NR, ldy, m - row,
              silu, own->tail, own->scratch);
}

/* The whole GEMM (silu 0) or epilogue (silu 1) on the tiles, threads splitting units x 32-row
 * blocks, the rows in passes whose bf16 copy stays in L2. */
static int amx_run(const float *x, int64_t m, int64_t k, const uint16_t *packed,
                   const float *bias, int64_t n, float *y, int num_threads, int silu) {
    const int64_t kp = (k + 1) / 2, lda = (kp + 15) / 16 * TILE_K;
    const int64_t mp = (m + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    const int64_t panels = n / NR, units = silu ? panels / 2 : (panels + 1) / 2;
    const int64_t ldy = silu ? n / 2 : n;
    uint16_t *a = (uint16_t *)aligned_alloc(64, (size_t)(mp * lda) * sizeof(uint16_t));
    if (!a) return 1;
    /* Rows per pass: 32-row blocks whose bf16 activations take at most ~512 KiB of L2. */
    int64_t pass = AMX_PASS_BYTES / (lda * 2) / 32 * 32;
    if (pass < 32) pass = 32;
    if (num_threads < 1) num_threads = 1;
    const int64_t work = units * ((mp + 31) / 32);
    const int threads = num_threads > work ? (int)work : num_threads;
    tile_config config;
    amx_config(&config);
#pragma omp parallel num_threads(threads)
    {
        amx_locals own;
        own.seeded = -1;
        tile_config saved;
        _tile_storeconfig(&saved);
        _tile_loadconfig(&config);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < mp; ++i) {
            if (i < m) amx_round_row(x + i * k, k, lda, a + i * lda);
            else memset(a + i * lda, 0, (size_t)lda * sizeof(uint16_t));
        }
        if (m >= AMX_BLOCK_ROWS_FIRST) {
            /* Many rows: 32-row blocks outside, the units of a chunk of panels inside, so each
             * block's C rows are written whole (not a 32-column strip down every row) and the
             * chunk's panels stay in L2 while the blocks pass. */
            const int64_t unit_bytes = 2 * kp * 2 * NR * (int64_t)sizeof(uint16_t);
            const int64_t chunk = AMX_CHUNK_BYTES / unit_bytes > 0 ? AMX_CHUNK_BYTES / unit_bytes : 1;
            const int64_t blocks = (mp + 31) / 32;
            for (int64_t u0 = 0; u0 < units; u0 += chunk) {
                const int64_t u1 = u0 + chunk < units ? u0 + chunk : units;
#pragma omp for schedule(static) nowait
                for (int64_t b = 0; b < blocks; ++b)
                    for (int64_t u = u0; u < u1; ++u)
                        amx_unit(a, lda, mp, m, 32 * b, packed, kp, panels, bias, y, ldy, u,
                                 silu, &own);
            }
        } else {
            for (int64_t m0 = 0; m0 < mp; m0 += pass) {
                const int64_t rows = mp - m0 < pass ? mp - m0 : pass, blocks = (rows + 31) / 32;
#pragma omp for collapse(2) schedule(static) nowait
                for (int64_t u = 0; u < units; ++u)
                    for (int64_t b = 0; b < blocks; ++b)
                        amx_unit(a, lda, mp, m, m0 + 32 * b, packed, kp, panels, bias, y, ldy, u,
                                 silu, &own);
            }
        }
        if (saved.palette) _tile_loadconfig(&saved);
        else _tile_release();
    }
    free(a);
    return 0;
}

/* The calling thread's A buffer of x[m, k] (rows padded to 16, k to 32, zeros), kept between
 * calls, reused with same_x as thread_pairs; *lda: its row stride. NULL: out of memory. */
static const uint16_t *thread_tiles(const float *x, int64_t m, int64_t k, int same_x,
                                    int64_t *lda) {
    static __thread uint16_t *buffer = NULL;
    static __thread size_t capacity = 0;
    static __thread const float *rounded_x = NULL;
    static __thread int64_t rounded_m = -1, rounded_k = -1;
    const int64_t kp = (k + 1) / 2, mp = (m + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    *lda = (kp + 15) / 16 * TILE_K;
    const size_t need = (size_t)(mp * *lda);
    if (need > capacity) {
        free(buffer);
        buffer = (uint16_t *)aligned_alloc(64, need * sizeof(uint16_t));
        capacity = buffer ? need : 0;
        rounded_x = NULL;
        if (!buffer) return NULL;
    }
    if (!(same_x && rounded_x == x && rounded_m == m && rounded_k == k)) {
        for (int64_t i = 0; i < mp; ++i) {
            if (i < m) amx_round_row(x + i * k, k, *lda, buffer + i * *lda);
            else memset(buffer + i * *lda, 0, (size_t)*lda * sizeof(uint16_t));
        }
        rounded_x = x, rounded_m = m, rounded_k = k;
    }
    return buffer;
}

/* Columns [col0, col1) of the GEMM (silu 0) or gate columns [col0, col1) of the epilogue
 * (silu 1) on the tiles, on the calling thread (its own tile configuration, loaded here and the
 * thread's previous one put back: an OpenMP thread of the step graph may run oneDNN's tiles
 * between two calls); every element as amx_run computes it. */
static int amx_part(const float *x, int64_t m, int64_t k, const uint16_t *packed,
                    const float *bias, int64_t n, float *y, int64_t col0, int64_t col1,
                    int same_x, int silu) {
    int64_t lda;
    const uint16_t *a = thread_tiles(x, m, k, same_x, &lda);
    if (!a) return 1;
    const int64_t kp = (k + 1) / 2, mp = (m + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    const int64_t panels = n / NR, ldy = silu ? n / 2 : n;
    tile_config config, saved;
    amx_config(&config);
    _tile_storeconfig(&saved);
    _tile_loadconfig(&config);
    amx_locals own;
    own.seeded = -1;
    /* units: the epilogue's gate panels; the GEMM's panel pairs from col0 (the last one alone
     * where the range holds an odd number) */
    const int64_t first = col0 / NR, last = col1 / NR;
    for (int64_t p = first; p < last; p += silu ? 1 : 2) {
        for (int64_t row = 0; row < mp; row += 32) {
            if (silu) {
                amx_unit(a, lda, mp, m, row, packed, kp, panels, bias, y, ldy, p, 1, &own);
                continue;
            }
            const int np = p + 1 < last ? 2 : 1, ma = mp - row > 16 ? 2 : 1;
            if (bias && own.seeded != p) {
                for (int r = 0; r < TILE_ROWS; ++r) {
                    memcpy(own.bias[0] + r * NR, bias + p * NR, NR * 4);
                    if (np > 1) memcpy(own.bias[1] + r * NR, bias + (p + 1) * NR, NR * 4);
                }
                own.seeded = p;
            }
            float *out = y + row * ldy + p * NR;
            amx_block(a + row * lda, lda, ma, packed + p * kp * 2 * NR,
                      packed + (p + 1) * kp * 2 * NR, np, kp, bias ? own.bias[0] : 0,
                      bias ? own.bias[1] : 0, out, out + NR, ldy, m - row, 0, own.tail,
                      own.scratch);
        }
    }
    if (saved.palette) _tile_loadconfig(&saved);
    else _tile_release();
    return 0;
}
#endif

static inline int amx_ready(void) {
#if AMX
    return __atomic_load_n(&amx_granted, __ATOMIC_ACQUIRE);
#else
    return 0;
#endif
}

/* x: [M, K] fp32 contiguous; packed: bf16 panels as actorline_bf16_gemm_f32's; bias: [N] or
 * NULL; y: [M, N]. Returns 0; 1 when out of memory; 2 when N is not a multiple of 16; 3 when
 * AMX is not available (this build, this CPU, or actorline_bf16_amx_enable() not granted). */
int actorline_bf16_gemm_amx_f32(const float *x, int64_t m, int64_t k, const uint16_t *packed,
                                const float *bias, int64_t n, float *y, int num_threads) {
    if (n % NR != 0 || k < 1 || m < 0) return 2;
    if (!amx_ready()) return 3;
    if (m == 0) return 0;
#if AMX
    return amx_run(x, m, k, packed, bias, n, y, num_threads, 0);
#else
    (void)x; (void)packed; (void)bias; (void)y; (void)num_threads;
    return 3;
#endif
}

/* The bf16 GEMM under the NativeGemm convention, on AMX tiles from AMX_ROWS rows on where
 * actorline_bf16_amx_enable() granted them, else actorline_bf16_gemm_f32. */
int actorline_bf16_gemm_tiles(const float *x, int64_t m, int64_t k, const void *packed,
                              int format, const float *bias, int64_t n, float *y,
                              int num_threads) {
    (void)format;
    if (m >= AMX_ROWS && amx_ready())
        return actorline_bf16_gemm_amx_f32(x, m, k, (const uint16_t *)packed, bias, n, y,
                                           num_threads);
    return actorline_bf16_gemm_f32(x, m, k, (const uint16_t *)packed, bias, n, y, num_threads);
}

/* actorline_bf16_gemm_tiles' column-range entry (NativeGemm.part, as actorline_bf16_gemm_part):
 * on the tiles from AMX_ROWS rows on where granted, each element as the whole call computes
 * it (the step graph's one region then multiplies on the tiles at the row counts where the
 * per-op form does: 2.5-4x VDPBF16PS at 8-64 rows). */
int actorline_bf16_gemm_tiles_part(const float *x, int64_t m, int64_t k, const void *weights,
                                   int format, const float *bias, int64_t n, float *y,
                                   int64_t col0, int64_t col1, int same_x) {
#if AMX
    if (m >= AMX_ROWS && amx_ready()) {
        if (n % NR != 0 || k < 1 || col0 < 0 || col1 > n || col0 > col1 || col0 % NR != 0 ||
            col1 % NR != 0)
            return 2;
        if (col0 == col1) return 0;
        return amx_part(x, m, k, (const uint16_t *)weights, bias, n, y, col0, col1, same_x, 0);
    }
#endif
    return actorline_bf16_gemm_part(x, m, k, weights, format, bias, n, y, col0, col1, same_x);
}

/* The SiLU-and-mul epilogue (see above) under NativeGemm's arguments: weights the fused
 * gate/up panels (n columns, a multiple of 32: gate's n / 2, then up's), bias [n] or NULL, y
 * [M, n / 2] = silu(gate) * up; on the tiles from AMX_ROWS rows where ``tiles`` and granted,
 * else on VDPBF16PS. Returns 0; 1 when out of memory; 2 on a shape it cannot serve. */
static int silu_mul(const float *x, int64_t m, int64_t k, const void *weights,
                    const float *bias, int64_t n, float *y, int num_threads, int tiles) {
    if (!silu_shape_ok(m, k, n)) return 2;
    if (m == 0) return 0;
#if AMX
    if (tiles && m >= AMX_ROWS && amx_ready())
        return amx_run(x, m, k, (const uint16_t *)weights, bias, n, y, num_threads, 1);
#endif
    (void)tiles;
    return silu_mul_dp(x, m, k, (const uint16_t *)weights, bias, n, y, num_threads);
}

/* The epilogue with actorline_bf16_gemm's products (VDPBF16PS at every row count). */
int actorline_bf16_silu_mul(const float *x, int64_t m, int64_t k, const void *weights,
                            int format, const float *bias, int64_t n, float *y,
                            int num_threads) {
    (void)format;
    return silu_mul(x, m, k, weights, bias, n, y, num_threads, 0);
}

/* The epilogue with actorline_bf16_gemm_tiles' products (the tiles from AMX_ROWS rows). */
int actorline_bf16_silu_mul_tiles(const float *x, int64_t m, int64_t k, const void *weights,
                                  int format, const float *bias, int64_t n, float *y,
                                  int num_threads) {
    (void)format;
    return silu_mul(x, m, k, weights, bias, n, y, num_threads, 1);
}

/* Gate columns [col0, col1) of the epilogue (multiples of 16, col1 at most n / 2) on the
 * calling thread, as actorline_bf16_gemm_part for the GEMM: y's other columns untouched, each
 * element as the whole call computes it (``tiles``: as actorline_bf16_silu_mul_tiles). */
static int silu_mul_part(const float *x, int64_t m, int64_t k, const void *weights,
                         const float *bias, int64_t n, float *y, int64_t col0, int64_t col1,
                         int same_x, int tiles) {
    if (!silu_shape_ok(m, k, n) || col0 < 0 || col1 > n / 2 || col0 > col1 || col0 % NR != 0 ||
        col1 % NR != 0)
        return 2;
    if (m == 0 || col0 == col1) return 0;
#if AMX
    if (tiles && m >= AMX_ROWS && amx_ready())
        return amx_part(x, m, k, (const uint16_t *)weights, bias, n, y, col0, col1, same_x, 1);
#endif
    (void)tiles;
    return silu_mul_dp_part(x, m, k, (const uint16_t *)weights, bias, n, y, col0, col1, same_x);
}

int actorline_bf16_silu_mul_part(const float *x, int64_t m, int64_t k, const void *weights,
                                 int format, const float *bias, int64_t n, float *y,
                                 int64_t col0, int64_t col1, int same_x) {
    (void)format;
    return silu_mul_part(x, m, k, weights, bias, n, y, col0, col1, same_x, 0);
}

int actorline_bf16_silu_mul_tiles_part(const float *x, int64_t m, int64_t k, const void *weights,
                                       int format, const float *bias, int64_t n, float *y,
                                       int64_t col0, int64_t col1, int same_x) {
    (void)format;
    return silu_mul_part(x, m, k, weights, bias, n, y, col0, col1, same_x, 1);
}
