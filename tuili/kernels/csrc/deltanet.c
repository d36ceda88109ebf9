/* Gated DeltaNet at decode: one new token per sequence through the causal conv, the gated delta
 * rule and the gated RMSNorm, in one call (what tuili/layers/deltanet.py does in ~40 torch ops per
 * layer and step, each a pass over memory or, at batch 1, mostly Python dispatch).
 *
 * For each decode row d (its token at row rows[d] of the inputs and the output, its state in slot
 * slots[d]) and each value head h of Hv (key head h / (Hv / Hk)):
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
 * (row, head) is computed alone, in a fixed order, whatever the batch: a sequence's decode gives
 * the same bits in any batch and at any thread count. Inputs may be views with a row stride (the
 * fused projections' outputs); the state and weights are contiguous. Rows and slots are checked
 * first: a bad one writes nothing. */
#include <omp.h>
#include <stdlib.h>

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

int tuili_deltanet_decode(const void *mixed, int64_t mixed_stride, const void *z, int64_t z_stride, const void *b,
                          const void *a, int64_t ba_stride, const void *conv_weight, void *conv_state,
                          float *recurrent, int64_t num_slots, const int64_t *rows, const int64_t *slots,
                          int64_t num_rows, int64_t num_tokens, const void *a_log, const void *dt_bias, const void *norm_weight,
                          int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, int64_t kernel, float eps,
                          int dtype, void *out, int64_t out_stride, int num_threads, int64_t *error) {
    if (dk > MAX_HEAD_DIM || dv > MAX_HEAD_DIM || kernel < 2 || v_heads % k_heads) return TUILI_BAD_SHAPE;
    for (int64_t d = 0; d < num_rows; d++) {
        if (rows[d] < 0 || rows[d] >= num_tokens) {
            error[1] = d;
            error[2] = rows[d];
            return (int)(error[0] = TUILI_BAD_SEQ_ROWS);
        }
        if (slots[d] < 0 || slots[d] >= num_slots) {
            error[1] = d;
            error[2] = slots[d];
            return (int)(error[0] = TUILI_BAD_SLOT);
        }
    }
    const int64_t key_dim = k_heads * dk, channels = 2 * key_dim + v_heads * dv, width = kernel - 1;
    float *conv = malloc((size_t)(num_rows * channels) * sizeof(float)); /* the conv's outputs, rounded */
    if (!conv) return TUILI_NO_MEMORY;

#pragma omp parallel num_threads(num_threads)
    {
        /* The conv, channel by channel; each slot's window moves on by one input. */
#pragma omp for schedule(static)
        for (int64_t dc = 0; dc < num_rows * channels; dc++) {
            const int64_t d = dc / channels, c = dc % channels;
            char *state = (char *)conv_state;
            const size_t size = dtype == TUILI_BF16 ? 2 : 4;
            void *window = state + ((slots[d] * channels + c) * width) * size;
            const float x = load(mixed, dtype, rows[d] * mixed_stride + c);
            float sum = 0.0f;
            for (int64_t j = 0; j < width; j++) sum += load(window, dtype, j) * load(conv_weight, dtype, c * kernel + j);
            sum += x * load(conv_weight, dtype, c * kernel + width);
            for (int64_t j = 0; j + 1 < width; j++) store(window, dtype, j, load(window, dtype, j + 1));
            store(window, dtype, width - 1, x);
            conv[dc] = round_to(silu(sum), dtype);
        }
        /* The rule and the norm, one (row, value head) at a time. */
        float q[MAX_HEAD_DIM], k[MAX_HEAD_DIM], zf[MAX_HEAD_DIM], w[MAX_HEAD_DIM];
        for (int64_t j = 0; j < dv; j++) w[j] = load(norm_weight, dtype, j);
        const int64_t per_key = v_heads / k_heads;
        const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp for schedule(static)
        for (int64_t dh = 0; dh < num_rows * v_heads; dh++) {
            const int64_t d = dh / v_heads, h = dh % v_heads, kh = h / per_key, row = rows[d];
            const float *c = conv + d * channels;
            for (int64_t i = 0; i < dk; i++) {
                q[i] = c[kh * dk + i];
                k[i] = c[key_dim + kh * dk + i];
            }
            l2_normalise(q, dk, q_scale);
            l2_normalise(k, dk, 1.0f);
            for (int64_t j = 0; j < dv; j++) zf[j] = load(z, dtype, row * z_stride + h * dv + j);
            const float beta = round_to(1.0f / (1.0f + expf(-load(b, dtype, row * ba_stride + h))), dtype);
            const float g = -expf(load(a_log, dtype, h)) * softplus(load(a, dtype, row * ba_stride + h) +
                                                                     load(dt_bias, dtype, h));
            head_step(recurrent + (slots[d] * v_heads + h) * dk * dv, q, k, c + 2 * key_dim + h * dv, expf(g), beta,
                      zf, w, eps, dk, dv, dtype, out, row * out_stride + h * dv);
        }
    }
    free(conv);
    return TUILI_OK;
}
