/* y = x W^T for a few rows of x (decode) with W held in tuili/layers/quant.py's packed int4
 * layout, read as stored: the matrix-vector product of GGUF Q4_0, Q4_1 and Q8_0 weights and of
 * --quantization int4, at the speed the packed bytes stream from memory.
 *
 * Layout (Int4Linear): packed [N / 64, K', 32] uint8, byte [t, k, j] holding row 64t + j's code
 * in its low nibble and row 64t + 32 + j's in its high nibble; scale_zero [K' / group, N, 2]
 * bfloat16; w[n, k] = scale * (q - 8) + zero. Where every zero is 0 (GGUF Q4_0) the module
 * holds the scales alone, [K' / group, N] (`pairs` 0), and the kernel takes the zeros as 0.
 * Int8GroupLinear (Q8_0) is the same code layout over K' = 2K (its high and low nibble halves)
 * with its scales alone, [K / group, N] bfloat16 (w = scale * q); `copies` = 2 selects its own
 * kernel (q8 below), which reads both halves at once. Int6GroupLinear (GGUF Q6_K, Q5_0, Q5_1,
 * Q5_K: codes in -32..31) is K rows of nibbles and K / 2 rows of 2-bit planes a tile, `copies`
 * = 3, read by the VNNI path alone (unpack_quad). Output rows lie `out_stride` values apart.
 *
 * Per group g of K' the product needs no dequantized weight:
 *   y[n] += scale[g, n] * sum_k x[k] * q[n, k] + (zero[g, n] - 8 scale[g, n]) * sum_k x[k]
 * The inner sums run over the 64 rows of a tile at once (a tile row of 32 bytes is 64 codes, one
 * per output row). Three ways, by what the CPU has:
 *
 * - AVX512-VNNI and VBMI (Ice Lake, Sapphire Rapids, Zen 4 and 5): x is written per group as
 *   two int8 parts, x ~ sx * (254 xq + xq_low) with xq = round(x * 127 / max |x|) and xq_low the
 *   rounded rest in steps of 1/254, and VPDPBUSD adds four code x part products per 32-bit lane,
 *   one accumulator per part, folded once per group (254 acc + rest, exact in int32). One byte
 *   permute (VPERMT2B) turns four tile rows (k..k+3) into 16 lanes of four consecutive k each; a
 *   mask and a shift split the nibbles. The sum of x over a group stays exact (float32); the
 *   products carry x's rounding, at most max |x| / 64516 per value: below bf16's own rounding of
 *   x (2^-9 relative) for every value within 1/128 of its group's largest. llama.cpp rounds x
 *   to one int8 part (error up to max |x| / 254); on SmolLM2 that part alone raised prompt
 *   perplexity 1.4% over float32 sums, the two parts keep it within the tests' 1%. The second
 *   part doubles the dot products, which a decode row never waits for (it waits for memory);
 *   four rows at once pay ~20% (two accumulator sets fill the registers at two rows).
 * - AVX2 CPUs: the same two int8 parts as one int16 and the same exact integer sums, made by
 *   VPMADDWD on int16 codes (below, "AVX2"): the VNNI path's bits.
 * - other AVX-512 CPUs: float32 throughout, exact up to float32 rounding: each
 *   k broadcasts x[k] into 16-lane multiply-adds, a code becoming q - 8 by one permute from a
 *   16-entry table (AVX2 and plain C: by widening).
 *
 * Either way a row's result depends on that row alone (x is rounded per row and group, the int32
 * sums are exact, the float32 epilogue runs in one order), so the batch-invariant mode runs the
 * first way at every row count, prompts included: on Zen 5 the float32 way is bound by its
 * permutes (29 against 44 GB/s at one row; docs/kernels.md, Measured crossovers). `exact` takes
 * the second way on every CPU, for tests of the float32 sums on VNNI machines.
 *
 * The output is stored as float32 or rounded once to bfloat16.
 *
 * Threads take static ranges of whole tiles. Rows of x go four at a time (their accumulators fill
 * the registers); a tile, 32 K' bytes, is still in L2 for the next four. From a few rows on (a
 * prompt) each tile's codes are widened once to int16 into a per-thread buffer of 128 K bytes that
 * every row then reads, instead of permuting and masking the packed bytes again for each pair of
 * rows: VNNI CPUs from CACHE_MIN_ROWS rows (tile_rows_vnni_wide, VPDPWSSD), AVX2 from
 * WIDE_MIN_ROWS (tile_rows_avx2_wide, VPMADDWD); the integer sums, hence the bits, are the same
 * either way. */
#include <omp.h>
#include <stdlib.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common.h"
#include "kernels.h"

#define TILE TUILI_INT4_TILE_ROWS
#define HALF (TILE / 2)
#define ROWS_AT_ONCE 4
/* Tile rows (32 bytes each) read ahead. A thread streams its tiles' codes front to back: at one
 * row the distance must cover the memory's latency at the rate the products consume bytes. AVX-512
 * (VNNI): 8 KiB; on machine D (AMD Zen 4) against 2 KiB, one row of the Qwen3-0.6B-shape layers from
 * memory 5-10% faster, four rows 5-15%, sixteen the same, the Q4_0 model's batch-1 decode +12%
 * (docs/kernels.md, Measured crossovers); Q8_0 (two streams a tile) the same either way. AVX2:
 * 2 KiB, the distance its prefetches were measured at on Zen 3 (machine C), where 4 and 8 KiB made the
 * Q4_0 model's batch-1 decode 5-10% and 15-25% slower (2026-12-06). */
#ifdef __AVX512F__
#define PREFETCH_ROWS 256
#else
#define PREFETCH_ROWS 64
#endif
#define CACHE_MIN_ROWS 16 /* rows of x from which a tile's codes are widened once (VNNI) */
#define LOW_STEPS 254     /* integer dots (VNNI, AVX2): x / sx ~ high + low / LOW_STEPS, both int8 */

typedef struct {
    const float *x;       /* [M, K] float32 */
    const float *xsum;    /* [M, groups]: sum of x over each group */
    const int8_t *xq;     /* x / sx rounded, per group (VNNI path only), as x */
    const int8_t *xq_low; /* the rest, (x / sx - xq) * LOW_STEPS rounded, as x */
    const float *sx;      /* [M, groups] the scales of x / (sx * LOW_STEPS) ~ LOW_STEPS xq + xq_low */
    const int32_t *xqsum; /* [M, groups] sum of LOW_STEPS xq + xq_low over each group */
    const int16_t *x16;   /* AVX2: [M, K] LOW_STEPS xq + xq_low (the integer dots' x), or NULL */
    const uint8_t *packed;
    const uint16_t *scale_zero; /* (scale, zero) pairs, or (pairs 0) each group's scales alone */
    void *out;
    int out_dtype, q8; /* q8: Int8GroupLinear's halves, tiles of 2 kp rows; or q6's planes */
    int q6;             /* Int6GroupLinear's 6-bit codes (VNNI only): see unpack_quad */
    int pairs;          /* scale_zero holds (scale, zero) pairs; else scales, the zeros 0 (Q4_0, Q8_0) */
    int exact;          /* float32 sums of x as given, never its int8 rounding (VNNI CPUs too) */
    int64_t m, kp, group, n_pad, n_out, out_stride; /* kp: K, the columns of x; out_stride: between out's rows */
} int4_args;

/* Q8_0 (q8): the tile's codes h (rows 0..K-1) and l (rows K..2K-1) give u = 16h + l = q + 128,
 * and with the block's scale s
 *   y[n] += s * sum_k x[k] * (u[n, k] - 128)
 * with one pass over both halves and no zero term: it reads 1.0625 bytes per value, Q8_0's own
 * size (a scale per 32 values). Q4_0 without its zeros reads 0.5625, its own size too.
 *
 * Group g's 64 (scale, zero) pairs of a tile, or its 64 scales where the zeros are 0. */
static inline const uint16_t *group_scales(const int4_args *a, int64_t tile, int64_t g) {
    return a->scale_zero + (g * a->n_pad + tile * TILE) * (a->pairs ? 2 : 1);
}

/* Asks for the two lines of the quad PREFETCH_ROWS tile rows after `quad` (its four rows of 32
 * bytes), into L2. */
static inline void prefetch_quad(const uint8_t *quad) {
    __builtin_prefetch(quad + PREFETCH_ROWS * HALF, 0, 2);
    __builtin_prefetch(quad + (PREFETCH_ROWS + 2) * HALF, 0, 2);
}

/* Each group's 64 bf16 (scale, zero) pairs (or 64 scales) lie N * 4 (2) bytes after the previous
 * group's, in another page: the kernels ask for them two groups early. */
static inline void prefetch_scales(const uint16_t *scales, const int pairs) {
    for (int line = 0; line < (pairs ? 4 : 2); line++) __builtin_prefetch(scales + line * 32, 0, 2);
}

/* Adds scale * sums + zero * xsum for group g to total[i][r] (rows i of x, r of the tile). */
static inline void add_group(const int4_args *a, int64_t tile, int64_t g, int64_t i0, int rows,
                             float sums[ROWS_AT_ONCE][TILE], float total[ROWS_AT_ONCE][TILE]) {
    const uint16_t *sz = group_scales(a, tile, g);
    for (int r = 0; r < TILE; r++) {
        const float s = bf16_to_f32(sz[a->pairs ? 2 * r : r]), z = a->pairs ? bf16_to_f32(sz[2 * r + 1]) : 0.0f;
        for (int i = 0; i < rows; i++) total[i][r] += s * sums[i][r] + z * a->xsum[(i0 + i) * (a->kp / a->group) + g];
    }
}

#ifdef __AVX512F__
#define KERNEL static inline __attribute__((always_inline)) void
#define UNROLLED _Pragma("GCC unroll 8")

/* The bf16 scales of rows first .. first + 15 (four bytes a row in (scale, zero) pairs, two
 * where the scales stand alone) as float32. */
static inline __attribute__((always_inline)) __m512 scales16(const uint16_t *sz, int first, const int pairs) {
    const __m512i lanes = pairs ? _mm512_loadu_si512(sz + 2 * first)
                                : _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(sz + first)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16));
}

/* Their zeros as float32: the pairs' upper halves, or 0. */
static inline __attribute__((always_inline)) __m512 zeros16(const uint16_t *sz, int first, const int pairs) {
    return pairs ? _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(0xFFFF), _mm512_loadu_si512(sz + 2 * first)))
                 : _mm512_setzero_ps();
}

/* Rows i0 .. i0 + R - 1 of x against tile `tile`, all groups, into total. */
KERNEL tile_rows(const int4_args *a, int64_t tile, int64_t i0, float total[ROWS_AT_ONCE][TILE], const int R) {
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const uint8_t *codes = a->packed + tile * a->kp * HALF;
    const int64_t groups = a->kp / a->group;
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[ROWS_AT_ONCE][4];
        UNROLLED for (int i = 0; i < R; i++)
            UNROLLED for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();
        for (int64_t k = g * a->group; k < (g + 1) * a->group; k++) {
            if ((k & 1) == 0) __builtin_prefetch(codes + (k + 16) * HALF, 0, 2); /* 512 bytes ahead */
            const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + k * HALF)));
            const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + k * HALF + 16)));
            /* Rows 0-15, 16-31 (low nibbles), 32-47, 48-63 (high nibbles). */
            const __m512 w[4] = {
                _mm512_permutexvar_ps(first, table),
                _mm512_permutexvar_ps(second, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32(first, 4), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32(second, 4), table),
            };
            UNROLLED for (int i = 0; i < R; i++) {
                const __m512 xv = _mm512_set1_ps(a->x[(i0 + i) * a->kp + k]);
                UNROLLED for (int v = 0; v < 4; v++) acc[i][v] = _mm512_fmadd_ps(xv, w[v], acc[i][v]);
            }
        }
        const uint16_t *sz = group_scales(a, tile, g);
        UNROLLED for (int v = 0; v < 4; v++) {
            const __m512 s = scales16(sz, v * 16, a->pairs), z = zeros16(sz, v * 16, a->pairs);
            UNROLLED for (int i = 0; i < R; i++) {
                const __m512 xs = _mm512_set1_ps(a->xsum[(i0 + i) * groups + g]);
                __m512 t = _mm512_loadu_ps(total[i] + v * 16);
                t = _mm512_fmadd_ps(s, acc[i][v], _mm512_fmadd_ps(z, xs, t));
                _mm512_storeu_ps(total[i] + v * 16, t);
            }
        }
    }
}


#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define VNNI 1
#define VNNI_ROWS 2    /* rows of x at a time: two accumulator sets each fill the registers */
/* Byte 4j + l of the permuted vector: tile row k + l, column j (+ 16 for the second half), from
 * the two 64-byte loads A = rows k, k+1 and B = rows k+2, k+3 (indices 64.. select from B). */
static inline __m512i transpose_index(int first_column) {
    uint8_t index[64];
    for (int j = 0; j < 16; j++)
        for (int l = 0; l < 4; l++) index[4 * j + l] = (uint8_t)(l * 32 + first_column + j);
    return _mm512_loadu_si512(index);
}

/* Tile rows k .. k + 3 of `rows` (32 bytes each) as 16 lanes of four consecutive k: tile columns
 * 0-15 in *first, 16-31 in *second. Asks for the rows PREFETCH_ROWS further on. */
static inline __attribute__((always_inline)) void four_rows(const uint8_t *rows, int64_t k, __m512i first_half,
                                                            __m512i second_half, __m512i *first, __m512i *second) {
    prefetch_quad(rows + k * HALF);
    const __m512i rows01 = _mm512_loadu_si512(rows + k * HALF), rows23 = _mm512_loadu_si512(rows + (k + 2) * HALF);
    *first = _mm512_permutex2var_epi8(rows01, first_half, rows23);
    *second = _mm512_permutex2var_epi8(rows01, second_half, rows23);
}

/* acc + VPDPBUSD(u8's unsigned bytes, s8's signed bytes), the accumulator kept in its register: GCC 12
 * compiles the intrinsic in these loops as a copy of acc to another register and a copy back around
 * every product (16 moves per quad at one row); this form has none, and is 2-7% faster at 4-64 rows
 * on Zen 4 (docs/kernels.md, linear_int4). Same instruction, same integer sums. */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
    return acc;
}

/* The products of four k of 64 codes (w: rows 0-15, 16-31, 32-47, 48-63) with rows i0.. of x,
 * its xq part into acc and its xq_low part into rest. */
static inline __attribute__((always_inline)) void add_products(const int4_args *a, int64_t i0, int64_t k,
                                                               const __m512i w[4], __m512i acc[VNNI_ROWS][4],
                                                               __m512i rest[VNNI_ROWS][4], const int R) {
    UNROLLED for (int i = 0; i < R; i++) {
        int32_t four_high, four_low;
        memcpy(&four_high, a->xq + (i0 + i) * a->kp + k, sizeof four_high);
        memcpy(&four_low, a->xq_low + (i0 + i) * a->kp + k, sizeof four_low);
        const __m512i xh = _mm512_set1_epi32(four_high), xl = _mm512_set1_epi32(four_low);
        UNROLLED for (int v = 0; v < 4; v++) {
            acc[i][v] = dpbusd(acc[i][v], w[v], xh);
            rest[i][v] = dpbusd(rest[i][v], w[v], xl);
        }
    }
}

/* acc = LOW_STEPS * acc + rest: the group's sums of codes x (x / sx), exact in int32 (|acc| < 2^31
 * for groups of up to 256: the caller checks). Q8_0's; int4's fold in float32 (below). */
static inline __attribute__((always_inline)) void fold_low(__m512i acc[VNNI_ROWS][4], __m512i rest[VNNI_ROWS][4],
                                                           const int R) {
    const __m512i steps = _mm512_set1_epi32(LOW_STEPS);
    UNROLLED for (int i = 0; i < R; i++)
        UNROLLED for (int v = 0; v < 4; v++)
            acc[i][v] = _mm512_add_epi32(_mm512_mullo_epi32(acc[i][v], steps), rest[i][v]);
}

/* The codes of tile rows k .. k + 3 as VPDPBUSD reads them, four vectors of 16 lanes of four
 * consecutive k (tile columns 0-15, 16-31, 32-47, 48-63): int4 codes 0..15, for Q8_0 (q8) the
 * byte u = 16h + l = q + 128 of its two nibble halves, or for 6-bit codes (q6) u = 16h + l =
 * q + 32 with l from a tile's K rows of nibbles (int4's layout) and h from the 2-bit planes after
 * them: K / 4 vectors of 64 bytes, quad k / 4's already in VPDPBUSD's order, byte 4j + i holding
 * h of tile columns j, 16 + j, 32 + j, 48 + j at k + i in bits 0-1, 2-3, 4-5, 6-7. A quad's
 * codes are thus 128 + 64 bytes: 0.75 bytes per value, with a bf16 scale per 16 values 0.875
 * (Q6_K's 6.56 bits against the 9 of its codes as Q8_0's halves). 6-bit codes may come with
 * (scale, zero) pairs (GGUF Q5_1, Q5_K): tile_rows_vnni adds zero * sum x as for int4. */
static inline __attribute__((always_inline)) void unpack_quad(const int4_args *a, int64_t tile, int64_t k,
                                                              __m512i w[4]) {
    const __m512i first_half = transpose_index(0), second_half = transpose_index(16);
    const __m512i low_nibble = _mm512_set1_epi8(0x0F), high_nibble = _mm512_set1_epi8((char)0xF0);
    if (a->q6) {
        const uint8_t *low = a->packed + tile * 3 * a->kp * HALF / 2, *planes = low + a->kp * HALF + k * 16;
        const __m512i bits45 = _mm512_set1_epi8(0x30);
        __m512i l1, l2;
        four_rows(low, k, first_half, second_half, &l1, &l2);
        __builtin_prefetch(planes + PREFETCH_ROWS * HALF / 2, 0, 2); /* the same distance in quads */
        const __m512i h = _mm512_loadu_si512(planes);
        w[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(l1, low_nibble), _mm512_slli_epi16(h, 4), bits45, 0xF8);
        w[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(l2, low_nibble), _mm512_slli_epi16(h, 2), bits45, 0xF8);
        w[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low_nibble), h, bits45, 0xF8);
        w[3] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l2, 4), low_nibble), _mm512_srli_epi16(h, 2),
                                         bits45, 0xF8);
    } else if (a->q8) {
        const uint8_t *high = a->packed + tile * 2 * a->kp * HALF, *low = high + a->kp * HALF;
        __m512i h1, h2, l1, l2;
        four_rows(high, k, first_half, second_half, &h1, &h2);
        four_rows(low, k, first_half, second_half, &l1, &l2);
        w[0] = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(h1, 4), high_nibble), _mm512_and_si512(l1, low_nibble));
        w[1] = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(h2, 4), high_nibble), _mm512_and_si512(l2, low_nibble));
        w[2] = _mm512_or_si512(_mm512_and_si512(h1, high_nibble), _mm512_and_si512(_mm512_srli_epi16(l1, 4), low_nibble));
        w[3] = _mm512_or_si512(_mm512_and_si512(h2, high_nibble), _mm512_and_si512(_mm512_srli_epi16(l2, 4), low_nibble));
    } else {
        __m512i first, second;
        four_rows(a->packed + tile * a->kp * HALF, k, first_half, second_half, &first, &second);
        w[0] = _mm512_and_si512(first, low_nibble);
        w[1] = _mm512_and_si512(second, low_nibble);
        w[2] = _mm512_and_si512(_mm512_srli_epi16(first, 4), low_nibble);
        w[3] = _mm512_and_si512(_mm512_srli_epi16(second, 4), low_nibble);
    }
}

/* Rows 0 .. R - 1 of a tile's totals into registers (the VNNI kernels hold them across the
 * groups), and back. */
static inline __attribute__((always_inline)) void load_totals(__m512 sum[][4], float total[][TILE], const int R) {
    UNROLLED for (int i = 0; i < R; i++)
        UNROLLED for (int v = 0; v < 4; v++) sum[i][v] = _mm512_loadu_ps(total[i] + v * 16);
}
static inline __attribute__((always_inline)) void store_totals(float total[][TILE], __m512 sum[][4], const int R) {
    UNROLLED for (int i = 0; i < R; i++)
        UNROLLED for (int v = 0; v < 4; v++) _mm512_storeu_ps(total[i] + v * 16, sum[i][v]);
}

/* Rows i0 .. i0 + R - 1 of x against tile `tile`, all groups, into total, the codes unpacked as
 * they are read (decodes: below CACHE_MIN_ROWS rows). Int4 weights add (zero - 8 scale) * sum x
 * per group; Q8_0 subtracts 128 * sum xq, exact in int32 (sum xq * q = sum xq * u - 128 sum xq). */
KERNEL tile_rows_vnni(const int4_args *a, int64_t tile, int64_t i0, float total[][TILE], const int R) {
    const int64_t groups = a->kp / a->group;
    __m512 sum[VNNI_ROWS][4]; /* total's rows, in registers across the groups */
    load_totals(sum, total, R);
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *sz = group_scales(a, tile, g);
        if (g + 2 < groups) prefetch_scales(group_scales(a, tile, g + 2), a->pairs);
        __m512i acc[VNNI_ROWS][4], rest[VNNI_ROWS][4]; /* sums of codes x xq and x xq_low */
        UNROLLED for (int i = 0; i < R; i++)
            UNROLLED for (int v = 0; v < 4; v++) acc[i][v] = rest[i][v] = _mm512_setzero_si512();
        for (int64_t k = g * a->group; k < (g + 1) * a->group; k += 4) {
            __m512i w[4];
            unpack_quad(a, tile, k, w);
            add_products(a, i0, k, w, acc, rest, R);
        }
        if (a->q8) fold_low(acc, rest, R);
        UNROLLED for (int v = 0; v < 4; v++) {
            const __m512 s = scales16(sz, v * 16, a->pairs);
            if (a->q8) {
                /* 6-bit codes may carry a zero per group (GGUF Q5_1, Q5_K): + zero * sum x */
                const __m512 z = zeros16(sz, v * 16, a->pairs);
                UNROLLED for (int i = 0; i < R; i++) {
                    const int64_t at = (i0 + i) * groups + g;
                    const __m512i corrected = _mm512_sub_epi32(acc[i][v], _mm512_set1_epi32((a->q6 ? 32 : 128) * a->xqsum[at]));
                    const __m512 t = a->pairs ? _mm512_fmadd_ps(z, _mm512_set1_ps(a->xsum[at]), sum[i][v]) : sum[i][v];
                    sum[i][v] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(a->sx[at])), _mm512_cvtepi32_ps(corrected), t);
                }
            } else {
                const __m512 z = zeros16(sz, v * 16, a->pairs);
                const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z); /* zero - 8 scale */
                UNROLLED for (int i = 0; i < R; i++) {
                    const int64_t at = (i0 + i) * groups + g;
                    __m512 t = _mm512_fmadd_ps(offset, _mm512_set1_ps(a->xsum[at]), sum[i][v]);
                    /* LOW_STEPS * acc + rest rounded once, as the int32 fold then its conversion: both
                     * sums of int4 codes are below 2^24 (group x 15 x 127), so exact in float32, and a
                     * fused multiply-add rounds the exact integer. VPMULLD costs more than the two
                     * conversions on Zen 4: 4-8% at 16 rows (docs/kernels.md, linear_int4). */
                    const __m512 folded = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][v]), _mm512_set1_ps((float)LOW_STEPS),
                                                          _mm512_cvtepi32_ps(rest[i][v]));
                    sum[i][v] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(a->sx[at])), folded, t);
                }
            }
        }
    }
    store_totals(total, sum, R);
}

/* From CACHE_MIN_ROWS rows on (prompts) each tile's codes are widened once to int16 and multiplied
 * by x16 = LOW_STEPS xq + xq_low (both int8 parts in one int16, |.| <= 32385) with VPDPWSSD, 32
 * products per instruction into 16 int32 lanes: the integers that the two VPDPBUSD parts and their
 * fold make (|sum| <= group x 255 x 32385 < 2^31 for groups of up to 256), in one accumulator set
 * instead of two and without the fold, so four rows x 64 outputs fit the registers and a group's
 * epilogue is a third shorter. The AVX2 wide path's layout and epilogue (tile_rows_avx2_wide): the
 * same bits as the VNNI path at every row count.
 *
 * The buffer: for each pair of tile rows (k, k + 1) four vectors, cache[k / 2 * 4 + v], lane l of
 * vector v the two int16 codes (k, k + 1) of output row 16 v + l, signed: int4 codes as stored
 * (0..15), Q8_0's q = u - 128, 6-bit ones q = u - 32. They come from unpack_quad (which asks for
 * the packed rows ahead: without that, 16-row calls from memory ran 5-15% slower than unpacking per
 * pair of rows): its lane of four bytes (k .. k + 3) becomes two int16 pairs, (k, k + 1) in the
 * vector of pair k / 2 and (k + 2, k + 3) in the next. */
static void widen_tile_vnni(const int4_args *a, int64_t tile, __m512i *cache) {
    const __m512i offset = _mm512_set1_epi16(a->q6 ? 32 : a->q8 ? 128 : 0);
    const __m512i first_pairs = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i second_pairs = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t k = 0; k < a->kp; k += 4) {
        __m512i w[4];
        unpack_quad(a, tile, k, w);
        for (int v = 0; v < 4; v++) { /* lanes 0-7 and 8-15 of w[v], each byte an int16 */
            const __m512i low = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(w[v])), offset);
            const __m512i high = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(w[v], 1)), offset);
            cache[k / 2 * 4 + v] = _mm512_permutex2var_epi32(low, first_pairs, high);
            cache[(k / 2 + 1) * 4 + v] = _mm512_permutex2var_epi32(low, second_pairs, high);
        }
    }
}

/* acc + VPDPWSSD(w's int16 pairs, x's), the accumulator kept in its register (as dpbusd). */
static inline __attribute__((always_inline)) __m512i dpwssd(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

/* Rows i0 .. i0 + R - 1 of x against the widened tile, all groups, into total: per pair of k the
 * four code vectors loaded once for the R rows, each row's x16 pair broadcast once for the four.
 * The epilogue is the VNNI path's operations in its order (int4: + offset * sum x, then + scale *
 * sx * sums; Q8_0's sums already signed). Machine A (Sapphire Rapids), 512 rows, 2 threads,
 * against the two VPDPBUSD parts: Q8_0 1024 x 3072 11-13 -> 8-9 ms, 3072 x 1024 11-13 -> 9-10,
 * Q4_0 1024 x 6144 (256 rows) 10-11 -> 8-9. Running a chunk of 128 k of the tile (16 KiB) through
 * all rows before the next, to hold the codes in L1, was no faster (within 3%). */
KERNEL tile_rows_vnni_wide(const int4_args *a, int64_t tile, int64_t i0, float total[][TILE],
                           const __m512i *cache, const int R) {
    const int64_t groups = a->kp / a->group;
    const int16_t *x[ROWS_AT_ONCE];
    UNROLLED for (int i = 0; i < R; i++) x[i] = a->x16 + (i0 + i) * a->kp;
    __m512 sum[ROWS_AT_ONCE][4]; /* total's rows, in registers across the groups */
    load_totals(sum, total, R);
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *sz = group_scales(a, tile, g);
        if (g + 2 < groups) prefetch_scales(group_scales(a, tile, g + 2), a->pairs);
        __m512i acc[ROWS_AT_ONCE][4];
        UNROLLED for (int i = 0; i < R; i++)
            UNROLLED for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_si512();
        const __m512i *w = cache + g * a->group / 2 * 4;
        for (int64_t k = g * a->group; k < (g + 1) * a->group; k += 2, w += 4) {
            __m512i codes[4];
            UNROLLED for (int v = 0; v < 4; v++) codes[v] = _mm512_load_si512(w + v);
            UNROLLED for (int i = 0; i < R; i++) {
                int32_t two; /* x16[k], x16[k + 1] */
                memcpy(&two, x[i] + k, sizeof two);
                const __m512i xv = _mm512_set1_epi32(two);
                UNROLLED for (int v = 0; v < 4; v++) acc[i][v] = dpwssd(acc[i][v], codes[v], xv);
            }
        }
        UNROLLED for (int v = 0; v < 4; v++) {
            const __m512 s = scales16(sz, v * 16, a->pairs);
            const __m512 z = zeros16(sz, v * 16, a->pairs);
            /* int4: zero - 8 scale; 6-bit codes with zeros (GGUF Q5_1, Q5_K): the zero (no term for Q8_0) */
            const __m512 offset = a->q8 ? z : _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);
            UNROLLED for (int i = 0; i < R; i++) {
                const int64_t at = (i0 + i) * groups + g;
                const __m512 t = a->q8 && !a->pairs ? sum[i][v]
                                                    : _mm512_fmadd_ps(offset, _mm512_set1_ps(a->xsum[at]), sum[i][v]);
                sum[i][v] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(a->sx[at])), _mm512_cvtepi32_ps(acc[i][v]), t);
            }
        }
    }
    store_totals(total, sum, R);
}
#define TILE_ROWS tile_rows_vnni
#else
#define TILE_ROWS tile_rows
#endif


/* Q8_0 in float32: q = 16h + l - 128 per lane, exact. */
KERNEL q8_tile_rows(const int4_args *a, int64_t tile, int64_t i0, float total[ROWS_AT_ONCE][TILE], const int R) {
    const uint8_t *high = a->packed + tile * 2 * a->kp * HALF, *low = high + a->kp * HALF;
    const int64_t groups = a->kp / a->group;
    const __m512i nibble = _mm512_set1_epi32(0x0F), offset = _mm512_set1_epi32(128);
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[ROWS_AT_ONCE][4];
        UNROLLED for (int i = 0; i < R; i++)
            UNROLLED for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();
        for (int64_t k = g * a->group; k < (g + 1) * a->group; k++) {
            __m512 w[4];
            UNROLLED for (int half = 0; half < 2; half++) {
                const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(high + k * HALF + 16 * half)));
                const __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(low + k * HALF + 16 * half)));
                UNROLLED for (int shift = 0; shift < 2; shift++) {
                    const __m512i hv = _mm512_and_si512(_mm512_srli_epi32(h, 4 * shift), nibble);
                    const __m512i lv = _mm512_and_si512(_mm512_srli_epi32(l, 4 * shift), nibble);
                    const __m512i q = _mm512_sub_epi32(_mm512_or_si512(_mm512_slli_epi32(hv, 4), lv), offset);
                    w[2 * shift + half] = _mm512_cvtepi32_ps(q); /* rows 0-15, 16-31, 32-47, 48-63 */
                }
            }
            UNROLLED for (int i = 0; i < R; i++) {
                const __m512 xv = _mm512_set1_ps(a->x[(i0 + i) * a->kp + k]);
                UNROLLED for (int v = 0; v < 4; v++) acc[i][v] = _mm512_fmadd_ps(xv, w[v], acc[i][v]);
            }
        }
        const uint16_t *sz = group_scales(a, tile, g);
        UNROLLED for (int v = 0; v < 4; v++) {
            const __m512 s = scales16(sz, v * 16, 0);
            UNROLLED for (int i = 0; i < R; i++) {
                __m512 t = _mm512_loadu_ps(total[i] + v * 16);
                _mm512_storeu_ps(total[i] + v * 16, _mm512_fmadd_ps(s, acc[i][v], t));
            }
        }
    }
}

#ifdef VNNI
/* The VNNI kernel takes up to VNNI_ROWS rows: R rows run as blocks of that many. */
#define SPECIALIZE(R)                                                                                 \
    static void tile_rows_##R(const int4_args *a, int64_t t, int64_t i0, float tot[ROWS_AT_ONCE][TILE], \
                              const void *cache) {                                                    \
        if (a->q8 && a->exact) {                                                                      \
            q8_tile_rows(a, t, i0, tot, R);                                                           \
        } else if (a->exact) {                                                                        \
            tile_rows(a, t, i0, tot, R);                                                              \
        } else if (cache != NULL) {                                                                   \
            tile_rows_vnni_wide(a, t, i0, tot, cache, R);                                             \
        } else {                                                                                      \
            tile_rows_vnni(a, t, i0, tot, (R) < VNNI_ROWS ? (R) : VNNI_ROWS);                         \
            if ((R) > VNNI_ROWS) tile_rows_vnni(a, t, i0 + VNNI_ROWS, tot + VNNI_ROWS, (R) - VNNI_ROWS); \
        }                                                                                             \
    }
#else
#define SPECIALIZE(R)                                                                                 \
    static void tile_rows_##R(const int4_args *a, int64_t t, int64_t i0, float tot[ROWS_AT_ONCE][TILE], \
                              const void *cache) {                                                    \
        (void)cache;                                                                                  \
        if (a->q8)                                                                                    \
            q8_tile_rows(a, t, i0, tot, R);                                                           \
        else                                                                                          \
            tile_rows(a, t, i0, tot, R);                                                              \
    }
#endif
SPECIALIZE(1)
SPECIALIZE(2)
SPECIALIZE(3)
SPECIALIZE(4)
typedef void (*rows_fn)(const int4_args *, int64_t, int64_t, float[ROWS_AT_ONCE][TILE], const void *);
static const rows_fn tile_rows_table[ROWS_AT_ONCE] = {tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4};

static void run_tile_rows(const int4_args *a, int64_t tile, int64_t i0, int rows, float total[ROWS_AT_ONCE][TILE],
                          const void *cache) {
    tile_rows_table[rows - 1](a, tile, i0, total, cache);
}

#else /* no AVX-512: the same sums in plain C */

static void q8_tile_rows(const int4_args *a, int64_t tile, int64_t i0, int rows, float total[ROWS_AT_ONCE][TILE]) {
    const uint8_t *high = a->packed + tile * 2 * a->kp * HALF, *low = high + a->kp * HALF;
    for (int64_t g = 0; g < a->kp / a->group; g++) {
        float sums[ROWS_AT_ONCE][TILE] = {{0}};
        for (int64_t k = g * a->group; k < (g + 1) * a->group; k++) {
            float w[TILE];
            for (int j = 0; j < HALF; j++) {
                const uint8_t h = high[k * HALF + j], l = low[k * HALF + j];
                w[j] = (float)(((h & 0x0F) << 4 | (l & 0x0F)) - 128);
                w[HALF + j] = (float)(((h & 0xF0) | (l >> 4)) - 128);
            }
            for (int i = 0; i < rows; i++) {
                const float xv = a->x[(i0 + i) * a->kp + k];
                for (int r = 0; r < TILE; r++) sums[i][r] = MADD(xv, w[r], sums[i][r]);
            }
        }
        const uint16_t *sz = group_scales(a, tile, g);
        for (int r = 0; r < TILE; r++)
            for (int i = 0; i < rows; i++) total[i][r] += bf16_to_f32(sz[r]) * sums[i][r];
    }
}

static void plain_tile_rows(const int4_args *a, int64_t tile, int64_t i0, int rows, float total[ROWS_AT_ONCE][TILE]) {
    const uint8_t *codes = a->packed + tile * a->kp * HALF;
    for (int64_t g = 0; g < a->kp / a->group; g++) {
        float sums[ROWS_AT_ONCE][TILE] = {{0}};
        for (int64_t k = g * a->group; k < (g + 1) * a->group; k++) {
            float w[TILE];
            for (int j = 0; j < HALF; j++) {
                w[j] = (float)((codes[k * HALF + j] & 0x0F) - 8);
                w[HALF + j] = (float)((codes[k * HALF + j] >> 4) - 8);
            }
            for (int i = 0; i < rows; i++) {
                const float xv = a->x[(i0 + i) * a->kp + k];
                for (int r = 0; r < TILE; r++) sums[i][r] = MADD(xv, w[r], sums[i][r]);
            }
        }
        add_group(a, tile, g, i0, rows, sums, total);
    }
}

#if defined(__AVX2__)
/* AVX2 (older Intel, AMD Zen 1-3): the VNNI way's exact integer sums, made with VPMADDWD (int16
 * pairs multiplied and added into int32): x as x16 = LOW_STEPS xq + xq_low (|.| <= 32385, both
 * int8 parts in one int16), the codes widened to int16, one VPMADDWD per 16 products. The int32
 * sums are LOW_STEPS (codes . xq) + codes . xq_low, the integers the VNNI path makes, and the
 * float32 epilogue is its operations in its order: the VNNI path's bits. At decode the codes are
 * widened in registers as they are read (rows_avx2); from a few rows on, once per tile into a
 * buffer that every row reads (tile_rows_avx2_wide).
 *
 * History, on a Zen 3 (machine C, two cores): the plain C float32 sums are compute bound here (4.4
 * GB/s of int4 bytes on two 2.0 GHz cores, against 20 GB/s for AVX-512), as were AVX2 intrinsics
 * of them. VPMADDUBSW over x's two int8 parts (int4 codes unsigned, int16 sums over spans of 16 k;
 * Q8_0 by llama.cpp's sign trick on quads transposed into lanes of four k) came next; asking for
 * both lines of each quad and each group's scales ahead took one Q4_0 row from 4.5 to 8.6 GB/s on
 * one core. Widening in registers replaced it: int4 one row 5-10% faster, two rows 10-15%; Q8_0's
 * 151936 x 1024 output matrix one row 6.3 -> 5.7 ms, two 11.1 -> 7.4 (it had spilled four sums in
 * every step), one core 12.4 -> 10.2 ms. */
#define AVX2_DOTS 1
/* Rows of x from which a tile is widened once (tile_rows_avx2_wide) rather than as it is read
 * (rows_avx2): measured on Zen 3 (machine C, two cores), one 38400 x 1024 weight (20 MB in int4,
 * 40 in Q8_0) at 4 rows 5-10% faster as read, at 5, 6 and 7 rows 8%, 0-13% and 23% faster widened
 * (2026-12-07, after the widened loop kept its sums in registers; it had been 8 before). */
#define WIDE_MIN_ROWS 5
/* int4: the 32 codes (0..15) of one tile row for the output rows of nibble half `half`. */
static inline __attribute__((always_inline)) __m256i int4_row_avx2(const uint8_t *row, int half) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)row);
    return _mm256_and_si256(half ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
}

/* Q8_0's u = 16h + l (0..255) of one tile row k, for the 32 output rows of nibble half `half`:
 * h, l the nibbles of that half in the high and low codes. */
static inline __attribute__((always_inline)) __m256i q8_row_avx2(const uint8_t *high, const uint8_t *low, int64_t k,
                                                                 int half) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(high + k * HALF));
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(low + k * HALF));
    return half ? _mm256_or_si256(_mm256_andnot_si256(nibble, h), _mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble))
                : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, nibble), 4),
                                  _mm256_and_si256(lo, nibble)); /* a nibble shifted stays in its byte */
}

/* Eight lanes of bf16 (scale, zero) pairs, or of scales widened with a zero half: the scales and
 * the offsets zero - 8 scale as float32. */
static inline __attribute__((always_inline)) __m256 scale_lanes(__m256i scale_zero) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(scale_zero, 16));
}
static inline __attribute__((always_inline)) __m256 offset_lanes(__m256i scale_zero, __m256 s) {
    const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(scale_zero, _mm256_set1_epi32((int)0xFFFF0000u)));
    return _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z);
}

/* One group's epilogue for eight outputs of one row of x, the same fused operations in the same
 * order on every AVX2 path (hence their common bits): total + offset * sum x (not for Q8_0), then
 * + scale * sx * sums. */
static inline __attribute__((always_inline)) __m256 add_group_sums(__m256 t, __m256 s, __m256 offset, __m256i sums,
                                                                   float sx, float xsum, const int q8) {
    if (!q8) t = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum), t);
    return _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(sx)), _mm256_cvtepi32_ps(sums), t);
}

/* add_group_sums for eight adjacent outputs first .. first + 7 of one row of x: the scales (and
 * offsets) of group `sz` read with plain loads (scales8: bf16 (scale, zero) pairs, or (pairs 0)
 * each scale widened with a zero half). */
static inline __attribute__((always_inline)) void scales8(const uint16_t *sz, int first, const int q8, const int pairs,
                                                          __m256 *s, __m256 *offset) {
    const __m256i scale_zero = pairs ? _mm256_loadu_si256((const __m256i *)(sz + 2 * first))
                                     : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sz + first)));
    *s = scale_lanes(scale_zero);
    *offset = q8 ? *s : offset_lanes(scale_zero, *s);
}
static inline __attribute__((always_inline)) void add_rows8_avx2(const uint16_t *sz, float *total, int first,
                                                                 __m256i sums, float sx, float xsum, const int q8,
                                                                 const int pairs) {
    __m256 s, offset;
    scales8(sz, first, q8, pairs, &s, &offset);
    _mm256_storeu_ps(total + first, add_group_sums(_mm256_loadu_ps(total + first), s, offset, sums, sx, xsum, q8));
}

/* The decode loops' int32 sums come as "row vectors": for half h of a tile (rows 32h .. 32h + 31)
 * vector v (0..3) holds rows 32h + 4v .. 32h + 4v + 3 in lanes 0-3 and the rows 16 further in
 * lanes 4-7 (what unpacking tile rows k and k + 1 twice yields). Two of them, `low` for rows
 * first .. first + 3 and `high` for the next four, become two vectors of eight adjacent rows
 * (first .. first + 7 and the eight 16 further) by two lane swaps, each added as add_rows8_avx2
 * does: the same operations lane by lane, hence the same bits, as the wide path. Adding each row
 * vector as its two halves took ~17 operations per four rows (the scales and totals gathered from
 * two places), a third of a one-row group's work. */
static inline __attribute__((always_inline)) void add_sums_avx2(const uint16_t *sz, float *total, int first,
                                                                __m256i low, __m256i high, float sx, float xsum,
                                                                const int q8, const int pairs) {
    add_rows8_avx2(sz, total, first, _mm256_permute2x128_si256(low, high, 0x20), sx, xsum, q8, pairs);
    add_rows8_avx2(sz, total, first + 16, _mm256_permute2x128_si256(low, high, 0x31), sx, xsum, q8, pairs);
}

/* The codes of tile rows k and k + 1 for the output rows of nibble half `half`, in int16 as four
 * row vectors, each lane the pair (k, k + 1) of one output row: int4 codes as stored (0..15),
 * Q8_0's as u = 16h + l (0..255). */
static inline __attribute__((always_inline)) void widen_pair_avx2(const uint8_t *codes, const uint8_t *low,
                                                                  int64_t k, const int half, const int q8,
                                                                  __m256i w[4]) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i n[2];
    for (int l = 0; l < 2; l++)
        n[l] = q8 ? q8_row_avx2(codes, low, k + l, half) : int4_row_avx2(codes + (k + l) * HALF, half);
    /* rows 0-7 | 16-23 and 8-15 | 24-31 of the half, k and k + 1 side by side */
    const __m256i pairs[2] = {_mm256_unpacklo_epi8(n[0], n[1]), _mm256_unpackhi_epi8(n[0], n[1])};
    for (int p = 0; p < 2; p++) {
        w[2 * p] = _mm256_unpacklo_epi8(pairs[p], zero);
        w[2 * p + 1] = _mm256_unpackhi_epi8(pairs[p], zero);
    }
}

/* From a few rows of x on (WIDE_MIN_ROWS) the codes of a tile are widened once into a
 * per-thread buffer (|sum| <= group x 128 x 32385 < 2^31 for groups up to 256).
 *
 * The buffer: for each pair of tile rows (k, k + 1) eight vectors, cache[k / 2 * 8 + v], lane l
 * of vector v the two int16 codes (k, k + 1) of output row 8v + l: eight adjacent rows, so the
 * epilogue reads their scales and totals with plain loads. Q8_0's codes are q = u - 128
 * (signed), int4's as stored (0..15). */
static void widen_tile_avx2(const int4_args *a, int64_t tile, __m256i *cache) {
    const uint8_t *codes = a->packed + tile * (a->q8 ? 2 : 1) * a->kp * HALF, *low = codes + a->kp * HALF;
    const __m256i offset = _mm256_set1_epi16(a->q8 ? 128 : 0);
    for (int64_t k = 0; k < a->kp; k += 2)
        for (int half = 0; half < 2; half++) {
            __m256i n[2], *to = cache + k / 2 * 8 + 4 * half;
            for (int l = 0; l < 2; l++)
                n[l] = a->q8 ? q8_row_avx2(codes, low, k + l, half) : int4_row_avx2(codes + (k + l) * HALF, half);
            for (int part = 0; part < 2; part++) { /* rows 0-15, 16-31 of the half */
                const __m128i r0 = part ? _mm256_extracti128_si256(n[0], 1) : _mm256_castsi256_si128(n[0]);
                const __m128i r1 = part ? _mm256_extracti128_si256(n[1], 1) : _mm256_castsi256_si128(n[1]);
                to[2 * part] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(r0, r1)), offset);
                to[2 * part + 1] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(r0, r1)), offset);
            }
        }
}

/* R rows of x against the widened tile: two vectors of codes at a time (a group's pairs of k
 * innermost), held in registers, so each code vector loaded serves R rows, each broadcast of x two
 * vectors, and 2R sums stay in registers. The epilogue is add_group_sums on eight adjacent rows,
 * as at decode (the same bits).
 *
 * The empty asm statements keep GCC's registers straight: without them it folded each code load
 * into all four of its VPMADDWD and spilled one sum to the stack, whose store and reload every
 * step then bounded the loop. VPMADDWD issues twice a cycle on a Zen 3, so the loop had run at
 * ~0.8 of one. On machine C (two cores), 256 rows of a 4096 x 1024 weight: Q4_0 1.55x, Q8_0 1.65x
 * faster than with the sums' epilogue in row vectors and the loads folded (16 to 64 rows
 * 1.3-1.5x; 2026-12-07).
 *
 * `group` is a constant for GGUF's blocks of 32 (AVX2_WIDE), so that a group's 16 steps unroll
 * whole: as a loop of a run-time count the same 4096 x 1024 weight at 5 to 256 rows ran 7-20%
 * slower (medians, same bits; groups of 32 had then run 30% below groups of 128). */
static inline __attribute__((always_inline)) void tile_rows_avx2_wide(const int4_args *a, int64_t tile, int64_t i0,
                                                                      float total[ROWS_AT_ONCE][TILE],
                                                                      const __m256i *cache, const int R,
                                                                      const int q8, const int64_t group) {
    const int64_t groups = a->kp / group;
    const int16_t *x[ROWS_AT_ONCE];
    for (int i = 0; i < R; i++) x[i] = a->x16 + (i0 + i) * a->kp;
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *sz = group_scales(a, tile, g);
        const int64_t begin = g * group, end = begin + group;
        for (int vec = 0; vec < 8; vec += 2) {
            __m256i acc[ROWS_AT_ONCE][2];
            for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
            const __m256i *w = cache + begin / 2 * 8 + vec;
            _Pragma("GCC unroll 16") for (int64_t k = begin; k < end; k += 2, w += 8) {
                __m256i w0 = _mm256_load_si256(w), w1 = _mm256_load_si256(w + 1);
                __asm__("" : "+x"(w0), "+x"(w1)); /* loaded once, not folded into each VPMADDWD */
                for (int i = 0; i < R; i++) {
                    int32_t two; /* x16[k], x16[k + 1] */
                    memcpy(&two, x[i] + k, sizeof two);
                    const __m256i xv = _mm256_set1_epi32(two);
                    acc[i][0] = _mm256_add_epi32(_mm256_madd_epi16(w0, xv), acc[i][0]);
                    acc[i][1] = _mm256_add_epi32(_mm256_madd_epi16(w1, xv), acc[i][1]);
                    __asm__("" : "+x"(acc[i][0]), "+x"(acc[i][1]));
                }
            }
            for (int j = 0; j < 2; j++) { /* add_rows8_avx2 with the scales read once for R rows */
                const int first = 8 * (vec + j);
                __m256 s, offset;
                scales8(sz, first, q8, a->pairs, &s, &offset);
                for (int i = 0; i < R; i++) {
                    const int64_t at = (i0 + i) * groups + g;
                    _mm256_storeu_ps(total[i] + first, add_group_sums(_mm256_loadu_ps(total[i] + first), s, offset,
                                                                      acc[i][j], a->sx[at], a->xsum[at], q8));
                }
            }
        }
    }
}

/* One half (`half`, rows 32 half .. 32 half + 31) of a tile, k from begin to end (a group, a
 * multiple of 4), against R rows of x (xr: each row's x16): the int32 sums into acc as row vectors.
 * Half 0 asks for the quads' lines ahead; half 1 rereads them from L1. */
static inline __attribute__((always_inline)) void group_half_avx2(const uint8_t *codes, const uint8_t *low,
                                                                  int64_t begin, int64_t end,
                                                                  const int16_t *const *xr,
                                                                  __m256i acc[ROWS_AT_ONCE][4], const int R,
                                                                  const int q8, const int half) {
    const __m256i zero = _mm256_setzero_si256();
    for (int i = 0; i < R; i++)
        for (int v = 0; v < 4; v++) acc[i][v] = zero;
    for (int64_t quad = begin; quad < end; quad += 4) {
        if (half == 0) {
            prefetch_quad(codes + quad * HALF);
            if (q8) prefetch_quad(low + quad * HALF);
        }
        for (int64_t k = quad; k < quad + 4; k += 2) {
            __m256i w[4];
            widen_pair_avx2(codes, low, k, half, q8, w);
            for (int i = 0; i < R; i++) {
                int32_t two; /* x16[k], x16[k + 1] */
                memcpy(&two, xr[i] + k, sizeof two);
                const __m256i xv = _mm256_set1_epi32(two);
                for (int v = 0; v < 4; v++) acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_madd_epi16(w[v], xv));
            }
        }
    }
}

/* Rows i0 .. i0 + R - 1 of x against tile `tile` at decode (below WIDE_MIN_ROWS rows), int4 or
 * Q8_0 (q8), into total: tile_rows_avx2_wide's products with the codes widened in registers as
 * they are read, not through a buffer. Per pair of tile rows (k, k + 1) and half, the codes of
 * both side by side in int16 (four row vectors), one VPMADDWD each by x16's pair (k, k + 1).
 * Q8_0's codes go in as u = 16h + l and 128 x16's group sum comes off once: the sums of u x16 are
 * taken modulo 2^32 (|.| can pass 2^31 for groups of 256), so each is sum q x16, the wide path's
 * integer. 22 operations per 64 codes, and the sums fit the registers. */
static inline __attribute__((always_inline)) void rows_avx2(const int4_args *a, int64_t tile, int64_t i0,
                                                            float total[ROWS_AT_ONCE][TILE], const int R,
                                                            const int q8) {
    const uint8_t *codes = a->packed + tile * (q8 ? 2 : 1) * a->kp * HALF, *low = codes + a->kp * HALF;
    const int64_t groups = a->kp / a->group;
    const int16_t *xr[ROWS_AT_ONCE];
    for (int i = 0; i < R; i++) xr[i] = a->x16 + (i0 + i) * a->kp;
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *sz = group_scales(a, tile, g);
        if (g + 2 < groups) prefetch_scales(group_scales(a, tile, g + 2), a->pairs);
        const int64_t begin = g * a->group, end = begin + a->group;
        for (int half = 0; half < 2; half++) {
            __m256i acc[ROWS_AT_ONCE][4];
            if (half == 0)
                group_half_avx2(codes, low, begin, end, xr, acc, R, q8, 0);
            else
                group_half_avx2(codes, low, begin, end, xr, acc, R, q8, 1);
            for (int i = 0; i < R; i++) {
                const int64_t at = (i0 + i) * groups + g;
                const __m256i offset = _mm256_set1_epi32(q8 ? (int32_t)(128u * (uint32_t)a->xqsum[at]) : 0);
                for (int v = 0; v < 4; v += 2)
                    add_sums_avx2(sz, total[i], HALF * half + 4 * v, _mm256_sub_epi32(acc[i][v], offset),
                                  _mm256_sub_epi32(acc[i][v + 1], offset), a->sx[at], a->xsum[at], q8, a->pairs);
            }
        }
    }
}
/* One or two rows of x against an int4 tile at decode: each pair of tile rows (k, k + 1) widened
 * once with both nibbles of a byte in one int16, b = l + 16 h (l the code of output row r, h of
 * row r + 32), and per row vector one VPMADDWD of b and one of its low nibble l by x16's pair: the
 * sums of h come out as (sum b x - sum l x) / 16. Exact: the difference is 16 sum h x, |.| <= 16 x
 * 15 x 32385 x 256 < 2^31 for groups up to 256, so the wrapping int32 sums give it exactly, and the
 * integers are rows_avx2's (hence its bits). rows_avx2 widens each half of the tile apart: per
 * pair of tile rows 37 operations against 29 at one row (the same 8 VPMADDWD), 54 against 46 at
 * two. Two rows take the tile's row vectors in two passes over a group (codes reread from L1), so
 * that their sums fit the 16 registers; three would not. Zen 3 (machine C, two cores), one row:
 * the Q4_0 Qwen3-0.6B shape's largest layer called again and again (in L3) 12% faster, its
 * decode step 5-10% (2026-12-07). */
static inline __attribute__((always_inline)) void rows_int4_avx2(const int4_args *a, int64_t tile, int64_t i0,
                                                                 float total[ROWS_AT_ONCE][TILE], const int R) {
    const uint8_t *codes = a->packed + tile * a->kp * HALF;
    const int64_t groups = a->kp / a->group;
    const int per_pass = R == 1 ? 2 : 1; /* of the two byte-pair vectors of (k, k + 1) */
    const int16_t *x[2];
    for (int i = 0; i < R; i++) x[i] = a->x16 + (i0 + i) * a->kp;
    const __m256i zero = _mm256_setzero_si256(), nibble = _mm256_set1_epi16(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *sz = group_scales(a, tile, g);
        if (g + 2 < groups) prefetch_scales(group_scales(a, tile, g + 2), a->pairs);
        for (int first = 0; first < 2; first += per_pass) {
            /* row vector v of this pass: rows 4 (2 first + v).. (low) and those and 32 further (both) */
            __m256i both[2][4], low[2][4];
            for (int i = 0; i < R; i++)
                for (int v = 0; v < 2 * per_pass; v++) both[i][v] = low[i][v] = zero;
            for (int64_t quad = g * a->group; quad < (g + 1) * a->group; quad += 4) {
                if (first == 0) prefetch_quad(codes + quad * HALF);
                for (int64_t k = quad; k < quad + 4; k += 2) {
                    const __m256i n0 = _mm256_loadu_si256((const __m256i *)(codes + k * HALF));
                    const __m256i n1 = _mm256_loadu_si256((const __m256i *)(codes + (k + 1) * HALF));
                    __m256i xv[2];
                    for (int i = 0; i < R; i++) {
                        int32_t two; /* x16[k], x16[k + 1] */
                        memcpy(&two, x[i] + k, sizeof two);
                        xv[i] = _mm256_set1_epi32(two);
                    }
                    for (int p = first; p < first + per_pass; p++) {
                        const __m256i pair = p ? _mm256_unpackhi_epi8(n0, n1) : _mm256_unpacklo_epi8(n0, n1);
                        for (int s = 0; s < 2; s++) {
                            const __m256i b = s ? _mm256_unpackhi_epi8(pair, zero) : _mm256_unpacklo_epi8(pair, zero);
                            const __m256i l = _mm256_and_si256(b, nibble);
                            const int v = 2 * (p - first) + s;
                            for (int i = 0; i < R; i++) {
                                both[i][v] = _mm256_add_epi32(both[i][v], _mm256_madd_epi16(b, xv[i]));
                                low[i][v] = _mm256_add_epi32(low[i][v], _mm256_madd_epi16(l, xv[i]));
                            }
                        }
                    }
                }
            }
            for (int i = 0; i < R; i++) {
                const int64_t at = (i0 + i) * groups + g;
                for (int v = 0; v < 2 * per_pass; v += 2) {
                    const int row = 4 * (2 * first + v);
                    add_sums_avx2(sz, total[i], row, low[i][v], low[i][v + 1], a->sx[at], a->xsum[at], 0, a->pairs);
                    add_sums_avx2(sz, total[i], HALF + row, _mm256_srai_epi32(_mm256_sub_epi32(both[i][v], low[i][v]), 4),
                                  _mm256_srai_epi32(_mm256_sub_epi32(both[i][v + 1], low[i][v + 1]), 4), a->sx[at],
                                  a->xsum[at], 0, a->pairs);
                }
            }
        }
    }
}
#define AVX2_ROWS(R)                                                                                \
    static void avx2_rows_##R(const int4_args *a, int64_t t, int64_t i0, float tot[ROWS_AT_ONCE][TILE]) { \
        if (a->q8)                                                                                  \
            rows_avx2(a, t, i0, tot, R, 1);                                                         \
        else if (R <= 2)                                                                            \
            rows_int4_avx2(a, t, i0, tot, R);                                                       \
        else                                                                                        \
            rows_avx2(a, t, i0, tot, R, 0);                                                         \
    }
AVX2_ROWS(1)
AVX2_ROWS(2)
AVX2_ROWS(3)
AVX2_ROWS(4)
typedef void (*avx2_rows_fn)(const int4_args *, int64_t, int64_t, float[ROWS_AT_ONCE][TILE]);
static const avx2_rows_fn avx2_rows_table[ROWS_AT_ONCE] = {avx2_rows_1, avx2_rows_2, avx2_rows_3, avx2_rows_4};

#define AVX2_WIDE(R)                                                                                        \
    static void avx2_wide_##R(const int4_args *a, int64_t t, int64_t i0, float tot[ROWS_AT_ONCE][TILE],    \
                              const __m256i *cache) {                                                       \
        if (a->q8 && a->group == 32)                                                                        \
            tile_rows_avx2_wide(a, t, i0, tot, cache, R, 1, 32);                                            \
        else if (a->q8)                                                                                     \
            tile_rows_avx2_wide(a, t, i0, tot, cache, R, 1, a->group);                                      \
        else if (a->group == 32)                                                                            \
            tile_rows_avx2_wide(a, t, i0, tot, cache, R, 0, 32);                                            \
        else                                                                                                \
            tile_rows_avx2_wide(a, t, i0, tot, cache, R, 0, a->group);                                      \
    }
AVX2_WIDE(1)
AVX2_WIDE(2)
AVX2_WIDE(3)
AVX2_WIDE(4)
typedef void (*avx2_wide_fn)(const int4_args *, int64_t, int64_t, float[ROWS_AT_ONCE][TILE], const __m256i *);
static const avx2_wide_fn avx2_wide_table[ROWS_AT_ONCE] = {avx2_wide_1, avx2_wide_2, avx2_wide_3, avx2_wide_4};
#endif

static void run_tile_rows(const int4_args *a, int64_t tile, int64_t i0, int rows, float total[ROWS_AT_ONCE][TILE],
                          const void *cache) {
    (void)cache;
#ifdef AVX2_DOTS
    /* Not exact: x16, and from WIDE_MIN_ROWS rows the widened tile (cache). */
    if (a->x16 != NULL) {
        if (cache == NULL)
            avx2_rows_table[rows - 1](a, tile, i0, total);
        else
            avx2_wide_table[rows - 1](a, tile, i0, total, cache);
        return;
    }
#endif
    if (a->q8)
        q8_tile_rows(a, tile, i0, rows, total);
    else
        plain_tile_rows(a, tile, i0, rows, total);
}
#endif

/* Writes total's rows i0.. to out (only the real rows of the last, padded tile). */
static void store_tile(const int4_args *a, int64_t tile, int64_t i0, int rows, float total[ROWS_AT_ONCE][TILE]) {
    const int64_t n0 = tile * TILE, count = a->n_out - n0 < TILE ? a->n_out - n0 : TILE;
    for (int i = 0; i < rows; i++)
        for (int64_t r = 0; r < count; r++) {
            const int64_t at = (i0 + i) * a->out_stride + n0 + r;
            if (a->out_dtype == TUILI_F32)
                ((float *)a->out)[at] = total[i][r];
            else
                ((uint16_t *)a->out)[at] = f32_to_bf16(total[i][r]);
        }
}

/* The sum of v[0 .. n - 1], added one after another from 0: the order the sum of a group of x
 * keeps on every path (its float32 value enters the outputs). */
static inline float sum_in_order(const float *v, int64_t n) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) sum += v[j];
    return sum;
}

/* Where tuili_linear_int4 puts x's forms: float32, group sums and, for the integer dots, the
 * int8 parts and their scales and sums; on AVX2 also both parts as one int16 (x16). */
typedef struct {
    float *xf, *xsum, *sx;
    int32_t *xqsum;
    int8_t *xq, *xq_low;
    int16_t *x16;
} x_forms;

#ifdef VNNI
/* round_group's forms of a group for the VNNI products, sixteen values at a time: the same values
 * as its scalar loops (the largest |x| is exact in any order, the sum of x keeps its order, the
 * rounding is rintf's and lrintf's, round to nearest even), in ~1.5 us less per decode call at
 * K = 1024 (machine D: a 128 x 1024 int4 call at one thread 7.5 -> 5.7 us). */
static void round_group_vnni(const void *x, int x_dtype, int64_t group, int64_t at, const x_forms *f) {
    float *xg = f->xf + at * group;
    __m512 largest16 = _mm512_setzero_ps();
    for (int64_t j = 0; j < group; j += 16) {
        const __m512 v = x_dtype == TUILI_F32 ? _mm512_loadu_ps((const float *)x + at * group + j)
                                              : widen_bf16((const uint16_t *)x + at * group + j);
        _mm512_storeu_ps(xg + j, v);
        largest16 = _mm512_max_ps(_mm512_abs_ps(v), largest16); /* a NaN left out, as the scalar loop does */
    }
    f->xsum[at] = sum_in_order(xg, group);
    const float largest = _mm512_reduce_max_ps(largest16);
    const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    __m512i qsum = _mm512_setzero_si512();
    for (int64_t j = 0; j < group; j += 16) {
        const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(xg + j), inverse);
        const __m512 high = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i xq = _mm512_cvtps_epi32(high);
        const __m512i xq_low = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, high), _mm512_set1_ps((float)LOW_STEPS)));
        _mm_storeu_si128((__m128i *)(f->xq + at * group + j), _mm512_cvtepi32_epi8(xq));
        _mm_storeu_si128((__m128i *)(f->xq_low + at * group + j), _mm512_cvtepi32_epi8(xq_low));
        const __m512i both = _mm512_add_epi32(_mm512_mullo_epi32(xq, _mm512_set1_epi32(LOW_STEPS)), xq_low);
        qsum = _mm512_add_epi32(qsum, both);
        if (f->x16 != NULL) _mm256_storeu_si256((__m256i *)(f->x16 + at * group + j), _mm512_cvtepi32_epi16(both));
    }
    f->sx[at] = largest / (127.0f * LOW_STEPS);
    f->xqsum[at] = _mm512_reduce_add_epi32(qsum);
}
#endif

#ifdef AVX2_DOTS
/* round_group's forms of a group for the AVX2 dots, eight values at a time: the same values as
 * its scalar loops (the largest |x| is exact in any order and leaves NaN out as they do, the sum
 * of x keeps its order, the roundings are rintf's and lrintf's, to nearest even), and only the
 * forms the AVX2 dots read: x16, its group sums and scales (not the int8 parts). The scalar loops
 * had taken ~5% of a batch-16 decode step of the Q4_0 Qwen3-0.6B shape on a Zen 3 (machine C). */
static void round_group_avx2(const void *x, int x_dtype, int64_t group, int64_t at, const x_forms *f) {
    float *xg = f->xf + at * group;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 largest8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < group; j += 8) {
        const __m256 v =
            x_dtype == TUILI_F32
                ? _mm256_loadu_ps((const float *)x + at * group + j)
                : _mm256_castsi256_ps(_mm256_slli_epi32(
                      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + at * group + j))), 16));
        _mm256_storeu_ps(xg + j, v);
        largest8 = _mm256_max_ps(_mm256_and_ps(v, magnitude), largest8); /* a NaN lane keeps largest8's */
    }
    f->xsum[at] = sum_in_order(xg, group);
    float lanes[8], largest = 0.0f;
    _mm256_storeu_ps(lanes, largest8);
    for (int l = 0; l < 8; l++) largest = lanes[l] > largest ? lanes[l] : largest;
    const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    __m256i qsum = _mm256_setzero_si256();
    for (int64_t j = 0; j < group; j += 8) {
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(xg + j), inverse);
        const __m256 high = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i xq_low = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(scaled, high), _mm256_set1_ps((float)LOW_STEPS)));
        const __m256i both = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_cvtps_epi32(high), _mm256_set1_epi32(LOW_STEPS)), xq_low);
        qsum = _mm256_add_epi32(qsum, both);
        _mm_storeu_si128((__m128i *)(f->x16 + at * group + j),
                         _mm_packs_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1))); /* |.| <= 32385 */
    }
    f->sx[at] = largest / (127.0f * LOW_STEPS);
    const __m128i pairs = _mm_add_epi32(_mm256_castsi256_si128(qsum), _mm256_extracti128_si256(qsum, 1));
    const __m128i quads = _mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 0x4E));
    f->xqsum[at] = _mm_cvtsi128_si32(_mm_add_epi32(quads, _mm_shuffle_epi32(quads, 0xB1)));
}
#endif

/* Group `at` of x (row at / groups, group at % groups) into its forms. Groups are independent,
 * so the threads share them out before any tile is read. */
static void round_group(const void *x, int x_dtype, int64_t group, int64_t at, int exact, const x_forms *f) {
#ifdef VNNI
    if (!exact && group % 16 == 0) {
        round_group_vnni(x, x_dtype, group, at, f);
        return;
    }
#endif
#ifdef AVX2_DOTS
    if (!exact && f->x16 != NULL && group % 8 == 0) {
        round_group_avx2(x, x_dtype, group, at, f);
        return;
    }
#endif
    float *xg = f->xf + at * group;
    for (int64_t j = 0; j < group; j++)
        xg[j] = x_dtype == TUILI_F32 ? ((const float *)x)[at * group + j]
                                     : bf16_to_f32(((const uint16_t *)x)[at * group + j]);
    float sum = 0.0f, largest = 0.0f;
    for (int64_t j = 0; j < group; j++) {
        sum += xg[j];
        const float magnitude = fabsf(xg[j]);
        largest = magnitude > largest ? magnitude : largest; /* fmaxf, without its libm call (NaN left out as there) */
    }
    f->xsum[at] = sum;
#if defined(VNNI) || defined(AVX2_DOTS) /* x ~ sx * (LOW_STEPS xq + xq_low), where integer dots read it */
    if (exact) return;
    const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    int8_t *xq = f->xq + at * group, *xq_low = f->xq_low + at * group;
    int32_t qsum = 0;
    for (int64_t j = 0; j < group; j++) {
        const float scaled = xg[j] * inverse; /* in [-127, 127] */
        const float high = rintf(scaled);
        xq[j] = (int8_t)high;
        xq_low[j] = (int8_t)lrintf((scaled - high) * LOW_STEPS); /* |.| <= 127 */
        qsum += LOW_STEPS * xq[j] + xq_low[j];
    }
    f->sx[at] = largest / (127.0f * LOW_STEPS);
    f->xqsum[at] = qsum;
    if (f->x16 != NULL)
        for (int64_t j = 0; j < group; j++) f->x16[at * group + j] = (int16_t)(LOW_STEPS * xq[j] + xq_low[j]);
#endif
#if !defined(VNNI) && !defined(AVX2_DOTS)
    (void)exact;
    (void)largest;
#endif
}

/* x [M, K] (float32 or bfloat16, 1 <= M <= MAX_M), packed [tiles, K', 32], scale_zero
 * [K' / group, tiles * 64, 2] bfloat16, or where `pairs` is 0 the scales alone [K' / group,
 * tiles * 64] (the zeros 0; always so for copies 2, whose scales are [K / group, tiles * 64]),
 * out [M, n_out] with n_out <= tiles * 64, its rows out_stride >= n_out elements apart (a column
 * range of a wider output: the parts of a stacked linear, tuili/layers/quant/linear.py);
 * K' = copies * K and group divides K. The shapes are checked by the caller (tuili/kernels/cpu.py). */
int tuili_linear_int4(const void *x, int x_dtype, const void *packed, const void *scale_zero, void *out,
                      int out_dtype, int64_t m, int64_t k, int64_t copies, int64_t tiles, int64_t group,
                      int64_t n_out, int64_t out_stride, int exact, int pairs, int num_threads) {
    /* Int8GroupLinear (copies 2) runs the Q8_0 kernel over K with its halves side by side;
     * Int6GroupLinear (copies 3) its 6-bit codes, on VNNI CPUs only (Python checks first). */
#ifdef VNNI
    if (copies == 3 && exact) return TUILI_BAD_SHAPE;
#else
    if (copies == 3) return TUILI_BAD_SHAPE;
#endif
    const int64_t groups = k / group;
    /* x16: AVX2's integer dots at every row count; VNNI's wide path (int4 and Q8_0 prompts) */
#if defined(AVX2_DOTS)
    const int64_t x16_values = m * k;
#elif defined(VNNI)
    const int64_t x16_values = m >= CACHE_MIN_ROWS ? m * k : 0;
#else
    const int64_t x16_values = 0;
#endif
    float *xf = malloc((size_t)(m * k + 2 * m * groups) * sizeof(float) + (size_t)(m * groups) * sizeof(int32_t) +
                       (size_t)(2 * m * k) + (size_t)x16_values * sizeof(int16_t));
    if (xf == NULL) return TUILI_NO_MEMORY;
    float *xsum = xf + m * k, *sx = xsum + m * groups;
    int32_t *xqsum = (int32_t *)(sx + m * groups);
    int8_t *xq = (int8_t *)(xqsum + m * groups), *xq_low = xq + m * k;
    /* x's parts as one int16 (after xq_low: an even offset, as k is a multiple of 4) */
    int16_t *x16 = x16_values > 0 && !exact ? (int16_t *)(xq_low + m * k) : NULL;
#if defined(AVX2_DOTS)
    const int64_t cache_rows = WIDE_MIN_ROWS;
#elif defined(VNNI)
    const int64_t cache_rows = CACHE_MIN_ROWS;
#endif
#if defined(VNNI) || defined(AVX2_DOTS)
    const size_t cache_bytes = (size_t)k * TILE * 2; /* a tile widened to int16: 128 K bytes at K = 1024 */
#endif
    const x_forms forms = {xf, xsum, sx, xqsum, xq, xq_low, x16};
    const int4_args a = {xf, xsum, xq, xq_low, sx, xqsum, x16, packed, scale_zero, out, out_dtype, copies >= 2,
                         copies == 3, pairs != 0 && copies != 2, exact != 0, m, k, group, tiles * TILE, n_out, out_stride};
    if (num_threads < 1) num_threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* x's forms first, in one region with the tiles (a second fork costs a decode call more
         * than rounding its one row takes); the loop's barrier: all of x before any tile */
#pragma omp for schedule(static)
        for (int64_t at = 0; at < m * groups; at++) round_group(x, x_dtype, group, at, exact, &forms);
        void *cache = NULL;
#if defined(VNNI) || defined(AVX2_DOTS)
        /* Only calls of cache_rows rows or more widen a tile once: below, writing and rereading
         * the buffer costs more than unpacking per pair (VNNI: measured at 4 and 8 rows on Zen 5;
         * AVX2: WIDE_MIN_ROWS). */
        if (!exact && m >= cache_rows) {
            cache = aligned_alloc(64, cache_bytes);
            failed = cache == NULL;
        }
#endif
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (failed) continue;
#ifdef VNNI
            if (cache != NULL) widen_tile_vnni(&a, tile, cache);
#elif defined(AVX2_DOTS)
            if (cache != NULL) widen_tile_avx2(&a, tile, cache);
#endif
            for (int64_t i0 = 0; i0 < m; i0 += ROWS_AT_ONCE) {
                const int rows = m - i0 < ROWS_AT_ONCE ? (int)(m - i0) : ROWS_AT_ONCE;
                float total[ROWS_AT_ONCE][TILE] = {{0}};
                run_tile_rows(&a, tile, i0, rows, total, cache);
                store_tile(&a, tile, i0, rows, total);
            }
        }
        free(cache);
    }
    free(xf);
    return failed ? TUILI_NO_MEMORY : TUILI_OK;
}

/* Whether this build reads 6-bit codes (copies 3): the VNNI kernel's unpacking only. */
int tuili_linear_int6_available(void) {
#ifdef VNNI
    return 1;
#else
    return 0;
#endif
}
