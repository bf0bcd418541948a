/* Weight-only quantized GEMM for CPU linears: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and y
 * fp32, W in 4 or 8 bits, dequantized inside the GEMM (docs/architecture.md §6.3). Built and
 * loaded by stages/execute/quant_kernel.py; the layouts are packed by
 * stages/execute/quantized.py.
 *
 * W is cut into panels of NR = 16 output columns and groups of G = 32 inputs; each (panel,
 * group) is one block record, the quants first, then one scale (and one offset) per column:
 *   Q8:  int8 q[32][16], fp16 d[16]                 w = d * q         (544 bytes, 8.5 bits)
 *   Q4:  uint8 q[16][16], fp16 d[16], fp16 m[16]    w = d * q + m     (320 bytes, 5 bits)
 *   Q4F: the same with fp32 d[16], m[16]                              (384 bytes, 6 bits)
 * In a Q4 quant byte q[kk][j] column j holds input 2kk in its low nibble and 2kk + 1 in its high
 * one. These are llama.cpp's Q8_0, Q4_1 and (with m = -8d) Q4_0 blocks of 32, transposed so that
 * one 16-byte load feeds 16 columns; Q4F holds Q4_K's sub-blocks, whose scales (d * sc, a
 * product of an fp16 and a 6-bit integer) need more than fp16.
 *
 * Few rows (decode, M <= DIRECT_ROWS): each row block of up to ROWS rows (8 with AVX-512's 32
 * vector registers, else 4) streams the panel's blocks once, widening the quants to float in registers and accumulating per group
 * sum_k x[k] q[k]; a group then adds d * that + m * sum_k x[k] (the row sums per group are
 * computed once per call). Weights are read once per call at 5 or 8.5 bits instead of 32, which
 * is what decode, bound by memory bandwidth, gains. More rows (prefill, big batches): each thread
 * dequantizes a panel into a [K][16] fp32 buffer that stays in L2, then runs a 6 x 16
 * register-blocked micro-kernel over the rows, as the fp32 packed GEMM does, so the dequant is
 * paid once per panel and row block. Threads split the panels. GCC vector extensions: one
 * source compiles to AVX-512, AVX2 or NEON. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* The 64-byte vectors are passed between inlined helpers only; no ABI crosses them. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define NR 16
#define GROUP 32
#if defined(__AVX512F__)
#define ROWS 8 /* rows per block on the direct path: 2 x 8 accumulators of AVX-512's 32 */
#else
#define ROWS 4 /* rows per block on the direct path: 2 x 4 accumulators of AVX2's 16 */
#endif
#define DIRECT_ROWS (2 * ROWS) /* up to this many rows: direct path; more: dequantized panels */
/* Block records prefetched ahead on the direct path, into L2 (as the fp32 packed GEMM prefetches
 * its panel rows: the out-of-order window alone keeps too few misses in flight). Over 30 cold
 * layers, Q8 at 1 / 8 rows 7.4 -> 5.0 / 11.0 -> 8.9 ms; Q4, bound by widening its nibbles,
 * level (docs/performance.md §4). */
#define PREFETCH_BLOCKS 8
#define MR 6
#define MB 768 /* rows per block on the panel path (x stays in cache) */

enum { FORMAT_Q8 = 0, FORMAT_Q4 = 1, FORMAT_Q4F = 2 };

typedef float vf __attribute__((vector_size(NR * sizeof(float)), aligned(4)));
typedef int32_t vi __attribute__((vector_size(NR * sizeof(int32_t)), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(NR * sizeof(uint32_t)), aligned(4)));
typedef uint8_t vb __attribute__((vector_size(NR), aligned(1)));
typedef int8_t vsb __attribute__((vector_size(NR), aligned(1)));
typedef uint16_t vh __attribute__((vector_size(NR * sizeof(uint16_t)), aligned(2)));

int64_t actorline_quant_block_bytes(int format) {
    switch (format) {
    case FORMAT_Q8: return GROUP * NR + NR * 2;
    case FORMAT_Q4: return GROUP / 2 * NR + 2 * NR * 2;
    case FORMAT_Q4F: return GROUP / 2 * NR + 2 * NR * 4;
    default: return -1;
    }
}

/* 16 bytes widened to 16 int32 lanes, zero- or sign-extended. GCC lowers a generic
 * __builtin_convertvector of bytes to 16 scalar loads, so x86 gets its widening loads. */
static inline vi widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    vi out;
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    memcpy(&out, &lo, sizeof lo);
    memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
    return out;
#else
    return __builtin_convertvector(*(const vb *)p, vi);
#endif
}

static inline vi widen_s8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    vi out;
    const __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    memcpy(&out, &lo, sizeof lo);
    memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
    return out;
#else
    return __builtin_convertvector(*(const vsb *)p, vi);
#endif
}

/* 16 fp16 values to fp32, exact for every finite value (subnormals included): the magnitude's
 * bits moved to fp32's exponent and mantissa fields, scaled by 2^112 (the exponent bias gap). */
static inline vf halves(const uint8_t *p) {
    const vu wide = __builtin_convertvector(*(const vh *)p, vu);
    const vu sign = (wide & 0x8000u) << 16;
    const vf magnitude = (vf)((wide & 0x7fffu) << 13) * 0x1p112f;
    return (vf)((vu)magnitude | sign);
}

static inline vf scales(const uint8_t *p, const int fp32) {
    return fp32 ? *(const vf *)p : halves(p);
}

/* The direct path: mr (<= ROWS) rows of x against one panel's blocks. */
static inline __attribute__((always_inline)) void
direct(const float *restrict x, int64_t ldx, const float *restrict sums, int64_t groups,
       const uint8_t *restrict blocks, int64_t block_bytes, const float *restrict bias,
       float *restrict y, int64_t ldy, const int mr, const int format) {
    vf acc[ROWS];
    for (int i = 0; i < mr; ++i) acc[i] = bias ? *(const vf *)bias : (vf){0};
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *block = blocks + g * block_bytes;
        for (int64_t c = 0; c < block_bytes; c += 64)
            __builtin_prefetch(block + PREFETCH_BLOCKS * block_bytes + c, 0, 2);
        const float *xg = x + g * GROUP;
        vf part[ROWS];
        for (int i = 0; i < mr; ++i) part[i] = (vf){0};
        if (format == FORMAT_Q8) {
            for (int kk = 0; kk < GROUP; ++kk) {
                const vf w = __builtin_convertvector(widen_s8(block + kk * NR), vf);
                for (int i = 0; i < mr; ++i) part[i] += xg[i * ldx + kk] * w;
            }
            const vf d = halves(block + GROUP * NR);
            for (int i = 0; i < mr; ++i) acc[i] += part[i] * d;
        } else {
            for (int kk = 0; kk < GROUP / 2; ++kk) {
                const vi wide = widen_u8(block + kk * NR);
                const vf lo = __builtin_convertvector(wide & 15, vf);
                const vf hi = __builtin_convertvector(wide >> 4, vf);
                for (int i = 0; i < mr; ++i)
                    part[i] += xg[i * ldx + 2 * kk] * lo + xg[i * ldx + 2 * kk + 1] * hi;
            }
            const int fp32 = format == FORMAT_Q4F;
            const uint8_t *s = block + GROUP / 2 * NR;
            const vf d = scales(s, fp32), m = scales(s + NR * (fp32 ? 4 : 2), fp32);
            for (int i = 0; i < mr; ++i) acc[i] += part[i] * d + sums[i * groups + g] * m;
        }
    }
    for (int i = 0; i < mr; ++i) *(vf *)(y + i * ldy) = acc[i];
}

#define DIRECT_CASE(MRV)                                                                      \
    case MRV:                                                                                 \
        if (format == FORMAT_Q8) DIRECT(MRV, FORMAT_Q8);                                       \
        else if (format == FORMAT_Q4) DIRECT(MRV, FORMAT_Q4);                                  \
        else DIRECT(MRV, FORMAT_Q4F);                                                          \
        break

static void direct_rows(const float *x, int64_t rows, int64_t k, const float *sums,
                        const uint8_t *blocks, int64_t block_bytes, const float *bias, float *y,
                        int64_t n, int format) {
    const int64_t groups = k / GROUP;
    for (int64_t i = 0; i < rows; i += ROWS) {
        const float *xi = x + i * k, *si = sums + i * groups;
        float *yi = y + i * n;
#define DIRECT(MRV, FMT) direct(xi, k, si, groups, blocks, block_bytes, bias, yi, n, MRV, FMT)
        switch (rows - i < ROWS ? (int)(rows - i) : ROWS) {
#if ROWS > 4
            DIRECT_CASE(8);
            DIRECT_CASE(7);
            DIRECT_CASE(6);
            DIRECT_CASE(5);
#endif
            DIRECT_CASE(4);
            DIRECT_CASE(3);
            DIRECT_CASE(2);
            DIRECT_CASE(1);
        default: break;
        }
#undef DIRECT
    }
}

/* One panel's blocks as fp32 [K][16] in panel. */
static void dequantize_panel(const uint8_t *blocks, int64_t block_bytes, int64_t groups,
                             int format, float *restrict panel) {
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *block = blocks + g * block_bytes;
        float *out = panel + g * GROUP * NR;
        if (format == FORMAT_Q8) {
            const vf d = halves(block + GROUP * NR);
            for (int kk = 0; kk < GROUP; ++kk)
                *(vf *)(out + kk * NR) = __builtin_convertvector(widen_s8(block + kk * NR), vf) * d;
        } else {
            const int fp32 = format == FORMAT_Q4F;
            const uint8_t *s = block + GROUP / 2 * NR;
            const vf d = scales(s, fp32), m = scales(s + NR * (fp32 ? 4 : 2), fp32);
            for (int kk = 0; kk < GROUP / 2; ++kk) {
                const vi wide = widen_u8(block + kk * NR);
                *(vf *)(out + 2 * kk * NR) = __builtin_convertvector(wide & 15, vf) * d + m;
                *(vf *)(out + (2 * kk + 1) * NR) = __builtin_convertvector(wide >> 4, vf) * d + m;
            }
        }
    }
}

static inline __attribute__((always_inline)) void
micro(const float *restrict x, int64_t ldx, const float *restrict panel, int64_t k,
      const float *restrict bias, float *restrict y, int64_t ldy, const int mr) {
    vf acc[MR];
    for (int i = 0; i < mr; ++i) acc[i] = bias ? *(const vf *)bias : (vf){0};
    for (int64_t kk = 0; kk < k; ++kk) {
        const vf w = *(const vf *)(panel + kk * NR);
        for (int i = 0; i < mr; ++i) acc[i] += x[i * ldx + kk] * w;
    }
    for (int i = 0; i < mr; ++i) *(vf *)(y + i * ldy) = acc[i];
}

static void panel_rows(const float *x, int64_t rows, int64_t k, const float *panel,
                       const float *bias, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + MR <= rows; i += MR) micro(x + i * k, k, panel, k, bias, y + i * n, n, MR);
    switch ((int)(rows - i)) {
    case 5: micro(x + i * k, k, panel, k, bias, y + i * n, n, 5); break;
    case 4: micro(x + i * k, k, panel, k, bias, y + i * n, n, 4); break;
    case 3: micro(x + i * k, k, panel, k, bias, y + i * n, n, 3); break;
    case 2: micro(x + i * k, k, panel, k, bias, y + i * n, n, 2); break;
    case 1: micro(x + i * k, k, panel, k, bias, y + i * n, n, 1); break;
    default: break;
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias). blocks: [N / 16][K / 32] block records of the format.
 * Returns 0 on success, 1 when scratch memory could not be allocated, 2 on arguments it
 * cannot serve. */
int actorline_quant_gemm(const float *x, int64_t m, int64_t k, const uint8_t *blocks, int format,
                         const float *bias, int64_t n, float *y, int num_threads) {
    const int64_t block_bytes = actorline_quant_block_bytes(format);
    if (block_bytes < 0 || m < 0 || k <= 0 || k % GROUP != 0 || n <= 0 || n % NR != 0)
        return 2;
    if (m == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    const int64_t groups = k / GROUP, panels = n / NR;
    const int64_t panel_bytes = groups * block_bytes;
    if (m <= DIRECT_ROWS) {
        float sums[DIRECT_ROWS * 1024];
        float *row_sums = sums;
        if (m * groups > DIRECT_ROWS * 1024) {
            row_sums = (float *)malloc(sizeof(float) * (size_t)(m * groups));
            if (row_sums == NULL) return 1;
        }
        for (int64_t i = 0; i < m; ++i)
            for (int64_t g = 0; g < groups; ++g) {
                float s = 0.0f;
                for (int j = 0; j < GROUP; ++j) s += x[i * k + g * GROUP + j];
                row_sums[i * groups + g] = s;
            }
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < panels; ++p)
            direct_rows(x, m, k, row_sums, blocks + p * panel_bytes, block_bytes,
                        bias ? bias + p * NR : NULL, y + p * NR, n, format);
        if (row_sums != sums) free(row_sums);
        return 0;
    }
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(k * NR) * (size_t)num_threads);
    if (scratch == NULL) return 1;
    for (int64_t r0 = 0; r0 < m; r0 += MB) {
        const int64_t rows = m - r0 < MB ? m - r0 : MB;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            float *panel = scratch + (size_t)(k * NR) * (size_t)omp_get_thread_num();
            dequantize_panel(blocks + p * panel_bytes, block_bytes, groups, format, panel);
            panel_rows(x + r0 * k, rows, k, panel, bias ? bias + p * NR : NULL,
                       y + r0 * n + p * NR, n);
        }
    }
    free(scratch);
    return 0;
}

/* Rows of W (inputs of an embedding tied to, or stored as, a quantized matrix): out[i] = W[ids[i]]
 * as fp32 [count][K], rounded as llama.cpp's dequantization (d * q, then + m: no fused
 * multiply-add), so the rows equal the dequantized checkpoint's bit for bit. Returns 2 on an id
 * outside [0, n) or bad arguments. */
__attribute__((optimize("fp-contract=off"))) int actorline_quant_rows(const uint8_t *blocks, int format, int64_t k, int64_t n,
                         const int64_t *ids, int64_t count, float *out) {
    const int64_t block_bytes = actorline_quant_block_bytes(format);
    if (block_bytes < 0 || k <= 0 || k % GROUP != 0 || n <= 0 || n % NR != 0) return 2;
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= n) return 2;
    const int64_t groups = k / GROUP;
    for (int64_t i = 0; i < count; ++i) {
        const int64_t p = ids[i] / NR, column = ids[i] % NR;
        const uint8_t *panel = blocks + p * groups * block_bytes;
        float *row = out + i * k;
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t *block = panel + g * block_bytes;
            float lanes[NR], offsets[NR];
            if (format == FORMAT_Q8) {
                *(vf *)lanes = halves(block + GROUP * NR);
                for (int kk = 0; kk < GROUP; ++kk)
                    row[g * GROUP + kk] = (float)(int8_t)block[kk * NR + column] * lanes[column];
            } else {
                const int fp32 = format == FORMAT_Q4F;
                const uint8_t *s = block + GROUP / 2 * NR;
                *(vf *)lanes = scales(s, fp32);
                *(vf *)offsets = scales(s + NR * (fp32 ? 4 : 2), fp32);
                for (int kk = 0; kk < GROUP / 2; ++kk) {
                    const uint8_t byte = block[kk * NR + column];
                    row[g * GROUP + 2 * kk] = (float)(byte & 15) * lanes[column] + offsets[column];
                    row[g * GROUP + 2 * kk + 1] = (float)(byte >> 4) * lanes[column] + offsets[column];
                }
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- packing GGUF blocks */

/* llama.cpp's GGML types this file reads (ggml.h: enum ggml_type). */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12 };

static inline float half_bits_to_float(uint16_t h) {
    union { uint32_t u; float f; } magnitude = {(uint32_t)(h & 0x7fffu) << 13}, out;
    out.f = magnitude.f * 0x1p112f;
    out.u |= (uint32_t)(h & 0x8000u) << 16;
    return out.f;
}

static inline uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static inline void write_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* Q4_K's 6-bit scale and min of sub-block j (ggml-quants.c: get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* The kernel's format for a GGML type, or -1. */
int actorline_quant_format_of(int ggml_type) {
    switch (ggml_type) {
    case GGML_Q8_0: return FORMAT_Q8;
    case GGML_Q4_0: case GGML_Q4_1: return FORMAT_Q4;
    case GGML_Q4_K: return FORMAT_Q4F;
    default: return -1;
    }
}

/* Pack n rows of a GGML tensor (raw: row r at raw + r * row_bytes, k inputs each) into the
 * kernel's block records: out [ceil(n / 16)][k / 32][block bytes], rows past n zero. Scales
 * are copied (fp16) or computed as llama.cpp computes them (Q4_K: d * sc and -(dmin * m) in
 * fp32; Q4_0: m = -8 d, exact in fp16). Returns 2 on a type or shape it cannot serve. */
__attribute__((optimize("fp-contract=off"))) int
actorline_quant_pack(const uint8_t *raw, int ggml_type, int64_t n, int64_t k, uint8_t *out) {
    const int format = actorline_quant_format_of(ggml_type);
    if (format < 0 || n <= 0 || k <= 0 || k % GROUP != 0) return 2;
    if (ggml_type == GGML_Q4_K && k % 256 != 0) return 2;
    const int64_t block_bytes = actorline_quant_block_bytes(format);
    const int64_t groups = k / GROUP, panels = (n + NR - 1) / NR;
    int64_t row_bytes;
    switch (ggml_type) {
    case GGML_Q8_0: row_bytes = groups * 34; break;
    case GGML_Q4_0: row_bytes = groups * 18; break;
    case GGML_Q4_1: row_bytes = groups * 20; break;
    default: row_bytes = k / 256 * 144; break;
    }
    memset(out, 0, (size_t)(panels * groups * block_bytes));
    for (int64_t r = 0; r < n; ++r) {
        const uint8_t *row = raw + r * row_bytes;
        const int64_t p = r / NR, j = r % NR;
        for (int64_t g = 0; g < groups; ++g) {
            uint8_t *block = out + (p * groups + g) * block_bytes;
            uint8_t values[GROUP];
            if (ggml_type == GGML_Q8_0) {
                const uint8_t *src = row + g * 34;
                for (int kk = 0; kk < GROUP; ++kk) block[kk * NR + j] = src[2 + kk];
                write_u16(block + GROUP * NR + 2 * j, read_u16(src));
                continue;
            }
            uint8_t *scale = block + GROUP / 2 * NR;
            if (ggml_type == GGML_Q4_K) {
                const uint8_t *super = row + (g / 8) * 144;
                const int sub = (int)(g % 8);
                uint8_t sc, mn;
                scale_min_k4(sub, super + 4, &sc, &mn);
                const float d = half_bits_to_float(read_u16(super)) * (float)sc;
                const float m = -(half_bits_to_float(read_u16(super + 2)) * (float)mn);
                memcpy(scale + 4 * j, &d, 4);
                memcpy(scale + NR * 4 + 4 * j, &m, 4);
                /* chunk sub / 2 of 64 values: low nibbles first, then high ones */
                const uint8_t *qs = super + 16 + (sub / 2) * 32;
                for (int kk = 0; kk < GROUP; ++kk)
                    values[kk] = sub % 2 ? (uint8_t)(qs[kk] >> 4) : (uint8_t)(qs[kk] & 15);
            } else {
                const int q4_1 = ggml_type == GGML_Q4_1;
                const uint8_t *src = row + g * (q4_1 ? 20 : 18);
                const uint16_t d = read_u16(src);
                uint16_t m;
                if (q4_1) {
                    m = read_u16(src + 2);
                } else {
                    /* -8 d in fp16: the exponent up by 3 (or a subnormal shifted), sign set */
                    const float v = -8.0f * half_bits_to_float(d);
                    union { float f; uint32_t u; } bits = {v};
                    const uint32_t mag = bits.u & 0x7fffffffu;
                    if (mag == 0) m = (uint16_t)((bits.u >> 16) & 0x8000u);
                    else if (mag >= 0x38800000u) { /* normal in fp16 */
                        if (mag > 0x477fe000u) return 2; /* overflows fp16 */
                        m = (uint16_t)(((bits.u >> 16) & 0x8000u) | ((mag - 0x38000000u) >> 13));
                    } else { /* fp16 subnormal: exact, as 8 d keeps d's few bits */
                        union { float f; uint32_t u; } sub_bits = {v < 0 ? -v : v};
                        sub_bits.f *= 0x1p24f;
                        m = (uint16_t)(((bits.u >> 16) & 0x8000u) | (uint32_t)sub_bits.f);
                    }
                }
                write_u16(scale + 2 * j, d);
                write_u16(scale + NR * 2 + 2 * j, m);
                const uint8_t *qs = src + (q4_1 ? 4 : 2);
                for (int kk = 0; kk < 16; ++kk) {
                    values[kk] = qs[kk] & 15;
                    values[kk + 16] = qs[kk] >> 4;
                }
            }
            for (int kk = 0; kk < GROUP / 2; ++kk)
                block[kk * NR + j] = (uint8_t)(values[2 * kk] | (values[2 * kk + 1] << 4));
        }
    }
    return 0;
}
