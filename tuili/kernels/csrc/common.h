/* Shared by the tuili CPU kernels: element types, error codes, conversions to and from float32
 * (and, on AVX-512, the bf16 rounding of sixteen lanes), a vectorizable exp, and the multiply-add
 * used in inner loops.
 *
 * Plain C11 that GCC and Clang auto-vectorize at -O3; no torch headers. The library is compiled
 * with -ffp-contract=off, so `a * b + c` rounds twice exactly as PyTorch's separate multiply and
 * add do (the dequantizers rely on that to match torch bit for bit); loops that want a fused
 * multiply-add say so with MADD. */
#ifndef TUILI_KERNELS_COMMON_H
#define TUILI_KERNELS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Weight layouts shared with the Python side: tuili/kernels/layout.py, passed by build.py. */
#if !defined(TUILI_INT4_TILE_ROWS) || !defined(TUILI_AMX_TILE_ROWS) || !defined(TUILI_AMX_K_MULTIPLE)
#error "build with tuili/kernels/build.py, which defines the layout constants of tuili/kernels/layout.py"
#endif

/* Element types, numbered as tuili/kernels/cpu.py passes them. */
enum tuili_dtype { TUILI_F32 = 0, TUILI_BF16 = 1, TUILI_F8E4M3 = 2 };

/* Error codes returned by the kernels; cpu.py turns them into ValueErrors naming the argument.
 * The kernels check only what Python cannot check cheaply: the values inside index tensors. */
enum tuili_error {
    TUILI_OK = 0,
    TUILI_BAD_SEQ_ROWS = 1,   /* a sequence's query rows fall outside q */
    TUILI_BAD_SEQ_POS = 2,    /* a negative first row, row count or position */
    TUILI_TOO_FEW_BLOCKS = 3, /* the context needs more blocks than the table has columns */
    TUILI_BAD_BLOCK_ID = 4,   /* a block id outside [0, num_blocks) */
    TUILI_NO_MEMORY = 5,
    TUILI_NO_AMX = 6,    /* the CPU or the OS does not let this process use AMX tiles */
    TUILI_BAD_SHAPE = 7, /* a dimension the kernel cannot take (checked in Python first) */
    TUILI_BAD_SLOT = 8,  /* a KV cache slot outside [0, num_slots) */
    TUILI_BAD_PROGRAM = 9, /* a graph program that does not decode (graph.c) */
    TUILI_ABORTED = 10,    /* a shared-memory collective's group was aborted (shm_comm.c) */
};

/* Fused where the hardware fuses (one rounding, faster); elsewhere a plain multiply and add. */
#ifdef __FMA__
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

/* Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays a quiet NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (f != f) ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)rounded;
}

#ifdef __AVX__
#include <immintrin.h>

#ifdef __AVX2__
/* Eight bf16 values at p, exactly, as float32 lanes. */
static inline __m256 widen_bf16_8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* An 8 x 8 transpose: lane q of out[l] = first[q * stride + l], for eight rows of eight floats
 * `stride` floats apart (sums of eight outputs side by side, one per lane, so that their lanes
 * are added one vector at a time rather than one output at a time, each waiting on its adds). */
static inline void transpose8(const float *first, int64_t stride, __m256 out[8]) {
    __m256 row[8], pair[8], quad[8];
    for (int q = 0; q < 8; q++) row[q] = _mm256_loadu_ps(first + q * stride);
    for (int q = 0; q < 8; q += 2) {
        pair[q] = _mm256_unpacklo_ps(row[q], row[q + 1]);
        pair[q + 1] = _mm256_unpackhi_ps(row[q], row[q + 1]);
    }
    for (int q = 0; q < 8; q += 4) {
        quad[q] = _mm256_shuffle_ps(pair[q], pair[q + 2], 0x44);
        quad[q + 1] = _mm256_shuffle_ps(pair[q], pair[q + 2], 0xEE);
        quad[q + 2] = _mm256_shuffle_ps(pair[q + 1], pair[q + 3], 0x44);
        quad[q + 3] = _mm256_shuffle_ps(pair[q + 1], pair[q + 3], 0xEE);
    }
    /* quad[q] holds elements q (low half) and q + 4 (high half) of rows 0-3 | 4-7 */
    for (int q = 0; q < 4; q++) {
        out[q] = _mm256_permute2f128_ps(quad[q], quad[q + 4], 0x20);
        out[q + 4] = _mm256_permute2f128_ps(quad[q], quad[q + 4], 0x31);
    }
}
#endif

#ifdef __AVX512F__

/* Sixteen bf16 values at p, exactly, as float32 lanes. */
static inline __m512 widen_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* f32_to_bf16 on sixteen lanes: to nearest even, NaN kept quiet; the same bits. */
static inline __m256i narrow_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* float8 e4m3fn (bias 7, no infinities, S.1111.111 = NaN). Exponent and mantissa are placed
 * in float32's low exponent bits and the result is multiplied by 2^(127 - 7): this maps normal
 * codes exactly and, because float32 subnormals scale the same way, subnormal codes too. */
static inline float f8e4m3_to_f32(uint8_t x) {
    float magnitude = bits_to_f32((uint32_t)(x & 0x7Fu) << 20) * 0x1p120f;
    float value = (x & 0x80u) ? -magnitude : magnitude;
    return ((x & 0x7Fu) == 0x7Fu) ? NAN : value;
}

/* a . b over n floats as sixteen partial sums (independent lanes, which GCC vectorizes without
 * reassociating), then the tail, then the lanes, in that fixed order. */
static inline float dot_lanes16(const float *a, const float *b, int64_t n) {
    float lanes[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int l = 0; l < 16; l++) lanes[l] = MADD(a[d + l], b[d + l], lanes[l]);
    float total = 0.0f;
    for (; d < n; d++) total = MADD(a[d], b[d], total);
    for (int l = 0; l < 16; l++) total += lanes[l];
    return total;
}

/* exp(x) for x <= 0 to about 2 ulp (Cephes' expf polynomial), written so loops over it
 * vectorize: no floorf/fmaxf calls, which GCC vectorizes only with -ffast-math. Inputs below
 * -87 return ~0 (at most 2^-126), all softmax needs. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* n = round(x / ln 2): adding and subtracting 1.5 * 2^23 rounds to an integer. */
    float n = (x * 1.44269504088896341f + 0x1.8p23f) - 0x1.8p23f;
    float r = MADD(n, -0.693359375f, x); /* x - n ln 2, ln 2 in two parts for accuracy */
    r = MADD(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = MADD(p, r, 1.3981999507e-3f);
    p = MADD(p, r, 8.3334519073e-3f);
    p = MADD(p, r, 4.1665795894e-2f);
    p = MADD(p, r, 1.6666665459e-1f);
    p = MADD(p, r, 5.0000001201e-1f);
    p = MADD(p * r, r, r) + 1.0f;
    return p * bits_to_f32((uint32_t)((int32_t)n + 127) << 23);
}

#endif
