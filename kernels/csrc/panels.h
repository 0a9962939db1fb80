/* Shared by the small-batch projection kernels (f32_linear.c, bf16_linear.c): W packed in panels
 * of PANEL outputs, each input's (or input pair's) PANEL values one 192-byte row, the panel
 * streamed front to back, ROWS rows of x at a time. */
#ifndef PDSERVE_PANELS_H
#define PDSERVE_PANELS_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "pdserve_kernels.h"

enum { PANEL = PDS_LIMIT_panel, ROWS = 8, CHUNK = 64 };

/* CALL(r) with r the constant 1..ROWS that count (at least 1) is, or ROWS when count is larger:
 * the row-group kernels are inlined once for each row count. */
#define WITH_ROWS(count, CALL)                                                                                         \
    switch ((count) < ROWS ? (count) : ROWS) {                                                                         \
    case 1: CALL(1); break;                                                                                            \
    case 2: CALL(2); break;                                                                                            \
    case 3: CALL(3); break;                                                                                            \
    case 4: CALL(4); break;                                                                                            \
    case 5: CALL(5); break;                                                                                            \
    case 6: CALL(6); break;                                                                                            \
    case 7: CALL(7); break;                                                                                            \
    default: CALL(8); break;                                                                                           \
    }

/* How far ahead of its reads a panel's W rows are prefetched, in bytes. On the 2-core Zen 5, with
 * 3-64 rows of x the FMAs between reads left the hardware prefetcher behind. SmolLM-135M's 30
 * layers' projections, one thread, medians of 9 alternated repeats, 3 / 8 / 16 / 64 rows:
 * float32 11.24 / 14.16 / 20.25 / 59.17 ms -> 10.22 / 11.85 / 17.41 / 56.71; bfloat16 5.95 /
 * 6.62 / 10.79 / 29.96 -> 5.45 / 5.25 / 8.57 / 28.02. Two threads: 8 rows 8.09 -> 6.6 (float32),
 * 3.81 -> 2.95-3.16 (bfloat16). With one row the stream already ran at the memory's speed and
 * the prefetches cost 3-5%, so the kernels skip them there. */
enum { PREFETCH_AHEAD_BYTES = 12288 };

/* Prefetch the 192-byte W row at p (three cache lines) into L1, or with into_l2 (a constant after
 * inlining) into L2 only (prefetcht1). bfloat16 on a 2-core Zen 4 EPYC, SmolLM-135M's 30 layers'
 * projections, medians of 11 alternated repeats, one thread, 2 / 3 / 4 / 6 / 8 / 16 / 32 / 64
 * rows, L1 -> L2: 10.06 -> 12.21, 9.79 -> 10.94, 9.29-10.06 -> 9.98-10.23, 10.88 -> 9.74,
 * 11.12-12.06 -> 9.36-9.90, 18.97 -> 17.02, 35.06 -> 33.13, 65.5-65.9 -> 63.6-64.3 ms; two
 * threads, 2 / 4 / 8 / 16 / 64 rows: 7.31 -> 8.00, 6.38 -> 6.22, 7.03 -> 6.28, 10.90 -> 10.24,
 * 36.06 -> 34.85. With 6 rows and more the FMAs between reads leave the L1's few miss buffers
 * waiting on the L1 prefetches (as in paged_attention.c's); with fewer the stream needs them.
 * bf16_linear.c takes L2 from 6 rows on; float32 measured the same either way (two threads,
 * 1-64 rows) and keeps L1. */
static inline __attribute__((always_inline)) void prefetch_panel_row(const void *p, const int into_l2) {
    const char *c = (const char *)p + PREFETCH_AHEAD_BYTES;
    for (int line = 0; line < 192; line += 64) {
        if (into_l2)
            _mm_prefetch(c + line, _MM_HINT_T1);
        else
            _mm_prefetch(c + line, _MM_HINT_T0);
    }
}

/* The panel after this one, into L2 (prefetcht1), while the row groups after the first run this
 * one: group 0 streams this panel from memory while later groups read it from cache, so the next
 * panel's read then overlaps FMAs instead of stalling the next group 0. float32 on the 2-core
 * Zen 5, SmolLM-135M's 30 layers' projections, medians of 9 alternated repeats, 16 / 32 / 48 / 64
 * rows: one thread 19.5-19.9 -> 18.6-18.9, 34.2 -> 29.7, 48.4-48.7 -> 43.6-43.7, 62.4-62.8 ->
 * 57.5-59.1 ms; two threads 12.7-13.0 -> 12.1-12.3, 19.7 -> 16.2-16.3, 26.7-27.2 -> 23.3-23.5,
 * 33.6-34.1 -> 30.2-30.5 (then groups 1-3 fetched one line per W row each). Measured and not
 * kept there: starting in group 0 (9 rows 5-7% slower on one thread), and two or three lines a W
 * row where there are fewer groups (9-16 rows up to 16% slower).
 * With more than four groups (over 32 rows) the lines are spread evenly over all of them, 3 /
 * (groups - 1) lines a W row, rather than one a row in groups 1-3: on a 2-core Xeon (Emerald
 * Rapids) each software prefetch holds one of the L1's few miss buffers until memory answers, so
 * a line every W row (12 cycles of FMAs at 8 rows) left the FMAs waiting on them. float32, a
 * whole decode step's 30 layers (kernels/decode_layers.c, 64 sequences of ~290 tokens), alternated
 * builds: one thread 64 rows 166.5-172.5 -> 160.0-163.0 ms, 48 rows 131.5-139.4 -> 123.2-123.3;
 * two threads 64 rows 88.4-89.9 -> 86.0-89.8, 48 rows 68.9-69.6 -> 66.0-66.9; 16 and 32 rows
 * (four groups or fewer, where nothing changed) the same. */
typedef struct {
    const char *line; /* the next line to fetch */
    int64_t owed;     /* the pace's count: each W row adds 3, and each `groups` of it fetch a line */
    int64_t groups;   /* the share's spread (next_panel_share): a line every groups / 3 W rows;
                         0: this group fetches none */
} NextPanel;

/* Row group `group`'s share of the next panel's lines (next: NULL past the last panel): the
 * panel's 3 * num_w_rows lines in order over groups 1 .. spread, spread = the groups after the
 * first but at least 3, so each takes 3 * num_w_rows / spread of them, a line every spread / 3 W
 * rows. With four groups or fewer that is one line a W row in groups 1-3, those there are. */
static inline NextPanel next_panel_share(const void *next, int64_t group, int64_t num_groups, int64_t num_w_rows) {
    NextPanel share = {NULL, 0, 0};
    const int64_t spread = num_groups - 1 > 3 ? num_groups - 1 : 3;
    if (next == NULL || group < 1 || group > spread) return share;
    const int64_t first = (group - 1) * 3 * num_w_rows; /* in 1 / spread of a line */
    share.groups = spread;
    share.line = (const char *)next + first / spread * 64;
    share.owed = first % spread;
    return share;
}

/* One W row's step of share (whose groups is not 0). */
static inline __attribute__((always_inline)) void next_panel_step(NextPanel *share) {
    share->owed += 3;
    if (share->owed >= share->groups) {
        _mm_prefetch(share->line, _MM_HINT_T1);
        share->line += 64;
        share->owed -= share->groups;
    }
}

#endif
