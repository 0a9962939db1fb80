/* A decode step's decoder layers in one call, in bfloat16 or float32: the same kernels the
 * Python layer loop calls (engine/model.py), in the same order on the same buffers, so its
 * results are the same bits. What it removes is the Python between them: per layer ~11 op
 * calls, each with its argument checks, tensor allocations and ctypes marshalling, and the
 * interpreter's own code and data, which every projection's weight stream evicts from the
 * caches.
 *
 * The kernels come in as function pointers (kernels/decode_layers.py takes them from the
 * libraries the op modules load), so each keeps one source and one build.
 *
 * Measured on a 2-core Xeon (AMX), bfloat16 SmolLM-135M shape, 64 sequences: the ops between the
 * projections and attention took 45 (RMSNorm), 56 (SiLU-and-mul), 38 (rotary) and 36 (KV write)
 * us per call inside the Python loop against 17, 29, 15 and 10 us alone; see
 * kernels/decode_layers.py for the step.
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*linear_fn)(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *packed, int64_t n,
                         const float *bias, void *out, int64_t out_stride);
typedef void (*add_rms_norm_fn)(const void *x, int64_t stride_x, const void *residual, int64_t stride_res,
                                const void *weight, void *out, int64_t stride_out, void *new_residual,
                                int64_t stride_new, int64_t num_rows, int64_t hidden, float eps);
typedef void (*silu_and_mul_fn)(const void *x, int64_t stride_x, void *out, int64_t stride_out, int64_t num_rows,
                                int64_t half);
typedef int (*rotary_fn)(void *query, int64_t stride_q_tok, int64_t stride_q_head, int64_t num_heads, void *key,
                         int64_t stride_k_tok, int64_t stride_k_head, int64_t num_kv_heads, const int64_t *positions,
                         const void *cos_sin, int64_t stride_cs, int64_t max_position, int64_t num_tokens,
                         int64_t half);
typedef int (*write_kv_fn)(const void *key, int64_t stride_k_tok, int64_t stride_k_head, const void *value,
                           int64_t stride_v_tok, int64_t stride_v_head, void *cache, int64_t stride_block,
                           int64_t stride_kv, int64_t stride_token, int64_t stride_head, int64_t num_blocks,
                           int64_t block_size, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                           int64_t head_dim);
typedef int (*attention_fn)(const void *query, int64_t stride_q_seq, int64_t stride_q_head, const void *kv_cache,
                            int64_t stride_block, int64_t stride_kv, int64_t stride_token, int64_t stride_head,
                            const int32_t *block_tables, int64_t stride_table, const int32_t *seq_lens, void *out,
                            int64_t stride_out_seq, int64_t stride_out_head, int num_seqs, int num_kv_heads,
                            int group, int head_dim, int block_size, float scale, int kv_bf16);

/* Field order and types match kernels/decode_layers.py's ctypes structures. The kernels are one
 * dtype's: all bfloat16 or all float32. */
typedef struct {
    linear_fn linear;
    add_rms_norm_fn add_rms_norm;
    silu_and_mul_fn silu_and_mul;
    rotary_fn rotary;
    write_kv_fn write_kv;
    attention_fn attention;
} Kernels;

typedef struct {
    const void *input_norm, *post_norm;
    const void *qkv, *o, *gate_up, *down; /* packed for the small-batch projection kernel */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* float32, or NULL */
} Layer;

typedef struct {
    int64_t elem_size; /* 2: bfloat16, 4: float32 */
    int64_t rows, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    char *kv_cache; /* layer l's cache starts stride_layer elements after layer l - 1's */
    int64_t stride_layer, stride_block, stride_kv, stride_token, stride_head, num_blocks, block_size;
    const int64_t *positions, *slots;
    const int32_t *block_tables;
    int64_t stride_table;
    const int32_t *seq_lens;
    const void *cos_sin;
    int64_t stride_cs, max_position;
    /* hidden_buf: in, the embeddings [rows, hidden]; out, the last layer's MLP output.
     * residual: out, the residual stream before the final norm. The rest is scratch. All
     * contiguous rows. */
    char *hidden_buf, *residual, *normed, *qkv, *attn, *o_out, *gate_up, *act;
} Step;

enum { OK = 0, BAD_POSITION = 1, BAD_SLOT = 2, NO_ATTENTION_PATH = 3, NO_MEMORY = 4 };

/* Runs layers [0, num_layers). Returns OK, or the first failure (nothing after it runs):
 * BAD_POSITION (a position outside cos_sin), BAD_SLOT (a slot outside the cache),
 * NO_ATTENTION_PATH (sizes the attention kernel has no path for), NO_MEMORY (the projection
 * kernel's buffer). The caller checks the block tables and lengths against the cache first. */
int decode_layers(const Kernels *k, const Layer *layers, int64_t num_layers, const Step *s) {
    const int64_t rows = s->rows, hidden = s->hidden, hd = s->head_dim, elem = s->elem_size;
    const int64_t q_size = s->num_heads * hd, kv_size = s->num_kv_heads * hd, qkv_width = q_size + 2 * kv_size;
    const int64_t inter = s->intermediate;
    char *const q = s->qkv, *const key = s->qkv + q_size * elem, *const value = s->qkv + (q_size + kv_size) * elem;
    const char *residual = s->hidden_buf; /* the first layer's residual is its input */
    for (int64_t l = 0; l < num_layers; ++l) {
        const Layer *w = &layers[l];
        char *cache = s->kv_cache + l * s->stride_layer * elem;
        if (l == 0)
            k->add_rms_norm(s->hidden_buf, hidden, NULL, 0, w->input_norm, s->normed, hidden, NULL, 0, rows, hidden,
                            s->eps);
        else {
            k->add_rms_norm(s->hidden_buf, hidden, residual, hidden, w->input_norm, s->normed, hidden, s->residual,
                            hidden, rows, hidden, s->eps);
            residual = s->residual;
        }
        if (k->linear(s->normed, hidden, rows, hidden, w->qkv, qkv_width, w->qkv_bias, s->qkv, qkv_width))
            return NO_MEMORY;
        if (k->rotary(q, qkv_width, hd, s->num_heads, key, qkv_width, hd, s->num_kv_heads, s->positions, s->cos_sin,
                      s->stride_cs, s->max_position, rows, hd / 2))
            return BAD_POSITION;
        if (k->write_kv(key, qkv_width, hd, value, qkv_width, hd, cache, s->stride_block, s->stride_kv,
                        s->stride_token, s->stride_head, s->num_blocks, s->block_size, s->slots, rows,
                        s->num_kv_heads, hd))
            return BAD_SLOT;
        if (k->attention(q, qkv_width, hd, cache, s->stride_block, s->stride_kv, s->stride_token, s->stride_head,
                         s->block_tables, s->stride_table, s->seq_lens, s->attn, q_size, hd, (int)rows,
                         (int)s->num_kv_heads, (int)(s->num_heads / s->num_kv_heads), (int)hd, (int)s->block_size,
                         s->scale, elem == 2))
            return NO_ATTENTION_PATH;
        if (k->linear(s->attn, q_size, rows, q_size, w->o, hidden, w->o_bias, s->o_out, hidden)) return NO_MEMORY;
        /* in place from the second layer on: the kernel adds element by element */
        k->add_rms_norm(s->o_out, hidden, residual, hidden, w->post_norm, s->normed, hidden, s->residual, hidden,
                        rows, hidden, s->eps);
        residual = s->residual;
        if (k->linear(s->normed, hidden, rows, hidden, w->gate_up, 2 * inter, w->gate_up_bias, s->gate_up, 2 * inter))
            return NO_MEMORY;
        k->silu_and_mul(s->gate_up, 2 * inter, s->act, inter, rows, inter);
        if (k->linear(s->act, inter, rows, inter, w->down, hidden, w->down_bias, s->hidden_buf, hidden)) return NO_MEMORY;
    }
    return OK;
}
