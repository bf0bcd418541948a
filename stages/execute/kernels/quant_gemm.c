/* Quantized GEMM for CPU linears: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and y fp32, W in 4 or
 * 8 bits (docs/architecture.md §6.3). Built and loaded by stages/execute/quant/kernel.py; the
 * layouts are packed from llama.cpp's blocks by actorline_quant_pack below.
 *
 * W is cut into panels of NR = 16 output columns and groups of G = 32 inputs; each (panel,
 * group) is one block record, the quants first, in chunks of 64 bytes (16 columns x 4 bytes),
 * then one scale (and one offset) per column:
 *   Q8:  int8 q[8][16][4], fp16 d[16]               w = d * q         (544 bytes, 8.5 bits)
 *   Q4:  uint8 q[4][16][4], fp16 d[16], fp16 m[16]  w = d * q + m     (320 bytes, 5 bits)
 *   Q4F: the same with fp32 d[16], m[16]                              (384 bytes, 6 bits)
 * Q8 chunk c holds inputs 4c..4c+3 of each column in 4 consecutive bytes; Q4 chunk c holds
 * inputs 8c+t in the low nibble of byte t and 8c+4+t in its high one. One 64-byte load then
 * feeds 16 columns, as 16 int32 lanes of 4 inputs each: what VNNI's vpdpbusd multiplies with 4
 * int8 activations (llama.cpp's ggml-cpu/arch/x86/quants.c interleaves its repacked blocks the
 * same way), and what shifts widen to floats elsewhere. These are llama.cpp's Q8_0, Q4_1 and
 * (with m = -8d) Q4_0 blocks of 32, transposed; Q4F holds Q4_K's sub-blocks, whose scales
 * (d * sc, a product of an fp16 and a 6-bit integer) need more than fp16.
 *
 * Two kinds of activations, chosen per call by the ACT_Q8 bit of the format code:
 * - fp32 (weight-only; exact up to fp32 rounding): few rows (decode, M <= DIRECT_ROWS): each row
 *   block of up to ROWS rows streams the panel's blocks once, widening the quants to float in
 *   registers and accumulating per group sum_k x[k] q[k]; a group then adds d * that + m *
 *   sum_k x[k]. More rows: each thread dequantizes a panel into a [K][16] fp32 buffer that
 *   stays in L2, then runs an MR x 16 register-blocked micro-kernel over the rows (14 x 16
 *   with AVX-512's 32 registers, else 6 x 16), as the fp32 packed GEMM does.
 * - int8 (ACT_Q8), llama.cpp's way (ggml-quants.c quantize_row_q8_0_ref, then vec_dot_q8_0_q8_0
 *   and vec_dot_q4_1_q8_1): each row of x is quantized once per call to int8 blocks of 32 with
 *   an fp16 scale dx (d = max|x| / 127, q = roundf(x / d)), the dot products are integer (4
 *   inputs per int32 lane: vpdpbusd with AVX512-VNNI or AVX-VNNI, vpmaddubsw + vpmaddwd on
 *   AVX2 (the two-halves section), plain integer vectors elsewhere, the same sums), and each
 *   group adds d dx isum (+ m dx sum_k q_x[k]) in fp32.
 *   Rows go in blocks of ROWS against a panel (at any M: the panel stays in L1, x's int8 rows
 *   in L2 by blocks of QMB rows).
 * Threads split the panels. GCC vector extensions: one source compiles to AVX-512, AVX2 or
 * NEON (little-endian: a chunk's bytes are read as int32 lanes); AVX2 without AVX-512 runs
 * its hot loops on 8-lane halves (see "AVX2 without AVX-512" below). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "quant_gemm.c reads its 64-byte chunks as little-endian int32 lanes"
#endif
/* The 64-byte vectors are passed between inlined helpers only; no ABI crosses them. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define NR 16
#define GROUP 32
#define CHUNK 64 /* bytes of 16 columns x 4 */
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
#if defined(__AVX512F__)
#define MR 14 /* rows per micro-tile on the panel path: 14 accumulators, as packed_gemm.c's */
#else
#define MR 6 /* BLIS's Haswell 6 x 16: 12 ymm accumulators */
#endif
#define MB 768  /* rows per block on the panel path (x stays in cache) */
#define QMB 256 /* rows per block on the int8 path (their int8 rows stay in L2) */

enum { FORMAT_Q8 = 0, FORMAT_Q4 = 1, FORMAT_Q4F = 2, FORMAT_MASK = 15, ACT_Q8 = 16 };

typedef float vf __attribute__((vector_size(NR * sizeof(float)), aligned(4)));
typedef int32_t vi __attribute__((vector_size(NR * sizeof(int32_t)), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(NR * sizeof(uint32_t)), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(NR * sizeof(uint16_t)), aligned(2)));

int64_t actorline_quant_block_bytes(int format) {
    switch (format) {
    case FORMAT_Q8: return GROUP * NR + NR * 2;
    case FORMAT_Q4: return GROUP / 2 * NR + 2 * NR * 2;
    case FORMAT_Q4F: return GROUP / 2 * NR + 2 * NR * 4;
    default: return -1;
    }
}

/* 1 where the int8 dot products run on VNNI instructions (compiled in), else 0 (they run on
 * plain integer vectors: the same sums, slower). */
int actorline_quant_vnni(void) {
#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || defined(__AVXVNNI__)
    return 1;
#else
    return 0;
#endif
}

/* What the int8 dot products run on: 2 VNNI (vpdpbusd), 1 AVX2's vpmaddubsw + vpmaddwd (the
 * two-halves path below), 0 plain integer vectors (the same sums, several times slower: the
 * int8 activations do not pay there). */
int actorline_quant_int8_dot(void) {
#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || defined(__AVXVNNI__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* Byte offsets of input kk of column j in a record's quants. */
static inline int q8_at(int kk, int j) { return (kk >> 2) * CHUNK + j * 4 + (kk & 3); }
static inline int q4_at(int kk, int j) { return (kk >> 3) * CHUNK + j * 4 + (kk & 3); }

static inline vi load_chunk(const uint8_t *p) {
    vi v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Byte t of each lane, sign-extended (Q8 quants) or a nibble of it (Q4). */
static inline vf q8_input(vi v, int t) { return __builtin_convertvector((v << (24 - 8 * t)) >> 24, vf); }
static inline vf q4_input(vi v, int t) { return __builtin_convertvector((v >> (8 * (t & 3) + 4 * (t >> 2))) & 15, vf); }

/* acc + per int32 lane, the sum over its 4 bytes of a's (unsigned) times b's (signed). */
static inline vi dot4(vi acc, vi a, vi b) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif defined(__AVXVNNI__)
    __m256i acc2[2], a2[2], b2[2];
    memcpy(acc2, &acc, sizeof acc);
    memcpy(a2, &a, sizeof a);
    memcpy(b2, &b, sizeof b);
    acc2[0] = _mm256_dpbusd_avx_epi32(acc2[0], a2[0], b2[0]);
    acc2[1] = _mm256_dpbusd_avx_epi32(acc2[1], a2[1], b2[1]);
    memcpy(&acc, acc2, sizeof acc);
    return acc;
#else
    for (int t = 0; t < 4; ++t) acc += ((a >> (8 * t)) & 255) * ((b << (24 - 8 * t)) >> 24);
    return acc;
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

/* ---------------------------------------------------------------- AVX2 without AVX-512
 * GCC 12 lowers the 64-byte vectors above piecewise where the widest registers are 256 bits:
 * arrays of them (the accumulators) live on the stack and move through general registers
 * (vmovq / vpinsrq per 16 bytes), which left every path 2-15x slower than the fp32 packed GEMM
 * on an AVX2-only Zen 3 (docs/performance.md §12.4). There the hot loops below hold the 16
 * columns as two 8-lane halves, and the int8 dot products use vpmaddubsw (unsigned x signed
 * byte pairs to int16) and vpmaddwd with ones (int16 pairs to int32), as llama.cpp's AVX2
 * vec_dot_q4_1_q8_1 and vec_dot_q8_0_q8_0 do (ggml-cpu/arch/x86/quants.c: mul_sum_us8_pairs,
 * mul_sum_i8_pairs): Q4's nibbles are unsigned already; a Q8 weight's sign moves onto the
 * activation (vpsignb) so that |w| is the unsigned side. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define HALVES 1
#else
#define HALVES 0
#endif

#if HALVES
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { return (v8f)_mm256_loadu_ps(p); }
static inline void store8(float *p, v8f v) { _mm256_storeu_ps(p, (__m256)v); }
static inline __m256i load_bytes(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 8 fp16 values to fp32, exactly (as halves above). */
static inline v8f halves8(const uint8_t *p) {
    const v8u wide = (v8u)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    const v8u sign = (wide & 0x8000u) << 16;
    const v8f magnitude = (v8f)((wide & 0x7fffu) << 13) * 0x1p112f;
    return (v8f)((v8u)magnitude | sign);
}

static inline v8f scales8(const uint8_t *p, const int fp32) {
    return fp32 ? load8((const float *)p) : halves8(p);
}

/* v held in a register here: GCC otherwise reassociates a group's integer sums, computing
 * every product of the unrolled loop before adding any, and spills them to the stack. */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

static inline __m256i word_of(const int8_t *p) {
    int32_t word;
    memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
}

/* direct_q on two halves: mr (<= ROWS) rows of quantized x (signed quants: no flip) against
 * one panel's blocks. */
static inline __attribute__((always_inline)) void
direct_q8(const int8_t *restrict xq, int64_t ldq, const float *restrict dx,
          const float *restrict sx, int64_t groups, const uint8_t *restrict blocks,
          int64_t block_bytes, const float *restrict bias, float *restrict y, int64_t ldy,
          const int mr, const int format) {
    v8f acc[ROWS][2];
    for (int i = 0; i < mr; ++i)
        for (int h = 0; h < 2; ++h) acc[i][h] = bias ? load8(bias + 8 * h) : (v8f){0};
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
    (void)ones; /* AVX-VNNI sums its int32 lanes without it */
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *block = blocks + g * block_bytes;
        for (int64_t c = 0; c < block_bytes; c += 64)
            __builtin_prefetch(block + PREFETCH_BLOCKS * block_bytes + c, 0, 2);
        const int8_t *xg = xq + g * GROUP;
        __m256i isum[ROWS][2];
        for (int i = 0; i < mr; ++i) isum[i][0] = isum[i][1] = _mm256_setzero_si256();
        if (format == FORMAT_Q8) {
            /* |w| x (x signed as w): 2 x 128 x 127 fits int16; int32 sums per chunk */
            for (int c = 0; c < GROUP / 4; ++c) {
                __m256i w[2], a[2];
                for (int h = 0; h < 2; ++h) {
                    w[h] = load_bytes(block + c * CHUNK + 32 * h);
                    a[h] = _mm256_sign_epi8(w[h], w[h]);
                }
                for (int i = 0; i < mr; ++i) {
                    const __m256i xw = word_of(xg + i * ldq + 4 * c);
                    for (int h = 0; h < 2; ++h) {
#if defined(__AVXVNNI__)
                        isum[i][h] = _mm256_dpbusd_avx_epi32(isum[i][h], a[h],
                                                             _mm256_sign_epi8(xw, w[h]));
#else
                        isum[i][h] = _mm256_add_epi32(
                            isum[i][h],
                            _mm256_madd_epi16(
                                _mm256_maddubs_epi16(a[h], _mm256_sign_epi8(xw, w[h])), ones));
#endif
                        IN_REGISTER(isum[i][h]);
                    }
                }
            }
        } else {
            /* nibbles (0..15) x |x| <= 127: the group's 32 products per lane pair sum to at
             * most 16 x 15 x 127 = 30480, so int16 holds the whole group; one vpmaddwd at its
             * end */
            for (int c = 0; c < GROUP / 8; ++c) {
                __m256i lo[2], hi[2];
                for (int h = 0; h < 2; ++h) {
                    const __m256i w = load_bytes(block + c * CHUNK + 32 * h);
                    lo[h] = _mm256_and_si256(w, nibble);
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
                }
                for (int i = 0; i < mr; ++i) {
                    const __m256i xl = word_of(xg + i * ldq + 8 * c);
                    const __m256i xh = word_of(xg + i * ldq + 8 * c + 4);
                    for (int h = 0; h < 2; ++h) {
#if defined(__AVXVNNI__)
                        isum[i][h] = _mm256_dpbusd_avx_epi32(
                            _mm256_dpbusd_avx_epi32(isum[i][h], lo[h], xl), hi[h], xh);
#else
                        isum[i][h] = _mm256_add_epi16(
                            isum[i][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                         _mm256_maddubs_epi16(hi[h], xh)));
#endif
                        IN_REGISTER(isum[i][h]);
                    }
                }
            }
#if !defined(__AVXVNNI__)
            for (int i = 0; i < mr; ++i)
                for (int h = 0; h < 2; ++h) isum[i][h] = _mm256_madd_epi16(isum[i][h], ones);
#endif
        }
        if (format == FORMAT_Q8) {
            const v8f d[2] = {halves8(block + GROUP * NR), halves8(block + GROUP * NR + 16)};
            for (int i = 0; i < mr; ++i)
                for (int h = 0; h < 2; ++h)
                    acc[i][h] += (v8f)_mm256_cvtepi32_ps(isum[i][h]) * (d[h] * dx[i * groups + g]);
        } else {
            const int fp32 = format == FORMAT_Q4F, width = fp32 ? 4 : 2;
            const uint8_t *s = block + GROUP / 2 * NR;
            const v8f d[2] = {scales8(s, fp32), scales8(s + 8 * width, fp32)};
            const v8f m[2] = {scales8(s + NR * width, fp32), scales8(s + NR * width + 8 * width, fp32)};
            for (int i = 0; i < mr; ++i)
                for (int h = 0; h < 2; ++h)
                    acc[i][h] += (v8f)_mm256_cvtepi32_ps(isum[i][h]) * (d[h] * dx[i * groups + g]) +
                                 sx[i * groups + g] * m[h];
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int h = 0; h < 2; ++h) store8(y + i * ldy + 8 * h, acc[i][h]);
}

/* Byte t of each lane of a 32-byte half, sign-extended (Q8) or a nibble of it (Q4), as floats. */
static inline v8f q8_input8(v8i v, int t) { return __builtin_convertvector((v << (24 - 8 * t)) >> 24, v8f); }
static inline v8f q4_input8(v8i v, int t) { return __builtin_convertvector((v >> (8 * (t & 3) + 4 * (t >> 2))) & 15, v8f); }

/* direct on two halves: mr (<= ROWS) rows of fp32 x against one panel's blocks. */
static inline __attribute__((always_inline)) void
direct8(const float *restrict x, int64_t ldx, const float *restrict sums, int64_t groups,
        const uint8_t *restrict blocks, int64_t block_bytes, const float *restrict bias,
        float *restrict y, int64_t ldy, const int mr, const int format) {
    v8f acc[ROWS][2];
    for (int i = 0; i < mr; ++i)
        for (int h = 0; h < 2; ++h) acc[i][h] = bias ? load8(bias + 8 * h) : (v8f){0};
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *block = blocks + g * block_bytes;
        for (int64_t c = 0; c < block_bytes; c += 64)
            __builtin_prefetch(block + PREFETCH_BLOCKS * block_bytes + c, 0, 2);
        const float *xg = x + g * GROUP;
        v8f part[ROWS][2];
        for (int i = 0; i < mr; ++i) part[i][0] = part[i][1] = (v8f){0};
        const int q8 = format == FORMAT_Q8, per_chunk = q8 ? 4 : 8;
        for (int c = 0; c < GROUP / per_chunk; ++c) {
            v8i v[2];
            for (int h = 0; h < 2; ++h) v[h] = (v8i)load_bytes(block + c * CHUNK + 32 * h);
            for (int t = 0; t < per_chunk; ++t) {
                v8f w[2];
                for (int h = 0; h < 2; ++h) w[h] = q8 ? q8_input8(v[h], t) : q4_input8(v[h], t);
                for (int i = 0; i < mr; ++i) {
                    const float xv = xg[i * ldx + per_chunk * c + t];
                    for (int h = 0; h < 2; ++h) part[i][h] += xv * w[h];
                }
            }
        }
        if (q8) {
            const v8f d[2] = {halves8(block + GROUP * NR), halves8(block + GROUP * NR + 16)};
            for (int i = 0; i < mr; ++i)
                for (int h = 0; h < 2; ++h) acc[i][h] += part[i][h] * d[h];
        } else {
            const int fp32 = format == FORMAT_Q4F, width = fp32 ? 4 : 2;
            const uint8_t *s = block + GROUP / 2 * NR;
            const v8f d[2] = {scales8(s, fp32), scales8(s + 8 * width, fp32)};
            const v8f m[2] = {scales8(s + NR * width, fp32), scales8(s + NR * width + 8 * width, fp32)};
            for (int i = 0; i < mr; ++i)
                for (int h = 0; h < 2; ++h)
                    acc[i][h] += part[i][h] * d[h] + sums[i * groups + g] * m[h];
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int h = 0; h < 2; ++h) store8(y + i * ldy + 8 * h, acc[i][h]);
}
#endif

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
            for (int c = 0; c < GROUP / 4; ++c) {
                const vi v = load_chunk(block + c * CHUNK);
                for (int t = 0; t < 4; ++t) {
                    const vf w = q8_input(v, t);
                    for (int i = 0; i < mr; ++i) part[i] += xg[i * ldx + 4 * c + t] * w;
                }
            }
            const vf d = halves(block + GROUP * NR);
            for (int i = 0; i < mr; ++i) acc[i] += part[i] * d;
        } else {
            for (int c = 0; c < GROUP / 8; ++c) {
                const vi v = load_chunk(block + c * CHUNK);
                for (int t = 0; t < 8; ++t) {
                    const vf w = q4_input(v, t);
                    for (int i = 0; i < mr; ++i) part[i] += xg[i * ldx + 8 * c + t] * w;
                }
            }
            const int fp32 = format == FORMAT_Q4F;
            const uint8_t *s = block + GROUP / 2 * NR;
            const vf d = scales(s, fp32), m = scales(s + NR * (fp32 ? 4 : 2), fp32);
            for (int i = 0; i < mr; ++i) acc[i] += part[i] * d + sums[i * groups + g] * m;
        }
    }
    for (int i = 0; i < mr; ++i) *(vf *)(y + i * ldy) = acc[i];
}

/* The int8 path: mr (<= ROWS) rows of quantized x (xq, ldq bytes apart; scales dx and, for Q4's
 * offsets, sx = dx * sum of the group's quants) against one panel's blocks. */
static inline __attribute__((always_inline)) void
direct_q(const int8_t *restrict xq, int64_t ldq, const float *restrict dx,
         const float *restrict sx, int64_t groups, const uint8_t *restrict blocks,
         int64_t block_bytes, const float *restrict bias, float *restrict y, int64_t ldy,
         const int mr, const int format) {
    vf acc[ROWS];
    for (int i = 0; i < mr; ++i) acc[i] = bias ? *(const vf *)bias : (vf){0};
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *block = blocks + g * block_bytes;
        for (int64_t c = 0; c < block_bytes; c += 64)
            __builtin_prefetch(block + PREFETCH_BLOCKS * block_bytes + c, 0, 2);
        const int8_t *xg = xq + g * GROUP;
        vi isum[ROWS];
        for (int i = 0; i < mr; ++i) isum[i] = (vi){0};
        if (format == FORMAT_Q8) {
            /* vpdpbusd multiplies unsigned by signed bytes: x comes in as x + 128 (quantize_rows
             * flipped its sign bits), and 128 times the column's sum of quants comes off. */
            vi wsum = (vi){0};
            const vi ones = (vi){0} + 0x01010101;
            for (int c = 0; c < GROUP / 4; ++c) {
                const vi w = load_chunk(block + c * CHUNK);
                wsum = dot4(wsum, ones, w);
                for (int i = 0; i < mr; ++i) {
                    int32_t word; /* x + 128, as quantize_rows stored it */
                    memcpy(&word, xg + i * ldq + 4 * c, 4);
                    isum[i] = dot4(isum[i], (vi){0} + word, w);
                }
            }
            const vf d = halves(block + GROUP * NR);
            for (int i = 0; i < mr; ++i)
                acc[i] += __builtin_convertvector(isum[i] - (wsum << 7), vf) * (d * dx[i * groups + g]);
        } else {
            for (int c = 0; c < GROUP / 8; ++c) {
                const vi v = load_chunk(block + c * CHUNK);
                const vi lo = v & 0x0f0f0f0f, hi = (v >> 4) & 0x0f0f0f0f;
                for (int i = 0; i < mr; ++i) {
                    int32_t low, high;
                    memcpy(&low, xg + i * ldq + 8 * c, 4);
                    memcpy(&high, xg + i * ldq + 8 * c + 4, 4);
                    isum[i] = dot4(dot4(isum[i], lo, (vi){0} + low), hi, (vi){0} + high);
                }
            }
            const int fp32 = format == FORMAT_Q4F;
            const uint8_t *s = block + GROUP / 2 * NR;
            const vf d = scales(s, fp32), m = scales(s + NR * (fp32 ? 4 : 2), fp32);
            for (int i = 0; i < mr; ++i)
                acc[i] += __builtin_convertvector(isum[i], vf) * (d * dx[i * groups + g]) +
                          sx[i * groups + g] * m;
        }
    }
    for (int i = 0; i < mr; ++i) *(vf *)(y + i * ldy) = acc[i];
}

#if HALVES
#define DIRECT_FN direct8
#define DIRECT_Q_FN direct_q8
#define Q8_FLIP 0 /* direct_q8 moves a Q8 weight's sign onto signed activations */
#else
#define DIRECT_FN direct
#define DIRECT_Q_FN direct_q
#define Q8_FLIP 1 /* dot4 multiplies unsigned activations (x + 128) by the signed quants */
#endif

#define ROW_CASES(CALL)                                                                      \
    CALL(1) CALL(2) CALL(3) CALL(4)                                                           \
    ROW_CASES_WIDE(CALL)
#if ROWS > 4
#define ROW_CASES_WIDE(CALL) CALL(5) CALL(6) CALL(7) CALL(8)
#else
#define ROW_CASES_WIDE(CALL)
#endif

static void direct_rows(const float *x, int64_t rows, int64_t k, const float *sums,
                        const uint8_t *blocks, int64_t block_bytes, const float *bias, float *y,
                        int64_t n, int format) {
    const int64_t groups = k / GROUP;
    for (int64_t i = 0; i < rows; i += ROWS) {
        const float *xi = x + i * k, *si = sums + i * groups;
        float *yi = y + i * n;
        const int mr = rows - i < ROWS ? (int)(rows - i) : ROWS;
#define DIRECT(MRV)                                                                           \
    case MRV:                                                                                 \
        if (format == FORMAT_Q8)                                                              \
            DIRECT_FN(xi, k, si, groups, blocks, block_bytes, bias, yi, n, MRV, FORMAT_Q8);   \
        else if (format == FORMAT_Q4)                                                         \
            DIRECT_FN(xi, k, si, groups, blocks, block_bytes, bias, yi, n, MRV, FORMAT_Q4);   \
        else                                                                                  \
            DIRECT_FN(xi, k, si, groups, blocks, block_bytes, bias, yi, n, MRV, FORMAT_Q4F);  \
        break;
        switch (mr) {
            ROW_CASES(DIRECT)
        default: break;
        }
#undef DIRECT
    }
}

static void direct_rows_q(const int8_t *xq, const float *dx, const float *sx, int64_t rows,
                          int64_t k, const uint8_t *blocks, int64_t block_bytes,
                          const float *bias, float *y, int64_t n, int format) {
    const int64_t groups = k / GROUP;
    for (int64_t i = 0; i < rows; i += ROWS) {
        const int8_t *xi = xq + i * k;
        const float *di = dx + i * groups, *si = sx + i * groups;
        float *yi = y + i * n;
        const int mr = rows - i < ROWS ? (int)(rows - i) : ROWS;
#define DIRECT_Q(MRV)                                                                          \
    case MRV:                                                                                  \
        if (format == FORMAT_Q8)                                                               \
            DIRECT_Q_FN(xi, k, di, si, groups, blocks, block_bytes, bias, yi, n, MRV, FORMAT_Q8); \
        else if (format == FORMAT_Q4)                                                          \
            DIRECT_Q_FN(xi, k, di, si, groups, blocks, block_bytes, bias, yi, n, MRV, FORMAT_Q4); \
        else                                                                                   \
            DIRECT_Q_FN(xi, k, di, si, groups, blocks, block_bytes, bias, yi, n, MRV, FORMAT_Q4F);\
        break;
        switch (mr) {
            ROW_CASES(DIRECT_Q)
        default: break;
        }
#undef DIRECT_Q
    }
}

/* fp32 to the nearest fp16 value (ties to even), back in fp32: d >= 0 and finite. */
static inline float round_to_half(float d) {
    if (d < 0x1p-14f) return rintf(d * 0x1p24f) * 0x1p-24f; /* fp16 subnormals: steps of 2^-24 */
    if (d >= 65520.0f) return INFINITY;
    uint32_t u;
    memcpy(&u, &d, 4);
    u += 0xfffu + ((u >> 13) & 1u);
    u &= ~0x1fffu;
    memcpy(&d, &u, 4);
    return d;
}

/* Horizontal sum and maximum of 16 lanes (the maximum of non-negative lanes: floats' bits). */
static inline int32_t lanes_sum(vi v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

static inline vi lanes_larger(vi a, vi b) {
    const vi larger = a > b;
    return (a & larger) | (b & ~larger);
}

static inline int32_t lanes_max(vi v) {
    v = lanes_larger(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = lanes_larger(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = lanes_larger(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = lanes_larger(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

/* Rows of x quantized as llama.cpp's quantize_row_q8_0_ref: per group of 32, d = max|x| / 127,
 * q = roundf(x * (1 / d)) (halves away from zero), the scale kept as fp16 (dx); sx = dx * sum q
 * (Q4_1's offset term, as q8_1's s but in fp32). With flip, the quants are stored as q + 128
 * (unsigned: their sign bit flipped), as the Q8 weights' dot products take them. */
static void quantize_rows(const float *x, int64_t rows, int64_t k, int flip, int8_t *xq,
                          float *dx, float *sx) {
    typedef int8_t vq __attribute__((vector_size(NR), aligned(1)));
    const int64_t groups = k / GROUP;
#if HALVES /* the same arithmetic on 4 x 8 lanes (the 64-byte vectors spill on AVX2) */
    typedef int8_t vq8 __attribute__((vector_size(8), aligned(1)));
    const vq8 flip8 = (vq8){0} + (int8_t)(flip ? -128 : 0);
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = x + i * k + g * GROUP;
            v8f part[4];
            v8i top = {0};
            for (int p = 0; p < 4; ++p) {
                part[p] = load8(xg + 8 * p);
                const v8i bits = (v8i)part[p] & 0x7fffffff;
                top = (v8i)_mm256_max_epi32((__m256i)top, (__m256i)bits);
            }
            __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128((__m256i)top),
                                       _mm256_extracti128_si256((__m256i)top, 1));
            m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0x4e));
            m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0xb1));
            const int32_t top_bits = _mm_cvtsi128_si32(m4);
            float amax;
            memcpy(&amax, &top_bits, 4);
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            v8i total = {0};
            int8_t *q = xq + i * k + g * GROUP;
            for (int p = 0; p < 4; ++p) {
                const v8f v = part[p] * id, mag = (v8f)((v8i)v & 0x7fffffff);
                const v8i whole = __builtin_convertvector(mag, v8i); /* truncated: floor here */
                const v8i up = (mag - __builtin_convertvector(whole, v8f)) >= 0.5f;
                const v8i rounded = whole - up; /* a true lane is -1 */
                const v8i negative = (v8i)v < 0;
                const v8i signed_q = (rounded ^ negative) - negative;
                total += signed_q;
                const vq8 bytes = __builtin_convertvector(signed_q, vq8) ^ flip8;
                memcpy(q + 8 * p, &bytes, sizeof bytes);
            }
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128((__m256i)total),
                                       _mm256_extracti128_si256((__m256i)total, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            const float dh = round_to_half(d);
            dx[i * groups + g] = dh;
            sx[i * groups + g] = dh * (float)_mm_cvtsi128_si32(s4);
        }
    return;
#endif
    const vq flip_bits = (vq){0} + (int8_t)(flip ? -128 : 0);
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = x + i * k + g * GROUP;
            vf half_x[2];
            memcpy(half_x, xg, sizeof half_x);
            const vi abs_bits[2] = {(vi)half_x[0] & 0x7fffffff, (vi)half_x[1] & 0x7fffffff};
            const int32_t top = lanes_max(lanes_larger(abs_bits[0], abs_bits[1]));
            float amax;
            memcpy(&amax, &top, 4);
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            vi total = {0};
            int8_t *q = xq + i * k + g * GROUP;
            for (int half = 0; half < 2; ++half) {
                const vf v = half_x[half] * id, mag = (vf)((vi)v & 0x7fffffff);
                const vi whole = __builtin_convertvector(mag, vi); /* truncated: floor here */
                const vi up = (mag - __builtin_convertvector(whole, vf)) >= 0.5f;
                const vi rounded = whole - up; /* a true lane is -1 */
                const vi negative = (vi)v < 0;
                const vi signed_q = (rounded ^ negative) - negative;
                total += signed_q;
                const vq bytes = __builtin_convertvector(signed_q, vq) ^ flip_bits;
                memcpy(q + half * NR, &bytes, sizeof bytes);
            }
            const float dh = round_to_half(d);
            dx[i * groups + g] = dh;
            sx[i * groups + g] = dh * (float)lanes_sum(total);
        }
}

/* One panel's blocks as fp32 [K][16] in panel. */
static void dequantize_panel(const uint8_t *blocks, int64_t block_bytes, int64_t groups,
                             int format, float *restrict panel) {
#if HALVES
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *block = blocks + g * block_bytes;
        float *out = panel + g * GROUP * NR;
        const int q8 = format == FORMAT_Q8, per_chunk = q8 ? 4 : 8;
        const int fp32 = format == FORMAT_Q4F, width = fp32 ? 4 : 2;
        const uint8_t *s = block + (q8 ? GROUP * NR : GROUP / 2 * NR);
        v8f d[2], m[2] = {{0}, {0}};
        for (int h = 0; h < 2; ++h) {
            d[h] = scales8(s + 8 * width * h, fp32);
            if (!q8) m[h] = scales8(s + NR * width + 8 * width * h, fp32);
        }
        for (int c = 0; c < GROUP / per_chunk; ++c)
            for (int h = 0; h < 2; ++h) {
                const v8i v = (v8i)load_bytes(block + c * CHUNK + 32 * h);
                for (int t = 0; t < per_chunk; ++t)
                    store8(out + (per_chunk * c + t) * NR + 8 * h,
                           q8 ? q8_input8(v, t) * d[h] : q4_input8(v, t) * d[h] + m[h]);
            }
    }
    return;
#endif
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *block = blocks + g * block_bytes;
        float *out = panel + g * GROUP * NR;
        if (format == FORMAT_Q8) {
            const vf d = halves(block + GROUP * NR);
            for (int c = 0; c < GROUP / 4; ++c) {
                const vi v = load_chunk(block + c * CHUNK);
                for (int t = 0; t < 4; ++t) *(vf *)(out + (4 * c + t) * NR) = q8_input(v, t) * d;
            }
        } else {
            const int fp32 = format == FORMAT_Q4F;
            const uint8_t *s = block + GROUP / 2 * NR;
            const vf d = scales(s, fp32), m = scales(s + NR * (fp32 ? 4 : 2), fp32);
            for (int c = 0; c < GROUP / 8; ++c) {
                const vi v = load_chunk(block + c * CHUNK);
                for (int t = 0; t < 8; ++t)
                    *(vf *)(out + (8 * c + t) * NR) = q4_input(v, t) * d + m;
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

#if HALVES
/* micro on two halves: 6 rows x 2 x 8 accumulators, 2 panel vectors, 1 broadcast (BLIS's
 * Haswell 6 x 16 register tile: 15 of the 16 ymm registers). */
static inline __attribute__((always_inline)) void
micro8(const float *restrict x, int64_t ldx, const float *restrict panel, int64_t k,
       const float *restrict bias, float *restrict y, int64_t ldy, const int mr) {
    v8f acc[MR][2];
    for (int i = 0; i < mr; ++i)
        for (int h = 0; h < 2; ++h) acc[i][h] = bias ? load8(bias + 8 * h) : (v8f){0};
    for (int64_t kk = 0; kk < k; ++kk) {
        const v8f w0 = load8(panel + kk * NR), w1 = load8(panel + kk * NR + 8);
        for (int i = 0; i < mr; ++i) {
            const float xv = x[i * ldx + kk];
            acc[i][0] += xv * w0;
            acc[i][1] += xv * w1;
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int h = 0; h < 2; ++h) store8(y + i * ldy + 8 * h, acc[i][h]);
}
#define MICRO_FN micro8
#else
#define MICRO_FN micro
#endif

static void panel_rows(const float *x, int64_t rows, int64_t k, const float *panel,
                       const float *bias, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + MR <= rows; i += MR) MICRO_FN(x + i * k, k, panel, k, bias, y + i * n, n, MR);
#define MICRO_TAIL(r)                                                                         \
    case r: MICRO_FN(x + i * k, k, panel, k, bias, y + i * n, n, r); break;
    switch ((int)(rows - i)) {
        MICRO_TAIL(1) MICRO_TAIL(2) MICRO_TAIL(3) MICRO_TAIL(4) MICRO_TAIL(5)
#if MR > 6
        MICRO_TAIL(6) MICRO_TAIL(7) MICRO_TAIL(8) MICRO_TAIL(9) MICRO_TAIL(10) MICRO_TAIL(11)
        MICRO_TAIL(12) MICRO_TAIL(13)
#endif
    default: break;
    }
#undef MICRO_TAIL
}

/* The int8 path (see the top): x quantized by blocks of QMB rows, each block against every
 * panel. */
static int gemm_q8_activations(const float *x, int64_t m, int64_t k, const uint8_t *blocks,
                               int format, const float *bias, int64_t n, float *y,
                               int num_threads) {
    const int64_t block_bytes = actorline_quant_block_bytes(format);
    const int64_t groups = k / GROUP, panels = n / NR, panel_bytes = groups * block_bytes;
    const int64_t block_rows = m < QMB ? m : QMB;
    int8_t *xq = (int8_t *)malloc((size_t)(block_rows * k));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(2 * block_rows * groups));
    if (xq == NULL || dx == NULL) {
        free(xq);
        free(dx);
        return 1;
    }
    float *sx = dx + block_rows * groups;
    for (int64_t r0 = 0; r0 < m; r0 += QMB) {
        const int64_t rows = m - r0 < QMB ? m - r0 : QMB;
        quantize_rows(x + r0 * k, rows, k, Q8_FLIP && format == FORMAT_Q8, xq, dx, sx);
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < panels; ++p)
            direct_rows_q(xq, dx, sx, rows, k, blocks + p * panel_bytes, block_bytes,
                          bias ? bias + p * NR : NULL, y + r0 * n + p * NR, n, format);
    }
    free(xq);
    free(dx);
    return 0;
}

/* y[M, N] = x[M, K] @ W^T (+ bias). blocks: [N / 16][K / 32] block records of the format;
 * format | ACT_Q8 runs the int8 activations path. Returns 0 on success, 1 when scratch memory
 * could not be allocated, 2 on arguments it cannot serve. */
int actorline_quant_gemm(const float *x, int64_t m, int64_t k, const uint8_t *blocks, int code,
                         const float *bias, int64_t n, float *y, int num_threads) {
    const int format = code & FORMAT_MASK;
    const int64_t block_bytes = actorline_quant_block_bytes(format);
    if ((code & ~(FORMAT_MASK | ACT_Q8)) != 0 || block_bytes < 0 || m < 0 || k <= 0 ||
        k % GROUP != 0 || n <= 0 || n % NR != 0)
        return 2;
    if (m == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    if (code & ACT_Q8) return gemm_q8_activations(x, m, k, blocks, format, bias, n, y, num_threads);
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

/* A buffer of the calling thread's own of at least bytes, kept between calls (NULL when out of
 * memory). */
static void *thread_buffer(size_t bytes) {
    static __thread void *buffer = NULL;
    static __thread size_t capacity = 0;
    if (bytes > capacity) {
        void *bigger = realloc(buffer, bytes);
        if (bigger == NULL) return NULL;
        buffer = bigger;
        capacity = bytes;
    }
    return buffer;
}

/* Output columns [col0, col1) of the same GEMM on the calling thread, no OpenMP region: the CPU
 * step graph's threads each compute their share inside the one region of a step (stages/
 * execute/native.py: NativeGemm.part); col0 and col1 multiples of 16 (col1 at most n). Each
 * thread prepares the rows itself (their int8 blocks, or their group sums) into a buffer of
 * its own kept between calls (the whole call did it on one thread while the others waited);
 * with same_x (the caller's word that x holds the rows of this thread's last call) it takes
 * the int8 blocks of that call when it had the same x, m, k and sign flip (a Q8 weight's).
 * Every column is computed as in the whole call: the same results bit for bit. Returns 0; 1
 * when out of memory; 2 on arguments it cannot serve. */
int actorline_quant_gemm_part(const float *x, int64_t m, int64_t k, const void *weights,
                              int code, const float *bias, int64_t n, float *y, int64_t col0,
                              int64_t col1, int same_x) {
    /* what the thread's buffer holds: the int8 blocks of rows x, m, k with flip */
    static __thread const float *quantized_x = NULL;
    static __thread int64_t quantized_m = -1, quantized_k = -1;
    static __thread int quantized_flip = -1;
    const int format = code & FORMAT_MASK;
    const int64_t block_bytes = actorline_quant_block_bytes(format);
    if ((code & ~(FORMAT_MASK | ACT_Q8)) != 0 || block_bytes < 0 || m < 0 || k <= 0 ||
        k % GROUP != 0 || n <= 0 || n % NR != 0 || col0 < 0 || col1 > n || col0 > col1 ||
        col0 % NR != 0 || col1 % NR != 0)
        return 2;
    if (m == 0 || col0 == col1) return 0;
    const uint8_t *blocks = (const uint8_t *)weights;
    const int64_t groups = k / GROUP, panel_bytes = groups * block_bytes;
    const int64_t p0 = col0 / NR, p1 = col1 / NR;
    const int flip = Q8_FLIP && format == FORMAT_Q8;
    if ((code & ACT_Q8) && m <= QMB) { /* one block of rows: kept for the next call */
        const size_t scale_bytes = sizeof(float) * (size_t)(2 * m * groups);
        const int same = same_x && quantized_x == x && quantized_m == m && quantized_k == k &&
                         quantized_flip == flip;
        float *dx = (float *)thread_buffer(scale_bytes + (size_t)(m * k));
        if (dx == NULL) return 1;
        float *sx = dx + m * groups;
        int8_t *xq = (int8_t *)(dx + 2 * m * groups);
        if (!same) {
            quantize_rows(x, m, k, flip, xq, dx, sx);
            quantized_x = x, quantized_m = m, quantized_k = k, quantized_flip = flip;
        }
        for (int64_t p = p0; p < p1; ++p)
            direct_rows_q(xq, dx, sx, m, k, blocks + p * panel_bytes, block_bytes,
                          bias ? bias + p * NR : NULL, y + p * NR, n, format);
        return 0;
    }
    quantized_x = NULL; /* the buffer is put to other uses below */
    if (code & ACT_Q8) {
        const int64_t block_rows = QMB;
        const size_t scale_bytes = sizeof(float) * (size_t)(2 * block_rows * groups);
        float *dx = (float *)thread_buffer(scale_bytes + (size_t)(block_rows * k));
        if (dx == NULL) return 1;
        float *sx = dx + block_rows * groups;
        int8_t *xq = (int8_t *)(dx + 2 * block_rows * groups);
        for (int64_t r0 = 0; r0 < m; r0 += QMB) {
            const int64_t rows = m - r0 < QMB ? m - r0 : QMB;
            quantize_rows(x + r0 * k, rows, k, flip, xq, dx, sx);
            for (int64_t p = p0; p < p1; ++p)
                direct_rows_q(xq, dx, sx, rows, k, blocks + p * panel_bytes, block_bytes,
                              bias ? bias + p * NR : NULL, y + r0 * n + p * NR, n, format);
        }
        return 0;
    }
    if (m <= DIRECT_ROWS) {
        float *row_sums = (float *)thread_buffer(sizeof(float) * (size_t)(m * groups));
        if (row_sums == NULL) return 1;
        for (int64_t i = 0; i < m; ++i)
            for (int64_t g = 0; g < groups; ++g) {
                float s = 0.0f;
                for (int j = 0; j < GROUP; ++j) s += x[i * k + g * GROUP + j];
                row_sums[i * groups + g] = s;
            }
        for (int64_t p = p0; p < p1; ++p)
            direct_rows(x, m, k, row_sums, blocks + p * panel_bytes, block_bytes,
                        bias ? bias + p * NR : NULL, y + p * NR, n, format);
        return 0;
    }
    float *panel = (float *)thread_buffer(sizeof(float) * (size_t)(k * NR));
    if (panel == NULL) return 1;
    for (int64_t r0 = 0; r0 < m; r0 += MB) {
        const int64_t rows = m - r0 < MB ? m - r0 : MB;
        for (int64_t p = p0; p < p1; ++p) {
            dequantize_panel(blocks + p * panel_bytes, block_bytes, groups, format, panel);
            panel_rows(x + r0 * k, rows, k, panel, bias ? bias + p * NR : NULL,
                       y + r0 * n + p * NR, n);
        }
    }
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
        const int64_t p = ids[i] / NR;
        const int column = (int)(ids[i] % NR);
        const uint8_t *panel = blocks + p * groups * block_bytes;
        float *row = out + i * k;
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t *block = panel + g * block_bytes;
            float lanes[NR], offsets[NR];
            if (format == FORMAT_Q8) {
                *(vf *)lanes = halves(block + GROUP * NR);
                for (int kk = 0; kk < GROUP; ++kk)
                    row[g * GROUP + kk] = (float)(int8_t)block[q8_at(kk, column)] * lanes[column];
            } else {
                const int fp32 = format == FORMAT_Q4F;
                const uint8_t *s = block + GROUP / 2 * NR;
                *(vf *)lanes = scales(s, fp32);
                *(vf *)offsets = scales(s + NR * (fp32 ? 4 : 2), fp32);
                for (int kk = 0; kk < GROUP; ++kk) {
                    const uint8_t byte = block[q4_at(kk, column)];
                    const int value = kk & 4 ? byte >> 4 : byte & 15;
                    row[g * GROUP + kk] = (float)value * lanes[column] + offsets[column];
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
                for (int kk = 0; kk < GROUP; ++kk) block[q8_at(kk, (int)j)] = src[2 + kk];
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
            for (int kk = 0; kk < GROUP; ++kk)
                block[q4_at(kk, (int)j)] |= (uint8_t)(values[kk] << (kk & 4));
        }
    }
    return 0;
}
