/* bfloat16 projections y = x W^T (+ bias), decode batches (up to 64 rows) and prefill ones (see
 * blocked() below), on CPUs with AVX512-BF16 but no AMX (AMD's Zen 4 and Zen 5, Intel's Cooper
 * Lake): vdpbf16ps, which adds two bfloat16 products to each of 16 float32 sums. W is packed once,
 * when the model loads (ProjectionKernels.pack_bf16_pairs in kernels/cpu/linear.py): panels of 48
 * outputs, each k / 2 rows of 48 outputs x 2 consecutive inputs (zero-padded past n), so a panel
 * streams front to back. Each thread takes whole panels; each panel runs x 8 rows at a time: 8 x
 * 48 float32 sums in 24 registers, one broadcast of an input pair of x per row and three loads of
 * W per input pair. The first 8 rows read the panel from memory, the rest from cache (a panel is
 * k x 96 bytes: 54 KB at k = 576). The sums are rounded to bfloat16 (nearest even) after the bias
 * is added in float32. Against oneDNN's prepacked linear: benchmarks/kernels.py --cpu.
 *
 * bf16_linear_wide (below) is the same kernel with float32 FMAs on the pairs widened in registers,
 * for CPUs where vdpbf16ps runs at half the FMAs' rate in flops (ProjectionKernels in
 * kernels/cpu/linear.py measures it with bf16_linear_dot_ratio).
 *
 * vdpbf16ps forms each bfloat16 product exactly in float32 and adds the pair to the sum with
 * float32 rounding, so the sums are float32 sums of exact products, as oneDNN's are; their order
 * differs (each output sums its inputs front to back, blocked in chunks of CHUNK inputs), so
 * results differ in the last bits before the rounding to bfloat16.
 */
#include "pdserve_kernels.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "panels.h"

int bf16_linear_ready(void) { return 1; }

/* The calling thread's buffer for x widened to float32 (bf16_linear_wide), grown to at least
 * count floats; NULL when it cannot be. Kept between calls: allocating 12 MB (a 2,048-token
 * chunk's 1,536 inputs) anew would page-fault it in on every call. */
static float *wide_x(size_t count) {
    static __thread float *buffer;
    static __thread size_t capacity;
    if (count > capacity) {
        const size_t bytes = (count * sizeof(float) + 63) / 64 * 64;
        float *grown = aligned_alloc(64, bytes);
        if (grown == NULL) return NULL;
        free(buffer);
        buffer = grown, capacity = bytes / sizeof(float);
    }
    return buffer;
}

/* x's m rows (k inputs, x_stride apart) widened into dst in groups of ROWS rows: group g's pair j
 * (inputs 2j, 2j + 1) of its row r at dst[(g * k / 2 + j) * 2 * ROWS + 2 * r], so that a row
 * group's inputs for one pair are one 64-byte line, read by broadcasts at fixed offsets
 * (fma_broadcast; x rows a stride apart made the compiler keep the broadcasts in registers and
 * spill). Split among the calling team's threads (a worksharing loop: call it from all of them,
 * or outside a parallel region). */
static void widen_rows(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, float *dst) {
    const __m512i lanes = _mm512_set_epi64(7 * ROWS, 6 * ROWS, 5 * ROWS, 4 * ROWS, 3 * ROWS, 2 * ROWS, ROWS, 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
        const uint16_t *src = x + r * x_stride;
        double *group = (double *)(dst + (r / ROWS) * ROWS * k); /* a pair of floats as one 8-byte lane */
        const __m512i row = _mm512_add_epi64(lanes, _mm512_set1_epi64(r % ROWS));
        for (int64_t i = 0; i < k; i += 16) {
            const __m512i at = _mm512_add_epi64(row, _mm512_set1_epi64((i / 2) * ROWS));
            if (i + 16 <= k) {
                _mm512_i64scatter_pd(group, at, _mm512_castps_pd(bf16x16_load(src + i)), 8);
            } else {
                const __mmask16 tail = (__mmask16)((1u << (k - i)) - 1u);
                const __mmask8 pairs = (__mmask8)((1u << ((k - i) / 2)) - 1u);
                _mm512_mask_i64scatter_pd(group, pairs, at, _mm512_castps_pd(bf16x16_maskz_load(tail, src + i)), 8);
            }
        }
    }
}

/* acc + w * x[0] broadcast, the broadcast read by the FMA itself (an embedded broadcast), which
 * the compiler does not keep in a register. */
static inline __attribute__((always_inline)) __m512 fma_broadcast(__m512 acc, __m512 w, const float *x) {
    __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* Row `row` of x: bfloat16, rows x_stride elements apart; with wide, the first of a widened row
 * group (row a multiple of ROWS; x_stride k). */
static inline const void *row_of(const void *x, int64_t row, int64_t x_stride, const int wide) {
    return wide ? (const void *)((const float *)x + row * x_stride) : (const void *)((const uint16_t *)x + row * x_stride);
}

static inline __m512i pair_of(const uint16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_set1_epi32(pair);
}

/* acc[r] += rows (1..8, a constant after inlining) of x against the panel's input pairs [i0, i1)
 * (x_rows: bfloat16 rows x_stride elements apart, or with wide (a constant) the row group widened
 * in widen_rows' layout), each pair's W row (three vectors) prefetched ahead with prefetch (a
 * constant too; see panels.h), and with fetch_next the row group's share of the next panel's
 * lines (next_panel_step per pair). fetch_next is a constant, the caller testing share's groups
 * once, so that no test runs inside the loop. */
static inline __attribute__((always_inline)) void accumulate(__m512 acc[][3], const void *x_rows, int64_t x_stride,
                                                             const uint16_t *w, int64_t i0, int64_t i1, const int rows,
                                                             const int prefetch, NextPanel *share,
                                                             const int fetch_next, const int wide) {
    const uint16_t *x = (const uint16_t *)x_rows;
    for (int64_t i = i0; i < i1; i += 2) {
        const uint16_t *wi = w + i * PANEL;
        if (prefetch && rows > 1) prefetch_panel_row(wi, rows >= 6);
        if (fetch_next) next_panel_step(share);
        if (wide) { /* x's row group widened (widen_rows' layout): FMAs on the pairs widened here */
            const float *xp = (const float *)x_rows + (i / 2) * 2 * ROWS;
            for (int v = 0; v < 3; ++v) {
                const __m512i pairs = _mm512_loadu_si512(wi + 32 * v);
                const __m512 odd = bf16_pairs_odd(pairs), even = bf16_pairs_even(pairs);
                for (int r = 0; r < rows; ++r)
                    acc[r][v] = fma_broadcast(fma_broadcast(acc[r][v], odd, xp + 2 * r + 1), even, xp + 2 * r);
            }
            continue;
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wi), w1 = (__m512bh)_mm512_loadu_si512(wi + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(wi + 64);
        for (int r = 0; r < rows; ++r) {
            const __m512bh xv = (__m512bh)pair_of(x + r * x_stride + i);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
        }
    }
}

/* out's rows = sums + bias (float32, or none), rounded to bfloat16; cols: the panel's real outputs. */
static inline __attribute__((always_inline)) void store_rounded(__m512 sums[][3], const float *bias, uint16_t *out,
                                                                int64_t out_stride, int cols, const int rows) {
    for (int v = 0; v < 3 && 16 * v < cols; ++v) {
        const int n = cols - 16 * v < 16 ? cols - 16 * v : 16;
        const __mmask16 mask = (__mmask16)((1u << n) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
        for (int r = 0; r < rows; ++r)
            _mm256_mask_storeu_epi16(out + r * out_stride + 16 * v, mask, bf16x16_narrow(_mm512_add_ps(sums[r][v], b)));
    }
}

/* rows (1..8, a constant after inlining) of x against one panel; cols: the panel's real outputs;
 * k even; next: this row group's share of the next panel's prefetches, as in f32_linear.c
 * (panels.h). The sums run in chunks of CHUNK inputs, each chunk's added to the running total in
 * sums (a blocked summation, as in f32_linear.c). */
static inline __attribute__((always_inline)) void panel_rows(const void *x, int64_t x_stride, const uint16_t *w,
                                                             int64_t k, const float *bias, uint16_t *out,
                                                             int64_t out_stride, int cols, const int rows,
                                                             NextPanel next, const int wide) {
    __m512 sums[ROWS][3];
    for (int r = 0; r < rows; ++r) sums[r][0] = sums[r][1] = sums[r][2] = _mm512_setzero_ps();
    for (int64_t start = 0; start < k; start += CHUNK) {
        const int64_t end = k - start < CHUNK ? k : start + CHUNK;
        __m512 acc[ROWS][3];
        for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
        if (next.groups)
            accumulate(acc, x, x_stride, w, start, end, rows, 1, &next, 1, wide);
        else
            accumulate(acc, x, x_stride, w, start, end, rows, 1, NULL, 0, wide);
        for (int r = 0; r < rows; ++r)
            for (int v = 0; v < 3; ++v) sums[r][v] = _mm512_add_ps(sums[r][v], acc[r][v]);
    }
    store_rounded(sums, bias, out, out_stride, cols, rows);
}

/* Prefill-sized batches (over SMALL_BATCH_ROWS rows) run blocked for the caches: a work item is
 * one panel and up to BLOCK_ROWS rows of x, and it takes the panel's inputs BLOCK_INPUTS at a time:
 * those 24 KB of W stay in L1 while all the item's row groups pass over them, and the item's x
 * rows of those inputs (64 KB) in L2. Each row group's sums over an input block start at zero and
 * are added to its running totals, float32 in `carry` (ROWS x PANEL per group, 24 KB): a blocked
 * summation with blocks of BLOCK_INPUTS inputs (the small-batch path's chunk sums and totals both
 * in registers ran slower here). The sizes were chosen against oneDNN's prepacked bfloat16 matmul,
 * which this path replaces, on SmolLM-135M's projections at 96 to 2,048 rows. */
enum { SMALL_BATCH_ROWS = PDS_LIMIT_small_batch_rows, BLOCK_ROWS = 128, BLOCK_INPUTS = 256 };

/* The items run GROUP_PANELS panels at a time: within a group, row block by row block, each over
 * the group's panels, so a row block of x is read from L2 by all the group's panels and the
 * group's W is read again from L2/L3 for each row block, rather than x streamed from L3 once per
 * panel. Same bits either way; 16 ran fastest of 8 to 32 at 2,048 rows. */
enum { GROUP_PANELS = 16 };

/* rows (1..8, a constant after inlining) of x against one panel's inputs [k0, k1), their sums
 * added to carry (float32 [rows][PANEL]; set instead with first); with last, the totals rounded
 * to out (as panel_rows). */
static inline __attribute__((always_inline)) void block_rows(const void *x, int64_t x_stride, const uint16_t *w,
                                                             int64_t k0, int64_t k1, float *carry, int first, int last,
                                                             const float *bias, uint16_t *out, int64_t out_stride,
                                                             int cols, const int rows, const int wide) {
    __m512 acc[ROWS][3];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
    if (k1 <= k0) __builtin_unreachable(); /* else the accumulators go through the stack */
    accumulate(acc, x, x_stride, w, k0, k1, rows, 0, NULL, 0, wide);
    if (!first)
        for (int r = 0; r < rows; ++r)
            for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_add_ps(_mm512_load_ps(carry + r * PANEL + 16 * v), acc[r][v]);
    if (!last) {
        for (int r = 0; r < rows; ++r)
            for (int v = 0; v < 3; ++v) _mm512_store_ps(carry + r * PANEL + 16 * v, acc[r][v]);
        return;
    }
    store_rounded(acc, bias, out, out_stride, cols, rows);
}

/* The blocked path's input blocks: of equal size (even), at most BLOCK_INPUTS: 576 inputs in 3 x
 * 192, not 256 + 256 + 64. */
static int64_t blocked_step(int64_t k) {
    const int64_t num_steps = (k + BLOCK_INPUTS - 1) / BLOCK_INPUTS;
    return ((k + num_steps - 1) / num_steps + 1) / 2 * 2;
}

static inline __attribute__((always_inline)) void blocked(const uint16_t *x_in, int64_t x_in_stride, float *x_wide,
                                                          int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                                                          const float *bias, uint16_t *out, int64_t out_stride,
                                                          const int wide) {
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = (m + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const int64_t step = blocked_step(k);
    const void *x = wide ? (const void *)x_wide : (const void *)x_in;
    const int64_t x_stride = wide ? k : x_in_stride;
#pragma omp parallel
    {
        float carry[BLOCK_ROWS * PANEL] __attribute__((aligned(64)));
        if (wide) widen_rows(x_in, x_in_stride, m, k, x_wide);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < panels * blocks; ++item) {
            const int64_t group = item / (GROUP_PANELS * blocks), first_item = group * GROUP_PANELS * blocks;
            const int64_t group_panels = panels - group * GROUP_PANELS < GROUP_PANELS ? panels - group * GROUP_PANELS
                                                                                       : GROUP_PANELS;
            const int64_t p = group * GROUP_PANELS + (item - first_item) % group_panels;
            const int64_t row0 = (item - first_item) / group_panels * BLOCK_ROWS;
            const int64_t row1 = m - row0 < BLOCK_ROWS ? m : row0 + BLOCK_ROWS;
            const uint16_t *w = packed + p * k * PANEL;
            const float *b = bias ? bias + p * PANEL : NULL;
            const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
            for (int64_t k0 = 0; k0 < k; k0 += step) {
                const int64_t k1 = k - k0 < step ? k : k0 + step;
                for (int64_t row = row0; row < row1; row += ROWS) {
                    const void *xr = row_of(x, row, x_stride, wide);
                    uint16_t *o = out + row * out_stride + p * PANEL;
                    float *c = carry + (row - row0) * PANEL;
#define BLOCK_ROWS_OF(r) block_rows(xr, x_stride, w, k0, k1, c, k0 == 0, k1 == k, b, o, out_stride, cols, r, wide)
                    WITH_ROWS(row1 - row, BLOCK_ROWS_OF)
#undef BLOCK_ROWS_OF
                }
            }
        }
    }
}

/* How many inputs bf16_linear sums from zero before adding them to an output's total, for m rows
 * of k inputs (CHUNK on the small-batch path, the blocked path's step above): the greedy head
 * (greedy_head.c) sums its candidates' logits the same way. */
int64_t bf16_linear_chunk(int64_t m, int64_t k) { return m > SMALL_BATCH_ROWS ? blocked_step(k) : CHUNK; }

/* x: [m, k] bfloat16 rows x_stride apart (k even); packed: W [n, k] as above; bias: n float32 or
 * NULL; out: [m, n] bfloat16 rows out_stride apart; wide (a constant): FMAs on x widened to
 * float32 (wide_x) instead of vdpbf16ps. Returns PDS_OK, or PDS_ERR_MEMORY when x's float32 copy
 * could not be allocated (the signature of amx_linear_bf16's). */
static inline __attribute__((always_inline)) int run(const uint16_t *x_in, int64_t x_in_stride, int64_t m, int64_t k,
                                                     const uint16_t *packed, int64_t n, const float *bias,
                                                     uint16_t *out, int64_t out_stride, const int wide) {
    float *x_wide = NULL;
    if (wide && m > 0 && (x_wide = wide_x((size_t)((m + ROWS - 1) / ROWS * ROWS) * (size_t)k)) == NULL) return PDS_ERR_MEMORY;
    if (m > SMALL_BATCH_ROWS) {
        blocked(x_in, x_in_stride, x_wide, m, k, packed, n, bias, out, out_stride, wide);
        return 0;
    }
    const void *x = wide ? (const void *)x_wide : (const void *)x_in;
    const int64_t x_stride = wide ? k : x_in_stride;
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel if (panels * m * k > 32768)
    {
        if (wide) widen_rows(x_in, x_in_stride, m, k, x_wide);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const uint16_t *w = packed + p * k * PANEL;
            const float *b = bias ? bias + p * PANEL : NULL;
            const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
            const uint16_t *next = p + 1 < panels ? w + k * PANEL : NULL; /* this thread's next one (static schedule) */
            for (int64_t row = 0; row < m; row += ROWS) {
                const void *xr = row_of(x, row, x_stride, wide);
                uint16_t *o = out + row * out_stride + p * PANEL;
                const NextPanel share = next_panel_share(next, row / ROWS, (m + ROWS - 1) / ROWS, k / 2);
#define PANEL_ROWS(r) panel_rows(xr, x_stride, w, k, b, o, out_stride, cols, r, share, wide)
                WITH_ROWS(m - row, PANEL_ROWS)
#undef PANEL_ROWS
            }
        }
    }
    return 0;
}

int bf16_linear(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                const float *bias, uint16_t *out, int64_t out_stride) {
    return run(x, x_stride, m, k, packed, n, bias, out, out_stride, 0);
}

/* bf16_linear with float32 FMAs (bf16_pair_fma) in place of vdpbf16ps from BF16_WIDE_MIN_ROWS
 * rows on, for CPUs where vdpbf16ps runs at half the FMAs' rate (bf16_linear_dot_ratio); the same
 * sums but for denormals. */
int bf16_linear_wide(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                     const float *bias, uint16_t *out, int64_t out_stride) {
    if (m < BF16_WIDE_MIN_ROWS) return run(x, x_stride, m, k, packed, n, bias, out, out_stride, 0);
    return run(x, x_stride, m, k, packed, n, bias, out, out_stride, 1);
}

/* vdpbf16ps's rate in flops against float32 FMAs' on this core (each counted as two flops a
 * product): 12 independent sums of each, alternated 5 times, the fastest of each (about 2 ms in
 * all). Intel's cores without AMX (Emerald Rapids) issue vdpbf16ps at half the FMAs' rate, ~0.5
 * here, where bf16_linear_wide is the faster; AMD's at the same rate. */
#define SUMS(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double bf16_linear_dot_ratio(void) {
    enum { ITERATIONS = 20000, REPEATS = 5 };
    double best_fma = 1e30, best_dot = 1e30;
    float sink = 0.0f;
/* One timing of 12 independent chains a##j = STEP(a##j, x), x = X (kept opaque), into best. */
#define START(j) __m512 a##j = _mm512_set1_ps((float)(j) * 1e-3f); __asm__ volatile("" : "+v"(a##j));
#define FINISH(j) sink += _mm512_reduce_add_ps(a##j);
#define TIME_CHAINS(best, X, STEP)                                                                                     \
    {                                                                                                                  \
        SUMS(START)                                                                                                    \
        const __typeof__(X) x = (X);                                                                                   \
        const double t0 = seconds();                                                                                   \
        for (int i = 0; i < ITERATIONS; ++i) {                                                                         \
            SUMS(STEP)                                                                                                 \
            __asm__ volatile("" ::"v"(x));                                                                             \
        }                                                                                                              \
        const double t = seconds() - t0;                                                                               \
        best = t < best ? t : best;                                                                                    \
        SUMS(FINISH)                                                                                                   \
    }
#define FMA(j) a##j = _mm512_fmadd_ps(x, x, a##j);
#define DOT(j) a##j = _mm512_dpbf16_ps(a##j, x, x);
    for (int repeat = 0; repeat < REPEATS; ++repeat) {
        TIME_CHAINS(best_fma, _mm512_set1_ps(1e-9f), FMA)
        TIME_CHAINS(best_dot, (__m512bh)_mm512_set1_epi32(0x30003000), DOT)
    }
#undef FMA
#undef DOT
#undef TIME_CHAINS
#undef START
#undef FINISH
    __asm__ volatile("" ::"x"(sink));
    /* per instruction: an FMA 32 flops, a vdpbf16ps 64 */
    return (64.0 / best_dot) / (32.0 / best_fma);
}
#undef SUMS

#else
int bf16_linear_ready(void) { return 0; }
#endif
