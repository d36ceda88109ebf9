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
#ifdef __AVX__
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AVX512 1
#endif

#include "common.h"
#include "kernels.h"

#define MAX_M 8
#define MAX_UNROLL 4
#define LANES 16 /* float32 lanes of the plain C path: one AVX-512 register, two AVX2 ones */
#define HALF (LANES / 2) /* one AVX2 register */

typedef struct {
    const void *x, *weight, *bias;
    const float *x_f32; /* x as float32: x itself, or a widened copy when x is bfloat16 */
    void *out;
    int dtype, out_dtype;
    int64_t m, n, k;
    /* Rows from one weight row of a step to the next: 1 (adjacent), or a thread's range cut into
     * as many parts as a step has rows (weight_rows). Always 1 in AVX-512 builds, whose register
     * kernels read adjacent rows. */
    int64_t spread;
} linear_args;

#ifdef AVX512
/* Weight rows per step: M x unroll accumulators, unroll weight vectors and one x vector must fit
 * in the 32 AVX-512 registers (M = 8: 16 + 2 + 1). */
static inline int unroll(int64_t m) { return m <= 4 ? 4 : 2; }
#define SMALL_ROWS MAX_M /* the most rows tuili_linear_rows hands to linear_small */
#else
/* Weight rows per step: M x unroll 16-lane sums are 2 M unroll AVX2 registers, at most 8 of the
 * 16 below 5 rows (from 7 rows they spill whatever the unroll). */
static inline int unroll(int64_t m) { return m == 1 ? 4 : m == 2 ? 2 : 1; }
/* The most rows tuili_linear_rows hands to linear_small: 8 rows ran up to 1.3x faster as its two
 * blocks of 4 than in linear_small, where their 16 sums spill; 7 and 6 rows slower (docs/kernels.md,
 * Measured crossovers). */
#define SMALL_ROWS 7
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

/* Computes sums[i * R + r] = x[i] . weight[row + r * a->spread] for all M rows of x and R weight rows. */
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

/* Weight element `at` (row-major, in place) as float32. */
static inline float weight_at(const void *w, int64_t at, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[at]) : ((const float *)w)[at];
}

/* Whether the step at element j (a multiple of LANES) starts a new 64 bytes of a weight row: the
 * prefetches ask once per 64 bytes of each row, as the AVX-512 kernels ask. */
static inline int starts_line(int64_t j, int bf16) { return j * (bf16 ? 2 : 4) % 64 == 0; }

/* The step at j of the R weight rows from `row` (a->spread apart) asks, for each row, for the
 * same place in the row that its stream reaches PREFETCH_STEPS steps later. */
static inline __attribute__((always_inline)) void ask_ahead(const linear_args *a, int64_t row, int R, int64_t j,
                                                            int bf16) {
    const int64_t ahead = a->spread == 1 ? PREFETCH_STEPS * R : PREFETCH_STEPS;
    if (starts_line(j, bf16))
        for (int r = 0; r < R; r++) prefetch_ahead(a->weight, (row + r * a->spread + ahead) * a->k + j, bf16 ? 2 : 4);
}

/* LANES independent partial sums per (x row, weight row): lane l takes the j = l mod LANES of
 * K's whole steps, in order. Fills acc[i][r] for x rows i < M and weight rows r < R, and returns
 * the first j past the whole steps. */
static inline __attribute__((always_inline)) int64_t dot_steps(const linear_args *a, int64_t row,
                                                               float (*acc)[MAX_UNROLL][LANES], const int M,
                                                               const int R, const int bf16) {
    const float *x = a->x_f32;
    const int64_t k = a->k;
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    /* Each sum as two AVX2 registers (lanes 0-7, 8-15). Written out because GCC's vectorization
     * of the plain C loop below built x's upper lanes from eight scalar loads at every step and
     * zeroed all of acc (2 KiB) per call: from 3 rows of x on, the loop was compute bound (a Zen 3,
     * 6144 x 1024 bf16, two cores: 3 rows 37 -> 68 GFLOP/s, 6 rows 54 -> 100, 8 rows 54 -> 78).
     * x's vectors are pinned to registers when one serves several weight rows (as in dot_half).
     * (7 and 8 rows spill; two sweeps of 4 rows over K, the second reading the weight rows again
     * from L1, were no faster.) */
    __m256 lo[MAX_M][MAX_UNROLL], hi[MAX_M][MAX_UNROLL];
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) lo[i][r] = hi[i][r] = _mm256_setzero_ps();
    for (; j + LANES <= k; j += LANES) {
        ask_ahead(a, row, R, j, bf16);
        for (int i = 0; i < M; i++) {
            __m256 x_lo = _mm256_loadu_ps(x + i * k + j), x_hi = _mm256_loadu_ps(x + i * k + j + HALF);
            if (R > 1) __asm__("" : "+x"(x_lo), "+x"(x_hi));
            for (int r = 0; r < R; r++) {
                __m256 w_lo, w_hi;
                if (bf16) {
                    const uint16_t *src = (const uint16_t *)a->weight + (row + r * a->spread) * k + j;
                    w_lo = widen_bf16_8(src);
                    w_hi = widen_bf16_8(src + HALF);
                } else {
                    const float *src = (const float *)a->weight + (row + r * a->spread) * k + j;
                    w_lo = _mm256_loadu_ps(src);
                    w_hi = _mm256_loadu_ps(src + HALF);
                }
                lo[i][r] = _mm256_fmadd_ps(x_lo, w_lo, lo[i][r]);
                hi[i][r] = _mm256_fmadd_ps(x_hi, w_hi, hi[i][r]);
            }
        }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(acc[i][r], lo[i][r]);
            _mm256_storeu_ps(acc[i][r] + HALF, hi[i][r]);
        }
#else
    /* Independent lanes, which the compiler vectorizes without reassociating anything. */
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++)
            for (int l = 0; l < LANES; l++) acc[i][r][l] = 0.0f;
    for (; j + LANES <= k; j += LANES) {
        float w[MAX_UNROLL][LANES];
        ask_ahead(a, row, R, j, bf16);
        for (int r = 0; r < R; r++) {
            if (bf16) {
                const uint16_t *src = (const uint16_t *)a->weight + (row + r * a->spread) * k + j;
                for (int l = 0; l < LANES; l++) w[r][l] = bf16_to_f32(src[l]);
            } else {
                const float *src = (const float *)a->weight + (row + r * a->spread) * k + j;
                for (int l = 0; l < LANES; l++) w[r][l] = src[l];
            }
        }
        for (int i = 0; i < M; i++)
            for (int r = 0; r < R; r++)
                for (int l = 0; l < LANES; l++) acc[i][r][l] = MADD(x[i * k + j + l], w[r][l], acc[i][r][l]);
    }
#endif
    return j;
}

/* dot_steps, then the tail of K into lane 0 and each sum over lanes 0 .. LANES-1 in order.
 * Inlined into one function per constant (M, R, dtype) (PORTABLE), so that the loops unroll and
 * the sums stay in registers. */
static inline __attribute__((always_inline)) void dot_portable(const linear_args *a, int64_t row, float *sums,
                                                               const int M, const int R, const int bf16) {
    const float *x = a->x_f32;
    const int64_t k = a->k;
    float acc[MAX_M][MAX_UNROLL][LANES];
    for (int64_t j = dot_steps(a, row, acc, M, R, bf16); j < k; j++) {
        for (int r = 0; r < R; r++) {
            const float wv = weight_at(a->weight, (row + r * a->spread) * k + j, bf16);
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
 * stride xk) against R rows of a weight tile w (row stride wk, read in place). A sum's LANES lanes
 * are independent chains (lane l takes the j = l mod LANES), so they run as two passes of HALF
 * lanes (one AVX2 register each): in a pass, I x R = 10 accumulators, R weight vectors and one x
 * vector take 13 of the 16 AVX2 registers, and each load serves R or I products (7 loads per 10
 * multiply-adds, where whole 16-lane sums leave no register for x: 16 per 12). 4 x 3 fills all 16
 * registers: no faster on a Zen 3; 6 x 2 and 3 x 4 spill, at half the speed. K goes in chunks
 * of K_CHUNK floats, the lanes carried in memory from one to the next, so that a block of x's
 * rows stays in L1 while the tile's rows pass it (chunks of 512 or 256: slower, each chunk costs
 * its accumulators' loads and stores). Each lane's chain and the final sum over lanes
 * 0 .. LANES-1 are dot_portable's.
 *
 * A bf16 weight is widened in registers, one shift or AND per 8 values, as pairs of elements
 * (pass_element): the passes take the even and the odd elements of each step, and x's float32
 * copy is split the same way. (A float32 copy of each tile, widened once, had the first block of
 * x wait on memory while it was made: 16 rows from memory 78-90 -> 90-103 GFLOP/s without it.)
 * x's copy starts at 64 bytes and its rows lie padded_stride(k) floats apart: a vector load never
 * splits a cache line, and the rows one step reads do not all fall in one L1 set, as rows 4 KiB
 * apart (k = 1024) do. On a Zen 3 (machine C) that took 512 x 1024 x 3072 from 66-70 to 97
 * GFLOP/s on two cores; each vector loaded once (GCC's own vectorization folded each x load into
 * both multiply-adds, 12 loads per 10) and the lanes summed eight sums at a time (sum_lanes: GCC's
 * scalar sums ran two chains at a time, a fifth of the time) took it to 125-130 (PyTorch's float32
 * matmul, with no fixed order to keep: 150-170), and 16 rows (decode at batch 16) from 78 to 105
 * (weights in L3). */
#define TILE_X 5
#define TILE_W 2
#define K_CHUNK 1024 /* TILE_X rows of it: 20 KB */

/* Floats from one row of x's float32 copy to the next: whole cache lines, plus one. */
static inline int64_t padded_stride(int64_t k) { return (k + LANES - 1) / LANES * LANES + LANES; }

/* The element of a step of LANES that slot half + l of a pass multiplies. A bf16 weight is read
 * in place as 32-bit pairs, so a pass takes the even elements (half 0: the pair shifted left, no
 * shuffle) or the odd ones (half HALF: the pair with its low element cleared); x's copy is laid
 * out to match (split_rows), and slots 0-15 hold the chains of elements 0, 2, .., 14, 1, 3, .., 15. */
static inline int64_t pass_element(int l, int half, int bf16) { return bf16 ? 2 * l + half / HALF : half + l; }

/* The slot that holds element l's chain (0 <= l < LANES): pass_element's inverse. */
static inline int lane_slot(int l, int bf16) { return bf16 ? (l % 2) * HALF + l / 2 : l; }

/* At step j, asks for the same step of the R weight rows at `ahead` (the next call's rows, NULL
 * for none; row stride wk) into L1. dot_chunk hands `ahead` to its second pass only: that pass
 * reads its rows from L1, so the cache's link to L2 and memory is free for them. */
static inline __attribute__((always_inline)) void ask_next_rows(const char *ahead, int64_t wk, int64_t j, int R,
                                                                int bf16) {
    if (ahead != NULL && starts_line(j, bf16))
        for (int r = 0; r < R; r++) __builtin_prefetch(ahead + (r * wk + j) * (bf16 ? 2 : 4), 0, 3);
}

/* One pass (half 0 or HALF) of the sums of x row i and weight row r over the whole steps at
 * j0 .. j1 - 1, carried in acc[i * acc_stride + r][half ..] (started at zero when j0 is 0),
 * asking for the rows at `ahead` (ask_next_rows). */
static inline __attribute__((always_inline)) void dot_half(const float *restrict x, const void *restrict w,
                                                           int64_t xk, int64_t wk, int64_t j0, int64_t j1, int I,
                                                           int R, int half, int bf16, float (*acc)[LANES],
                                                           int64_t acc_stride, const char *ahead) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 part[TILE_X][TILE_W];
    for (int i = 0; i < I; i++)
        for (int r = 0; r < R; r++)
            part[i][r] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(&acc[i * acc_stride + r][half]);
    for (int64_t j = j0; j < j1; j += LANES) {
        /* unaligned loads: a float32 x and any weight are read in place. Each vector is pinned to a
         * register (the empty asm): GCC would otherwise fold its load into every multiply-add
         * that uses it */
        __m256 wv[TILE_W];
        ask_next_rows(ahead, wk, j, R, bf16);
        for (int r = 0; r < R; r++) {
            if (bf16) {
                const __m256i pairs = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + r * wk + j));
                wv[r] = _mm256_castsi256_ps(half ? _mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u))
                                                 : _mm256_slli_epi32(pairs, 16));
            } else {
                wv[r] = _mm256_loadu_ps((const float *)w + r * wk + j + half);
            }
            __asm__("" : "+x"(wv[r]));
        }
        for (int i = 0; i < I; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * xk + j + half);
            __asm__("" : "+x"(xv));
            for (int r = 0; r < R; r++) part[i][r] = _mm256_fmadd_ps(xv, wv[r], part[i][r]);
        }
    }
    for (int i = 0; i < I; i++)
        for (int r = 0; r < R; r++) _mm256_storeu_ps(&acc[i * acc_stride + r][half], part[i][r]);
#else
    float part[TILE_X][TILE_W][HALF];
    for (int i = 0; i < I; i++)
        for (int r = 0; r < R; r++)
            for (int l = 0; l < HALF; l++) part[i][r][l] = j0 == 0 ? 0.0f : acc[i * acc_stride + r][half + l];
    for (int64_t j = j0; j < j1; j += LANES) {
        ask_next_rows(ahead, wk, j, R, bf16);
        _Pragma("GCC unroll 4") for (int i = 0; i < I; i++)
            _Pragma("GCC unroll 3") for (int r = 0; r < R; r++)
                for (int l = 0; l < HALF; l++) {
                    const float wv = weight_at(w, r * wk + j + pass_element(l, half, bf16), bf16);
                    part[i][r][l] = MADD(x[i * xk + j + half + l], wv, part[i][r][l]);
                }
    }
    for (int i = 0; i < I; i++)
        for (int r = 0; r < R; r++)
            for (int l = 0; l < HALF; l++) acc[i * acc_stride + r][half + l] = part[i][r][l];
#endif
}

/* Both passes over one chunk; one specialised copy per (I, R, bf16), so that the loops unroll
 * into registers (with I or R unknown, GCC keeps the accumulators on the stack). I is 3, 4 or 5:
 * tuili_linear_rows splits m >= 9 rows into blocks of floor or ceil of m / ceil(m / 5) rows. */
static void dot_chunk(const float *x, const void *w, int64_t xk, int64_t wk, int64_t j0, int64_t j1, int I,
                      int R, int bf16, float (*acc)[LANES], int64_t acc_stride, const char *ahead) {
#define DOT_CHUNK(I_, R_, BF16_)                                                     \
    do {                                                                             \
        dot_half(x, w, xk, wk, j0, j1, I_, R_, 0, BF16_, acc, acc_stride, NULL); \
        dot_half(x, w, xk, wk, j0, j1, I_, R_, HALF, BF16_, acc, acc_stride, ahead); \
        return;                                                                      \
    } while (0)
#define DOT_CHUNK_R(I_, BF16_)                         \
    do {                                               \
        if (R == TILE_W) DOT_CHUNK(I_, TILE_W, BF16_); \
        DOT_CHUNK(I_, 1, BF16_);                       \
    } while (0)
#define DOT_CHUNK_I(I_)                  \
    case I_:                             \
        if (bf16) DOT_CHUNK_R(I_, 1);    \
        DOT_CHUNK_R(I_, 0)
    switch (I) {
        DOT_CHUNK_I(3);
        DOT_CHUNK_I(4);
        DOT_CHUNK_I(5);
    }
#undef DOT_CHUNK_I
#undef DOT_CHUNK_R
#undef DOT_CHUNK
}

/* totals[o] = the sum of lanes 0, 1, .., LANES - 1 of lanes[o], added from 0 in that order
 * (dot_portable's), for o < count; lane l is in slot lane_slot(l) (bf16: the even lanes in
 * slots 0-7, the odd ones in 8-15). With AVX, eight sums side by side, one per lane of
 * a vector, after a transpose of their slots: one sum at a time waits on each add. Inlined once
 * per layout (bf16), so that the slot order is fixed at compile time. */
static inline __attribute__((always_inline)) void sum_lanes(const float (*lanes)[LANES], int64_t count,
                                                            const int bf16, float *totals) {
    int64_t o = 0;
#ifdef __AVX__
    for (; o + 8 <= count; o += 8) {
        __m256 low[8], high[8], total = _mm256_setzero_ps();
        transpose8(lanes[o], LANES, low); /* low[l]: slot l of sums o .. o + 7 */
        transpose8(lanes[o] + HALF, LANES, high);
        for (int l = 0; l < LANES; l++) {
            const int slot = lane_slot(l, bf16);
            total = _mm256_add_ps(total, slot < HALF ? low[slot] : high[slot - HALF]);
        }
        _mm256_storeu_ps(totals + o, total);
    }
#endif
    for (; o < count; o++) {
        float total = 0.0f;
        for (int l = 0; l < LANES; l++) total += lanes[o][lane_slot(l, bf16)];
        totals[o] = total;
    }
}
#endif

/* Adds the bias to sums[i * R + r] (row i of x, weight row row + r * spread) and stores it to out. */
static void store_rows(const linear_args *a, int64_t row, int R, const float *sums) {
    for (int r = 0; r < R; r++) {
        float b = 0.0f;
        if (a->bias != NULL)
            b = a->dtype == TUILI_F32 ? ((const float *)a->bias)[row + r * a->spread]
                                      : bf16_to_f32(((const uint16_t *)a->bias)[row + r * a->spread]);
        for (int64_t i = 0; i < a->m; i++) {
            const float y = sums[i * R + r] + b;
            if (a->out_dtype == TUILI_F32)
                ((float *)a->out)[i * a->n + row + r * a->spread] = y;
            else
                ((uint16_t *)a->out)[i * a->n + row + r * a->spread] = f32_to_bf16(y);
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

#ifndef AVX512
/* widen_rows for tuili_linear_rows' bf16 passes: each whole step of LANES values as its even
 * elements, then its odd ones (pass_element), the tail of K as it is. */
static void split_rows(float *dst, const uint16_t *src, int64_t rows, int64_t k, int64_t stride) {
    const int64_t whole = k - k % LANES;
    for (int64_t i = 0; i < rows; i++) {
        for (int64_t j = 0; j < whole; j += LANES)
            for (int l = 0; l < LANES; l++)
                dst[i * stride + j + l] = bf16_to_f32(src[i * k + j + pass_element(l % HALF, l / HALF * HALF, 1)]);
        for (int64_t j = whole; j < k; j++) dst[i * stride + j] = bf16_to_f32(src[i * k + j]);
    }
}
#endif

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
 * rows left over (fewer than a step) one at a time. A step's rows are its streams from memory.
 * Without AVX-512 they are spread: the range is cut into `step` equal parts and a step reads row i
 * of each, so each stream runs front to back through adjacent rows, one long run the hardware
 * prefetcher follows. Adjacent rows in a step made `step` streams of one row each (2 KiB at
 * K = 1024 in bf16), started over at every step: on a Zen 3 (machine C) a one-row bf16 GEMV of
 * 16384 x 1024 read 22 GB/s against 30 for 4096 x 4096, and the Qwen3-0.6B shape's decode-step
 * weights 25.5 GB/s, 35.1 spread (docs/kernels.md, `linear_small`). A row's sums are the same
 * operations wherever it sits, so the outputs are the same bits. */
static void weight_rows(const linear_args *a, int64_t begin, int64_t end) {
    const int step = unroll(a->m);
    const rows_fn whole = kernel_for(a, step), single = kernel_for(a, 1);
    float sums[MAX_M * MAX_UNROLL];
    int64_t row = begin;
#ifndef AVX512
    linear_args spread = *a;
    spread.spread = (end - begin) / step; /* each part's rows */
    if (step > 1 && spread.spread > 1) {
        for (int64_t i = 0; i < spread.spread; i++) {
            whole(&spread, begin + i, sums);
            store_rows(&spread, begin + i, step, sums);
        }
        row = begin + step * spread.spread;
    }
#endif
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
    linear_args a = {x, weight, bias, x, out, dtype, out_dtype, m, n, k, 1};
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
 * linear_small's own register kernels, MAX_M rows of x at a time; elsewhere each thread runs
 * blocks of up to TILE_X rows of x by TILE_W weight rows (dot_chunk), the weight read in place. */
int tuili_linear_rows(const void *x, const void *weight, const void *bias, void *out, int dtype, int out_dtype,
                      int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m <= SMALL_ROWS) /* linear_small reads each weight row once for all m rows */
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
#ifdef AVX512
        widen_rows(x_f32, x, m, k, xk);
#else
        split_rows(x_f32, x, m, k, xk);
#endif
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
                                   m - i0 < MAX_M ? m - i0 : MAX_M, n, k, 1};
            weight_rows(&a, begin, end);
        }
    }
#else
    /* a tile: about 128 KB of the weight, read in place */
    const int bf16 = dtype == TUILI_BF16;
    const int64_t tile = tile_rows(n, k, bf16 ? 2 : 4, 128 * 1024, TILE_W, num_threads);
    /* each thread's partial sums for a block of x against its tile: those of x row i and tile
     * row c at [i * tile + c], and the totals of one x row */
    float(*lanes)[LANES] = malloc((size_t)(num_threads * TILE_X * tile) * sizeof *lanes);
    float *totals = malloc((size_t)(num_threads * tile) * sizeof *totals);
    if (lanes == NULL || totals == NULL) {
        free(lanes);
        free(totals);
        if (x_f32 != x) free(x_f32);
        return TUILI_NO_MEMORY;
    }
    const size_t size = bf16 ? 2 : 4;
    const int64_t num_tiles = (n + tile - 1) / tile;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tiles; t++) {
        const int64_t row0 = t * tile, rows = n - row0 < tile ? n - row0 : tile;
        const char *w = (const char *)weight + row0 * k * size;
        float(*acc)[LANES] = lanes + (size_t)omp_get_thread_num() * TILE_X * tile;
        float *row_totals = totals + (size_t)omp_get_thread_num() * tile;
        const int64_t whole = k - k % LANES;
        /* x in blocks of at most TILE_X rows, their sizes a row apart at most: a block of 1 or 2
         * rows does 2 or 4 multiply-adds per 3 or 4 loads (m = 16: 4 x 4 rows, not 5 + 5 + 5 + 1) */
        const int64_t blocks = (m + TILE_X - 1) / TILE_X;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i0 = b * m / blocks;
            const int I = (int)((b + 1) * m / blocks - i0);
            const float *xs = x_f32 + i0 * xk;
            for (int64_t j0 = 0; j0 < whole; j0 += K_CHUNK) {
                const int64_t j1 = whole - j0 < K_CHUNK ? whole : j0 + K_CHUNK;
                for (int64_t c = 0; c < rows;) {
                    const int R = rows - c < TILE_W ? 1 : TILE_W; /* the rows left over one at a time */
                    /* The first block reads the tile from memory: it asks for the chunk of the rows
                     * two calls on into L2 at once, and for the next call's into L1 during its
                     * second pass. Later blocks find the tile in L2, where asking ahead into L1
                     * measured a little slower (with 512 rows, 3% for k = 3072). */
                    const char *ahead = NULL;
                    if (b == 0) {
                        for (int64_t r = c + PREFETCH_STEPS * TILE_W; r < c + (PREFETCH_STEPS + 1) * TILE_W; r++)
                            for (int64_t j = j0; j < j1; j += 64 / (int64_t)size) prefetch_ahead(w, r * k + j, size);
                        if (c + R + TILE_W <= rows) ahead = w + (c + R) * k * size;
                    }
                    dot_chunk(xs, w + c * k * size, xk, k, j0, j1, I, R, bf16, acc + c, tile, ahead);
                    c += R;
                }
            }
            for (int i = 0; i < I; i++) {
                float(*row_lanes)[LANES] = acc + i * tile;
                if (whole == 0) memset(row_lanes, 0, (size_t)rows * sizeof *row_lanes); /* no chunk ran */
                for (int64_t c = 0; c < rows; c++) /* the tail of K to lane 0 */
                    for (int64_t j = whole; j < k; j++)
                        row_lanes[c][0] = MADD(xs[i * xk + j], weight_at(w, c * k + j, bf16), row_lanes[c][0]);
                if (bf16)
                    sum_lanes((const float(*)[LANES])row_lanes, rows, 1, row_totals);
                else
                    sum_lanes((const float(*)[LANES])row_lanes, rows, 0, row_totals);
                const linear_args a = {NULL, weight, bias, NULL, (char *)out + (i0 + i) * n * out_size,
                                       dtype, out_dtype, 1, n, k, 1};
                store_rows(&a, row0, (int)rows, row_totals);
            }
        }
    }
    free(lanes);
    free(totals);
#endif
    if (x_f32 != x) free(x_f32);
    return TUILI_OK;
}
