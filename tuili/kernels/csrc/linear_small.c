/* y = x W^T + b for a few rows of x (decode at batch 1..8): a matrix-vector product whose speed
 * is the rate at which the weight streams from memory.
 *
 * Shapes (row-major, contiguous): x [M, K] with 1 <= M <= MAX_M, weight [N, K], bias [N] or
 * NULL, out [M, N]. Either everything is float32, or x, weight and bias are bfloat16 with float32
 * accumulation (the bias added in float32 first) and out is bfloat16 (one rounding of each
 * output) or float32 (no rounding: logits from bf16 weights without bf16's ties).
 *
 * Each thread takes one static chunk of output rows and reads each weight row once, front to
 * back, for all M rows of x (which stay in L1 or L2: 64 KiB for M = 8, K = 4096 in bf16).
 * Weight rows go a few at a time (unroll(M)), each with its own accumulators: several
 * independent streams keep enough cache misses in flight, and the x values loaded for one step
 * serve all of them; software prefetches run two steps ahead.
 *
 * Code paths: bf16 with AVX512-BF16's vdpbf16ps (two products and their sum per lane and
 * instruction; it treats subnormal inputs and results as zero), AVX-512 FMA for float32 and for
 * bf16 on CPUs without AVX512-BF16 (the weight widened to float32 in registers), and plain C
 * (independent lanes that GCC and Clang vectorize) for other CPUs. */
#include <omp.h>
#include <stdlib.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define AVX512 1
#endif

#include "common.h"
#include "kernels.h"

#define MAX_M 8
#define MAX_UNROLL 4
#define LANES 16 /* float32 lanes of the plain C path: one AVX-512 register, two AVX2 ones */

typedef struct {
    const void *x, *weight, *bias;
    const float *x_f32; /* x as float32: x itself, or a widened copy when x is bfloat16 */
    void *out;
    int dtype, out_dtype;
    int64_t m, n, k;
} linear_args;

/* Weight rows per step: M x unroll accumulators, unroll weight vectors and one x vector must fit
 * in the 32 AVX-512 registers (M = 8: 16 + 2 + 1). */
static inline int unroll(int64_t m) { return m <= 4 ? 4 : 2; }

/* Computes sums[i * R + r] = x[i] . weight[row + r] for all M rows of x and R weight rows. */
typedef void (*rows_fn)(const linear_args *a, int64_t row, float *sums);

#ifdef AVX512
/* The kernels below take any M <= MAX_M and R <= MAX_UNROLL and are inlined into one function
 * per constant (M, R) (SPECIALIZE), so their loops unroll and the accumulators are registers. */
#define KERNEL static inline __attribute__((always_inline)) void
/* Unrolled before GCC's scalar replacement of aggregates: without it acc[][] stays an array in
 * memory, stored on every step. */
#define UNROLLED _Pragma("GCC unroll 8")

/* Asks for element `index` of the weight w into L2. The kernels ask, at every 64 bytes of a
 * step's rows, for the same place PREFETCH_STEPS steps (of R rows) ahead: faster from memory than
 * the hardware prefetchers alone (docs/kernels.md, Measured crossovers), most at larger M, where the arithmetic between loads keeps fewer of them in flight. Addresses past
 * the weight's end are harmless (a prefetch never faults), so they are computed as integers.
 * __builtin_prefetch, because GCC 12 deletes _mm_prefetch here (dead-code elimination). */
#define PREFETCH_STEPS 2
static inline void prefetch_ahead(const void *w, int64_t index, size_t size) {
    __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)index * size), 0, 2); /* read, into L2 */
}

/* float32: 16 products per FMA; the tail of K through masked loads (which read nothing past it). */
KERNEL dot_f32(const linear_args *a, int64_t row, float *sums, const int M, const int R) {
    const float *x = a->x_f32, *w = (const float *)a->weight + row * a->k;
    const int64_t k = a->k;
    __m512 acc[MAX_M][MAX_UNROLL];
    UNROLLED for (int i = 0; i < M; i++)
        UNROLLED for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        const __mmask16 mask = k - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - j)) - 1);
        __m512 wv[MAX_UNROLL];
        UNROLLED for (int r = 0; r < R; r++) prefetch_ahead(w, (PREFETCH_STEPS * R + r) * k + j, sizeof *w);
        UNROLLED for (int r = 0; r < R; r++) wv[r] = _mm512_maskz_loadu_ps(mask, w + r * k + j);
        UNROLLED for (int i = 0; i < M; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * k + j);
            UNROLLED for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
        }
    }
    UNROLLED for (int i = 0; i < M; i++)
        UNROLLED for (int r = 0; r < R; r++) sums[i * R + r] = _mm512_reduce_add_ps(acc[i][r]);
}

#ifdef __AVX512BF16__ /* implies AVX512BW */
/* bfloat16: 32 products per vdpbf16ps into 16 float32 lanes. */
KERNEL dot_bf16(const linear_args *a, int64_t row, float *sums, const int M, const int R) {
    const uint16_t *x = a->x, *w = (const uint16_t *)a->weight + row * a->k;
    const int64_t k = a->k;
    __m512 acc[MAX_M][MAX_UNROLL];
    UNROLLED for (int i = 0; i < M; i++)
        UNROLLED for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 32) {
        const __mmask32 mask = k - j >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (k - j)) - 1);
        __m512bh wv[MAX_UNROLL];
        UNROLLED for (int r = 0; r < R; r++) prefetch_ahead(w, (PREFETCH_STEPS * R + r) * k + j, sizeof *w);
        UNROLLED for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * k + j);
        UNROLLED for (int i = 0; i < M; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * k + j);
            UNROLLED for (int r = 0; r < R; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
        }
    }
    UNROLLED for (int i = 0; i < M; i++)
        UNROLLED for (int r = 0; r < R; r++) sums[i * R + r] = _mm512_reduce_add_ps(acc[i][r]);
}
#else
/* bfloat16 without AVX512-BF16: the weight widened to float32 in registers (exactly: a shift
 * into the high half), x read from its float32 copy. */
KERNEL dot_bf16(const linear_args *a, int64_t row, float *sums, const int M, const int R) {
    const float *x = a->x_f32;
    const uint16_t *w = (const uint16_t *)a->weight + row * a->k;
    const int64_t k = a->k;
    __m512 acc[MAX_M][MAX_UNROLL];
    UNROLLED for (int i = 0; i < M; i++)
        UNROLLED for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        const __mmask16 mask = k - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - j)) - 1);
        __m512 wv[MAX_UNROLL];
        if ((j & 16) == 0)
            UNROLLED for (int r = 0; r < R; r++) prefetch_ahead(w, (PREFETCH_STEPS * R + r) * k + j, sizeof *w);
        UNROLLED for (int r = 0; r < R; r++) {
            const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, w + r * k + j));
            wv[r] = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
        }
        UNROLLED for (int i = 0; i < M; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * k + j);
            UNROLLED for (int r = 0; r < R; r++) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
        }
    }
    UNROLLED for (int i = 0; i < M; i++)
        UNROLLED for (int r = 0; r < R; r++) sums[i * R + r] = _mm512_reduce_add_ps(acc[i][r]);
}
#endif

/* One function per (kernel, M, R): R is 1 (the rows left over) or unroll(M). */
#define SPECIALIZE(dot, M, R) \
    static void dot##_##M##_##R(const linear_args *a, int64_t row, float *sums) { dot(a, row, sums, M, R); }
#define SPECIALIZE_M(dot, M, R) SPECIALIZE(dot, M, 1) SPECIALIZE(dot, M, R)
#define SPECIALIZE_ALL(dot)                                                                            \
    SPECIALIZE_M(dot, 1, 4) SPECIALIZE_M(dot, 2, 4) SPECIALIZE_M(dot, 3, 4) SPECIALIZE_M(dot, 4, 4)    \
    SPECIALIZE_M(dot, 5, 2) SPECIALIZE_M(dot, 6, 2) SPECIALIZE_M(dot, 7, 2) SPECIALIZE_M(dot, 8, 2)    \
    static const rows_fn dot##_table[MAX_M][2] = {                                                     \
        {dot##_1_1, dot##_1_4}, {dot##_2_1, dot##_2_4}, {dot##_3_1, dot##_3_4}, {dot##_4_1, dot##_4_4}, \
        {dot##_5_1, dot##_5_2}, {dot##_6_1, dot##_6_2}, {dot##_7_1, dot##_7_2}, {dot##_8_1, dot##_8_2}, \
    };
SPECIALIZE_ALL(dot_f32)
SPECIALIZE_ALL(dot_bf16)

/* The function for M rows of x and R weight rows (1 or unroll(M)). */
static rows_fn kernel_for(const linear_args *a, int R) {
    return (a->dtype == TUILI_F32 ? dot_f32_table : dot_bf16_table)[a->m - 1][R == 1 ? 0 : 1];
}

#else /* no AVX-512 */

/* LANES independent partial sums per (x row, weight row), which the compiler vectorizes without
 * reassociating anything; the tail of K goes to lane 0. */
static void dot_portable(const linear_args *a, int64_t row, float *sums, int R) {
    const float *x = a->x_f32;
    const int64_t k = a->k, m = a->m;
    float acc[MAX_M][MAX_UNROLL][LANES] = {{{0}}};
    float w[MAX_UNROLL][LANES];
    int64_t j = 0;
    for (; j + LANES <= k; j += LANES) {
        for (int r = 0; r < R; r++) {
            if (a->dtype == TUILI_F32) {
                memcpy(w[r], (const float *)a->weight + (row + r) * k + j, sizeof w[r]);
            } else {
                const uint16_t *src = (const uint16_t *)a->weight + (row + r) * k + j;
                for (int l = 0; l < LANES; l++) w[r][l] = bf16_to_f32(src[l]);
            }
        }
        for (int64_t i = 0; i < m; i++)
            for (int r = 0; r < R; r++)
                for (int l = 0; l < LANES; l++) acc[i][r][l] = MADD(x[i * k + j + l], w[r][l], acc[i][r][l]);
    }
    for (; j < k; j++) {
        for (int r = 0; r < R; r++) {
            const int64_t at = (row + r) * k + j;
            const float wv = a->dtype == TUILI_F32 ? ((const float *)a->weight)[at]
                                                   : bf16_to_f32(((const uint16_t *)a->weight)[at]);
            for (int64_t i = 0; i < m; i++) acc[i][r][0] = MADD(x[i * k + j], wv, acc[i][r][0]);
        }
    }
    for (int64_t i = 0; i < m; i++) {
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int l = 0; l < LANES; l++) s += acc[i][r][l];
            sums[i * R + r] = s;
        }
    }
}

static void dot_portable_1(const linear_args *a, int64_t row, float *sums) { dot_portable(a, row, sums, 1); }
static void dot_portable_2(const linear_args *a, int64_t row, float *sums) { dot_portable(a, row, sums, 2); }
static void dot_portable_4(const linear_args *a, int64_t row, float *sums) { dot_portable(a, row, sums, 4); }

static rows_fn kernel_for(const linear_args *a, int R) {
    (void)a; /* one kernel for both dtypes */
    return R == 1 ? dot_portable_1 : R == 2 ? dot_portable_2 : dot_portable_4;
}

/* Prompts (tuili_linear_rows): dot_portable's sums, element for element, for I rows of x (row
 * stride k) and R rows of a float32 weight tile w (row stride k), into sums[i * R + r]. I x R
 * pairs of LANES lanes are 12 AVX2 registers at I = 3, R = 2, the two weight vectors 4 more:
 * the accumulators stay in registers, where dot_portable at 8 rows keeps them in memory. */
#define TILE_X 3
#define TILE_W 2
static inline __attribute__((always_inline)) void dot_tile(const float *restrict x, const float *restrict w,
                                                           int64_t k, int I, int R, float *restrict sums) {
    float acc[TILE_X][TILE_W][LANES] = {{{0}}};
    int64_t j = 0;
    for (; j + LANES <= k; j += LANES)
        for (int i = 0; i < I; i++)
            for (int r = 0; r < R; r++)
                for (int l = 0; l < LANES; l++) acc[i][r][l] = MADD(x[i * k + j + l], w[r * k + j + l], acc[i][r][l]);
    for (; j < k; j++)
        for (int i = 0; i < I; i++)
            for (int r = 0; r < R; r++) acc[i][r][0] = MADD(x[i * k + j], w[r * k + j], acc[i][r][0]);
    for (int i = 0; i < I; i++)
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int l = 0; l < LANES; l++) s += acc[i][r][l];
            sums[i * R + r] = s;
        }
}

/* One specialised copy per (I, R), so that the loops unroll into registers. */
static void dot_tile_any(const float *x, const float *w, int64_t k, int I, int R, float *sums) {
    if (I == TILE_X && R == TILE_W)
        dot_tile(x, w, k, TILE_X, TILE_W, sums);
    else if (R == TILE_W)
        dot_tile(x, w, k, I == 2 ? 2 : 1, TILE_W, sums);
    else
        dot_tile(x, w, k, I, 1, sums);
}
#endif

/* Adds the bias to sums[i * R + r] (row i of x, weight row row + r) and stores it to out. */
static void store_rows(const linear_args *a, int64_t row, int R, const float *sums) {
    for (int r = 0; r < R; r++) {
        float b = 0.0f;
        if (a->bias != NULL)
            b = a->dtype == TUILI_F32 ? ((const float *)a->bias)[row + r]
                                      : bf16_to_f32(((const uint16_t *)a->bias)[row + r]);
        for (int64_t i = 0; i < a->m; i++) {
            const float y = sums[i * R + r] + b;
            if (a->out_dtype == TUILI_F32)
                ((float *)a->out)[i * a->n + row + r] = y;
            else
                ((uint16_t *)a->out)[i * a->n + row + r] = f32_to_bf16(y);
        }
    }
}

/* Whether the kernels read x as float32 (all but vdpbf16ps), so a bfloat16 x needs a copy. */
static int reads_x_as_f32(int dtype) {
#ifdef __AVX512BF16__
    (void)dtype;
    return 0;
#else
    return dtype == TUILI_BF16;
#endif
}

/* 1 <= m <= MAX_M and the shapes are checked by the caller (tuili/kernels/cpu.py). */
int tuili_linear_small(const void *x, const void *weight, const void *bias, void *out, int dtype, int out_dtype,
                       int64_t m, int64_t n, int64_t k, int num_threads) {
    linear_args a = {x, weight, bias, x, out, dtype, out_dtype, m, n, k};
    float *x_f32 = NULL;
    if (reads_x_as_f32(dtype)) {
        x_f32 = malloc((size_t)(m * k) * sizeof(float));
        if (x_f32 == NULL) return TUILI_NO_MEMORY;
        for (int64_t i = 0; i < m * k; i++) x_f32[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        a.x_f32 = x_f32;
    }
    const int step = unroll(m);
    const rows_fn whole = kernel_for(&a, step), single = kernel_for(&a, 1);
    if (num_threads < 1) num_threads = 1;
    /* Static chunks of whole steps; a thread's leftover rows (at most step - 1, only in the last
     * chunk) one at a time. */
    const int64_t steps = (n + step - 1) / step;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per_thread = (steps + threads - 1) / threads;
        const int64_t begin = t * per_thread * step;
        const int64_t end = begin + per_thread * step < n ? begin + per_thread * step : n;
        float sums[MAX_M * MAX_UNROLL];
        int64_t row = begin;
        for (; row + step <= end; row += step) {
            whole(&a, row, sums);
            store_rows(&a, row, step, sums);
        }
        for (; row < end; row++) {
            single(&a, row, sums);
            store_rows(&a, row, 1, sums);
        }
    }
    free(x_f32);
    return TUILI_OK;
}

/* x [M, K] for any M >= 1: row i of out is bit for bit what tuili_linear_small gives row i alone.
 * With AVX-512, blocks of MAX_M rows through it. Elsewhere (dot_portable) a tiled product: each
 * thread takes tiles of weight rows (widened to float32 once, in L2) and runs every row of x
 * against them, TILE_X rows of x by TILE_W weight rows at a time (dot_tile): the arithmetic per
 * output of dot_portable, without streaming the weight from memory once per 8 rows. */
int tuili_linear_rows(const void *x, const void *weight, const void *bias, void *out, int dtype, int out_dtype,
                      int64_t m, int64_t n, int64_t k, int num_threads) {
    const size_t size = dtype == TUILI_BF16 ? 2 : 4, out_size = out_dtype == TUILI_BF16 ? 2 : 4;
#ifdef AVX512
    for (int64_t i0 = 0; i0 < m; i0 += MAX_M) {
        const int status = tuili_linear_small((const char *)x + i0 * k * size, weight, bias,
                                              (char *)out + i0 * n * out_size, dtype, out_dtype,
                                              m - i0 < MAX_M ? m - i0 : MAX_M, n, k, num_threads);
        if (status != TUILI_OK) return status;
    }
    return TUILI_OK;
#else
    (void)size;
    (void)out_size;
    if (num_threads < 1) num_threads = 1;
    /* a tile of weight rows: about 128 KB of float32, an even count */
    int64_t tile = (32768 / (k > 0 ? k : 1)) & ~(int64_t)1;
    if (tile < TILE_W) tile = TILE_W;
    float *x_f32 = (float *)x, *tiles = NULL;
    if (dtype == TUILI_BF16) {
        x_f32 = malloc((size_t)(m * k) * sizeof(float));
        tiles = malloc((size_t)(num_threads * tile * k) * sizeof(float));
        if (x_f32 == NULL || tiles == NULL) {
            free(x_f32);
            free(tiles);
            return TUILI_NO_MEMORY;
        }
        for (int64_t i = 0; i < m * k; i++) x_f32[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    const int64_t num_tiles = (n + tile - 1) / tile;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t row0 = t * tile, rows = n - row0 < tile ? n - row0 : tile;
        const float *w = (const float *)weight + row0 * k;
        if (dtype == TUILI_BF16) {
            float *own = tiles + (size_t)omp_get_thread_num() * tile * k;
            for (int64_t e = 0; e < rows * k; e++) own[e] = bf16_to_f32(((const uint16_t *)weight)[row0 * k + e]);
            w = own;
        }
        float sums[TILE_X * TILE_W];
        for (int64_t i0 = 0; i0 < m; i0 += TILE_X) {
            const int I = m - i0 < TILE_X ? (int)(m - i0) : TILE_X;
            for (int64_t r0 = 0; r0 < rows; r0 += TILE_W) {
                const int R = rows - r0 < TILE_W ? (int)(rows - r0) : TILE_W;
                dot_tile_any(x_f32 + i0 * k, w + r0 * k, k, I, R, sums);
                for (int r = 0; r < R; r++) {
                    const int64_t col = row0 + r0 + r;
                    float b = 0.0f;
                    if (bias != NULL)
                        b = dtype == TUILI_F32 ? ((const float *)bias)[col]
                                               : bf16_to_f32(((const uint16_t *)bias)[col]);
                    for (int i = 0; i < I; i++) {
                        const float y = sums[i * R + r] + b;
                        if (out_dtype == TUILI_F32)
                            ((float *)out)[(i0 + i) * n + col] = y;
                        else
                            ((uint16_t *)out)[(i0 + i) * n + col] = f32_to_bf16(y);
                    }
                }
            }
        }
    }
    if (x_f32 != x) free(x_f32);
    free(tiles);
    return TUILI_OK;
#endif
}
