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
 *   - elsewhere: the portable path widens each bf16 to fp32 (a 16-bit shift) and FMAs, so the
 *     two paths give the same sums up to their order.
 * The register blocking follows kernels/packed_gemm.c: MR rows x two neighbouring panels in
 * accumulators, the panels split over threads, x cut into row blocks that stay in L2; at fewer
 * than 4 rows a second accumulator set takes odd k pairs. A decode step reads every weight once:
 * bf16 halves the bytes of fp32's kernel.
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
#define MR 12
#define PREFETCH_LINES 32

typedef float vf __attribute__((vector_size(NR * sizeof(float)), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(NR * sizeof(uint32_t)), aligned(4)));

/* 1 where this build multiplies with VDPBF16PS, 0 on the portable path. */
int actorline_bf16_native(void) { return DPBF16; }

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* A row block's pairs: k pair p of row i as one 32-bit word (x[2p] low, x[2p+1] high). */
static void round_rows(const float *x, int64_t rows, int64_t k, int64_t kp, uint32_t *out) {
    for (int64_t i = 0; i < rows; ++i) {
        const float *row = x + i * k;
        uint32_t *dst = out + i * kp;
        for (int64_t p = 0; p < kp; ++p) {
            const uint32_t lo = to_bf16(row[2 * p]);
            const uint32_t hi = 2 * p + 1 < k ? to_bf16(row[2 * p + 1]) : 0u;
            dst[p] = lo | (hi << 16);
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
#else
typedef vf acc_t;
static inline __attribute__((always_inline)) acc_t madd(acc_t acc, uint32_t pair, const uint16_t *line) {
    uint32_t lo_bits = pair << 16, hi_bits = pair & 0xffff0000u;
    float lo, hi;
    memcpy(&lo, &lo_bits, sizeof lo);
    memcpy(&hi, &hi_bits, sizeof hi);
    const vu w = *(const vu *)line;
    const vu w_lo = w << 16, w_hi = w & 0xffff0000u;
    acc += lo * (vf)w_lo;
    acc += hi * (vf)w_hi;
    return acc;
}
static inline acc_t acc_load(const float *bias) { return bias ? *(const vf *)bias : (vf){0}; }
static inline acc_t acc_add(acc_t a, acc_t b) { return a + b; }
static inline void acc_store(float *y, acc_t a) { *(vf *)y = a; }
static inline acc_t acc_zero(void) { return (vf){0}; }
#endif

/* ``mr`` rows of pairs ``xp`` (row stride kp words) times ``np`` neighbouring panels (p0, and
 * p0 + kp * 32 when np is 2) into y (row stride ldy), bias added where given. */
static inline __attribute__((always_inline)) void
micro(const uint32_t *restrict xp, int64_t kp, const uint16_t *restrict p0, const float *restrict bias,
      float *restrict y, int64_t ldy, const int mr, const int np) {
    const uint16_t *p1 = p0 + kp * 2 * NR;
    acc_t acc0[MR], acc1[MR];
    const acc_t b0 = acc_load(bias), b1 = np > 1 ? acc_load(bias ? bias + NR : 0) : acc_zero();
    for (int i = 0; i < mr; ++i) {
        acc0[i] = b0;
        acc1[i] = b1;
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
        acc_store(y + i * ldy, acc0[i]);
        if (np > 1) acc_store(y + i * ldy + NR, acc1[i]);
    }
}

#define TAIL(r)                                                                                \
    case r: micro(xp + i * kp, kp, p0, bias, y + i * ldy, ldy, r, np); break;

/* All ``rows`` of a row block through one unit (one panel, or two when ``np`` is 2). */
static inline __attribute__((always_inline)) void
unit_rows(const uint32_t *xp, int64_t rows, int64_t kp, const uint16_t *p0, const float *bias,
          float *y, int64_t ldy, const int np) {
    int64_t i = 0;
    for (; i + MR <= rows; i += MR) micro(xp + i * kp, kp, p0, bias, y + i * ldy, ldy, MR, np);
    switch ((int)(rows - i)) {
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6)
        TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
    default: break;
    }
}

static void pair_rows(const uint32_t *xp, int64_t rows, int64_t kp, const uint16_t *p0,
                      const float *bias, float *y, int64_t ldy) {
    unit_rows(xp, rows, kp, p0, bias, y, ldy, 2);
}

static void single_rows(const uint32_t *xp, int64_t rows, int64_t kp, const uint16_t *p0,
                        const float *bias, float *y, int64_t ldy) {
    unit_rows(xp, rows, kp, p0, bias, y, ldy, 1);
}

/* x: [M, K] fp32 contiguous; packed: [N / 16, ceil(K / 2), 16, 2] bf16 (see above); bias: [N]
 * or NULL; y: [M, N]. Returns 0; 1 when out of memory; 2 when N is not a multiple of 16. */
int actorline_bf16_gemm_f32(const float *x, int64_t m, int64_t k, const uint16_t *packed,
                            const float *bias, int64_t n, float *y, int num_threads) {
    if (n % NR != 0 || k < 1 || m < 0) return 2;
    if (m == 0) return 0;
    const int64_t kp = (k + 1) / 2;
    const int64_t panels = n / NR, pairs = panels / 2, units = pairs + (panels - 2 * pairs);
    uint32_t *xp = (uint32_t *)malloc((size_t)(m * kp) * sizeof(uint32_t));
    if (!xp) return 1;
    /* Rows per block so that a block of pairs stays in L2 while the panels pass. */
    int64_t mb = 256 * 1024 / 4 / kp / MR * MR;
    if (mb < 4 * MR) mb = 4 * MR;
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
    static __thread uint32_t *pairs_buffer = NULL;
    static __thread size_t capacity = 0;
    static __thread const float *rounded_x = NULL; /* the rows the buffer holds: x, m, k */
    static __thread int64_t rounded_m = -1, rounded_k = -1;
    (void)format;
    if (n % NR != 0 || k < 1 || m < 0 || col0 < 0 || col1 > n || col0 > col1 ||
        col0 % NR != 0 || col1 % NR != 0)
        return 2;
    if (m == 0 || col0 == col1) return 0;
    const uint16_t *packed = (const uint16_t *)weights;
    const int64_t kp = (k + 1) / 2;
    const size_t need = (size_t)(m * kp);
    if (need > capacity) {
        uint32_t *bigger = (uint32_t *)realloc(pairs_buffer, need * sizeof(uint32_t));
        if (!bigger) return 1;
        pairs_buffer = bigger;
        capacity = need;
        rounded_x = NULL;
    }
    uint32_t *xp = pairs_buffer;
    if (!(same_x && rounded_x == x && rounded_m == m && rounded_k == k)) {
        round_rows(x, m, k, kp, xp);
        rounded_x = x, rounded_m = m, rounded_k = k;
    }
    int64_t mb = 256 * 1024 / 4 / kp / MR * MR;
    if (mb < 4 * MR) mb = 4 * MR;
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
