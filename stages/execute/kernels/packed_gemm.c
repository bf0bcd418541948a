/* fp32 GEMM for CPU linears over a pre-packed weight: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 * Built and loaded by stages/execute/native.py; used by stages/execute/cpu.py's PackedLinear.
 *
 * The weight is packed once, at load, into panels of NR = 16 output columns, each panel
 * [K][16] contiguous, so the inner loop streams one panel with two 8-float vector loads per k.
 * The micro-kernel keeps an MR x 16 block of y in registers (MR = 6: 12 accumulators, two
 * weight vectors and one broadcast, 15 of AVX2's 16 registers) and does MR broadcast FMAs per
 * weight vector: the register blocking of BLIS's Haswell sgemm kernel (6x16), written with
 * GCC vector extensions so it compiles for any vector unit. A panel (K * 64 bytes) stays in
 * L2 while every row block of x goes past it, so each weight is read from memory once per
 * call at decode's few rows, and rows are blocked by MB for long prefills. Threads split the
 * panels. Measured on 2 AVX2 cores against MKL (F.linear / W @ x^T): 1.4-1.7x at 16-64 rows,
 * 2-3x at 4-8 rows, 1.1-1.3x at 128-2048 rows (tests/stages/execute/test_native.py checks
 * it against F.linear). */
#include <stdint.h>

#define NR 16
#define MR 6
#define MB 768

typedef float vf __attribute__((vector_size(8 * sizeof(float)), aligned(4)));

/* packed[(p * K + k) * NR + j] = w[(p * NR + j) * K + k]; N must be a multiple of NR. */
void actorline_pack_weight_f32(const float *w, float *packed, int64_t n, int64_t k) {
    for (int64_t p = 0; p < n / NR; ++p)
        for (int64_t kk = 0; kk < k; ++kk)
            for (int j = 0; j < NR; ++j)
                packed[(p * k + kk) * NR + j] = w[(p * NR + j) * k + kk];
}

static inline __attribute__((always_inline)) void
micro(const float *restrict x, int64_t ldx, const float *restrict panel, int64_t k,
      const float *restrict bias, float *restrict y, int64_t ldy, const int mr) {
    vf acc0[MR], acc1[MR];
    const vf b0 = bias ? *(const vf *)bias : (vf){0};
    const vf b1 = bias ? *(const vf *)(bias + 8) : (vf){0};
    for (int i = 0; i < mr; ++i) {
        acc0[i] = b0;
        acc1[i] = b1;
    }
    for (int64_t kk = 0; kk < k; ++kk) {
        const vf w0 = *(const vf *)(panel + kk * NR);
        const vf w1 = *(const vf *)(panel + kk * NR + 8);
        for (int i = 0; i < mr; ++i) {
            const float xv = x[i * ldx + kk];
            acc0[i] += xv * w0;
            acc1[i] += xv * w1;
        }
    }
    for (int i = 0; i < mr; ++i) {
        *(vf *)(y + i * ldy) = acc0[i];
        *(vf *)(y + i * ldy + 8) = acc1[i];
    }
}

static void panel_rows(const float *x, int64_t rows, int64_t k, const float *panel,
                       const float *bias, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + MR <= rows; i += MR) micro(x + i * k, k, panel, k, bias, y + i * n, n, MR);
    switch ((int)(rows - i)) {
    case 1: micro(x + i * k, k, panel, k, bias, y + i * n, n, 1); break;
    case 2: micro(x + i * k, k, panel, k, bias, y + i * n, n, 2); break;
    case 3: micro(x + i * k, k, panel, k, bias, y + i * n, n, 3); break;
    case 4: micro(x + i * k, k, panel, k, bias, y + i * n, n, 4); break;
    case 5: micro(x + i * k, k, panel, k, bias, y + i * n, n, 5); break;
    default: break;
    }
}

/* x: [M, K] contiguous; packed: from actorline_pack_weight_f32; bias: [N] or NULL;
 * y: [M, N] contiguous. Returns 0, or 2 when N is not a multiple of NR. */
int actorline_packed_gemm_f32(const float *x, int64_t m, int64_t k, const float *packed,
                              const float *bias, int64_t n, float *y, int num_threads) {
    if (n % NR != 0 || k < 1) return 2;
    const int64_t panels = n / NR;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        const int64_t rows = m - m0 < MB ? m - m0 : MB;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p)
            panel_rows(x + m0 * k, rows, k, packed + p * k * NR, bias ? bias + p * NR : 0,
                       y + m0 * n + p * NR, n);
    }
    return 0;
}
