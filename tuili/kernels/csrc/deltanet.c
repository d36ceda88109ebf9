/* Gated DeltaNet, token by token: each sequence's new tokens through the causal conv, the gated
 * delta rule and the gated RMSNorm, in one call per layer and step (what tuili/layers/deltanet.py
 * does in ~40 torch ops per decode row, or with the chunked rule's matmuls per prompt chunk).
 *
 * For each item (a decode row, or a prompt chunk: consecutive tokens of one sequence, its state in
 * one slot), each of its tokens in order and each value head h of Hv (key head h / (Hv / Hk)):
 *
 *   conv:   c = round(silu(sum_j window[j] * w[j])) per conv channel, window = the slot's last K-1
 *           inputs then this one (float32 sum in order j = 0 .. K-1); the slot keeps the last K-1
 *   q, k:   float32, L2-normalised (x * 1/sqrt(sum x^2 + 1e-6)), q scaled by Dk^-0.5
 *   gates:  beta = round(sigmoid(b)); g = -exp(A_log) * softplus(a + dt_bias); decay = exp(g)
 *   rule:   S = decay * S; delta = (v - S^T k) * beta; S = S + k delta^T; o = round(S^T q)
 *           on the slot's float32 state S [Dk, Dv], updated in place
 *   norm:   y = round(round(w * round(o * r)) * silu(z)), r = 1/sqrt(mean(o^2) + eps)
 *
 * where round is to the working dtype (nothing for float32), as the torch code rounds. Each
 * (item, head) is computed alone, token after token in one fixed order, whatever the batch: a
 * token's bits depend only on its sequence's tokens up to it — not on the batch, the thread count,
 * or where the prompt was split into chunks (a chunk of n tokens is exactly n decode steps), so a
 * prompt computed in one chunk, in pieces, after a prefix-cache hit or as decode steps after a
 * preemption gives the same state and outputs (a chunk runs the rule by blocks of the state's
 * columns across its tokens, each element's operations unchanged: rule_columns). The
 * batch-invariant mode runs prompts this way on CPUs (docs/engine.md); the chunked rule's matmuls
 * round differently at every split.
 *
 * A chunk can also hand out its state after given numbers of tokens (cuts: prefix-cache
 * checkpoints inside it), copied to other rows of the state tensors. Inputs may be views with a
 * row stride (the fused projections' outputs); the state and weights are contiguous. Items,
 * slots and cuts are checked first: a bad one writes nothing. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "exp16.h"
#include "kernels.h"

#define MAX_HEAD_DIM 1024 /* the heads' sizes the kernel takes; Python checks it */
#define L2NORM_EPS 1e-6f

static inline float load(const void *p, int dtype, int64_t i) {
    return dtype == TUILI_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int dtype, int64_t i, float v) {
    if (dtype == TUILI_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline float round_to(float v, int dtype) { return dtype == TUILI_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* torch's softplus (beta 1, threshold 20): x above the threshold is returned as is. */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Each of `rows` rows of n floats, x[t * n ..], *= scale / sqrt(sum x^2 + eps), in float32, the
 * sum over i = 0 .. n-1 in order as for the row alone. NORM_LANES rows at a time, their sums side
 * by side: one row's sum is a chain of n dependent multiply-adds, several rows' chains overlap. */
#define NORM_LANES 16
static void l2_normalise(float *x, int64_t rows, int64_t n, float scale) {
    for (int64_t t0 = 0; t0 < rows; t0 += NORM_LANES) {
        const int64_t m = rows - t0 < NORM_LANES ? rows - t0 : NORM_LANES;
        float *xs = x + t0 * n, sum[NORM_LANES] = {0.0f}, r[NORM_LANES];
        for (int64_t i = 0; i < n; i++)
            for (int64_t l = 0; l < m; l++) sum[l] = MADD(xs[l * n + i], xs[l * n + i], sum[l]);
        for (int64_t l = 0; l < m; l++) r[l] = 1.0f / sqrtf(sum[l] + L2NORM_EPS);
        for (int64_t l = 0; l < m; l++)
            for (int64_t i = 0; i < n; i++) xs[l * n + i] = xs[l * n + i] * r[l] * scale;
    }
}

/* The rule over an item's tokens on a block of n <= RULE_COLS columns of one head's state s
 * [dk, dv] (row stride dv, first column c0): every column of S^T k, delta, S and S^T q is computed
 * from that column alone, so a block of columns goes through all the item's tokens while it stays
 * in the L1 cache (and its sums in registers), instead of the whole 64 KB state passing through
 * the cache twice per token. Each element sees the same operations in the same order as token
 * by token: S = decay * S and S^T k summed over i = 0 .. dk-1; delta = (v - S^T k) * beta;
 * S = S + k delta and S^T q summed over i. Token t's update and S^T q share one pass over the
 * block with token t+1's decay and S^T k, unless a cut falls between them (its state is the one
 * after the update, before the next decay). S^T q of token t goes to row t of o. */
#ifdef __AVX512F__
#define RULE_COLS 64 /* a block of [128, 64] floats (32 KB) stays in L1 */
#else
/* The fused pass holds a block's delta, S^T q and S^T k sums: 3 x 32 floats are 12 of the 16
 * AVX2 registers (3 x 64 would spill to the stack every step). */
#define RULE_COLS 32
#endif
#define RULE_VECS (RULE_COLS / 16)

/* A token's first pass over a block of n columns: S = decay * S, remembered = S^T k (sums over
 * i in order, from 0). */
static inline __attribute__((always_inline)) void decay_pass(float *restrict s, int64_t stride, int64_t n,
                                                             int64_t dk, const float *restrict k, float decay,
                                                             float *restrict remembered) {
#ifdef __AVX512F__
    if (n == RULE_COLS) { /* the same operations, the sums in registers */
        const __m512 dec = _mm512_set1_ps(decay);
        __m512 r_sum[RULE_VECS];
        for (int v = 0; v < RULE_VECS; v++) r_sum[v] = _mm512_setzero_ps();
        for (int64_t i = 0; i < dk; i++) {
            float *row = s + i * stride;
            const __m512 ki = _mm512_set1_ps(k[i]);
            for (int v = 0; v < RULE_VECS; v++) {
                const __m512 decayed = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * v), dec);
                r_sum[v] = _mm512_fmadd_ps(decayed, ki, r_sum[v]);
                _mm512_storeu_ps(row + 16 * v, decayed);
            }
        }
        for (int v = 0; v < RULE_VECS; v++) _mm512_storeu_ps(remembered + 16 * v, r_sum[v]);
        return;
    }
#endif
    for (int64_t c = 0; c < n; c++) remembered[c] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *restrict row = s + i * stride;
        const float ki = k[i];
        for (int64_t c = 0; c < n; c++) {
            row[c] *= decay;
            remembered[c] = MADD(row[c], ki, remembered[c]);
        }
    }
}

/* A token's second pass: S = S + k delta, out = S^T q (sums over i in order, from 0). */
static inline __attribute__((always_inline)) void update_pass(float *restrict s, int64_t stride, int64_t n,
                                                              int64_t dk, const float *restrict k,
                                                              const float *restrict q, const float *restrict delta,
                                                              float *restrict out) {
#ifdef __AVX512F__
    if (n == RULE_COLS) {
        __m512 d[RULE_VECS], o_sum[RULE_VECS];
        for (int v = 0; v < RULE_VECS; v++) {
            d[v] = _mm512_loadu_ps(delta + 16 * v);
            o_sum[v] = _mm512_setzero_ps();
        }
        for (int64_t i = 0; i < dk; i++) {
            float *row = s + i * stride;
            const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
            for (int v = 0; v < RULE_VECS; v++) {
                const __m512 updated = _mm512_fmadd_ps(ki, d[v], _mm512_loadu_ps(row + 16 * v));
                o_sum[v] = _mm512_fmadd_ps(updated, qi, o_sum[v]);
                _mm512_storeu_ps(row + 16 * v, updated);
            }
        }
        for (int v = 0; v < RULE_VECS; v++) _mm512_storeu_ps(out + 16 * v, o_sum[v]);
        return;
    }
#endif
    for (int64_t c = 0; c < n; c++) out[c] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *restrict row = s + i * stride;
        const float ki = k[i], qi = q[i];
        for (int64_t c = 0; c < n; c++) {
            row[c] = MADD(ki, delta[c], row[c]);
            out[c] = MADD(row[c], qi, out[c]);
        }
    }
}

/* A block's dk rows of n floats from s (row stride `stride`) to `to` (row stride to_stride): a
 * checkpoint of the state after a cut's token, or the block into and out of its contiguous copy. */
static inline void copy_columns(float *restrict to, int64_t to_stride, const float *restrict s, int64_t stride,
                                int64_t n, int64_t dk) {
    for (int64_t i = 0; i < dk; i++) memcpy(to + i * to_stride, s + i * stride, (size_t)n * sizeof(float));
}

/* The rule over one block: s is its first element (row stride `stride`), v and o the block's first
 * column of the tokens' values and outputs (row strides v_stride, o_stride); a cut copies the
 * block to cut_base + its row * row_size (row stride cut_stride). */
static inline __attribute__((always_inline)) void rule_columns(
    float *restrict s, int64_t stride, int64_t n, int64_t count, int64_t dk, const float *restrict qn,
    const float *restrict kn, const float *restrict decays, const float *restrict betas, const float *v,
    int64_t v_stride, float *restrict o, int64_t o_stride, float *cut_base, int64_t cut_stride, int64_t row_size,
    const int64_t *cut_offsets, const int64_t *cut_rows, int64_t num_cuts) {
    float remembered[RULE_COLS], delta[RULE_COLS], out[RULE_COLS];
    int64_t cut = 0;
    for (; cut < num_cuts && cut_offsets[cut] == 0; cut++)
        copy_columns(cut_base + cut_rows[cut] * row_size, cut_stride, s, stride, n, dk);
    decay_pass(s, stride, n, dk, kn, decays[0], remembered); /* token 0's decay and S^T k */
    for (int64_t t = 0; t < count; t++) {
        const float *vt = v + t * v_stride, beta = betas[t];
        const float *qt = qn + t * dk, *kt = kn + t * dk;
        for (int64_t c = 0; c < n; c++) delta[c] = (vt[c] - remembered[c]) * beta;
        const int fused = t + 1 < count && !(cut < num_cuts && cut_offsets[cut] == t + 1);
        if (fused) {
            const float *kn1 = kn + (t + 1) * dk, decay = decays[t + 1];
#ifdef __AVX512F__
            if (n == RULE_COLS) { /* the same operations, the sums held in registers */
                __m512 d[RULE_VECS], o_sum[RULE_VECS], r_sum[RULE_VECS];
                for (int v = 0; v < RULE_VECS; v++) {
                    d[v] = _mm512_loadu_ps(delta + 16 * v);
                    o_sum[v] = r_sum[v] = _mm512_setzero_ps();
                }
                const __m512 dec = _mm512_set1_ps(decay);
                for (int64_t i = 0; i < dk; i++) {
                    float *row = s + i * stride;
                    const __m512 ki = _mm512_set1_ps(kt[i]), qi = _mm512_set1_ps(qt[i]), k1 = _mm512_set1_ps(kn1[i]);
                    for (int v = 0; v < RULE_VECS; v++) {
                        const __m512 updated = _mm512_fmadd_ps(ki, d[v], _mm512_loadu_ps(row + 16 * v));
                        o_sum[v] = _mm512_fmadd_ps(updated, qi, o_sum[v]);
                        const __m512 decayed = _mm512_mul_ps(updated, dec);
                        r_sum[v] = _mm512_fmadd_ps(decayed, k1, r_sum[v]);
                        _mm512_storeu_ps(row + 16 * v, decayed);
                    }
                }
                for (int v = 0; v < RULE_VECS; v++) {
                    _mm512_storeu_ps(o + t * o_stride + 16 * v, o_sum[v]);
                    _mm512_storeu_ps(remembered + 16 * v, r_sum[v]);
                }
                continue;
            }
#endif
            for (int64_t c = 0; c < n; c++) out[c] = remembered[c] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                float *restrict row = s + i * stride;
                const float ki = kt[i], qi = qt[i], k1 = kn1[i];
                for (int64_t c = 0; c < n; c++) {
                    const float updated = MADD(ki, delta[c], row[c]);
                    out[c] = MADD(updated, qi, out[c]);
                    const float decayed = updated * decay;
                    remembered[c] = MADD(decayed, k1, remembered[c]);
                    row[c] = decayed;
                }
            }
        } else {
            update_pass(s, stride, n, dk, kt, qt, delta, out);
            for (; cut < num_cuts && cut_offsets[cut] == t + 1; cut++)
                copy_columns(cut_base + cut_rows[cut] * row_size, cut_stride, s, stride, n, dk);
            if (t + 1 < count) decay_pass(s, stride, n, dk, kn + (t + 1) * dk, decays[t + 1], remembered);
        }
        for (int64_t c = 0; c < n; c++) o[t * o_stride + c] = out[c];
    }
}

/* One token's rule on a whole head's state s [dk, dv] (rows contiguous, dv floats each), in place:
 * a decode row. The same operations on each element, in the same order, as rule_columns with one
 * token (hence its bits), but the state walked row after row: a first pass reads it and sums
 * S^T k of the decayed state (not stored), a second recomputes each decayed element, updates it,
 * sums S^T q and writes it once. By blocks of columns (rule_columns) every row of the 64 KB head
 * was read 128 bytes at a time, 512 apart, and written twice: on machine C (Zen 3) a 16-row decode
 * call of the Qwen3.5-0.8B shape spent 1.9 ms in the rule and norms that way, 1.5 this way (16 MB
 * of state read and written: 21 GB/s, against 43 for an in-place scale of as much memory).
 *
 * `next` (or NULL) is the state of the head the thread works on next: each pass asks for half of
 * it into L2, so that memory is busy while the passes compute on this head from the caches (the
 * first pass had read from memory with nothing else in flight, the second from L2 with memory
 * idle: ~1.5 -> ~1.2 ms of rule and norms in that 16-row call). */
#ifndef __AVX512F__
static void rule_token(float *restrict s, int64_t dk, int64_t dv, const float *restrict q, const float *restrict k,
                       float decay, float beta, const float *restrict v, float *restrict o, const float *next) {
    float remembered[MAX_HEAD_DIM], delta[MAX_HEAD_DIM];
    const int64_t half = dk * dv / 2, per_row = (half + dk - 1) / dk; /* next's floats asked for per row */
    for (int64_t c = 0; c < dv; c++) remembered[c] = o[c] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float *restrict row = s + i * dv;
        const float ki = k[i];
        if (next != NULL)
            for (int64_t c = 0; c < per_row; c += 16) __builtin_prefetch(next + i * per_row + c, 0, 2);
        for (int64_t c = 0; c < dv; c++) remembered[c] = MADD(row[c] * decay, ki, remembered[c]);
    }
    for (int64_t c = 0; c < dv; c++) delta[c] = (v[c] - remembered[c]) * beta;
    for (int64_t i = 0; i < dk; i++) {
        float *restrict row = s + i * dv;
        const float ki = k[i], qi = q[i];
        if (next != NULL)
            for (int64_t c = 0; c < per_row; c += 16) __builtin_prefetch(next + half + i * per_row + c, 0, 2);
        for (int64_t c = 0; c < dv; c++) {
            const float updated = MADD(ki, delta[c], row[c] * decay);
            o[c] = MADD(updated, qi, o[c]);
            row[c] = updated;
        }
    }
}
#endif

/* A token's q, k and v channels of one head in a conv row (at q, k, v; dk, dk and dv floats),
 * fetched into the cache GATHER_AHEAD tokens before they are copied out. */
#define GATHER_AHEAD 4
static inline void prefetch_head(const float *row, int64_t q, int64_t k, int64_t v, int64_t dk, int64_t dv) {
    for (int64_t j = 0; j < dk; j += 16) {
        __builtin_prefetch(row + q + j);
        __builtin_prefetch(row + k + j);
    }
    for (int64_t j = 0; j < dv; j += 16) __builtin_prefetch(row + v + j);
}

/* x[0..n) = silu(x) = x / (1 + exp(-x)): sixteen lanes at a time with exp16 where the build has
 * AVX-512 (every channel alike, a short last group masked); elsewhere from e = exp(-|x|) by
 * exp_nonpositive, which the compiler vectorises (expf, a library call per value, took a third of
 * an AVX2 build's prompt kernel): x / (1 + e) for x >= 0, x e / (1 + e) below. */
static inline void silu_block(float *x, int64_t n) {
#ifdef __AVX512F__
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 lanes = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(lanes, x + c);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_mask_storeu_ps(x + c, lanes, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    }
#else
    for (int64_t c = 0; c < n; c++) {
        const float v = x[c], e = exp_nonpositive(-fabsf(v));
        x[c] = (v >= 0.0f ? v : v * e) / (1.0f + e);
    }
#endif
}

/* The gated RMSNorm of one head's outputs o [count, dv] (rounded in place), gated by silu(z) (z's
 * rows z_at + t * z_stride), into y's rows y_at + t * y_stride. Each token's sum of squares over
 * j in order, NORM_LANES tokens' sums side by side (as l2_normalise); gate is [dv] of scratch. */
static void head_norms(float *restrict o, int64_t count, const void *z, int64_t z_at, int64_t z_stride,
                       const float *restrict norm_w, float eps, int64_t dv, int dtype, void *y, int64_t y_at,
                       int64_t y_stride, float *restrict gate) {
    for (int64_t t0 = 0; t0 < count; t0 += NORM_LANES) {
        const int64_t m = count - t0 < NORM_LANES ? count - t0 : NORM_LANES;
        float *os = o + t0 * dv, squares[NORM_LANES] = {0.0f};
        if (dtype == TUILI_BF16) /* the type's test out of the loops, so that they vectorise */
            for (int64_t j = 0; j < m * dv; j++) os[j] = bf16_to_f32(f32_to_bf16(os[j]));
        for (int64_t j = 0; j < dv; j++)
            for (int64_t l = 0; l < m; l++) squares[l] = MADD(os[l * dv + j], os[l * dv + j], squares[l]);
        for (int64_t l = 0; l < m; l++) {
            const float r = 1.0f / sqrtf(squares[l] / (float)dv + eps), *ot = os + l * dv;
            const int64_t z_row = z_at + (t0 + l) * z_stride, y_row = y_at + (t0 + l) * y_stride;
            if (t0 + l + GATHER_AHEAD < count) { /* rows apart, as the conv's (prefetch_head) */
                const size_t size = dtype == TUILI_BF16 ? 2 : 4;
                for (int64_t j = 0; j < dv; j += 16)
                    __builtin_prefetch((const char *)z + (size_t)(z_row + GATHER_AHEAD * z_stride + j) * size);
            }
            if (dtype == TUILI_BF16) {
                for (int64_t j = 0; j < dv; j++) gate[j] = bf16_to_f32(((const uint16_t *)z)[z_row + j]);
                silu_block(gate, dv);
                for (int64_t j = 0; j < dv; j++) {
                    const float normed = bf16_to_f32(f32_to_bf16(norm_w[j] * bf16_to_f32(f32_to_bf16(ot[j] * r))));
                    ((uint16_t *)y)[y_row + j] = f32_to_bf16(normed * gate[j]);
                }
            } else {
                for (int64_t j = 0; j < dv; j++) gate[j] = ((const float *)z)[z_row + j];
                silu_block(gate, dv);
                for (int64_t j = 0; j < dv; j++) ((float *)y)[y_row + j] = norm_w[j] * (ot[j] * r) * gate[j];
            }
        }
    }
}

/* The conv of a range of channels over an item's tokens, in blocks of CONV_BLOCK channels: each
 * token's outputs (rounded) into out[t * channels + c], the windows moving on by one input per
 * token; after `offset` tokens for each of the item's cuts, the windows are also copied to that
 * cut's row of conv_state. Token-major over the whole range (each token's inputs and outputs one
 * run each, the blocks' windows and weights held in `blocks`: 4.3 KB a block), so that memory is
 * walked row after row, not 512 rows apart per block; the sums vectorise across channels; each
 * channel's sum is still window[0] w[0] + ... + x w[K-1], left to right, separate multiplies and
 * adds (the build's -ffp-contract=off). */
#define CONV_BLOCK 64

#define MAX_CONV_WIDTH 8 /* K - 1; Python checks it */
typedef struct {
    float window[MAX_CONV_WIDTH][CONV_BLOCK], w[MAX_CONV_WIDTH + 1][CONV_BLOCK];
} ConvBlock;

/* A block of n channels' conv sums through SiLU, rounded, into the conv's output row. */
static inline void conv_output(float *restrict sum, int64_t n, int dtype, float *restrict row) {
    silu_block(sum, n);
    if (dtype == TUILI_BF16)
        for (int64_t c = 0; c < n; c++) row[c] = bf16_to_f32(f32_to_bf16(sum[c]));
    else
        for (int64_t c = 0; c < n; c++) row[c] = sum[c];
}

/* One token through one block of n channels starting at c0: inputs x, outputs into row. */
static inline __attribute__((always_inline)) void conv_token(ConvBlock *restrict blk, const void *mixed, int64_t at,
                                                             int64_t n, int64_t width, int dtype, float *restrict row) {
    float x[CONV_BLOCK], sum[CONV_BLOCK];
    if (dtype == TUILI_BF16) /* the type's test out of the loops, so that they vectorise */
        for (int64_t c = 0; c < n; c++) x[c] = bf16_to_f32(((const uint16_t *)mixed)[at + c]);
    else
        for (int64_t c = 0; c < n; c++) x[c] = ((const float *)mixed)[at + c];
    for (int64_t c = 0; c < n; c++) sum[c] = 0.0f;
    for (int64_t j = 0; j < width; j++)
        for (int64_t c = 0; c < n; c++) sum[c] = sum[c] + blk->window[j][c] * blk->w[j][c];
    for (int64_t c = 0; c < n; c++) sum[c] = sum[c] + x[c] * blk->w[width][c];
    for (int64_t j = 0; j + 1 < width; j++)
        for (int64_t c = 0; c < n; c++) blk->window[j][c] = blk->window[j + 1][c];
    for (int64_t c = 0; c < n; c++) blk->window[width - 1][c] = x[c];
    conv_output(sum, n, dtype, row);
}

/* conv_token's sums for a token with no ConvBlock windows: channel c's window read where the slot
 * keeps it (state + c * width, the inputs oldest first), the same products added in the same
 * order. Inlined per width, so that the common one (3) is a constant the loop vectorises by. */
static inline __attribute__((always_inline)) void slot_sums(const ConvBlock *restrict blk, const void *state,
                                                            const void *mixed, int64_t at, int64_t n,
                                                            const int64_t width, int dtype, float *restrict sum) {
    if (dtype == TUILI_BF16) {
        const uint16_t *w = state, *x = (const uint16_t *)mixed + at;
        for (int64_t c = 0; c < n; c++) {
            float total = 0.0f;
            for (int64_t j = 0; j < width; j++) total = total + bf16_to_f32(w[c * width + j]) * blk->w[j][c];
            sum[c] = total + bf16_to_f32(x[c]) * blk->w[width][c];
        }
    } else {
        const float *w = state, *x = (const float *)mixed + at;
        for (int64_t c = 0; c < n; c++) {
            float total = 0.0f;
            for (int64_t j = 0; j < width; j++) total = total + w[c * width + j] * blk->w[j][c];
            sum[c] = total + x[c] * blk->w[width][c];
        }
    }
}

/* The conv weights of channels c_begin .. c_end - 1 (c_begin a multiple of CONV_BLOCK) into
 * `blocks`, one ConvBlock per CONV_BLOCK channels: once per call, every item's conv reads them
 * (loaded again for each item, they took ~0.3 ms of a 16-row decode call's 1.0 ms conv on machine
 * C for the Qwen3.5-0.8B shape). */
static void conv_weights(const void *weight, int64_t c_begin, int64_t c_end, int64_t width, int dtype,
                         ConvBlock *blocks) {
    for (int64_t c = c_begin; c < c_end; c++)
        for (int64_t j = 0; j <= width; j++)
            blocks[(c - c_begin) / CONV_BLOCK].w[j][(c - c_begin) % CONV_BLOCK] =
                load(weight, dtype, c * (width + 1) + j);
}

/* The slot's windows of channels c_begin .. c_end - 1 moved on by one input x (mixed's values
 * from `at`): each channel's [w1 .. w_{K-1}, x], which is the range's values shifted by one place
 * (channel c's last taking c + 1's first) with x written over each last: bit copies, as the
 * windows hold the inputs as given. Storing ConvBlock windows back one value at a time took
 * ~0.25 ms of a 16-row decode call's conv on machine C. */
static void shift_windows(void *conv_state, int64_t slot, int64_t channels, int64_t c_begin, int64_t c_end,
                          int64_t width, const void *mixed, int64_t at, int dtype) {
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
    char *row = (char *)conv_state + (size_t)(slot * channels + c_begin) * width * size;
    memmove(row, row + size, ((size_t)(c_end - c_begin) * width - 1) * size);
    if (dtype == TUILI_BF16) /* typed copies: memcpy of a run-time size was a call per channel */
        for (int64_t c = 0; c < c_end - c_begin; c++)
            ((uint16_t *)row)[c * width + width - 1] = ((const uint16_t *)mixed)[at + c_begin + c];
    else
        for (int64_t c = 0; c < c_end - c_begin; c++)
            ((float *)row)[c * width + width - 1] = ((const float *)mixed)[at + c_begin + c];
}

/* One token with no cuts (a decode row) through channels c_begin .. c_end - 1: the sums read the
 * windows where the slot keeps them (slot_sums), without the ConvBlock copy, whose transposing
 * loads took ~0.2 ms of a 16-row decode call on machine C; then the windows move on. */
static void conv_row(const void *mixed, int64_t at, void *conv_state, int64_t slot, int64_t c_begin,
                     int64_t c_end, int64_t channels, int64_t width, int dtype, float *out,
                     const ConvBlock *blocks) {
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
    for (int64_t c0 = c_begin; c0 < c_end; c0 += CONV_BLOCK) {
        const ConvBlock *blk = &blocks[(c0 - c_begin) / CONV_BLOCK];
        const void *windows = (const char *)conv_state + (size_t)(slot * channels + c0) * width * size;
        const int64_t n = c_end - c0 < CONV_BLOCK ? c_end - c0 : CONV_BLOCK;
        float sum[CONV_BLOCK];
        if (width == 3 && n == CONV_BLOCK) /* kernel 4, as Qwen3.5's and Qwen3-Next's */
            slot_sums(blk, windows, mixed, at + c0, CONV_BLOCK, 3, dtype, sum);
        else
            slot_sums(blk, windows, mixed, at + c0, n, width, dtype, sum);
        conv_output(sum, n, dtype, out + c0);
    }
    shift_windows(conv_state, slot, channels, c_begin, c_end, width, mixed, at, dtype);
}

/* Channels c_begin .. c_end - 1 (c_begin a multiple of CONV_BLOCK) of one item; `blocks` holds
 * one ConvBlock per CONV_BLOCK channels of the range, its weights loaded (conv_weights). */
static void conv_range(const void *mixed, int64_t mixed_stride, int64_t first, int64_t count, void *conv_state,
                       int64_t slot, int64_t c_begin, int64_t c_end, int64_t channels, int64_t width,
                       const int64_t *cut_offsets, const int64_t *cut_rows, int64_t num_cuts, int dtype, float *out,
                       ConvBlock *blocks) {
    if (count == 1 && num_cuts == 0) {
        conv_row(mixed, first * mixed_stride, conv_state, slot, c_begin, c_end, channels, width, dtype, out, blocks);
        return;
    }
    const int64_t num_blocks = (c_end - c_begin + CONV_BLOCK - 1) / CONV_BLOCK;
    for (int64_t k = 0; k < num_blocks; k++) {
        const int64_t c0 = c_begin + k * CONV_BLOCK, n = c_end - c0 < CONV_BLOCK ? c_end - c0 : CONV_BLOCK;
        const int64_t at = (slot * channels + c0) * width;
        if (dtype == TUILI_BF16) /* the type's test out of the loops */
            for (int64_t c = 0; c < n; c++)
                for (int64_t j = 0; j < width; j++)
                    blocks[k].window[j][c] = bf16_to_f32(((const uint16_t *)conv_state)[at + c * width + j]);
        else
            for (int64_t c = 0; c < n; c++)
                for (int64_t j = 0; j < width; j++)
                    blocks[k].window[j][c] = ((const float *)conv_state)[at + c * width + j];
    }
    int64_t cut = 0;
    for (int64_t t = 0; t <= count; t++) {
        for (; cut < num_cuts && cut_offsets[cut] == t; cut++)
            for (int64_t c = c_begin; c < c_end; c++)
                for (int64_t j = 0; j < width; j++)
                    store(conv_state, dtype, (cut_rows[cut] * channels + c) * width + j,
                          blocks[(c - c_begin) / CONV_BLOCK].window[j][(c - c_begin) % CONV_BLOCK]);
        if (t == count) break;
        for (int64_t k = 0; k < num_blocks; k++) {
            const int64_t c0 = c_begin + k * CONV_BLOCK, at = (first + t) * mixed_stride + c0;
            float *row = out + t * channels + c0;
            if (c_end - c0 >= CONV_BLOCK) /* a constant width: the loops vectorise without a rest */
                conv_token(&blocks[k], mixed, at, CONV_BLOCK, width, dtype, row);
            else
                conv_token(&blocks[k], mixed, at, c_end - c0, width, dtype, row);
        }
    }
    if (count == 1) { /* with cuts: the windows as a decode row's */
        shift_windows(conv_state, slot, channels, c_begin, c_end, width, mixed, first * mixed_stride, dtype);
        return;
    }
    for (int64_t c = c_begin; c < c_end; c++)
        for (int64_t j = 0; j < width; j++)
            store(conv_state, dtype, (slot * channels + c) * width + j,
                  blocks[(c - c_begin) / CONV_BLOCK].window[j][(c - c_begin) % CONV_BLOCK]);
}

/* Items: item i is rows firsts[i] .. firsts[i] + counts[i] - 1 of one sequence, consecutive tokens,
 * its state in slot slots[i]; counts NULL means one row each (decode). Cuts (cut_starts NULL: none):
 * item i's are cut_starts[i] .. cut_starts[i + 1] - 1, in increasing offset; cut j copies the
 * item's state after cut_offsets[j] tokens (0 .. counts[i]) to row cut_rows[j] of the state. */
static int deltanet_items(const void *mixed, int64_t mixed_stride, const void *z, int64_t z_stride, const void *b,
                          const void *a, int64_t ba_stride, const void *conv_weight, void *conv_state,
                          float *recurrent, int64_t num_slots, const int64_t *firsts, const int64_t *counts,
                          const int64_t *slots, int64_t num_items, const int64_t *cut_starts,
                          const int64_t *cut_offsets, const int64_t *cut_rows, int64_t num_tokens,
                          const void *a_log, const void *dt_bias, const void *norm_weight, int64_t k_heads,
                          int64_t v_heads, int64_t dk, int64_t dv, int64_t kernel, float eps, int dtype, void *out,
                          int64_t out_stride, int num_threads, int64_t *error) {
    if (dk > MAX_HEAD_DIM || dv > MAX_HEAD_DIM || kernel < 2 || kernel - 1 > MAX_CONV_WIDTH || v_heads % k_heads)
        return TUILI_BAD_SHAPE;
    int64_t *starts = malloc((size_t)(num_items + 1) * sizeof(int64_t)); /* item i's first row of conv */
    if (!starts) return TUILI_NO_MEMORY;
    starts[0] = 0;
    for (int64_t i = 0; i < num_items; i++) {
        const int64_t count = counts ? counts[i] : 1;
        if (firsts[i] < 0 || count < 1 || firsts[i] + count > num_tokens) {
            error[1] = i;
            error[2] = firsts[i];
            free(starts);
            return (int)(error[0] = TUILI_BAD_SEQ_ROWS);
        }
        if (slots[i] < 0 || slots[i] >= num_slots) {
            error[1] = i;
            error[2] = slots[i];
            free(starts);
            return (int)(error[0] = TUILI_BAD_SLOT);
        }
        for (int64_t j = cut_starts ? cut_starts[i] : 0; cut_starts && j < cut_starts[i + 1]; j++)
            if (cut_rows[j] < 0 || cut_rows[j] >= num_slots || cut_offsets[j] < 0 || cut_offsets[j] > count ||
                (j > cut_starts[i] && cut_offsets[j] < cut_offsets[j - 1])) {
                error[1] = i;
                error[2] = cut_rows[j];
                free(starts);
                return (int)(error[0] = TUILI_BAD_SLOT);
            }
        starts[i + 1] = starts[i] + count;
    }
    const int64_t key_dim = k_heads * dk, channels = 2 * key_dim + v_heads * dv, width = kernel - 1;
    /* the conv's outputs, rounded; then q and k L2-normalised in place */
    float *conv = malloc((size_t)(starts[num_items] * channels) * sizeof(float));
    /* Each thread's buffers for one (item, head): its tokens' q and k normalised, its outputs
     * before the norm, decays and betas; then one token's gate and the norm's weight. */
    int64_t max_count = 1;
    for (int64_t i = 0; i < num_items; i++)
        if (starts[i + 1] - starts[i] > max_count) max_count = starts[i + 1] - starts[i];
    const size_t per_thread = (size_t)(max_count * (2 * dk + 2 * dv + 2) + 2 * dv);
    float *buffers = conv ? malloc((size_t)num_threads * per_thread * sizeof(float)) : NULL;
    /* each thread's contiguous copy of a block of the state's columns (rule_columns) */
    float *state_blocks = buffers ? aligned_alloc(64, (size_t)num_threads * dk * RULE_COLS * sizeof(float)) : NULL;
    /* one per block of channels, whichever thread takes it */
    const int64_t num_conv_blocks = (channels + CONV_BLOCK - 1) / CONV_BLOCK;
    ConvBlock *conv_blocks = state_blocks ? malloc((size_t)num_conv_blocks * sizeof(ConvBlock)) : NULL;
    if (!conv_blocks) {
        free(state_blocks);
        free(buffers);
        free(conv);
        free(starts);
        return TUILI_NO_MEMORY;
    }

#pragma omp parallel num_threads(num_threads)
    {
        /* The conv: each thread a range of whole blocks of channels, item after item. */
        {
            const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
            const int64_t b0 = num_conv_blocks * thread / threads, b1 = num_conv_blocks * (thread + 1) / threads;
            const int64_t c_begin = b0 * CONV_BLOCK, c_end = b1 * CONV_BLOCK < channels ? b1 * CONV_BLOCK : channels;
            if (b1 > b0) conv_weights(conv_weight, c_begin, c_end, width, dtype, conv_blocks + b0);
            for (int64_t i = 0; i < num_items && b1 > b0; i++) {
                const int64_t first_cut = cut_starts ? cut_starts[i] : 0,
                              num_cuts = cut_starts ? cut_starts[i + 1] - first_cut : 0;
                conv_range(mixed, mixed_stride, firsts[i], starts[i + 1] - starts[i], conv_state,
                           slots[i], c_begin, c_end, channels, width, cut_offsets + first_cut, cut_rows + first_cut,
                           num_cuts, dtype, conv + starts[i] * channels, conv_blocks + b0);
            }
        }
#pragma omp barrier
        /* Each token's q and k L2-normalised in place, once per key head (not once per value head
         * that reads it), the k_heads rows side by side (one row's sum is a chain of dk
         * multiply-adds that waits on each; alone, they took ~10% of a decode call). */
        const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < starts[num_items]; t++) {
            l2_normalise(conv + t * channels, k_heads, dk, q_scale);
            l2_normalise(conv + t * channels + key_dim, k_heads, dk, 1.0f);
        }
        /* The rule and the norm, one (item, value head) at a time: the tokens' q, k and gates
         * first, then the rule by blocks of columns over all the tokens (rule_columns), then each
         * token's norm. */
        float *buffer = buffers + (size_t)omp_get_thread_num() * per_thread;
        float *qn = buffer, *kn = qn + max_count * dk, *vs = kn + max_count * dk, *o = vs + max_count * dv;
        float *decays = o + max_count * dv;
        float *betas = decays + max_count, *zf = betas + max_count, *w = zf + dv;
        float *block = state_blocks + (size_t)omp_get_thread_num() * dk * RULE_COLS;
        for (int64_t j = 0; j < dv; j++) w[j] = load(norm_weight, dtype, j);
        const int64_t per_key = v_heads / k_heads;
        const int64_t state_size = v_heads * dk * dv;
        /* Decode rows (counts NULL) are alike: each thread takes one run of consecutive (row, head)
         * pairs, so it knows whose state it reads next (rule_token asks for it ahead); chunks, of
         * any lengths, go one pair at a time to whichever thread is free. */
        const int64_t pairs = num_items * v_heads, runs = counts == NULL ? omp_get_num_threads() : pairs;
#pragma omp for schedule(dynamic, 1)
        for (int64_t run = 0; run < runs; run++) {
            const int64_t last = pairs * (run + 1) / runs;
            for (int64_t ih = pairs * run / runs; ih < last; ih++) {
                const int64_t i = ih / v_heads, h = ih % v_heads, kh = h / per_key, count = starts[i + 1] - starts[i];
                const int64_t first_cut = cut_starts ? cut_starts[i] : 0;
                const int64_t num_cuts = cut_starts ? cut_starts[i + 1] - first_cut : 0;
                for (int64_t t = 0; t < count; t++) {
                    const int64_t row = firsts[i] + t;
                    const float *c = conv + (starts[i] + t) * channels;
                    if (t + GATHER_AHEAD < count) /* rows a conv row apart: the hardware does not fetch them ahead */
                        prefetch_head(c + GATHER_AHEAD * channels, kh * dk, key_dim, 2 * key_dim + h * dv, dk, dv);
                    memcpy(qn + t * dk, c + kh * dk, (size_t)dk * sizeof(float));
                    memcpy(kn + t * dk, c + key_dim + kh * dk, (size_t)dk * sizeof(float));
                    memcpy(vs + t * dv, c + 2 * key_dim + h * dv, (size_t)dv * sizeof(float));
                    betas[t] = round_to(1.0f / (1.0f + expf(-load(b, dtype, row * ba_stride + h))), dtype);
                    const float g = -expf(load(a_log, dtype, h)) * softplus(load(a, dtype, row * ba_stride + h) +
                                                                             load(dt_bias, dtype, h));
                    decays[t] = expf(g);
                }
                float *s = recurrent + slots[i] * state_size + h * dk * dv;
                float *cut_base = recurrent + h * dk * dv;
                const int64_t *offsets = cut_offsets + first_cut, *rows = cut_rows + first_cut;
#ifndef __AVX512F__ /* AVX-512 builds keep rule_columns' sums in registers (not measured against) */
                if (count == 1 && num_cuts == 0)
                    rule_token(s, dk, dv, qn, kn, decays[0], betas[0], vs, o,
                               ih + 1 < last ? recurrent + slots[(ih + 1) / v_heads] * state_size +
                                                   (ih + 1) % v_heads * dk * dv
                                             : NULL);
                else
#endif
                for (int64_t c0 = 0; c0 < dv; c0 += RULE_COLS) {
                    const int64_t n = dv - c0 < RULE_COLS ? dv - c0 : RULE_COLS;
                    /* Over several tokens the block is worked on in a contiguous copy: its rows in the
                     * state are dv floats apart, which maps a [128, 64] block of a 128-wide head onto
                     * half of L1's sets, more lines than their ways hold. */
                    float *cols = s + c0;
                    int64_t stride = dv;
                    if (count > 1) {
                        copy_columns(block, RULE_COLS, cols, stride, n, dk);
                        cols = block;
                        stride = RULE_COLS;
                    }
                    if (n == RULE_COLS) /* the constant width lets the compiler keep the sums in registers */
                        rule_columns(cols, stride, RULE_COLS, count, dk, qn, kn, decays, betas, vs + c0, dv, o + c0,
                                     dv, cut_base + c0, dv, state_size, offsets, rows, num_cuts);
                    else
                        rule_columns(cols, stride, n, count, dk, qn, kn, decays, betas, vs + c0, dv, o + c0, dv,
                                     cut_base + c0, dv, state_size, offsets, rows, num_cuts);
                    if (count > 1) copy_columns(s + c0, dv, block, RULE_COLS, n, dk);
                }
                head_norms(o, count, z, firsts[i] * z_stride + h * dv, z_stride, w, eps, dv, dtype, out,
                           firsts[i] * out_stride + h * dv, out_stride, zf);
            }
        }
    }
    free(conv_blocks);
    free(state_blocks);
    free(buffers);
    free(conv);
    free(starts);
    return TUILI_OK;
}

int tuili_deltanet_decode(const void *mixed, int64_t mixed_stride, const void *z, int64_t z_stride, const void *b,
                          const void *a, int64_t ba_stride, const void *conv_weight, void *conv_state,
                          float *recurrent, int64_t num_slots, const int64_t *rows, const int64_t *slots,
                          int64_t num_rows, int64_t num_tokens, const void *a_log, const void *dt_bias, const void *norm_weight,
                          int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, int64_t kernel, float eps,
                          int dtype, void *out, int64_t out_stride, int num_threads, int64_t *error) {
    return deltanet_items(mixed, mixed_stride, z, z_stride, b, a, ba_stride, conv_weight, conv_state, recurrent,
                          num_slots, rows, NULL, slots, num_rows, NULL, NULL, NULL, num_tokens, a_log, dt_bias,
                          norm_weight, k_heads, v_heads, dk, dv, kernel, eps, dtype, out, out_stride, num_threads,
                          error);
}

int tuili_deltanet_chunks(const void *mixed, int64_t mixed_stride, const void *z, int64_t z_stride, const void *b,
                          const void *a, int64_t ba_stride, const void *conv_weight, void *conv_state,
                          float *recurrent, int64_t num_slots, const int64_t *firsts, const int64_t *counts,
                          const int64_t *slots, int64_t num_items, const int64_t *cut_starts,
                          const int64_t *cut_offsets, const int64_t *cut_rows, int64_t num_tokens,
                          const void *a_log, const void *dt_bias, const void *norm_weight, int64_t k_heads,
                          int64_t v_heads, int64_t dk, int64_t dv, int64_t kernel, float eps, int dtype, void *out,
                          int64_t out_stride, int num_threads, int64_t *error) {
    return deltanet_items(mixed, mixed_stride, z, z_stride, b, a, ba_stride, conv_weight, conv_state, recurrent,
                          num_slots, firsts, counts, slots, num_items, cut_starts, cut_offsets, cut_rows, num_tokens,
                          a_log, dt_bias, norm_weight, k_heads, v_heads, dk, dv, kernel, eps, dtype, out, out_stride,
                          num_threads, error);
}
