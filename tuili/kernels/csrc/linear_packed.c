/* y = x W^T + b in bfloat16 with the weight packed once at load into 16-row panels (the layout of
 * AMX B tiles), for any number of rows of x: the one copy of a bf16 linear's weight on CPUs with
 * AVX512-BF16 (AMD Zen 4 and 5, Intel Cooper Lake and later) or AMX.
 *
 * Layout: packed[b][p][c][e] = W[16b + c][2p + e] for b < N/16, p < K/2. Each panel of 16
 * weight rows is K/2 lines of 64 bytes, each line one k pair of 16 outputs (the "VNNI" layout).
 * That is exactly the B operand of TDPBF16PS (16 such lines: 32 k of 16 outputs), and one
 * 64-byte load of it is the weight operand of VDPBF16PS for 16 outputs at once. A panel is one
 * contiguous run of 32 K bytes, read front to back, where a row-major weight read by tiles is 16
 * or 32 streams at a stride of K.
 *
 * Shapes (contiguous, bfloat16): x [M, K] with K a multiple of 32, packed as above with N a
 * multiple of 16, bias [N] or NULL, out [M, N] in bfloat16 or float32 (out_f32). Products and
 * sums in float32, the bias added in float32, one rounding of each output to bfloat16, or none.
 *
 * - M <= GEMV_MAX_ROWS (decode), with AVX512-BF16: VDPBF16PS on 16 outputs per instruction, x's
 *   k pair broadcast; two accumulator chains per row and panel (even and odd k pairs), four
 *   panels at a time. Threads take equal static ranges of panels: dynamic hand-out slowed the
 *   row-major GEMV (docs/kernels.md).
 * - more rows, with AMX: the rows of x are A tiles read in place (16 rows x 32 k at a stride of
 *   K; a last block of fewer than 16 rows is copied into a zero-padded block), the panels B tiles,
 *   four accumulator tiles per two x blocks and two panels, stored straight into out's rows (no
 *   transposes). Work items are (CHUNK_M rows of x, PAIRS_PER_GRAB panel pairs), handed out as
 *   threads free up: on a shared VM each core's matmul rate can drop for seconds at a time,
 *   independently of the other (docs/kernels.md, Measured crossovers), and a static split waits for
 *   the slow core.
 * - more rows without AMX (dot_product): the GEMV's arithmetic in register blocks of rows and
 *   panels, each thread taking groups of panels that stay in L2 while every row block passes.
 *
 * A row's result depends only on that row and the weights, never on the other rows, the schedule
 * or the thread count: a sequence gets the same bits at every batch size of one path. Without
 * AMX there is one path (the GEMV and dot_product compute every row alike), so the bits do not
 * depend on the batch size at all; with AMX, `one_path` runs the tiles at every row count (the
 * batch-invariant mode), else the GEMV takes up to GEMV_MAX_ROWS rows. */
#define _GNU_SOURCE
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "common.h"
#include "kernels.h"

/* A panel of the layout is one AMX tile of rows (layout.py AMX_TILE_ROWS) and one AVX-512 register of
 * float32 outputs for the GEMV: the code below relies on both being 16. */
_Static_assert(TUILI_AMX_TILE_ROWS == 16, "a panel must be 16 rows: one AMX tile, one register of float32 lanes");

#define GEMV_MAX_ROWS 4
#define CHUNK_M 256         /* rows of x per work item: their tiles stay in L2 while the panels pass */
#define PAIRS_PER_GRAB 2    /* panel pairs per work item */
#define PREFETCH_STEPS 4    /* k steps of 32 ahead that a lone x pair asks for its own panel lines */
/* The GEMV asks for the line GEMV_PREFETCH bytes ahead of its loads in each stream, into L2: the
 * fastest distance measured (docs/kernels.md, Measured crossovers). */
#define GEMV_PREFETCH 4096
/* Panels a GEMV thread reads at once, from as many places in its range: one sequential stream per
 * core keeps too few reads in flight (docs/kernels.md, Measured crossovers). */
#define GEMV_STREAMS 4

#if defined(__AVX512BF16__) || defined(HAVE_AMX)

/* 16 lanes of bf16 (the bias at n0) widened to float32, or zeros. */
static inline __m512 load_bias(const uint16_t *bias, int64_t n0) {
    return bias == NULL ? _mm512_setzero_ps() : widen_bf16(bias + n0);
}

/* out[row][n0 .. n0 + 15] = y + bias, rounded to bf16 unless out_f32. */
static inline void store16(void *out, int out_f32, int64_t n, int64_t row, int64_t n0, __m512 y) {
    if (out_f32)
        _mm512_storeu_ps((float *)out + row * n + n0, y);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + row * n + n0), narrow_bf16(y));
}
#endif

#ifdef __AVX512BF16__
/* k pairs p and p + 1 of one panel into the `even` and `odd` accumulators of each row of x. */
#define GEMV_STEP(panel, p, even, odd)                                                                \
    do {                                                                                             \
        __builtin_prefetch((const char *)((panel) + (p) * 32) + GEMV_PREFETCH, 0, 2);               \
        __builtin_prefetch((const char *)((panel) + (p) * 32) + GEMV_PREFETCH + 64, 0, 2);          \
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((panel) + (p) * 32);                       \
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((panel) + (p) * 32 + 32);                  \
        for (int r = 0; r < rows; r++) {                                                             \
            const int32_t *xr = (const int32_t *)(x + r * k);                                        \
            even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(xr[p]), w0);              \
            odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(xr[(p) + 1]), w1);          \
        }                                                                                            \
    } while (0)

/* Panels [b0, b1) for `rows` rows of x (a constant after inlining), GEMV_STREAMS panels at a
 * time, one from each of as many equal parts of the range. */
static inline __attribute__((always_inline)) void gemv_panels(const uint16_t *x, const uint16_t *w,
                                                              const uint16_t *bias, void *out, int out_f32,
                                                              int64_t n, int64_t k, int64_t b0, int64_t b1,
                                                              const int rows) {
    const int64_t pairs = k / 2, part = (b1 - b0) / GEMV_STREAMS;
    for (int64_t i = 0; i < part; i++) {
        __m512 even[GEMV_STREAMS][GEMV_MAX_ROWS], odd[GEMV_STREAMS][GEMV_MAX_ROWS];
        for (int s = 0; s < GEMV_STREAMS; s++)
            for (int r = 0; r < rows; r++) even[s][r] = odd[s][r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p += 2)
            for (int s = 0; s < GEMV_STREAMS; s++) GEMV_STEP(w + (b0 + s * part + i) * pairs * 32, p, even[s], odd[s]);
        for (int s = 0; s < GEMV_STREAMS; s++) {
            const int64_t b = b0 + s * part + i;
            const __m512 bv = load_bias(bias, b * 16);
            for (int r = 0; r < rows; r++)
                store16(out, out_f32, n, r, b * 16, _mm512_add_ps(_mm512_add_ps(even[s][r], odd[s][r]), bv));
        }
    }
    for (int64_t b = b0 + GEMV_STREAMS * part; b < b1; b++) {
        const uint16_t *panel = w + b * pairs * 32;
        __m512 even[GEMV_MAX_ROWS], odd[GEMV_MAX_ROWS];
        for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p += 2) GEMV_STEP(panel, p, even, odd);
        const __m512 bv = load_bias(bias, b * 16);
        for (int r = 0; r < rows; r++)
            store16(out, out_f32, n, r, b * 16, _mm512_add_ps(_mm512_add_ps(even[r], odd[r]), bv));
    }
}

static void gemv(const uint16_t *x, const uint16_t *w, const uint16_t *bias, void *out, int out_f32, int64_t m,
                 int64_t n, int64_t k, int num_threads) {
    const int64_t panels = n / TUILI_AMX_TILE_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t b0 = panels * t / threads, b1 = panels * (t + 1) / threads;
        switch (m) {
        case 1: gemv_panels(x, w, bias, out, out_f32, n, k, b0, b1, 1); break;
        case 2: gemv_panels(x, w, bias, out, out_f32, n, k, b0, b1, 2); break;
        case 3: gemv_panels(x, w, bias, out, out_f32, n, k, b0, b1, 3); break;
        default: gemv_panels(x, w, bias, out, out_f32, n, k, b0, b1, 4); break;
        }
    }
}
#endif

#ifdef __AVX512BF16__
/* More rows than the GEMV takes, on CPUs without AMX: the same arithmetic as the GEMV for every
 * row (the same k pairs into the same even and odd accumulators, in the same order, then even +
 * odd + bias), so that a row's result never depends on how many rows came with it. Blocks of
 * DOT_ROWS rows times DOT_PANELS panels keep 16 accumulators in registers; a thread takes a group
 * of panels (in L2 while it is used) and runs every row block of x against it. */
#define DOT_ROWS 4
#define DOT_PANELS 2

static inline __attribute__((always_inline)) void dot_block(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                                                            void *out, int out_f32, int64_t n, int64_t k, int64_t row0,
                                                            int64_t b, const int rows, const int panels) {
    const int64_t pairs = k / 2;
    __m512 even[DOT_ROWS][DOT_PANELS], odd[DOT_ROWS][DOT_PANELS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++) even[r][j] = odd[r][j] = _mm512_setzero_ps();
    const uint16_t *panel[DOT_PANELS];
    for (int j = 0; j < panels; j++) panel[j] = w + (b + j) * pairs * 32;
    for (int64_t p = 0; p < pairs; p += 2) {
        __m512bh xe[DOT_ROWS], xo[DOT_ROWS];
        for (int r = 0; r < rows; r++) {
            const int32_t *xr = (const int32_t *)(x + (row0 + r) * k);
            xe[r] = (__m512bh)_mm512_set1_epi32(xr[p]);
            xo[r] = (__m512bh)_mm512_set1_epi32(xr[p + 1]);
        }
        for (int j = 0; j < panels; j++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel[j] + p * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel[j] + p * 32 + 32);
            for (int r = 0; r < rows; r++) {
                even[r][j] = _mm512_dpbf16_ps(even[r][j], xe[r], w0);
                odd[r][j] = _mm512_dpbf16_ps(odd[r][j], xo[r], w1);
            }
        }
    }
    for (int j = 0; j < panels; j++) {
        const __m512 bv = load_bias(bias, (b + j) * 16);
        for (int r = 0; r < rows; r++)
            store16(out, out_f32, n, row0 + r, (b + j) * 16, _mm512_add_ps(_mm512_add_ps(even[r][j], odd[r][j]), bv));
    }
}

#define DOT_GROUP 8 /* panels per work item: 8 x K x 32 bytes, in L2 while every row block passes */

static void dot_product(const uint16_t *x, const uint16_t *w, const uint16_t *bias, void *out, int out_f32, int64_t m,
                        int64_t n, int64_t k, int num_threads) {
    const int64_t panels = n / 16, groups = (panels + DOT_GROUP - 1) / DOT_GROUP;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t b_end = (g + 1) * DOT_GROUP < panels ? (g + 1) * DOT_GROUP : panels;
        for (int64_t row0 = 0; row0 < m; row0 += DOT_ROWS) {
            const int64_t rows = m - row0 < DOT_ROWS ? m - row0 : DOT_ROWS;
            for (int64_t b = g * DOT_GROUP; b < b_end; b += DOT_PANELS) {
                const int both = b + 1 < b_end;
                switch (rows * 2 + both) {
                case 2: dot_block(x, w, bias, out, out_f32, n, k, row0, b, 1, 1); break;
                case 3: dot_block(x, w, bias, out, out_f32, n, k, row0, b, 1, 2); break;
                case 4: dot_block(x, w, bias, out, out_f32, n, k, row0, b, 2, 1); break;
                case 5: dot_block(x, w, bias, out, out_f32, n, k, row0, b, 2, 2); break;
                case 6: dot_block(x, w, bias, out, out_f32, n, k, row0, b, 3, 1); break;
                case 7: dot_block(x, w, bias, out, out_f32, n, k, row0, b, 3, 2); break;
                case 8: dot_block(x, w, bias, out, out_f32, n, k, row0, b, 4, 1); break;
                default: dot_block(x, w, bias, out, out_f32, n, k, row0, b, 4, 2); break;
                }
            }
        }
    }
}
#endif

#ifdef HAVE_AMX

/* Accumulator tile t's 16 x 16 float32 (rows of x, outputs n0..) plus bias into out rows row0..
 * (`rows` of them: a padded last block stores only its real rows). */
static inline void store_tile(int t, const uint16_t *bias, void *out, int out_f32, int64_t n, int64_t row0,
                              int64_t rows, int64_t n0) {
    _Alignas(64) float c[TILE * TILE];
    switch (t) { /* tile numbers must be constants */
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
    }
    const __m512 bv = load_bias(bias, n0);
    for (int64_t i = 0; i < rows; i++) store16(out, out_f32, n, row0 + i, n0, _mm512_add_ps(_mm512_load_ps(c + i * TILE), bv));
}

/* Spreads prefetches of `lines` cache lines from `at` over the k steps of the current panel pair,
 * `per_step` at a time, so the next pair is in L2 when its turn comes, without a burst. */
typedef struct {
    const char *at;
    int64_t lines, done, per_step;
} prefetcher;

static inline void prefetch_some(prefetcher *p) {
    for (int64_t q = 0; q < p->per_step && p->done < p->lines; q++, p->done++)
        __builtin_prefetch(p->at + p->done * 64, 0, 2);
}

/* x blocks a0 (and a1 when not NULL) times panels w0 (and w1 when not NULL) over all of K, into
 * out rows row0.. and columns n0... */
static void tile_block(const uint16_t *a0, const uint16_t *a1, const uint16_t *w0, const uint16_t *w1,
                       const uint16_t *bias, void *out, int out_f32, int64_t n, int64_t k, int64_t row0,
                       int64_t rows, int64_t n0, int prefetch_own, prefetcher *next) {
    const int64_t stride = k * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < k; j += TILE_K) {
        if (next != NULL) prefetch_some(next);
        if (prefetch_own && j + PREFETCH_STEPS * TILE_K < k) { /* 16 lines of each panel per step */
            const char *ahead = (const char *)(w0 + (j + PREFETCH_STEPS * TILE_K) * 16);
            for (int q = 0; q < 16; q++) __builtin_prefetch(ahead + q * 64, 0, 2);
            if (w1 != NULL) {
                ahead = (const char *)(w1 + (j + PREFETCH_STEPS * TILE_K) * 16);
                for (int q = 0; q < 16; q++) __builtin_prefetch(ahead + q * 64, 0, 2);
            }
        }
        _tile_loadd(4, a0 + j, stride);
        _tile_loadd(6, w0 + j * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (w1 != NULL) {
            _tile_loadd(7, w1 + j * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (a1 != NULL) {
            _tile_loadd(5, a1 + j, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (w1 != NULL) _tile_dpbf16ps(3, 5, 7);
        }
    }
    const int64_t rows_a = rows < TILE ? rows : TILE, rows_b = rows - rows_a;
    store_tile(0, bias, out, out_f32, n, row0, rows_a, n0);
    if (w1 != NULL) store_tile(1, bias, out, out_f32, n, row0, rows_a, n0 + TILE);
    if (a1 != NULL) {
        store_tile(2, bias, out, out_f32, n, row0 + TILE, rows_b, n0);
        if (w1 != NULL) store_tile(3, bias, out, out_f32, n, row0 + TILE, rows_b, n0 + TILE);
    }
}

static int amx_product(const uint16_t *x, const uint16_t *w, const uint16_t *bias, void *out, int out_f32, int64_t m,
                       int64_t n, int64_t k, int num_threads) {
    const int64_t panel = k / 2 * 32, panels = n / TILE, panel_pairs = (panels + 1) / 2;
    const int64_t full_blocks = m / TILE, blocks = (m + TILE - 1) / TILE;
    uint16_t *last = NULL; /* the rows of a last block of fewer than 16, then zeros */
    if (blocks > full_blocks) {
        last = aligned_alloc(64, (size_t)TILE * k * 2);
        if (last == NULL) return TUILI_NO_MEMORY;
        const int64_t rows = m - full_blocks * TILE;
        memcpy(last, x + full_blocks * TILE * k, (size_t)rows * k * 2);
        memset(last + rows * k, 0, (size_t)(TILE - rows) * k * 2);
    }
    const int64_t chunks = (m + CHUNK_M - 1) / CHUNK_M, grabs = (panel_pairs + PAIRS_PER_GRAB - 1) / PAIRS_PER_GRAB;
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < chunks * grabs; item++) {
            const int64_t chunk = item / grabs, grab = item % grabs;
            const int64_t first_block = chunk * (CHUNK_M / TILE);
            const int64_t end_block = first_block + CHUNK_M / TILE < blocks ? first_block + CHUNK_M / TILE : blocks;
            const int64_t x_pairs = (end_block - first_block + 1) / 2;
            const int64_t first_pair = grab * PAIRS_PER_GRAB;
            const int64_t end_pair = first_pair + PAIRS_PER_GRAB < panel_pairs ? first_pair + PAIRS_PER_GRAB : panel_pairs;
            for (int64_t pp = first_pair; pp < end_pair; pp++) {
                const uint16_t *w0 = w + 2 * pp * panel, *w1 = 2 * pp + 1 < panels ? w0 + panel : NULL;
                /* the next pair of this grab, if any, comes toward L2 during this one's x pairs */
                const int64_t next_panels = pp + 1 < end_pair ? (2 * pp + 3 < panels ? 2 : 1) : 0;
                const int64_t lines = next_panels * panel * 2 / 64, steps = x_pairs * (k / TILE_K);
                prefetcher next = {(const char *)(w0 + 2 * panel), lines, 0, (lines + steps - 1) / steps};
                for (int64_t b = first_block; b < end_block; b += 2) {
                    const uint16_t *a0 = b < full_blocks ? x + b * TILE * k : last;
                    const uint16_t *a1 = b + 1 >= end_block ? NULL : (b + 1 < full_blocks ? a0 + TILE * k : last);
                    const int64_t rows = (m - b * TILE) < 2 * TILE ? m - b * TILE : 2 * TILE;
                    tile_block(a0, a1, w0, w1, bias, out, out_f32, n, k, b * TILE, rows, 2 * pp * TILE,
                               b == first_block && (x_pairs == 1 || pp == first_pair), x_pairs > 1 ? &next : NULL);
                }
            }
        }
        _tile_release();
    }
    free(last);
    return TUILI_OK;
}

#endif /* HAVE_AMX */

int tuili_linear_packed(const void *x_, const void *packed_, const void *bias_, void *out, int out_f32, int64_t m,
                        int64_t n, int64_t k, int one_path, int num_threads) {
    const uint16_t *x = x_, *w = packed_, *bias = bias_;
    if (k % TUILI_AMX_K_MULTIPLE != 0 || n % TUILI_AMX_TILE_ROWS != 0) return TUILI_BAD_SHAPE;
    if (num_threads < 1) num_threads = 1;
    if (m < 1 || n < 1) return TUILI_OK;
#ifdef HAVE_AMX
    /* one_path: AMX tiles at every row count, so that a row's bits never depend on M. */
    if (one_path && tuili_amx_init() == 0) return amx_product(x, w, bias, out, out_f32, m, n, k, num_threads);
#else
    (void)one_path;
#endif
#ifdef __AVX512BF16__
    if (m <= GEMV_MAX_ROWS) {
        gemv(x, w, bias, out, out_f32, m, n, k, num_threads);
        return TUILI_OK;
    }
#endif
#ifdef HAVE_AMX
    if (tuili_amx_init() == 0) return amx_product(x, w, bias, out, out_f32, m, n, k, num_threads);
#endif
#ifdef __AVX512BF16__
    dot_product(x, w, bias, out, out_f32, m, n, k, num_threads);
    return TUILI_OK;
#else
    (void)x, (void)w, (void)bias, (void)out, (void)out_f32;
    return TUILI_NO_AMX;
#endif
}

int tuili_linear_packed_available(void) {
#if defined(__AVX512BF16__) || defined(HAVE_AMX)
    return 1;
#else
    return 0;
#endif
}
