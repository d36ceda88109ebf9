/* y = x W^T + b in bfloat16 on Intel AMX tiles, for any number of rows of x, reading the weight
 * as nn.Linear stores it (no repacking at load, no second copy of the model).
 *
 * Shapes (row-major, contiguous, bfloat16): x [M, K] with K a multiple of 32, weight [N, K],
 * bias [N] or NULL, out [M, N] in bfloat16 or float32 (out_f32). Products and sums in float32
 * (AMX's TDPBF16PS, which treats subnormal inputs as zero), the bias added in float32, one
 * rounding of each output to bfloat16, or none.
 *
 * The trick that avoids repacking: TDPBF16PS multiplies an A tile of 16 rows x 32 bf16 by a
 * B tile stored as 16 rows of (16 columns x 2 consecutive k), the "VNNI" layout. A row-major
 * weight is already an A tile: 16 weight rows, 32 consecutive k each, at a stride of K. So the
 * kernel computes the transposed product out^T = W x^T, with x^T repacked into VNNI B tiles
 * (M x K values, a small copy next to the N x K weight) and each 16 x 16 float32 result tile
 * transposed on the way out (x^T and the results go through 16 x 16 register transposes).
 *
 * Work: the rows of x go in chunks of up to CHUNK_M (their B tiles stay in L2); within a chunk,
 * threads take weight row pairs (32 rows: two A tiles) a few at a time as they free up, and for
 * each pair run over the chunk's row-of-x pairs (two B tiles) with four accumulator tiles.
 * Handing out work dynamically, not in equal static ranges, is what makes a product fast on a
 * shared or hybrid machine: each core's matmul rate can drop for seconds at a time, independently
 * of the other (docs/kernels.md, Measured crossovers), and a static split waits for the slow one. Every output is still computed by one thread in one order, so the bits do not depend on
 * the schedule. A decode (M <= 16) is one chunk and one B tile: the weight streams from memory
 * once, at memory speed. N % 16 leftover weight rows go through plain float32 dot products.
 *
 * AMX needs the kernel's permission to use the tile state (Linux arch_prctl, once per process);
 * tuili_amx_init asks for it and returns 0 only when tiles can be used. */
#define _GNU_SOURCE /* syscall() from unistd.h, which -std=c11 hides */
#include <omp.h>
#include <stdlib.h>

#include "amx.h"
#include "common.h"
#include "kernels.h"

#ifdef HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define CHUNK_M 256 /* rows of x per chunk: its B tiles, 256 x K bf16, stay in L2 */
#define PREFETCH_STEPS 2
#define PAIRS_PER_GRAB 4 /* weight row pairs a thread takes at a time, prefetching the next of its own */

#ifdef HAVE_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int tuili_amx_init(void) {
    static int status = -1;
    if (status < 0) status = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : 1;
    return status;
}

/* A 16 x 16 transpose of 32-bit values held in sixteen registers, in four rounds of shuffles. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* x rows [m0, m0 + rows) -> VNNI B tiles: vnni[(b * K/2 + p) * 32 + 2 * i + e] = x[m0 + 16b + i][2p + e],
 * zero for rows past the chunk. A B tile is the transpose of 16 rows' k-pairs taken as 32-bit values. */
static void pack_x(const uint16_t *x, int64_t m0, int64_t rows, int64_t k, uint16_t *vnni) {
    const int64_t blocks = (rows + TILE - 1) / TILE, pairs = k / 2;
#pragma omp for schedule(dynamic)
    for (int64_t b = 0; b < blocks; b++) {
        float *dst = (float *)vnni + b * pairs * TILE;
        for (int64_t p = 0; p < pairs; p += TILE) {
            __m512 r[16];
            for (int i = 0; i < TILE; i++) {
                const int64_t row = b * TILE + i;
                r[i] = row < rows ? _mm512_loadu_ps((const float *)(x + (m0 + row) * k) + p) : _mm512_setzero_ps();
            }
            transpose16(r);
            for (int q = 0; q < TILE; q++) _mm512_store_ps(dst + (p + q) * TILE, r[q]);
        }
    }
}

/* Stores out[i][j] (row-major, N columns): bf16, or float32 when out_f32. */
static inline void store_out(void *out, int out_f32, int64_t at, float y) {
    if (out_f32)
        ((float *)out)[at] = y;
    else
        ((uint16_t *)out)[at] = f32_to_bf16(y);
}

/* Transposes accumulator tile c (c[n][m], float32) into out rows m0.. (rows_m of them), columns
 * n0 .. n0 + 15, adding bias; bf16 outputs rounded to nearest even as f32_to_bf16 does. */
static void store_tile(const float *c, const uint16_t *bias, void *out, int out_f32, int64_t n, int64_t n0,
                       int64_t m0, int64_t rows_m) {
    __m512 r[16];
    for (int j = 0; j < TILE; j++) r[j] = _mm512_load_ps(c + j * TILE);
    transpose16(r);
    const __m512 b = bias ? widen_bf16(bias + n0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows_m; i++) {
        const __m512 y = _mm512_add_ps(r[i], b);
        if (out_f32) {
            _mm512_storeu_ps((float *)out + (m0 + i) * n + n0, y);
        } else { /* sixteen lanes at once: a scalar loop here was a large share of the product (docs/kernels.md, Measured crossovers) */
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + (m0 + i) * n + n0), narrow_bf16(y));
        }
    }
}

/* Brings the next weight row pair toward L2 while the current one is multiplied by several x
 * pairs: `per_step` of its cache lines per k step, spread so they arrive before they are needed
 * and without a burst. The first pair of a thread's grab, and every pair of a decode (one x
 * pair), prefetch their own rows a few steps ahead instead. */
typedef struct {
    const uint16_t *rows; /* the next pair's first row */
    int64_t k, lines, done, per_step;
} prefetcher;

static inline void prefetch_next(prefetcher *p) {
    const int64_t per_row = p->k / TILE_K;
    for (int64_t q = 0; q < p->per_step && p->done < p->lines; q++, p->done++)
        __builtin_prefetch(p->rows + (p->done / per_row) * p->k + (p->done % per_row) * TILE_K, 0, 2);
}

/* Weight blocks w0 (and w0 + 1 when two) x x blocks b0 (and b0 + 1 when two), over all of K. */
static void tile_block(const uint16_t *w, const uint16_t *vnni, const uint16_t *bias, void *out, int out_f32,
                       int64_t n, int64_t k, int64_t w0, int two_w, int64_t b0, int two_b, int64_t m0,
                       int64_t rows_m, int prefetch_own, prefetcher *next) {
    const int64_t pairs = k / 2;
    const int64_t stride_w = k * 2;
    const uint16_t *wa = w + w0 * TILE * k, *wb = wa + TILE * k;
    const uint16_t *xa = vnni + b0 * pairs * 2 * TILE, *xb = xa + pairs * 2 * TILE;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < k; j += TILE_K) {
        /* Each of the 32 weight rows is its own stream through memory: ask for each row's line
         * PREFETCH_STEPS steps ahead (faster than the hardware prefetchers alone: docs/kernels.md, Measured crossovers),
         * unless the previous pair of this grab prefetched these rows. */
        const int64_t ahead = j + PREFETCH_STEPS * TILE_K;
        if (next != NULL) prefetch_next(next);
        if (prefetch_own && ahead < k) {
            for (int r = 0; r < TILE; r++) __builtin_prefetch(wa + r * k + ahead, 0, 2);
            if (two_w)
                for (int r = 0; r < TILE; r++) __builtin_prefetch(wb + r * k + ahead, 0, 2);
        }
        _tile_loadd(4, wa + j, stride_w);
        _tile_loadd(6, xa + j * TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_b) {
            _tile_loadd(7, xb + j * TILE, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_w) {
            _tile_loadd(5, wb + j, stride_w);
            _tile_dpbf16ps(2, 5, 6);
            if (two_b) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _Alignas(64) float c[TILE * TILE];
    const int64_t m_a = b0 * TILE, rows_a = rows_m - m_a < TILE ? rows_m - m_a : TILE;
    const int64_t rows_b = rows_m - m_a - TILE < TILE ? rows_m - m_a - TILE : TILE;
    _tile_stored(0, c, 64);
    store_tile(c, bias, out, out_f32, n, w0 * TILE, m0 + m_a, rows_a);
    if (two_b) {
        _tile_stored(1, c, 64);
        store_tile(c, bias, out, out_f32, n, w0 * TILE, m0 + m_a + TILE, rows_b);
    }
    if (two_w) {
        _tile_stored(2, c, 64);
        store_tile(c, bias, out, out_f32, n, (w0 + 1) * TILE, m0 + m_a, rows_a);
        if (two_b) {
            _tile_stored(3, c, 64);
            store_tile(c, bias, out, out_f32, n, (w0 + 1) * TILE, m0 + m_a + TILE, rows_b);
        }
    }
}

int tuili_linear_amx(const void *x_, const void *weight_, const void *bias_, void *out, int out_f32, int64_t m,
                     int64_t n, int64_t k, int num_threads) {
    const uint16_t *x = x_, *w = weight_, *bias = bias_;
    if (tuili_amx_init() != 0) return TUILI_NO_AMX;
    if (k % TILE_K != 0) return TUILI_BAD_SHAPE;
    const int64_t chunk = m < CHUNK_M ? m : CHUNK_M;
    uint16_t *vnni = aligned_alloc(64, (size_t)(((chunk + TILE - 1) / TILE) * TILE * k * 2));
    if (vnni == NULL) return TUILI_NO_MEMORY;
    const int64_t w_blocks = n / TILE, w_pairs = (w_blocks + 1) / 2;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
        for (int64_t m0 = 0; m0 < m; m0 += CHUNK_M) {
            const int64_t rows_m = m - m0 < CHUNK_M ? m - m0 : CHUNK_M;
            const int64_t x_blocks = (rows_m + TILE - 1) / TILE;
            pack_x(x, m0, rows_m, k, vnni); /* ends with the implicit barrier of omp for */
#pragma omp for schedule(dynamic, PAIRS_PER_GRAB)
            for (int64_t p = 0; p < w_pairs; p++) {
                const int two_w = 2 * p + 1 < w_blocks;
                const int64_t x_pairs = (x_blocks + 1) / 2;
                const int64_t next_rows = 2 * p + 2 >= w_blocks ? 0 : (2 * p + 3 < w_blocks ? 2 : 1) * TILE;
                const int64_t lines = next_rows * (k / TILE_K), steps = x_pairs * (k / TILE_K);
                prefetcher next = {w + (2 * p + 2) * TILE * k, k, lines, 0, (lines + steps - 1) / steps};
                const int first_of_grab = p % PAIRS_PER_GRAB == 0, last_of_grab = (p + 1) % PAIRS_PER_GRAB == 0;
                for (int64_t b = 0; b < x_blocks; b += 2)
                    tile_block(w, vnni, bias, out, out_f32, n, k, 2 * p, two_w, b, b + 1 < x_blocks, m0, rows_m,
                               b == 0 && (x_pairs == 1 || first_of_grab),
                               x_pairs > 1 && !last_of_grab ? &next : NULL);
            }
            /* The last TILE - 1 or fewer weight rows, one float32 dot product at a time. */
#pragma omp for schedule(static) collapse(2)
            for (int64_t r = w_blocks * TILE; r < n; r++) {
                for (int64_t i = 0; i < rows_m; i++) {
                    const uint16_t *xr = x + (m0 + i) * k, *wr = w + r * k;
                    float sum = bias ? bf16_to_f32(bias[r]) : 0.0f;
                    float acc = 0.0f;
                    for (int64_t j = 0; j < k; j++) acc = MADD(bf16_to_f32(xr[j]), bf16_to_f32(wr[j]), acc);
                    store_out(out, out_f32, (m0 + i) * n + r, acc + sum);
                }
            }
        }
        _tile_release();
    }
    free(vnni);
    return TUILI_OK;
}

#else

int tuili_amx_init(void) { return 1; }

int tuili_linear_amx(const void *x, const void *weight, const void *bias, void *out, int out_f32, int64_t m,
                     int64_t n, int64_t k, int num_threads) {
    (void)x, (void)weight, (void)bias, (void)out, (void)out_f32, (void)m, (void)n, (void)k, (void)num_threads;
    return TUILI_NO_AMX;
}

#endif
