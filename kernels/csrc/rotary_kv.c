/* Rotary position embedding (neox style) in place on query and key, and the KV-cache write, on
 * the CPU in float32 and bfloat16, one pass over each token's rows (the torch references make several passes
 * with temporaries and an index_put). Tokens are spread over the process's OpenMP threads.
 *
 * Rotary must round exactly as transformers does: x1 * cos - x2 * sin and x2 * cos + x1 * sin,
 * each product rounded to float32 before the sum. This file is therefore built without
 * -ffast-math's contraction into fused multiply-adds and without reassociation (the pragma
 * below overrides the build's flags for every function here).
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include "pdserve_kernels.h"
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static void rotate_row(float *x, const float *cos, const float *sin, int64_t half) {
    float *x1 = x, *x2 = x + half;
    for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        const float first = a * cos[i] - b * sin[i];
        x2[i] = b * cos[i] + a * sin[i];
        x1[i] = first;
    }
}

/* bfloat16: each product and each sum rounded to bfloat16 (to nearest even), as torch's
 * bfloat16 ops round each result (the products of two bfloat16 values are exact in float32). */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }


static void rotate_row_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t half) {
    uint16_t *x1 = x, *x2 = x + half;
    int64_t start = 0;
#if defined(__AVX512BF16__)
    /* 16 pairs at a time with the scalar loop's roundings, each by one instruction: the same
     * bits as the scalar loop below, in fewer instructions. */
    for (; start + 16 <= half; start += 16) {
        const __m512 a = bf16x16_load(x1 + start), b = bf16x16_load(x2 + start);
        const __m512 c = bf16x16_load(cos + start), s = bf16x16_load(sin + start);
        const __m512 first = _mm512_sub_ps(bf16x16_round(_mm512_mul_ps(a, c)), bf16x16_round(_mm512_mul_ps(b, s)));
        const __m512 second = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(b, c)), bf16x16_round(_mm512_mul_ps(a, s)));
        bf16x16_store(x1 + start, first);
        bf16x16_store(x2 + start, second);
    }
#endif
    for (int64_t i = start; i < half; ++i) {
        const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
        const float c = bf16_to_f32(cos[i]), s = bf16_to_f32(sin[i]);
        const uint16_t first = f32_to_bf16(round_bf16(a * c) - round_bf16(b * s));
        x2[i] = f32_to_bf16(round_bf16(b * c) + round_bf16(a * s));
        x1[i] = first;
    }
}

/* query [num_tokens, num_heads, 2 * half] and key [num_tokens, num_kv_heads, 2 * half], strides
 * in elements (unit along head_dim); positions int64; cos_sin [max_position, 2 * half]: cos of
 * the half frequencies, then their sin. Returns PDS_OK, or PDS_ERR_RANGE when a position is
 * outside the cache (nothing is changed then). */
int rotary_f32(float *query, int64_t stride_q_tok, int64_t stride_q_head, int64_t num_heads, float *key,
               int64_t stride_k_tok, int64_t stride_k_head, int64_t num_kv_heads, const int64_t *positions,
               const float *cos_sin, int64_t stride_cs, int64_t max_position, int64_t num_tokens, int64_t half) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return PDS_ERR_RANGE;
#pragma omp parallel for schedule(static) if (num_tokens * (num_heads + num_kv_heads) * half > 8192)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *cos = cos_sin + positions[t] * stride_cs, *sin = cos + half;
        for (int64_t h = 0; h < num_heads; ++h) rotate_row(query + t * stride_q_tok + h * stride_q_head, cos, sin, half);
        for (int64_t h = 0; h < num_kv_heads; ++h) rotate_row(key + t * stride_k_tok + h * stride_k_head, cos, sin, half);
    }
    return 0;
}

/* The same in bfloat16 (query, key and cos_sin as uint16_t). */
int rotary_bf16(uint16_t *query, int64_t stride_q_tok, int64_t stride_q_head, int64_t num_heads, uint16_t *key,
                int64_t stride_k_tok, int64_t stride_k_head, int64_t num_kv_heads, const int64_t *positions,
                const uint16_t *cos_sin, int64_t stride_cs, int64_t max_position, int64_t num_tokens, int64_t half) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return PDS_ERR_RANGE;
#pragma omp parallel for schedule(static) if (num_tokens * (num_heads + num_kv_heads) * half > 8192)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const uint16_t *cos = cos_sin + positions[t] * stride_cs, *sin = cos + half;
        for (int64_t h = 0; h < num_heads; ++h)
            rotate_row_bf16(query + t * stride_q_tok + h * stride_q_head, cos, sin, half);
        for (int64_t h = 0; h < num_kv_heads; ++h)
            rotate_row_bf16(key + t * stride_k_tok + h * stride_k_head, cos, sin, half);
    }
    return 0;
}

/* Each token's K and V rows [num_kv_heads, head_dim] into its slot of one layer's paged cache
 * (strides in elements of elem_size bytes: block, K/V, token in block, head; unit along
 * head_dim); slot = block * block_size + offset, -1 skips the token. Returns PDS_OK, or
 * PDS_ERR_RANGE when a slot is outside the cache (nothing is written then). */
static int write_kv_rows(const char *key, int64_t stride_k_tok, int64_t stride_k_head, const char *value,
                         int64_t stride_v_tok, int64_t stride_v_head, char *cache, int64_t stride_block,
                         int64_t stride_kv, int64_t stride_token, int64_t stride_head, int64_t num_blocks,
                         int64_t block_size, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                         int64_t head_dim, int64_t elem_size) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slots[t] < -1 || slots[t] >= num_blocks * block_size) return PDS_ERR_RANGE;
    const size_t row_bytes = (size_t)(head_dim * elem_size);
#pragma omp parallel for schedule(static) if (num_tokens * num_kv_heads * head_dim > 32768)
    for (int64_t t = 0; t < num_tokens; ++t) {
        if (slots[t] < 0) continue;
        char *dst = cache + ((slots[t] / block_size) * stride_block + (slots[t] % block_size) * stride_token) * elem_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            memcpy(dst + h * stride_head * elem_size, key + (t * stride_k_tok + h * stride_k_head) * elem_size,
                   row_bytes);
            memcpy(dst + (stride_kv + h * stride_head) * elem_size,
                   value + (t * stride_v_tok + h * stride_v_head) * elem_size, row_bytes);
        }
    }
    return 0;
}

int write_kv_f32(const float *key, int64_t stride_k_tok, int64_t stride_k_head, const float *value,
                 int64_t stride_v_tok, int64_t stride_v_head, float *cache, int64_t stride_block, int64_t stride_kv,
                 int64_t stride_token, int64_t stride_head, int64_t num_blocks, int64_t block_size,
                 const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim) {
    return write_kv_rows((const char *)key, stride_k_tok, stride_k_head, (const char *)value, stride_v_tok,
                         stride_v_head, (char *)cache, stride_block, stride_kv, stride_token, stride_head, num_blocks,
                         block_size, slots, num_tokens, num_kv_heads, head_dim, sizeof(float));
}

/* The same for a bfloat16 cache (K, V and cache as uint16_t). */
int write_kv_bf16(const uint16_t *key, int64_t stride_k_tok, int64_t stride_k_head, const uint16_t *value,
                  int64_t stride_v_tok, int64_t stride_v_head, uint16_t *cache, int64_t stride_block,
                  int64_t stride_kv, int64_t stride_token, int64_t stride_head, int64_t num_blocks,
                  int64_t block_size, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                  int64_t head_dim) {
    return write_kv_rows((const char *)key, stride_k_tok, stride_k_head, (const char *)value, stride_v_tok,
                         stride_v_head, (char *)cache, stride_block, stride_kv, stride_token, stride_head, num_blocks,
                         block_size, slots, num_tokens, num_kv_heads, head_dim, sizeof(uint16_t));
}
