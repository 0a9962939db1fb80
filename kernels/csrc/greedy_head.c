/* Greedy LM head: each row's argmax of x W^T, the token the full head's logits give, without
 * computing them all, for float32 and bfloat16 heads. For rows that only need their greedy token
 * (no logprobs, no penalties, no bias, no grammar), two passes:
 *
 * 1. A screen in int8 (vpdpbusd: four products a lane per instruction, twice vdpbf16ps's and
 *    four times a float32 FMA's), with error bounds:
 *    - W per output v: scale s_v = max |w_v| / 127, q_v = round(w_v / s_v), e_v = w_v - s_v q_v.
 *    - x per row, but for UPAIRS input pairs the call picks (trained models' final hidden states
 *      have a few channels at 10-20x the rest, which would set the int8 step for all; see
 *      pick_pairs): x_rest (x with those pairs zeroed) as s_x qx + dx the same way, qx + 128 in
 *      unsigned bytes.
 *    - a_v = s_x s_v (qx . q_v) (integer sums, exact) + x_U . w_v (the picked pairs in the head's
 *      own dtype: vdpbf16ps on bfloat16 weights, FMAs on float32 ones), and (Cauchy-Schwarz)
 *          |x . w_v - a_v| <= s_x |qx| |e_v| + |dx| |w_v| + the float32 roundings of a_v,
 *      plus the rounding of the exact sums (below) and, near zero, the denormals vdpbf16ps
 *      flushes, each norm rounded up and the bound widened for the float32 arithmetic that forms
 *      it. So every logit lies in [a_v - b_v, a_v + b_v], and an output whose upper end falls
 *      below the largest lower end (L) cannot be the argmax; for bfloat16 heads, whose logits are
 *      compared after their rounding to bfloat16, below the lowest value that rounds to L's
 *      bfloat16 value (threshold_of). Random heads and SmolLM2-135M's keep ~15-20 outputs a row.
 * 2. The outputs left computed exactly as the head's own kernel computes them, one candidate per
 *    vector lane, gathered from W's rows: float32, f32_linear.c's FMAs in chunks of CHUNK inputs;
 *    bfloat16, bf16_linear.c's vdpbf16ps over input pairs in chunks of `chunk` inputs (its
 *    small-batch CHUNK or its blocked path's step), rounded to bfloat16. The row's token is the
 *    first index of their maximum, as argmax_rows takes it: bit for bit that kernel's argmax.
 *
 * A row whose x holds an inf or NaN, with over CAP outputs near its maximum (thousands of
 * near-ties, as all-zero weights give), or whose candidates' logits hold a NaN is left to the
 * caller (-1), which computes its logits in full.
 *
 * Packed W (kernels/cpu/greedy_head.py: prepare_greedy_head, pack_int8_quads): q in panels of
 * PANEL outputs, per 4 inputs one 192-byte row of 48 outputs x 4 bytes (inputs padded with zeros
 * to whole quads); per output s_v, sum_i q_vi, |e_v| and |w_v|; the head's own panels
 * (ProjectionKernels.pack_bf16_pairs or pack_f32_panels), for the picked pairs; W itself for the
 * exact logits. Against the logits and their argmax: benchmarks/kernels.py --cpu.
 */
#include "pdserve_kernels.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include <omp.h>

#include "bf16.h"
#include "panels.h"

int greedy_head_ready(void) { return 1; }

static inline float up(double v) { return nextafterf((float)v, INFINITY); }

/* NaN and inf tests on the bits, which -ffast-math (no NaN, no inf assumed) cannot fold away. */
static inline uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}
static inline int not_finite(float f) { return (bits_of(f) & 0x7fffffffu) >= 0x7f800000u; }

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

static int cmp_int32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The least upper end an output needs to stay a candidate against a largest lower end l: l itself
 * where the logits are compared as float32; where they are rounded to bfloat16 first (bf16_out),
 * far enough below l that no value under it rounds to l's bfloat16 value or above (each rounding
 * moves a value by at most 2^-8 of it, or 2^-126 where it flushes to zero). Monotone in l. */
static inline float threshold_of(float l, int bf16_out) {
    return bf16_out ? l - (fabsf(l) * (0x1p-7f + 0x1p-13f) + 0x1p-124f) : l;
}

/* Drop the candidates whose upper end fell below threshold. */
static void compact(Candidates *c, float threshold) {
    int32_t kept = 0;
    for (int32_t j = 0; j < c->count; ++j)
        if (!(c->at[j].upper < threshold)) c->at[kept++] = c->at[j];
    c->count = kept;
}

/* The first n lanes of 16 (none for n <= 0). */
static inline __mmask16 lanes_below(int64_t n) {
    return n >= 16 ? (__mmask16)0xffffu : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* Each of a panel's three vectors of 16 outputs: the lanes of its cols real outputs. */
static inline void panel_masks(int cols, __mmask16 masks[3]) {
    for (int v = 0; v < 3; ++v) masks[v] = lanes_below(cols - 16 * v);
}

/* A panel's outputs (v0 on, three vectors of 16, masks their real ones) with their upper ends, to
 * a row's candidates: those not below threshold (NaN upper ends, an overflowed bound, stay). */
static inline void push_candidates(Candidates *c, const __m512 upper[3], const __mmask16 masks[3], float threshold,
                                   int64_t v0) {
    if (c->count + PANEL > CAP) {
        compact(c, threshold);
        if (c->count + PANEL > CAP) {
            c->overflow = 1;
            return;
        }
    }
    const __m512 t = _mm512_set1_ps(threshold);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int v = 0; v < 3; ++v) {
        const __mmask16 keep = masks[v] & ~_mm512_cmp_ps_mask(upper[v], t, _CMP_LT_OQ);
        if (!keep) continue;
        int32_t index[16];
        float up_v[16];
        _mm512_mask_compressstoreu_epi32(index, keep, _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)(v0 + 16 * v))));
        _mm512_mask_compressstoreu_ps(up_v, keep, upper[v]);
        for (int j = 0; j < __builtin_popcount(keep); ++j) c->at[c->count + j] = (Candidate){index[j], up_v[j]};
        c->count += __builtin_popcount(keep);
    }
}

/* Row r's candidates over every thread's (cands: threads x m), in index order (the first maximum
 * wins), into cand (CAP); returns their count, or -1 when the row is left to the caller (a thread
 * overflowed, too many candidates, or a non-finite largest lower end). */
static int64_t gather_row(const Candidates *cands, int threads, int64_t m, int64_t r, int bf16_out, int32_t *cand) {
    float l = -INFINITY;
    for (int th = 0; th < threads; ++th) {
        if (cands[th * m + r].overflow) return -1;
        if (cands[th * m + r].lower_max > l) l = cands[th * m + r].lower_max;
    }
    if (not_finite(l)) return -1;
    const float t = threshold_of(l, bf16_out);
    int64_t count = 0;
    for (int th = 0; th < threads; ++th) {
        const Candidates *c = cands + th * m + r;
        for (int32_t j = 0; j < c->count; ++j) {
            if (c->at[j].upper < t) continue;
            if (count == CAP) return -1;
            cand[count++] = c->at[j].index;
        }
    }
    qsort(cand, (size_t)count, sizeof cand[0], cmp_int32);
    return count;
}

/* Exact logits of up to 16 candidates (lanes < count; the rest read output 0), float32: x . w_v
 * summed as f32_linear.c sums it. */
static __m512 exact_f32(const float *x, int64_t k, const float *weight, const int32_t *cand, int count) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(lanes_below(count), cand), _mm512_set1_epi32((int32_t)k));
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

enum { UPAIRS = 8 };

/* acc + each lane's four products of u8's unsigned bytes and s8's signed ones (vpdpbusd). In
 * assembly: GCC 12 keeps a copy of each accumulator of the intrinsic in memory, a store per
 * instruction, which ran the screen at a third of the instruction's rate. */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
    return acc;
}

typedef struct {
    float sx;       /* x_rest's int8 step */
    float qx_norm;  /* |qx|, rounded up */
    float dx_norm;  /* |x_rest - sx qx|, rounded up */
    float x_norm;   /* |x|, rounded up */
    float u_norm;   /* |x_U|, rounded up */
    int all;        /* left to the caller */
} RowInfo;

typedef struct {
    const float *scale;    /* s_v */
    const int32_t *qsum;   /* sum_i q_vi */
    const float *e_norm;   /* |w_v - s_v q_v| */
    const float *w_norm;   /* |w_v| */
} Screen;

/* Row r of x (rows stride elements apart), bfloat16 or (f32, a constant after inlining) float32. */
static inline const void *x_row(const void *x, int64_t r, int64_t stride, const int f32) {
    return (const char *)x + r * stride * (f32 ? sizeof(float) : sizeof(uint16_t));
}

/* 16 values of x from index i (n_mask of them), bfloat16 or (f32, a constant after inlining)
 * float32, as float32. */
static inline __attribute__((always_inline)) __m512 load_x(const void *x, int64_t i, __mmask16 n_mask, const int f32) {
    return f32 ? _mm512_maskz_loadu_ps(n_mask, (const float *)x + i) : bf16x16_maskz_load(n_mask, (const uint16_t *)x + i);
}

/* The lanes of v that hold an inf or a NaN (on the bits: -ffast-math assumes there are none). */
static inline __mmask16 non_finite_lanes(__m512 v) {
    return _mm512_cmpge_epu32_mask(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)),
                                   _mm512_set1_epi32(0x7f800000));
}

/* Sum of squares of v's 16 lanes, added to acc in float64 (two halves). */
static inline __m512d add_squares(__m512d acc, __m512 v) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v)), hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
    return _mm512_fmadd_pd(hi, hi, _mm512_fmadd_pd(lo, lo, acc));
}

/* The call's UPAIRS pairs (fewer where k / 2 is smaller), one at a time: each row votes for the
 * pair of its largest |x| (relative to its RMS) among the pairs not yet taken, with that value,
 * and the pair with the most votes is taken; so the picks cover the largest values of as many rows
 * as they can (a row's int8 step is its largest value left). Rows with a non-finite x vote for
 * nothing (they are left to the caller). rest: k floats, 0 at the picked pairs' inputs and 1
 * elsewhere. Returns the count, or -1 when a buffer could not be allocated. */
static inline __attribute__((always_inline)) int pick_pairs(const void *x, int64_t x_stride, int64_t m, int64_t k,
                                                            int32_t *pairs, float *rest, const int f32) {
    const int64_t num_pairs = k / 2;
    const int count = num_pairs < UPAIRS ? (int)num_pairs : UPAIRS;
    const int64_t padded = (k + 15) / 16 * 16;
    float *scaled = malloc(sizeof(float) * (size_t)(m * padded)), *votes = malloc(sizeof(float) * (size_t)num_pairs);
    if (!scaled || !votes) {
        free(scaled);
        free(votes);
        return -1;
    }
    int64_t voters = 0; /* rows with a finite, nonzero x, in scaled's first rows */
    for (int64_t r = 0; r < m; ++r) {
        const void *xr = x_row(x, r, x_stride, f32);
        __m512 ss = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (int64_t i = 0; i < k; i += 16) {
            const __m512 v = load_x(xr, i, lanes_below(k - i), f32);
            bad |= non_finite_lanes(v);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float sum = _mm512_reduce_add_ps(ss);
        if (bad || !(sum > 0.0f) || not_finite(sum)) continue;
        const __m512 inv_rms = _mm512_set1_ps((float)(1.0 / sqrt((double)sum / (double)k)));
        for (int64_t i = 0; i < padded; i += 16)
            _mm512_storeu_ps(scaled + voters * padded + i,
                             _mm512_mul_ps(_mm512_abs_ps(load_x(xr, i, lanes_below(k - i), f32)), inv_rms));
        ++voters;
    }
    for (int64_t i = 0; i < k; ++i) rest[i] = 1.0f;
    for (int c = 0; c < count; ++c) {
        memset(votes, 0, sizeof(float) * (size_t)num_pairs);
        for (int64_t r = 0; r < voters; ++r) {
            const float *sr = scaled + r * padded;
            __m512 best = _mm512_setzero_ps();
            for (int64_t i = 0; i < padded; i += 16)
                best = _mm512_max_ps(best, _mm512_mul_ps(_mm512_loadu_ps(sr + i), _mm512_maskz_loadu_ps(lanes_below(k - i), rest + i)));
            const float top = _mm512_reduce_max_ps(best);
            if (!(top > 0.0f)) continue;
            for (int64_t i = 0; i < k; ++i)
                if (rest[i] > 0.0f && sr[i] == top) {
                    votes[i / 2] += top;
                    break;
                }
        }
        int64_t pick = -1;
        for (int64_t j = 0; j < num_pairs; ++j)
            if (rest[2 * j] > 0.0f && (pick < 0 || votes[j] > votes[pick])) pick = j;
        pairs[c] = (int32_t)pick;
        rest[2 * pick] = rest[2 * pick + 1] = 0.0f;
    }
    free(scaled);
    free(votes);
    /* in order: the screen reads their weights front to back */
    qsort(pairs, (size_t)count, sizeof pairs[0], cmp_int32);
    return count;
}

/* x's row (k values, bfloat16 or with f32 float32) -> its int8 rest as unsigned bytes (qx + 128;
 * qx = 0 at the picked pairs, where rest is 0), its picked pairs' values (xu: bfloat16, each
 * pair's two as one int32; float32, the two as two) and its RowInfo. The norms are summed in
 * float64 from exact float32 values (x, and x - sx qx formed in float64: sx qx has at most 31
 * significant bits) and rounded up. */
static inline __attribute__((always_inline)) void quantize_row(const void *x, int64_t k, const float *rest,
                                                              const int32_t *pairs, int num_pairs, uint8_t *xq,
                                                              int32_t *xu, RowInfo *info, const int f32) {
    memset(info, 0, sizeof *info);
    __m512 amax = _mm512_setzero_ps();
    __m512d xx = _mm512_setzero_pd(), uu = _mm512_setzero_pd();
    __mmask16 bad = 0;
    for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 n = lanes_below(k - i);
        const __m512 v = load_x(x, i, n, f32), keep = _mm512_maskz_loadu_ps(n, rest + i);
        bad |= non_finite_lanes(v);
        xx = add_squares(xx, v);
        uu = add_squares(uu, _mm512_sub_ps(v, _mm512_mul_ps(v, keep)));
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_mul_ps(v, keep)));
    }
    if (bad) {
        info->all = 1;
        memset(xq, 128, (size_t)k);
        memset(xu, 0, sizeof(int32_t) * 2 * UPAIRS);
        return;
    }
    const float sx = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 sxv = _mm512_set1_ps(sx), lim = _mm512_set1_ps(127.0f);
    const __m512d sxd = _mm512_set1_pd((double)sx);
    __m512d qq = _mm512_setzero_pd(), dd = _mm512_setzero_pd();
    for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 n = lanes_below(k - i);
        const __m512 v = _mm512_mul_ps(load_x(x, i, n, f32), _mm512_maskz_loadu_ps(n, rest + i));
        __m512 q = _mm512_setzero_ps();
        if (sx > 0.0f)
            q = _mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim),
                                                 _mm512_roundscale_ps(_mm512_div_ps(v, sxv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
        qq = add_squares(qq, q);
        /* x - sx q in float64, exact, by halves */
        const __m512d dlo = _mm512_fnmadd_pd(sxd, _mm512_cvtps_pd(_mm512_castps512_ps256(q)),
                                             _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
        const __m512d dhi = _mm512_fnmadd_pd(sxd, _mm512_cvtps_pd(_mm512_extractf32x8_ps(q, 1)),
                                             _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
        dd = _mm512_fmadd_pd(dhi, dhi, _mm512_fmadd_pd(dlo, dlo, dd));
        const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128)));
        _mm_mask_storeu_epi8(xq + i, n, bytes);
    }
    for (int j = 0; j < num_pairs; ++j) {
        if (f32)
            memcpy(xu + 2 * j, (const float *)x + 2 * (int64_t)pairs[j], 2 * sizeof(float));
        else
            memcpy(xu + j, (const uint16_t *)x + 2 * (int64_t)pairs[j], sizeof(int32_t));
    }
    info->sx = sx;
    info->qx_norm = up(sqrt(_mm512_reduce_add_pd(qq)) * (1.0 + 1e-12));
    info->dx_norm = up(sqrt(_mm512_reduce_add_pd(dd)) * (1.0 + 1e-12));
    info->x_norm = up(sqrt(_mm512_reduce_add_pd(xx)) * (1.0 + 1e-12));
    info->u_norm = up(sqrt(_mm512_reduce_add_pd(uu)) * (1.0 + 1e-12));
    if (not_finite(info->qx_norm) || not_finite(info->dx_norm) || not_finite(info->x_norm) || not_finite(info->u_norm))
        info->all = 1;
}

/* rows (1..8, a constant after inlining) against one panel: the int8 sums over the k / 4 input
 * quads, scaled, then the picked pairs' products (bfloat16: vdpbf16ps on the head's bfloat16
 * panel wu; f32: FMAs on its float32 panel, both constants after inlining); each output's bounds;
 * the row's lower_max raised and its candidates added (push_candidates). */
static inline __attribute__((always_inline)) void screen_rows(
    const uint8_t *xq, const int32_t *xu, int64_t k, int64_t k4, const int8_t *w8, const void *wu, const int32_t *pairs,
    int num_pairs, const Screen *s, int64_t v0, const RowInfo *info, float exact_rel, Candidates *cands, int cols,
    const int rows, const int f32) {
    __m512i acc[ROWS][3];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_si512();
    if (k <= 0) __builtin_unreachable();
    for (int64_t i = 0; i < k4; i += 4) {
        const int8_t *wi = w8 + i * PANEL;
        if (rows > 1) prefetch_panel_row(wi, rows >= 6);
        const __m512i w0 = _mm512_loadu_si512(wi), w1 = _mm512_loadu_si512(wi + 64), w2 = _mm512_loadu_si512(wi + 128);
        for (int r = 0; r < rows; ++r) {
            int32_t quad;
            memcpy(&quad, xq + r * k4 + i, sizeof quad);
            const __m512i xv = _mm512_set1_epi32(quad);
            acc[r][0] = dpbusd(acc[r][0], xv, w0);
            acc[r][1] = dpbusd(acc[r][1], xv, w1);
            acc[r][2] = dpbusd(acc[r][2], xv, w2);
        }
    }
    __m512 a[ROWS][3];
    for (int v = 0; v < 3; ++v) {
        const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(s->qsum + v0 + 16 * v), 7); /* 128 sum q */
        const __m512 scale = _mm512_loadu_ps(s->scale + v0 + 16 * v);
        for (int r = 0; r < rows; ++r)
            a[r][v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], offset)),
                                    _mm512_mul_ps(scale, _mm512_set1_ps(info[r].sx)));
    }
    for (int j = 0; j < num_pairs && !f32; ++j) {
        const uint16_t *wj = (const uint16_t *)wu + (int64_t)pairs[j] * 2 * PANEL;
        const __m512bh u0 = (__m512bh)_mm512_loadu_si512(wj), u1 = (__m512bh)_mm512_loadu_si512(wj + 32),
                       u2 = (__m512bh)_mm512_loadu_si512(wj + 64);
        for (int r = 0; r < rows; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xu[r * 2 * UPAIRS + j]);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], xv, u0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], xv, u1);
            a[r][2] = _mm512_dpbf16_ps(a[r][2], xv, u2);
        }
    }
    for (int j = 0; j < 2 * num_pairs && f32; ++j) { /* the pairs' inputs one by one, in order */
        const float *wj = (const float *)wu + (2 * (int64_t)pairs[j / 2] + j % 2) * PANEL;
        const __m512 u0 = _mm512_loadu_ps(wj), u1 = _mm512_loadu_ps(wj + 16), u2 = _mm512_loadu_ps(wj + 32);
        for (int r = 0; r < rows; ++r) {
            float xv;
            memcpy(&xv, xu + r * 2 * UPAIRS + j, sizeof xv);
            a[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(xv), u0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_set1_ps(xv), u1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(_mm512_set1_ps(xv), u2, a[r][2]);
        }
    }
    /* a_v's own roundings: the int32 -> float32 conversion and two products (3 units of 2^-24
     * of |a0|), then 2 a pair for the picked pairs, of at most |a| + 2 |x_U| |w_v|; generously */
    const __m512 widen = _mm512_set1_ps(1.0f + 1.0f / 512.0f);
    const __m512 a_rel = _mm512_set1_ps((float)(num_pairs + 4) * 0x1p-23f + 0x1p-20f);
    const float tiny_unit = 0x1p-125f * (float)(k + 2);
    const __m512 tiny_w = _mm512_set1_ps(tiny_unit);
    for (int r = 0; r < rows; ++r) {
        Candidates *c = cands + r;
        if (c->overflow) continue;
        const __m512 sq = _mm512_set1_ps(info[r].sx * info[r].qx_norm * (1.0f + 0x1p-20f));
        const __m512 dn = _mm512_set1_ps(info[r].dx_norm);
        const __m512 un2 = _mm512_set1_ps(2.0f * info[r].u_norm);
        const __m512 exact_n = _mm512_set1_ps(info[r].x_norm * exact_rel);
        const __m512 tiny = _mm512_set1_ps(tiny_unit * (1.0f + info[r].x_norm));
        __m512 upper[3], lo_max = _mm512_set1_ps(c->lower_max);
        __mmask16 masks[3];
        panel_masks(cols, masks);
        for (int v = 0; v < 3; ++v) {
            const int64_t o = v0 + 16 * v;
            const __m512 e = _mm512_loadu_ps(s->e_norm + o), wn = _mm512_loadu_ps(s->w_norm + o);
            /* s_x |qx| |e| + |dx| |w| + the exact sums' rounding + a's own, + near zero */
            __m512 b = _mm512_mul_ps(sq, e);
            b = _mm512_fmadd_ps(dn, wn, b);
            b = _mm512_fmadd_ps(exact_n, wn, b);
            b = _mm512_fmadd_ps(a_rel, _mm512_fmadd_ps(un2, wn, _mm512_abs_ps(a[r][v])), b);
            b = _mm512_fmadd_ps(b, widen, _mm512_fmadd_ps(tiny_w, wn, tiny));
            upper[v] = _mm512_add_ps(a[r][v], b);
            lo_max = _mm512_mask_max_ps(lo_max, masks[v], lo_max, _mm512_sub_ps(a[r][v], b));
        }
        c->lower_max = _mm512_reduce_max_ps(lo_max);
        push_candidates(c, upper, masks, threshold_of(c->lower_max, !f32), v0);
    }
}

/* The bfloat16 logits of up to 16 candidates (lanes < count; the rest read output 0), as
 * bf16_linear.c sums them: vdpbf16ps (with wide, bf16_linear_wide's FMAs) over the input pairs in
 * chunks of `chunk` inputs, each chunk from zero and added to the total, plus a zero bias, rounded
 * to bfloat16 (widened back). The weight pairs are gathered from W's rows (weight: [n, k]
 * bfloat16), where each candidate's next 16 pairs share one cache line; from the panels each pair
 * would read a line of its own. */
static __m512 exact_bf16(const uint16_t *x, int64_t k, const uint16_t *weight, const int32_t *cand, int count,
                         int64_t chunk, int wide) {
    const __m512i rows =
        _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(lanes_below(count), cand), _mm512_set1_epi32((int32_t)(k / 2)));
    const int32_t *pairs = (const int32_t *)weight;
    __m512 sums = _mm512_setzero_ps();
    for (int64_t start = 0; start < k; start += chunk) {
        const int64_t end = k - start < chunk ? k : start + chunk;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = start; i < end; i += 2) {
            const __m512i w = _mm512_i32gather_epi32(rows, pairs + i / 2, 4);
            if (wide) { /* bf16_linear_wide's sums */
                acc = bf16_pair_fma(acc, _mm512_set1_ps(bf16_to_f32(x[i])), _mm512_set1_ps(bf16_to_f32(x[i + 1])), w);
                continue;
            }
            int32_t pair;
            memcpy(&pair, x + i, sizeof pair);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
        }
        sums = _mm512_add_ps(sums, acc);
    }
    return bf16x16_round(_mm512_add_ps(sums, _mm512_setzero_ps()));
}

/* The int8 screen's call, for bfloat16 x or (f32, a constant after inlining) float32 x; see
 * greedy_head_int8. */
static inline __attribute__((always_inline)) int screen_int8(
    const void *x, int64_t x_stride, int64_t m, int64_t k, const int8_t *q8, const Screen *screen, const void *wu,
    const void *weight, int64_t n, int64_t chunk, int wide, int64_t *out, int64_t *candidates_out, const int f32) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int threads = omp_get_max_threads();
    const size_t x_size = f32 ? sizeof(float) : sizeof(uint16_t);
    int32_t pairs[UPAIRS];
    float *rest = malloc(sizeof(float) * (size_t)k);
    const int num_pairs = rest ? pick_pairs(x, x_stride, m, k, pairs, rest, f32) : -1;
    const int64_t k4 = (k + 3) / 4 * 4; /* the int8 copies' inputs: k padded with zeros to whole quads */
    uint8_t *xq = malloc((size_t)(m * k4));
    int32_t *xu = malloc(sizeof(int32_t) * 2 * UPAIRS * (size_t)m);
    RowInfo *info = malloc(sizeof(RowInfo) * (size_t)m);
    Candidates *cands = malloc(sizeof(Candidates) * (size_t)(m * threads));
    if (num_pairs < 0 || !xq || !xu || !info || !cands) {
        free(rest);
        free(xq);
        free(xu);
        free(info);
        free(cands);
        return PDS_ERR_MEMORY;
    }
    /* the exact sums' rounding relative to |x| |w_v|: 2 a pair within a chunk, one a chunk after */
    const float exact_rel = (float)((chunk + k / chunk + 4) * 0x1p-23);
#pragma omp parallel
    {
        const int me = omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) {
            quantize_row(x_row(x, r, x_stride, f32), k, rest, pairs, num_pairs, xq + r * k4,
                         xu + r * 2 * UPAIRS, info + r, f32);
            memset(xq + r * k4 + k, 128, (size_t)(k4 - k)); /* qx = 0 */
        }
        Candidates *mine = cands + (int64_t)me * m;
        for (int64_t r = 0; r < m; ++r) mine[r].lower_max = -INFINITY, mine[r].count = 0, mine[r].overflow = info[r].all;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const int8_t *w8 = q8 + p * k4 * PANEL;
            /* the head's own panel (bfloat16: k / 2 pair rows of 96 values; float32: k rows of 48) */
            const char *wup = (const char *)wu + p * k * PANEL * x_size;
            const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
            /* the next panel's picked pairs into L2 (scattered rows: the hardware's prefetch misses them) */
            for (int j = 0; j < num_pairs && p + 1 < panels; ++j) {
                const char *next = wup + (k * PANEL + (int64_t)pairs[j] * 2 * PANEL) * x_size;
                for (int line = 0; line < (int)(2 * PANEL * x_size); line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
            }
            for (int64_t row = 0; row < m; row += ROWS) {
#define SCREEN_ROWS(r) screen_rows(xq + row * k4, xu + row * 2 * UPAIRS, k, k4, w8, wup, pairs, num_pairs, screen, \
                                     p * PANEL, info + row, exact_rel, mine + row, cols, r, f32)
                WITH_ROWS(m - row, SCREEN_ROWS)
#undef SCREEN_ROWS
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < m; ++r) {
            int32_t cand[CAP];
            const int64_t count = gather_row(cands, threads, m, r, !f32, cand);
            const void *xr = x_row(x, r, x_stride, f32);
            int64_t best_v = count < 0 ? -1 : 0;
            float best = 0.0f;
            for (int64_t j = 0; j < count && best_v >= 0; j += 16) {
                const int lanes = count - j < 16 ? (int)(count - j) : 16;
                float vals[16];
                _mm512_storeu_ps(vals, f32 ? exact_f32((const float *)xr, k, weight, cand + j, lanes)
                                           : exact_bf16((const uint16_t *)xr, k, weight, cand + j, lanes, chunk, wide));
                for (int l2 = 0; l2 < lanes; ++l2) {
                    if ((bits_of(vals[l2]) & 0x7fffffffu) > 0x7f800000u) { /* a NaN: the caller's argmax finds the first */
                        best_v = -1;
                        break;
                    }
                    if ((j == 0 && l2 == 0) || vals[l2] > best) best = vals[l2], best_v = cand[j + l2];
                }
            }
            out[r] = best_v;
            if (candidates_out) candidates_out[r] = best_v < 0 ? n : count;
        }
    }
    free(rest);
    free(xq);
    free(xu);
    free(info);
    free(cands);
    return 0;
}

/* x: [m, k] rows x_stride apart (elements), bfloat16, or float32 with f32 (k even, at most
 * 65,536); q8: int8 W in panels (its inputs padded with zeros to a multiple of 4); scale, qsum,
 * e_norm, w_norm: per output, padded to whole panels; wu: the head's own panels (bfloat16:
 * pack_bf16_pairs; float32: pack_f32_panels), for the picked pairs; weight: W [n, k] in x's dtype,
 * contiguous, for the exact logits; chunk: the inputs bf16_linear.c sums in one go for m rows
 * (bf16_linear_chunk) and wide: whether it is bf16_linear_wide (bfloat16 only: float32 heads are
 * summed in f32_linear.c's CHUNK whatever they say); out: m int64 tokens, -1 for a row left to the
 * caller; candidates_out (or NULL): each row's count of exact logits. Returns PDS_OK, or
 * PDS_ERR_MEMORY when a buffer could not be allocated. */
int greedy_head_int8(const void *x, int64_t x_stride, int64_t m, int64_t k, const int8_t *q8, const float *scale,
                     const int32_t *qsum, const float *e_norm, const float *w_norm, const void *wu, const void *weight,
                     int64_t n, int64_t chunk, int wide, int f32, int64_t *out, int64_t *candidates_out) {
    const Screen screen = {scale, qsum, e_norm, w_norm};
    if (f32) return screen_int8(x, x_stride, m, k, q8, &screen, wu, weight, n, CHUNK, 0, out, candidates_out, 1);
    return screen_int8(x, x_stride, m, k, q8, &screen, wu, weight, n, chunk, wide && m >= BF16_WIDE_MIN_ROWS, out,
                       candidates_out, 0);
}
#else
int greedy_head_ready(void) { return 0; }
#endif
