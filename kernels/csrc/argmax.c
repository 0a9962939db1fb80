/* Row-wise argmax of float32 or bfloat16 rows (greedy sampling over the vocabulary), with
 * torch.argmax's answer: the first index of the row's maximum, or the first NaN's index when the
 * row has a NaN. Two passes per row, a vectorised max (plus a NaN test on the bits, which
 * -ffast-math cannot fold away) then a scan for the first element equal to it, with the row in L2
 * between them: faster than torch's argmax, which carries an index per element. Rows are spread
 * over the process's OpenMP threads (torch's pool). A bfloat16 row is widened as it is read
 * (exact, so the answer is that of its float32 copy): the model needs no float32 copy of its logits.
 */
#include "pdserve_kernels.h"
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static int64_t row_argmax(const float *x, int64_t cols) {
    float best = x[0];
    uint32_t nan_seen = 0;
#pragma omp simd reduction(max : best) reduction(| : nan_seen)
    for (int64_t i = 0; i < cols; ++i) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        nan_seen |= (uint32_t)((bits & 0x7fffffffu) > 0x7f800000u);
        best = x[i] > best ? x[i] : best;
    }
    if (nan_seen) {
        for (int64_t i = 0; i < cols; ++i) {
            uint32_t bits;
            memcpy(&bits, &x[i], sizeof bits);
            if ((bits & 0x7fffffffu) > 0x7f800000u) return i;
        }
    }
    for (int64_t i = 0; i < cols; ++i)
        if (x[i] == best) return i;
    return 0;
}

void argmax_rows_f32(const float *x, int64_t stride, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * stride, cols);
}

static int64_t row_argmax_bf16(const uint16_t *x, int64_t cols) {
    float best = bf16_to_f32(x[0]);
    uint32_t nan_seen = 0;
#pragma omp simd reduction(max : best) reduction(| : nan_seen)
    for (int64_t i = 0; i < cols; ++i) {
        nan_seen |= (uint32_t)((x[i] & 0x7fffu) > 0x7f80u);
        const float v = bf16_to_f32(x[i]);
        best = v > best ? v : best;
    }
    if (nan_seen) {
        for (int64_t i = 0; i < cols; ++i)
            if ((x[i] & 0x7fffu) > 0x7f80u) return i;
    }
    for (int64_t i = 0; i < cols; ++i)
        if (bf16_to_f32(x[i]) == best) return i;
    return 0;
}

void argmax_rows_bf16(const uint16_t *x, int64_t stride, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax_bf16(x + r * stride, cols);
}
