/* Paged decode attention for CPU, fp32: one query token per sequence; keys and values are
 * read in place from the token-major paged cache [num_slots, Hkv, D] through each sequence's
 * block table, so nothing is gathered or padded. Built and loaded by
 * stages/execute/native.py, which checks the arguments (D a multiple of 8, group <= 16).
 *
 * Work items are whole sequences spread over OpenMP threads when there are at least four per
 * thread (each key and value row then read whole, a block's rows back to back: 1.4-1.5x the
 * bandwidth of reading one head's slice of every row, measured cold over 30 layers), else
 * (sequence, KV head) pairs so that a few long sequences still use every thread. The Hq/Hkv
 * query heads of one KV head share every key and value row read (GQA without expanding keys). Two passes
 * over the context: scores (n floats per query head), then softmax and the weighted sum of
 * values. The same plan as vLLM's CPU paged attention v1 (csrc/cpu/attention.cpp, reduce
 * over the blocks of the block table), written with GCC vector extensions so that one
 * source compiles to AVX2, AVX-512 or NEON for the machine it runs on. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 8
#define MAX_GROUP 16
#define MAX_HEADS 128 /* for whole-sequence work items */
#define MAX_VECTORS 32 /* head_dim <= 256 */

typedef float vf __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; ++i) s += v[i];
    return s;
}

static inline __attribute__((always_inline)) void
attend(const float *restrict query, int64_t q_head_stride, const float *restrict key_cache,
       const float *restrict value_cache, const int64_t *restrict blocks, int64_t context_len,
       int64_t row_stride, int group, const int vectors, int block_size, float scale,
       float *restrict scores, float *restrict out, int64_t out_head_stride) {
    vf q[MAX_GROUP][MAX_VECTORS];
    for (int g = 0; g < group; ++g)
        for (int i = 0; i < vectors; ++i)
            q[g][i] = *(const vf *)(query + g * q_head_stride + i * LANES) * scale;
    /* Pass 1: scores[g][j] = scale * <q_g, k_j>. */
    for (int64_t j0 = 0, b = 0; j0 < context_len; j0 += block_size, ++b) {
        const float *k = key_cache + blocks[b] * block_size * row_stride;
        const int64_t count = context_len - j0 < block_size ? context_len - j0 : block_size;
        for (int64_t o = 0; o < count; ++o, k += row_stride) {
            for (int g = 0; g < group; ++g) {
                vf acc = q[g][0] * *(const vf *)k;
                for (int i = 1; i < vectors; ++i) acc += q[g][i] * *(const vf *)(k + i * LANES);
                scores[g * context_len + j0 + o] = hsum(acc);
            }
        }
    }
    /* Softmax per query head, max-subtracted. */
    float inv_sum[MAX_GROUP];
    for (int g = 0; g < group; ++g) {
        float *s = scores + g * context_len;
        float peak = s[0];
        for (int64_t j = 1; j < context_len; ++j) peak = s[j] > peak ? s[j] : peak;
        float sum = 0.0f;
        for (int64_t j = 0; j < context_len; ++j) {
            s[j] = expf(s[j] - peak);
            sum += s[j];
        }
        inv_sum[g] = 1.0f / sum;
    }
    /* Pass 2: out_g = sum_j p[g][j] v_j / sum_g. */
    vf acc[MAX_GROUP][MAX_VECTORS];
    for (int g = 0; g < group; ++g)
        for (int i = 0; i < vectors; ++i) acc[g][i] = (vf){0};
    for (int64_t j0 = 0, b = 0; j0 < context_len; j0 += block_size, ++b) {
        const float *v = value_cache + blocks[b] * block_size * row_stride;
        const int64_t count = context_len - j0 < block_size ? context_len - j0 : block_size;
        for (int64_t o = 0; o < count; ++o, v += row_stride) {
            for (int g = 0; g < group; ++g) {
                const float p = scores[g * context_len + j0 + o];
                for (int i = 0; i < vectors; ++i) acc[g][i] += p * *(const vf *)(v + i * LANES);
            }
        }
    }
    for (int g = 0; g < group; ++g)
        for (int i = 0; i < vectors; ++i)
            *(vf *)(out + g * out_head_stride + i * LANES) = acc[g][i] * inv_sum[g];
}

/* All heads of one sequence: each key and value row is read whole (every KV head, 4*Hkv*D
 * contiguous bytes, a block's rows back to back), which streams from memory far better than
 * one head's slice of every row; used when there are enough sequences to share out. */
static inline __attribute__((always_inline)) void
attend_all(const float *restrict query, int64_t q_head_stride, const float *restrict key_cache,
           const float *restrict value_cache, const int64_t *restrict blocks,
           int64_t context_len, int num_kv_heads, int group, const int vectors, int block_size,
           float scale, float *restrict scores, vf *restrict acc, float *restrict out,
           int64_t out_head_stride) {
    const int heads = num_kv_heads * group;
    const int64_t row_stride = (int64_t)num_kv_heads * vectors * LANES;
    for (int64_t j0 = 0, b = 0; j0 < context_len; j0 += block_size, ++b) {
        const float *k = key_cache + blocks[b] * block_size * row_stride;
        const int64_t count = context_len - j0 < block_size ? context_len - j0 : block_size;
        for (int64_t o = 0; o < count; ++o, k += row_stride) {
            for (int h = 0; h < heads; ++h) {
                const float *q = query + h * q_head_stride;
                const float *kh = k + (h / group) * vectors * LANES;
                vf dot = *(const vf *)q * *(const vf *)kh;
                for (int i = 1; i < vectors; ++i)
                    dot += *(const vf *)(q + i * LANES) * *(const vf *)(kh + i * LANES);
                scores[h * context_len + j0 + o] = hsum(dot) * scale;
            }
        }
    }
    float inv_sum[MAX_HEADS];
    for (int h = 0; h < heads; ++h) {
        float *s = scores + h * context_len;
        float peak = s[0];
        for (int64_t j = 1; j < context_len; ++j) peak = s[j] > peak ? s[j] : peak;
        float sum = 0.0f;
        for (int64_t j = 0; j < context_len; ++j) {
            s[j] = expf(s[j] - peak);
            sum += s[j];
        }
        inv_sum[h] = 1.0f / sum;
    }
    for (int i = 0; i < heads * vectors; ++i) acc[i] = (vf){0};
    for (int64_t j0 = 0, b = 0; j0 < context_len; j0 += block_size, ++b) {
        const float *v = value_cache + blocks[b] * block_size * row_stride;
        const int64_t count = context_len - j0 < block_size ? context_len - j0 : block_size;
        for (int64_t o = 0; o < count; ++o, v += row_stride) {
            for (int h = 0; h < heads; ++h) {
                const float p = scores[h * context_len + j0 + o];
                const float *vh = v + (h / group) * vectors * LANES;
                vf *a = acc + h * vectors;
                for (int i = 0; i < vectors; ++i) a[i] += p * *(const vf *)(vh + i * LANES);
            }
        }
    }
    for (int h = 0; h < heads; ++h)
        for (int i = 0; i < vectors; ++i)
            *(vf *)(out + h * out_head_stride + i * LANES) = acc[h * vectors + i] * inv_sum[h];
}

/* Returns 0 on success, 1 when the scratch allocation failed, 2 on arguments it cannot serve.
 *
 * query: row r, head h at query + r * q_row_stride + h * q_head_stride (D contiguous).
 * out:   row r, head h at out + r * out_row_stride + h * out_head_stride (D contiguous).
 * key_cache, value_cache: [num_slots, num_kv_heads, head_dim] contiguous.
 * block_tables: [num_rows, table_width] block ids (< num_cache_blocks), rows table_stride
 * apart; context_lens: [num_rows], each >= 1 and within its row of the table. */
int actorline_paged_decode_f32(const float *query, int64_t q_row_stride, int64_t q_head_stride,
                               const float *key_cache, const float *value_cache,
                               const int64_t *block_tables, int64_t table_stride,
                               int64_t table_width, const int64_t *context_lens, float *out,
                               int64_t out_row_stride, int64_t out_head_stride, int num_rows,
                               int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int64_t num_cache_blocks, float scale, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0 ||
        head_dim <= 0 || head_dim % LANES != 0 || head_dim / LANES > MAX_VECTORS)
        return 2;
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP) return 2;
    /* Every block a row reads must lie in the cache: a bad table is refused, never read. */
    int64_t longest = 1;
    for (int r = 0; r < num_rows; ++r) {
        if (context_lens[r] <= 0) return 2;
        longest = context_lens[r] > longest ? context_lens[r] : longest;
        const int64_t blocks = (context_lens[r] + block_size - 1) / block_size;
        if (blocks > table_width) return 2;
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t block = block_tables[r * table_stride + b];
            if (block < 0 || block >= num_cache_blocks) return 2;
        }
    }
    if (num_threads < 1) num_threads = 1;
    const int64_t items = (int64_t)num_rows * num_kv_heads;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    const int vectors = head_dim / LANES;
    /* Whole sequences per work item when there are enough to keep every thread busy. */
    const int whole = num_rows >= 4 * num_threads && num_heads <= MAX_HEADS;
    const size_t per_thread =
        whole ? (size_t)num_heads * ((size_t)longest + (size_t)head_dim)
              : (size_t)group * (size_t)longest;
    float *scratch = (float *)malloc(sizeof(float) * per_thread * (size_t)num_threads);
    if (scratch == NULL) return 1;
    if (whole) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
        for (int r = 0; r < num_rows; ++r) {
            float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
            vf *acc = (vf *)(scores + (size_t)num_heads * (size_t)longest);
            const float *q = query + r * q_row_stride;
            const int64_t *blocks = block_tables + r * table_stride;
            float *o = out + r * out_row_stride;
            if (vectors == 8)
                attend_all(q, q_head_stride, key_cache, value_cache, blocks, context_lens[r],
                           num_kv_heads, group, 8, block_size, scale, scores, acc, o,
                           out_head_stride);
            else
                attend_all(q, q_head_stride, key_cache, value_cache, blocks, context_lens[r],
                           num_kv_heads, group, vectors, block_size, scale, scores, acc, o,
                           out_head_stride);
        }
        free(scratch);
        return 0;
    }
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
        const int r = (int)(item / num_kv_heads);
        const int h = (int)(item % num_kv_heads);
        const float *q = query + r * q_row_stride + (int64_t)h * group * q_head_stride;
        const float *k = key_cache + (int64_t)h * head_dim;
        const float *v = value_cache + (int64_t)h * head_dim;
        const int64_t *blocks = block_tables + r * table_stride;
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
        float *o = out + r * out_row_stride + (int64_t)h * group * out_head_stride;
        /* Constant vector counts for the common head sizes, so the D loops unroll. */
        if (vectors == 8)
            attend(q, q_head_stride, k, v, blocks, context_lens[r], row_stride, group, 8,
                   block_size, scale, scores, o, out_head_stride);
        else if (vectors == 16)
            attend(q, q_head_stride, k, v, blocks, context_lens[r], row_stride, group, 16,
                   block_size, scale, scores, o, out_head_stride);
        else
            attend(q, q_head_stride, k, v, blocks, context_lens[r], row_stride, group, vectors,
                   block_size, scale, scores, o, out_head_stride);
    }
    free(scratch);
    return 0;
}
