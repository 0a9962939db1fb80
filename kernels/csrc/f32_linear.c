/* float32 projections y = x W^T (+ bias) for decode-sized batches (up to 64 rows) on AVX-512.
 * W is packed once, when the model loads (ProjectionKernels.pack_f32_panels in
 * kernels/cpu/linear.py): panels of 48 outputs, each k rows of 48 floats (W^T's rows cut to the
 * panel, zero-padded past n), so a panel streams front to back. Each thread takes whole panels;
 * each panel runs x 8 rows at a time: 8 x 48 float32 sums in 24 registers, one broadcast of x per
 * row and three loads of W per input. The first 8 rows read the panel from memory, the rest from
 * cache (a panel is k x 192 bytes: 108 KB at k = 576), while they prefetch the next panel into L2
 * (panels.h). Against oneDNN's prepacked linear: benchmarks/kernels.py --cpu.
 *
 * The order of the sums differs from oneDNN's (each output sums its inputs front to back, in
 * chunks), so results differ in the last bits.
 */
#include "pdserve_kernels.h"
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include "panels.h"

/* For tests (on any x86 CPU, with AVX-512 or not): the lines of the next panel that each of
 * num_groups row groups fetches over num_w_rows W rows (first line into first[g], count into
 * count[g]), as the kernels run them. Returns PDS_OK, or PDS_ERR_MEMORY. */
int next_panel_plan(int64_t num_groups, int64_t num_w_rows, int64_t *first, int64_t *count) {
    char *panel = malloc((size_t)(3 * num_w_rows * 64)); /* a panel of num_w_rows 192-byte W rows */
    if (panel == NULL) return PDS_ERR_MEMORY;
    for (int64_t g = 0; g < num_groups; ++g) {
        NextPanel share = next_panel_share(panel, g, num_groups, num_w_rows);
        first[g] = share.groups ? (share.line - panel) / 64 : 0;
        count[g] = 0;
        for (int64_t i = 0; i < num_w_rows && share.groups; ++i) {
            const char *before = share.line;
            next_panel_step(&share);
            count[g] += share.line != before;
        }
    }
    free(panel);
    return 0;
}
#endif

#ifdef __AVX512F__
#include <immintrin.h>

int f32_linear_ready(void) { return 1; }

/* rows (1..8, a constant after inlining) of x against one panel; cols: the panel's real outputs;
 * next: this row group's share of the next panel's prefetches (panels.h).
 * The sums run in chunks of CHUNK inputs, each chunk's added to the running total in sums: a
 * blocked summation, whose rounding error grows with CHUNK + k / CHUNK rather than k (summed
 * front to back in one run, the error was several times F.linear's). */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t x_stride, const float *w,
                                                             int64_t k, const float *bias, float *out,
                                                             int64_t out_stride, int cols, const int rows,
                                                             NextPanel next) {
    __m512 sums[ROWS][3];
    for (int r = 0; r < rows; ++r) sums[r][0] = sums[r][1] = sums[r][2] = _mm512_setzero_ps();
    for (int64_t start = 0; start < k; start += CHUNK) {
        const int64_t end = k - start < CHUNK ? k : start + CHUNK;
        __m512 acc[ROWS][3];
        for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
        for (int64_t i = start; i < end; ++i) {
            if (rows > 1) prefetch_panel_row(w + i * PANEL, 0);
            if (next.groups) next_panel_step(&next);
            const __m512 w0 = _mm512_loadu_ps(w + i * PANEL), w1 = _mm512_loadu_ps(w + i * PANEL + 16),
                         w2 = _mm512_loadu_ps(w + i * PANEL + 32);
            for (int r = 0; r < rows; ++r) {
                const __m512 xv = _mm512_set1_ps(x[r * x_stride + i]);
                acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
            }
        }
        for (int r = 0; r < rows; ++r)
            for (int v = 0; v < 3; ++v) sums[r][v] = _mm512_add_ps(sums[r][v], acc[r][v]);
    }
    for (int v = 0; v < 3 && 16 * v < cols; ++v) {
        const int n = cols - 16 * v < 16 ? cols - 16 * v : 16;
        const __mmask16 mask = (__mmask16)((1u << n) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
        for (int r = 0; r < rows; ++r)
            _mm512_mask_storeu_ps(out + r * out_stride + 16 * v, mask, _mm512_add_ps(sums[r][v], b));
    }
}

/* x: [m, k] float32 rows x_stride apart; packed: W [n, k] as above; bias: n float32 or NULL;
 * out: [m, n] rows out_stride apart. Returns PDS_OK (the signature of amx_linear_bf16's). */
int f32_linear(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed, int64_t n,
               const float *bias, float *out, int64_t out_stride) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) if (panels * m * k > 32768)
    for (int64_t p = 0; p < panels; ++p) {
        const float *w = packed + p * k * PANEL, *b = bias ? bias + p * PANEL : NULL;
        const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
        const float *next = p + 1 < panels ? w + k * PANEL : NULL; /* this thread's next one (static schedule) */
        for (int64_t row = 0; row < m; row += ROWS) {
            const float *xr = x + row * x_stride;
            float *o = out + row * out_stride + p * PANEL;
            const NextPanel share = next_panel_share(next, row / ROWS, (m + ROWS - 1) / ROWS, k);
#define PANEL_ROWS(r) panel_rows(xr, x_stride, w, k, b, o, out_stride, cols, r, share)
            WITH_ROWS(m - row, PANEL_ROWS)
#undef PANEL_ROWS
        }
    }
    return 0;
}

#else
int f32_linear_ready(void) { return 0; }
#endif
