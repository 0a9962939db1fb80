/* Prefill / extend attention in bfloat16 on AMX: each 16-query block of a chunk attends causally
 * to its sequence's paged K/V (the chunk's own K/V already in the cache), flash-style: 32 keys at
 * a time, a running max and sum per query, the output rescaled as the max grows.
 *
 * The tiles run transposed, so that each query is a vector lane and the softmax needs no
 * horizontal reductions:
 *   - scores^T [16 keys x 16 queries] = K [16 keys x 32 dims, straight from a cache block] times
 *     Q^T (the block's queries packed once into AMX's B layout), summed over the head's dims;
 *   - each key's row of scores is then one vector over the queries: masked, max-reduced and
 *     exponentiated lane-wise, and its probabilities (rounded to bfloat16, as every flash kernel
 *     feeds the second product) packed in pairs of keys into a B tile;
 *   - out^T [16 dims x 16 queries] += V^T [16 dims x 32 keys] times that B tile. V^T comes from a
 *     copy of each sequence's V per KV head, transposed once per call (zero past the sequence).
 * Queries past a chunk's end and keys past a sequence's end never reach the output: lanes of the
 * former are dropped, the latter are masked (their cache rows may hold anything).
 *
 * The caller's tensors are read directly, so the tables and lengths are checked first
 * (prefill.h, shared with the float32 kernel in prefill_attention_f32.c): a bad one returns
 * PDS_ERR_RANGE before anything is read.
 *
 * Against torch's per-sequence SDPA: benchmarks/kernels.py --cpu. Most of its time goes to the
 * softmax's exponentials (one per key and query), then to storing and rescaling out^T per block.
 */
#define _DEFAULT_SOURCE /* syscall() in amx.h */
#include "pdserve_kernels.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "prefill.h"

#ifdef PDSERVE_HAVE_AMX

int amx_attention_ready(void) { return amx_request(); }

typedef struct {
    const uint16_t *query, *cache;
    int64_t q_tok, q_head, s_block, s_kv, s_off, s_head, block_size;
    const int32_t *tables, *cu, *lens;
    int64_t table_stride, num_heads, group, head_dim;
    float log2_scale;
    uint16_t *out;
    int64_t o_tok, o_head;
    uint16_t *vt;          /* per sequence and KV head: V^T [head_dim][padded length] */
    const int64_t *vt_off; /* each sequence's first V^T */
} problem;

static int64_t padded_len(int64_t len) { return (len + 31) / 32 * 32; }

static const uint16_t *cache_row(const problem *p, int64_t seq, int64_t token, int64_t kv_head) {
    const int64_t block = p->tables[seq * p->table_stride + token / p->block_size];
    return p->cache + block * p->s_block + (token % p->block_size) * p->s_off + kv_head * p->s_head;
}

/* V^T of one sequence and KV head, zero past its length: per 16 tokens (one cache block holds
 * them all) and pair of dims, one gather of the 16 tokens' pairs, split into the two dims' rows. */
static void transpose_values(const problem *p, int64_t seq, int64_t kv_head) {
    const int64_t len = p->lens[seq], width = padded_len(len), dim = p->head_dim;
    uint16_t *vt = p->vt + p->vt_off[seq] + kv_head * dim * width;
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(p->s_off / 2)));
    const __m512i split = _mm512_setr_epi32(0x00020000, 0x00060004, 0x000a0008, 0x000e000c, 0x00120010, 0x00160014,
                                            0x001a0018, 0x001e001c, 0x00030001, 0x00070005, 0x000b0009, 0x000f000d,
                                            0x00130011, 0x00170015, 0x001b0019, 0x001f001d);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t count = len - t0 < 16 ? len - t0 : 16;
        const __mmask16 live = count == 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
        const uint16_t *base = cache_row(p, seq, t0, kv_head) + p->s_kv;
        for (int64_t d = 0; d < dim; d += 2) {
            const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, base + d, 4);
            /* even 16-bit lanes (dim d) to the low half, odd (dim d + 1) to the high half */
            const __m512i both = _mm512_permutexvar_epi16(split, pairs);
            _mm256_storeu_si256((__m256i *)(vt + d * width + t0), _mm512_castsi512_si256(both));
            _mm256_storeu_si256((__m256i *)(vt + (d + 1) * width + t0), _mm512_extracti64x4_epi64(both, 1));
        }
    }
    const int64_t filled = (len + 15) / 16 * 16;
    for (int64_t d = 0; d < dim; ++d) memset(vt + d * width + filled, 0, (size_t)(width - filled) * 2);
}

/* Q^T of queries [first, first + rows) of a head in AMX's B layout: per 32 dims, row r holds the
 * queries' dims (2r, 2r + 1), zero for missing queries. */
static void pack_queries(const problem *p, int64_t first, int64_t rows, int64_t head, uint32_t *qt) {
    const int64_t words = p->head_dim / 2;
    memset(qt, 0, (size_t)(words * 16 * 4));
    for (int64_t q = 0; q < rows; ++q) {
        const uint16_t *src = p->query + (first + q) * p->q_tok + head * p->q_head;
        for (int64_t w = 0; w < words; ++w) memcpy(&qt[(w / 16) * 256 + (w % 16) * 16 + q], src + 2 * w, 4);
    }
}

/* One key block's probabilities: scores [32 keys][16 queries] in place of the raw products,
 * running max and sum updated; returns the output's rescale factor and packs the bfloat16
 * probabilities in pairs of keys into pt (a B tile). */
static __m512 softmax_block(float *scores, int64_t first_key, int64_t keys, __m512i positions, int masked, __m512 c,
                            __m512 *run_max, __m512 *run_sum, uint16_t *pt) {
    const __m512 alpha = mask_block(scores, 32, first_key, keys, positions, masked, c, run_max);
    const __m512 new_max = *run_max;
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t r = 0; r < 16; ++r) {
        const __m512 lo = exp2_ps(_mm512_sub_ps(_mm512_load_ps(scores + 32 * r), new_max));
        const __m512 hi = exp2_ps(_mm512_sub_ps(_mm512_load_ps(scores + 32 * r + 16), new_max));
        sum = _mm512_add_ps(sum, _mm512_add_ps(lo, hi));
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* lo's 16 then hi's 16 */
        _mm512_store_si512((__m512i *)(pt + 32 * r), _mm512_permutexvar_epi16(pairs, both));
    }
    *run_sum = _mm512_fmadd_ps(*run_sum, alpha, sum);
    return alpha;
}

/* out^T rows [d0, d0 + 16 * n) = alpha * out^T + V^T rows times the probabilities (tile 3). */
static void accumulate_values(const uint16_t *vt, int64_t width, int64_t first_key, int64_t d0, int n, float *ot,
                              __m512 alpha, float *pv) {
    const uint16_t *a = vt + d0 * width + first_key;
    const int64_t stride = width * 2;
    _tile_zero(4);
    _tile_loadd(0, a, stride);
    _tile_dpbf16ps(4, 0, 3);
    if (n > 1) {
        _tile_zero(5);
        _tile_loadd(1, a + 16 * width, stride);
        _tile_dpbf16ps(5, 1, 3);
    }
    if (n > 2) {
        _tile_zero(6);
        _tile_loadd(2, a + 32 * width, stride);
        _tile_dpbf16ps(6, 2, 3);
    }
    if (n > 3) {
        _tile_zero(7);
        _tile_loadd(0, a + 48 * width, stride);
        _tile_dpbf16ps(7, 0, 3);
    }
    _tile_stored(4, pv, 64);
    if (n > 1) _tile_stored(5, pv + 256, 64);
    if (n > 2) _tile_stored(6, pv + 512, 64);
    if (n > 3) _tile_stored(7, pv + 768, 64);
    for (int64_t d = 0; d < 16 * n; ++d) {
        float *row = ot + (d0 + d) * 16;
        _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_load_ps(row), alpha, _mm512_load_ps(pv + d * 16)));
    }
}

typedef struct {
    uint32_t qt[4 * 256] __attribute__((aligned(64))); /* Q^T, up to 128 dims */
    float scores[32 * 16] __attribute__((aligned(64)));
    uint16_t pt[16 * 32] __attribute__((aligned(64)));
    float pv[4 * 256] __attribute__((aligned(64)));
    float ot[256 * 16] __attribute__((aligned(64))); /* out^T, up to 256 dims */
} scratch;

/* Queries [16 * qb, 16 * qb + 16) of a sequence's chunk, one head. */
static void query_block(const problem *p, int64_t seq, int64_t head, int64_t qb, scratch *w) {
    const int64_t q_len = p->cu[seq + 1] - p->cu[seq], len = p->lens[seq], width = padded_len(len);
    const int64_t rows = q_len - 16 * qb < 16 ? q_len - 16 * qb : 16;
    const int64_t first = p->cu[seq] + 16 * qb, first_pos = len - q_len + 16 * qb;
    const int64_t kv_head = head / p->group, dim = p->head_dim, k_tiles = dim / 32;
    /* Missing queries take the last row's position: they see no key past the sequence. */
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i positions = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32((int)first_pos), lanes),
                                               _mm512_set1_epi32((int)(first_pos + rows - 1)));
    const int64_t key_end = first_pos + rows; /* keys any query sees */
    const uint16_t *vt = p->vt + p->vt_off[seq] + kv_head * dim * width;
    const __m512 c = _mm512_set1_ps(p->log2_scale);
    __m512 run_max = _mm512_set1_ps(-INFINITY), run_sum = _mm512_setzero_ps();
    pack_queries(p, first, rows, head, w->qt);
    memset(w->ot, 0, (size_t)(dim * 16 * 4));
    for (int64_t k0 = 0; k0 < key_end; k0 += 32) {
        const int second = k0 + 16 < key_end;
        const uint16_t *k_lo = cache_row(p, seq, k0, kv_head);
        const uint16_t *k_hi = second ? cache_row(p, seq, k0 + 16, kv_head) : NULL;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t t = 0; t < k_tiles; ++t) {
            _tile_loadd(3, w->qt + t * 256, 64);
            _tile_loadd(2, k_lo + 32 * t, p->s_off * 2);
            _tile_dpbf16ps(0, 2, 3);
            if (second) {
                _tile_loadd(4, k_hi + 32 * t, p->s_off * 2);
                _tile_dpbf16ps(1, 4, 3);
            }
        }
        _tile_stored(0, w->scores, 64);
        _tile_stored(1, w->scores + 256, 64);
        const int64_t keys = key_end - k0 < 32 ? key_end - k0 : 32;
        const __m512 alpha = softmax_block(w->scores, k0, keys, positions, k0 + 31 > first_pos, c, &run_max, &run_sum,
                                           w->pt);
        _tile_loadd(3, w->pt, 64);
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            const int n = dim - d0 >= 64 ? 4 : (int)((dim - d0) / 16);
            accumulate_values(vt, width, k0, d0, n, w->ot, alpha, w->pv);
        }
    }
    float inv[16] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), run_sum));
    /* out^T's column q, 16 dims at a time */
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    for (int64_t q = 0; q < rows; ++q) {
        uint16_t *dst = p->out + (first + q) * p->o_tok + head * p->o_head;
        const __m512 scale = _mm512_set1_ps(inv[q]);
        for (int64_t d = 0; d < dim; d += 16)
            bf16x16_store(dst + d, _mm512_mul_ps(_mm512_i32gather_ps(column, w->ot + d * 16 + q, 4), scale));
    }
}

/* query: [tokens, heads, head_dim]; cache: one layer, [blocks, 2, block_size, kv_heads, head_dim]
 * strided; out like query. head_dim a multiple of 32 up to 128 (256 for the output), block_size a
 * multiple of 16. Returns PDS_OK, PDS_ERR_RANGE for tables or lengths out of range, PDS_ERR_MEMORY. */
int amx_prefill_attention_bf16(PREFILL_PARAMS(uint16_t)) {
    prefill_plan plan;
    const int status = prefill_plan_make(&plan, tables, table_stride, table_width, cu, lens, num_seqs, num_tokens,
                                         num_blocks, block_size, num_heads, sizeof(scratch));
    if (status != PDS_OK) return status;
    const int64_t *item_start = plan.item_start;
    /* each sequence's V^T (its KV heads' values transposed for the tiles), at vt + vt_off[s] */
    int64_t *vt_off = malloc((size_t)(num_seqs + 1) * sizeof *vt_off);
    if (!vt_off) {
        prefill_plan_free(&plan);
        return PDS_ERR_MEMORY;
    }
    vt_off[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        vt_off[s + 1] = vt_off[s] + (cu[s + 1] > cu[s] ? num_kv_heads * head_dim * padded_len(lens[s]) : 0);
    uint16_t *vt = aligned_alloc(64, (size_t)((vt_off[num_seqs] * 2 + 63) / 64 * 64 + 64));
    if (!vt) {
        free(vt_off);
        prefill_plan_free(&plan);
        return PDS_ERR_MEMORY;
    }
    const float log2_scale = scale * 1.4426950408889634f; /* log2(e) */
    const problem p = {query, cache, q_tok, q_head, s_block, s_kv, s_off, s_head, block_size, tables, cu, lens,
                       table_stride, num_heads, num_heads / num_kv_heads, head_dim, log2_scale, out, o_tok, o_head, vt,
                       vt_off};
    const int64_t items = item_start[num_seqs];
#pragma omp parallel num_threads(plan.threads)
    {
        scratch *w = (scratch *)plan.scratches + omp_get_thread_num();
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < num_seqs * num_kv_heads; ++i) {
            const int64_t seq = i / num_kv_heads;
            if (cu[seq + 1] > cu[seq]) transpose_values(&p, seq, i % num_kv_heads);
        }
        amx_configure_tiles();
        int64_t seq = 0, head, block;
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < items; ++i) {
            locate_item(i, item_start, cu, &seq, &head, &block);
            query_block(&p, seq, head, block, w);
        }
        _tile_release();
    }
    free(vt);
    free(vt_off);
    prefill_plan_free(&plan);
    return PDS_OK;
}

#else
int amx_attention_ready(void) { return 0; }
#endif
