/* Row-wise ops of the model on the CPU, float32 and bfloat16, each one pass over its rows (the
 * torch references make 5-7 passes with temporaries): RMSNorm with the residual add fused in,
 * and SiLU-and-mul. Rows are spread over the process's OpenMP threads (torch's own pool).
 * Built with -ffast-math (vector expf, reassociated sums), linked without it.
 */
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
         * and gate / (1 + inf) came out NaN (measured, gate = -90). */
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) o[i] = gate[i] / (1.0f + expf(fminf(-gate[i], 80.0f))) * up[i];
    }
}

/* bfloat16 rows: each op's float32 work as above, rounded to bfloat16 (to nearest even) where
 * the torch reference in bfloat16 rounds: the residual sum, the normalized row before the
 * weight, the product with the weight; SiLU, then its product with up. */

void add_rms_norm_bf16(const uint16_t *x, int64_t stride_x, const uint16_t *residual, int64_t stride_res,
                       const uint16_t *weight, uint16_t *out, int64_t stride_out, uint16_t *new_residual,
                       int64_t stride_new, int64_t num_rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (num_rows * hidden > 8192)
    for (int64_t row = 0; row < num_rows; ++row) {
        const uint16_t *xr = x + row * stride_x;
        uint16_t *o = out + row * stride_out;
        const uint16_t *h = xr;
        if (residual) {
            const uint16_t *r = residual + row * stride_res;
            uint16_t *n = new_residual + row * stride_new;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) n[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(r[i]));
            h = n;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) sum += bf16_to_f32(h[i]) * bf16_to_f32(h[i]);
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i)
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(h[i]) * inv)));
    }
}

void silu_and_mul_bf16(const uint16_t *x, int64_t stride_x, uint16_t *out, int64_t stride_out, int64_t num_rows,
                       int64_t half) {
#pragma omp parallel for schedule(static) if (num_rows * half > 65536)
    for (int64_t row = 0; row < num_rows; ++row) {
        const uint16_t *gate = x + row * stride_x, *up = gate + half;
        uint16_t *o = out + row * stride_out;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float g = bf16_to_f32(gate[i]);
            const float silu = bf16_to_f32(f32_to_bf16(g / (1.0f + expf(fminf(-g, 80.0f)))));
            o[i] = f32_to_bf16(silu * bf16_to_f32(up[i]));
        }
    }
}
