/* This step's keys and values written into the paged cache: token t's row of k and of v goes to
 * slot slot_mapping[t] of k_cache and v_cache ([num_slots, row_bytes] each, a slot being
 * block * block_size + offset). k and v are views into the fused qkv product, so their tokens
 * are src_stride bytes apart; a row is Hkv * D values of the cache's dtype, copied as bytes
 * (the caller converts first when the dtypes differ). Slots are checked before anything is
 * written, so a bad one leaves the cache as it was. */
#include <string.h>

#include "common.h"
#include "kernels.h"

#define PARALLEL_MIN_TOKENS 256 /* below this a copy of a few KiB per token is not worth a fork */

int tuili_kv_store(const void *k, const void *v, int64_t src_stride, void *k_cache, void *v_cache, int64_t num_slots,
                   const int64_t *slot_mapping, int64_t num_tokens, int64_t row_bytes, int num_threads,
                   int64_t *error) {
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) {
            error[1] = t;
            error[2] = slot_mapping[t];
            return (int)(error[0] = TUILI_BAD_SLOT);
        }
    }
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= PARALLEL_MIN_TOKENS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        memcpy((char *)k_cache + slot * row_bytes, (const char *)k + t * src_stride, (size_t)row_bytes);
        memcpy((char *)v_cache + slot * row_bytes, (const char *)v + t * src_stride, (size_t)row_bytes);
    }
    return TUILI_OK;
}
