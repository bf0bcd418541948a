/* The CPU step graph: a whole decode step of actorline's own Llama (every row one new token)
 * in one call, the CPU analogue of a captured CUDA graph (docs/architecture.md §6.5; Python side:
 * stages/execute/step_graph.py, which records the plan once and fills its small input buffers
 * per step).
 *
 * The plan holds fixed pointers: every layer's weights (each linear as a NativeGemm: function,
 * weights, format, bias, n, k), its norms and KV cache tensors, the fp32 workspaces (max_rows
 * rows each), the kernels of fused_cpu.c (RMSNorm, SiLU-and-mul, rotary) and paged_decode.c
 * (decode attention) as function pointers, and the input buffers the caller fills. The step
 * calls the same kernels with the same arguments in the same order as the module path (the
 * decoder layers of stages/execute/llama.py over the fused and packed modules), so its logits
 * are those of the module path bit for bit; new here are only copies (embedding rows, cos/sin
 * rows of the rotary table, the KV write at the slot mapping, the sampled rows) and the
 * residual adds, all exact.
 *
 * Threads: ONE OpenMP region per step (step_threaded), its threads kept across the layer loop,
 * where the per-op form (step_per_op) opened a region per GEMM and fused op (~8 fork/joins a
 * layer, and the fused ops of a few rows on one thread while the others waited). A layer is
 * five phases, each cut into chunks that the threads claim (sg_phase):
 *   1. the input RMSNorm into a buffer of the thread's own (every thread the whole rows: a few
 *      KiB), then per chunk a range of whole heads of q, k and v (32-column aligned), their
 *      rotary embeddings and the K/V heads written into the cache;
 *   2. attention: a range of the step's (row, query head) pairs;
 *   3. a range of o_proj's columns and of the residual add;
 *   4. the post-attention RMSNorm (the thread's buffer again), then per chunk a range of gate
 *      columns, the matching up columns of the fused gate/up projection, SiLU-and-mul of them
 *      (bf16 panels: one call of the GEMM's SiLU-and-mul epilogue on those gate columns, the
 *      layer's silu_part, as the per-op form calls the whole epilogue);
 *   5. a range of down_proj's columns and of the residual add;
 * then the final norm and ranges of the LM head's columns. A linear's range goes through its
 * ``part`` entry (NativeGemm.part: the same micro-kernels on a column range, no region of its
 * own). Every element is computed by the same code in the same order as in the per-op form,
 * so the logits are the same bit for bit. The per-op form stays for plans whose linears have
 * no part entry or whose shapes the column ranges cannot split (a head_dim not a multiple of
 * 16, a fused gate/up whose halves do not meet at a multiple of 32 columns), and as the
 * reference the tests compare against. */
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

typedef int (*gemm_fn)(const float *x, int64_t m, int64_t k, const void *weights, int format,
                       const float *bias, int64_t n, float *y, int threads);
typedef void (*rms_fn)(const float *x, int64_t x_stride, const float *weight, float *out,
                       int64_t rows, int64_t dim, float eps, int threads);
typedef void (*silu_fn)(const float *gate_up, int64_t rows, int64_t inter, float *out,
                        int threads);
typedef void (*rope_fn)(float *q, int64_t q_stride, int q_heads, float *k, int64_t k_stride,
                        int k_heads, int64_t rows, int head_dim, const float *cos,
                        const float *sin, int threads);
typedef int (*gemm_part_fn)(const float *x, int64_t m, int64_t k, const void *weights,
                            int format, const float *bias, int64_t n, float *y, int64_t col0,
                            int64_t col1, int same_x);
typedef void (*rms_rows_fn)(const float *x, int64_t x_stride, const float *weight, float *out,
                            int64_t out_stride, int64_t rows, int64_t dim, float eps);
typedef void (*silu_cols_fn)(const float *gate, const float *up, int64_t in_stride, float *out,
                             int64_t out_stride, int64_t rows, int64_t inter, int64_t first,
                             int64_t last);
typedef void (*rope_heads_fn)(float *x, int heads, int head_dim, const float *cos,
                              const float *sin);
typedef int (*attn_heads_fn)(const float *query, int64_t q_head_stride, const void *key_cache,
                             const void *value_cache, int64_t row_stride, const int64_t *blocks,
                             int64_t context_len, float *out, int64_t out_head_stride, int count,
                             int head_dim, int block_size, float scale);
typedef int (*attn_fn)(const float *query, int64_t q_row_stride, int64_t q_head_stride,
                       const void *key_cache, const void *value_cache,
                       const int64_t *block_tables, int64_t table_stride, int64_t table_width,
                       const int64_t *context_lens, float *out, int64_t out_row_stride,
                       int64_t out_head_stride, int num_rows, int num_heads, int num_kv_heads,
                       int head_dim, int block_size, int64_t num_cache_blocks, float scale,
                       int num_threads, int64_t window, float softcap, const float *sinks);

/* One linear under NativeGemm's convention; function 0: absent; part: its column-range entry
 * (0: none). */
typedef struct {
    void *function;
    void *part;
    const void *weights;
    int64_t format;
    const float *bias;
    int64_t n, k;
} sg_gemm;

/* A linear's LoRA deltas for a step's set of adapters (stages/execute/step_graph_lora.py):
 * the adapters' A concatenated along the rank, a [rank, k], and their B likewise, transposed
 * and scaled, bt [rank, out] (the same tensors the module path's lora_segments.py multiplies);
 * adapter group g owns the rank columns [offsets[g], offsets[g + 1]) (empty: it leaves this
 * linear alone). a NULL: no adapter of the set touches the linear. */
typedef struct {
    const float *a, *bt;
    const int64_t *offsets;
    int64_t rank, out;
} sg_lora;

enum { SG_Q, SG_K, SG_V, SG_O, SG_GATE, SG_UP, SG_DOWN, SG_TARGETS };

typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    sg_gemm q, k, v, o;
    sg_gemm gate; /* the fused gate/up projection (gate's columns, then up's) when up is absent */
    sg_gemm up;
    sg_gemm down;
    void *key_cache, *value_cache; /* [num_slots, kv_heads, head_dim], fp32 or bf16 (kv_bf16) */
    /* The fused gate/up projection's SiLU-and-mul epilogue (bf16_gemm.c: the gate argument's
     * weights and shapes, output rows of n / 2 = inter floats) and its gate-column-range entry;
     * 0: none (the GEMM, then SiLU-and-mul). */
    void *silu, *silu_part;
} sg_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, vocab;
    int64_t block_size, num_cache_blocks, table_width, max_rows, num_layers;
    float scale, final_eps;
    rms_fn rms;
    silu_fn silu;
    rope_fn rope;
    attn_fn attn; /* paged_decode.c's entry point for the cache's type */
    int64_t kv_bf16; /* the KV cache holds bf16: rows are rounded to it as they are written */
    /* the same kernels' entries for one thread's share (step_threaded) */
    rms_rows_fn rms_rows;
    silu_cols_fn silu_cols;
    rope_heads_fn rope_heads;
    attn_heads_fn attn_heads; /* for the cache's type, as attn */
    int64_t threaded; /* 1: one region per step (step_threaded); 0: step_per_op */
    /* Embedding row v: emb + (v / emb_panel) * emb_panel_stride + (v % emb_panel) *
     * emb_lane_stride, its elements emb_elem_stride apart (a [V, H] table: 1, H, 0, 1; a packed
     * LM head's panels: 16, 16 H, 1, 16). NULL: the caller writes the rows into h. */
    const float *emb;
    int64_t emb_panel, emb_panel_stride, emb_lane_stride, emb_elem_stride;
    const float *cos_table, *sin_table; /* [table_rows, head_dim] */
    int64_t table_rows;
    const float *final_norm;
    sg_gemm head;
    const sg_layer *layers;
    /* inputs, filled per step */
    const int64_t *tokens, *positions, *slots, *block_tables, *context_lens, *keep;
    /* workspaces, max_rows rows each (row widths: the producing GEMM's n) */
    float *h, *xn, *q, *kb, *vb, *attn_out, *o, *gate_buf, *up_buf, *gate_up, *act, *down;
    float *cos, *sin, *kept, *logits;
    /* LoRA (NULL: a step of base rows): SG_TARGETS entries a layer, and each row's adapter
     * group (-1: the base model); lora_rank: the largest rank of an entry (the shrink
     * buffers' width) */
    const sg_lora *lora;
    const int64_t *lora_rows;
    int64_t lora_rank;
} sg_plan;

int actorline_step_graph_abi(void) { return (int)sizeof(sg_plan) * 1000 + (int)sizeof(sg_layer); }

static int gemm(const sg_gemm *g, const float *x, int64_t rows, float *y, int threads) {
    return ((gemm_fn)g->function)(x, rows, g->k, g->weights, (int)g->format, g->bias, g->n, y,
                                  threads);
}

/* h[r, :hidden] += add[r, :hidden], add's rows add_stride apart. */
static void residual(float *restrict h, const float *restrict add, int64_t rows, int64_t hidden,
                     int64_t add_stride) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < hidden; ++j) h[r * hidden + j] += add[r * add_stride + j];
}

/* The LoRA entry of layer ``index``'s linear ``target``, or NULL (no adapter touches it). */
static inline const sg_lora *lora_of(const sg_plan *p, int64_t index, int target) {
    if (p->lora == NULL) return NULL;
    const sg_lora *l = p->lora + index * SG_TARGETS + target;
    return l->a != NULL && l->rank > 0 ? l : NULL;
}

/* x[:k] . a[:k], in 16 independent partial sums (vectorised without reassociation flags). */
static inline float dot(const float *restrict x, const float *restrict a, int64_t k) {
    float part[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= k; j += 16)
        for (int u = 0; u < 16; ++u) part[u] += x[j + u] * a[j + u];
    float total = 0.0f;
    for (; j < k; ++j) total += x[j] * a[j];
    for (int u = 0; u < 16; ++u) total += part[u];
    return total;
}

/* out[i] = x[:k] . a[i * k:(i + 1) * k] for i < 4, each summed as dot() sums it (the same
 * result bit for bit), the four sharing the loads of x. */
static inline void dot4(const float *restrict x, const float *restrict a, int64_t k,
                        float *restrict out) {
    float p0[16] = {0}, p1[16] = {0}, p2[16] = {0}, p3[16] = {0};
    const float *restrict a1 = a + k, *restrict a2 = a + 2 * k, *restrict a3 = a + 3 * k;
    int64_t j = 0;
    for (; j + 16 <= k; j += 16)
        for (int u = 0; u < 16; ++u) {
            const float v = x[j + u];
            p0[u] += v * a[j + u];
            p1[u] += v * a1[j + u];
            p2[u] += v * a2[j + u];
            p3[u] += v * a3[j + u];
        }
    float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
    for (; j < k; ++j) {
        t0 += x[j] * a[j];
        t1 += x[j] * a1[j];
        t2 += x[j] * a2[j];
        t3 += x[j] * a3[j];
    }
    for (int u = 0; u < 16; ++u) {
        t0 += p0[u];
        t1 += p1[u];
        t2 += p2[u];
        t3 += p3[u];
    }
    out[0] = t0, out[1] = t1, out[2] = t2, out[3] = t3;
}

/* The LoRA shrink of rows [first, last): s[r, t] = x[r] . a[t] over row r's own group's rank
 * columns (groups[r]; -1, a row of the base model: nothing), s's rows l->rank apart. */
static void lora_shrink_rows(const sg_lora *l, const int64_t *groups, const float *x,
                             int64_t x_stride, int64_t first, int64_t last, int64_t k, float *s) {
    for (int64_t r = first; r < last; ++r) {
        const int64_t g = groups[r];
        if (g < 0) continue;
        const float *restrict row = x + r * x_stride;
        int64_t t = l->offsets[g];
        for (; t + 4 <= l->offsets[g + 1]; t += 4) /* four rank columns per pass over the row */
            dot4(row, l->a + t * k, k, s + r * l->rank + t);
        for (; t < l->offsets[g + 1]; ++t) s[r * l->rank + t] = dot(row, l->a + t * k, k);
    }
}

/* y[r, j:j + W] += s[r, t] * bt[t, j:j + W] over row r's group's rank columns [t0, t1), in
 * t's order for each element, the W elements in registers across them. */
#define LORA_EXPAND_BLOCK(W)                                                                \
    do {                                                                                    \
        float acc[W];                                                                       \
        for (int u = 0; u < W; ++u) acc[u] = out[j + u];                                    \
        for (int64_t t = t0; t < t1; ++t) {                                                 \
            const float *restrict b = l->bt + t * l->out + j;                               \
            for (int u = 0; u < W; ++u) acc[u] += v[t] * b[u];                              \
        }                                                                                   \
        for (int u = 0; u < W; ++u) out[j + u] = acc[u];                                    \
    } while (0)

/* The LoRA expand over columns [first, last) (cut at the adapters' width): y[r, j] +=
 * s[r, t] * bt[t, j] over each row's group's rank columns, in t's order for each element.
 * By tiles of 16 rows, in each by blocks of 64 columns (then 16, then one), every row of the
 * tile in each: a block of bt (64 columns of every rank column, 16 KiB at a total rank of 64)
 * stays in L1 across the tile's rows, and the tile's rows of y in L2 across its blocks. */
static void lora_expand_rows(const sg_lora *l, const int64_t *groups, const float *s,
                             int64_t rows, float *y, int64_t y_stride, int64_t first,
                             int64_t last) {
    if (last > l->out) last = l->out;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t r1 = r0 + 16 < rows ? r0 + 16 : rows;
        for (int64_t j0 = first; j0 < last; j0 += 64) {
            const int64_t width = last - j0 < 64 ? last - j0 : 64;
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t g = groups[r];
                if (g < 0) continue;
                const int64_t t0 = l->offsets[g], t1 = l->offsets[g + 1];
                if (t0 == t1) continue;
                float *restrict out = y + r * y_stride;
                const float *restrict v = s + r * l->rank;
                int64_t j = j0;
                if (width == 64) {
                    LORA_EXPAND_BLOCK(64);
                    continue;
                }
                for (; j + 16 <= j0 + width; j += 16) LORA_EXPAND_BLOCK(16);
                for (; j < j0 + width; ++j) {
                    float acc = out[j];
                    for (int64_t t = t0; t < t1; ++t) acc += v[t] * l->bt[t * l->out + j];
                    out[j] = acc;
                }
            }
        }
    }
}

/* The step graph's shrink and expand: the plan's rows' groups. */
static inline void lora_shrink(const sg_plan *p, const sg_lora *l, const float *x,
                               int64_t x_stride, int64_t rows, int64_t k, float *s) {
    lora_shrink_rows(l, p->lora_rows, x, x_stride, 0, rows, k, s);
}

static inline void lora_expand(const sg_plan *p, const sg_lora *l, const float *s, int64_t rows,
                               float *y, int64_t y_stride, int64_t first, int64_t last) {
    lora_expand_rows(l, p->lora_rows, s, rows, y, y_stride, first, last);
}

/* The module path's LoRA delta of one linear (stages/execute/lora_native.py), the same shrink
 * and expand as the step graph's: y[r, :l->out] += row r's delta, for rows rows of x (k
 * floats each, x_stride apart) under their groups (groups[r] in [-1, count), -1: the base
 * model's row, untouched; offsets has count + 1 entries), y's rows y_stride apart, s a buffer
 * of rows * l->rank floats. One OpenMP region of threads threads (one thread below ~2M
 * multiply-adds): the shrink by rows, then the expand by ranges of the output's columns
 * (multiples of 64; every row each). Returns 0; 2: arguments out of range (nothing
 * written). */
int actorline_lora_delta(const sg_lora *l, const int64_t *groups, int64_t count, const float *x,
                         int64_t x_stride, int64_t rows, int64_t k, float *y, int64_t y_stride,
                         float *s, int threads) {
    if (l == NULL || l->a == NULL || l->bt == NULL || l->offsets == NULL || rows < 0 ||
        count < 1 || k < 1 || l->rank < 1 || l->out < 1 || x_stride < k || y_stride < l->out)
        return 2;
    for (int64_t g = 0; g < count; ++g)
        if (l->offsets[g] < 0 || l->offsets[g] > l->offsets[g + 1]) return 2;
    if (l->offsets[count] > l->rank) return 2;
    for (int64_t r = 0; r < rows; ++r)
        if (groups[r] < -1 || groups[r] >= count) return 2;
    const int64_t units = (l->out + 63) / 64;
    if (threads < 1) threads = 1;
    /* a region's fork and join (and, on a loaded machine, a thread descheduled at the
     * barrier) costs more than a small delta: below ~2M multiply-adds one thread does it */
    if (threads > 1 && rows * l->rank * (k + l->out) < (1 << 21)) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int n = omp_get_num_threads(), id = omp_get_thread_num();
        lora_shrink_rows(l, groups, x, x_stride, rows * id / n, rows * (id + 1) / n, k, s);
#pragma omp barrier
        lora_expand_rows(l, groups, s, rows, y, y_stride, units * id / n * 64,
                         units * (id + 1) / n * 64);
    }
    return 0;
}

/* The whole LoRA delta of layer index's target on every column (the per-op form), s a buffer
 * of max_rows * lora_rank floats. */
static void lora_add(const sg_plan *p, int64_t index, int target, const float *x,
                     int64_t x_stride, int64_t rows, int64_t k, float *y, int64_t y_stride,
                     float *s) {
    const sg_lora *l = lora_of(p, index, target);
    if (l == NULL) return;
    lora_shrink(p, l, x, x_stride, rows, k, s);
    lora_expand(p, l, s, rows, y, y_stride, 0, l->out);
}

/* fp32 -> bf16, rounding to nearest even (NaN: the quiet NaN 0x7fc0), as torch's
 * Tensor.to(torch.bfloat16) rounds (c10/util/BFloat16.h, round_to_nearest_even), so the step
 * graph writes the very bits the module path's index_copy_ of a bf16 tensor writes. */
static inline uint16_t to_bf16(float value) {
    if (value != value) return 0x7fc0u;
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* count floats of one token's K or V row into a cache layer from element ``offset`` on, as
 * the cache stores them (fp32, or rounded to bf16). */
static void store_kv(void *cache, int64_t offset, const float *row, int64_t count, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + offset, row, sizeof(float) * (size_t)count);
        return;
    }
    uint16_t *out = (uint16_t *)cache + offset;
    for (int64_t j = 0; j < count; ++j) out[j] = to_bf16(row[j]);
}

/* The K and V of heads [first, last) of every row into the cache at the rows' slots. */
static void write_kv_heads(const sg_plan *p, const sg_layer *L, int64_t rows, const float *k_rows,
                           int64_t k_stride, const float *v_rows, int64_t v_stride,
                           int64_t first, int64_t last) {
    const int64_t D = p->head_dim, kv_width = p->kv_heads * D;
    const int bf16 = (int)p->kv_bf16;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = p->slots[r] * kv_width + first * D;
        if (k_rows != NULL)
            store_kv(L->key_cache, at, k_rows + r * k_stride + first * D, (last - first) * D, bf16);
        if (v_rows != NULL)
            store_kv(L->value_cache, at, v_rows + r * v_stride + first * D, (last - first) * D,
                     bf16);
    }
}

/* The layers one op at a time, each kernel with its own OpenMP region. Returns 0 or 3. */
/* s: a LoRA shrink buffer of max_rows * lora_rank floats (NULL without LoRA). */
static int step_per_op(const sg_plan *p, int64_t rows, int64_t keep, int threads, float *s) {
    const int64_t H = p->hidden, D = p->head_dim;
    for (int64_t index = 0; index < p->num_layers; ++index) {
        const sg_layer *L = p->layers + index;
        p->rms(p->h, H, L->norm1, p->xn, rows, H, L->eps1, threads);
        if (gemm(&L->q, p->xn, rows, p->q, threads) || gemm(&L->k, p->xn, rows, p->kb, threads) ||
            gemm(&L->v, p->xn, rows, p->vb, threads))
            return 3;
        lora_add(p, index, SG_Q, p->xn, H, rows, L->q.k, p->q, L->q.n, s);
        lora_add(p, index, SG_K, p->xn, H, rows, L->k.k, p->kb, L->k.n, s);
        lora_add(p, index, SG_V, p->xn, H, rows, L->v.k, p->vb, L->v.n, s);
        p->rope(p->q, L->q.n, (int)p->heads, p->kb, L->k.n, (int)p->kv_heads, rows, (int)D, p->cos,
                p->sin, threads);
        write_kv_heads(p, L, rows, p->kb, L->k.n, p->vb, L->v.n, 0, p->kv_heads);
        if (p->attn(p->q, L->q.n, D, L->key_cache, L->value_cache, p->block_tables,
                    p->table_width, p->table_width, p->context_lens, p->attn_out, p->heads * D, D,
                    (int)rows, (int)p->heads, (int)p->kv_heads, (int)D, (int)p->block_size,
                    p->num_cache_blocks, p->scale, threads, 0, 0.0f, NULL))
            return 3;
        if (gemm(&L->o, p->attn_out, rows, p->o, threads)) return 3;
        lora_add(p, index, SG_O, p->attn_out, p->heads * D, rows, L->o.k, p->o, L->o.n, s);
        residual(p->h, p->o, rows, H, L->o.n);
        p->rms(p->h, H, L->norm2, p->xn, rows, H, L->eps2, threads);
        const int64_t I = p->inter;
        const float *gate_up = p->gate_up;
        if (L->silu != NULL) { /* the gate/up GEMM with its SiLU-and-mul epilogue */
            if (lora_of(p, index, SG_GATE) != NULL) return 3; /* no delta before the epilogue */
            if (((gemm_fn)L->silu)(p->xn, rows, L->gate.k, L->gate.weights, (int)L->gate.format,
                                   L->gate.bias, L->gate.n, p->act, threads))
                return 3;
            goto down;
        }
        if (L->up.function == NULL) { /* one gate/up GEMM */
            if (gemm(&L->gate, p->xn, rows, p->gate_buf, threads)) return 3;
            lora_add(p, index, SG_GATE, p->xn, H, rows, L->gate.k, p->gate_buf, L->gate.n, s);
            if (L->gate.n == 2 * I)
                gate_up = p->gate_buf;
            else
                for (int64_t r = 0; r < rows; ++r)
                    memcpy(p->gate_up + r * 2 * I, p->gate_buf + r * L->gate.n, sizeof(float) * 2 * I);
        } else {
            if (gemm(&L->gate, p->xn, rows, p->gate_buf, threads) ||
                gemm(&L->up, p->xn, rows, p->up_buf, threads))
                return 3;
            lora_add(p, index, SG_GATE, p->xn, H, rows, L->gate.k, p->gate_buf, L->gate.n, s);
            lora_add(p, index, SG_UP, p->xn, H, rows, L->up.k, p->up_buf, L->up.n, s);
            for (int64_t r = 0; r < rows; ++r) {
                memcpy(p->gate_up + r * 2 * I, p->gate_buf + r * L->gate.n, sizeof(float) * I);
                memcpy(p->gate_up + r * 2 * I + I, p->up_buf + r * L->up.n, sizeof(float) * I);
            }
        }
        p->silu(gate_up, rows, I, p->act, threads);
    down:
        if (gemm(&L->down, p->act, rows, p->down, threads)) return 3;
        lora_add(p, index, SG_DOWN, p->act, I, rows, L->down.k, p->down, L->down.n, s);
        residual(p->h, p->down, rows, H, L->down.n);
    }
    if (keep == 0) return 0;
    p->rms(p->h, H, p->final_norm, p->xn, rows, H, p->final_eps, threads);
    for (int64_t i = 0; i < keep; ++i)
        memcpy(p->kept + i * H, p->xn + p->keep[i] * H, sizeof(float) * H);
    return gemm(&p->head, p->kept, keep, p->logits, threads) ? 3 : 0;
}

/* ------------------------------------------------------------ one region per step */

#define UNIT 32 /* columns: a pair of 16-column panels (the fp32 GEMM pairs them) */

typedef struct {
    int64_t first, last;
} span;

/* Part t of threads (a chunk of a phase): its contiguous share of count units. */
static inline span share(int64_t count, int t, int threads) {
    return (span){count * t / threads, count * (t + 1) / threads};
}

/* Part t of threads (a chunk) of a GEMM's n columns, in units of 32 (the last part's end: n). */
static inline span columns(int64_t n, int t, int threads) {
    const int64_t units = (n + UNIT - 1) / UNIT;
    const span s = share(units, t, threads);
    return (span){s.first * UNIT, s.last == units ? n : s.last * UNIT};
}

/* The last part entry a thread called in the current phase and its rows: within a phase the
 * rows a linear reads do not change, so a call of the same entry on the same rows tells the
 * kernel so (same_x) and it keeps what it derived from them (int8 blocks, bf16 pairs) instead
 * of deriving it again for every chunk and every projection. Reset at each phase. */
typedef struct {
    void *entry;
    const float *x;
} sg_last;

/* Column-range entry ``entry`` (g's part, or a layer's silu_part over g's weights) on cols. */
static inline int part_of(void *entry, const sg_gemm *g, const float *x, int64_t rows, float *y,
                          span cols, sg_last *last) {
    if (cols.first >= cols.last) return 0;
    const int same_x = last->entry == entry && last->x == x;
    last->entry = entry, last->x = x;
    return ((gemm_part_fn)entry)(x, rows, g->k, g->weights, (int)g->format, g->bias, g->n, y,
                                 cols.first, cols.last, same_x);
}

static inline int part(const sg_gemm *g, const float *x, int64_t rows, float *y, span cols,
                       sg_last *last) {
    return part_of(g->part, g, x, rows, y, cols, last);
}

/* h[r, cols] += add[r, cols] over the columns of cols below hidden. */
static void residual_cols(float *restrict h, const float *restrict add, int64_t rows,
                          int64_t hidden, int64_t add_stride, span cols) {
    const int64_t last = cols.last < hidden ? cols.last : hidden;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = cols.first; j < last; ++j) h[r * hidden + j] += add[r * add_stride + j];
}

/* A buffer of the calling thread's own of at least floats floats, kept between steps. */
static float *thread_floats(size_t floats) {
    static __thread float *buffer = NULL;
    static __thread size_t capacity = 0;
    if (floats > capacity) {
        float *bigger = (float *)realloc(buffer, sizeof(float) * floats);
        if (bigger == NULL) return NULL;
        buffer = bigger;
        capacity = floats;
    }
    return buffer;
}

/* The heads of one of q, k, v (count of them, its units from base on in the list q's units,
 * k's, v's) that fall in a chunk's units: per_unit = 32 / gcd(D, 32) heads a unit, so that
 * a range of them starts at a multiple of 32 columns. */
static span head_range(span units, int64_t base, int64_t count, int64_t per_unit) {
    const int64_t total = (count + per_unit - 1) / per_unit;
    int64_t first = units.first - base, last = units.last - base;
    first = first < 0 ? 0 : first > total ? total : first;
    last = last < 0 ? 0 : last > total ? total : last;
    const int64_t h0 = first * per_unit, h1 = last * per_unit < count ? last * per_unit : count;
    return (span){h0, h1 > h0 ? h1 : h0};
}

/* The GEMM columns of those heads (the last head's end: the GEMM's n, its padding included). */
static inline span head_columns(span heads, int64_t count, int64_t D, int64_t n) {
    if (heads.first >= heads.last) return (span){0, 0};
    return (span){heads.first * D, heads.last == count ? n : heads.last * D};
}

/* The phases of a step, in order: five a layer and the LM head. Each phase's work is cut into
 * chunks that the threads claim one at a time (a counter each phase), and a phase's chunks
 * start once every chunk of the phase before it is finished (a second counter), so the phases
 * run in order as with a barrier between them; but a thread that the OS has descheduled holds
 * up the others only while it holds a chunk: the others claim what it would have taken
 * (on a machine shared with other work a barrier waited for the late thread's next time slice,
 * ms each, 150 times a step). A thread that has spun SPINS pauses for the phase before to
 * finish sleeps on a futex, woken by the thread that finishes its last chunk: a thread that
 * yielded its core instead (sched_yield) had to be scheduled again among every runnable task
 * of a loaded machine before it could see the phase finished, ms each phase (a 64-row bf16 step
 * took 0.41-0.44 s at two threads and load 14, against 0.11 s for the module path, whose
 * OpenMP joins sleep on futexes as libgomp's do); a woken sleeper is scheduled promptly. */
typedef struct {
    int64_t next;          /* chunks claimed */
    int32_t done, waiters; /* chunks finished (the futex word), threads asleep on it */
    char pad[48];          /* a cache line each */
} sg_phase;

#define CHUNKS_PER_THREAD 4 /* chunks a phase is cut into, per thread (fewer where it has fewer) */
#define SPINS 1000          /* pauses before a waiting thread sleeps */

static inline int64_t chunk_count(int64_t units, int threads) {
    const int64_t most = threads > 1 ? (int64_t)CHUNKS_PER_THREAD * threads : 1;
    return units < most ? units : most;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Sleep until ph->done may differ from seen (a wake, a spurious return, or 1 ms at most). The
 * waiter count is raised before done is read again and finish() raises done before it reads the
 * count (both sequentially consistent), so a finish either sees the sleeper or the sleeper sees
 * the finish; the kernel compares done with seen again as it queues the sleeper. */
static void phase_sleep(sg_phase *ph, int32_t seen) {
#if defined(__linux__)
    const struct timespec most = {0, 1000000};
    __atomic_fetch_add(&ph->waiters, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&ph->done, __ATOMIC_SEQ_CST) == seen)
        syscall(SYS_futex, &ph->done, FUTEX_WAIT_PRIVATE, seen, &most, NULL, 0);
    __atomic_fetch_sub(&ph->waiters, 1, __ATOMIC_SEQ_CST);
#else
    (void)ph, (void)seen;
    sched_yield();
#endif
}

/* Whether this thread has anything to claim in phase ph (of chunks chunks); if so, after the
 * phase before it (before_chunks chunks; none for the first) is finished. */
static int phase_open(sg_phase *ph, const sg_phase *first, int64_t chunks, int64_t before_chunks,
                      sg_last *last) {
    last->entry = NULL, last->x = NULL;
    if (__atomic_load_n(&ph->next, __ATOMIC_RELAXED) >= chunks) return 0;
    if (ph != first)
        for (int spins = 0;; ++spins) {
            const int32_t seen = __atomic_load_n(&ph[-1].done, __ATOMIC_ACQUIRE);
            if (seen >= before_chunks) break;
            if (spins < SPINS)
                relax();
            else
                phase_sleep(ph - 1, seen);
        }
    return 1;
}

static inline int64_t claim(sg_phase *ph) {
    return __atomic_fetch_add(&ph->next, 1, __ATOMIC_RELAXED);
}

/* A chunk of ph (of chunks chunks) is finished; the last one wakes the threads asleep on it. */
static inline void finish(sg_phase *ph, int64_t chunks) {
    const int32_t done = __atomic_add_fetch(&ph->done, 1, __ATOMIC_SEQ_CST);
#if defined(__linux__)
    if (done >= chunks && __atomic_load_n(&ph->waiters, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, &ph->done, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#else
    (void)done, (void)chunks;
#endif
}

/* One thread of a step's region (threads of them; every thread runs this, claiming chunks of
 * each phase in turn, see the top). A failing kernel marks *failed; a thread without its
 * buffer claims nothing (the others do its share; the caller checks that the last phase
 * finished). */
static void step_threaded(const sg_plan *p, int64_t rows, int64_t keep, int threads,
                          sg_phase *phases, int *failed) {
    const int64_t H = p->hidden, D = p->head_dim, I = p->inter;
    const int64_t heads = p->heads, kv_heads = p->kv_heads, group = heads / kv_heads;
    const int64_t kv_width = kv_heads * D;
    const int64_t per_unit = D % UNIT == 0 ? 1 : UNIT / 16; /* D a multiple of 16 */
    const int64_t q_units = (heads + per_unit - 1) / per_unit;
    const int64_t kv_units = (kv_heads + per_unit - 1) / per_unit;
    const int64_t head_units = q_units + 2 * kv_units;
    const int64_t lora_floats = p->lora != NULL ? p->max_rows * p->lora_rank : 0;
    float *xn = thread_floats((size_t)(p->max_rows * H + 3 * lora_floats));
    if (xn == NULL) return;
    /* the thread's LoRA shrinks of the phase's linears (every thread all rows, as the norm) */
    float *s0 = xn + p->max_rows * H, *s1 = s0 + lora_floats, *s2 = s1 + lora_floats;
    int error = 0;
    sg_last last = {NULL, NULL};
    sg_phase *ph = phases;
    int64_t before = 0, chunks;
    for (int64_t index = 0; index < p->num_layers; ++index) {
        const sg_layer *L = p->layers + index;
        /* 1: norm, q/k/v heads, rotary, the K/V cache */
        chunks = chunk_count(head_units, threads);
        if (phase_open(ph, phases, chunks, before, &last)) {
            p->rms_rows(p->h, H, L->norm1, xn, H, rows, H, L->eps1);
            const sg_lora *lq = lora_of(p, index, SG_Q), *lk = lora_of(p, index, SG_K);
            const sg_lora *lv = lora_of(p, index, SG_V);
            if (lq != NULL) lora_shrink(p, lq, xn, H, rows, L->q.k, s0);
            if (lk != NULL) lora_shrink(p, lk, xn, H, rows, L->k.k, s1);
            if (lv != NULL) lora_shrink(p, lv, xn, H, rows, L->v.k, s2);
            for (int64_t c; (c = claim(ph)) < chunks; finish(ph, chunks)) {
                const span units = share(head_units, (int)c, (int)chunks);
                const span q_heads = head_range(units, 0, heads, per_unit);
                const span k_heads = head_range(units, q_units, kv_heads, per_unit);
                const span v_heads = head_range(units, q_units + kv_units, kv_heads, per_unit);
                const span q_cols = head_columns(q_heads, heads, D, L->q.n);
                const span k_cols = head_columns(k_heads, kv_heads, D, L->k.n);
                const span v_cols = head_columns(v_heads, kv_heads, D, L->v.n);
                error |= part(&L->q, xn, rows, p->q, q_cols, &last);
                error |= part(&L->k, xn, rows, p->kb, k_cols, &last);
                error |= part(&L->v, xn, rows, p->vb, v_cols, &last);
                if (lq != NULL) lora_expand(p, lq, s0, rows, p->q, L->q.n, q_cols.first, q_cols.last);
                if (lk != NULL)
                    lora_expand(p, lk, s1, rows, p->kb, L->k.n, k_cols.first, k_cols.last);
                if (lv != NULL)
                    lora_expand(p, lv, s2, rows, p->vb, L->v.n, v_cols.first, v_cols.last);
                for (int64_t r = 0; r < rows; ++r) {
                    const float *cos = p->cos + r * D, *sin = p->sin + r * D;
                    if (q_heads.last > q_heads.first)
                        p->rope_heads(p->q + r * L->q.n + q_heads.first * D,
                                      (int)(q_heads.last - q_heads.first), (int)D, cos, sin);
                    if (k_heads.last > k_heads.first)
                        p->rope_heads(p->kb + r * L->k.n + k_heads.first * D,
                                      (int)(k_heads.last - k_heads.first), (int)D, cos, sin);
                }
                write_kv_heads(p, L, rows, p->kb, L->k.n, NULL, 0, k_heads.first, k_heads.last);
                write_kv_heads(p, L, rows, NULL, 0, p->vb, L->v.n, v_heads.first, v_heads.last);
            }
        }
        before = chunks, ++ph;
        /* 2: attention, runs of query heads of one row that share a KV head */
        chunks = chunk_count(rows * heads, threads);
        if (phase_open(ph, phases, chunks, before, &last))
            for (int64_t c; (c = claim(ph)) < chunks; finish(ph, chunks)) {
                const span pairs = share(rows * heads, (int)c, (int)chunks); /* (row, head) */
                for (int64_t e = pairs.first; e < pairs.last;) {
                    const int64_t r = e / heads, h = e % heads, g = h / group;
                    const int64_t group_end = r * heads + (g + 1) * group;
                    const int64_t end = group_end < pairs.last ? group_end : pairs.last;
                    /* the KV head's first element, in bytes (fp32 or bf16 elements) */
                    const int64_t at = g * D * (p->kv_bf16 ? 2 : 4);
                    error |= p->attn_heads(p->q + r * L->q.n + h * D, D,
                                           (const char *)L->key_cache + at,
                                           (const char *)L->value_cache + at, kv_width,
                                           p->block_tables + r * p->table_width,
                                           p->context_lens[r], p->attn_out + r * heads * D + h * D,
                                           D, (int)(end - e), (int)D, (int)p->block_size,
                                           p->scale);
                    e = end;
                }
            }
        before = chunks, ++ph;
        /* 3: o_proj and the residual */
        const int64_t o_units = (L->o.n + UNIT - 1) / UNIT;
        chunks = chunk_count(o_units, threads);
        if (phase_open(ph, phases, chunks, before, &last)) {
            const sg_lora *lo = lora_of(p, index, SG_O);
            if (lo != NULL) lora_shrink(p, lo, p->attn_out, heads * D, rows, L->o.k, s0);
            for (int64_t c; (c = claim(ph)) < chunks; finish(ph, chunks)) {
                const span cols = columns(L->o.n, (int)c, (int)chunks);
                error |= part(&L->o, p->attn_out, rows, p->o, cols, &last);
                if (lo != NULL) lora_expand(p, lo, s0, rows, p->o, L->o.n, cols.first, cols.last);
                residual_cols(p->h, p->o, rows, H, L->o.n, cols);
            }
        }
        before = chunks, ++ph;
        /* 4: norm, gate/up and SiLU-and-mul, by gate columns */
        chunks = chunk_count((I + UNIT - 1) / UNIT, threads);
        if (phase_open(ph, phases, chunks, before, &last)) {
            p->rms_rows(p->h, H, L->norm2, xn, H, rows, H, L->eps2);
            const sg_lora *lg = lora_of(p, index, SG_GATE), *lu = lora_of(p, index, SG_UP);
            if (lg != NULL) lora_shrink(p, lg, xn, H, rows, L->gate.k, s0);
            if (lu != NULL) lora_shrink(p, lu, xn, H, rows, L->up.k, s1);
            if (lg != NULL && L->silu_part != NULL) error = 1; /* no delta before the epilogue */
            for (int64_t c; (c = claim(ph)) < chunks; finish(ph, chunks)) {
                const span cols = columns(I, (int)c, (int)chunks);
                const int at_end = cols.last == I;
                const float *up;
                if (L->silu_part != NULL) { /* the epilogue: these gate columns' activations */
                    error |= part_of(L->silu_part, &L->gate, xn, rows, p->act, cols, &last);
                    continue;
                }
                if (L->up.function == NULL) { /* gate's columns, then up's, in one GEMM */
                    const span up_cols = {I + cols.first, at_end ? L->gate.n : I + cols.last};
                    error |= part(&L->gate, xn, rows, p->gate_buf, cols, &last);
                    error |= part(&L->gate, xn, rows, p->gate_buf, up_cols, &last);
                    if (lg != NULL) {
                        lora_expand(p, lg, s0, rows, p->gate_buf, L->gate.n, cols.first,
                                    cols.last);
                        lora_expand(p, lg, s0, rows, p->gate_buf, L->gate.n, up_cols.first,
                                    up_cols.last);
                    }
                    up = p->gate_buf + I;
                } else {
                    const span g_cols = {cols.first, at_end ? L->gate.n : cols.last};
                    const span u_cols = {cols.first, at_end ? L->up.n : cols.last};
                    error |= part(&L->gate, xn, rows, p->gate_buf, g_cols, &last);
                    error |= part(&L->up, xn, rows, p->up_buf, u_cols, &last);
                    if (lg != NULL)
                        lora_expand(p, lg, s0, rows, p->gate_buf, L->gate.n, g_cols.first,
                                    g_cols.last);
                    if (lu != NULL)
                        lora_expand(p, lu, s1, rows, p->up_buf, L->up.n, u_cols.first,
                                    u_cols.last);
                    up = p->up_buf;
                }
                p->silu_cols(p->gate_buf, up, L->gate.n, p->act, I, rows, I, cols.first,
                             cols.last);
            }
        }
        before = chunks, ++ph;
        /* 5: down_proj and the residual */
        const int64_t down_units = (L->down.n + UNIT - 1) / UNIT;
        chunks = chunk_count(down_units, threads);
        if (phase_open(ph, phases, chunks, before, &last)) {
            const sg_lora *ld = lora_of(p, index, SG_DOWN);
            if (ld != NULL) lora_shrink(p, ld, p->act, I, rows, L->down.k, s0);
            for (int64_t c; (c = claim(ph)) < chunks; finish(ph, chunks)) {
                const span cols = columns(L->down.n, (int)c, (int)chunks);
                error |= part(&L->down, p->act, rows, p->down, cols, &last);
                if (ld != NULL)
                    lora_expand(p, ld, s0, rows, p->down, L->down.n, cols.first, cols.last);
                residual_cols(p->h, p->down, rows, H, L->down.n, cols);
            }
        }
        before = chunks, ++ph;
    }
    if (keep > 0) {
        chunks = chunk_count((p->head.n + UNIT - 1) / UNIT, threads);
        if (phase_open(ph, phases, chunks, before, &last)) {
            for (int64_t i = 0; i < keep; ++i)
                p->rms_rows(p->h + p->keep[i] * H, H, p->final_norm, xn + i * H, H, 1, H,
                            p->final_eps);
            for (int64_t c; (c = claim(ph)) < chunks; finish(ph, chunks))
                error |= part(&p->head, xn, keep, p->logits,
                              columns(p->head.n, (int)c, (int)chunks), &last);
        }
    }
    if (error) {
#pragma omp atomic write
        *failed = 1;
    }
}

/* The chunks of a step's last phase (step_threaded's count), to check that it finished. */
static int64_t last_phase_chunks(const sg_plan *p, int64_t keep, int threads) {
    if (keep > 0) return chunk_count((p->head.n + UNIT - 1) / UNIT, threads);
    const sg_layer *L = p->layers + p->num_layers - 1;
    return chunk_count((L->down.n + UNIT - 1) / UNIT, threads);
}

/* Returns 0; 2: arguments out of range (a token, position, slot or block id outside the
 * plan); 3: a kernel refused its arguments or could not allocate. */
int actorline_step_graph(const sg_plan *p, int64_t rows, int64_t keep, int threads) {
    if (rows < 1 || rows > p->max_rows || keep < 0 || keep > rows) return 2;
    const int64_t H = p->hidden, D = p->head_dim;
    const int64_t num_slots = p->num_cache_blocks * p->block_size;
    for (int64_t r = 0; r < rows; ++r) {
        if (p->positions[r] < 0 || p->positions[r] >= p->table_rows || p->slots[r] < 0 ||
            p->slots[r] >= num_slots || p->context_lens[r] != p->positions[r] + 1)
            return 2;
        if (p->emb != NULL && (p->tokens[r] < 0 || p->tokens[r] >= p->vocab)) return 2;
        /* every block the row attends lies in the cache (paged_decode.c checks it per call) */
        const int64_t blocks = (p->context_lens[r] + p->block_size - 1) / p->block_size;
        if (blocks > p->table_width) return 2;
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t block = p->block_tables[r * p->table_width + b];
            if (block < 0 || block >= p->num_cache_blocks) return 2;
        }
    }
    for (int64_t i = 0; i < keep; ++i)
        if (p->keep[i] < 0 || p->keep[i] >= rows) return 2;
    if (p->emb != NULL)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t v = p->tokens[r];
            const float *row =
                p->emb + v / p->emb_panel * p->emb_panel_stride + v % p->emb_panel * p->emb_lane_stride;
            for (int64_t j = 0; j < H; ++j) p->h[r * H + j] = row[j * p->emb_elem_stride];
        }
    for (int64_t r = 0; r < rows; ++r) {
        memcpy(p->cos + r * D, p->cos_table + p->positions[r] * D, sizeof(float) * D);
        memcpy(p->sin + r * D, p->sin_table + p->positions[r] * D, sizeof(float) * D);
    }
    if (p->lora != NULL) { /* every row's group, and the entries' rank columns, in range */
        if (p->lora_rows == NULL || p->lora_rank < 1) return 2;
        for (int64_t r = 0; r < rows; ++r)
            if (p->lora_rows[r] < -1 || p->lora_rows[r] >= p->max_rows) return 2;
    }
    if (!p->threaded) {
        float *s = NULL;
        if (p->lora != NULL &&
            (s = (float *)malloc(sizeof(float) * (size_t)(p->max_rows * p->lora_rank))) == NULL)
            return 3;
        const int status = step_per_op(p, rows, keep, threads, s);
        free(s);
        return status;
    }
    if (p->num_layers < 1) return 2;
    const int64_t count = 5 * p->num_layers + (keep > 0);
    sg_phase *phases = (sg_phase *)aligned_alloc(64, sizeof(sg_phase) * (size_t)count);
    if (phases == NULL) return 3;
    memset(phases, 0, sizeof(sg_phase) * (size_t)count);
    int failed = 0, used = threads > 1 ? threads : 1;
    if (used == 1) {
        step_threaded(p, rows, keep, 1, phases, &failed);
    } else {
#pragma omp parallel num_threads(used)
        {
#pragma omp single
            used = omp_get_num_threads(); /* the team may be smaller than asked */
            step_threaded(p, rows, keep, used, phases, &failed);
        }
    }
    const int finished = phases[count - 1].done == last_phase_chunks(p, keep, used);
    free(phases);
    return failed || !finished ? 3 : 0;
}
