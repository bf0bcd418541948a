/* fp32 GEMM for CPU linears over a pre-packed weight: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 * Built and loaded by stages/execute/native.py; used by stages/execute/cpu.py's PackedLinear.
 *
 * The weight is packed once, at load, into panels of NR = 16 output columns, each panel
 * [K][16] contiguous, so the inner loop streams one panel row (16 floats, one cache line) per k.
 * The micro-kernel keeps an MR x 16 block of y in registers and does one broadcast FMA per row
 * and vector of the panel row: the register blocking of BLIS's sgemm micro-kernels, written
 * with GCC vector extensions and sized at compile time for the widest vector unit the compiler
 * targets (the library is built with -march=native where the compiler takes it):
 *
 *   AVX-512 (32 zmm):  two neighbouring panels at once, 12 rows x 2 vectors (24 accumulators,
 *                      micro_pair); a last odd panel and tails under 4 rows one panel at a
 *                      time, one 16-float vector per panel row, MR = 14 (14 accumulators);
 *   AVX2/AVX (16 ymm): two 8-float vectors,  MR = 6 (12 accumulators, BLIS's Haswell 6x16);
 *   NEON (32 q):       four 4-float vectors, MR = 6 (24 accumulators);
 *   other (SSE2, 16):  four 4-float vectors, MR = 2 (8 accumulators).
 *
 * A panel (K * 64 bytes) stays in L1/L2 while every row block of x goes past it, so each weight
 * is read from memory once per call at decode's few rows; long inputs are cut into row blocks
 * whose x fits in L2 (see row_block), each block once past every panel. Threads split the
 * panels. With fewer than 4 rows the k loop runs two accumulator sets (even and odd k), so the
 * FMA latency does not bound the few chains there are. tests/stages/execute/test_native.py
 * checks it against F.linear; `actorline bench roof` measures it against MKL at the model's
 * shapes (docs/performance.md §2). */
#include <stdint.h>

#define NR 16

#if defined(__AVX512F__)
#define LANES 16
#define MR 14
#elif defined(__AVX__)
#define LANES 8
#define MR 6
#elif defined(__ARM_NEON) || defined(__aarch64__)
#define LANES 4
#define MR 6
#else
#define LANES 4
#define MR 2
#endif
#define VPR (NR / LANES) /* vectors per panel row */
/* Panel rows (64-byte lines) prefetched ahead of the one being multiplied, into L2. A decode
 * step streams every weight from memory once; with a dozen rows of FMAs per line the core's
 * out-of-order window no longer reaches far enough ahead to keep enough misses in flight, and
 * the hardware prefetcher alone left 12-row GEMMs at half the bandwidth one row gets. Across a
 * panel's end the lines ahead are the next panel's, the next one this thread takes. Measured
 * over 30 layers of distinct weights (docs/performance.md §4): 12 rows 31 -> 22 ms, 64 rows
 * 71 -> 54 ms; one row (bandwidth-bound already) level. */
#define PREFETCH_ROWS 64

typedef float vf __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

/* The vector width and rows per micro-tile this build chose (for the benchmarks' reports). */
int actorline_gemm_lanes(void) { return LANES; }
int actorline_gemm_rows(void) { return MR; }

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
    vf acc[MR][VPR];
    vf bias_v[VPR];
    for (int v = 0; v < VPR; ++v) bias_v[v] = bias ? *(const vf *)(bias + v * LANES) : (vf){0};
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < VPR; ++v) acc[i][v] = bias_v[v];
    int64_t kk = 0;
    if (mr < 4) {
        /* Few rows: a second accumulator set for odd k doubles the independent FMA chains. */
        vf odd[MR][VPR];
        for (int i = 0; i < mr; ++i)
            for (int v = 0; v < VPR; ++v) odd[i][v] = (vf){0};
        for (; kk + 2 <= k; kk += 2) {
            const float *row = panel + kk * NR;
            __builtin_prefetch(row + PREFETCH_ROWS * NR, 0, 2);
            __builtin_prefetch(row + (PREFETCH_ROWS + 1) * NR, 0, 2);
            for (int v = 0; v < VPR; ++v) {
                const vf w0 = *(const vf *)(row + v * LANES);
                const vf w1 = *(const vf *)(row + NR + v * LANES);
                for (int i = 0; i < mr; ++i) {
                    acc[i][v] += x[i * ldx + kk] * w0;
                    odd[i][v] += x[i * ldx + kk + 1] * w1;
                }
            }
        }
        for (int i = 0; i < mr; ++i)
            for (int v = 0; v < VPR; ++v) acc[i][v] += odd[i][v];
    }
    for (; kk < k; ++kk) {
        vf w[VPR];
        __builtin_prefetch(panel + (kk + PREFETCH_ROWS) * NR, 0, 2);
        for (int v = 0; v < VPR; ++v) w[v] = *(const vf *)(panel + kk * NR + v * LANES);
        for (int i = 0; i < mr; ++i) {
            const float xv = x[i * ldx + kk];
            for (int v = 0; v < VPR; ++v) acc[i][v] += xv * w[v];
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < VPR; ++v) *(vf *)(y + i * ldy + v * LANES) = acc[i][v];
}

/* One micro-kernel call per case: each gets mr as a constant and its own register allocation. */
#define TAIL(r)                                                                                \
    case r: micro(x + i * k, k, panel, k, bias, y + i * n, n, (r) < MR ? (r) : 1); break;

static void panel_rows(const float *x, int64_t rows, int64_t k, const float *panel,
                       const float *bias, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + MR <= rows; i += MR) micro(x + i * k, k, panel, k, bias, y + i * n, n, MR);
    switch ((int)(rows - i)) {
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
        TAIL(8) TAIL(9) TAIL(10) TAIL(11) TAIL(12) TAIL(13) TAIL(14)
    default: break;
    }
}

#if LANES == 16
/* AVX-512: two neighbouring panels at once, a PAIR_MR x 32 block of y in 24 accumulators
 * (BLIS's Skylake-X sgemm tile is 32 x 12 the same way). Per k it loads two panel rows and
 * PAIR_MR broadcasts for 2 * PAIR_MR FMAs, where one panel's 14 x 16 tile loads 15 for 14: the
 * load ports, not the FMA units, bounded that tile at 65-72% of the FMA peak. Each y element
 * sums its k in the same order as micro's rows of 4 or more. */
#define PAIR_MR 12
#define PAIRS 1

static inline __attribute__((always_inline)) void
micro_pair(const float *restrict x, int64_t ldx, const float *restrict p0,
           const float *restrict p1, int64_t k, const float *restrict bias, float *restrict y,
           int64_t ldy, const int mr) {
    vf acc0[PAIR_MR], acc1[PAIR_MR];
    const vf b0 = bias ? *(const vf *)bias : (vf){0};
    const vf b1 = bias ? *(const vf *)(bias + NR) : (vf){0};
    for (int i = 0; i < mr; ++i) {
        acc0[i] = b0;
        acc1[i] = b1;
    }
    for (int64_t kk = 0; kk < k; ++kk) {
        __builtin_prefetch(p0 + (kk + PREFETCH_ROWS) * NR, 0, 2);
        __builtin_prefetch(p1 + (kk + PREFETCH_ROWS) * NR, 0, 2);
        const vf w0 = *(const vf *)(p0 + kk * NR);
        const vf w1 = *(const vf *)(p1 + kk * NR);
        for (int i = 0; i < mr; ++i) {
            const float xv = x[i * ldx + kk];
            acc0[i] += xv * w0;
            acc1[i] += xv * w1;
        }
    }
    for (int i = 0; i < mr; ++i) {
        *(vf *)(y + i * ldy) = acc0[i];
        *(vf *)(y + i * ldy + NR) = acc1[i];
    }
}

#define PAIR_TAIL(r) case r: micro_pair(x + i * k, k, p0, p1, k, bias, y + i * n, n, r); break;

/* Panels p0 and p1 = p0 + K * 16 (y's columns j and j + 16) over the rows; tails under 4 rows
 * go to micro panel by panel, whose two accumulator sets suit so few rows. */
static void pair_rows(const float *x, int64_t rows, int64_t k, const float *p0, const float *bias,
                      float *y, int64_t n) {
    const float *p1 = p0 + k * NR;
    int64_t i = 0;
    for (; i + PAIR_MR <= rows; i += PAIR_MR)
        micro_pair(x + i * k, k, p0, p1, k, bias, y + i * n, n, PAIR_MR);
    const int tail = (int)(rows - i);
    if (tail >= 4) {
        switch (tail) {
            PAIR_TAIL(4) PAIR_TAIL(5) PAIR_TAIL(6) PAIR_TAIL(7)
            PAIR_TAIL(8) PAIR_TAIL(9) PAIR_TAIL(10) PAIR_TAIL(11)
        default: break;
        }
    } else if (tail > 0) {
        panel_rows(x + i * k, tail, k, p0, bias, y + i * n, n);
        panel_rows(x + i * k, tail, k, p1, bias ? bias + NR : 0, y + i * n + NR, n);
    }
}
#define ROW_UNIT PAIR_MR
#else
#define PAIRS 0
#define ROW_UNIT MR
#endif

/* Rows per block so that a block of x (rows * k floats) stays in L2 while the panels pass. */
static int64_t row_block(int64_t k) {
    const int64_t budget = 384 * 1024 / (int64_t)sizeof(float);
    int64_t rows = budget / k / ROW_UNIT * ROW_UNIT;
    if (rows < 4 * ROW_UNIT) rows = 4 * ROW_UNIT;
    return rows;
}

/* x: [M, K] contiguous; packed: from actorline_pack_weight_f32; bias: [N] or NULL;
 * y: [M, N] contiguous. Returns 0, or 2 when N is not a multiple of NR. */
int actorline_packed_gemm_f32(const float *x, int64_t m, int64_t k, const float *packed,
                              const float *bias, int64_t n, float *y, int num_threads) {
    if (n % NR != 0 || k < 1) return 2;
    const int64_t panels = n / NR;
    /* Work units: pairs of panels where the build pairs them (then a last odd panel alone). */
    const int64_t pairs = PAIRS ? panels / 2 : 0;
    const int64_t units = pairs + (panels - 2 * pairs);
    const int64_t mb = row_block(k);
    if (num_threads < 1) num_threads = 1;
    if (num_threads > units) num_threads = (int)units;
#pragma omp parallel num_threads(num_threads)
    for (int64_t m0 = 0; m0 < m; m0 += mb) {
        const int64_t rows = m - m0 < mb ? m - m0 : mb;
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < units; ++u) {
            const int64_t p = u < pairs ? 2 * u : 2 * pairs + (u - pairs);
            const float *xb = x + m0 * k, *panel = packed + p * k * NR;
            const float *b = bias ? bias + p * NR : 0;
            float *yb = y + m0 * n + p * NR;
#if PAIRS
            if (u < pairs) {
                pair_rows(xb, rows, k, panel, b, yb, n);
                continue;
            }
#endif
            panel_rows(xb, rows, k, panel, b, yb, n);
        }
    }
    return 0;
}

/* The same GEMM under the calling convention every native linear shares (the quantized GEMM's:
 * a weight pointer and a format code), so that code calling linears from C (the CPU step
 * graph) calls each through one function-pointer type; ``format`` is unused here (fp32). */
int actorline_packed_gemm(const float *x, int64_t m, int64_t k, const void *packed, int format,
                          const float *bias, int64_t n, float *y, int num_threads) {
    (void)format;
    return actorline_packed_gemm_f32(x, m, k, (const float *)packed, bias, n, y, num_threads);
}

/* Output columns [col0, col1) of the same GEMM on the calling thread, no OpenMP region: the CPU
 * step graph's threads each compute their share inside the one region of a step (stages/
 * execute/native.py: NativeGemm.part). col0 a multiple of 32 and col1 one of 32 or n, so that
 * a panel is paired with the same neighbour as in the whole call and every y element sums its
 * k in the same order: the same results bit for bit. same_x (the rows unchanged since this
 * thread's last call) is unused: fp32 rows are read as they are. Returns 0; 2 on a range or
 * shape it cannot serve. */
int actorline_packed_gemm_part(const float *x, int64_t m, int64_t k, const void *weights,
                               int format, const float *bias, int64_t n, float *y, int64_t col0,
                               int64_t col1, int same_x) {
    (void)format;
    (void)same_x;
    if (n % NR != 0 || k < 1 || m < 0 || col0 < 0 || col1 > n || col0 > col1 ||
        col0 % (2 * NR) != 0 || (col1 % (2 * NR) != 0 && col1 != n))
        return 2;
    const float *packed = (const float *)weights;
#if PAIRS
    const int64_t pairs = n / NR / 2;
#endif
    const int64_t mb = row_block(k);
    for (int64_t m0 = 0; m0 < m; m0 += mb) {
        const int64_t rows = m - m0 < mb ? m - m0 : mb;
        for (int64_t p = col0 / NR; p < col1 / NR;) {
            const float *xb = x + m0 * k, *panel = packed + p * k * NR;
            const float *b = bias ? bias + p * NR : 0;
            float *yb = y + m0 * n + p * NR;
#if PAIRS
            if (p < 2 * pairs) {
                pair_rows(xb, rows, k, panel, b, yb, n);
                p += 2;
                continue;
            }
#endif
            panel_rows(xb, rows, k, panel, b, yb, n);
            p += 1;
        }
    }
    return 0;
}
