/* Paged decode attention on the CPU, float32: one query token per sequence attends to the
 * first seq_len tokens of its block table, read in place from the block-major cache (no gather).
 *
 * One task per (sequence, KV head): the task's `group` query heads walk the sequence's blocks
 * once, with an online softmax (running max and sum, rescaled accumulator) in float32. Tasks
 * are spread over the process's OpenMP threads (torch's own pool: the same libgomp.so.1).
 * Built with -ffast-math for vector expf and reassociated sums, linked without it so that
 * loading the library leaves the process's denormal handling alone.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

enum { MAX_GROUP = 64, MAX_HEAD_DIM = 256, MAX_BLOCK_SIZE = 256 };

typedef struct {
    const float *kv_cache;
    int64_t stride_block, stride_kv, stride_token, stride_head;
    int block_size, group;
    float scale;
} CacheView;

/* Scores of one query row against num keys (rows stride apart), four keys at a time so the
 * four dot products' additions overlap. */
static inline __attribute__((always_inline)) void
score_keys(const float *q, const float *keys, int64_t stride, int num, int head_dim, float scale, float *scores) {
    int t = 0;
    for (; t + 4 <= num; t += 4) {
        const float *k0 = keys + t * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int d = 0; d < head_dim; ++d) {
            s0 += q[d] * k0[d];
            s1 += q[d] * k1[d];
            s2 += q[d] * k2[d];
            s3 += q[d] * k3[d];
        }
        scores[t] = s0 * scale;
        scores[t + 1] = s1 * scale;
        scores[t + 2] = s2 * scale;
        scores[t + 3] = s3 * scale;
    }
    for (; t < num; ++t) {
        const float *k = keys + t * stride;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int d = 0; d < head_dim; ++d) s += q[d] * k[d];
        scores[t] = s * scale;
    }
}

static inline __attribute__((always_inline)) void
attend_one(const CacheView *cv, const float *q, int64_t stride_q_head, int kv_head, const int32_t *block_table,
           int seq_len, float *out, int64_t stride_out_head, const int head_dim) {
    const int group = cv->group, block_size = cv->block_size;
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    float scores[MAX_BLOCK_SIZE];
    for (int g = 0; g < group; ++g) {
        run_max[g] = -FLT_MAX;
        run_sum[g] = 0.0f;
        for (int d = 0; d < head_dim; ++d) acc[g][d] = 0.0f;
    }
    for (int start = 0; start < seq_len; start += block_size) {
        const int num = seq_len - start < block_size ? seq_len - start : block_size;
        const float *keys = cv->kv_cache + (int64_t)block_table[start / block_size] * cv->stride_block
                            + (int64_t)kv_head * cv->stride_head;
        const float *values = keys + cv->stride_kv;
        for (int g = 0; g < group; ++g) {
            score_keys(q + g * stride_q_head, keys, cv->stride_token, num, head_dim, cv->scale, scores);
            float block_max = -FLT_MAX;
            for (int t = 0; t < num; ++t) block_max = scores[t] > block_max ? scores[t] : block_max;
            const float new_max = block_max > run_max[g] ? block_max : run_max[g];
            const float correction = expf(run_max[g] - new_max);
            float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
            for (int t = 0; t < num; ++t) {
                scores[t] = expf(scores[t] - new_max);
                block_sum += scores[t];
            }
            run_sum[g] = run_sum[g] * correction + block_sum;
            run_max[g] = new_max;
            float *ag = acc[g];
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) ag[d] *= correction;
            for (int t = 0; t < num; ++t) {
                const float p = scores[t];
                const float *v = values + t * cv->stride_token;
#pragma omp simd
                for (int d = 0; d < head_dim; ++d) ag[d] += p * v[d];
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        float *og = out + g * stride_out_head;
        const float inv = seq_len > 0 ? 1.0f / run_sum[g] : 0.0f;
        for (int d = 0; d < head_dim; ++d) og[d] = acc[g][d] * inv;
    }
}

/* Specialized copies for the common head sizes: the compiler unrolls their inner loops. */
static void attend_64(const CacheView *cv, const float *q, int64_t sq, int h, const int32_t *bt, int len, float *o,
                      int64_t so) { attend_one(cv, q, sq, h, bt, len, o, so, 64); }
static void attend_128(const CacheView *cv, const float *q, int64_t sq, int h, const int32_t *bt, int len, float *o,
                       int64_t so) { attend_one(cv, q, sq, h, bt, len, o, so, 128); }
static void attend_any(const CacheView *cv, const float *q, int64_t sq, int h, const int32_t *bt, int len, float *o,
                       int64_t so, int head_dim) { attend_one(cv, q, sq, h, bt, len, o, so, head_dim); }

/* query [num_seqs, num_kv_heads * group, head_dim] and out alike (row strides given, unit
 * stride in head_dim); cache strides in elements; block_tables int32 [num_seqs, >= blocks
 * needed]; seq_lens int32. Returns 0, or -1 when a size is beyond this kernel's limits (the
 * caller then takes another path); a sequence of length 0 gets zeros. */
int paged_decode_attention_f32(const float *query, int64_t stride_q_seq, int64_t stride_q_head,
                               const float *kv_cache, int64_t stride_block, int64_t stride_kv,
                               int64_t stride_token, int64_t stride_head,
                               const int32_t *block_tables, int64_t stride_table, const int32_t *seq_lens,
                               float *out, int64_t stride_out_seq, int64_t stride_out_head,
                               int num_seqs, int num_kv_heads, int group, int head_dim, int block_size,
                               float scale) {
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE) return -1;
    const CacheView cv = {kv_cache, stride_block, stride_kv, stride_token, stride_head, block_size, group, scale};
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int s = 0; s < num_seqs; ++s) {
        for (int h = 0; h < num_kv_heads; ++h) {
            const float *q = query + s * stride_q_seq + (int64_t)h * group * stride_q_head;
            float *o = out + s * stride_out_seq + (int64_t)h * group * stride_out_head;
            const int32_t *bt = block_tables + s * stride_table;
            if (head_dim == 64) attend_64(&cv, q, stride_q_head, h, bt, seq_lens[s], o, stride_out_head);
            else if (head_dim == 128) attend_128(&cv, q, stride_q_head, h, bt, seq_lens[s], o, stride_out_head);
            else attend_any(&cv, q, stride_q_head, h, bt, seq_lens[s], o, stride_out_head, head_dim);
        }
    }
    return 0;
}
