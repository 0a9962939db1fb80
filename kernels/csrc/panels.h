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

/* How far ahead of its reads a panel's W rows are prefetched, in bytes: with several rows of x the
 * FMAs between reads leave the hardware prefetcher behind. With one row the stream already runs
 * at the memory's speed, so the kernels skip the prefetches there. Chosen by
 * benchmarks/kernels.py --cpu. */
enum { PREFETCH_AHEAD_BYTES = 12288 };

/* Prefetch the 192-byte W row at p (three cache lines) into L1, or with into_l2 (a constant after
 * inlining) into L2 only (prefetcht1). With 6 rows and more the FMAs between reads leave the L1's
 * few miss buffers waiting on L1 prefetches (as in paged_attention.c), so bf16_linear.c takes L2
 * from 6 rows on; float32 runs the same either way and keeps L1 (benchmarks/kernels.py --cpu). */
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
 * panel's read overlaps FMAs instead of stalling the next group 0. With more than four groups
 * (over 32 rows) the lines are spread evenly over all of them, 3 / (groups - 1) lines a W row,
 * rather than one a row in groups 1-3: each software prefetch holds one of the L1's few miss
 * buffers until memory answers, and a line every W row left the FMAs waiting on them. Chosen by
 * benchmarks/kernels.py --cpu. */
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
