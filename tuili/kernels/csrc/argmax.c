/* The index of each row's largest value: greedy decoding's pick over the vocabulary.
 *
 * x [rows, n] float32, row-major; out [rows] int64. Values are read as the sampler's
 * nan_to_num leaves them: NaN as -inf (never picked unless the row holds nothing else) and +inf
 * as the largest finite float, so a row's answer is torch.argmax(torch.nan_to_num(row, nan=-inf,
 * posinf=FLT_MAX, neginf=-inf)): the first index of the largest value. A row with no value above
 * -inf gives 0.
 *
 * One pass, 16 lanes: lane j keeps the largest value among elements j, j + 16, ... and the first
 * index where it occurred (strictly greater replaces), so among the lanes holding the row's
 * maximum the smallest index is the row's first. Rows are split among threads. */
#include <float.h>
#include <omp.h>

#include "common.h"
#include "kernels.h"

#define LANES 16

static inline float clean(float v) {
    if (v != v) return -INFINITY;
    return v > FLT_MAX ? FLT_MAX : v;
}

static int64_t argmax_row(const float *x, int64_t n) {
    float best[LANES];
    int64_t where[LANES];
    for (int j = 0; j < LANES; j++) {
        best[j] = -INFINITY;
        where[j] = 0;
    }
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const float v = clean(x[i + j]);
            const int greater = v > best[j];
            best[j] = greater ? v : best[j];
            where[j] = greater ? i + j : where[j];
        }
    float top = -INFINITY;
    int64_t index = 0;
    for (int j = 0; j < LANES; j++)
        if (best[j] > top || (best[j] == top && where[j] < index && top > -INFINITY)) {
            top = best[j];
            index = where[j];
        }
    for (; i < n; i++) { /* the tail comes after every lane's elements: only strictly greater wins */
        const float v = clean(x[i]);
        if (v > top) {
            top = v;
            index = i;
        }
    }
    return index;
}

int tuili_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
    return TUILI_OK;
}
