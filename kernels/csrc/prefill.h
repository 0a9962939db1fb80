/* What the CPU prefill-attention kernels share (amx_attention.c in bfloat16, prefill_attention_f32.c
 * in float32): the check of the caller's tables and lengths, made before anything is read, and a
 * vector 2^x for the softmax. */
#ifndef PDSERVE_PREFILL_H
#define PDSERVE_PREFILL_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "pdserve_kernels.h"

/* The parameter list of every prefill-attention entry point (pdserve_kernels.h declares each with
 * its spans), on query, cache and out elements of type T; PREFILL_ARGS passes it on. */
#define PREFILL_PARAMS(T)                                                                                          \
    const T *query, int64_t q_tok, int64_t q_head, const T *cache, int64_t s_block, int64_t s_kv, int64_t s_off,   \
        int64_t s_head, int64_t num_blocks, int64_t block_size, const int32_t *tables, int64_t table_stride,       \
        int64_t table_width, const int32_t *cu, const int32_t *lens, int64_t num_seqs, int64_t num_tokens,         \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, T *out, int64_t o_tok, int64_t o_head
#define PREFILL_ARGS                                                                                               \
    query, q_tok, q_head, cache, s_block, s_kv, s_off, s_head, num_blocks, block_size, tables, table_stride,       \
        table_width, cu, lens, num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, scale, out, o_tok, o_head

/* 0 when every sequence's chunk, length and blocks are in range; 1 otherwise. */
static inline int check_chunks(const int32_t *tables, int64_t table_stride, int64_t table_width, const int32_t *cu,
                               const int32_t *lens, int64_t num_seqs, int64_t num_tokens, int64_t num_blocks,
                               int64_t block_size) {
    if (cu[0] < 0 || cu[num_seqs] > num_tokens) return 1;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = (int64_t)cu[s + 1] - cu[s], len = lens[s];
        if (q_len < 0 || q_len > len || len > table_width * block_size) return 1;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
            const int32_t id = tables[s * table_stride + b];
            if (id < 0 || id >= num_blocks) return 1;
        }
    }
    return 0;
}

/* The work both kernels hand out: item_start[s], sequence s's first item (units_per_block items for
 * each of its chunk's 16-query blocks), and one scratch of scratch_size bytes per OpenMP thread. */
typedef struct {
    int64_t *item_start;
    void *scratches;
    int threads;
} prefill_plan;

static inline void prefill_plan_free(prefill_plan *plan) {
    free(plan->item_start);
    free(plan->scratches);
}

/* PDS_OK, PDS_ERR_RANGE (the caller's tables or lengths: nothing allocated) or PDS_ERR_MEMORY. */
static inline int prefill_plan_make(prefill_plan *plan, const int32_t *tables, int64_t table_stride,
                                    int64_t table_width, const int32_t *cu, const int32_t *lens, int64_t num_seqs,
                                    int64_t num_tokens, int64_t num_blocks, int64_t block_size,
                                    int64_t units_per_block, size_t scratch_size) {
    if (check_chunks(tables, table_stride, table_width, cu, lens, num_seqs, num_tokens, num_blocks, block_size))
        return PDS_ERR_RANGE;
    plan->threads = omp_get_max_threads();
    plan->item_start = malloc((size_t)(num_seqs + 1) * sizeof *plan->item_start);
    plan->scratches = aligned_alloc(64, (size_t)plan->threads * scratch_size);
    if (!plan->item_start || !plan->scratches) {
        prefill_plan_free(plan);
        return PDS_ERR_MEMORY;
    }
    plan->item_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        plan->item_start[s + 1] = plan->item_start[s] + units_per_block * ((cu[s + 1] - cu[s] + 15) / 16);
    return PDS_OK;
}

/* Work item i, one head's 16-query block of a sequence's chunk, as (sequence, head, block):
 * item_start[s] is sequence s's first item. *seq moves on from its last value, so a thread must
 * meet its items in increasing order (as an OpenMP loop hands them out). */
static inline void locate_item(int64_t i, const int64_t *item_start, const int32_t *cu, int64_t *seq, int64_t *head,
                               int64_t *block) {
    while (item_start[*seq + 1] <= i) ++*seq;
    const int64_t local = i - item_start[*seq], blocks = (cu[*seq + 1] - cu[*seq] + 15) / 16;
    *head = local / blocks;
    *block = local % blocks;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 2^x for x <= 128, and 0 for x below -126 (masked keys: -inf). x is rounded to the nearest
 * integer n and 2^f for f = x - n in [-0.5, 0.5] taken from its Taylor series to f^6 (relative
 * error < 2e-7). */
static inline __m512 exp2_ps(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* A block of scores in place, row j the key first_key + j, one lane per query: scaled by c, and
 * -inf where a query may not see the key (when masked: the key past its position) and in the
 * rows from keys on (up to rows). Folds the block into *run_max and returns the factor that
 * rescales what was summed before. */
static inline __m512 mask_block(float *scores, int64_t rows, int64_t first_key, int64_t keys, __m512i positions,
                                int masked, __m512 c, __m512 *run_max) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 block_max = minus_inf;
    for (int64_t j = 0; j < rows; ++j) {
        __m512 v = minus_inf;
        if (j < keys) {
            v = _mm512_mul_ps(_mm512_load_ps(scores + 16 * j), c);
            if (masked) {
                const __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)(first_key + j)), positions);
                v = _mm512_mask_blend_ps(seen, minus_inf, v);
            }
        }
        _mm512_store_ps(scores + 16 * j, v);
        block_max = _mm512_max_ps(block_max, v);
    }
    const __m512 new_max = _mm512_max_ps(*run_max, block_max);
    const __m512 alpha = exp2_ps(_mm512_sub_ps(*run_max, new_max));
    *run_max = new_max;
    return alpha;
}

#endif

#endif
