/* What the AMX kernels share: asking Linux for AMX's state, and the tile shape they all use. */
#ifndef PDSERVE_AMX_H
#define PDSERVE_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PDSERVE_HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX's state only to a process that asks for it (once per process); 1 when
 * granted. */
static inline int amx_request(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* All 8 tiles 16 rows of 64 bytes (16 float32 or 32 bfloat16): per thread, before its first
 * tile instruction; _tile_release() when done. */
static inline void amx_configure_tiles(void) {
    struct {
        uint8_t palette;
        uint8_t start_row;
        uint8_t reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}
#endif

#endif
