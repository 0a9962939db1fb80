/* A decode step's decoder layers in one call, in bfloat16 or float32 (pdserve_kernels.h: pds_layer,
 * pds_step): the same kernels the Python layer loop calls (engine/model.py), in the same order on
 * the same buffers, so its results are the same bits. It removes the Python between them: ~11 op
 * calls a layer, each with its argument checks, allocations and marshalling, and the interpreter's
 * code and data, which every projection's weight stream evicts from the caches. The kernels are
 * this build's own, picked by the caller's linear kind (kernels_for; the caller is
 * kernels/cpu/decode_layers.py). Built where the small-batch projection kernels are (AVX-512 and
 * above). */
#include "pdserve_kernels.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __AVX512F__
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

/* One dtype's kernels: all bfloat16 or all float32. */
typedef struct {
    linear_fn linear;
    add_rms_norm_fn add_rms_norm;
    silu_and_mul_fn silu_and_mul;
    rotary_fn rotary;
    write_kv_fn write_kv;
} Kernels;

/* The kernels of linear_kind; 0 where this build has no such projection kernel. */
static int kernels_for(int linear_kind, Kernels *k) {
    const Kernels f32 = {(linear_fn)f32_linear, (add_rms_norm_fn)add_rms_norm_f32, (silu_and_mul_fn)silu_and_mul_f32,
                         (rotary_fn)rotary_f32, (write_kv_fn)write_kv_f32};
    Kernels bf16 = {NULL, (add_rms_norm_fn)add_rms_norm_bf16, (silu_and_mul_fn)silu_and_mul_bf16,
                    (rotary_fn)rotary_bf16, (write_kv_fn)write_kv_bf16};
    switch (linear_kind) {
    case PDS_LINEAR_F32: *k = f32; return 1;
#ifdef __AVX512BF16__
    case PDS_LINEAR_BF16: bf16.linear = (linear_fn)bf16_linear; *k = bf16; return 1;
    case PDS_LINEAR_BF16_WIDE: bf16.linear = (linear_fn)bf16_linear_wide; *k = bf16; return 1;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    case PDS_LINEAR_AMX: bf16.linear = (linear_fn)amx_linear_bf16; *k = bf16; return 1;
#endif
    default: (void)bf16; return 0;
    }
}

/* Runs layers [0, num_layers). Returns PDS_OK, or the first failure (nothing after it runs):
 * PDS_ERR_RANGE (a position outside cos_sin or a slot outside the cache), PDS_ERR_UNSUPPORTED
 * (a projection kind this build lacks, or sizes the attention kernel has no path for),
 * PDS_ERR_MEMORY (the projection kernel's buffer). The caller checks the block tables and lengths
 * against the cache first. hidden_buf: in, the embeddings [rows, hidden]; out, the last layer's MLP
 * output. residual: out, the residual stream before the final norm. The rest is scratch. All
 * contiguous rows. */
int decode_layers(int linear_kind, const pds_layer *layers, int64_t num_layers, const pds_step *s) {
    Kernels kernels;
    if (!kernels_for(linear_kind, &kernels)) return PDS_ERR_UNSUPPORTED;
    const Kernels *k = &kernels;
    char *const hidden_buf = s->hidden_buf, *const normed = s->normed, *const res_buf = s->residual;
    char *const qkv = s->qkv, *const attn = s->attn, *const o_out = s->o_out, *const gate_up = s->gate_up;
    char *const act = s->act, *const kv_cache = s->kv_cache;

    const int64_t rows = s->rows, hidden = s->hidden, hd = s->head_dim, elem = s->elem_size;
    const int64_t q_size = s->num_heads * hd, kv_size = s->num_kv_heads * hd, qkv_width = q_size + 2 * kv_size;
    const int64_t inter = s->intermediate;
    char *const q = qkv, *const key = qkv + q_size * elem, *const value = qkv + (q_size + kv_size) * elem;
    const char *residual = hidden_buf; /* the first layer's residual is its input */
    for (int64_t l = 0; l < num_layers; ++l) {
        const pds_layer *w = &layers[l];
        char *cache = kv_cache + l * s->stride_layer * elem;
        if (l == 0)
            k->add_rms_norm(hidden_buf, hidden, NULL, 0, w->input_norm, normed, hidden, NULL, 0, rows, hidden,
                            s->eps);
        else {
            k->add_rms_norm(hidden_buf, hidden, residual, hidden, w->input_norm, normed, hidden, res_buf,
                            hidden, rows, hidden, s->eps);
            residual = res_buf;
        }
        if (k->linear(normed, hidden, rows, hidden, w->qkv, qkv_width, w->qkv_bias, qkv, qkv_width))
            return PDS_ERR_MEMORY;
        if (k->rotary(q, qkv_width, hd, s->num_heads, key, qkv_width, hd, s->num_kv_heads, s->positions, s->cos_sin,
                      s->stride_cs, s->max_position, rows, hd / 2))
            return PDS_ERR_RANGE;
        if (k->write_kv(key, qkv_width, hd, value, qkv_width, hd, cache, s->stride_block, s->stride_kv,
                        s->stride_token, s->stride_head, s->num_blocks, s->block_size, s->slots, rows,
                        s->num_kv_heads, hd))
            return PDS_ERR_RANGE;
        if (paged_decode_attention(q, qkv_width, hd, cache, s->stride_block, s->stride_kv, s->stride_token, s->stride_head,
                         s->block_tables, s->stride_table, s->seq_lens, attn, q_size, hd, (int)rows,
                         (int)s->num_kv_heads, (int)(s->num_heads / s->num_kv_heads), (int)hd, (int)s->block_size,
                         s->scale, elem == 2))
            return PDS_ERR_UNSUPPORTED;
        if (k->linear(attn, q_size, rows, q_size, w->o, hidden, w->o_bias, o_out, hidden)) return PDS_ERR_MEMORY;
        /* in place from the second layer on: the kernel adds element by element */
        k->add_rms_norm(o_out, hidden, residual, hidden, w->post_norm, normed, hidden, res_buf, hidden,
                        rows, hidden, s->eps);
        residual = res_buf;
        if (k->linear(normed, hidden, rows, hidden, w->gate_up, 2 * inter, w->gate_up_bias, gate_up, 2 * inter))
            return PDS_ERR_MEMORY;
        k->silu_and_mul(gate_up, 2 * inter, act, inter, rows, inter);
        if (k->linear(act, inter, rows, inter, w->down, hidden, w->down_bias, hidden_buf, hidden)) return PDS_ERR_MEMORY;
    }
    return PDS_OK;
}
#endif
