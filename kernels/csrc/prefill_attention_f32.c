/* Prefill / extend attention in float32 on AVX-512: the scheme of amx_attention.c with vector FMAs
 * in place of AMX's tiles. Each 16-query block of a chunk attends causally to its sequence's paged
 * K/V (the chunk's own K/V already in the cache), 16 keys at a time, with a running max and sum
 * per query; each query is a vector lane, so the softmax needs no horizontal reductions:
 *   - a key's scores are the sum over the head's dims of its K[d] (broadcast) times Q^T[d] (the
 *     16 queries' d-th values, packed once per block, pre-scaled by scale * log2(e));
 *   - out^T[d] (16 queries) += V[key][d] (broadcast) times the key's probabilities.
 * K and V are read in place from the cache rows. Queries past a chunk's end and keys past a
 * sequence's end never reach the output (lanes dropped; keys masked).
 *
 * The caller's tensors are read directly, so the tables and lengths are checked first
 * (prefill.h): a bad one returns PDS_ERR_RANGE before anything is read.
 *
 * prefill_attention_bf16 is the same computation on bfloat16 query, cache and output, for CPUs
 * without AMX (amx_attention.c takes those with it). Where the CPU has AVX512-BF16 the scores are
 * vdpbf16ps products of the unscaled bfloat16 queries (Q^T packed in pairs of dims) and each key's
 * pairs of dims, read in place (exact products, float32 sums; the scale applied to the sums),
 * and the value product is vdpbf16ps too: each block's V rows packed in pairs of keys into the
 * thread's scratch, the probabilities rounded to bfloat16 (nearest even, as torch's SDPA and
 * amx_attention.c do) in pairs of keys, float32 sums. Without AVX512-BF16 the key and V rows are
 * widened to float32 (exact), both products run in float32 as above and the probabilities stay
 * float32. The output is rounded once to bfloat16 (nearest even).
 *
 * A work item takes up to MAX_HEADS heads of one KV head's group at once, so each K and V value
 * broadcast serves all of them, and moves Q^T in and the output out by 16 x 16 register
 * transposes. Against torch's per-sequence SDPA: benchmarks/kernels.py --cpu.
 */
#define _DEFAULT_SOURCE
#include "pdserve_kernels.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "prefill.h"

#ifdef __AVX512F__

int prefill_attention_f32_ready(void) { return 1; }

/* Strides in elements; elem: 4 (float32) or 2 (bfloat16: query, cache and out). */
typedef struct {
    const char *query, *cache;
    int64_t q_tok, q_head, s_block, s_kv, s_off, s_head, block_size;
    const int32_t *tables, *cu, *lens;
    int64_t table_stride, group, head_dim;
    float log2_scale;
    char *out;
    int64_t o_tok, o_head, elem;
} problem;

/* The heads of a KV head's group that one work item takes at once (each K and V value read is
 * used for all of them): up to MAX_HEADS. */
#define MAX_HEADS 3
/* The output dims one value-product call (accumulate_keys, accumulate_pairs) takes for nh heads:
 * 16 for one head, else 8, so the accumulators fill the registers either way. */
#define ACC_DIMS(nh) ((nh) == 1 ? 16 : 8)
enum { MAX_ACC_DIMS = 16 };
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    float qt[MAX_HEADS][256 * 16] __attribute__((aligned(64))); /* Q^T per head, up to 256 dims */
    float scores[MAX_HEADS][16 * 16] __attribute__((aligned(64)));
    float ot[MAX_HEADS][256 * 16] __attribute__((aligned(64))); /* out^T per head */
    float k[16 * 256] __attribute__((aligned(64)));             /* bfloat16: a block's K rows, widened */
    float v[16 * 256] __attribute__((aligned(64)));             /* and its V rows */
    uint16_t qp[MAX_HEADS][256 * 16] __attribute__((aligned(64))); /* bfloat16: Q^T in pairs of dims */
    uint32_t pp[MAX_HEADS][8 * 16] __attribute__((aligned(64)));   /* bfloat16: probabilities in pairs of keys */
    uint32_t vp[8 * 256] __attribute__((aligned(64)));              /* bfloat16: a block's V in pairs of keys */
} scratch;

static const char *key_row(const problem *p, int64_t seq, int64_t token, int64_t kv_head) {
    const int64_t block = p->tables[seq * p->table_stride + token / p->block_size];
    return p->cache + (block * p->s_block + (token % p->block_size) * p->s_off + kv_head * p->s_head) * p->elem;
}

/* rows rows of bfloat16 (s_off apart) to float32 rows dim apart. */
static void widen_rows(const uint16_t *src, int64_t s_off, int64_t rows, int64_t dim, float *dst) {
    for (int64_t j = 0; j < rows; ++j)
        for (int64_t d = 0; d < dim; d += 16) _mm512_store_ps(dst + j * dim + d, bf16x16_load(src + j * s_off + d));
}

/* r[i][j] -> r[j][i] for a 16 x 16 block of 32-bit values, in registers: within each 128-bit lane
 * pairs of rows interleaved (ps), then pairs of pairs (pd), then lanes across rows 4 and 8
 * apart. Q^T's packing and the output's unpacking, in place of slower gathers. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* r[4i + m], lane L: rows 4i..4i+3 of column 4L + m */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 2; ++i) /* t[8i + m]: columns m, 8 + m; t[8i + 4 + m]: 4 + m, 12 + m */
        for (int m = 0; m < 4; ++m) {
            t[8 * i + m] = _mm512_shuffle_f32x4(r[8 * i + m], r[8 * i + 4 + m], 0x88);
            t[8 * i + 4 + m] = _mm512_shuffle_f32x4(r[8 * i + m], r[8 * i + 4 + m], 0xdd);
        }
    for (int m = 0; m < 8; ++m) {
        r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
        r[m + 8] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd);
    }
}

/* Scores of keys [at, at + 8) of a block (rows of k, s_off apart) for the 16
 * queries of each of nh heads' Q^T (w->qt), into each head's scores rows from `at`. */
INLINE void score_keys_impl(const float *k, int64_t s_off, scratch *w, int64_t dim, int64_t at, const int nh) {
    __m512 acc[MAX_HEADS][8];
    for (int h = 0; h < nh; ++h)
        for (int j = 0; j < 8; ++j) acc[h][j] = _mm512_setzero_ps();
    if (dim < 16) __builtin_unreachable(); /* else the accumulators go through the stack */
    for (int64_t d = 0; d < dim; ++d) {
        __m512 q[MAX_HEADS];
        for (int h = 0; h < nh; ++h) q[h] = _mm512_load_ps(w->qt[h] + 16 * d);
        for (int j = 0; j < 8; ++j) {
            const __m512 kj = _mm512_set1_ps(k[j * s_off + d]);
            for (int h = 0; h < nh; ++h) acc[h][j] = _mm512_fmadd_ps(kj, q[h], acc[h][j]);
        }
    }
    for (int h = 0; h < nh; ++h)
        for (int j = 0; j < 8; ++j) _mm512_store_ps(w->scores[h] + 16 * (at + j), acc[h][j]);
}

/* The value products' accumulators (accumulate_pairs, accumulate_keys): out^T rows [d0, d0 +
 * ACC_DIMS(nh)) of each of nh heads, scaled by the head's alpha, in; and back out. */
INLINE void load_out(__m512 acc[][MAX_ACC_DIMS], const scratch *w, int64_t d0, const __m512 *alpha, const int nh) {
    for (int h = 0; h < nh; ++h)
        for (int i = 0; i < ACC_DIMS(nh); ++i)
            acc[h][i] = _mm512_mul_ps(_mm512_load_ps(w->ot[h] + (d0 + i) * 16), alpha[h]);
}

INLINE void store_out(__m512 acc[][MAX_ACC_DIMS], scratch *w, int64_t d0, const int nh) {
    for (int h = 0; h < nh; ++h)
        for (int i = 0; i < ACC_DIMS(nh); ++i) _mm512_store_ps(w->ot[h] + (d0 + i) * 16, acc[h][i]);
}

#ifdef __AVX512BF16__
#define SCORES_IN_BF16 1
/* The same from bfloat16 rows of k and each head's Q^T in pairs of dims (w->qp), unscaled: one
 * vdpbf16ps per key, pair and head. */
INLINE void score_keys_bf16_impl(const uint16_t *k, int64_t s_off, scratch *w, int64_t dim, int64_t at, const int nh) {
    __m512 acc[MAX_HEADS][8];
    for (int h = 0; h < nh; ++h)
        for (int j = 0; j < 8; ++j) acc[h][j] = _mm512_setzero_ps();
    if (dim < 16) __builtin_unreachable(); /* else the accumulators go through the stack */
    for (int64_t d = 0; d < dim; d += 2) {
        __m512bh q[MAX_HEADS];
        for (int h = 0; h < nh; ++h) q[h] = (__m512bh)_mm512_load_si512(w->qp[h] + 16 * d);
        for (int j = 0; j < 8; ++j) {
            int32_t pair;
            memcpy(&pair, k + j * s_off + d, sizeof pair);
            const __m512bh kj = (__m512bh)_mm512_set1_epi32(pair);
            for (int h = 0; h < nh; ++h) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], q[h], kj);
        }
    }
    for (int h = 0; h < nh; ++h)
        for (int j = 0; j < 8; ++j) _mm512_store_ps(w->scores[h] + 16 * (at + j), acc[h][j]);
}

/* A block's keys [0, keys) in pairs for vdpbf16ps, the odd key's partner zero: V rows (bfloat16,
 * s_off apart) to w->vp, pair j's dims in order, each the 32-bit pair (key 2j, key 2j + 1); and
 * each head's probabilities (its scores rows, float32) rounded to bfloat16 (nearest even) to
 * w->pp, pair j's 16 queries, each the pair (key 2j, key 2j + 1). Returns the number of pairs. */
static int64_t pack_pairs(const uint16_t *v, int64_t s_off, int64_t keys, int64_t dim, scratch *w, int nh) {
    const int64_t pairs = (keys + 1) / 2;
    for (int64_t j = 0; j < pairs; ++j) {
        const uint16_t *a = v + 2 * j * s_off, *b = a + s_off;
        const int odd = 2 * j + 1 >= keys;
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + d)));
            const __m512i hi = odd ? _mm512_setzero_si512()
                                   : _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + d))), 16);
            _mm512_store_si512(w->vp + j * dim + d, _mm512_or_si512(lo, hi));
        }
    }
    /* out[2q] = in[q], out[2q + 1] = in[16 + q]: the two keys' rows interleaved by query */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int h = 0; h < nh; ++h)
        for (int64_t j = 0; j < pairs; ++j) {
            const __m512 a = _mm512_load_ps(w->scores[h] + 32 * j);
            const __m512 b = 2 * j + 1 >= keys ? _mm512_setzero_ps() : _mm512_load_ps(w->scores[h] + 32 * j + 16);
            _mm512_store_si512(w->pp[h] + 16 * j, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
        }
    return pairs;
}

/* accumulate_keys on pairs of keys (pack_pairs): one vdpbf16ps per pair, dim and head, where
 * the float32 form takes two FMAs. */
INLINE void accumulate_pairs_impl(const uint32_t *vp, int64_t dim, int64_t num_pairs, scratch *w, int64_t d0,
                                  const __m512 *alpha, const int nh) {
    __m512 acc[MAX_HEADS][MAX_ACC_DIMS];
    load_out(acc, w, d0, alpha, nh);
    if (num_pairs < 1) __builtin_unreachable(); /* else the accumulators go through the stack */
    for (int64_t j = 0; j < num_pairs; ++j) {
        __m512bh pj[MAX_HEADS];
        for (int h = 0; h < nh; ++h) pj[h] = (__m512bh)_mm512_load_si512(w->pp[h] + 16 * j);
        const uint32_t *row = vp + j * dim + d0;
        for (int i = 0; i < ACC_DIMS(nh); ++i) {
            const __m512bh vi = (__m512bh)_mm512_set1_epi32((int)row[i]);
            for (int h = 0; h < nh; ++h) acc[h][i] = _mm512_dpbf16_ps(acc[h][i], pj[h], vi);
        }
    }
    store_out(acc, w, d0, nh);
}
#else
#define SCORES_IN_BF16 0
#endif

/* Masks, max and exponentials of a block's scores (keys rows), scaled by c first; returns the
 * rescale factor of what came before. */
static inline __m512 softmax_keys(float *scores, int64_t first_key, int64_t keys, __m512i positions, int masked,
                                  __m512 c, __m512 *run_max, __m512 *run_sum) {
    const __m512 alpha = mask_block(scores, keys, first_key, keys, positions, masked, c, run_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; ++j) {
        const __m512 e = exp2_ps(_mm512_sub_ps(_mm512_load_ps(scores + 16 * j), *run_max));
        _mm512_store_ps(scores + 16 * j, e);
        sum = _mm512_add_ps(sum, e);
    }
    *run_sum = _mm512_fmadd_ps(*run_sum, alpha, sum);
    return alpha;
}

/* For each of nh heads, out^T rows [d0, d0 + ACC_DIMS(nh)) = alpha * out^T + the keys' V (rows of
 * v, s_off apart) times the head's probabilities (its scores). */
INLINE void accumulate_keys_impl(const float *v, int64_t s_off, int64_t keys, scratch *w, int64_t d0,
                            const __m512 *alpha, const int nh) {
    __m512 acc[MAX_HEADS][MAX_ACC_DIMS];
    load_out(acc, w, d0, alpha, nh);
    if (keys < 1) __builtin_unreachable(); /* else the accumulators go through the stack */
    for (int64_t j = 0; j < keys; ++j) {
        __m512 pj[MAX_HEADS];
        for (int h = 0; h < nh; ++h) pj[h] = _mm512_load_ps(w->scores[h] + 16 * j);
        const float *row = v + j * s_off + d0;
        for (int i = 0; i < ACC_DIMS(nh); ++i) {
            const __m512 vi = _mm512_set1_ps(row[i]);
            for (int h = 0; h < nh; ++h) acc[h][i] = _mm512_fmadd_ps(vi, pj[h], acc[h][i]);
        }
    }
    store_out(acc, w, d0, nh);
}

/* Each of the above compiled per head count on its own (noinline): inlined into the query
 * loop, the compiler kept accumulators or operands on the stack. */
#define PER_HEADS(NH)                                                                                              \
    static __attribute__((noinline)) void score_keys_##NH(const float *k, int64_t s_off, scratch *w, int64_t dim, \
                                                          int64_t at) {                                           \
        score_keys_impl(k, s_off, w, dim, at, NH);                                                                 \
    }                                                                                                              \
    static __attribute__((noinline)) void accumulate_keys_##NH(const float *v, int64_t s_off, int64_t keys,       \
                                                               scratch *w, int64_t d0, const __m512 *alpha) {     \
        accumulate_keys_impl(v, s_off, keys, w, d0, alpha, NH);                                                    \
    }                                                                                                              \
    BF16_PER_HEADS(NH)
#if SCORES_IN_BF16
#define BF16_PER_HEADS(NH)                                                                                         \
    static __attribute__((noinline)) void score_keys_bf16_##NH(const uint16_t *k, int64_t s_off, scratch *w,      \
                                                               int64_t dim, int64_t at) {                         \
        score_keys_bf16_impl(k, s_off, w, dim, at, NH);                                                            \
    }                                                                                                              \
    static __attribute__((noinline)) void accumulate_pairs_##NH(const uint32_t *vp, int64_t dim, int64_t num_pairs, \
                                                                scratch *w, int64_t d0, const __m512 *alpha) {      \
        accumulate_pairs_impl(vp, dim, num_pairs, w, d0, alpha, NH);                                                 \
    }
#else
#define BF16_PER_HEADS(NH)
#endif
PER_HEADS(1)
PER_HEADS(2)
PER_HEADS(3)
#define BY_HEADS(fn, nh, ...) ((nh) == 1 ? fn##_1(__VA_ARGS__) : (nh) == 2 ? fn##_2(__VA_ARGS__) : fn##_3(__VA_ARGS__))

/* Queries [16 * qb, 16 * qb + 16) of a sequence's chunk, heads [head, head + nh) of one KV head's
 * group. */
INLINE void query_block_heads(const problem *p, int64_t seq, int64_t head, int64_t qb, scratch *w, const int nh) {
    const int64_t q_len = p->cu[seq + 1] - p->cu[seq], len = p->lens[seq];
    const int64_t rows = q_len - 16 * qb < 16 ? q_len - 16 * qb : 16;
    const int64_t first = p->cu[seq] + 16 * qb, first_pos = len - q_len + 16 * qb;
    const int64_t kv_head = head / p->group, dim = p->head_dim;
    /* Missing queries take the last row's position: they see no key past the sequence. */
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i positions = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32((int)first_pos), lanes),
                                               _mm512_set1_epi32((int)(first_pos + rows - 1)));
    const int64_t key_end = first_pos + rows; /* keys any query sees */
    const int pairs = SCORES_IN_BF16 && p->elem == 2; /* scores from bfloat16 pairs, scaled after */
    const __m512 score_scale = _mm512_set1_ps(pairs ? p->log2_scale : 1.0f);
    /* Q^T per head: 16 x 16 blocks of the chunk's rows transposed, of 32-bit values: bfloat16
     * pairs of dims (pairs), else dims (bfloat16 ones widened), pre-scaled; missing queries are
     * zeros. */
    const int64_t units = pairs ? dim / 2 : dim; /* dim / 2: not always a multiple of 16 */
    const __m512 c = _mm512_set1_ps(p->log2_scale);
    for (int h = 0; h < nh; ++h) {
        const char *src = p->query + (first * p->q_tok + (head + h) * p->q_head) * p->elem;
        float *dst = pairs ? (float *)w->qp[h] : w->qt[h];
        for (int64_t d0 = 0; d0 < units; d0 += 16) {
            const int64_t n = units - d0 < 16 ? units - d0 : 16;
            const __mmask16 in_row = (__mmask16)((1u << n) - 1);
            __m512 r[16];
            for (int q = 0; q < 16; ++q) {
                const char *row = src + q * p->q_tok * p->elem;
                r[q] = q >= rows                   ? _mm512_setzero_ps()
                       : pairs || p->elem == 4 ? _mm512_maskz_loadu_ps(in_row, (const float *)row + d0)
                                               : bf16x16_load((const uint16_t *)row + d0);
            }
            transpose16(r);
            for (int i = 0; i < n; ++i) _mm512_store_ps(dst + 16 * (d0 + i), pairs ? r[i] : _mm512_mul_ps(r[i], c));
        }
        memset(w->ot[h], 0, (size_t)(dim * 16 * 4));
    }
    __m512 run_max[MAX_HEADS], run_sum[MAX_HEADS], alpha[MAX_HEADS];
    for (int h = 0; h < nh; ++h) run_max[h] = _mm512_set1_ps(-INFINITY), run_sum[h] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < key_end; k0 += 16) {
        /* 16 keys from k0 lie in one cache block (block_size a multiple of 16); rows past the
         * sequence are computed on and never used. */
        const char *row = key_row(p, seq, k0, kv_head);
        const int64_t keys = key_end - k0 < 16 ? key_end - k0 : 16;
        const float *k = (const float *)row, *v = (const float *)row + p->s_kv;
        int64_t s_off = p->s_off;
#if SCORES_IN_BF16
        if (pairs) {
            const uint16_t *kh = (const uint16_t *)row;
            for (int j = 0; j < 16; j += 8)
                if (j < keys) BY_HEADS(score_keys_bf16, nh, kh + j * p->s_off, p->s_off, w, dim, j);
        }
#endif
        if (p->elem == 2 && !pairs) { /* the K and V rows, widened */
            widen_rows((const uint16_t *)row, p->s_off, keys > 8 ? 16 : 8, dim, w->k);
            widen_rows((const uint16_t *)row + p->s_kv, p->s_off, keys, dim, w->v);
            k = w->k, v = w->v, s_off = dim;
        }
        if (!pairs) {
            for (int j = 0; j < 16; j += 8)
                if (j < keys) BY_HEADS(score_keys, nh, k + j * s_off, s_off, w, dim, j);
        }
        for (int h = 0; h < nh; ++h)
            alpha[h] = softmax_keys(w->scores[h], k0, keys, positions, k0 + 15 > first_pos, score_scale, &run_max[h],
                                    &run_sum[h]);
#if SCORES_IN_BF16
        if (pairs) {
            const int64_t key_pairs = pack_pairs((const uint16_t *)row + p->s_kv, p->s_off, keys, dim, w, nh);
            for (int64_t d0 = 0; d0 < dim; d0 += ACC_DIMS(nh))
                BY_HEADS(accumulate_pairs, nh, w->vp, dim, key_pairs, w, d0, alpha);
            continue;
        }
#endif
        for (int64_t d0 = 0; d0 < dim; d0 += ACC_DIMS(nh)) BY_HEADS(accumulate_keys, nh, v, s_off, keys, w, d0, alpha);
    }
    for (int h = 0; h < nh; ++h) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), run_sum[h]);
        float scale[16] __attribute__((aligned(64)));
        _mm512_store_ps(scale, inv);
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
            __m512 r[16]; /* out^T's rows d0.. -> the queries' rows of dims d0.. */
            for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(w->ot[h] + (d0 + i) * 16);
            transpose16(r);
            for (int64_t q = 0; q < rows; ++q) {
                char *dst = p->out + ((first + q) * p->o_tok + (head + h) * p->o_head) * p->elem;
                const __m512 o = _mm512_mul_ps(r[q], _mm512_set1_ps(scale[q]));
                if (p->elem == 4)
                    _mm512_storeu_ps((float *)dst + d0, o);
                else
                    bf16x16_store((uint16_t *)dst + d0, o);
            }
        }
    }
}

static void query_block(const problem *p, int64_t seq, int64_t head, int64_t nh, int64_t qb, scratch *w) {
    switch (nh) {
    case 1: query_block_heads(p, seq, head, qb, w, 1); break;
    case 2: query_block_heads(p, seq, head, qb, w, 2); break;
    default: query_block_heads(p, seq, head, qb, w, 3); break;
    }
}

static int prefill_attention(int64_t elem, PREFILL_PARAMS(void)) {
    /* A unit is up to MAX_HEADS heads of one KV head's group, split evenly (4 heads: 2 + 2). */
    const int64_t group = num_heads / num_kv_heads, per_kv = (group + MAX_HEADS - 1) / MAX_HEADS;
    const int64_t unit_heads = (group + per_kv - 1) / per_kv, units = num_kv_heads * per_kv;
    prefill_plan plan;
    const int status = prefill_plan_make(&plan, tables, table_stride, table_width, cu, lens, num_seqs, num_tokens,
                                         num_blocks, block_size, units, sizeof(scratch));
    if (status != PDS_OK) return status;
    const int64_t *item_start = plan.item_start;
    const problem p = {query, cache, q_tok, q_head, s_block, s_kv, s_off, s_head, block_size, tables, cu, lens,
                       table_stride, group, head_dim, scale * 1.4426950408889634f /* log2(e) */,
                       out, o_tok, o_head, elem};
    const int64_t items = item_start[num_seqs];
#pragma omp parallel num_threads(plan.threads)
    {
        scratch *w = (scratch *)plan.scratches + omp_get_thread_num();
        int64_t seq = 0, head, block;
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < items; ++i) {
            int64_t unit;
            locate_item(i, item_start, cu, &seq, &unit, &block);
            head = unit / per_kv * group + unit % per_kv * unit_heads;
            const int64_t nh = (unit / per_kv + 1) * group - head;
            query_block(&p, seq, head, nh < unit_heads ? nh : unit_heads, block, w);
        }
    }
    prefill_plan_free(&plan);
    return PDS_OK;
}

/* query: [tokens, heads, head_dim] float32; cache: one layer, [blocks, 2, block_size, kv_heads,
 * head_dim] strided; out like query. head_dim a multiple of 16 up to 256, block_size a multiple
 * of 16. Returns PDS_OK, PDS_ERR_RANGE for tables or lengths out of range, or PDS_ERR_MEMORY. */
int prefill_attention_f32(PREFILL_PARAMS(float)) { return prefill_attention(4, PREFILL_ARGS); }

/* The same on bfloat16 query, cache and out. */
int prefill_attention_bf16(PREFILL_PARAMS(uint16_t)) { return prefill_attention(2, PREFILL_ARGS); }

#else
int prefill_attention_f32_ready(void) { return 0; }
#endif
