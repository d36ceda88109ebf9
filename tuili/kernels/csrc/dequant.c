/* Dequantizers for tuili/layers/quant.py's packed int4 layout: a range of tiles of 64 output
 * rows unpacked into W^T [K, 64 * count] (float32 or bfloat16), ready for an ordinary matmul.
 *
 * Layout (Int4Linear): packed [N / 64, K, 32] uint8, byte [t, k, j] holding row 64t + j's code
 * in its low nibble and row 64t + 32 + j's in its high nibble; scale_zero [K / group, N, 2]
 * (float32 or bfloat16), or where every zero is 0 (GGUF Q4_0) the scales alone [K / group, N].
 * Int4: w[n, k] = scale * (q - 8) + zero, computed as a float32 multiply then add (two roundings,
 * like torch), then rounded to the output type.
 * Int8GroupLinear stores a GGUF Q8_0 weight [N, K] as int4 codes [N, 2K]: h in rows 0..K-1 and
 * l in rows K..2K-1 with q = 16h + l - 128, and its scales s alone, [K / group, N] (float32 or
 * bfloat16): w[n, k] = s * q.
 *
 * Work is split by groups of K rows, so each thread writes whole output rows. */
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "common.h"
#include "kernels.h"

#define TILE TUILI_INT4_TILE_ROWS
#define HALF (TILE / 2)

/* One row k of a tile: the 64 values of W^T[k, tile columns], written to out as float32 or
 * bfloat16 (round to nearest even). Plain C first; AVX-512 versions below replace them. */
static inline void store_row(void *out, int out_dtype, const float *w) {
    if (out_dtype == TUILI_F32) {
        memcpy(out, w, TILE * sizeof(float));
    } else {
        uint16_t *o = out;
        for (int j = 0; j < TILE; j++) o[j] = f32_to_bf16(w[j]);
    }
}

static inline void int4_row_portable(void *out, int out_dtype, const uint8_t *codes, const float *scale,
                                     const float *zero) {
    float w[TILE];
    for (int j = 0; j < HALF; j++) {
        w[j] = scale[j] * (float)((codes[j] & 0x0F) - 8) + zero[j];
        w[HALF + j] = scale[HALF + j] * (float)((codes[j] >> 4) - 8) + zero[HALF + j];
    }
    store_row(out, out_dtype, w);
}

/* q = 16h + l - 128 from the nibbles of the h half (high) and the l half (low). */
static inline void int8_group_row_portable(void *out, int out_dtype, const uint8_t *high, const uint8_t *low,
                                           const float *scale) {
    float w[TILE];
    for (int j = 0; j < HALF; j++) {
        w[j] = scale[j] * (float)(((high[j] & 0x0F) << 4 | (low[j] & 0x0F)) - 128);
        w[HALF + j] = scale[HALF + j] * (float)(((high[j] & 0xF0) | (low[j] >> 4)) - 128);
    }
    store_row(out, out_dtype, w);
}

#ifdef __AVX512F__
/* Stores 32 floats (a: the first 16) as float32 or bfloat16. */
static inline void store32(void *out, int out_dtype, __m512 a, __m512 b) {
    if (out_dtype == TUILI_F32) {
        _mm512_storeu_ps(out, a);
        _mm512_storeu_ps((float *)out + 16, b);
        return;
    }
#ifdef __AVX512BF16__ /* one instruction, round to nearest even (float32 subnormals flush to 0) */
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(b, a));
#else
    const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    __m512i ua = _mm512_castps_si512(a), ub = _mm512_castps_si512(b);
    ua = _mm512_add_epi32(ua, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(ua, 16), one)));
    ub = _mm512_add_epi32(ub, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(ub, 16), one)));
    _mm256_storeu_si256(out, _mm512_cvtepi32_epi16(_mm512_srli_epi32(ua, 16)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(ub, 16)));
#endif
}

/* s * (q - 8) + z for 16 codes of one column range: a multiply, then an add (torch's roundings). */
static inline __m512 int4_values(__m512i codes, const float *scale, const float *zero) {
    __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(codes, _mm512_set1_epi32(8)));
    return _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(scale), q), _mm512_loadu_ps(zero));
}

static inline void int4_row(void *out, int out_dtype, const uint8_t *codes, const float *scale, const float *zero) {
    const size_t size = out_dtype == TUILI_F32 ? 4 : 2;
    const __m512i mask = _mm512_set1_epi32(0x0F);
    __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16)));
    store32(out, out_dtype, int4_values(_mm512_and_si512(first, mask), scale, zero),
            int4_values(_mm512_and_si512(second, mask), scale + 16, zero + 16));
    store32((char *)out + HALF * size, out_dtype, int4_values(_mm512_srli_epi32(first, 4), scale + 32, zero + 32),
            int4_values(_mm512_srli_epi32(second, 4), scale + 48, zero + 48));
}

/* s * (16h + l - 128) for 16 columns; shift 0 takes the low nibbles, 4 the high ones. */
static inline __m512 int8_group_values(__m512i high, __m512i low, int shift, const float *scale) {
    const __m512i mask = _mm512_set1_epi32(0x0F);
    __m512i h = _mm512_and_si512(_mm512_srli_epi32(high, shift), mask);
    __m512i l = _mm512_and_si512(_mm512_srli_epi32(low, shift), mask);
    __m512i q = _mm512_sub_epi32(_mm512_or_si512(_mm512_slli_epi32(h, 4), l), _mm512_set1_epi32(128));
    return _mm512_mul_ps(_mm512_loadu_ps(scale), _mm512_cvtepi32_ps(q));
}

static inline void int8_group_row(void *out, int out_dtype, const uint8_t *high, const uint8_t *low,
                                  const float *scale) {
    const size_t size = out_dtype == TUILI_F32 ? 4 : 2;
    __m512i h0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)high));
    __m512i h1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(high + 16)));
    __m512i l0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)low));
    __m512i l1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(low + 16)));
    store32(out, out_dtype, int8_group_values(h0, l0, 0, scale), int8_group_values(h1, l1, 0, scale + 16));
    store32((char *)out + HALF * size, out_dtype, int8_group_values(h0, l0, 4, scale + 32),
            int8_group_values(h1, l1, 4, scale + 48));
}
#else
#define int4_row int4_row_portable
#define int8_group_row int8_group_row_portable
#endif

/* The 64 values of one tile in one group as float32, each `stride` apart from `offset` on:
 * int4's (scale, zero) pairs (stride 2, one call each), Q8_0's scales (stride 1). */
static void load_tile_values(float *values, const void *stored, int dtype, int64_t offset, int stride) {
    for (int j = 0; j < TILE; j++)
        values[j] = dtype == TUILI_F32 ? ((const float *)stored)[offset + stride * j]
                                       : bf16_to_f32(((const uint16_t *)stored)[offset + stride * j]);
}

int tuili_dequant_int4(const uint8_t *packed, int64_t k, const void *scale_zero, int scale_dtype, int pairs, int64_t n,
                       int64_t group_size, int64_t first_tile, int64_t num_tiles, void *out, int out_dtype,
                       int num_threads) {
    const int64_t cols = num_tiles * TILE, groups = k / group_size;
    const size_t out_size = out_dtype == TUILI_F32 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t g = 0; g < groups; g++) {
        float scale[TILE], zero[TILE];
        for (int64_t t = 0; t < num_tiles; t++) {
            const int64_t tile = first_tile + t;
            if (pairs) {
                load_tile_values(scale, scale_zero, scale_dtype, (g * n + tile * TILE) * 2, 2);
                load_tile_values(zero, scale_zero, scale_dtype, (g * n + tile * TILE) * 2 + 1, 2);
            } else {
                load_tile_values(scale, scale_zero, scale_dtype, g * n + tile * TILE, 1);
                for (int j = 0; j < TILE; j++) zero[j] = 0.0f;
            }
            for (int64_t row = g * group_size; row < (g + 1) * group_size; row++) {
                int4_row((char *)out + (row * cols + t * TILE) * out_size, out_dtype, packed + (tile * k + row) * HALF,
                         scale, zero);
            }
        }
    }
    return TUILI_OK;
}

int tuili_dequant_int8_group(const uint8_t *packed, int64_t k, const void *scales, int scale_dtype, int64_t n,
                             int64_t group_size, int64_t first_tile, int64_t num_tiles, void *out, int out_dtype,
                             int num_threads) {
    const int64_t cols = num_tiles * TILE, groups = k / group_size;
    const size_t out_size = out_dtype == TUILI_F32 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(num_threads < 1 ? 1 : num_threads)
    for (int64_t g = 0; g < groups; g++) {
        float scale[TILE];
        for (int64_t t = 0; t < num_tiles; t++) {
            const int64_t tile = first_tile + t;
            load_tile_values(scale, scales, scale_dtype, g * n + tile * TILE, 1);
            for (int64_t row = g * group_size; row < (g + 1) * group_size; row++) {
                const uint8_t *high = packed + (tile * 2 * k + row) * HALF, *low = high + k * HALF;
                int8_group_row((char *)out + (row * cols + t * TILE) * out_size, out_dtype, high, low, scale);
            }
        }
    }
    return TUILI_OK;
}
