/* Paged decode attention on the CPU: one query token per sequence attends to the
 * first seq_len tokens of its block table, read in place from the block-major cache (no gather).
 *
 * One task per sequence: its query heads walk the sequence's blocks once, with an online softmax
 * (running max and sum, accumulator rescaled only when the max grows) per head in float32.
 * Per block, KV head by KV head: the keys give every query head of the group its scores 16 tokens
 * at a time (16 dot-product vectors summed across lanes together, not one by one), then the
 * values are added into accumulators held in registers for the whole block (the group's query
 * heads in chunks of at most 16 vectors). The next block is prefetched slice by slice as this one
 * is read, one block ahead, and a sequence's last block prefetches the next sequence's first; each
 * row read also brings the next KV head's row of the same token into L1 (prefetch_for_row).
 * From memory the reads and the arithmetic barely overlap, so without the prefetches the kernel
 * takes about twice as long.
 * Tasks are spread over the process's OpenMP threads (torch's own pool: the same libgomp.so.1),
 * guided: each thread first takes a run of consecutive sequences, so the next sequence whose
 * first block a sequence prefetches (`then`) is mostly its own, and the runs shrink toward the
 * end, so a thread held up (by another process on its core) is caught up by the other.
 * Head sizes 32, 64, 80, 96 and 128 run on 16-float vectors (GCC vector extensions: one AVX-512
 * register; 8-float vectors ran slower); other sizes take a scalar loop.
 * The cache, query and output are all float32 or all bfloat16: a bfloat16 row is widened to
 * float32 as it is loaded (its bits shifted into a float's top half, exact), so every sum runs in
 * float32 and the bytes read are halved; the output is rounded to bfloat16 once, as torch rounds.
 * The prefetch distances and levels, the schedule and the layout of the loops were chosen with
 * benchmarks/kernels.py --cpu (paged decode attention).
 * Built with -ffast-math for vector expf and reassociated sums, linked without it so that
 * loading the library leaves the process's denormal handling alone.
 */
#include "pdserve_kernels.h"
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

enum { MAX_HEADS = PDS_LIMIT_max_heads, MAX_HEAD_DIM = PDS_LIMIT_max_head_dim,
       MAX_BLOCK_SIZE = PDS_LIMIT_max_block_size, LANES = 16 };

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

typedef struct {
    const void *kv_cache; /* float32, or bfloat16 (uint16_t) when kv_bf16 */
    int64_t stride_block, stride_kv, stride_token, stride_head;
    int block_size, group;
    float scale;
} CacheView;

/* A two-source lane permute (indices 16-31 pick from b): GCC before 12 has only __builtin_shuffle. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t i32x16 __attribute__((vector_size(64)));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i32x16){__VA_ARGS__})
#endif

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* 16 cache values from element offset off, as float32. */
static inline v16 load_kv16(const void *cache, int64_t off, const int kv_bf16) {
    if (!kv_bf16) return load16((const float *)cache + off);
#ifdef __AVX512F__
    /* One vpmovzxwd and one shift: GCC turns the vector-extension form (#else) into two 8-lane
     * halves and an insert, which ran slower. */
    return (v16)bf16x16_load((const uint16_t *)cache + off);
#else
    u16x16 half;
    memcpy(&half, (const uint16_t *)cache + off, sizeof half);
    const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    v16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

/* 16 float32 values to element offset off of out, narrowed to bfloat16 when bf16 (to nearest
 * even, NaN kept a NaN: bf16.h's rule, as torch rounds). */
static inline void store_out16(void *out, int64_t off, v16 v, const int bf16) {
    if (!bf16) {
        store16((float *)out + off, v);
        return;
    }
    u32x16 bits;
    memcpy(&bits, &v, sizeof bits);
    const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const u32x16 quiet = (bits >> 16) | 0x40u;
    const u32x16 nan = (u32x16)((bits & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    const u32x16 narrowed = (quiet & nan) | (rounded & ~nan);
    const u16x16 half = __builtin_convertvector(narrowed, u16x16);
    memcpy((uint16_t *)out + off, &half, sizeof half);
}

/* num elements from element offset off of the cache: into L2 (prefetcht1), or with into_l1 (a
 * constant after inlining) into L1 (prefetcht0). */
static inline __attribute__((always_inline)) void prefetch_span(const void *cache, int64_t off, int64_t num,
                                                                const int kv_bf16, const int into_l1) {
    const char *p = (const char *)cache + off * (kv_bf16 ? 2 : 4);
    const int64_t bytes = num * (kv_bf16 ? 2 : 4);
    for (int64_t i = 0; i < bytes; i += 64) {
        if (into_l1)
            __builtin_prefetch(p + i, 0, 3);
        else
            __builtin_prefetch(p + i, 0, 2);
    }
}

/* What each K or V row read (row, num elements) prefetches:
 * - the same row of the next block (ahead) into L2, not L1: L1 prefetches a block ahead wait on
 *   the L1's few miss buffers, and the reads then stop overlapping the arithmetic;
 * - the same token's row of the next KV head into L1, which the next head's pass reads ~16
 *   tokens later (past the last head: the next token's first head, already read; a prefetch
 *   never faults, so the block's very last row may point past the cache harmlessly).
 * Both chosen by benchmarks/kernels.py --cpu. */
static inline __attribute__((always_inline)) void prefetch_for_row(const CacheView *cv, int64_t ahead, int64_t row,
                                                                   int64_t num, const int kv_bf16) {
    prefetch_span(cv->kv_cache, ahead, num, kv_bf16, 0);
    prefetch_span(cv->kv_cache, row + cv->stride_head, num, kv_bf16, 1);
}

/* The 16 sums of d[0..15], in order, as one vector: four levels that each add the two halves of
 * every lane segment of two vectors (segments of 8, 4, 2, 1 lanes), pairing d[i] with d[i + 8]
 * first so that the sums come out in natural order. 15 two-source permute pairs and 15 adds for
 * 16 dot products, against four shuffle-add levels for each one alone. */
static inline v16 sum16x16(const v16 d[LANES]) {
    v16 w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)
        w[i] = SHUFFLE(d[i], d[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUFFLE(d[i], d[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        x[i] = SHUFFLE(w[i], w[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + SHUFFLE(w[i], w[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        y[i] = SHUFFLE(x[i], x[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + SHUFFLE(x[i], x[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return SHUFFLE(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + SHUFFLE(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

/* Online-softmax step for one query head over one block's scores: returns the factor the
 * accumulator must be scaled by (1 when the running max stays, which after the first blocks is
 * the common case); scores become the block's unnormalized probabilities. */
static inline float softmax_step(float *scores, int num, float *run_max, float *run_sum) {
    float block_max = -FLT_MAX;
    for (int t = 0; t < num; ++t) block_max = scores[t] > block_max ? scores[t] : block_max;
    float correction = 1.0f;
    if (block_max > *run_max) {
        correction = expf(*run_max - block_max);
        *run_max = block_max;
    }
    const float new_max = *run_max;
    float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
    for (int t = 0; t < num; ++t) {
        scores[t] = expf(scores[t] - new_max);
        block_sum += scores[t];
    }
    *run_sum = *run_sum * correction + block_sum;
    return correction;
}

enum { MAX_CHUNK = 4 };

/* Scores of tokens [0, n) (n <= 16) of one block for gc query heads that share one KV head, each
 * query head's 16 dot products summed across lanes together (sum16x16): scores[g *
 * MAX_BLOCK_SIZE + t], scaled. k and ahead: this KV head's first key in this block and in the
 * next one, whose same keys are prefetched when prefetch is set (and the next KV head's keys of
 * this block into L1). */
static inline __attribute__((always_inline)) void
key_tile(const CacheView *cv, int64_t k, int64_t ahead, int prefetch, int n, const void *q, int64_t q_off, int64_t stride_q_head,
         float *scores, const int gc, const int num_vecs, const int kv_bf16) {
    v16 qv[MAX_CHUNK][MAX_HEAD_DIM / LANES];
    v16 dots[MAX_CHUNK][LANES];
    for (int g = 0; g < gc; ++g)
        for (int j = 0; j < num_vecs; ++j) qv[g][j] = load_kv16(q, q_off + g * stride_q_head + j * LANES, kv_bf16);
    for (int t = 0; t < n; ++t) {
        const int64_t row = k + t * cv->stride_token;
        if (prefetch) prefetch_for_row(cv, ahead + t * cv->stride_token, row, num_vecs * LANES, kv_bf16);
        v16 key[MAX_HEAD_DIM / LANES];
        for (int j = 0; j < num_vecs; ++j) key[j] = load_kv16(cv->kv_cache, row + j * LANES, kv_bf16);
        for (int g = 0; g < gc; ++g) {
            v16 dot = qv[g][0] * key[0];
            for (int j = 1; j < num_vecs; ++j) dot += qv[g][j] * key[j];
            dots[g][t] = dot;
        }
    }
    for (int t = n; t < LANES; ++t)
        for (int g = 0; g < gc; ++g) dots[g][t] = (v16){0};
    for (int g = 0; g < gc; ++g) store16(scores + g * MAX_BLOCK_SIZE, sum16x16(dots[g]) * cv->scale);
}

/* acc[g] += sum over tokens t < num of p[g][t] * value[t], for gc query heads sharing one KV head,
 * the accumulators held in registers across the block. v and ahead: this KV head's first value
 * in this block and in the next one (prefetched when prefetch is set, and the next KV head's
 * values of this block into L1). */
static inline __attribute__((always_inline)) void
value_block(const CacheView *cv, int64_t v, int64_t ahead, int prefetch, int num, const float *scores,
            v16 (*acc)[MAX_HEAD_DIM / LANES], const int gc, const int num_vecs, const int kv_bf16) {
    v16 a[MAX_CHUNK][MAX_HEAD_DIM / LANES];
    for (int g = 0; g < gc; ++g)
        for (int j = 0; j < num_vecs; ++j) a[g][j] = acc[g][j];
    for (int t = 0; t < num; ++t) {
        const int64_t row = v + t * cv->stride_token;
        if (prefetch) prefetch_for_row(cv, ahead + t * cv->stride_token, row, num_vecs * LANES, kv_bf16);
        v16 value[MAX_HEAD_DIM / LANES];
        for (int j = 0; j < num_vecs; ++j) value[j] = load_kv16(cv->kv_cache, row + j * LANES, kv_bf16);
        for (int g = 0; g < gc; ++g) {
            const float p = scores[g * MAX_BLOCK_SIZE + t];
            for (int j = 0; j < num_vecs; ++j) a[g][j] += p * value[j];
        }
    }
    for (int g = 0; g < gc; ++g)
        for (int j = 0; j < num_vecs; ++j) acc[g][j] = a[g][j];
}

/* One call of key_tile or value_block with the chunk size gc as a constant (1..MAX_CHUNK). */
#define WITH_CHUNK(gc, CALL)                                                                                    \
    switch (gc) {                                                                                              \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    default: CALL(4); break;                                                                                   \
    }

/* Vector path, one sequence, all its heads: head_dim = num_vecs * 16; num_vecs and kv_bf16 are
 * constants in each copy. Cache positions are element offsets from cv->kv_cache. Per block: the
 * scores of every query head (KV head by KV head, the query heads of a group in chunks that fit
 * in registers), the online-softmax step, then the values, KV head by KV head. The next block is
 * prefetched slice by slice as this one is read; the last block prefetches `then` (a cache
 * position, or -1 for none): the first block of the sequence that comes next. */
static inline __attribute__((always_inline)) void
attend_vec(const CacheView *cv, const void *q, int64_t stride_q_head, int num_kv_heads, const int32_t *block_table,
           int seq_len, void *out, int64_t stride_out_head, int64_t then, const int num_vecs, const int kv_bf16) {
    /* Chunks of at most 16 accumulator vectors, so that value_block's stay in registers. */
    const int chunk_cap = 16 / num_vecs > MAX_CHUNK ? MAX_CHUNK : 16 / num_vecs;
    const int group = cv->group, block_size = cv->block_size, num_heads = num_kv_heads * group;
    const int64_t stride_token = cv->stride_token, stride_head = cv->stride_head, stride_kv = cv->stride_kv;
    v16 acc[MAX_HEADS][MAX_HEAD_DIM / LANES];
    float run_max[MAX_HEADS], run_sum[MAX_HEADS];
    float scores[MAX_HEADS][MAX_BLOCK_SIZE];
    for (int head = 0; head < num_heads; ++head) {
        run_max[head] = -FLT_MAX;
        run_sum[head] = 0.0f;
        for (int j = 0; j < num_vecs; ++j) acc[head][j] = (v16){0};
    }
    for (int start = 0; start < seq_len; start += block_size) {
        const int num = seq_len - start < block_size ? seq_len - start : block_size;
        const int64_t block = (int64_t)block_table[start / block_size] * cv->stride_block;
        const int next = start + block_size;
        /* The last block prefetches the next sequence's first block (then), or itself (harmless). */
        const int64_t ahead = next < seq_len ? (int64_t)block_table[next / block_size] * cv->stride_block
                              : then >= 0 ? then : block;
        for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
            const int64_t k = block + kv_head * stride_head, k_ahead = ahead + kv_head * stride_head;
            for (int g0 = 0; g0 < group; g0 += chunk_cap) {
                const int gc = group - g0 < chunk_cap ? group - g0 : chunk_cap, head = kv_head * group + g0;
                for (int t0 = 0; t0 < num; t0 += LANES) {
                    const int n = num - t0 < LANES ? num - t0 : LANES;
                    const int64_t at = t0 * stride_token;
#define KEY_TILE(GC)                                                                                               \
    key_tile(cv, k + at, k_ahead + at, g0 == 0, n, q, head * stride_q_head, stride_q_head, &scores[head][t0], GC, \
             num_vecs, kv_bf16)
                    WITH_CHUNK(gc, KEY_TILE)
#undef KEY_TILE
                }
            }
        }
        for (int head = 0; head < num_heads; ++head) {
            const float correction = softmax_step(scores[head], num, &run_max[head], &run_sum[head]);
            if (correction != 1.0f)
                for (int j = 0; j < num_vecs; ++j) acc[head][j] *= correction;
        }
        for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
            const int64_t v = block + stride_kv + kv_head * stride_head, v_ahead = ahead + stride_kv + kv_head * stride_head;
            for (int g0 = 0; g0 < group; g0 += chunk_cap) {
                const int gc = group - g0 < chunk_cap ? group - g0 : chunk_cap, head = kv_head * group + g0;
#define VALUE_BLOCK(GC) value_block(cv, v, v_ahead, g0 == 0, num, scores[head], &acc[head], GC, num_vecs, kv_bf16)
                WITH_CHUNK(gc, VALUE_BLOCK)
#undef VALUE_BLOCK
            }
        }
    }
    for (int head = 0; head < num_heads; ++head) {
        const float inv = seq_len > 0 ? 1.0f / run_sum[head] : 0.0f;
        for (int j = 0; j < num_vecs; ++j) store_out16(out, head * stride_out_head + j * LANES, acc[head][j] * inv, kv_bf16);
    }
}

/* Scalar path for any head_dim <= MAX_HEAD_DIM, one sequence, float32 cache only. */
static void attend_scalar(const CacheView *cv, const float *q, int64_t stride_q_head, int num_kv_heads,
                          const int32_t *block_table, int seq_len, float *out, int64_t stride_out_head,
                          int head_dim) {
    const int group = cv->group, block_size = cv->block_size, num_heads = num_kv_heads * group;
    float acc[MAX_HEAD_DIM];
    float scores[MAX_BLOCK_SIZE];
    for (int head = 0; head < num_heads; ++head) {
        float run_max = -FLT_MAX, run_sum = 0.0f;
        const float *qh = q + head * stride_q_head;
        for (int d = 0; d < head_dim; ++d) acc[d] = 0.0f;
        for (int start = 0; start < seq_len; start += block_size) {
            const int num = seq_len - start < block_size ? seq_len - start : block_size;
            const float *keys = (const float *)cv->kv_cache + (int64_t)block_table[start / block_size] * cv->stride_block
                                + (int64_t)(head / group) * cv->stride_head;
            const float *values = keys + cv->stride_kv;
            for (int t = 0; t < num; ++t) {
                const float *k = keys + t * cv->stride_token;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int d = 0; d < head_dim; ++d) sum += qh[d] * k[d];
                scores[t] = sum * cv->scale;
            }
            const float correction = softmax_step(scores, num, &run_max, &run_sum);
            for (int d = 0; d < head_dim; ++d) acc[d] *= correction;
            for (int t = 0; t < num; ++t) {
                const float p = scores[t];
                const float *v = values + t * cv->stride_token;
#pragma omp simd
                for (int d = 0; d < head_dim; ++d) acc[d] += p * v[d];
            }
        }
        const float inv = seq_len > 0 ? 1.0f / run_sum : 0.0f;
        for (int d = 0; d < head_dim; ++d) out[head * stride_out_head + d] = acc[d] * inv;
    }
}

#define ATTEND_VEC(N, BF16, NAME)                                                                      \
    static void NAME(const CacheView *cv, const void *q, int64_t sq, int nkv, const int32_t *bt, int len,  \
                     void *o, int64_t so, int64_t then) {                                                  \
        attend_vec(cv, q, sq, nkv, bt, len, o, so, then, N, BF16);                                         \
    }
ATTEND_VEC(2, 0, attend_vec4)
ATTEND_VEC(4, 0, attend_vec8)
ATTEND_VEC(5, 0, attend_vec10)
ATTEND_VEC(6, 0, attend_vec12)
ATTEND_VEC(8, 0, attend_vec16)
ATTEND_VEC(2, 1, attend_vec4_bf16)
ATTEND_VEC(4, 1, attend_vec8_bf16)
ATTEND_VEC(5, 1, attend_vec10_bf16)
ATTEND_VEC(6, 1, attend_vec12_bf16)
ATTEND_VEC(8, 1, attend_vec16_bf16)

typedef void (*attend_fn)(const CacheView *, const void *, int64_t, int, const int32_t *, int, void *, int64_t, int64_t);

/* The vector copy for head_dim and the cache's type; NULL where there is none (then only a
 * float32 cache has a path: the scalar one). */
static attend_fn vector_path(int head_dim, int kv_bf16) {
    switch (head_dim) {
    case 32: return kv_bf16 ? attend_vec4_bf16 : attend_vec4;
    case 64: return kv_bf16 ? attend_vec8_bf16 : attend_vec8;
    case 80: return kv_bf16 ? attend_vec10_bf16 : attend_vec10;
    case 96: return kv_bf16 ? attend_vec12_bf16 : attend_vec12;
    case 128: return kv_bf16 ? attend_vec16_bf16 : attend_vec16;
    default: return NULL;
    }
}

/* Whether paged_decode_attention has a path for these sizes: within this kernel's limits, and for
 * a bfloat16 cache a head size with a vector path (a float32 cache has the scalar one). */
int paged_decode_attention_takes(int num_heads, int head_dim, int block_size, int kv_bf16) {
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE) return 0;
    return vector_path(head_dim, kv_bf16) != NULL || !kv_bf16;
}

/* query [num_seqs, num_kv_heads * group, head_dim] and out alike (row strides given, unit stride
 * in head_dim), kv_cache too (strides in elements): all float32, or all bfloat16 when kv_bf16
 * (the sums in float32 either way, the output rounded to bfloat16 once, at the end);
 * block_tables int32 [num_seqs, >= blocks needed]; seq_lens int32, a sequence of length 0 getting
 * zeros. The tables and lengths are not checked here: the caller checks them against the cache
 * (kernels/cpu/ops.py: check_bounds). Returns PDS_OK, or PDS_ERR_UNSUPPORTED (nothing read) where
 * paged_decode_attention_takes says no: the caller then takes another path. */
int paged_decode_attention(const void *query, int64_t stride_q_seq, int64_t stride_q_head,
                           const void *kv_cache, int64_t stride_block, int64_t stride_kv,
                           int64_t stride_token, int64_t stride_head,
                           const int32_t *block_tables, int64_t stride_table, const int32_t *seq_lens,
                           void *out, int64_t stride_out_seq, int64_t stride_out_head,
                           int num_seqs, int num_kv_heads, int group, int head_dim, int block_size,
                           float scale, int kv_bf16) {
    if (!paged_decode_attention_takes(num_kv_heads * group, head_dim, block_size, kv_bf16)) return PDS_ERR_UNSUPPORTED;
    const attend_fn vector = vector_path(head_dim, kv_bf16);
    const CacheView cv = {kv_cache, stride_block, stride_kv, stride_token, stride_head, block_size, group, scale};
#pragma omp parallel for schedule(guided)
    for (int s = 0; s < num_seqs; ++s) {
        const size_t elem = kv_bf16 ? 2 : 4;
        const void *q = (const char *)query + s * stride_q_seq * elem;
        void *o = (char *)out + s * stride_out_seq * elem;
        /* The next sequence's first block, prefetched during this one's last (else a sequence's
         * first block is read on demand); mostly this thread's own under the guided schedule. */
        const int64_t then = s + 1 < num_seqs && seq_lens[s + 1] > 0
                                 ? (int64_t)block_tables[(s + 1) * stride_table] * stride_block : -1;
        if (vector != NULL)
            vector(&cv, q, stride_q_head, num_kv_heads, block_tables + s * stride_table, seq_lens[s], o,
                   stride_out_head, then);
        else
            attend_scalar(&cv, (const float *)q, stride_q_head, num_kv_heads, block_tables + s * stride_table, seq_lens[s], (float *)o,
                          stride_out_head, head_dim);
    }
    return 0;
}
