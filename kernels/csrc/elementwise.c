/* Row-wise ops of the model on the CPU, float32 and bfloat16, each one pass over its rows (the
 * torch references make 5-7 passes with temporaries): RMSNorm with the residual add fused in,
 * and SiLU-and-mul. Rows are spread over the process's OpenMP threads (torch's own pool).
 * Built with -ffast-math (vector expf, reassociated sums), linked without it.
 */
#include "pdserve_kernels.h"
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* new_residual = x + residual (when residual is given, else x itself); out = new_residual *
 * rsqrt(mean(new_residual^2) + eps) * weight. Rows are contiguous, row strides given. */
void add_rms_norm_f32(const float *x, int64_t stride_x, const float *residual, int64_t stride_res,
                      const float *weight, float *out, int64_t stride_out, float *new_residual,
                      int64_t stride_new, int64_t num_rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (num_rows * hidden > 8192)
    for (int64_t row = 0; row < num_rows; ++row) {
        const float *xr = x + row * stride_x;
        float *o = out + row * stride_out;
        const float *h = xr;
        if (residual) {
            const float *r = residual + row * stride_res;
            float *n = new_residual + row * stride_new;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) n[i] = xr[i] + r[i];
            h = n;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) sum += h[i] * h[i];
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) o[i] = weight[i] * (h[i] * inv);
    }
}

/* out[row, i] = silu(x[row, i]) * x[row, half + i]. */
void silu_and_mul_f32(const float *x, int64_t stride_x, float *out, int64_t stride_out, int64_t num_rows,
                      int64_t half) {
#pragma omp parallel for schedule(static) if (num_rows * half > 65536)
    for (int64_t row = 0; row < num_rows; ++row) {
        const float *gate = x + row * stride_x, *up = gate + half;
        float *o = out + row * stride_out;
        /* exp's argument is capped below float overflow: -ffast-math assumes no infinities,
         * and gate / (1 + inf) came out NaN (gate = -90). */
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) o[i] = gate[i] / (1.0f + expf(fminf(-gate[i], 80.0f))) * up[i];
    }
}

/* bfloat16 rows: each op's float32 work as above, rounded to bfloat16 (to nearest even) where
 * the torch reference in bfloat16 rounds: the residual sum, the normalized row before the
 * weight, the product with the weight; SiLU, then its product with up. */

/* The rounding loops, each a row at a time: where the CPU has AVX512-BF16 (bf16.h), 16 values
 * per vcvtneps2bf16 (one instruction against f32_to_bf16's ~8 integer ops), the rest (and every
 * value elsewhere) by f32_to_bf16. The float32 arithmetic and its order are the same either way,
 * and so are the bits, NaN and inf included. */

/* n = bf16(a + b) */
static inline void add_row_bf16(uint16_t *n, const uint16_t *a, const uint16_t *b, int64_t len) {
    int64_t start = 0;
#if defined(__AVX512BF16__)
    for (; start + 16 <= len; start += 16)
        bf16x16_store(n + start, _mm512_add_ps(bf16x16_load(a + start), bf16x16_load(b + start)));
#endif
#pragma omp simd
    for (int64_t i = start; i < len; ++i) n[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

/* o = bf16(weight * bf16(h * inv)) */
static inline void normalize_row_bf16(uint16_t *o, const uint16_t *h, const uint16_t *weight, float inv, int64_t len) {
    int64_t start = 0;
#if defined(__AVX512BF16__)
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (; start + 16 <= len; start += 16) {
        const __m512 normed = bf16x16_round(_mm512_mul_ps(bf16x16_load(h + start), inv16));
        bf16x16_store(o + start, _mm512_mul_ps(bf16x16_load(weight + start), normed));
    }
#endif
#pragma omp simd
    for (int64_t i = start; i < len; ++i)
        o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(h[i]) * inv)));
}

/* o = bf16(bf16(silu) * up), silu in float32 */
static inline void mul_rounded_row_bf16(uint16_t *o, const float *silu, const uint16_t *up, int64_t len) {
    int64_t start = 0;
#if defined(__AVX512BF16__)
    for (; start + 16 <= len; start += 16)
        bf16x16_store(o + start, _mm512_mul_ps(bf16x16_round(_mm512_loadu_ps(silu + start)), bf16x16_load(up + start)));
#endif
#pragma omp simd
    for (int64_t i = start; i < len; ++i) o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu[i])) * bf16_to_f32(up[i]));
}

void add_rms_norm_bf16(const uint16_t *x, int64_t stride_x, const uint16_t *residual, int64_t stride_res,
                       const uint16_t *weight, uint16_t *out, int64_t stride_out, uint16_t *new_residual,
                       int64_t stride_new, int64_t num_rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (num_rows * hidden > 8192)
    for (int64_t row = 0; row < num_rows; ++row) {
        const uint16_t *h = x + row * stride_x;
        if (residual) {
            uint16_t *n = new_residual + row * stride_new;
            add_row_bf16(n, h, residual + row * stride_res, hidden);
            h = n;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) sum += bf16_to_f32(h[i]) * bf16_to_f32(h[i]);
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        normalize_row_bf16(out + row * stride_out, h, weight, inv, hidden);
    }
}

enum { SILU_CHUNK = 256 };

/* Each row in float32 chunks: SiLU vectorised as in float32 (the same expf), then the roundings. */
void silu_and_mul_bf16(const uint16_t *x, int64_t stride_x, uint16_t *out, int64_t stride_out, int64_t num_rows,
                       int64_t half) {
#pragma omp parallel for schedule(static) if (num_rows * half > 65536)
    for (int64_t row = 0; row < num_rows; ++row) {
        const uint16_t *gate = x + row * stride_x, *up = gate + half;
        uint16_t *o = out + row * stride_out;
        float silu[SILU_CHUNK];
        for (int64_t start = 0; start < half; start += SILU_CHUNK) {
            const int64_t n = half - start < SILU_CHUNK ? half - start : SILU_CHUNK;
            const uint16_t *g = gate + start;
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) {
                const float v = bf16_to_f32(g[i]);
                silu[i] = v / (1.0f + expf(fminf(-v, 80.0f)));
            }
            mul_rounded_row_bf16(o + start, silu, up + start, n);
        }
    }
}
