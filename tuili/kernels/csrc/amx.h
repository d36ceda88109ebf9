/* What the AMX kernels (linear_amx.c, prompt_attention.c) share: whether this build has AMX, and
 * the one tile configuration both use. The process asks the OS for the tile state once
 * (tuili_amx_init, linear_amx.c); each thread loads the configuration before its first tile. */
#ifndef TUILI_KERNELS_AMX_H
#define TUILI_KERNELS_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#define HAVE_AMX 1

#define TILE TUILI_AMX_TILE_ROWS     /* rows of a tile, and float32 columns of an accumulator */
#define TILE_K TUILI_AMX_K_MULTIPLE /* bf16 values in a tile row of 64 bytes */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* All eight tiles 16 rows of 64 bytes: a bf16 operand of 16 x 32 values or a float32
 * accumulator of 16 x 16. */
static inline void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = TILE;
    }
    _tile_loadconfig(&cfg);
}
#endif

#endif
