/* Causal attention of one prompt over itself in bfloat16 on Intel AMX tiles: a prefill's
 * attention, flash-attention style (scores never leave a block of 32 queries x 256 keys).
 *
 * Shapes (row-major, bfloat16): q [T, Hq, D] with its tokens q_stride elements apart, k and v
 * [T, Hkv, D] with theirs kv_stride apart (views into the fused qkv product), out [T, Hq, D]
 * contiguous. D a multiple of 32, at most MAX_HEAD_DIM; Hq a multiple of Hkv, query head h
 * reading KV head h / (Hq / Hkv). Query t attends to keys 0 .. t.
 *
 * Numerics: scores Q K^T as float32 sums of bf16 products (TDPBF16PS), times `scale` (> 0), an
 * online softmax in float32 (exp16), the probabilities rounded to bf16 for the product with V
 * (as PyTorch's CPU flash attention rounds them), the output accumulated in float32 and rounded
 * once.
 *
 * Work: K and V are first repacked per KV head into AMX B tiles (K^T and V in the "VNNI"
 * layout: 16 rows of 16 columns x 2 consecutive k), keys padded with zeros to a multiple of
 * BLOCK. A unit is one query head and BLOCK queries, dynamically scheduled: a head's units one
 * after the other (its keys and values stay in cache), the last blocks, with the most keys,
 * first. A unit keeps its queries as two A tiles per 32 dims and walks its keys SUPER at a
 * time: the 2 x 2 score tiles of each block of BLOCK keys, then each row's softmax over them
 * (rescaling the row's float32 output only when its reference max moves, see absorb_row), then
 * P V with each pair of output tiles loaded once, accumulated over the SUPER keys and stored.
 * Speed against SDPA: docs/kernels.md, Measured crossovers.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "amx.h"
#include "common.h"
#include "exp16.h"
#include "kernels.h"

#define MAX_HEAD_DIM 256

#ifdef HAVE_AMX
#define BLOCK 32 /* queries per unit and keys per block: two tiles each way */
#define SUPER 256           /* keys scored before the softmax and the product with V run over them */
/* Row strides of the scratch (elements), a cache line past a power of two: tiles load and store
 * 16 rows at a time, which at a power-of-two stride would share a few L1 sets and evict each
 * other. */
#define S_STRIDE (SUPER + 16)
#define P_STRIDE (SUPER + 32)
#define QO_PAD 32
#define RESCALE_MARGIN 8.0f /* see absorb_row */

typedef struct {
    _Alignas(64) uint16_t q[BLOCK * (MAX_HEAD_DIM + QO_PAD)]; /* the unit's queries, rows D + QO_PAD apart */
    _Alignas(64) float s[BLOCK * S_STRIDE];                   /* a superblock's scores */
    _Alignas(64) uint16_t p[BLOCK * P_STRIDE];                /* its probabilities, A tiles of 16 rows */
    _Alignas(64) float o[BLOCK * (MAX_HEAD_DIM + QO_PAD)];    /* sum of p * v per row */
    _Alignas(64) float l[BLOCK * TILE];            /* sum of exp per row, in 16 lanes */
    float m[BLOCK];                                /* reference max per row */
} unit_scratch;

/* Sixteen floats rounded to bf16, to nearest even as f32_to_bf16 (common.h) rounds finite values,
 * in plain AVX-512 (a build may leave out AVX512-BF16's conversion instruction). */
static inline __m256i to_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16));
}

/* K tile (16 keys from key tile kt, dims 32j .. 32j + 31) of KV head h: B[pair][key][2]. */
static inline const uint16_t *k_tile(const uint16_t *kp, int64_t h, int64_t key_tiles, int64_t kt, int64_t j,
                                     int64_t d_steps) {
    return kp + ((h * key_tiles + kt) * d_steps + j) * (TILE * TILE_K);
}

/* V tile (keys of block kb, dims 16dt .. 16dt + 15) of KV head h: B[key pair][dim][2]. */
static inline const uint16_t *v_tile(const uint16_t *vp, int64_t h, int64_t blocks, int64_t kb, int64_t dt,
                                     int64_t d_tiles) {
    return vp + ((h * blocks + kb) * d_tiles + dt) * (TILE * TILE_K);
}

static void pack_kv(const uint16_t *k, const uint16_t *v, int64_t kv_stride, int64_t tokens, int64_t kv_heads,
                    int64_t D, int64_t blocks, uint16_t *kp, uint16_t *vp) {
    const int64_t key_tiles = 2 * blocks, d_steps = D / TILE_K, d_tiles = D / TILE;
#pragma omp for collapse(2) schedule(static)
    for (int64_t h = 0; h < kv_heads; h++) {
        for (int64_t kb = 0; kb < blocks; kb++) {
            for (int64_t half = 0; half < 2; half++) {
                const int64_t kt = 2 * kb + half;
                for (int64_t j = 0; j < d_steps; j++) {
                    uint32_t *dst = (uint32_t *)k_tile(kp, h, key_tiles, kt, j, d_steps);
                    for (int64_t n = 0; n < TILE; n++) {
                        const int64_t key = kt * TILE + n;
                        const uint32_t *src = (const uint32_t *)(k + key * kv_stride + h * D + j * TILE_K);
                        for (int64_t pair = 0; pair < TILE; pair++) dst[pair * TILE + n] = key < tokens ? src[pair] : 0;
                    }
                }
            }
            for (int64_t dt = 0; dt < d_tiles; dt++) {
                uint16_t *dst = (uint16_t *)v_tile(vp, h, blocks, kb, dt, d_tiles);
                for (int64_t pair = 0; pair < TILE; pair++) {
                    for (int64_t e = 0; e < 2; e++) {
                        const int64_t key = kb * BLOCK + 2 * pair + e;
                        const uint16_t *src = v + key * kv_stride + h * D + dt * TILE;
                        for (int64_t n = 0; n < TILE; n++) dst[(pair * TILE + n) * 2 + e] = key < tokens ? src[n] : 0;
                    }
                }
            }
        }
    }
}

/* Scores of the unit's queries against key block kb into columns 32c .. 32c + 31 of u->s
 * (2 x 2 tiles over D). */
static void block_scores(unit_scratch *u, const uint16_t *kp, int64_t kv_head, int64_t key_tiles, int64_t kb,
                         int64_t c, int64_t D) {
    const int64_t d_steps = D / TILE_K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < d_steps; j++) {
        _tile_loadd(4, u->q + j * TILE_K, (D + QO_PAD) * 2);
        _tile_loadd(5, u->q + TILE * (D + QO_PAD) + j * TILE_K, (D + QO_PAD) * 2);
        _tile_loadd(6, k_tile(kp, kv_head, key_tiles, 2 * kb, j, d_steps), 64);
        _tile_loadd(7, k_tile(kp, kv_head, key_tiles, 2 * kb + 1, j, d_steps), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float *s = u->s + c * BLOCK;
    _tile_stored(0, s, S_STRIDE * 4);
    _tile_stored(1, s + TILE, S_STRIDE * 4);
    _tile_stored(2, s + TILE * S_STRIDE, S_STRIDE * 4);
    _tile_stored(3, s + TILE * S_STRIDE + TILE, S_STRIDE * 4);
}

/* Row r's scores over the superblock's first `visible` keys (of `width`) into its running
 * softmax: probabilities to u->p as bf16 (zero past `visible`), their sum to the row's lanes of
 * u->l. The row's reference max moves only when a score exceeds it by more than RESCALE_MARGIN
 * (then the sum and output so far are rescaled): probabilities up to e^RESCALE_MARGIN are exact
 * enough in float32 and bf16 alike, and the output divides by the sum taken against the same
 * reference, so the result is the softmax's while most rows skip the rescaling. */
static void absorb_row(unit_scratch *u, int64_t r, int64_t visible, int64_t width, float scale, int64_t D) {
    const float *s = u->s + r * S_STRIDE;
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c + TILE <= visible; c += TILE) top16 = _mm512_max_ps(top16, _mm512_load_ps(s + c));
    const __mmask16 tail = (__mmask16)((1u << (visible - c)) - 1);
    if (tail) top16 = _mm512_mask_max_ps(top16, tail, top16, _mm512_load_ps(s + c));
    /* the scale is positive: the largest scaled score is the largest score, scaled */
    const float top = scale * _mm512_reduce_max_ps(top16);
    __m512 l = _mm512_load_ps(u->l + r * TILE);
    if (top > u->m[r] + RESCALE_MARGIN) {
        const float alpha = u->m[r] == -INFINITY ? 0.0f : expf(u->m[r] - top);
        const __m512 a = _mm512_set1_ps(alpha);
        l = _mm512_mul_ps(l, a);
        float *o = u->o + r * (D + QO_PAD);
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(o + d, _mm512_mul_ps(_mm512_load_ps(o + d), a));
        u->m[r] = top;
    }
    const __m512 m = _mm512_set1_ps(u->m[r]), sc = _mm512_set1_ps(scale);
    uint16_t *p = u->p + r * P_STRIDE;
    for (c = 0; c < width; c += TILE) {
        const __mmask16 keep = visible - c >= TILE ? 0xFFFF : visible <= c ? 0 : (__mmask16)((1u << (visible - c)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_fmsub_ps(_mm512_load_ps(s + c), sc, m)));
        l = _mm512_add_ps(l, e);
        _mm256_store_si256((__m256i *)(p + c), to_bf16(e)); /* the row of an A tile */
    }
    _mm512_store_ps(u->l + r * TILE, l);
}

/* u->o += P V over the superblock's `count` key blocks from first_kb: each pair of output tiles
 * loaded once, accumulated over every block, stored back. */
static void superblock_values(unit_scratch *u, const uint16_t *vp, int64_t kv_head, int64_t blocks,
                              int64_t first_kb, int64_t count, int64_t D) {
    const int64_t d_tiles = D / TILE;
    for (int64_t dt = 0; dt < d_tiles; dt += 2) {
        const int64_t o_stride = (D + QO_PAD) * 4;
        float *top = u->o + dt * TILE, *bottom = u->o + TILE * (D + QO_PAD) + dt * TILE;
        _tile_loadd(0, top, o_stride);
        _tile_loadd(1, top + TILE, o_stride);
        _tile_loadd(2, bottom, o_stride);
        _tile_loadd(3, bottom + TILE, o_stride);
        for (int64_t c = 0; c < count; c++) {
            _tile_loadd(4, u->p + c * BLOCK, P_STRIDE * 2);
            _tile_loadd(5, u->p + TILE * P_STRIDE + c * BLOCK, P_STRIDE * 2);
            _tile_loadd(6, v_tile(vp, kv_head, blocks, first_kb + c, dt, d_tiles), 64);
            _tile_loadd(7, v_tile(vp, kv_head, blocks, first_kb + c, dt + 1, d_tiles), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, top, o_stride);
        _tile_stored(1, top + TILE, o_stride);
        _tile_stored(2, bottom, o_stride);
        _tile_stored(3, bottom + TILE, o_stride);
    }
}

static void attend_unit(unit_scratch *u, const uint16_t *q, int64_t q_stride, const uint16_t *kp,
                        const uint16_t *vp, int64_t tokens, int64_t heads, int64_t per_kv, int64_t D, int64_t blocks,
                        int64_t h, int64_t qb, float scale, uint16_t *out) {
    const int64_t rows = tokens - qb * BLOCK < BLOCK ? tokens - qb * BLOCK : BLOCK, kv_head = h / per_kv;
    for (int64_t r = 0; r < BLOCK; r++) {
        if (r < rows)
            memcpy(u->q + r * (D + QO_PAD), q + (qb * BLOCK + r) * q_stride + h * D, (size_t)D * 2);
        else
            memset(u->q + r * (D + QO_PAD), 0, (size_t)D * 2);
        u->m[r] = -INFINITY;
    }
    memset(u->l, 0, sizeof u->l);
    memset(u->o, 0, sizeof(float) * BLOCK * (size_t)(D + QO_PAD));
    /* key blocks 0 .. qb (the diagonal one last), SUPER / BLOCK at a time */
    for (int64_t first = 0; first <= qb; first += SUPER / BLOCK) {
        const int64_t count = qb + 1 - first < SUPER / BLOCK ? qb + 1 - first : SUPER / BLOCK;
        for (int64_t c = 0; c < count; c++) block_scores(u, kp, kv_head, 2 * blocks, first + c, c, D);
        for (int64_t r = 0; r < BLOCK; r++) {
            /* keys of the superblock that query r (at qb * BLOCK + r) sees; none for the padding
             * rows past the prompt */
            const int64_t visible = r >= rows ? 0 : (qb - first) * BLOCK + r + 1 < count * BLOCK
                                                        ? (qb - first) * BLOCK + r + 1
                                                        : count * BLOCK;
            if (visible)
                absorb_row(u, r, visible, count * BLOCK, scale, D);
            else
                memset(u->p + r * P_STRIDE, 0, (size_t)count * BLOCK * 2);
        }
        superblock_values(u, vp, kv_head, blocks, first, count, D);
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(u->l + r * TILE)));
        uint16_t *dst = out + ((qb * BLOCK + r) * heads + h) * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                to_bf16(_mm512_mul_ps(_mm512_load_ps(u->o + r * (D + QO_PAD) + d), inv)));
    }
}

int tuili_prompt_attention(const void *q_, const void *k_, const void *v_, int64_t q_stride, int64_t kv_stride,
                           int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, void *out,
                           int num_threads) {
    const uint16_t *q = q_, *k = k_, *v = v_;
    if (tuili_amx_init() != 0) return TUILI_NO_AMX;
    if (head_dim % TILE_K || head_dim > MAX_HEAD_DIM || kv_heads < 1 || heads % kv_heads) return TUILI_BAD_SHAPE;
    if (tokens == 0) return TUILI_OK;
    const int64_t blocks = (tokens + BLOCK - 1) / BLOCK, per_kv = heads / kv_heads;
    const size_t packed = (size_t)(kv_heads * blocks * BLOCK * head_dim);
    uint16_t *kp = aligned_alloc(64, packed * 2), *vp = aligned_alloc(64, packed * 2);
    if (num_threads < 1) num_threads = 1;
    unit_scratch *scratch = aligned_alloc(64, sizeof(unit_scratch) * (size_t)num_threads);
    if (kp == NULL || vp == NULL || scratch == NULL) {
        free(kp), free(vp), free(scratch);
        return TUILI_NO_MEMORY;
    }
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
        pack_kv(k, v, kv_stride, tokens, kv_heads, head_dim, blocks, kp, vp); /* ends with a barrier */
        unit_scratch *u = scratch + omp_get_thread_num();
#pragma omp for schedule(dynamic)
        /* a head's blocks one after the other, its keys and values staying in cache; within a
         * head the last blocks, with the most keys, first */
        for (int64_t i = 0; i < heads * blocks; i++)
            attend_unit(u, q, q_stride, kp, vp, tokens, heads, per_kv, head_dim, blocks, i / blocks,
                        blocks - 1 - i % blocks, scale, out);
        _tile_release();
    }
    free(kp), free(vp), free(scratch);
    return TUILI_OK;
}

#else

int tuili_prompt_attention(const void *q, const void *k, const void *v, int64_t q_stride, int64_t kv_stride,
                           int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, void *out,
                           int num_threads) {
    (void)q, (void)k, (void)v, (void)q_stride, (void)kv_stride, (void)tokens, (void)heads, (void)kv_heads;
    (void)head_dim, (void)scale, (void)out, (void)num_threads;
    return TUILI_NO_AMX;
}

#endif
