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
 * residual adds, all exact. */
#include <stdint.h>
#include <string.h>

typedef int (*gemm_fn)(const float *x, int64_t m, int64_t k, const void *weights, int format,
                       const float *bias, int64_t n, float *y, int threads);
typedef void (*rms_fn)(const float *x, int64_t x_stride, const float *weight, float *out,
                       int64_t rows, int64_t dim, float eps, int threads);
typedef void (*silu_fn)(const float *gate_up, int64_t rows, int64_t inter, float *out,
                        int threads);
typedef void (*rope_fn)(float *q, int64_t q_stride, int q_heads, float *k, int64_t k_stride,
                        int k_heads, int64_t rows, int head_dim, const float *cos,
                        const float *sin, int threads);
typedef int (*attn_fn)(const float *query, int64_t q_row_stride, int64_t q_head_stride,
                       const void *key_cache, const void *value_cache,
                       const int64_t *block_tables, int64_t table_stride, int64_t table_width,
                       const int64_t *context_lens, float *out, int64_t out_row_stride,
                       int64_t out_head_stride, int num_rows, int num_heads, int num_kv_heads,
                       int head_dim, int block_size, int64_t num_cache_blocks, float scale,
                       int num_threads, int64_t window, float softcap, const float *sinks);

/* One linear under NativeGemm's convention; function 0: absent. */
typedef struct {
    void *function;
    const void *weights;
    int64_t format;
    const float *bias;
    int64_t n, k;
} sg_gemm;

typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    sg_gemm q, k, v, o;
    sg_gemm gate; /* the fused gate/up projection (gate's columns, then up's) when up is absent */
    sg_gemm up;
    sg_gemm down;
    void *key_cache, *value_cache; /* [num_slots, kv_heads, head_dim], fp32 or bf16 (kv_bf16) */
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

/* One token's K or V row (width floats) into slot ``slot`` of a cache layer, as it is stored. */
static void store_kv_row(void *cache, int64_t slot, const float *row, int64_t width, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + slot * width, row, sizeof(float) * width);
        return;
    }
    uint16_t *out = (uint16_t *)cache + slot * width;
    for (int64_t j = 0; j < width; ++j) out[j] = to_bf16(row[j]);
}

/* Returns 0; 2: arguments out of range (a token, position or slot outside the plan); 3: a
 * kernel refused its arguments or could not allocate. */
int actorline_step_graph(const sg_plan *p, int64_t rows, int64_t keep, int threads) {
    if (rows < 1 || rows > p->max_rows || keep < 0 || keep > rows) return 2;
    const int64_t H = p->hidden, D = p->head_dim, kv_width = p->kv_heads * D;
    const int64_t num_slots = p->num_cache_blocks * p->block_size;
    for (int64_t r = 0; r < rows; ++r) {
        if (p->positions[r] < 0 || p->positions[r] >= p->table_rows || p->slots[r] < 0 ||
            p->slots[r] >= num_slots || p->context_lens[r] != p->positions[r] + 1)
            return 2;
        if (p->emb != NULL && (p->tokens[r] < 0 || p->tokens[r] >= p->vocab)) return 2;
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
    for (int64_t index = 0; index < p->num_layers; ++index) {
        const sg_layer *L = p->layers + index;
        p->rms(p->h, H, L->norm1, p->xn, rows, H, L->eps1, threads);
        if (gemm(&L->q, p->xn, rows, p->q, threads) || gemm(&L->k, p->xn, rows, p->kb, threads) ||
            gemm(&L->v, p->xn, rows, p->vb, threads))
            return 3;
        p->rope(p->q, L->q.n, (int)p->heads, p->kb, L->k.n, (int)p->kv_heads, rows, (int)D, p->cos,
                p->sin, threads);
        for (int64_t r = 0; r < rows; ++r) {
            store_kv_row(L->key_cache, p->slots[r], p->kb + r * L->k.n, kv_width, (int)p->kv_bf16);
            store_kv_row(L->value_cache, p->slots[r], p->vb + r * L->v.n, kv_width,
                         (int)p->kv_bf16);
        }
        if (p->attn(p->q, L->q.n, D, L->key_cache, L->value_cache, p->block_tables,
                    p->table_width, p->table_width, p->context_lens, p->attn_out, p->heads * D, D,
                    (int)rows, (int)p->heads, (int)p->kv_heads, (int)D, (int)p->block_size,
                    p->num_cache_blocks, p->scale, threads, 0, 0.0f, NULL))
            return 3;
        if (gemm(&L->o, p->attn_out, rows, p->o, threads)) return 3;
        residual(p->h, p->o, rows, H, L->o.n);
        p->rms(p->h, H, L->norm2, p->xn, rows, H, L->eps2, threads);
        const int64_t I = p->inter;
        const float *gate_up = p->gate_up;
        if (L->up.function == NULL) { /* one gate/up GEMM */
            if (gemm(&L->gate, p->xn, rows, p->gate_buf, threads)) return 3;
            if (L->gate.n == 2 * I)
                gate_up = p->gate_buf;
            else
                for (int64_t r = 0; r < rows; ++r)
                    memcpy(p->gate_up + r * 2 * I, p->gate_buf + r * L->gate.n, sizeof(float) * 2 * I);
        } else {
            if (gemm(&L->gate, p->xn, rows, p->gate_buf, threads) ||
                gemm(&L->up, p->xn, rows, p->up_buf, threads))
                return 3;
            for (int64_t r = 0; r < rows; ++r) {
                memcpy(p->gate_up + r * 2 * I, p->gate_buf + r * L->gate.n, sizeof(float) * I);
                memcpy(p->gate_up + r * 2 * I + I, p->up_buf + r * L->up.n, sizeof(float) * I);
            }
        }
        p->silu(gate_up, rows, I, p->act, threads);
        if (gemm(&L->down, p->act, rows, p->down, threads)) return 3;
        residual(p->h, p->down, rows, H, L->down.n);
    }
    if (keep == 0) return 0;
    p->rms(p->h, H, p->final_norm, p->xn, rows, H, p->final_eps, threads);
    for (int64_t i = 0; i < keep; ++i)
        memcpy(p->kept + i * H, p->xn + p->keep[i] * H, sizeof(float) * H);
    return gemm(&p->head, p->kept, keep, p->logits, threads) ? 3 : 0;
}
