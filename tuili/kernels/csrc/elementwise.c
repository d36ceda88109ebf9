/* The elementwise work of a decoder layer, fused: RMSNorm (with the residual add before it),
 * Qwen3's per-head q/k RMSNorm with the rotary embedding, and SiLU(gate) * up.
 *
 * Each kernel does in one pass over its rows what the torch code (tuili/layers) does in 4-12
 * ops, each op a pass over memory and, at decode, mostly Python dispatch. Every kernel rounds
 * where the torch code rounds, so that float32 and bfloat16 models get the same values up to
 * the order of a float32 sum and the last bits of exp and sqrt:
 *
 *   rms_norm:      y = w * round(x * r),  r = 1 / sqrt(mean(x^2) + eps)  (x and r in float32);
 *                  with `offset` (Qwen3-Next's norms, weights stored centred on zero):
 *                  y = round((x * r) * (1 + w)), all in float32 before the one rounding
 *   add_rms_norm:  s = round(x + residual) is written back to residual; y = rms_norm(s)
 *   qk_norm_rope:  per head of q and k, optionally rms_norm with that head kind's weight, then
 *                  the rotate-half rotation in float32 (x1 cos - x2 sin, x2 cos + x1 sin) of the
 *                  first rotary_dim values, round
 *   sigmoid_gate:  x = round(x * round(sigmoid(g)))
 *   silu_mul:      y = round(silu(g)) * u   (silu(g) = g / (1 + exp(-g)) in float32)
 *
 * where round is to the tensor's dtype (nothing for float32) and products of two stored values
 * are rounded once. All tensors are row-major and contiguous. Threads take rows a few at a time
 * as they free up (a core of a shared machine may run slower for seconds: docs/kernels.md,
 * Measured crossovers). */
#include <omp.h>
#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "common.h"
#include "exp16.h"
#include "kernels.h"

#define ROWS_PER_GRAB 4

/* e^-|x|: sigmoid_gate's and silu_mul's functions come from the exp of a non-positive number
 * only (exp_nonpositive, which vectorises; expf of any sign does not), with e = e^-|x|:
 * sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) below. */
static inline float exp_neg_abs(float x) { return exp_nonpositive(-fabsf(x)); }

/* Rows go through float32 buffers, with the dtype test outside the loops so that they vectorize. */
static void row_load(float *dst, const void *src, int dtype, int64_t n) {
    if (dtype == TUILI_BF16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static void row_store(void *dst, const float *src, int dtype, int64_t n) {
    if (dtype == TUILI_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* Each value rounded to the dtype and back: what storing it would keep. */
static void row_round(float *v, int dtype, int64_t n) {
    if (dtype == TUILI_BF16)
        for (int64_t i = 0; i < n; i++) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
}

/* buf[0..dim) = w * round(buf * r): one row of RMSNorm in place, w already in float32; with
 * `offset`, buf * r * w unrounded (w then holds 1 + the stored weight). */
static void norm_row(float *buf, const float *w, int64_t dim, float eps, int offset, int dtype) {
    const float r = 1.0f / sqrtf(dot_lanes16(buf, buf, dim) / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++) buf[d] *= r;
    if (!offset) row_round(buf, dtype, dim);
    for (int64_t d = 0; d < dim; d++) buf[d] *= w[d];
}

/* SiLU(gate) * up and the sigmoid gate over n values of a row, through float32 buffers. */
static void silu_mul_loops(const char *g, const char *u, char *out, int64_t n, int dtype) {
    float gate[n], up[n];
    row_load(gate, g, dtype, n);
    row_load(up, u, dtype, n);
    for (int64_t d = 0; d < n; d++) { /* silu = x sigmoid(x), by exp_neg_abs */
        const float x = gate[d], e = exp_neg_abs(x);
        gate[d] = (x >= 0.0f ? x : x * e) / (1.0f + e);
    }
    row_round(gate, dtype, n);
    for (int64_t d = 0; d < n; d++) gate[d] *= up[d];
    row_store(out, gate, dtype, n);
}

static void sigmoid_gate_loops(char *x, const char *g, int64_t n, int dtype) {
    float v[n], gate[n];
    row_load(v, x, dtype, n);
    row_load(gate, g, dtype, n);
    for (int64_t d = 0; d < n; d++) { /* sigmoid, by exp_neg_abs */
        const float e = exp_neg_abs(gate[d]);
        gate[d] = (gate[d] >= 0.0f ? 1.0f : e) / (1.0f + e);
    }
    row_round(gate, dtype, n);
    for (int64_t d = 0; d < n; d++) v[d] *= gate[d];
    row_store(x, v, dtype, n);
}

#define MAX_DIM 16384 /* the longest row the stack buffer takes; Python checks it */

#if defined(__AVX512F__) && defined(__FMA__)
/* bf16 rows sixteen values to a register, in one or two passes instead of the loops above (their
 * overhead on short rows: docs/kernels.md, Measured crossovers). The same operations in the same
 * order, so the same bits: sums of squares as
 * dot_lanes16 takes them (sixteen fused lanes, added in order), products rounded once. */
#define FAST_BF16 1

static inline __m512 widen_narrowed(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline float lanes_in_order(__m512 lanes) {
    float l[16], total = 0.0f;
    _mm512_storeu_ps(l, lanes);
    for (int i = 0; i < 16; i++) total += l[i];
    return total;
}

/* One row of tuili_rms_norm in bf16, dim a multiple of 16; buf holds dim floats. */
static void rms_norm_row_bf16(const uint16_t *x, uint16_t *res, const float *w, uint16_t *out, int64_t dim,
                              float eps, int offset, float *buf) {
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
        __m512 v = widen_bf16(x + d);
        if (res) {
            const __m256i sum = narrow_bf16(_mm512_add_ps(v, widen_bf16(res + d)));
            _mm256_storeu_si256((__m256i *)(res + d), sum);
            v = widen_narrowed(sum);
        }
        lanes = _mm512_fmadd_ps(v, v, lanes);
        _mm512_storeu_ps(buf + d, v);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(lanes_in_order(lanes) / (float)dim + eps));
    for (int64_t d = 0; d < dim; d += 16) {
        const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(buf + d), r);
        const __m512 v = offset ? scaled : widen_narrowed(narrow_bf16(scaled));
        _mm256_storeu_si256((__m256i *)(out + d), narrow_bf16(_mm512_mul_ps(v, _mm512_loadu_ps(w + d))));
    }
}

/* One head of tuili_qk_norm_rope in bf16, in registers: head_dim a multiple of 32, at most 256,
 * rotary_dim a multiple of 32; read at src, written at dst (the same place, or q_out). */
static void qk_head_bf16(const uint16_t *src, uint16_t *dst, const float *w, const float *c, const float *s,
                         int64_t head_dim, int64_t rotary_dim, int offset, float eps) {
    __m512 v[16];
    const int64_t n = head_dim / 16, half = rotary_dim / 32;
    for (int64_t i = 0; i < n; i++) v[i] = widen_bf16(src + 16 * i);
    if (w) {
        __m512 lanes = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i++) lanes = _mm512_fmadd_ps(v[i], v[i], lanes);
        const __m512 r = _mm512_set1_ps(1.0f / sqrtf(lanes_in_order(lanes) / (float)head_dim + eps));
        for (int64_t i = 0; i < n; i++) {
            const __m512 scaled = _mm512_mul_ps(v[i], r);
            const __m512 normed = offset ? scaled : widen_narrowed(narrow_bf16(scaled));
            v[i] = widen_narrowed(narrow_bf16(_mm512_mul_ps(normed, _mm512_loadu_ps(w + 16 * i))));
        }
    }
    for (int64_t i = 0; i < half; i++) {
        const __m512 a = v[i], b = v[i + half];
        const __m512 cos = _mm512_loadu_ps(c + 16 * i), sin = _mm512_loadu_ps(s + 16 * i);
        v[i] = _mm512_sub_ps(_mm512_mul_ps(a, cos), _mm512_mul_ps(b, sin));
        v[i + half] = _mm512_add_ps(_mm512_mul_ps(b, cos), _mm512_mul_ps(a, sin));
    }
    for (int64_t i = 0; i < n; i++) _mm256_storeu_si256((__m256i *)(dst + 16 * i), narrow_bf16(v[i]));
}

/* Sixteen values of a row widened to float32; and stored back, narrowed to bf16 to nearest even
 * as row_store does (AVX-512F alone: no masked 16-bit loads, so a row's last n % 16 values take
 * the loops below, with the same operations). */
static inline __m512 load16(const void *src, int dtype) {
    return dtype == TUILI_BF16 ? widen_bf16(src) : _mm512_loadu_ps(src);
}
static inline void store16(void *dst, __m512 v, int dtype) {
    if (dtype == TUILI_BF16)
        _mm256_storeu_si256((__m256i *)dst, narrow_bf16(v));
    else
        _mm512_storeu_ps(dst, v);
}

/* round(v) to the dtype and back, as row_round. */
static inline __m512 round16(__m512 v, int dtype) {
    return dtype == TUILI_BF16 ? widen_narrowed(narrow_bf16(v)) : v;
}

/* sigmoid and silu on sixteen lanes from e = e^-|x| (exp16 of -|x|, exp_neg_abs's operations):
 * the scalar loops' operations (one IEEE division each), so the same bits (a NaN stays a NaN, its
 * sign and payload as the compiler's code for the loops leaves them aside). */
static inline __m512 exp_neg_abs16(__m512 x) {
    return exp16(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}

/* n values: out = round(silu(gate)) * up, sixteen at a time in registers, where the loops
 * (silu_mul_loops) pass six times through float32 buffers: 512 x 3072 bf16 on machine A, two
 * threads, 0.80 -> 0.69 ms; 64 rows 121 -> 91 us. */
static void silu_mul_row(const char *g, const char *u, char *out, int64_t n, int dtype) {
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        const __m512 x = load16(g + d * size, dtype), e = exp_neg_abs16(x);
        const __m512 numerator = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NGE_UQ), x, e);
        const __m512 silu = round16(_mm512_div_ps(numerator, _mm512_add_ps(e, _mm512_set1_ps(1.0f))), dtype);
        store16(out + d * size, _mm512_mul_ps(silu, load16(u + d * size, dtype)), dtype);
    }
    if (d < n) silu_mul_loops(g + d * size, u + d * size, out + d * size, n - d, dtype);
}

/* n values: x = round(x * round(sigmoid(gate))) in place. */
static void sigmoid_gate_row(char *x, const char *g, int64_t n, int dtype) {
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        const __m512 gate = load16(g + d * size, dtype), e = exp_neg_abs16(gate), one = _mm512_set1_ps(1.0f);
        const __m512 numerator = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
        const __m512 sigmoid = round16(_mm512_div_ps(numerator, _mm512_add_ps(e, one)), dtype);
        store16(x + d * size, _mm512_mul_ps(load16(x + d * size, dtype), sigmoid), dtype);
    }
    if (d < n) sigmoid_gate_loops(x + d * size, g + d * size, n - d, dtype);
}
#else
static void silu_mul_row(const char *g, const char *u, char *out, int64_t n, int dtype) {
    silu_mul_loops(g, u, out, n, dtype);
}

static void sigmoid_gate_row(char *x, const char *g, int64_t n, int dtype) {
    sigmoid_gate_loops(x, g, n, dtype);
}
#endif

int tuili_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim, float eps,
                   int offset, int dtype, int num_threads) {
    if (dim > MAX_DIM) return TUILI_BAD_SHAPE;
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
#pragma omp parallel num_threads(num_threads)
    {
        float buf[dim], res[dim], w[dim]; /* a few KiB: rows of one hidden state */
        row_load(w, weight, dtype, dim);
        if (offset)
            for (int64_t d = 0; d < dim; d++) w[d] += 1.0f;
#ifdef FAST_BF16
        if (dtype == TUILI_BF16 && dim % 16 == 0) {
#pragma omp for schedule(dynamic, ROWS_PER_GRAB)
            for (int64_t row = 0; row < rows; row++)
                rms_norm_row_bf16((const uint16_t *)x + row * dim, residual ? (uint16_t *)residual + row * dim : NULL,
                                  w, (uint16_t *)out + row * dim, dim, eps, offset, buf);
        } else
#endif
#pragma omp for schedule(dynamic, ROWS_PER_GRAB)
        for (int64_t row = 0; row < rows; row++) {
            row_load(buf, (const char *)x + row * dim * size, dtype, dim);
            if (residual) {
                char *rr = (char *)residual + row * dim * size;
                row_load(res, rr, dtype, dim);
                for (int64_t d = 0; d < dim; d++) buf[d] += res[d];
                row_store(rr, buf, dtype, dim);
                row_round(buf, dtype, dim);
            }
            norm_row(buf, w, dim, eps, offset, dtype);
            row_store((char *)out + row * dim * size, buf, dtype, dim);
        }
    }
    return TUILI_OK;
}

/* On qkv [tokens, q_heads * q_step + 2 kv_heads, head_dim]: the q heads (at every q_step-th head,
 * the ones between them untouched: Qwen3-Next's output gates) and the k heads after them normalized
 * (when q_weight / k_weight are given; `offset` as in tuili_rms_norm) and their first rotary_dim
 * values rotated (rotate-half within them); v untouched. k in place; q in place, or written to
 * q_out [tokens, q_heads, head_dim] when given. cos and sin are float32 [tokens, rotary_dim / 2]. */
int tuili_qk_norm_rope(void *qkv, const void *q_weight, const void *k_weight, const float *cos, const float *sin,
                       int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim,
                       int64_t q_step, int offset, void *q_out, float eps, int dtype, int num_threads) {
    if (head_dim > MAX_DIM || rotary_dim % 2 || rotary_dim > head_dim || q_step < 1) return TUILI_BAD_SHAPE;
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
    const int64_t heads = q_heads * q_step + 2 * kv_heads, rotated = q_heads + kv_heads, half = rotary_dim / 2;
#pragma omp parallel num_threads(num_threads)
    {
        float buf[head_dim], out[head_dim], qw[head_dim], kw[head_dim];
        if (q_weight) {
            row_load(qw, q_weight, dtype, head_dim);
            row_load(kw, k_weight, dtype, head_dim);
            if (offset)
                for (int64_t d = 0; d < head_dim; d++) {
                    qw[d] += 1.0f;
                    kw[d] += 1.0f;
                }
        }
#pragma omp for schedule(dynamic, ROWS_PER_GRAB)
        for (int64_t t = 0; t < tokens; t++) {
            const float *c = cos + t * half, *s = sin + t * half;
            for (int64_t h = 0; h < rotated; h++) {
                const int64_t slot = h < q_heads ? h * q_step : q_heads * q_step + (h - q_heads);
                char *src = (char *)qkv + (t * heads + slot) * head_dim * size;
                char *dst = h < q_heads && q_out ? (char *)q_out + (t * q_heads + h) * head_dim * size : src;
                const float *w = q_weight ? (h < q_heads ? qw : kw) : NULL;
#ifdef FAST_BF16
                if (dtype == TUILI_BF16 && head_dim % 32 == 0 && head_dim <= 256 && rotary_dim % 32 == 0) {
                    qk_head_bf16((const uint16_t *)src, (uint16_t *)dst, w, c, s, head_dim, rotary_dim, offset, eps);
                    continue;
                }
#endif
                row_load(buf, src, dtype, head_dim);
                if (w) {
                    norm_row(buf, w, head_dim, eps, offset, dtype);
                    row_round(buf, dtype, head_dim);
                }
                for (int64_t d = 0; d < half; d++) {
                    out[d] = buf[d] * c[d] - buf[d + half] * s[d];
                    out[d + half] = buf[d + half] * c[d] + buf[d] * s[d];
                }
                for (int64_t d = rotary_dim; d < head_dim; d++) out[d] = buf[d];
                row_store(dst, out, dtype, head_dim);
            }
        }
    }
    return TUILI_OK;
}

/* x [rows, heads * head_dim] *= round(sigmoid(gate)) in place, rounded, gate head h of row r at
 * gate + r * gate_stride + h * gate_head_stride (elements): Qwen3-Next's gated attention output. */
int tuili_sigmoid_gate(void *x, const void *gate, int64_t rows, int64_t heads, int64_t head_dim, int64_t gate_stride,
                       int64_t gate_head_stride, int dtype, int num_threads) {
    if (head_dim > MAX_DIM) return TUILI_BAD_SHAPE;
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, ROWS_PER_GRAB) collapse(2)
    for (int64_t row = 0; row < rows; row++) {
        for (int64_t h = 0; h < heads; h++) {
            sigmoid_gate_row((char *)x + (row * heads + h) * head_dim * size,
                             (const char *)gate + (row * gate_stride + h * gate_head_stride) * size, head_dim, dtype);
        }
    }
    return TUILI_OK;
}

/* out [rows, inter] = round(silu(gate)) * up, gate_up [rows, 2 * inter] holding gate then up. */
#define SILU_CHUNK 1024

int tuili_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype, int num_threads) {
    const size_t size = dtype == TUILI_BF16 ? 2 : 4;
    const int64_t chunks = (inter + SILU_CHUNK - 1) / SILU_CHUNK;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, ROWS_PER_GRAB) collapse(2)
    for (int64_t row = 0; row < rows; row++) {
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const int64_t first = chunk * SILU_CHUNK, n = inter - first < SILU_CHUNK ? inter - first : SILU_CHUNK;
            const char *g = (const char *)gate_up + (row * 2 * inter + first) * size, *u = g + inter * size;
            silu_mul_row(g, u, (char *)out + (row * inter + first) * size, n, dtype);
        }
    }
    return TUILI_OK;
}
