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

#ifdef AVX512
/* Weight rows per step: M x unroll accumulators, unroll weight vectors and one x vector must fit
 * in the 32 AVX-512 registers (M = 8: 16 + 2 + 1). */
static inline int unroll(int64_t m) { return m <= 4 ? 4 : 2; }
#else
/* Weight rows per step: M x unroll 16-lane sums are 2 M unroll AVX2 registers, at most 8 of the
 * 16 (from 5 rows they spill whatever the unroll). */
static inline int unroll(int64_t m) { return m == 1 ? 4 : m == 2 ? 2 : 1; }
#endif

/* Asks for element `index` of the weight w into L2. The kernels ask, at every 64 bytes of a
 * step's rows, for the same place PREFETCH_STEPS steps (of R rows) ahead: faster from memory than
 * the hardware prefetchers alone (docs/kernels.md, Measured crossovers), most at larger M, where
 * the arithmetic between loads keeps fewer of them in flight, and on a Zen 3 (AVX2) at one row of
 * 1024 bf16 values: 13.2 -> 19.4 GB/s. Addresses past
 * the weight's end are harmless (a prefetch never faults), so they are computed as integers.
 * __builtin_prefetch, because GCC 12 deletes _mm_prefetch here (dead-code elimination). */
#define PREFETCH_STEPS 2
static inline void prefetch_ahead(const void *w, int64_t index, size_t size) {
    __builtin_prefetch((const void *)((uintptr_t)w + (uintptr_t)index * size), 0, 2); /* read, into L2 */
}

/* Computes sums[i * R + r] = x[i] . weight[row + r] for all M rows of x and R weight rows. */
typedef void (*rows_fn)(const linear_args *a, int64_t row, float *sums);

#ifdef AVX512
/* The kernels below take any M <= MAX_M and R <= MAX_UNROLL and are inlined into one function
 * per constant (M, R) (SPECIALIZE), so their loops unroll and the accumulators are registers. */
#define KERNEL static inline __attribute__((always_inline)) void
/* Unrolled before GCC's scalar replacement of aggregates: without it acc[][] stays an array in
 * memory, stored on every step. */
#define UNROLLED _Pragma("GCC unroll 8")

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
 * reassociating anything; the tail of K goes to lane 0. Inlined into one function per constant
 * (M, R, dtype) (PORTABLE), so that the loops unroll and the sums stay in registers. */
static inline __attribute__((always_inline)) void dot_portable(const linear_args *a, int64_t row, float *sums,
                                                               const int M, const int R, const int bf16) {
    const float *x = a->x_f32;
    const int64_t k = a->k;
    float acc[MAX_M][MAX_UNROLL][LANES] = {{{0}}};
    int64_t j = 0;
    for (; j + LANES <= k; j += LANES) {
        float w[MAX_UNROLL][LANES];
        if (!bf16 || j % 32 == 0) /* at every 64 bytes of each row, as the AVX-512 kernels ask */
            for (int r = 0; r < R; r++)
                prefetch_ahead(a->weight, (row + PREFETCH_STEPS * R + r) * k + j, bf16 ? 2 : 4);
        for (int r = 0; r < R; r++) {
            if (bf16) {
                const uint16_t *src = (const uint16_t *)a->weight + (row + r) * k + j;
                for (int l = 0; l < LANES; l++) w[r][l] = bf16_to_f32(src[l]);
            } else {
                const float *src = (const float *)a->weight + (row + r) * k + j;
                for (int l = 0; l < LANES; l++) w[r][l] = src[l];
            }
        }
        for (int i = 0; i < M; i++)
            for (int r = 0; r < R; r++)
                for (int l = 0; l < LANES; l++) acc[i][r][l] = MADD(x[i * k + j + l], w[r][l], acc[i][r][l]);
    }
    for (; j < k; j++) {
        for (int r = 0; r < R; r++) {
            const int64_t at = (row + r) * k + j;
            const float wv = bf16 ? bf16_to_f32(((const uint16_t *)a->weight)[at]) : ((const float *)a->weight)[at];
            for (int i = 0; i < M; i++) acc[i][r][0] = MADD(x[i * k + j], wv, acc[i][r][0]);
        }
    }
    for (int i = 0; i < M; i++) {
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int l = 0; l < LANES; l++) s += acc[i][r][l];
            sums[i * R + r] = s;
        }
    }
}

/* One function per (M, R, dtype): R is 1 (the rows left over) or unroll(M). */
#define PORTABLE(M, R)                                                                       \
    static void dot_f32_##M##_##R(const linear_args *a, int64_t row, float *sums) {          \
        dot_portable(a, row, sums, M, R, 0);                                                 \
    }                                                                                        \
    static void dot_bf16_##M##_##R(const linear_args *a, int64_t row, float *sums) {         \
        dot_portable(a, row, sums, M, R, 1);                                                 \
    }
PORTABLE(1, 1) PORTABLE(1, 4) PORTABLE(2, 1) PORTABLE(2, 2) PORTABLE(3, 1) PORTABLE(4, 1)
PORTABLE(5, 1) PORTABLE(6, 1) PORTABLE(7, 1) PORTABLE(8, 1)
#define PORTABLE_TABLE(dot)                                                                  \
    static const rows_fn dot##_table[MAX_M][2] = {                                           \
        {dot##_1_1, dot##_1_4}, {dot##_2_1, dot##_2_2}, {dot##_3_1, dot##_3_1}, {dot##_4_1, dot##_4_1}, \
        {dot##_5_1, dot##_5_1}, {dot##_6_1, dot##_6_1}, {dot##_7_1, dot##_7_1}, {dot##_8_1, dot##_8_1}, \
    };
PORTABLE_TABLE(dot_f32)
PORTABLE_TABLE(dot_bf16)

static rows_fn kernel_for(const linear_args *a, int R) {
    return (a->dtype == TUILI_F32 ? dot_f32_table : dot_bf16_table)[a->m - 1][R == 1 ? 0 : 1];
}

/* Prompts (tuili_linear_rows): dot_portable's sums, element for element, for I rows of x (row
 * stride xk) against R rows of a float32 weight tile w (row stride wk). A sum's LANES lanes are
 * independent chains (lane l takes the j = l mod LANES), so they run as two passes of HALF lanes
 * (one AVX2 register each): in a pass, I x R = 10 accumulators, R weight vectors and one x vector
 * take 13 of the 16 AVX2 registers, and each load serves R or I products (7 loads per 10
 * multiply-adds, where whole 16-lane sums leave no register for x: 16 per 12). 4 x 3 fills all 16
 * registers, and GCC then reads the weight vectors again from memory (15 loads per 12): 3-5%
 * slower on a Zen 3; 6 x 2 and 3 x 4 spill, at half the speed. K goes in chunks
 * of K_CHUNK floats, the lanes carried in memory from one to the next, so that a block of x's
 * rows stays in L1 while the tile's rows pass it. Each lane's chain and the final sum over lanes
 * 0 .. LANES-1 are dot_portable's.
 *
 * The float32 copies (x's rows, each thread's tile) start at 64 bytes and their rows lie
 * padded_stride(k) floats apart: a vector load never splits a cache line, and the seven rows one
 * step reads do not all fall in one L1 set, as rows 4 KiB apart (k = 1024) do. On a Zen 3
 * (machine C) the two took 512 x 1024 x 3072 from 66-70 to 97 GFLOP/s on two cores (PyTorch's
 * float32 matmul, with no fixed order to keep: 150-170). */
#define TILE_X 5
#define TILE_W 2
#define HALF (LANES / 2)
#define K_CHUNK 1024 /* TILE_X rows of it: 20 KB */
typedef float tile_lanes[TILE_X][TILE_W][LANES]; /* the partial sums of one (x block, weight rows) pair */

/* Floats from one row of a float32 copy to the next: whole cache lines, plus one. */
static inline int64_t padded_stride(int64_t k) { return (k + LANES - 1) / LANES * LANES + LANES; }

/* Lanes half .. half + HALF - 1 over the whole steps at j0 .. j1 - 1, carried in acc. */
static inline __attribute__((always_inline)) void dot_half(const float *restrict x, const float *restrict w,
                                                           int64_t xk, int64_t wk, int64_t j0, int64_t j1, int I,
                                                           int R, int half, tile_lanes acc) {
    float part[TILE_X][TILE_W][HALF];
    for (int i = 0; i < I; i++) /* the first chunk starts the chains at zero */
        for (int r = 0; r < R; r++)
            for (int l = 0; l < HALF; l++) part[i][r][l] = j0 == 0 ? 0.0f : acc[i][r][half + l];
    for (int64_t j = j0 + half; j < j1; j += LANES)
        _Pragma("GCC unroll 4") for (int i = 0; i < I; i++) /* hints: 5 and 2 measured 4% slower */
            _Pragma("GCC unroll 3") for (int r = 0; r < R; r++)
                for (int l = 0; l < HALF; l++) part[i][r][l] = MADD(x[i * xk + j + l], w[r * wk + j + l], part[i][r][l]);
    for (int i = 0; i < I; i++)
        for (int r = 0; r < R; r++)
            for (int l = 0; l < HALF; l++) acc[i][r][half + l] = part[i][r][l];
}

/* Both halves over one chunk; one specialised copy per (I, R), so that the loops unroll into
 * registers. */
static void dot_chunk(const float *x, const float *w, int64_t xk, int64_t wk, int64_t j0, int64_t j1, int I,
                      int R, tile_lanes acc) {
#define DOT_CHUNK(I_, R_)                                          \
    do {                                                           \
        dot_half(x, w, xk, wk, j0, j1, I_, R_, 0, acc);    \
        dot_half(x, w, xk, wk, j0, j1, I_, R_, HALF, acc); \
    } while (0)
    if (I == TILE_X && R == TILE_W)
        DOT_CHUNK(TILE_X, TILE_W);
    else if (I == TILE_X)
        DOT_CHUNK(TILE_X, 1);
    else if (R == TILE_W)
        DOT_CHUNK(I, TILE_W);
    else
        DOT_CHUNK(I, 1);
#undef DOT_CHUNK
}

/* After the last chunk (none ran when K < LANES): the tail of K (from `whole`) to lane 0, then
 * the sum over the lanes into sums[i * R + r]. The I x R sums advance side by side, lane by lane,
 * each in dot_portable's order: independent chains, where one sum at a time waits on each add. */
static void finish_tile(const float *x, const float *w, int64_t xk, int64_t wk, int64_t k, int64_t whole, int I,
                        int R, tile_lanes acc, float *sums) {
    if (whole == 0) memset(acc, 0, sizeof(tile_lanes));
    for (int64_t j = whole; j < k; j++)
        for (int i = 0; i < I; i++)
            for (int r = 0; r < R; r++) acc[i][r][0] = MADD(x[i * xk + j], w[r * wk + j], acc[i][r][0]);
    float total[TILE_X][TILE_W] = {{0}};
    for (int l = 0; l < LANES; l++)
        for (int i = 0; i < I; i++)
            for (int r = 0; r < R; r++) total[i][r] += acc[i][r][l];
    for (int i = 0; i < I; i++)
        for (int r = 0; r < R; r++) sums[i * R + r] = total[i][r];
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

/* count floats at a 64-byte boundary (aligned_alloc wants a multiple of it, and never 0). */
static float *floats_at_64(size_t count) {
    return aligned_alloc(64, (count * sizeof(float) + 64) / 64 * 64);
}

/* rows x k bfloat16 values (row stride k) as float32 rows `stride` apart, in `dst`. */
static void widen_rows(float *dst, const uint16_t *src, int64_t rows, int64_t k, int64_t stride) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < k; j++) dst[i * stride + j] = bf16_to_f32(src[i * k + j]);
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

/* Outputs of weight rows begin .. end - 1 for a's rows of x: steps of unroll(M) rows, then the
 * rows left over (fewer than a step) one at a time. */
static void weight_rows(const linear_args *a, int64_t begin, int64_t end) {
    const int step = unroll(a->m);
    const rows_fn whole = kernel_for(a, step), single = kernel_for(a, 1);
    float sums[MAX_M * MAX_UNROLL];
    int64_t row = begin;
    for (; row + step <= end; row += step) {
        whole(a, row, sums);
        store_rows(a, row, step, sums);
    }
    for (; row < end; row++) {
        single(a, row, sums);
        store_rows(a, row, 1, sums);
    }
}

/* 1 <= m <= MAX_M and the shapes are checked by the caller (tuili/kernels/cpu.py). */
int tuili_linear_small(const void *x, const void *weight, const void *bias, void *out, int dtype, int out_dtype,
                       int64_t m, int64_t n, int64_t k, int num_threads) {
    linear_args a = {x, weight, bias, x, out, dtype, out_dtype, m, n, k};
    float *x_f32 = NULL;
    if (reads_x_as_f32(dtype)) {
        x_f32 = floats_at_64((size_t)(m * k));
        if (x_f32 == NULL) return TUILI_NO_MEMORY;
        widen_rows(x_f32, x, m, k, k);
        a.x_f32 = x_f32;
    }
    const int step = unroll(m);
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
        weight_rows(&a, begin, end);
    }
    free(x_f32);
    return TUILI_OK;
}

/* Weight rows per tile of tuili_linear_rows: about `bytes` of them (as the kernels read them), a
 * multiple of `multiple`, and no more than an equal share of the n rows for each thread. */
static int64_t tile_rows(int64_t n, int64_t k, size_t row_size, int64_t bytes, int64_t multiple, int threads) {
    int64_t tile = bytes / (k > 0 ? k * (int64_t)row_size : 1);
    const int64_t share = (n + threads - 1) / threads;
    if (tile > share) tile = share;
    tile -= tile % multiple;
    return tile < multiple ? multiple : tile;
}

/* x [M, K] for any M >= 1: row i of out is bit for bit what tuili_linear_small gives row i alone
 * (every kernel's sum for one (x row, weight row) pair is the same operations whatever the other
 * rows in its call). The weight goes in tiles of rows that stay in L2, each thread a tile at a
 * time against every row of x, so the weight streams from memory once (blocks of 8 rows through
 * tuili_linear_small would stream it once per block). With AVX-512 the tile runs through
 * linear_small's own register kernels, MAX_M rows of x at a time; elsewhere each thread widens
 * its tile to float32 once and runs TILE_X rows of x by TILE_W weight rows (dot_chunk). */
int tuili_linear_rows(const void *x, const void *weight, const void *bias, void *out, int dtype, int out_dtype,
                      int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m <= MAX_M) /* a tile's worth of reuse would not pay for widening it */
        return tuili_linear_small(x, weight, bias, out, dtype, out_dtype, m, n, k, num_threads);
    const size_t out_size = out_dtype == TUILI_BF16 ? 2 : 4;
    if (num_threads < 1) num_threads = 1;
    float *x_f32 = (float *)x;
#ifdef AVX512
    const int64_t xk = k; /* linear_small's kernels read x's rows k apart */
#else
    const int64_t xk = dtype == TUILI_BF16 ? padded_stride(k) : k; /* float32 x is read in place */
#endif
    if (dtype == TUILI_BF16 && reads_x_as_f32(dtype)) {
        x_f32 = floats_at_64((size_t)(m * xk));
        if (x_f32 == NULL) return TUILI_NO_MEMORY;
        widen_rows(x_f32, x, m, k, xk);
    }
#ifdef AVX512
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
    const int64_t tile = tile_rows(n, k, size, 256 * 1024, MAX_UNROLL, num_threads);
    const int64_t num_tiles = (n + tile - 1) / tile;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t begin = t * tile, end = begin + tile < n ? begin + tile : n;
        for (int64_t i0 = 0; i0 < m; i0 += MAX_M) {
            const float *rows_f32 = dtype == TUILI_F32 || x_f32 != x ? x_f32 + i0 * k : NULL; /* unread: NULL */
            const linear_args a = {(const char *)x + i0 * k * size, weight, bias, rows_f32,
                                   (char *)out + i0 * n * out_size, dtype, out_dtype,
                                   m - i0 < MAX_M ? m - i0 : MAX_M, n, k};
            weight_rows(&a, begin, end);
        }
    }
#else
    /* a tile: about 128 KB of float32 */
    const int64_t tile = tile_rows(n, k, sizeof(float), 128 * 1024, TILE_W, num_threads);
    /* each thread's partial sums for a block of x against its tile: a group per TILE_W rows,
     * and per row left over */
    const int64_t groups = tile / TILE_W + TILE_W;
    tile_lanes *lanes = malloc((size_t)(num_threads * groups) * sizeof *lanes);
    const int64_t wk = dtype == TUILI_BF16 ? padded_stride(k) : k; /* float32 weights are read in place */
    float *tiles = NULL;
    if (dtype == TUILI_BF16) tiles = floats_at_64((size_t)(num_threads * tile * wk));
    if (lanes == NULL || (dtype == TUILI_BF16 && tiles == NULL)) {
        free(lanes);
        free(tiles);
        if (x_f32 != x) free(x_f32);
        return TUILI_NO_MEMORY;
    }
    const int64_t num_tiles = (n + tile - 1) / tile;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t row0 = t * tile, rows = n - row0 < tile ? n - row0 : tile;
        const float *w = (const float *)weight + row0 * k;
        if (dtype == TUILI_BF16) {
            float *own = tiles + (size_t)omp_get_thread_num() * tile * wk;
            widen_rows(own, (const uint16_t *)weight + row0 * k, rows, k, wk);
            w = own;
        }
        tile_lanes *acc = lanes + (size_t)omp_get_thread_num() * groups;
        const int64_t whole = k - k % LANES;
        float sums[TILE_X * TILE_W];
        for (int64_t i0 = 0; i0 < m; i0 += TILE_X) {
            const int I = m - i0 < TILE_X ? (int)(m - i0) : TILE_X;
            const float *xs = x_f32 + i0 * xk;
            for (int64_t j0 = 0; j0 < whole; j0 += K_CHUNK) {
                const int64_t j1 = whole - j0 < K_CHUNK ? whole : j0 + K_CHUNK;
                for (int64_t r0 = 0, g = 0; r0 < rows; g++) {
                    const int R = rows - r0 < TILE_W ? 1 : TILE_W; /* the rows left over one at a time */
                    dot_chunk(xs, w + r0 * wk, xk, wk, j0, j1, I, R, acc[g]);
                    r0 += R;
                }
            }
            const linear_args a = {NULL, weight, bias, NULL, (char *)out + i0 * n * out_size, dtype, out_dtype, I, n, k};
            for (int64_t r0 = 0, g = 0; r0 < rows; g++) {
                const int R = rows - r0 < TILE_W ? 1 : TILE_W;
                finish_tile(xs, w + r0 * wk, xk, wk, k, whole, I, R, acc[g], sums);
                store_rows(&a, row0 + r0, R, sums);
                r0 += R;
            }
        }
    }
    free(tiles);
    free(lanes);
#endif
    if (x_f32 != x) free(x_f32);
    return TUILI_OK;
}
