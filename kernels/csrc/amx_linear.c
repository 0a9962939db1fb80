/* bfloat16 projections y = x W^T (+ bias) on AMX, for decode-sized batches on the CPUs that have
 * it (Sapphire Rapids and later Xeons). W is packed once, when the model loads, into the layout
 * AMX's B operand reads (ProjectionKernels.pack_for_amx in kernels/cpu/linear.py): per pair of
 * 16-output tiles and per 32 inputs, the two tiles' 16 rows of (16 outputs x 2 consecutive
 * inputs), 2 KB. A thread's pairs follow each other, so each thread streams its share of W once,
 * front to back.
 *
 * Each thread takes pairs of output tiles and runs every 32 rows of x against them: 2 x 2 tiles of
 * float32 sums, fed by two 16-row tiles of x and the pair's two weight tiles (all 8 of AMX's tile
 * registers); from x's 33rd row on, the pair's weights come again from cache. The sums are rounded
 * to bfloat16 (nearest even) after the bias is added in float32.
 *
 * Against oneDNN's prepacked linear: benchmarks/kernels.py --cpu (it also drops oneDNN's fixed cost
 * per call). No software prefetch: the hardware's own ran faster. Prefill batches stay on oneDNN:
 * once x no longer fits in L2 it is read again for every pair, and this kernel falls to about half
 * oneDNN's rate.
 *
 * Built without AMX (another CPU), the library exports amx_linear_ready returning 0 and the
 * Python side keeps oneDNN.
 */
#define _DEFAULT_SOURCE /* syscall() in amx.h */
#include "pdserve_kernels.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"

#ifdef PDSERVE_HAVE_AMX
#define TILE_ELEMS 512 /* bfloat16 per weight tile: 16 rows of 32 */

int amx_linear_ready(void) { return amx_request(); }

/* Rows [row, row + rows) of the sums in sums (16 x 16 float32), plus bias, to bfloat16 columns
 * [col, col + cols) of out. */
static void store_tile(const float *sums, int64_t rows, int64_t cols, const float *bias, uint16_t *out,
                       int64_t out_stride) {
    const __mmask16 mask = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(sums + r * 16), b);
        _mm256_mask_storeu_epi16(out + r * out_stride, mask, bf16x16_narrow(v));
    }
}

/* Where x's 16-row tile `tile` starts and its row stride in bytes: in x itself, or (a last tile
 * short of 16 rows) in tail, a zero-padded copy k wide. */
static const uint16_t *row_tile(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int64_t tile,
                                const uint16_t *tail, int64_t *stride_bytes) {
    if ((tile + 1) * 16 <= m) {
        *stride_bytes = x_stride * 2;
        return x + tile * 16 * x_stride;
    }
    *stride_bytes = k * 2;
    return tail;
}

/* One pair of 16-column tiles of W against all of x, 32 rows at a time. w holds the pair's tiles
 * input tile by input tile (2 KB each). */
static void column_pair(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *tail,
                        const uint16_t *w, int64_t n, int64_t col, const float *bias, uint16_t *out,
                        int64_t out_stride, float *sums) {
    const int64_t k_tiles = k / 32, m_tiles = (m + 15) / 16;
    for (int64_t g = 0; g < m_tiles; g += 2) {
        int64_t s0, s1 = 0;
        const uint16_t *a0 = row_tile(x, x_stride, m, k, g, tail, &s0);
        const int has_a1 = g + 1 < m_tiles;
        const uint16_t *a1 = has_a1 ? row_tile(x, x_stride, m, k, g + 1, tail, &s1) : NULL;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kt = 0; kt < k_tiles; ++kt) {
            const uint16_t *wk = w + kt * 2 * TILE_ELEMS;
            _tile_loadd(4, a0 + kt * 32, s0);
            _tile_loadd(6, wk, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, wk + TILE_ELEMS, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (has_a1) {
                _tile_loadd(5, a1 + kt * 32, s1);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, sums, 64);
        _tile_stored(1, sums + 256, 64);
        _tile_stored(2, sums + 512, 64);
        _tile_stored(3, sums + 768, 64);
        for (int64_t i = 0; i < 2 && g + i < m_tiles; ++i) {
            const int64_t row = (g + i) * 16, rows = m - row < 16 ? m - row : 16;
            for (int64_t t = 0; t < 2 && col + 16 * t < n; ++t) {
                const int64_t c = col + 16 * t, cols = n - c < 16 ? n - c : 16;
                store_tile(sums + (2 * i + t) * 256, rows, cols, bias ? bias + c : NULL, out + row * out_stride + c,
                           out_stride);
            }
        }
    }
}

/* x: [m, k] bfloat16 rows x_stride apart (k a multiple of 32); packed: W [n, k] packed as above
 * (n rounded up to 32 with zero columns); bias: n float32 or NULL; out: [m, n] rows out_stride
 * apart. Returns PDS_OK, or PDS_ERR_MEMORY (nothing written). */
int amx_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                    const float *bias, uint16_t *out, int64_t out_stride) {
    const int64_t pairs = (n + 31) / 32, k_tiles = k / 32, tail_rows = m % 16;
    /* x's last rows when they fill no whole tile, zero-padded to one: shared, read-only */
    uint16_t *tail = NULL;
    if (tail_rows) {
        tail = aligned_alloc(64, (size_t)(16 * k * 2));
        if (!tail) return PDS_ERR_MEMORY;
        memset(tail, 0, (size_t)(16 * k * 2));
        for (int64_t r = 0; r < tail_rows; ++r)
            memcpy(tail + r * k, x + (m - tail_rows + r) * x_stride, (size_t)(k * 2));
    }
#pragma omp parallel
    {
        float sums[4 * 256] __attribute__((aligned(64)));
        amx_configure_tiles();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; ++p)
            column_pair(x, x_stride, m, k, tail, packed + p * k_tiles * 2 * TILE_ELEMS, n, 32 * p, bias, out,
                        out_stride, sums);
        _tile_release();
    }
    free(tail);
    return 0;
}

#else
int amx_linear_ready(void) { return 0; }
#endif
