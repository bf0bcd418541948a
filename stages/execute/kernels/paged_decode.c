/* Paged decode attention for CPU, fp32: one query token per sequence; keys and values are
 * read in place from the token-major paged cache [num_slots, Hkv, D] through each sequence's
 * block table, so nothing is gathered or padded. Built and loaded by
 * stages/execute/native.py, which checks the arguments (D a multiple of 8, group <= 16).
 *
 * Work items are whole sequences spread over OpenMP threads when there are at least four per
 * thread (each key and value row then read whole, a block's rows back to back: 1.4-1.5x the
 * bandwidth of reading one head's slice of every row, measured cold over 30 layers), else
 * (sequence, KV head) pairs so that a few long sequences still use every thread; both run
 * the same code with the same arithmetic, so results do not depend on the split. The Hq/Hkv
 * query heads of one KV head share every key and value row read (GQA without expanding keys).
 * Two passes over the context: scores (n floats per query head), then softmax and the
 * weighted sum of values. Each pass goes block by block and, within a block, head by head:
 * the head's query (pass 1) or accumulator (pass 2) stays in registers while the block's rows,
 * a few KiB, stay in L1 for the group's other heads; pass 1 reduces eight rows' dot products
 * together (dot8), the softmax's exponentials are a vector polynomial (vexp), and the next
 * block is prefetched while this one is worked on. Against the first version of this file
 * (per row all heads, scalar expf, one horizontal sum per score), cold over 30 layers at
 * 64 x 250 tokens: 1.58 -> 1.02 ms per layer, 11.8 -> 18.2 GB/s of K/V. The same plan as
 * vLLM's CPU paged attention v1 (csrc/cpu/attention.cpp, reduce
 * over the blocks of the block table), written with GCC vector extensions so that one
 * source compiles to AVX2, AVX-512 or NEON for the machine it runs on.
 *
 * Attention variants (docs/architecture.md §6.1): a sliding window reads only
 * a row's last ``window`` positions (its leading blocks may be freed, so they are never
 * touched); soft-capped logits become ``softcap * tanh(score / softcap)`` (Gemma 2); a sink
 * (gpt-oss, one logit per query head) joins the softmax's max and denominator and adds no
 * value, as transformers' eager attention does.
 *
 * The cache holds fp32 or bf16 (kv_cache_dtype, docs/architecture.md §3.1). Where the build
 * has AVX512-BF16 (and ACTORLINE_ATTENTION_PORTABLE is not defined) the bf16 entry points run
 * attend_dot(): each query rounded to bf16 once, VDPBF16PS dot products over the key rows as
 * they lie in the cache, fp32 softmax, and an fp32 weighted sum over the value rows split into
 * their even and odd elements (a shift and a mask, no widening per element). Elsewhere they run
 * attend() with each key and value vector widened to fp32 as it is loaded (a bf16 is the high
 * half of an fp32: zero-extend and shift), so all arithmetic is fp32 and only the bytes read
 * halve. Queries and outputs are fp32 in both. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 8
#define MAX_GROUP 16
#define MAX_HEADS 128 /* for whole-sequence work items (else MAX_GROUP per item) */
#define MAX_VECTORS 32 /* head_dim <= 256 */

typedef float vf __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(2)));

/* LANES cache elements from element ``index`` of ``base`` as fp32: fp32 as they are, bf16
 * widened (bf16 0xABCD is the fp32 0xABCD0000, exactly). ``bf16`` is a constant at every
 * call (attend is instantiated per cache type), so the test folds away. */
static inline __attribute__((always_inline)) vf load_kv(const void *base, int64_t index,
                                                        const int bf16) {
    if (bf16) {
        const vu wide = __builtin_convertvector(*(const vh *)((const uint16_t *)base + index), vu)
                        << 16;
        vf out;
        __builtin_memcpy(&out, &wide, sizeof out);
        return out;
    }
    return *(const vf *)((const float *)base + index);
}

static inline float hsum(vf v) {
#if defined(__clang__) || __GNUC__ >= 12
    /* A tree of halvings (three shuffles and adds for 8 lanes), not eight scalar extracts. */
    typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
    v4 s = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    s += __builtin_shufflevector(s, s, 2, 3, 0, 1);
    s += __builtin_shufflevector(s, s, 1, 0, 3, 2);
    return s[0];
#else
    float s = 0.0f;
    for (int i = 0; i < LANES; ++i) s += v[i];
    return s;
#endif
}

/* The lane sums of d[0..7] as one vector: three levels of pairwise shuffles and adds (a
 * transposed reduction, 14 shuffles for eight rows instead of eight hsum trees). */
static inline vf dot8(const vf *d) {
#if LANES == 8 && (defined(__clang__) || __GNUC__ >= 12)
    vf a[4], b[2];
    for (int p = 0; p < 4; ++p)
        a[p] = __builtin_shufflevector(d[2 * p], d[2 * p + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(d[2 * p], d[2 * p + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int p = 0; p < 2; ++p)
        b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
#else
    vf r;
    for (int t = 0; t < LANES; ++t) r[t] = hsum(d[t]);
    return r;
#endif
}

/* exp(x) for x <= 0 (scores less their maximum), LANES at a time: x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial (about 1 ulp), 2^n by building the float's
 * exponent bits. Below -87 (where 2^n would be subnormal) the result is 2^-126-ish, not 0:
 * negligible against the maximum's 1 in every softmax sum. */
static inline vf vexp(vf x) {
    for (int i = 0; i < LANES; ++i) x[i] = x[i] > -87.0f ? x[i] : -87.0f; /* one vmaxps */
    const vf t = x * 1.44269504088896341f - 0.5f;
    const vi n = __builtin_convertvector(t, vi); /* truncation: round(x log2 e) for x <= 0 */
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const vi bits = (n + 127) << 23;
    vf scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Softmax of each of ``rows`` score rows of ``count`` scores in place (max-subtracted),
 * leaving the exponentials and each row's 1 / sum in inv_sum (the weighted sum divides once,
 * at the end). With sinks (one logit per row, or NULL) each row's sink takes part in the max
 * and the sum. */
static inline void softmax_rows(float *scores, int rows, int64_t count, const float *sinks,
                                float *inv_sum) {
    for (int h = 0; h < rows; ++h) {
        float *s = scores + h * count;
        float peak = s[0];
        for (int64_t j = 1; j < count; ++j) peak = s[j] > peak ? s[j] : peak;
        if (sinks != NULL && sinks[h] > peak) peak = sinks[h];
        vf sums = (vf){0};
        int64_t j = 0;
        for (; j + LANES <= count; j += LANES) {
            vf e = vexp(*(vf *)(s + j) - peak);
            *(vf *)(s + j) = e;
            sums += e;
        }
        float sum = hsum(sums) + (sinks != NULL ? expf(sinks[h] - peak) : 0.0f);
        for (; j < count; ++j) {
            s[j] = expf(s[j] - peak);
            sum += s[j];
        }
        inv_sum[h] = 1.0f / sum;
    }
}

/* Ask for the next block's rows (the item's slice of each: width elements of element_size bytes)
 * while this block's are worked on: blocks lie anywhere in the cache, so the hardware
 * prefetcher starts cold at each one, and the first touch of a block otherwise waits on
 * memory. */
static inline void prefetch_block(const void *cache, const int64_t *blocks, int64_t j,
                                  int64_t context_len, int block_size, int64_t row_stride,
                                  int64_t width, int64_t element_size) {
    const int64_t next = (j / block_size + 1) * block_size;
    if (next >= context_len) return;
    const int64_t rows = context_len - next < block_size ? context_len - next : block_size;
    const char *base =
        (const char *)cache + blocks[next / block_size] * block_size * row_stride * element_size;
    for (int64_t o = 0; o < rows; ++o)
        for (int64_t f = 0; f < width * element_size; f += 64)
            __builtin_prefetch(base + o * row_stride * element_size + f);
}

/* One work item: the kv_heads * group query heads at query attend to positions
 * [first, context_len) of blocks. key_cache/value_cache point at the item's first KV head; a
 * token's row is row_stride elements long (all KV heads; floats, or bf16 where ``bf16``), of
 * which the item reads kv_heads * D.
 * scores holds heads * (context_len - first) floats, acc heads * vectors vectors. softcap 0:
 * no capping; sinks: the item's heads' sink logits, or NULL. */
static inline __attribute__((always_inline)) void
attend(const float *restrict query, int64_t q_head_stride, const void *restrict key_cache,
       const void *restrict value_cache, const int64_t *restrict blocks, int64_t first,
       int64_t context_len, int64_t row_stride, int kv_heads, int group, const int vectors,
       int block_size, float scale, float softcap, const float *restrict sinks,
       float *restrict scores, vf *restrict acc, float *restrict out, int64_t out_head_stride,
       const int bf16) {
    const int heads = kv_heads * group;
    const int64_t element_size = bf16 ? 2 : 4;
    const int64_t count = context_len - first;
    /* Pass 1: scores[h][j - first] = scale * <q_h, k_j>, capped. Head by head over a run of
     * a block's rows: the head's query stays in registers, eight rows' dot products are
     * accumulated side by side and reduced together (dot8), the rest one by one. */
    for (int64_t j = first; j < context_len;) {
        const int64_t offset = j % block_size;
        const int64_t run = block_size - offset < context_len - j ? block_size - offset
                                                                  : context_len - j;
        /* the run's first row, in elements from key_cache */
        const int64_t k = (blocks[j / block_size] * block_size + offset) * row_stride;
        prefetch_block(key_cache, blocks, j, context_len, block_size, row_stride,
                       (int64_t)kv_heads * vectors * LANES, element_size);
        for (int h = 0; h < heads; ++h) {
            vf q[MAX_VECTORS];
            for (int i = 0; i < vectors; ++i)
                q[i] = *(const vf *)(query + h * q_head_stride + i * LANES);
            const int64_t kh = k + (h / group) * vectors * LANES;
            float *s = scores + h * count + j - first;
            int64_t o = 0;
            for (; o + LANES <= run; o += LANES) {
                vf d[LANES];
                for (int t = 0; t < LANES; ++t) {
                    const int64_t row = kh + (o + t) * row_stride;
                    d[t] = q[0] * load_kv(key_cache, row, bf16);
                    for (int i = 1; i < vectors; ++i)
                        d[t] += q[i] * load_kv(key_cache, row + i * LANES, bf16);
                }
                *(vf *)(s + o) = dot8(d) * scale;
            }
            for (; o < run; ++o) {
                const int64_t row = kh + o * row_stride;
                vf dot = q[0] * load_kv(key_cache, row, bf16);
                for (int i = 1; i < vectors; ++i)
                    dot += q[i] * load_kv(key_cache, row + i * LANES, bf16);
                s[o] = hsum(dot) * scale;
            }
            if (softcap > 0.0f)
                for (o = 0; o < run; ++o) s[o] = softcap * tanhf(s[o] / softcap);
        }
        j += run;
    }
    float inv_sum[MAX_HEADS];
    softmax_rows(scores, heads, count, sinks, inv_sum);
    /* Pass 2: out_h = sum_j p[h][j] v_j / sum_h. */
    for (int i = 0; i < heads * vectors; ++i) acc[i] = (vf){0};
    for (int64_t j = first; j < context_len;) {
        const int64_t offset = j % block_size;
        const int64_t run = block_size - offset < context_len - j ? block_size - offset
                                                                  : context_len - j;
        const int64_t v = (blocks[j / block_size] * block_size + offset) * row_stride;
        prefetch_block(value_cache, blocks, j, context_len, block_size, row_stride,
                       (int64_t)kv_heads * vectors * LANES, element_size);
        /* Head by head over the run's rows, each head's accumulator held in registers (the
         * run's value rows, a few KiB, stay in L1 for the group's other heads). */
        for (int h = 0; h < heads; ++h) {
            const float *p = scores + h * count + j - first;
            const int64_t vh = v + (h / group) * vectors * LANES;
            vf a[MAX_VECTORS];
            for (int i = 0; i < vectors; ++i) a[i] = acc[h * vectors + i];
            for (int64_t o = 0; o < run; ++o)
                for (int i = 0; i < vectors; ++i)
                    a[i] += p[o] * load_kv(value_cache, vh + o * row_stride + i * LANES, bf16);
            for (int i = 0; i < vectors; ++i) acc[h * vectors + i] = a[i];
        }
        j += run;
    }
    for (int h = 0; h < heads; ++h)
        for (int i = 0; i < vectors; ++i)
            *(vf *)(out + h * out_head_stride + i * LANES) = acc[h * vectors + i] * inv_sum[h];
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    !defined(ACTORLINE_ATTENTION_PORTABLE)
#define BF16_DOT 1
#include <immintrin.h>

#define BF16_CHUNK 32 /* bf16 elements per 512-bit vector */
#define MAX_CHUNKS (MAX_VECTORS * LANES / BF16_CHUNK)

/* The sums of v[0..15] as one vector (lane t: the sum of v[t]'s lanes): four levels of
 * pairwise shuffles and adds, then one permutation that puts the rows back in order. */
static inline __m512 reduce16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int p = 0; p < 8; ++p) /* rows 2p, 2p+1: lanes 0-7 and 8-15 */
        a[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; ++p) /* rows 4p..4p+3: one per 128-bit lane, 4 partials each */
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; ++p)
        c[p] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * p], b[2 * p + 1]),
                             _mm512_unpackhi_ps(b[2 * p], b[2 * p + 1]));
    const __m512 d = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))));
    /* d's element 4k + j holds row 4j + k */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, d);
}

/* The weighted sum of one KV head's value rows [0, run) for ``group`` query heads at once
 * (``group`` and ``chunks`` constants where it is inlined): each value row is loaded and split
 * into its even and odd elements once for all the heads that share it, where the per-head loop
 * loaded and split it once per head. Each head's accumulators take the same FMAs in the same
 * order as there, so the sums are the same bit for bit. p: the first head's weights of the
 * run, the others ``count`` apart; acc: the first head's accumulators, ``width`` apart. */
#define PV_GROUP 4
static inline __attribute__((always_inline)) void
pv_heads(const uint16_t *restrict row0, int64_t row_stride, int64_t run, const float *restrict p,
         int64_t count, const int group, const int chunks, __mmask32 tail_mask,
         float *restrict acc, int width) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 even[PV_GROUP][2], odd[PV_GROUP][2];
    for (int g = 0; g < group; ++g)
        for (int c = 0; c < chunks; ++c) {
            even[g][c] = _mm512_loadu_ps(acc + g * width + c * BF16_CHUNK);
            odd[g][c] = _mm512_loadu_ps(acc + g * width + c * BF16_CHUNK + 16);
        }
    for (int64_t o = 0; o < run; ++o) {
        const uint16_t *row = row0 + o * row_stride;
        __m512 lo[2], hi[2];
        for (int c = 0; c < chunks; ++c) {
            const __m512i x = c == chunks - 1 ? _mm512_maskz_loadu_epi16(tail_mask, row + c * BF16_CHUNK)
                                              : _mm512_loadu_si512(row + c * BF16_CHUNK);
            lo[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            hi[c] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
        }
        for (int g = 0; g < group; ++g) {
            const __m512 weight = _mm512_set1_ps(p[g * count + o]);
            for (int c = 0; c < chunks; ++c) {
                even[g][c] = _mm512_fmadd_ps(weight, lo[c], even[g][c]);
                odd[g][c] = _mm512_fmadd_ps(weight, hi[c], odd[g][c]);
            }
        }
    }
    for (int g = 0; g < group; ++g)
        for (int c = 0; c < chunks; ++c) {
            _mm512_storeu_ps(acc + g * width + c * BF16_CHUNK, even[g][c]);
            _mm512_storeu_ps(acc + g * width + c * BF16_CHUNK + 16, odd[g][c]);
        }
}

/* attend() over a bf16 cache with AVX512-BF16: each head's query is rounded to bf16 (round to
 * nearest even, as torch rounds) and its scores are VDPBF16PS dot products over the key rows
 * as they lie in the cache (32 elements an instruction, fp32 sums; 16 rows reduced together
 * by reduce16), so no key element is widened. Softmax as attend(). The weighted sum of values
 * stays fp32: a bf16 pair is an fp32 with its low half cleared, so one 32-element load gives
 * the even elements by a shift and the odd ones by a mask, two fp32 vectors accumulated with
 * fp32 weights apart and interleaved once at the end (no rounding of the probabilities). The
 * D tail (head_dim not a multiple of 32) is loaded masked, zeros beyond it.
 * acc: heads * chunks * 32 floats of scratch. */
static inline __attribute__((always_inline)) void
attend_dot(const float *restrict query, int64_t q_head_stride, const void *restrict key_cache,
           const void *restrict value_cache, const int64_t *restrict blocks, int64_t first,
           int64_t context_len, int64_t row_stride, int kv_heads, int group, const int head_dim,
           int block_size, float scale, float softcap, const float *restrict sinks,
           float *restrict scores, float *restrict acc, float *restrict out,
           int64_t out_head_stride) {
    const int heads = kv_heads * group;
    const int chunks = (head_dim + BF16_CHUNK - 1) / BF16_CHUNK;
    const int tail = head_dim - (chunks - 1) * BF16_CHUNK; /* elements of the last chunk */
    const __mmask32 tail_mask = tail == BF16_CHUNK ? 0xFFFFFFFFu : (1u << tail) - 1u;
    const uint16_t *keys = (const uint16_t *)key_cache;
    const uint16_t *vals = (const uint16_t *)value_cache;
    const int64_t count = context_len - first;
    for (int64_t j = first; j < context_len;) {
        const int64_t offset = j % block_size;
        const int64_t run = block_size - offset < context_len - j ? block_size - offset
                                                                  : context_len - j;
        const int64_t k = (blocks[j / block_size] * block_size + offset) * row_stride;
        prefetch_block(key_cache, blocks, j, context_len, block_size, row_stride,
                       (int64_t)kv_heads * head_dim, 2);
        for (int h = 0; h < heads; ++h) {
            __m512bh q[MAX_CHUNKS];
            const float *qh = query + h * q_head_stride;
            for (int c = 0; c < chunks; ++c) {
                const int n = c == chunks - 1 ? tail : BF16_CHUNK;
                const __mmask16 lo = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1u);
                const __mmask16 hi = n >= 32 ? 0xFFFF : (__mmask16)((1u << (n > 16 ? n - 16 : 0)) - 1u);
                q[c] = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, qh + c * BF16_CHUNK + 16),
                                           _mm512_maskz_loadu_ps(lo, qh + c * BF16_CHUNK));
            }
            const int64_t kh = k + (h / group) * head_dim;
            float *s = scores + h * count + j - first;
            int64_t o = 0;
            for (; o + 16 <= run; o += 16) {
                __m512 d[16];
                for (int t = 0; t < 16; ++t) {
                    const uint16_t *row = keys + kh + (o + t) * row_stride;
                    __m512 sum = _mm512_setzero_ps();
                    for (int c = 0; c < chunks; ++c) {
                        const __m512i kv = c == chunks - 1
                                               ? _mm512_maskz_loadu_epi16(tail_mask, row + c * BF16_CHUNK)
                                               : _mm512_loadu_si512(row + c * BF16_CHUNK);
                        sum = _mm512_dpbf16_ps(sum, q[c], (__m512bh)kv);
                    }
                    d[t] = sum;
                }
                _mm512_storeu_ps(s + o, _mm512_mul_ps(reduce16(d), _mm512_set1_ps(scale)));
            }
            for (; o < run; ++o) {
                const uint16_t *row = keys + kh + o * row_stride;
                __m512 sum = _mm512_setzero_ps();
                for (int c = 0; c < chunks; ++c) {
                    const __m512i kv = c == chunks - 1
                                           ? _mm512_maskz_loadu_epi16(tail_mask, row + c * BF16_CHUNK)
                                           : _mm512_loadu_si512(row + c * BF16_CHUNK);
                    sum = _mm512_dpbf16_ps(sum, q[c], (__m512bh)kv);
                }
                s[o] = _mm512_reduce_add_ps(sum) * scale;
            }
            if (softcap > 0.0f)
                for (o = 0; o < run; ++o) s[o] = softcap * tanhf(s[o] / softcap);
        }
        j += run;
    }
    float inv_sum[MAX_HEADS];
    softmax_rows(scores, heads, count, sinks, inv_sum);
    const int width = chunks * BF16_CHUNK; /* accumulator floats per head */
    for (int i = 0; i < heads * width; ++i) acc[i] = 0.0f;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t j = first; j < context_len;) {
        const int64_t offset = j % block_size;
        const int64_t run = block_size - offset < context_len - j ? block_size - offset
                                                                  : context_len - j;
        const int64_t v = (blocks[j / block_size] * block_size + offset) * row_stride;
        prefetch_block(value_cache, blocks, j, context_len, block_size, row_stride,
                       (int64_t)kv_heads * head_dim, 2);
#ifndef ACTORLINE_PV_PER_HEAD
        if (group <= PV_GROUP && chunks <= 2) {
            for (int kh = 0; kh < kv_heads; ++kh) {
                const uint16_t *row0 = vals + v + kh * head_dim;
                const float *p = scores + kh * group * count + j - first;
                float *a = acc + kh * group * width;
                switch (group) { /* constants, so the accumulators stay in registers */
                case 1: pv_heads(row0, row_stride, run, p, count, 1, chunks, tail_mask, a, width); break;
                case 2: pv_heads(row0, row_stride, run, p, count, 2, chunks, tail_mask, a, width); break;
                case 3: pv_heads(row0, row_stride, run, p, count, 3, chunks, tail_mask, a, width); break;
                default: pv_heads(row0, row_stride, run, p, count, 4, chunks, tail_mask, a, width); break;
                }
            }
            j += run;
            continue;
        }
#endif
        for (int h = 0; h < heads; ++h) {
            const float *p = scores + h * count + j - first;
            const int64_t vh = v + (h / group) * head_dim;
            __m512 even[MAX_CHUNKS], odd[MAX_CHUNKS];
            for (int c = 0; c < chunks; ++c) {
                even[c] = _mm512_loadu_ps(acc + h * width + c * BF16_CHUNK);
                odd[c] = _mm512_loadu_ps(acc + h * width + c * BF16_CHUNK + 16);
            }
            for (int64_t o = 0; o < run; ++o) {
                const __m512 weight = _mm512_set1_ps(p[o]);
                const uint16_t *row = vals + vh + o * row_stride;
                for (int c = 0; c < chunks; ++c) {
                    const __m512i x = c == chunks - 1
                                          ? _mm512_maskz_loadu_epi16(tail_mask, row + c * BF16_CHUNK)
                                          : _mm512_loadu_si512(row + c * BF16_CHUNK);
                    even[c] = _mm512_fmadd_ps(weight, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                                              even[c]);
                    odd[c] = _mm512_fmadd_ps(weight, _mm512_castsi512_ps(_mm512_and_si512(x, high)),
                                             odd[c]);
                }
            }
            for (int c = 0; c < chunks; ++c) {
                _mm512_storeu_ps(acc + h * width + c * BF16_CHUNK, even[c]);
                _mm512_storeu_ps(acc + h * width + c * BF16_CHUNK + 16, odd[c]);
            }
        }
        j += run;
    }
    /* element 2m of a chunk is even's lane m, element 2m + 1 odd's */
    const __m512i first_half = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second_half =
        _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int h = 0; h < heads; ++h) {
        const __m512 norm = _mm512_set1_ps(inv_sum[h]);
        float *oh = out + h * out_head_stride;
        for (int c = 0; c < chunks; ++c) {
            const __m512 e = _mm512_loadu_ps(acc + h * width + c * BF16_CHUNK);
            const __m512 d = _mm512_loadu_ps(acc + h * width + c * BF16_CHUNK + 16);
            const int n = c == chunks - 1 ? tail : BF16_CHUNK;
            const __mmask16 lo = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1u);
            const __mmask16 hi = n >= 32 ? 0xFFFF : (__mmask16)((1u << (n > 16 ? n - 16 : 0)) - 1u);
            _mm512_mask_storeu_ps(oh + c * BF16_CHUNK, lo,
                                  _mm512_mul_ps(_mm512_permutex2var_ps(e, first_half, d), norm));
            _mm512_mask_storeu_ps(oh + c * BF16_CHUNK + 16, hi,
                                  _mm512_mul_ps(_mm512_permutex2var_ps(e, second_half, d), norm));
        }
    }
}
#else
#define BF16_DOT 0
#endif

/* Floats of accumulator scratch per head: the bf16-dot path keeps whole 32-element chunks. */
static inline size_t acc_floats(int head_dim, int bf16) {
#if BF16_DOT
    if (bf16) return (size_t)(head_dim + BF16_CHUNK - 1) / BF16_CHUNK * BF16_CHUNK;
#endif
    (void)bf16;
    return (size_t)head_dim;
}

/* 1 where bf16 caches are attended with VDPBF16PS (queries rounded to bf16), 0 where each
 * key is widened to fp32 (no AVX512-BF16, or built with ACTORLINE_ATTENTION_PORTABLE). */
int actorline_paged_decode_bf16_dot(void) { return BF16_DOT; }

/* attend() with constant vector counts for the common head sizes, so the D loops unroll, and
 * the cache's type a constant (one instance per type). */
#define ATTEND_ITEM(NAME, BF16)                                                                  \
    static void NAME(const float *query, int64_t q_head_stride, const void *key_cache,          \
                     const void *value_cache, const int64_t *blocks, int64_t first,            \
                     int64_t context_len, int64_t row_stride, int kv_heads, int group,         \
                     int vectors, int block_size, float scale, float softcap,                  \
                     const float *sinks, float *scores, vf *acc, float *out,                   \
                     int64_t out_head_stride) {                                                \
        if (vectors == 8)                                                                      \
            attend(query, q_head_stride, key_cache, value_cache, blocks, first, context_len,   \
                   row_stride, kv_heads, group, 8, block_size, scale, softcap, sinks, scores,  \
                   acc, out, out_head_stride, BF16);                                           \
        else if (vectors == 16)                                                                \
            attend(query, q_head_stride, key_cache, value_cache, blocks, first, context_len,   \
                   row_stride, kv_heads, group, 16, block_size, scale, softcap, sinks, scores, \
                   acc, out, out_head_stride, BF16);                                           \
        else                                                                                   \
            attend(query, q_head_stride, key_cache, value_cache, blocks, first, context_len,   \
                   row_stride, kv_heads, group, vectors, block_size, scale, softcap, sinks,    \
                   scores, acc, out, out_head_stride, BF16);                                   \
    }
ATTEND_ITEM(attend_item_f32, 0)
#if BF16_DOT
/* A bf16 cache's item: attend_dot() with the common head sizes constant (the chunk loops
 * unroll). */
static void attend_item_bf16(const float *query, int64_t q_head_stride, const void *key_cache,
                             const void *value_cache, const int64_t *blocks, int64_t first,
                             int64_t context_len, int64_t row_stride, int kv_heads, int group,
                             int vectors, int block_size, float scale, float softcap,
                             const float *sinks, float *scores, vf *acc, float *out,
                             int64_t out_head_stride) {
    if (vectors == 8)
        attend_dot(query, q_head_stride, key_cache, value_cache, blocks, first, context_len,
                   row_stride, kv_heads, group, 64, block_size, scale, softcap, sinks, scores,
                   (float *)acc, out, out_head_stride);
    else if (vectors == 16)
        attend_dot(query, q_head_stride, key_cache, value_cache, blocks, first, context_len,
                   row_stride, kv_heads, group, 128, block_size, scale, softcap, sinks, scores,
                   (float *)acc, out, out_head_stride);
    else
        attend_dot(query, q_head_stride, key_cache, value_cache, blocks, first, context_len,
                   row_stride, kv_heads, group, vectors * LANES, block_size, scale, softcap,
                   sinks, scores, (float *)acc, out, out_head_stride);
}
#else
ATTEND_ITEM(attend_item_bf16, 1)
#endif

/* Returns 0 on success, 1 when the scratch allocation failed, 2 on arguments it cannot serve.
 *
 * query: row r, head h at query + r * q_row_stride + h * q_head_stride (D contiguous).
 * out:   row r, head h at out + r * out_row_stride + h * out_head_stride (D contiguous).
 * key_cache, value_cache: [num_slots, num_kv_heads, head_dim] contiguous, fp32
 * (actorline_paged_decode_f32) or bf16 (actorline_paged_decode_f32_bf16kv).
 * block_tables: [num_rows, table_width] block ids (< num_cache_blocks), rows table_stride
 * apart; context_lens: [num_rows], each >= 1 and within its row of the table.
 * window: each row attends its last ``window`` positions only (0: all); blocks before them
 * are never read. softcap: cap of the scores (0: none). sinks: [num_heads] sink logits, or
 * NULL. */
static int paged_decode(const float *query, int64_t q_row_stride, int64_t q_head_stride,
                        const void *key_cache, const void *value_cache,
                        const int64_t *block_tables, int64_t table_stride, int64_t table_width,
                        const int64_t *context_lens, float *out, int64_t out_row_stride,
                        int64_t out_head_stride, int num_rows, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, int64_t num_cache_blocks, float scale,
                        int num_threads, int64_t window, float softcap, const float *sinks,
                        const int bf16) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0 ||
        head_dim <= 0 || head_dim % LANES != 0 || head_dim / LANES > MAX_VECTORS ||
        window < 0 || !(softcap >= 0.0f))
        return 2;
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP) return 2;
    /* Every block a row reads must lie in the cache: a bad table is refused, never read. */
    int64_t longest = 1;
    for (int r = 0; r < num_rows; ++r) {
        if (context_lens[r] <= 0) return 2;
        const int64_t first = window > 0 && context_lens[r] > window ? context_lens[r] - window : 0;
        const int64_t count = context_lens[r] - first;
        longest = count > longest ? count : longest;
        const int64_t blocks = (context_lens[r] + block_size - 1) / block_size;
        if (blocks > table_width) return 2;
        for (int64_t b = first / block_size; b < blocks; ++b) {
            const int64_t block = block_tables[r * table_stride + b];
            if (block < 0 || block >= num_cache_blocks) return 2;
        }
    }
    if (num_threads < 1) num_threads = 1;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    const int vectors = head_dim / LANES;
    /* Whole sequences per work item when there are enough to keep every thread busy, else one
     * KV head (and its group of query heads) of one sequence. */
    const int whole = num_rows >= 4 * num_threads && num_heads <= MAX_HEADS;
    const int item_kv_heads = whole ? num_kv_heads : 1;
    const int items_per_row = num_kv_heads / item_kv_heads;
    const int64_t items = (int64_t)num_rows * items_per_row;
    const int item_heads = item_kv_heads * group;
    const size_t per_thread = (size_t)item_heads * ((size_t)longest + acc_floats(head_dim, bf16));
    float *scratch = (float *)malloc(sizeof(float) * per_thread * (size_t)num_threads);
    if (scratch == NULL) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t r = item / items_per_row;            /* the sequence */
        const int64_t h = item % items_per_row * item_kv_heads; /* its first KV head */
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
        vf *acc = (vf *)(scores + (size_t)item_heads * (size_t)longest);
        const int64_t length = context_lens[r];
        const int64_t first = window > 0 && length > window ? length - window : 0;
        const int64_t head_offset = h * head_dim * (bf16 ? 2 : 4); /* bytes */
        (bf16 ? attend_item_bf16 : attend_item_f32)(
            query + r * q_row_stride + h * group * q_head_stride, q_head_stride,
            (const char *)key_cache + head_offset, (const char *)value_cache + head_offset,
            block_tables + r * table_stride, first, length, row_stride, item_kv_heads, group,
            vectors, block_size, scale, softcap, sinks != NULL ? sinks + h * group : NULL, scores,
            acc, out + r * out_row_stride + h * group * out_head_stride, out_head_stride);
    }
    free(scratch);
    return 0;
}

int actorline_paged_decode_f32(const float *query, int64_t q_row_stride, int64_t q_head_stride,
                               const void *key_cache, const void *value_cache,
                               const int64_t *block_tables, int64_t table_stride,
                               int64_t table_width, const int64_t *context_lens, float *out,
                               int64_t out_row_stride, int64_t out_head_stride, int num_rows,
                               int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int64_t num_cache_blocks, float scale, int num_threads,
                               int64_t window, float softcap, const float *sinks) {
    return paged_decode(query, q_row_stride, q_head_stride, key_cache, value_cache, block_tables,
                        table_stride, table_width, context_lens, out, out_row_stride,
                        out_head_stride, num_rows, num_heads, num_kv_heads, head_dim, block_size,
                        num_cache_blocks, scale, num_threads, window, softcap, sinks, 0);
}

/* The same over a bf16 cache (uint16 bit patterns), fp32 queries and outputs. */
int actorline_paged_decode_f32_bf16kv(const float *query, int64_t q_row_stride,
                                      int64_t q_head_stride, const void *key_cache,
                                      const void *value_cache, const int64_t *block_tables,
                                      int64_t table_stride, int64_t table_width,
                                      const int64_t *context_lens, float *out,
                                      int64_t out_row_stride, int64_t out_head_stride,
                                      int num_rows, int num_heads, int num_kv_heads, int head_dim,
                                      int block_size, int64_t num_cache_blocks, float scale,
                                      int num_threads, int64_t window, float softcap,
                                      const float *sinks) {
    return paged_decode(query, q_row_stride, q_head_stride, key_cache, value_cache, block_tables,
                        table_stride, table_width, context_lens, out, out_row_stride,
                        out_head_stride, num_rows, num_heads, num_kv_heads, head_dim, block_size,
                        num_cache_blocks, scale, num_threads, window, softcap, sinks, 1);
}

/* One sequence's query heads [0, count) that share one KV head, on the calling thread (no
 * OpenMP region): the CPU step graph's threads each attend their share of a step's (row,
 * query head) pairs inside the one region of the step. query: the first head's D floats,
 * heads q_head_stride apart; key_cache, value_cache: at that KV head (row_stride elements per
 * slot, fp32 or bf16); blocks: the row's block table, its ids already checked against the cache;
 * out: the first head's output, heads out_head_stride apart. Each head's arithmetic is that
 * of actorline_paged_decode_f32 (whatever heads an item there holds), so are its results.
 * The scratch is the calling thread's own, kept between calls. Returns 0; 1: out of memory;
 * 2: arguments it cannot serve. */
static int paged_decode_heads(const float *query, int64_t q_head_stride, const void *key_cache,
                              const void *value_cache, int64_t row_stride, const int64_t *blocks,
                              int64_t context_len, float *out, int64_t out_head_stride, int count,
                              int head_dim, int block_size, float scale, const int bf16) {
    static __thread float *scratch = NULL;
    static __thread size_t capacity = 0;
    if (count <= 0 || count > MAX_GROUP || head_dim <= 0 || head_dim % LANES != 0 ||
        head_dim / LANES > MAX_VECTORS || block_size <= 0 || context_len <= 0)
        return 2;
    /* scores (count x context) and the vector accumulators (count x head_dim floats) */
    const size_t need = (size_t)count * ((size_t)context_len + acc_floats(head_dim, bf16));
    if (need > capacity) {
        const size_t grown = need > 2 * capacity ? need : 2 * capacity;
        float *bigger = (float *)realloc(scratch, sizeof(float) * grown);
        if (bigger == NULL) return 1;
        scratch = bigger;
        capacity = grown;
    }
    (bf16 ? attend_item_bf16 : attend_item_f32)(
        query, q_head_stride, key_cache, value_cache, blocks, 0, context_len, row_stride, 1, count,
        head_dim / LANES, block_size, scale, 0.0f, NULL, scratch,
        (vf *)(scratch + (size_t)count * (size_t)context_len), out, out_head_stride);
    return 0;
}

int actorline_paged_decode_heads_f32(const float *query, int64_t q_head_stride,
                                     const void *key_cache, const void *value_cache,
                                     int64_t row_stride, const int64_t *blocks,
                                     int64_t context_len, float *out, int64_t out_head_stride,
                                     int count, int head_dim, int block_size, float scale) {
    return paged_decode_heads(query, q_head_stride, key_cache, value_cache, row_stride, blocks,
                              context_len, out, out_head_stride, count, head_dim, block_size,
                              scale, 0);
}

/* The same over a bf16 cache (uint16 bit patterns). */
int actorline_paged_decode_heads_f32_bf16kv(const float *query, int64_t q_head_stride,
                                            const void *key_cache, const void *value_cache,
                                            int64_t row_stride, const int64_t *blocks,
                                            int64_t context_len, float *out,
                                            int64_t out_head_stride, int count, int head_dim,
                                            int block_size, float scale) {
    return paged_decode_heads(query, q_head_stride, key_cache, value_cache, row_stride, blocks,
                              context_len, out, out_head_stride, count, head_dim, block_size,
                              scale, 1);
}
