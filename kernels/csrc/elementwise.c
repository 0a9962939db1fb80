/* Row-wise float32 ops of the model on the CPU, each one pass over its rows (the torch
 * references make 5-7 passes with temporaries): RMSNorm with the residual add fused in, and
 * SiLU-and-mul. Rows are spread over the process's OpenMP threads (torch's own pool).
 * Built with -ffast-math (vector expf, reassociated sums), linked without it.
 */
#include <math.h>
#include <stdint.h>

/* new_residual = x + residual (when residual is given, else x itself); out = new_residual *
 * rsqrt(mean(new_residual^2) + eps) * weight. Rows are contiguous, row strides given. */
void add_rms_norm_f32(const float *x, int64_t stride_x, const float *residual, int64_t stride_res,
                      const float *weight, float *out, int64_t stride_out, float *new_residual,
                      int64_t stride_new, int64_t num_rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (num_rows * hidden > 65536)
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
