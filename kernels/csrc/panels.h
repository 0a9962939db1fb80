/* Shared by the small-batch projection kernels (f32_linear.c, bf16_linear.c): W packed in panels
 * of PANEL outputs, each input's (or input pair's) PANEL values one 192-byte row, the panel
 * streamed front to back, ROWS rows of x at a time. */
#ifndef PDSERVE_PANELS_H
#define PDSERVE_PANELS_H

#include <immintrin.h>

enum { PANEL = 48, ROWS = 8, CHUNK = 64 };

/* How far ahead of its reads a panel's W rows are prefetched, in bytes. On the 2-core Zen 5, with
 * 3-64 rows of x the FMAs between reads left the hardware prefetcher behind. SmolLM-135M's 30
 * layers' projections, one thread, medians of 9 alternated repeats, 3 / 8 / 16 / 64 rows:
 * float32 11.24 / 14.16 / 20.25 / 59.17 ms -> 10.22 / 11.85 / 17.41 / 56.71; bfloat16 5.95 /
 * 6.62 / 10.79 / 29.96 -> 5.45 / 5.25 / 8.57 / 28.02. Two threads: 8 rows 8.09 -> 6.6 (float32),
 * 3.81 -> 2.95-3.16 (bfloat16). With one row the stream already ran at the memory's speed and
 * the prefetches cost 3-5%, so the kernels skip them there. */
enum { PREFETCH_AHEAD_BYTES = 12288 };

/* Prefetch the 192-byte W row at p (three cache lines) into L1. */
static inline __attribute__((always_inline)) void prefetch_panel_row(const void *p) {
    const char *c = (const char *)p + PREFETCH_AHEAD_BYTES;
    _mm_prefetch(c, _MM_HINT_T0);
    _mm_prefetch(c + 64, _MM_HINT_T0);
    _mm_prefetch(c + 128, _MM_HINT_T0);
}

#endif
