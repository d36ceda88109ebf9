/* Attention of a flat batch of query rows over a paged KV cache, read in place.
 *
 * Shapes (row-major): q and out [T, Hq, D], out contiguous, q's tokens q_stride elements apart
 * (a view into the fused qkv product; Hq * D when contiguous); k_cache and v_cache
 * [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]; seq_info [B, 3] holding, per
 * sequence, its first row in q, its number of query rows n, and the absolute position p0 of
 * its first query. Query i of a sequence (row first + i) is at position p0 + i and attends
 * causally to keys 0 .. p0 + i, the key at position p living in block
 * block_tables[b, p / block_size] at offset p % block_size. Hq is a multiple of Hkv: query head
 * hq reads KV head hq / (Hq / Hkv) (grouped-query attention, K/V never copied). With a float8
 * cache, stored values are multiplied by the per-KV-head k_scale / v_scale.
 *
 * Work is split into units of one sequence, some of its KV heads, some of its query rows (for
 * each of those heads; rows are query token x query head of the group, token-major) and a range
 * of keys. A decode's unit takes as many KV heads as fit in ROW_TILE rows (usually all), so it
 * reads whole cache rows [Hkv, D] front to back, a pattern the hardware prefetchers follow; a
 * prompt chunk's unit takes one KV head and a tile of ROW_TILE rows. A unit streams its keys
 * KEY_CHUNK at a time, converting them to float32 once for all its rows (bf16 queries over a
 * bf16 cache on AVX512-BF16: keys and values read in place, rows in groups of ROW_GROUP that share
 * each load), with an online softmax in float32. When units are too few to keep every thread busy
 * (decode at small batch), each one's keys are split among several units whose partial results
 * (max, sum, weighted values) are merged afterwards (flash-decoding).
 *
 * With split_keys > 0 the parts are instead fixed: keys [j * split_keys, (j + 1) * split_keys)
 * for every sequence, whatever the batch, the rows of the call or the thread count, merged in
 * order of j. A row's arithmetic then depends only on its query, its keys and its position:
 * a decode, a prompt chunk continuing at any position and a prompt computed from position 0
 * give the same bits for the same token (tuili's batch-invariant mode, docs/engine.md). A row
 * whose keys all lie in one part gets exactly what an unsplit unit writes: the merge of one
 * part multiplies by exp(0) = 1 and adds to 0, both exact. */
#include <omp.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "common.h"
#include "exp16.h"
#include "kernels.h"

#define KEY_CHUNK 16      /* keys converted and scored at a time */
#define ROW_TILE 32       /* query rows per unit, over all its KV heads */
#define MIN_SPLIT_KEYS 64 /* fewer keys per unit than this is not worth a merge */
#define UNITS_PER_THREAD 4
/* float32 keys and values (and bf16 ones on the portable chunk) are read in place when a head has
 * at most this many rows (decodes); more rows (prompt chunks) reuse each key often enough that a
 * compact float32 copy in L1 pays (docs/kernels.md, Measured crossovers). With bf16 scores (below)
 * a bf16 cache is read in place at every row count. */
#define IN_PLACE_MAX_ROWS 4
#define ROW_GROUP 4 /* rows of a head that share each key and value load (bf16 scores) */

typedef struct {
    const void *q;
    int q_dtype;
    int64_t q_stride; /* elements from one token's queries to the next's */
    int64_t num_heads, head_dim;
    const void *k_cache, *v_cache;
    int cache_dtype;
    int64_t block_size, num_kv_heads;
    const float *k_scale, *v_scale; /* NULL unless the cache is float8 */
    const void *tables;
    int tables_int64;
    int64_t max_blocks;
    const void *seq_info;
    int seq_info_int64;
    float scale;
    void *out;
} attn_args;

/* One unit of work. Its r-th row is row first_row + r % head_rows (of the n * per_kv rows of
 * each KV head) of KV head first_head + r / head_rows. Keys split among several units give
 * consecutive units, the first of which records how many. */
typedef struct {
    int64_t seq;
    int64_t first_head, heads;     /* KV heads */
    int64_t first_row, head_rows;  /* rows per KV head */
    int64_t key_begin, key_end;    /* key positions [begin, end) */
    int64_t partial;               /* offset in the partials buffer, or -1: write to out */
    int64_t splits;                /* for the first unit of a split: how many (else 0) */
} unit_t;

static inline int64_t load_index(const void *base, int is_int64, int64_t i) {
    return is_int64 ? ((const int64_t *)base)[i] : (int64_t)((const int32_t *)base)[i];
}

static inline void to_f32(float *dst, const void *src, int dtype, int64_t n) {
    if (dtype == TUILI_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == TUILI_BF16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const uint8_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = f8e4m3_to_f32(s[i]);
    }
}

static void from_f32(void *dst, const float *src, float factor, int dtype, int64_t n) {
    if (dtype == TUILI_F32) {
        float *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = src[i] * factor;
    } else {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i] * factor);
    }
}

static inline size_t element_size(int dtype) {
    return dtype == TUILI_F32 ? 4 : dtype == TUILI_BF16 ? 2 : 1;
}

/* The running state of a unit's query rows (online softmax). */
typedef struct {
    int64_t rows, head_dim;
    float *q;                /* [rows, D]: queries, already multiplied by the softmax scale */
    float *acc;              /* [rows, D]: sum of exp(score - m) * value */
    float m[ROW_TILE];       /* largest score so far (-inf before the first key) */
    float l[ROW_TILE];       /* sum of exp(score - m) */
    int64_t limit[ROW_TILE]; /* the last key position the row may see (causal) */
    const uint16_t *q_bf16[ROW_TILE]; /* the rows' bf16 queries as given, unscaled (bf16 scores) */
} rows_t;

static inline void scale_row(float *y, float a, int64_t n) {
    for (int64_t d = 0; d < n; d++) y[d] *= a;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t d = 0; d < n; d++) y[d] = MADD(a, x[d], y[d]);
}

/* Folds a new maximum into a row's state: what was summed so far is rescaled to it. */
static inline void raise_max(rows_t *st, int64_t r, float top) {
    if (top > st->m[r]) {
        float alpha = (st->m[r] == -INFINITY) ? 0.0f : exp_nonpositive(st->m[r] - top);
        scale_row(st->acc + r * st->head_dim, alpha, st->head_dim);
        st->l[r] *= alpha;
        st->m[r] = top;
    }
}

/* How many of the chunk's n keys (positions c ..) row r may see; 0 when all are in its future. */
static inline int64_t visible_keys(const rows_t *st, int64_t r, int64_t c, int64_t n) {
    const int64_t visible = st->limit[r] - c + 1;
    return visible < 0 ? 0 : visible < n ? visible : n;
}

#ifdef __AVX512F__
/* Fully unrolled before GCC's scalar replacement of aggregates, so that arrays of vectors
 * (dots[16], sum[blocks]) live in registers instead of being stored and reloaded every step. */
#define UNROLLED _Pragma("GCC unroll 16")

/* The first two levels of a transpose-and-add tree over 16 vectors: per 128-bit lane, the sums of
 * v[0 .. 3] in order
 * (each 128-bit lane of the result holds one partial sum of each of the four). */
static inline __attribute__((always_inline)) __m512 sum_lanes4(const __m512 v[4]) {
    /* per 128-bit lane: v[0] and v[1], v[2] and v[3] folded to 2 values each */
    const __m512d a = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1])));
    const __m512d b = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3])));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

/* Its last two: lane t the total of key t from sum_lanes4 of keys 4i .. 4i + 3 in quads[i]. */
static inline __attribute__((always_inline)) __m512 sum_quads(const __m512 quads[4]) {
    __m512 halves[2];
    for (int i = 0; i < 2; i++) /* 128-bit lanes (0+1), (2+3) of quads[2i] then of quads[2i+1] */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Row r's scores for a chunk (lanes >= keys ignored) folded into its online softmax: its running
 * maximum and sum, its accumulator rescaled to a new maximum, p[t] the weight of key t (0 from
 * `keys` on). */
static inline void softmax_chunk(rows_t *st, int64_t r, __m512 raw, int64_t keys, float p[16]) {
    const __mmask16 valid = (__mmask16)((1u << keys) - 1u);
    __m512 scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), raw);
    raise_max(st, r, _mm512_reduce_max_ps(scores));
    __m512 weights = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(st->m[r]))));
    st->l[r] += _mm512_reduce_add_ps(weights);
    _mm512_storeu_ps(p, weights);
}

/* acc[i][d ..] += sum over t < keys of p[i][t] * vrow[t][d ..] for R rows, float32 values,
 * `blocks` x 16 floats of each row at a time held in registers across the keys, each value
 * vector loaded once for all R rows: every element adds the products in the order of t. */
static inline __attribute__((always_inline)) void accumulate_f32(float *const *acc, const float (*p)[16],
                                                                 int64_t keys, const float *const *vrow,
                                                                 int64_t d, const int R, const int blocks) {
    __m512 sum[ROW_GROUP][4];
    UNROLLED for (int i = 0; i < R; i++)
        UNROLLED for (int b = 0; b < blocks; b++) sum[i][b] = _mm512_loadu_ps(acc[i] + d + 16 * b);
    for (int64_t t = 0; t < keys; t++) {
        __m512 value[4];
        UNROLLED for (int b = 0; b < blocks; b++) value[b] = _mm512_loadu_ps(vrow[t] + d + 16 * b);
        UNROLLED for (int i = 0; i < R; i++) {
            const __m512 weight = _mm512_set1_ps(p[i][t]);
            UNROLLED for (int b = 0; b < blocks; b++) sum[i][b] = _mm512_fmadd_ps(weight, value[b], sum[i][b]);
        }
    }
    UNROLLED for (int i = 0; i < R; i++)
        UNROLLED for (int b = 0; b < blocks; b++) _mm512_storeu_ps(acc[i] + d + 16 * b, sum[i][b]);
}

static inline __attribute__((always_inline)) void accumulate_rows_f32(float *const *acc, const float (*p)[16],
                                                                      int64_t keys, const float *const *vrow,
                                                                      int64_t D, const int R) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) accumulate_f32(acc, p, keys, vrow, d, R, 4);
    for (; d < D; d += 16) accumulate_f32(acc, p, keys, vrow, d, R, 1);
}

#ifdef __AVX512BF16__
#define HAVE_BF16_SCORES 1
/* acc[i][d] += sum over t < keys of p[i][t] * vrow[t][d] for R rows at once, the bf16 values read
 * in place: a 32-bit lane of a value row holds its elements 2j and 2j + 1, the even one the lane
 * shifted left by 16 and the odd one the lane with its low half cleared (exact widenings, one
 * operation per 16 values, where widening in order took two and a copy to memory). Each 32
 * floats of an accumulator are taken apart into their even and odd elements for the chunk and
 * put back after it. Every element adds p[t] * v[t][d] in the order of t with one rounding, as
 * accumulate_f32 does: the same bits. */
static inline __attribute__((always_inline)) void accumulate_pairs(float *const *acc, const float (*p)[16],
                                                                   int64_t keys, const uint16_t *const *vrow,
                                                                   int64_t D, const int R) {
    const __m512i even_index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd_index = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i low_index = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i high_index = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t d = 0; d < D; d += 32) {
        __m512 even[ROW_GROUP], odd[ROW_GROUP];
        UNROLLED for (int i = 0; i < R; i++) {
            const __m512 low = _mm512_loadu_ps(acc[i] + d), high = _mm512_loadu_ps(acc[i] + d + 16);
            even[i] = _mm512_permutex2var_ps(low, even_index, high);
            odd[i] = _mm512_permutex2var_ps(low, odd_index, high);
        }
        for (int64_t t = 0; t < keys; t++) {
            const __m512i pairs = _mm512_loadu_si512(vrow[t] + d);
            const __m512 v_even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            const __m512 v_odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
            UNROLLED for (int i = 0; i < R; i++) {
                const __m512 weight = _mm512_set1_ps(p[i][t]);
                even[i] = _mm512_fmadd_ps(weight, v_even, even[i]);
                odd[i] = _mm512_fmadd_ps(weight, v_odd, odd[i]);
            }
        }
        UNROLLED for (int i = 0; i < R; i++) {
            _mm512_storeu_ps(acc[i] + d, _mm512_permutex2var_ps(even[i], low_index, odd[i]));
            _mm512_storeu_ps(acc[i] + d + 16, _mm512_permutex2var_ps(even[i], high_index, odd[i]));
        }
    }
}

#endif

/* Rows rows[0 .. R - 1]'s scaled scores against a chunk's 16 keys, into scores[i]: lane l of
 * dots[i][t] sums the products of row i's query and key t over d = l, l + 16, .. (bf16: over the
 * pairs 2l, 2l + 1, 2l + 32, ..), and a transpose-and-add tree reduces each key's 16 lanes.
 * R = 3 or 4 rows go together: each key vector is loaded once for all of them, and 12 or 16
 * chains of products run side by side (4 keys of each row); R = 1 runs the 16 keys of one row.
 * Keys go G at a time through the tree's first two levels (sum_lanes4 of keys 4j .. 4j + 3), the
 * last two (sum_quads) after all 16: the same operations on the same values whatever R, so the
 * same bits. One row's 16 keys at a time had left the products' latency showing and reloaded
 * every key for every row: a 512-token prompt's attention 1.4x slower on Zen 4 (bf16), 1.2x on
 * machine A over a float32 cache (docs/kernels.md). krow[t] for t >= n point at zeros.
 * - bf16 (bf16 queries over a bf16 cache, AVX512-BF16; D % 32 == 0): VDPBF16PS takes 32 query and
 *   key values straight from q and the cache (exact products, summed in pairs in float32), and
 *   the sum is scaled afterwards, so the keys are never converted.
 * - float32 (queries already scaled, float32 keys; D % 16 == 0): FMAs. */
static inline __attribute__((always_inline)) void group_scores(const rows_t *st, float scale, const int *rows,
                                                              const void *const *krow, __m512 *scores,
                                                              const int R, const int bf16) {
    const int64_t D = st->head_dim;
    const int G = R == 1 ? 16 : 4;
    __m512 quads[ROW_GROUP][4];
    for (int g = 0; g < 16; g += G) {
        __m512 dots[ROW_GROUP][16];
        UNROLLED for (int i = 0; i < R; i++)
            UNROLLED for (int t = 0; t < G; t++) dots[i][t] = _mm512_setzero_ps();
#ifdef HAVE_BF16_SCORES
        if (bf16) {
            const uint16_t *const *key16 = (const uint16_t *const *)krow;
            for (int64_t d = 0; d < D; d += 32) {
                UNROLLED for (int i = 0; i < R; i++) {
                    const __m512bh qd = (__m512bh)_mm512_loadu_si512(st->q_bf16[rows[i]] + d);
                    UNROLLED for (int t = 0; t < G; t++)
                        dots[i][t] = _mm512_dpbf16_ps(dots[i][t], qd, (__m512bh)_mm512_loadu_si512(key16[g + t] + d));
                }
            }
        } else
#endif
        {
            const float *const *key32 = (const float *const *)krow;
            for (int64_t d = 0; d < D; d += 16) {
                __m512 key[16];
                UNROLLED for (int t = 0; t < G; t++) key[t] = _mm512_loadu_ps(key32[g + t] + d);
                UNROLLED for (int i = 0; i < R; i++) {
                    const __m512 qd = _mm512_loadu_ps(st->q + rows[i] * D + d);
                    UNROLLED for (int t = 0; t < G; t++) dots[i][t] = _mm512_fmadd_ps(qd, key[t], dots[i][t]);
                }
            }
        }
        UNROLLED for (int i = 0; i < R; i++)
            UNROLLED for (int j = 0; j < G / 4; j++) quads[i][g / 4 + j] = sum_lanes4(dots[i] + 4 * j);
    }
    UNROLLED for (int i = 0; i < R; i++)
        scores[i] = bf16 ? _mm512_mul_ps(sum_quads(quads[i]), _mm512_set1_ps(scale)) : sum_quads(quads[i]);
}

/* R rows' values into their accumulators: accumulate_pairs from the bf16 cache in place, else
 * accumulate_rows_f32 over float32 values. */
static inline __attribute__((always_inline)) void group_values(float *const *acc, const float (*p)[16], int64_t keys,
                                                              const void *const *vrow, int64_t D, const int R,
                                                              const int bf16) {
#ifdef HAVE_BF16_SCORES
    if (bf16) {
        accumulate_pairs(acc, p, keys, (const uint16_t *const *)vrow, D, R);
        return;
    }
#else
    (void)bf16;
#endif
    accumulate_rows_f32(acc, p, keys, (const float *const *)vrow, D, R);
}

/* Rows [first, end) of one KV head (R <= ROW_GROUP of them) against a chunk of n <= 16 keys
 * (positions c ..): every row's scores and softmax first, then the values for all rows that see
 * the same keys at once, each key and value vector loaded once for all of them. bf16: bf16
 * queries over a bf16 cache read in place; else float32 queries (scaled) and keys. krow[t],
 * vrow[t] for t >= n point at zeros. */
static inline __attribute__((always_inline)) void attend_group(rows_t *st, float scale, int64_t first, int64_t end,
                                                              int64_t c, int64_t n, const void *const *krow,
                                                              const void *const *vrow, const int bf16) {
    float p[ROW_GROUP][16], *acc[ROW_GROUP];
    int64_t keys[ROW_GROUP];
    int rows = 0, same = 1, index[ROW_GROUP];
    for (int64_t r = first; r < end; r++) {
        keys[rows] = visible_keys(st, r, c, n);
        if (keys[rows] == 0) continue;
        index[rows] = (int)r;
        acc[rows] = st->acc + r * st->head_dim;
        same &= keys[rows] == keys[0];
        rows++;
    }
    __m512 scores[ROW_GROUP];
    switch (rows) {
    case 1: group_scores(st, scale, index, krow, scores, 1, bf16); break;
    case 2: /* a decode's two query heads: a row at a time, 16 chains each (2-6% faster than 8 x 2) */
        group_scores(st, scale, index, krow, scores, 1, bf16);
        group_scores(st, scale, index + 1, krow, scores + 1, 1, bf16);
        break;
    case 3: group_scores(st, scale, index, krow, scores, 3, bf16); break;
    case 4: group_scores(st, scale, index, krow, scores, 4, bf16); break;
    default: break;
    }
    for (int i = 0; i < rows; i++) softmax_chunk(st, index[i], scores[i], keys[i], p[i]);
    if (!same) { /* rows on the diagonal of a prompt end at different keys: one at a time */
        for (int i = 0; i < rows; i++) group_values(acc + i, p + i, keys[i], vrow, st->head_dim, 1, bf16);
        return;
    }
    switch (rows) {
    case 1: group_values(acc, p, keys[0], vrow, st->head_dim, 1, bf16); break;
    case 2: group_values(acc, p, keys[0], vrow, st->head_dim, 2, bf16); break;
    case 3: group_values(acc, p, keys[0], vrow, st->head_dim, 3, bf16); break;
    case 4: group_values(acc, p, keys[0], vrow, st->head_dim, 4, bf16); break;
    default: break;
    }
}

/* Rows [first, end) of one KV head against a chunk, ROW_GROUP rows at a time (attend_group): a
 * decode's rows of the head (its query heads, up to four) in one group, a prompt chunk's 32 in
 * eight. Needs D % 16 == 0 (D % 32 == 0 for bf16). */
static void attend_chunk_avx512(rows_t *st, int64_t first, int64_t end, int64_t c, int64_t n,
                                const float *const *krow, const float *const *vrow) {
    for (int64_t r = first; r < end; r += ROW_GROUP)
        attend_group(st, 1.0f, r, end - r < ROW_GROUP ? end : r + ROW_GROUP, c, n, (const void *const *)krow,
                     (const void *const *)vrow, 0);
}

#ifdef HAVE_BF16_SCORES
static void attend_chunk_bf16(rows_t *st, float scale, int64_t first, int64_t end, int64_t c, int64_t n,
                              const uint16_t *const *krow, const uint16_t *const *vrow) {
    for (int64_t r = first; r < end; r += ROW_GROUP)
        attend_group(st, scale, r, end - r < ROW_GROUP ? end : r + ROW_GROUP, c, n, (const void *const *)krow,
                     (const void *const *)vrow, 1);
}
#endif
#endif

/* The plain C chunk (any head size) in dot_lanes16's and axpy's orders, element for element,
 * arranged for registers: scores SCORE_ROWS rows by SCORE_KEYS keys at a time, a sum's 16 lanes
 * as two passes of 8 (one AVX2 register each: 12 accumulators, a query and 4 key vectors per
 * step, 7 loads per 12 multiply-adds where one dot product at a time loads 2 per 1), and the
 * values PV_BLOCK floats of a row's accumulator at a time, held in registers across the keys
 * (axpy loads and stores the accumulator once per key). */
#define SCORE_ROWS 3
#define SCORE_KEYS 4
#define PV_BLOCK 64 /* eight AVX2 registers: two FMA ports of 4-cycle latency */

/* Element d of a cache row as float32: a float32 row, or (bf16) a bfloat16 one read in place
 * (the conversion is exact, so either gives the same sums). */
static inline __attribute__((always_inline)) float cache_value(const void *row, int64_t d, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

/* Lanes half .. half + 7 of dot_lanes16 for I rows of q (row stride D) by SCORE_KEYS keys, into
 * lanes[i][t0 + t]. */
static inline __attribute__((always_inline)) void score_half(const float *restrict q, int64_t D, int64_t whole,
                                                             const void *const *restrict k, int I, int half,
                                                             float lanes[SCORE_ROWS][KEY_CHUNK][16], int t0,
                                                             const int bf16) {
#if defined(__AVX2__) && defined(__FMA__)
    /* The same multiply-adds as intrinsics, each query vector loaded once per step: GCC's own
     * vectorization folded it into all SCORE_KEYS multiply-adds, 12 loads a step at two rows
     * (four keys and eight query loads) where 6 serve. */
    __m256 part[SCORE_ROWS][SCORE_KEYS];
    for (int i = 0; i < I; i++)
        for (int t = 0; t < SCORE_KEYS; t++) part[i][t] = _mm256_setzero_ps();
    for (int64_t d = half; d < whole; d += 16) {
        __m256 qv[SCORE_ROWS];
        for (int i = 0; i < I; i++) {
            qv[i] = _mm256_loadu_ps(q + i * D + d);
            __asm__("" : "+x"(qv[i]));
        }
        for (int t = 0; t < SCORE_KEYS; t++) {
            __m256 kv = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                   _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)k[t] + d))), 16))
                             : _mm256_loadu_ps((const float *)k[t] + d);
            __asm__("" : "+x"(kv));
            for (int i = 0; i < I; i++) part[i][t] = _mm256_fmadd_ps(qv[i], kv, part[i][t]);
        }
    }
    for (int i = 0; i < I; i++)
        for (int t = 0; t < SCORE_KEYS; t++) _mm256_storeu_ps(lanes[i][t0 + t] + half, part[i][t]);
#else
    float part[SCORE_ROWS][SCORE_KEYS][8] = {{{0}}};
    for (int64_t d = half; d < whole; d += 16)
        _Pragma("GCC unroll 3") for (int i = 0; i < I; i++)
            _Pragma("GCC unroll 4") for (int t = 0; t < SCORE_KEYS; t++)
                for (int l = 0; l < 8; l++)
                    part[i][t][l] = MADD(q[i * D + d + l], cache_value(k[t], d + l, bf16), part[i][t][l]);
    for (int i = 0; i < I; i++)
        for (int t = 0; t < SCORE_KEYS; t++)
            for (int l = 0; l < 8; l++) lanes[i][t0 + t][half + l] = part[i][t][l];
#endif
}

/* dot_lanes16(q row i, k[t], D) for I <= SCORE_ROWS rows and SCORE_KEYS keys, in two parts: its
 * 16 lanes into lanes[i][t0 + t], its tail (the d past D's whole steps, summed from 0) into
 * scores[i * KEY_CHUNK + t0 + t]; add_lanes finishes it. */
static inline __attribute__((always_inline)) void score_tile(const float *q, int64_t D, const void *const *k,
                                                             int I, float lanes[SCORE_ROWS][KEY_CHUNK][16],
                                                             int t0, float *scores, const int bf16) {
    const int64_t whole = D - D % 16;
    score_half(q, D, whole, k, I, 0, lanes, t0, bf16);
    score_half(q, D, whole, k, I, 8, lanes, t0, bf16);
    for (int i = 0; i < I; i++)
        for (int t = 0; t < SCORE_KEYS; t++) {
            float total = 0.0f;
            for (int64_t d = whole; d < D; d++) total = MADD(q[i * D + d], cache_value(k[t], d, bf16), total);
            scores[i * KEY_CHUNK + t0 + t] = total;
        }
}

/* scores[t] += lanes[t][0] + lanes[t][1] + .. + lanes[t][15], added in that order (dot_lanes16's),
 * for the KEY_CHUNK keys of one row of q. With AVX, eight keys side by side after a transpose:
 * one key at a time, each waits on its 16 adds (a fifth of a prompt's attention on a Zen 3). */
static inline void add_lanes(const float lanes[KEY_CHUNK][16], float *scores) {
    int t = 0;
#ifdef __AVX__
    for (; t + 8 <= KEY_CHUNK; t += 8) {
        __m256 low[8], high[8], total = _mm256_loadu_ps(scores + t);
        transpose8(lanes[t], 16, low); /* low[l]: lane l of keys t .. t + 7 */
        transpose8(lanes[t] + 8, 16, high);
        for (int l = 0; l < 8; l++) total = _mm256_add_ps(total, low[l]);
        for (int l = 0; l < 8; l++) total = _mm256_add_ps(total, high[l]);
        _mm256_storeu_ps(scores + t, total);
    }
#endif
    for (; t < KEY_CHUNK; t++)
        for (int l = 0; l < 16; l++) scores[t] += lanes[t][l];
}

/* acc[0 .. PV_BLOCK) += sum over t < keys of p[t] * vrow[t][d ..], the block held in registers.
 * A bfloat16 row is read as 32-bit pairs of values: the even element is the pair shifted left by
 * 16, the odd one the pair with its low half cleared, so the block is held as its even and its
 * odd elements (one shift and one AND per 16 values, where widening in order took two
 * lane-crossing VPMOVZXWD and two shifts, and bound the loop on Zen 3's two shuffle pipes).
 * Each element still adds the same products in the same order: the same bits. */
static inline __attribute__((always_inline)) void accumulate_block(float *restrict acc, const float *restrict p,
                                                                   const void *const *restrict vrow,
                                                                   int64_t keys, int64_t d, const int bf16) {
#if defined(__AVX2__) && defined(__FMA__)
    if (bf16) { /* as below, each 32-bit pair loaded once for its shift and its AND */
        __m256 even[PV_BLOCK / 16], odd[PV_BLOCK / 16];
        for (int v = 0; v < PV_BLOCK / 16; v++) {
            const __m256 a = _mm256_loadu_ps(acc + 16 * v), b = _mm256_loadu_ps(acc + 16 * v + 8);
            /* a, b: elements 16v .. 16v + 15 in order; even[v] and odd[v] their even and odd ones */
            const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
            even[v] = _mm256_shuffle_ps(lo, hi, 0x88);
            odd[v] = _mm256_shuffle_ps(lo, hi, 0xDD);
        }
        for (int64_t t = 0; t < keys; t++) {
            const __m256 weight = _mm256_set1_ps(p[t]);
            const uint16_t *row = (const uint16_t *)vrow[t] + d;
            for (int v = 0; v < PV_BLOCK / 16; v++) {
                __m256i pairs = _mm256_loadu_si256((const __m256i *)(row + 16 * v));
                __asm__("" : "+x"(pairs));
                even[v] = _mm256_fmadd_ps(weight, _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)), even[v]);
                odd[v] = _mm256_fmadd_ps(weight, _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u))),
                                         odd[v]);
            }
        }
        for (int v = 0; v < PV_BLOCK / 16; v++) {
            const __m256 lo = _mm256_unpacklo_ps(even[v], odd[v]), hi = _mm256_unpackhi_ps(even[v], odd[v]);
            _mm256_storeu_ps(acc + 16 * v, _mm256_permute2f128_ps(lo, hi, 0x20));
            _mm256_storeu_ps(acc + 16 * v + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
        return;
    }
#endif
    if (bf16) {
        float even[PV_BLOCK / 2], odd[PV_BLOCK / 2];
        for (int l = 0; l < PV_BLOCK / 2; l++) {
            even[l] = acc[2 * l];
            odd[l] = acc[2 * l + 1];
        }
        for (int64_t t = 0; t < keys; t++) {
            const float weight = p[t];
            const uint16_t *row = (const uint16_t *)vrow[t] + d;
            for (int l = 0; l < PV_BLOCK / 2; l++) {
                uint32_t pair;
                memcpy(&pair, row + 2 * l, sizeof pair);
                even[l] = MADD(weight, bits_to_f32(pair << 16), even[l]);
                odd[l] = MADD(weight, bits_to_f32(pair & 0xFFFF0000u), odd[l]);
            }
        }
        for (int l = 0; l < PV_BLOCK / 2; l++) {
            acc[2 * l] = even[l];
            acc[2 * l + 1] = odd[l];
        }
        return;
    }
    float sum[PV_BLOCK];
    for (int l = 0; l < PV_BLOCK; l++) sum[l] = acc[l];
    for (int64_t t = 0; t < keys; t++) {
        const float weight = p[t];
        const float *v = (const float *)vrow[t] + d;
        for (int l = 0; l < PV_BLOCK; l++) sum[l] = MADD(weight, v[l], sum[l]);
    }
    for (int l = 0; l < PV_BLOCK; l++) acc[l] = sum[l];
}

/* Without unroll-and-jam: GCC 12 at -O3 jams two keys of accumulate_block into one scalar loop
 * over a block kept in memory (seen in the assembly), four times slower than the vector loop.
 * krow, vrow: float32 rows, or (bf16) the bfloat16 cache rows read in place. */
static inline __attribute__((always_inline)) void portable_chunk(rows_t *st, int64_t first, int64_t end, int64_t c,
                                                                 int64_t n, const void *const *krow,
                                                                 const void *const *vrow, const int bf16) {
    const int64_t D = st->head_dim;
    float scores[SCORE_ROWS * KEY_CHUNK], lanes[SCORE_ROWS][KEY_CHUNK][16];
    for (int64_t r0 = first; r0 < end; r0 += SCORE_ROWS) {
        const int I = end - r0 < SCORE_ROWS ? (int)(end - r0) : SCORE_ROWS;
        for (int t0 = 0; t0 < KEY_CHUNK; t0 += SCORE_KEYS) { /* every key: rows past n score zeros */
            if (I == SCORE_ROWS)
                score_tile(st->q + r0 * D, D, krow + t0, SCORE_ROWS, lanes, t0, scores, bf16);
            else if (I == 2)
                score_tile(st->q + r0 * D, D, krow + t0, 2, lanes, t0, scores, bf16);
            else
                score_tile(st->q + r0 * D, D, krow + t0, 1, lanes, t0, scores, bf16);
        }
        for (int i = 0; i < I; i++) add_lanes((const float(*)[16])lanes[i], scores + i * KEY_CHUNK);
        for (int i = 0; i < I; i++) {
            const int64_t r = r0 + i, keys = visible_keys(st, r, c, n);
            if (keys == 0) continue;
            float *s = scores + i * KEY_CHUNK, top = -INFINITY;
            for (int64_t t = 0; t < keys; t++) top = s[t] > top ? s[t] : top;
            raise_max(st, r, top);
            for (int64_t t = 0; t < keys; t++) s[t] = exp_nonpositive(s[t] - st->m[r]);
            for (int64_t t = 0; t < keys; t++) st->l[r] += s[t];
            float *acc = st->acc + r * D;
            int64_t d = 0;
            for (; d + PV_BLOCK <= D; d += PV_BLOCK) accumulate_block(acc + d, s, vrow, keys, d, bf16);
            for (int64_t t = 0; t < keys; t++)
                for (int64_t e = d; e < D; e++) acc[e] = MADD(s[t], cache_value(vrow[t], e, bf16), acc[e]);
        }
    }
}

__attribute__((optimize("no-loop-unroll-and-jam"))) static void attend_chunk_portable(
    rows_t *st, int64_t first, int64_t end, int64_t c, int64_t n, const float *const *krow, const float *const *vrow) {
    portable_chunk(st, first, end, c, n, (const void *const *)krow, (const void *const *)vrow, 0);
}

/* The same for a bfloat16 cache read in place (decodes: few rows per head, so a float32 copy of
 * each key and value, written and read back once or twice, cost more than widening in registers). */
__attribute__((optimize("no-loop-unroll-and-jam"))) static void attend_chunk_portable_bf16(
    rows_t *st, int64_t first, int64_t end, int64_t c, int64_t n, const uint16_t *const *krow,
    const uint16_t *const *vrow) {
    portable_chunk(st, first, end, c, n, (const void *const *)krow, (const void *const *)vrow, 1);
}

static inline void attend_chunk(rows_t *st, int64_t first, int64_t end, int64_t c, int64_t n,
                                const float *const *krow, const float *const *vrow) {
#ifdef __AVX512F__
    if (st->head_dim % 16 == 0) {
        attend_chunk_avx512(st, first, end, c, n, krow, vrow);
        return;
    }
#endif
    attend_chunk_portable(st, first, end, c, n, krow, vrow);
}

/* Byte offsets in the cache of positions c .. c + n - 1 of sequence seq, KV head h: one
 * division per chunk, then a walk along the block table. */
static void chunk_offsets(const attn_args *a, int64_t seq, int64_t h, int64_t c, int64_t n, int64_t *offsets) {
    const int64_t row_bytes = a->head_dim * (int64_t)element_size(a->cache_dtype);
    int64_t entry = seq * a->max_blocks + c / a->block_size, within = c % a->block_size;
    int64_t block = load_index(a->tables, a->tables_int64, entry);
    for (int64_t t = 0; t < n; t++, within++) {
        if (within == a->block_size) {
            block = load_index(a->tables, a->tables_int64, ++entry);
            within = 0;
        }
        offsets[t] = ((block * a->block_size + within) * a->num_kv_heads + h) * row_bytes;
    }
}

/* Floats of scratch memory one thread needs: queries, accumulators, one head's converted keys
 * and values, a row of zeros. */
static inline size_t scratch_floats(int64_t head_dim) {
    return (size_t)(2 * ROW_TILE + 2 * KEY_CHUNK + 1) * (size_t)head_dim;
}

/* Where the unit's r-th row lives in q and out (token * Hq + query head); *query receives the
 * row's query index within its sequence. */
static inline int64_t unit_row(const attn_args *a, const unit_t *u, int64_t r, int64_t first_token, int64_t *query) {
    const int64_t per_kv = a->num_heads / a->num_kv_heads;
    const int64_t row = u->first_row + r % u->head_rows, kv_head = u->first_head + r / u->head_rows;
    *query = row / per_kv;
    return (first_token + *query) * a->num_heads + kv_head * per_kv + row % per_kv;
}

/* Where a row of out (token * Hq + query head) has its query in q. */
static inline const char *query_row(const attn_args *a, int64_t out_row) {
    const int64_t token = out_row / a->num_heads, head = out_row % a->num_heads;
    return (const char *)a->q + (token * a->q_stride + head * a->head_dim) * (int64_t)element_size(a->q_dtype);
}

/* Asks for n cache rows of row_bytes each, at base + offsets[t], into L2. */
static inline void prefetch_rows(const char *base, const int64_t *offsets, int64_t n, size_t row_bytes) {
    for (int64_t t = 0; t < n; t++)
        for (size_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(base + offsets[t] + line, 0, 2);
}

/* Runs one unit. Writes the normalized rows to out, or (split keys) max, sum and unnormalized
 * values per row to partials + u->partial. */
static void attend_unit(const attn_args *a, const unit_t *u, float *scratch, float *partials) {
    const int64_t D = a->head_dim, head_rows = u->head_rows;
    rows_t st = {.rows = u->heads * head_rows, .head_dim = D, .q = scratch, .acc = scratch + ROW_TILE * D};
    float *kbuf = st.acc + ROW_TILE * D, *vbuf = kbuf + KEY_CHUNK * D, *zeros = vbuf + KEY_CHUNK * D;
    const float *krow[KEY_CHUNK], *vrow[KEY_CHUNK];
    const uint16_t *krow_bf16[KEY_CHUNK], *vrow_bf16[KEY_CHUNK];
    int64_t out_row[ROW_TILE], offsets[KEY_CHUNK];
#ifdef HAVE_BF16_SCORES
    const int bf16_scores = a->cache_dtype == TUILI_BF16 && a->q_dtype == TUILI_BF16 && D % 32 == 0;
#else
    const int bf16_scores = 0;
#endif
#ifdef __AVX512F__
    const int portable = D % 16 != 0; /* attend_chunk's choice */
#else
    const int portable = 1;
#endif
    /* decodes on the portable chunk read a bf16 cache in place */
    const int bf16_in_place = portable && !bf16_scores && a->cache_dtype == TUILI_BF16 && head_rows <= IN_PLACE_MAX_ROWS;
    const int64_t first_token = load_index(a->seq_info, a->seq_info_int64, 3 * u->seq);
    const int64_t first_pos = load_index(a->seq_info, a->seq_info_int64, 3 * u->seq + 2);
    const size_t q_size = element_size(a->q_dtype), row_bytes = (size_t)D * element_size(a->cache_dtype);
    const char *k_cache = a->k_cache, *v_cache = a->v_cache;

    for (int64_t r = 0; r < st.rows; r++) {
        int64_t query;
        out_row[r] = unit_row(a, u, r, first_token, &query);
        if (bf16_scores) { /* scored straight from q, scaled afterwards */
            st.q_bf16[r] = (const uint16_t *)query_row(a, out_row[r]);
        } else {
            to_f32(st.q + r * D, query_row(a, out_row[r]), a->q_dtype, D);
            scale_row(st.q + r * D, a->scale * (a->k_scale ? a->k_scale[u->first_head + r / head_rows] : 1.0f), D);
        }
        st.limit[r] = first_pos + query;
        st.m[r] = -INFINITY;
        st.l[r] = 0.0f;
        memset(st.acc + r * D, 0, (size_t)D * sizeof(float));
    }
    memset(zeros, 0, (size_t)D * sizeof(float));

    int64_t next_offsets[KEY_CHUNK], next_n = 0;
    if (u->key_begin < u->key_end) {
        next_n = (u->key_end - u->key_begin < KEY_CHUNK) ? u->key_end - u->key_begin : KEY_CHUNK;
        chunk_offsets(a, u->seq, u->first_head, u->key_begin, next_n, next_offsets);
    }
    for (int64_t c = u->key_begin; c < u->key_end; c += KEY_CHUNK) {
        const int64_t n = next_n;
        memcpy(offsets, next_offsets, sizeof offsets);
        /* The next chunk's cache rows are asked for while this one is computed, one head's
         * share per head below: its blocks lie anywhere in the pool, and the hardware
         * prefetchers stop at every 4 KiB page, so alone they find each block late. Into L2:
         * faster than into L1 on Zen 4 (docs/kernels.md, Measured crossovers). The keys before
         * this chunk's head is computed, the values after it (they are read after the next
         * chunk's scores): two bursts of half the lines each, 5-12% faster decodes from memory
         * on Zen 4 than all of them at once. */
        next_n = (u->key_end - c - KEY_CHUNK < KEY_CHUNK) ? u->key_end - c - KEY_CHUNK : KEY_CHUNK;
        if (next_n > 0) chunk_offsets(a, u->seq, u->first_head, c + KEY_CHUNK, next_n, next_offsets);
        /* Head by head: a chunk of one head's keys and values (float32, in L1) serves its rows.
         * With all heads in the unit, every byte of the chunk's cache rows is read within a short
         * time, so the hardware prefetchers follow. Rows past n read as zeros with weight 0. */
        for (int64_t h = 0; h < u->heads; h++) {
            prefetch_rows(k_cache + h * row_bytes, next_offsets, next_n, row_bytes);
            for (int64_t t = 0; t < KEY_CHUNK; t++) {
                const char *k = k_cache + offsets[t] + h * row_bytes, *v = v_cache + offsets[t] + h * row_bytes;
                if (t >= n) {
                    krow[t] = vrow[t] = zeros;
                    krow_bf16[t] = vrow_bf16[t] = (const uint16_t *)zeros; /* zero bytes: bf16 zeros too */
                } else if (bf16_in_place || bf16_scores) {
                    krow_bf16[t] = (const uint16_t *)k;
                    vrow_bf16[t] = (const uint16_t *)v;
                } else if (a->cache_dtype == TUILI_F32 && head_rows <= IN_PLACE_MAX_ROWS) { /* read in place */
                    krow[t] = (const float *)k;
                    vrow[t] = (const float *)v;
                } else {
                    to_f32(kbuf + t * D, k, a->cache_dtype, D);
                    to_f32(vbuf + t * D, v, a->cache_dtype, D);
                    krow[t] = kbuf + t * D;
                    vrow[t] = vbuf + t * D;
                }
            }
#ifdef HAVE_BF16_SCORES
            if (bf16_scores) {
                attend_chunk_bf16(&st, a->scale, h * head_rows, (h + 1) * head_rows, c, n, krow_bf16, vrow_bf16);
            } else
#endif
            if (bf16_in_place)
                attend_chunk_portable_bf16(&st, h * head_rows, (h + 1) * head_rows, c, n, krow_bf16, vrow_bf16);
            else
                attend_chunk(&st, h * head_rows, (h + 1) * head_rows, c, n, krow, vrow);
            prefetch_rows(v_cache + h * row_bytes, next_offsets, next_n, row_bytes);
        }
    }

    for (int64_t r = 0; r < st.rows; r++) {
        if (u->partial < 0) {
            float v_factor = a->v_scale ? a->v_scale[u->first_head + r / head_rows] : 1.0f;
            from_f32((char *)a->out + out_row[r] * D * q_size, st.acc + r * D, v_factor / st.l[r], a->q_dtype, D);
        } else {
            float *p = partials + u->partial + r * (D + 2);
            p[0] = st.m[r];
            p[1] = st.l[r];
            memcpy(p + 2, st.acc + r * D, (size_t)D * sizeof(float));
        }
    }
}

/* Merges the `first->splits` partial results of one unit's rows into out. */
static void merge_splits(const attn_args *a, const unit_t *first, const float *partials, float *row_buf) {
    const int64_t D = a->head_dim, rows = first->heads * first->head_rows, stride = rows * (D + 2);
    const int64_t first_token = load_index(a->seq_info, a->seq_info_int64, 3 * first->seq);
    const float *base = partials + first->partial;
    for (int64_t r = 0; r < rows; r++) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < first->splits; j++) top = fmaxf(top, base[j * stride + r * (D + 2)]);
        memset(row_buf, 0, (size_t)D * sizeof(float));
        for (int64_t j = 0; j < first->splits; j++) {
            const float *p = base + j * stride + r * (D + 2);
            if (p[0] == -INFINITY) continue; /* this part held only future keys for the row */
            float w = exp_nonpositive(p[0] - top);
            total = MADD(p[1], w, total);
            axpy(row_buf, w, p + 2, D);
        }
        int64_t query, out_row = unit_row(a, first, r, first_token, &query);
        float v_factor = a->v_scale ? a->v_scale[first->first_head + r / first->head_rows] : 1.0f;
        char *dst = (char *)a->out + out_row * D * element_size(a->q_dtype);
        from_f32(dst, row_buf, v_factor / total, a->q_dtype, D);
    }
}

/* Checks the index tensors' values; on error fills error[1..2] (sequence, offending value). */
static int check_indices(const attn_args *a, int64_t num_tokens, int64_t num_blocks, int64_t num_seqs, int64_t *error) {
    for (int64_t b = 0; b < num_seqs; b++) {
        int64_t first = load_index(a->seq_info, a->seq_info_int64, 3 * b);
        int64_t rows = load_index(a->seq_info, a->seq_info_int64, 3 * b + 1);
        int64_t pos = load_index(a->seq_info, a->seq_info_int64, 3 * b + 2);
        error[1] = b;
        if (rows < 0 || pos < 0 || first < 0) {
            error[2] = rows < 0 ? rows : pos < 0 ? pos : first;
            return TUILI_BAD_SEQ_POS;
        }
        if (rows == 0) continue;
        if (first + rows > num_tokens) {
            error[2] = first + rows;
            return TUILI_BAD_SEQ_ROWS;
        }
        int64_t blocks = (pos + rows + a->block_size - 1) / a->block_size;
        if (blocks > a->max_blocks) {
            error[2] = blocks;
            return TUILI_TOO_FEW_BLOCKS;
        }
        for (int64_t j = 0; j < blocks; j++) {
            int64_t id = load_index(a->tables, a->tables_int64, b * a->max_blocks + j);
            if (id < 0 || id >= num_blocks) {
                error[2] = id;
                return TUILI_BAD_BLOCK_ID;
            }
        }
    }
    return TUILI_OK;
}

/* Lays out the units (and, when units != NULL, fills them). Returns the number of units;
 * *partial_floats receives the size of the partials buffer. Keys are split in up to
 * max_splits parts of at least MIN_SPLIT_KEYS keys, or, when fixed_part > 0 (a multiple of
 * KEY_CHUNK), in parts of fixed_part keys at fixed positions. A unit takes at most max_heads KV
 * heads. */
static int64_t plan_units(const attn_args *a, int64_t num_seqs, int64_t max_splits, int64_t fixed_part,
                          int64_t max_heads, unit_t *units, int64_t *partial_floats) {
    const int64_t per_kv = a->num_heads / a->num_kv_heads, D = a->head_dim;
    int64_t count = 0, floats = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t n = load_index(a->seq_info, a->seq_info_int64, 3 * b + 1);
        const int64_t pos = load_index(a->seq_info, a->seq_info_int64, 3 * b + 2);
        const int64_t head_rows = n * per_kv;
        if (head_rows == 0) continue;
        /* Few rows per head (decodes): several heads per unit. Many (prompt chunks): row tiles. */
        int64_t heads = head_rows <= ROW_TILE ? (ROW_TILE / head_rows < a->num_kv_heads ? ROW_TILE / head_rows
                                                                                          : a->num_kv_heads)
                                              : 1;
        heads = heads < max_heads ? heads : max_heads;
        const int64_t tile = head_rows <= ROW_TILE ? head_rows : ROW_TILE;
        for (int64_t h = 0; h < a->num_kv_heads; h += heads) {
            const int64_t unit_heads = a->num_kv_heads - h < heads ? a->num_kv_heads - h : heads;
            for (int64_t row = 0; row < head_rows; row += tile) {
                const int64_t rows = head_rows - row < tile ? head_rows - row : tile;
                const int64_t keys = pos + (row + rows - 1) / per_kv + 1; /* up to the tile's last query */
                int64_t splits = keys / MIN_SPLIT_KEYS;
                splits = splits < 1 ? 1 : splits > max_splits ? max_splits : splits;
                /* Parts are whole key chunks; rounding up may leave fewer parts than asked. */
                const int64_t part = fixed_part > 0 ? fixed_part
                                                    : ((keys + splits - 1) / splits + KEY_CHUNK - 1) / KEY_CHUNK * KEY_CHUNK;
                splits = (keys + part - 1) / part;
                for (int64_t j = 0; j < splits; j++, count++) {
                    if (!units) continue;
                    units[count] = (unit_t){
                        .seq = b,
                        .first_head = h,
                        .heads = unit_heads,
                        .first_row = row,
                        .head_rows = rows,
                        .key_begin = j * part,
                        .key_end = (j + 1) * part < keys ? (j + 1) * part : keys,
                        .partial = splits > 1 ? floats + j * unit_heads * rows * (D + 2) : -1,
                        .splits = j == 0 && splits > 1 ? splits : 0,
                    };
                }
                if (splits > 1) floats += splits * unit_heads * rows * (D + 2);
            }
        }
    }
    *partial_floats = floats;
    return count;
}

int tuili_paged_attention(const void *q, int q_dtype, int64_t q_stride, int64_t num_tokens, int64_t num_heads,
                          int64_t head_dim,
                          const void *k_cache, const void *v_cache, int cache_dtype, int64_t num_blocks,
                          int64_t block_size, int64_t num_kv_heads, const float *k_scale, const float *v_scale,
                          const void *block_tables, int tables_int64, int64_t num_seqs, int64_t max_blocks,
                          const void *seq_info, int seq_info_int64, float scale, void *out, int64_t split_keys,
                          int num_threads, int64_t *error) {
    const attn_args a = {
        .q = q, .q_dtype = q_dtype, .q_stride = q_stride, .num_heads = num_heads, .head_dim = head_dim,
        .k_cache = k_cache, .v_cache = v_cache, .cache_dtype = cache_dtype,
        .block_size = block_size, .num_kv_heads = num_kv_heads, .k_scale = k_scale, .v_scale = v_scale,
        .tables = block_tables, .tables_int64 = tables_int64, .max_blocks = max_blocks,
        .seq_info = seq_info, .seq_info_int64 = seq_info_int64, .scale = scale, .out = out,
    };
    int status = check_indices(&a, num_tokens, num_blocks, num_seqs, error);
    if (status != TUILI_OK) return (int)(error[0] = status);
    if (num_threads < 1) num_threads = 1;

    /* Split keys only as far as needed to give every thread several units, or at the fixed
     * positions asked for (rounded up to whole key chunks). Still too few units (a short decode
     * with fixed parts: one unit below 256 keys, which one thread ran while the others waited),
     * fewer KV heads per unit: a row's arithmetic does not depend on the heads beside it. */
    int64_t partial_floats;
    const int64_t fixed_part = split_keys > 0 ? (split_keys + KEY_CHUNK - 1) / KEY_CHUNK * KEY_CHUNK : 0;
    const int64_t whole = plan_units(&a, num_seqs, 1, 0, num_kv_heads, NULL, &partial_floats);
    const int64_t wanted = num_threads > 1 ? (int64_t)UNITS_PER_THREAD * num_threads : 1;
    const int64_t max_splits = whole > 0 && whole < wanted ? (wanted + whole - 1) / whole : 1;
    int64_t max_heads = num_kv_heads;
    int64_t count = plan_units(&a, num_seqs, max_splits, fixed_part, max_heads, NULL, &partial_floats);
    while (count > 0 && count < wanted && max_heads > 1) {
        max_heads = (max_heads + 1) / 2;
        count = plan_units(&a, num_seqs, max_splits, fixed_part, max_heads, NULL, &partial_floats);
    }
    unit_t *units = malloc((size_t)(count > 0 ? count : 1) * sizeof(unit_t));
    float *partials = malloc((size_t)(partial_floats > 0 ? partial_floats : 1) * sizeof(float));
    if (!units || !partials) {
        free(units);
        free(partials);
        return (int)(error[0] = TUILI_NO_MEMORY);
    }
    plan_units(&a, num_seqs, max_splits, fixed_part, max_heads, units, &partial_floats);

    int failed = 0;
    const size_t scratch_bytes = (scratch_floats(head_dim) * sizeof(float) + 63) / 64 * 64;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = aligned_alloc(64, scratch_bytes);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++)
            if (scratch) attend_unit(&a, &units[i], scratch, partials);
        /* The loop's implicit barrier: every part is written before any merge reads it. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++)
            if (scratch && units[i].splits > 0) merge_splits(&a, &units[i], partials, scratch);
        free(scratch);
    }
    free(units);
    free(partials);
    return (int)(error[0] = failed ? TUILI_NO_MEMORY : TUILI_OK);
}
