/* The gated MLP's first half in float32 on AVX-512 for prefill-sized batches, its activation in
 * the same pass: act = silu(x Wg^T) * (x Wu^T), or the plain projection [gate | up] where a caller
 * wants that (ProjectionKernels.linear on this weight, kernels/cpu/linear.py).
 *
 * W is packed once, when the model loads (ProjectionKernels.pack_f32_gate_up), in panels of 32
 * gate outputs and the same 32 up outputs, each k rows of 64 floats (W^T's rows cut to the panel,
 * zero-padded past inter). Each thread takes a share of the panels; rows run in blocks of MB (x's
 * block stays in L2 while the thread's panels stream past it), 6 rows x 64 outputs at a time: 24
 * sums in registers, one broadcast of x per row and four loads of W per input, the panel read from
 * L2 after the block's first tile, the next panel prefetched into L2 meanwhile, a few lines each
 * tile. The sums run in chunks of CHUNK inputs, each chunk's added to the running total, as in
 * f32_linear.c (blocked summation: its error grows with CHUNK + k / CHUNK rather than k). The gated
 * epilogue computes SiLU as elementwise.c's silu_and_mul_f32 does (the same libmvec expf, the same
 * expression), from sums in registers, so the gate/up product [rows, 2 * inter] is never written.
 *
 * Against oneDNN's prepacked linear then silu_and_mul: benchmarks/kernels.py --cpu. Most of the
 * gain over the bare microkernel comes from the next panel's prefetch and the vector expf. At
 * decode sizes (up to 64 rows) f32_linear.c's kernel is faster and takes them.
 */
#include "pdserve_kernels.h"
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#include <omp.h>

int f32_gate_up_ready(void) { return 1; }

/* libmvec's 16-lane expf: the one GCC calls for elementwise.c's vectorised expf (-ffast-math). */
__m512 _ZGVeN16v_expf(__m512);

enum { HALF = PDS_LIMIT_gate_up_half, PANEL = 2 * HALF, MR = 6, CHUNK = 64, MB = 252 };
/* One line of the next panel every PF_EVERY inputs (prefetcht1), a tile's share of them. */
enum { PF_EVERY = 4 };

/* What the epilogue writes: the gate and up outputs apart (gate at out[:, j], up at
 * out[:, inter + j]), or silu(gate) * up. */
enum { SPLIT = 0, GATED = 1 };

#define INLINE static inline __attribute__((always_inline))

INLINE __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u); }

/* rows (1..MR, a constant after inlining) of x against one panel w; cols: the panel's real
 * outputs in each half (up to 32); out: the panel's first output in the first row; up: SPLIT's
 * up outputs. pf, pf_lines: this tile's share of the next panel's lines. */
INLINE void tile(const float *x, int64_t x_stride, const float *w, int64_t k, float *out,
                 float *up, int64_t out_stride, int cols, const int rows, const int mode, const char *pf,
                 int64_t pf_lines) {
    float sums[MR][PANEL] __attribute__((aligned(64)));
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < 4; ++v) _mm512_store_ps(sums[r] + 16 * v, _mm512_setzero_ps());
    for (int64_t start = 0; start < k; start += CHUNK) {
        const int64_t end = k - start < CHUNK ? k : start + CHUNK;
        __m512 acc[MR][4];
        for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
        for (int64_t i = start; i < end; ++i) {
            if (pf_lines > 0 && i % PF_EVERY == 0) {
                _mm_prefetch(pf, _MM_HINT_T1);
                pf += 64;
                --pf_lines;
            }
            const float *wi = w + i * PANEL;
            const __m512 w0 = _mm512_loadu_ps(wi), w1 = _mm512_loadu_ps(wi + 16), w2 = _mm512_loadu_ps(wi + 32),
                         w3 = _mm512_loadu_ps(wi + 48);
            for (int r = 0; r < rows; ++r) {
                const __m512 xv = _mm512_set1_ps(x[r * x_stride + i]);
                acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
            }
        }
        for (int r = 0; r < rows; ++r)
            for (int v = 0; v < 4; ++v)
                _mm512_store_ps(sums[r] + 16 * v, _mm512_add_ps(_mm512_load_ps(sums[r] + 16 * v), acc[r][v]));
    }
    for (int r = 0; r < rows; ++r) {
        float *o = out + r * out_stride;
        if (mode == SPLIT) {
            for (int v = 0; v < 2 && 16 * v < cols; ++v) {
                const __mmask16 m = lanes(cols - 16 * v);
                _mm512_mask_storeu_ps(o + 16 * v, m, _mm512_load_ps(sums[r] + 16 * v));
                _mm512_mask_storeu_ps(up + r * out_stride + 16 * v, m, _mm512_load_ps(sums[r] + HALF + 16 * v));
            }
        } else {
            for (int v = 0; v < 2 && 16 * v < cols; ++v) {
                const __m512 g = _mm512_load_ps(sums[r] + 16 * v), u = _mm512_load_ps(sums[r] + HALF + 16 * v);
                /* silu_and_mul_f32's g / (1 + expf(fminf(-g, 80))) * u; the cap keeps expf finite */
                const __m512 e = _ZGVeN16v_expf(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g),
                                                              _mm512_set1_ps(80.0f)));
                const __m512 y = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
                _mm512_mask_storeu_ps(o + 16 * v, lanes(cols - 16 * v), y);
            }
        }
    }
}

INLINE void run(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed, int64_t inter,
                float *out, int64_t out_stride, const int mode) {
    const int64_t panels = (inter + HALF - 1) / HALF;
#pragma omp parallel if (panels * m * k > 65536)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t first = panels * t / threads, last = panels * (t + 1) / threads;
        const int64_t lines = k * PANEL * 4 / 64; /* a panel's cache lines */
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int64_t m1 = m - m0 < MB ? m : m0 + MB, tiles = (m1 - m0 + MR - 1) / MR;
            const int64_t share = (lines + tiles - 1) / tiles;
            for (int64_t p = first; p < last; ++p) {
                const float *w = packed + p * k * PANEL;
                const int cols = inter - p * HALF < HALF ? (int)(inter - p * HALF) : HALF;
                for (int64_t row = m0, i = 0; row < m1; row += MR, ++i) {
                    const char *pf = (const char *)(w + k * PANEL) + i * share * 64;
                    const int64_t left = lines - i * share;
                    const int64_t pf_lines = p + 1 < last && left > 0 ? (left < share ? left : share) : 0;
                    const float *xr = x + row * x_stride;
                    float *o = out + row * out_stride + p * HALF;
                    float *u = mode == SPLIT ? o + inter : 0;
#define TILE(r) tile(xr, x_stride, w, k, o, u, out_stride, cols, r, mode, pf, pf_lines)
                    switch (m1 - row < MR ? m1 - row : MR) {
                    case 1: TILE(1); break;
                    case 2: TILE(2); break;
                    case 3: TILE(3); break;
                    case 4: TILE(4); break;
                    case 5: TILE(5); break;
                    default: TILE(6); break;
                    }
#undef TILE
                }
            }
        }
    }
}

/* x: [m, k] float32 rows x_stride apart; packed: gate [inter, k] and up [inter, k] as above.
 * gated != 0: out [m, inter] = silu(gate) * up; 0: out [m, 2 * inter] = gate then up (the plain
 * projection of the two stacked). Rows out_stride apart. Returns PDS_OK. */
int f32_gate_up(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *packed, int64_t inter,
                int gated, float *out, int64_t out_stride) {
    if (gated)
        run(x, x_stride, m, k, packed, inter, out, out_stride, GATED);
    else
        run(x, x_stride, m, k, packed, inter, out, out_stride, SPLIT);
    return 0;
}

#else
int f32_gate_up_ready(void) { return 0; }
#endif
