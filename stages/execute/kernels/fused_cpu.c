/* Fused fp32 CPU ops of the decoder layers, one pass over memory each where torch makes several:
 *
 * - RMSNorm: out = w * (x * rsqrt(mean(x^2) + eps)) per row, as HF's LlamaRMSNorm computes it
 *   in fp32 (torch: pow, mean, add, rsqrt, mul, mul: six passes and five temporaries);
 * - SiLU-and-mul of a gated MLP over the fused gate/up projection's output
 *   [rows, 2 * inter]: out = silu(gate) * up = gate / (1 + exp(-gate)) * up, as torch's silu
 *   (vLLM's silu_and_mul, csrc/activation_kernels.cu; torch: silu, then mul: two passes);
 * - rotary embeddings of the query and key heads in place, out = x * cos + rotate_half(x) * sin
 *   with rotate_half(x) = (-x2, x1) (the halves of each head), as HF's apply_rotary_pos_emb
 *   computes it (torch: two slices, a negation, a cat, two muls and an add per tensor; vLLM's
 *   rotary_embedding, csrc/cpu/pos_encoding.cpp, the neox style);
 * - the first index of each row's maximum, torch.argmax's answer (NaN counts as the maximum),
 *   for the sampler's greedy and sampled rows (torch's CPU argmax compares one element at a
 *   time: 36 us for a 49,152-token row, where the vector scan here takes a few).
 *
 * Rows are split over OpenMP threads (torch's runtime, as for the other kernels) once a call has
 * enough of them to pay for waking the threads. exp is a vector polynomial (Cephes expf's, within
 * 2 ulp of expf), so results agree with torch's to rounding. Built and loaded by
 * stages/execute/native.py; used by stages/execute/fused.py. */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define PARALLEL_ELEMENTS 32768 /* fewer elements run on the calling thread */

typedef float vf __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t)), aligned(4)));

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; ++i) s += v[i];
    return s;
}

/* exp(x): x = n ln2 + r, |r| <= ln2 / 2; exp(r) by Cephes expf's degree-6 polynomial; 2^n in the
 * exponent bits. Clamped to [-87.3, 88.7]: 0 below (a denormal at most), finite above. */
static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.33654f, hi = (vf){0} + 88.72283f;
    const vi below = x < lo, above = x > hi;
    x = (vf)(((vi)x & ~below) | ((vi)lo & below));
    x = (vf)(((vi)x & ~above) | ((vi)hi & above));
    /* n = round(x / ln2): adding and subtracting 1.5 * 2^23 rounds to the nearest integer */
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

int actorline_fused_lanes(void) { return LANES; }

static inline int threads_for(int64_t elements, int threads) {
    return elements < PARALLEL_ELEMENTS || threads < 1 ? 1 : threads;
}

/* One row of RMSNorm: dim floats at row into y. */
static inline void rms_row(const float *restrict row, const float *restrict weight,
                           float *restrict y, int64_t dim, float eps) {
    vf squares = (vf){0};
    int64_t j = 0;
    for (; j + LANES <= dim; j += LANES) {
        const vf v = *(const vf *)(row + j);
        squares += v * v;
    }
    float sum = hsum(squares);
    for (; j < dim; ++j) sum += row[j] * row[j];
    const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    for (j = 0; j + LANES <= dim; j += LANES)
        *(vf *)(y + j) = *(const vf *)(weight + j) * (*(const vf *)(row + j) * scale);
    for (; j < dim; ++j) y[j] = weight[j] * (row[j] * scale);
}

/* x: rows of dim floats, x_stride apart; out: rows of dim floats, contiguous. */
void actorline_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out,
                            int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * dim, threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) rms_row(x + r * x_stride, weight, out + r * dim, dim, eps);
}

/* The same on the calling thread, no OpenMP region (the CPU step graph's threads call it
 * inside the one region of a step): rows of x, x_stride apart, into rows of out, out_stride
 * apart; the same results as actorline_rms_norm_f32's. */
void actorline_rms_norm_rows_f32(const float *x, int64_t x_stride, const float *weight,
                                 float *out, int64_t out_stride, int64_t rows, int64_t dim,
                                 float eps) {
    for (int64_t r = 0; r < rows; ++r)
        rms_row(x + r * x_stride, weight, out + r * out_stride, dim, eps);
}

/* silu(gate[j]) * up[j] for j in [first, last), gate's vector part below vector_end (a
 * multiple of LANES; first too), one element at a time from there (the row's tail). */
static inline void silu_mul_span(const float *restrict gate, const float *restrict up,
                                 float *restrict y, int64_t first, int64_t last,
                                 int64_t vector_end) {
    int64_t j = first;
    for (; j + LANES <= last && j + LANES <= vector_end; j += LANES) {
        const vf g = *(const vf *)(gate + j);
        *(vf *)(y + j) = g / (1.0f + vexp(-g)) * *(const vf *)(up + j);
    }
    for (; j < last; ++j) y[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}

/* gate_up: rows of 2 * inter floats (gate, then up), contiguous; out: rows of inter floats. */
void actorline_silu_mul_f32(const float *gate_up, int64_t rows, int64_t inter, float *out,
                            int threads) {
#pragma omp parallel for num_threads(threads_for(rows * inter, threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = gate_up + r * 2 * inter;
        silu_mul_span(gate, gate + inter, out + r * inter, 0, inter, inter / LANES * LANES);
    }
}

/* The same over columns [first, last) of each row (first a multiple of 16), on the calling
 * thread, no OpenMP region: gate and up rows in_stride apart, out rows out_stride apart, each
 * element as actorline_silu_mul_f32 computes it. */
void actorline_silu_mul_cols_f32(const float *gate, const float *up, int64_t in_stride,
                                 float *out, int64_t out_stride, int64_t rows, int64_t inter,
                                 int64_t first, int64_t last) {
    for (int64_t r = 0; r < rows; ++r)
        silu_mul_span(gate + r * in_stride, up + r * in_stride, out + r * out_stride, first,
                      last, inter / LANES * LANES);
}

/* In place over rows of the query (q_heads heads of head_dim floats, rows q_stride apart) and
 * the key (likewise): each head's halves (x1, x2) become (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)
 * with c, s the row's head_dim cosines and sines (contiguous rows). */
static inline void rope_heads(float *restrict x, int heads, int head_dim, const float *restrict c,
                              const float *restrict s) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; ++h) {
        float *restrict x1 = x + h * head_dim, *restrict x2 = x1 + half;
        for (int j = 0; j < half; ++j) {
            const float a = x1[j], b = x2[j];
            x1[j] = a * c[j] - b * s[j];
            x2[j] = b * c[j + half] + a * s[j + half];
        }
    }
}

void actorline_rope_f32(float *q, int64_t q_stride, int q_heads, float *k, int64_t k_stride,
                        int k_heads, int64_t rows, int head_dim, const float *cos,
                        const float *sin, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * (q_heads + k_heads) * head_dim, threads)) \
    schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        rope_heads(q + r * q_stride, q_heads, head_dim, c, s);
        rope_heads(k + r * k_stride, k_heads, head_dim, c, s);
    }
}

/* rope_heads on the calling thread: heads heads of head_dim floats at x, one row's cos and
 * sin (the CPU step graph ropes each head where its thread computed it). */
void actorline_rope_heads_f32(float *x, int heads, int head_dim, const float *cos,
                              const float *sin) {
    rope_heads(x, heads, head_dim, cos, sin);
}

/* out[r] = the first index of row r's maximum (the first NaN where a row has one); rows of
 * cols floats (cols < 2^31), stride apart. One pass: each lane keeps the first index of its
 * own maximum (a strict >, so ties keep the earlier), then the first of the lanes that hold the
 * row's maximum wins. */
void actorline_argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t stride,
                               int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * cols, threads)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * stride;
        vf best = (vf){0} - INFINITY;
        vi where = (vi){0}, lane, nan = (vi){0};
        for (int i = 0; i < LANES; ++i) lane[i] = i;
        int64_t j = 0;
        for (; j + LANES <= cols; j += LANES) {
            const vf v = *(const vf *)(row + j);
            const vi above = v > best;
            nan |= v != v;
            best = (vf)(((vi)v & above) | ((vi)best & ~above));
            where = ((lane + (int32_t)j) & above) | (where & ~above);
        }
        float peak = -INFINITY;
        int64_t index = 0;
        int has_nan = 0;
        for (int i = 0; i < LANES; ++i) {
            has_nan |= nan[i] != 0;
            if (best[i] > peak || (best[i] == peak && where[i] < index)) {
                peak = best[i];
                index = where[i];
            }
        }
        for (; j < cols; ++j) {
            has_nan |= row[j] != row[j];
            if (row[j] > peak) {
                peak = row[j];
                index = j;
            }
        }
        if (has_nan)
            for (index = 0; row[index] == row[index]; ++index) {
            }
        out[r] = index;
    }
}
