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
 * preemption gives the same state and outputs. The batch-invariant mode runs prompts this way on
 * CPUs (docs/engine.md); the chunked rule's matmuls round differently at every split.
 *
 * A chunk can also hand out its state after given numbers of tokens (cuts: prefix-cache
 * checkpoints inside it), copied to other rows of the state tensors. Inputs may be views with a
 * row stride (the fused projections' outputs); the state and weights are contiguous. Items,
 * slots and cuts are checked first: a bad one writes nothing. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#define MAX_HEAD_DIM 1024 /* per-head buffers live on the stack; Python checks it */
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

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* torch's softplus (beta 1, threshold 20): x above the threshold is returned as is. */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* x[0..n) *= scale / sqrt(sum x^2 + eps), in float32. */
static void l2_normalise(float *x, int64_t n, float scale) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum = MADD(x[i], x[i], sum);
    const float r = 1.0f / sqrtf(sum + L2NORM_EPS);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r * scale;
}

/* One value head of one decode row: the rule on its state s [dk, dv], then the gated norm into y. */
static void head_step(float *restrict s, const float *restrict q, const float *restrict k, const float *restrict v,
                      float decay, float beta, const float *restrict z, const float *restrict norm_w, float eps,
                      int64_t dk, int64_t dv, int dtype, void *y, int64_t y_at) {
    float remembered[MAX_HEAD_DIM], delta[MAX_HEAD_DIM], o[MAX_HEAD_DIM];
    for (int64_t j = 0; j < dv; j++) remembered[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *restrict row = s + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; j++) {
            row[j] *= decay;
            remembered[j] = MADD(row[j], ki, remembered[j]);
        }
    }
    for (int64_t j = 0; j < dv; j++) {
        delta[j] = (v[j] - remembered[j]) * beta;
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        float *restrict row = s + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < dv; j++) {
            row[j] = MADD(ki, delta[j], row[j]);
            o[j] = MADD(row[j], qi, o[j]);
        }
    }
    float squares = 0.0f;
    for (int64_t j = 0; j < dv; j++) {
        o[j] = round_to(o[j], dtype);
        squares = MADD(o[j], o[j], squares);
    }
    const float r = 1.0f / sqrtf(squares / (float)dv + eps);
    for (int64_t j = 0; j < dv; j++) {
        const float normed = round_to(norm_w[j] * round_to(o[j] * r, dtype), dtype);
        store(y, dtype, y_at + j, normed * silu(z[j]));
    }
}

/* The conv of one channel over an item's tokens: each token's output (rounded) into out[t * channels],
 * the window moving on by one input per token; after `offset` tokens for each of the item's cuts,
 * the window is also copied to that cut's row of conv_state. */
static void conv_channel(const void *mixed, int64_t mixed_stride, int64_t first, int64_t count, const void *weight,
                         void *conv_state, int64_t slot, int64_t c, int64_t channels, int64_t width,
                         const int64_t *cut_offsets, const int64_t *cut_rows, int64_t num_cuts, int dtype,
                         float *out) {
    char *state = (char *)conv_state;
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
    void *window = state + ((slot * channels + c) * width) * size;
    int64_t cut = 0;
    for (int64_t t = 0; t <= count; t++) {
        for (; cut < num_cuts && cut_offsets[cut] == t; cut++)
            memcpy(state + ((cut_rows[cut] * channels + c) * width) * size, window, (size_t)width * size);
        if (t == count) break;
        const float x = load(mixed, dtype, (first + t) * mixed_stride + c);
        float sum = 0.0f;
        for (int64_t j = 0; j < width; j++) sum += load(window, dtype, j) * load(weight, dtype, c * (width + 1) + j);
        sum += x * load(weight, dtype, c * (width + 1) + width);
        for (int64_t j = 0; j + 1 < width; j++) store(window, dtype, j, load(window, dtype, j + 1));
        store(window, dtype, width - 1, x);
        out[t * channels] = round_to(silu(sum), dtype);
    }
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
    if (dk > MAX_HEAD_DIM || dv > MAX_HEAD_DIM || kernel < 2 || v_heads % k_heads) return TUILI_BAD_SHAPE;
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
    float *conv = malloc((size_t)(starts[num_items] * channels) * sizeof(float)); /* the conv's outputs, rounded */
    if (!conv) {
        free(starts);
        return TUILI_NO_MEMORY;
    }

#pragma omp parallel num_threads(num_threads)
    {
        /* The conv, channel by channel; each item's window moves on by one input per token. */
#pragma omp for schedule(static)
        for (int64_t ic = 0; ic < num_items * channels; ic++) {
            const int64_t i = ic / channels, c = ic % channels;
            const int64_t first_cut = cut_starts ? cut_starts[i] : 0, num_cuts = cut_starts ? cut_starts[i + 1] - first_cut : 0;
            conv_channel(mixed, mixed_stride, firsts[i], starts[i + 1] - starts[i], conv_weight, conv_state, slots[i],
                         c, channels, width, cut_offsets + first_cut, cut_rows + first_cut, num_cuts, dtype,
                         conv + starts[i] * channels + c);
        }
        /* The rule and the norm, one (item, value head) at a time, token after token: the state
         * [Dk, Dv] stays in cache across the item's tokens. */
        float q[MAX_HEAD_DIM], k[MAX_HEAD_DIM], zf[MAX_HEAD_DIM], w[MAX_HEAD_DIM];
        for (int64_t j = 0; j < dv; j++) w[j] = load(norm_weight, dtype, j);
        const int64_t per_key = v_heads / k_heads;
        const float q_scale = 1.0f / sqrtf((float)dk);
        const size_t state_bytes = (size_t)(dk * dv) * sizeof(float);
#pragma omp for schedule(dynamic, 1)
        for (int64_t ih = 0; ih < num_items * v_heads; ih++) {
            const int64_t i = ih / v_heads, h = ih % v_heads, kh = h / per_key, count = starts[i + 1] - starts[i];
            float *s = recurrent + (slots[i] * v_heads + h) * dk * dv;
            const int64_t first_cut = cut_starts ? cut_starts[i] : 0, end_cut = cut_starts ? cut_starts[i + 1] : 0;
            int64_t cut = first_cut;
            for (int64_t t = 0; t <= count; t++) {
                for (; cut < end_cut && cut_offsets[cut] == t; cut++)
                    memcpy(recurrent + (cut_rows[cut] * v_heads + h) * dk * dv, s, state_bytes);
                if (t == count) break;
                const int64_t row = firsts[i] + t;
                const float *c = conv + (starts[i] + t) * channels;
                for (int64_t j = 0; j < dk; j++) {
                    q[j] = c[kh * dk + j];
                    k[j] = c[key_dim + kh * dk + j];
                }
                l2_normalise(q, dk, q_scale);
                l2_normalise(k, dk, 1.0f);
                for (int64_t j = 0; j < dv; j++) zf[j] = load(z, dtype, row * z_stride + h * dv + j);
                const float beta = round_to(1.0f / (1.0f + expf(-load(b, dtype, row * ba_stride + h))), dtype);
                const float g = -expf(load(a_log, dtype, h)) * softplus(load(a, dtype, row * ba_stride + h) +
                                                                         load(dt_bias, dtype, h));
                head_step(s, q, k, c + 2 * key_dim + h * dv, expf(g), beta, zf, w, eps, dk, dv, dtype, out,
                          row * out_stride + h * dv);
            }
        }
    }
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
