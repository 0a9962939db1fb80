/* Greedy LM head for float32 models: each row's argmax of x W^T, the token the full head's
 * logits give, without computing them all. For rows that only need their greedy token (no
 * logprobs, no penalties, no bias, no grammar), two passes:
 *
 * 1. A screen in bfloat16 (vdpbf16ps: two products a lane, twice float32's FMAs): W rounded to
 *    bfloat16 once (wb_v = bf16(w_v), e_v = w_v - wb_v), x per row (xb = bf16(x), d = x - xb),
 *    each logit approximated as a_v = xb . wb_v (float32 sums of exact products). Its error is
 *    bounded from the rounding errors' norms (Cauchy-Schwarz):
 *        |x . w_v - xb . wb_v| <= |xb| |e_v| + |d| |wb_v| + |d| |e_v|
 *    plus the float32 rounding of the screen's sums and of the exact ones (below) and, near zero,
 *    vdpbf16ps's flushing of denormals, each norm rounded up and the bound widened for the
 *    float32 arithmetic that forms it. So every logit
 *    lies in [a_v - b_v, a_v + b_v], and every output whose upper end falls below the largest
 *    lower end (L) cannot be the argmax. bfloat16 keeps 8 bits: b_v is ~0.3% of |x| |w_v|, ~5%
 *    of a logit's spread on random weights, and a row keeps a handful of candidates.
 * 2. The outputs left computed exactly, in the order f32_linear.c sums them (float32 FMAs in
 *    chunks of CHUNK inputs), one candidate per vector lane, so each has the bits that kernel
 *    gives it; the row's token is the first index of their maximum, as argmax_rows takes it.
 *
 * A row whose x holds an inf or NaN, or with over CAP outputs near its maximum (thousands of
 * near-ties, as all-zero weights give), is left to the caller (-1), which computes its logits in
 * full.
 *
 * Packed W (kernels/greedy_head.py): bfloat16 in bf16_linear.c's layout (panels of PANEL outputs,
 * per input pair one 192-byte row of 48 outputs x 2 inputs), and per output |e_v|, |wb_v| and |w_v|.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "bf16.h"
#include "panels.h"

int greedy_head_ready(void) { return 1; }

/* Per-row quantities of x, from x's float values. */
typedef struct {
    float xb_norm;    /* |bf16(x)|, rounded up */
    float d_norm;     /* |x - bf16(x)|, rounded up */
    float x_norm;     /* |x|, rounded up */
    int all;          /* left to the caller (non-finite x or norms) */
} RowInfo;

static inline float up(double v) { return nextafterf((float)v, INFINITY); }

/* NaN and inf tests on the bits, which -ffast-math (no NaN, no inf assumed) cannot fold away. */
static inline uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}
static inline int not_finite(float f) { return (bits_of(f) & 0x7fffffffu) >= 0x7f800000u; }

/* x's row (k floats) -> its bfloat16 copy xb and its RowInfo. */
static void round_row(const float *x, int64_t k, uint16_t *xb, RowInfo *info) {
    memset(info, 0, sizeof *info);
    double bb = 0.0, dd = 0.0, xx = 0.0;
    for (int64_t i = 0; i < k; ++i) {
        if (not_finite(x[i])) {
            info->all = 1;
            return;
        }
        xb[i] = f32_to_bf16(x[i]);
        const double b = bf16_to_f32(xb[i]), d = (double)x[i] - b;
        bb += b * b;
        dd += d * d;
        xx += (double)x[i] * x[i];
    }
    info->xb_norm = up(sqrt(bb) * (1.0 + 1e-12));
    info->d_norm = up(sqrt(dd) * (1.0 + 1e-12));
    info->x_norm = up(sqrt(xx) * (1.0 + 1e-12));
    if (not_finite(info->xb_norm) || not_finite(info->d_norm) || not_finite(info->x_norm)) info->all = 1;
}

/* The screen's per-output data, n floats (ints) each, padded to whole panels. */
typedef struct {
    const float *e_norm;  /* |w_v - bf16(w_v)| */
    const float *wb_norm; /* |bf16(w_v)| */
    const float *w_norm;  /* |w_v| */
} Screen;

/* A thread's candidates of one row: the outputs whose upper end reached the row's largest lower
 * end seen so far (by this thread), with their upper ends, CAP at most. */
enum { CAP = 2048 };
typedef struct {
    int32_t index;
    float upper;
} Candidate;
typedef struct {
    float lower_max;
    int32_t count;
    int32_t overflow;
    Candidate at[CAP];
} Candidates;

/* Drop the candidates whose upper end fell below lower_max. */
static void compact(Candidates *c) {
    int32_t kept = 0;
    for (int32_t j = 0; j < c->count; ++j)
        if (!(c->at[j].upper < c->lower_max)) c->at[kept++] = c->at[j];
    c->count = kept;
}

/* acc[r] += rows (1..8, a constant after inlining) of xb against the panel's k inputs. */
static inline __attribute__((always_inline)) void accumulate(__m512 acc[][3], const uint16_t *xb, int64_t k,
                                                             const uint16_t *w, const int rows) {
    for (int64_t i = 0; i < k; i += 2) {
        const uint16_t *wi = w + i * PANEL;
        if (rows > 1) prefetch_panel_row(wi, rows >= 6);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wi), w1 = (__m512bh)_mm512_loadu_si512(wi + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(wi + 64);
        for (int r = 0; r < rows; ++r) {
            int32_t pair;
            memcpy(&pair, xb + r * k + i, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
        }
    }
}

/* rows (1..8, a constant after inlining) of xb against one panel: each output's bounds [a - b,
 * a + b]; the row's lower_max raised to the largest a - b, and the outputs whose a + b reaches
 * it added to its candidates. */
static inline __attribute__((always_inline)) void screen_rows(const uint16_t *xb, int64_t k, const uint16_t *w,
                                                              const Screen *s, int64_t v0, const RowInfo *info,
                                                              float screen_rel, float exact_rel, Candidates *cands,
                                                              int cols, const int rows) {
    __m512 acc[ROWS][3];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
    if (k <= 0) __builtin_unreachable(); /* else the accumulators go through the stack */
    accumulate(acc, xb, k, w, rows);
    const __m512 widen = _mm512_set1_ps(1.0f + 1.0f / 512.0f), a_slack = _mm512_set1_ps(1.0f / 1048576.0f);
    /* near zero: vdpbf16ps treats denormal inputs and results as zero, and a float32 sum loses up
     * to a denormal step an operation; all of it within 2^-125 (k + 2) (1 + |xb| + |wb|) */
    const float tiny_unit = 0x1p-125f * (float)(k + 2);
    const __m512 tiny_w = _mm512_set1_ps(tiny_unit);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int r = 0; r < rows; ++r) {
        Candidates *c = cands + r;
        if (c->overflow) continue;
        const __m512 xb_n = _mm512_set1_ps(info[r].xb_norm), d_n = _mm512_set1_ps(info[r].d_norm);
        const __m512 screen_n = _mm512_set1_ps(info[r].xb_norm * screen_rel);
        const __m512 exact_n = _mm512_set1_ps(info[r].x_norm * exact_rel);
        const __m512 tiny = _mm512_set1_ps(tiny_unit * (1.0f + info[r].xb_norm));
        __m512 upper[3], lo_max = _mm512_set1_ps(c->lower_max);
        __mmask16 masks[3];
        for (int v = 0; v < 3; ++v) {
            const int n = cols - 16 * v < 0 ? 0 : (cols - 16 * v < 16 ? cols - 16 * v : 16);
            masks[v] = (__mmask16)((1u << n) - 1u);
            const int64_t o = v0 + 16 * v;
            const __m512 a = acc[r][v], e = _mm512_loadu_ps(s->e_norm + o), wb = _mm512_loadu_ps(s->wb_norm + o);
            /* |xb| |e| + |d| (|wb| + |e|) + the screen's and the exact sums' rounding */
            __m512 b = _mm512_mul_ps(xb_n, e);
            b = _mm512_fmadd_ps(d_n, _mm512_add_ps(wb, e), b);
            b = _mm512_fmadd_ps(screen_n, wb, b);
            b = _mm512_fmadd_ps(exact_n, _mm512_loadu_ps(s->w_norm + o), b);
            b = _mm512_fmadd_ps(b, widen, _mm512_fmadd_ps(_mm512_abs_ps(a), a_slack, _mm512_fmadd_ps(tiny_w, wb, tiny)));
            upper[v] = _mm512_add_ps(a, b);
            lo_max = _mm512_mask_max_ps(lo_max, masks[v], lo_max, _mm512_sub_ps(a, b));
        }
        c->lower_max = _mm512_reduce_max_ps(lo_max);
        const __m512 threshold = _mm512_set1_ps(c->lower_max);
        if (c->count + PANEL > CAP) {
            compact(c);
            if (c->count + PANEL > CAP) {
                c->overflow = 1;
                continue;
            }
        }
        for (int v = 0; v < 3; ++v) {
            /* not below the threshold: NaN upper ends (an overflowed bound) stay candidates */
            const __mmask16 keep = masks[v] & ~_mm512_cmp_ps_mask(upper[v], threshold, _CMP_LT_OQ);
            if (!keep) continue;
            int32_t index[16];
            float up_v[16];
            _mm512_mask_compressstoreu_epi32(index, keep, _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)(v0 + 16 * v))));
            _mm512_mask_compressstoreu_ps(up_v, keep, upper[v]);
            for (int j = 0; j < __builtin_popcount(keep); ++j) c->at[c->count + j] = (Candidate){index[j], up_v[j]};
            c->count += __builtin_popcount(keep);
        }
    }
}

/* Exact logits of up to 16 candidates (lanes < count; the rest read output 0), float32: x . w_v
 * summed as f32_linear.c sums it. */
static __m512 exact_f32(const float *x, int64_t k, const float *weight, const int32_t *cand, int count) {
    const __mmask16 live = (__mmask16)(count >= 16 ? 0xffffu : (1u << count) - 1u);
    const __m512i rows = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(live, cand), _mm512_set1_epi32((int32_t)k));
    __m512 sums = _mm512_setzero_ps();
    for (int64_t start = 0; start < k; start += CHUNK) {
        const int64_t end = k - start < CHUNK ? k : start + CHUNK;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = start; i < end; ++i) {
            const __m512 w = _mm512_i32gather_ps(rows, weight + i, 4);
            acc = _mm512_fmadd_ps(_mm512_set1_ps(x[i]), w, acc);
        }
        sums = _mm512_add_ps(sums, acc);
    }
    return sums;
}

static int cmp_int32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* x: [m, k] float32 rows x_stride apart (k even); packed: bf16(W) in panels; e_norm, wb_norm,
 * w_norm: per output, padded to whole panels; weight: W [n, k] float32, contiguous; out: m int64
 * tokens, -1 for a row left to the caller (see above); candidates_out (or NULL): m int64, each
 * row's count of exact logits. Returns 0, or -1 when a buffer could not be allocated. */
int greedy_head(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, const float *e_norm,
                const float *wb_norm, const float *w_norm, const float *weight, int64_t n, int64_t *out,
                int64_t *candidates_out) {
    const Screen screen = {e_norm, wb_norm, w_norm};
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int threads = omp_get_max_threads();
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(m * k));
    RowInfo *info = malloc(sizeof(RowInfo) * (size_t)m);
    Candidates *cands = malloc(sizeof(Candidates) * (size_t)(m * threads));
    if (!xb || !info || !cands) {
        free(xb);
        free(info);
        free(cands);
        return -1;
    }
    /* the float32 sums' rounding, relative to the products' norms: the screen's, k products
     * summed in turn; the exact ones', a blocked sum in chunks of CHUNK */
    const float screen_rel = (float)((k + 4) * 0x1p-23), exact_rel = (float)((CHUNK + k / CHUNK + 4) * 0x1p-23);
#pragma omp parallel
    {
        const int me = omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) round_row(x + r * x_stride, k, xb + r * k, info + r);
        Candidates *mine = cands + (int64_t)me * m;
        for (int64_t r = 0; r < m; ++r) mine[r].lower_max = -INFINITY, mine[r].count = 0, mine[r].overflow = info[r].all;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const uint16_t *w = packed + p * k * PANEL;
            const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
            for (int64_t row = 0; row < m; row += ROWS) {
                const uint16_t *xr = xb + row * k;
#define SCREEN_ROWS(r) screen_rows(xr, k, w, &screen, p * PANEL, info + row, screen_rel, exact_rel, mine + row, cols, r)
                switch (m - row < ROWS ? m - row : ROWS) {
                case 1: SCREEN_ROWS(1); break;
                case 2: SCREEN_ROWS(2); break;
                case 3: SCREEN_ROWS(3); break;
                case 4: SCREEN_ROWS(4); break;
                case 5: SCREEN_ROWS(5); break;
                case 6: SCREEN_ROWS(6); break;
                case 7: SCREEN_ROWS(7); break;
                default: SCREEN_ROWS(8); break;
                }
#undef SCREEN_ROWS
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < m; ++r) {
            float l = -INFINITY;
            int overflow = 0;
            for (int th = 0; th < threads; ++th) {
                overflow |= cands[th * m + r].overflow;
                if (cands[th * m + r].lower_max > l) l = cands[th * m + r].lower_max;
            }
            /* every thread's candidates that reach the row's L, in index order (the first maximum wins) */
            int32_t cand[CAP];
            int64_t count = 0;
            for (int th = 0; th < threads && !overflow && !not_finite(l); ++th) {
                const Candidates *c = cands + th * m + r;
                for (int32_t j = 0; j < c->count; ++j) {
                    if (c->at[j].upper < l) continue;
                    if (count == CAP) {
                        overflow = 1;
                        break;
                    }
                    cand[count++] = c->at[j].index;
                }
            }
            if (overflow || not_finite(l)) {
                out[r] = -1;
                if (candidates_out) candidates_out[r] = n;
                continue;
            }
            qsort(cand, (size_t)count, sizeof cand[0], cmp_int32);
            float best = 0.0f;
            int64_t best_v = -1;
            for (int64_t j = 0; j < count; j += 16) {
                const int lanes = count - j < 16 ? (int)(count - j) : 16;
                float vals[16];
                _mm512_storeu_ps(vals, exact_f32(x + r * x_stride, k, weight, cand + j, lanes));
                for (int l2 = 0; l2 < lanes; ++l2)
                    if (best_v < 0 || vals[l2] > best) best = vals[l2], best_v = cand[j + l2];
            }
            out[r] = best_v;
            if (candidates_out) candidates_out[r] = count;
        }
    }
    free(xb);
    free(info);
    free(cands);
    return 0;
}

#else
int greedy_head_ready(void) { return 0; }
#endif
