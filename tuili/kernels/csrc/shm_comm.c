/* Collectives between the tensor-parallel ranks of one machine through a shared memory segment
 * (tuili/parallel/shm.py has the layout and the protocol). Each rank owns one 64-bit counter
 * in the segment, which it raises to n once its data for exchange n is written (a release
 * store), and a rank reads the others' data for exchange n only after seeing their counters
 * reach n (acquire loads): the data's writes, by this code or by torch before, are then visible
 * on every architecture. A word after the counters is the group's abort flag: any rank sets it
 * when the group fails, and every wait returns TUILI_ABORTED instead of waiting for a rank that
 * will never arrive.
 *
 * Waiting spins briefly with the CPU's pause hint (during a step a peer is microseconds away),
 * then yields the core at each look: with more ranks than cores, a spinning rank would otherwise
 * hold the core its peer needs in order to arrive. */
#define _POSIX_C_SOURCE 200809L
#include <sched.h>
#include <time.h>

#include "common.h"
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define CPU_RELAX() ((void)0)
#endif

#define PAUSE_SPINS 4096 /* ~10-40 us of pause hints before the first yield */
#define SUM_BLOCK 256    /* bfloat16 sums: float32 partial totals on the stack, this many at a time */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int aborted(const int64_t *counters, int64_t stride, int64_t world) {
    return __atomic_load_n(counters + world * stride, __ATOMIC_RELAXED) != 0;
}

static int shm_all_reduce(void *segment, int64_t stride, int64_t world, int64_t rank, int64_t header_bytes,
                          int64_t slot_bytes, int64_t *seq, void *x, int64_t numel, int dtype);

int tuili_shm_arrive(int64_t *counters, int64_t stride, int64_t rank, int64_t seq) {
    __atomic_store_n(counters + rank * stride, seq, __ATOMIC_RELEASE);
    return TUILI_OK;
}

/* 1 once the counters of ranks first .. first + count - 1 have all reached seq; 0 if
 * timeout_ns passed first (< 0: no limit; 0: look once); TUILI_ABORTED (negated) if the group
 * was aborted. */
int tuili_shm_wait(const int64_t *counters, int64_t stride, int64_t world, int64_t first, int64_t count, int64_t seq,
                   int64_t timeout_ns) {
    int64_t rank = first;
    const int64_t stop = first + count;
    const int64_t start = timeout_ns > 0 ? now_ns() : 0;
    for (int64_t spins = 0;; spins++) {
        while (rank < stop && __atomic_load_n(counters + rank * stride, __ATOMIC_ACQUIRE) >= seq) rank++;
        if (rank == stop) return 1;
        if (aborted(counters, stride, world)) return -TUILI_ABORTED;
        if (timeout_ns == 0) return 0;
        if (spins < PAUSE_SPINS) {
            CPU_RELAX();
            continue;
        }
        if (timeout_ns > 0 && (spins & 63) == 0 && now_ns() - start >= timeout_ns) return 0;
        sched_yield();
    }
}

/* x [numel] (float32 or bfloat16) summed over the ranks in place, in exchanges of at most
 * slot_bytes per rank; *seq is this rank's last exchange number, moved on by each. Every rank
 * adds the slots in rank order in float32 and rounds once, so all hold the same bits.
 * stats[0] += the nanoseconds spent here, stats[1] += 1: the communication time of a replayed
 * graph, which no Python code times. */
int tuili_shm_all_reduce(void *segment, int64_t stride, int64_t world, int64_t rank, int64_t header_bytes,
                         int64_t slot_bytes, int64_t *seq, int64_t *stats, void *x, int64_t numel, int dtype) {
    const int64_t started = now_ns();
    int status = shm_all_reduce(segment, stride, world, rank, header_bytes, slot_bytes, seq, x, numel, dtype);
    stats[0] += now_ns() - started;
    stats[1] += 1;
    return status;
}

static int shm_all_reduce(void *segment, int64_t stride, int64_t world, int64_t rank, int64_t header_bytes,
                          int64_t slot_bytes, int64_t *seq, void *x, int64_t numel, int dtype) {
    int64_t *counters = (int64_t *)segment;
    const int64_t size = dtype == TUILI_F32 ? 4 : 2;
    const int64_t per_chunk = slot_bytes / size;
    for (int64_t first = 0; first < numel; first += per_chunk) {
        const int64_t n = numel - first < per_chunk ? numel - first : per_chunk;
        const int64_t s = ++*seq;
        /* the slots of parity s % 2 are free once every rank arrived at s - 1 */
        int status = tuili_shm_wait(counters, stride, world, 0, world, s - 1, -1);
        if (status != 1) return -status;
        char *slots = (char *)segment + header_bytes + (s % 2) * world * slot_bytes;
        memcpy(slots + rank * slot_bytes, (char *)x + first * size, (size_t)(n * size));
        tuili_shm_arrive(counters, stride, rank, s);
        status = tuili_shm_wait(counters, stride, world, 0, world, s, -1);
        if (status != 1) return -status;
        if (dtype == TUILI_F32) {
            float *out = (float *)x + first;
            const float *part0 = (const float *)slots;
            for (int64_t i = 0; i < n; i++) out[i] = part0[i];
            for (int64_t r = 1; r < world; r++) {
                const float *part = (const float *)(slots + r * slot_bytes);
                for (int64_t i = 0; i < n; i++) out[i] += part[i];
            }
        } else {
            uint16_t *out = (uint16_t *)x + first;
            float total[SUM_BLOCK];
            for (int64_t b = 0; b < n; b += SUM_BLOCK) {
                const int64_t m = n - b < SUM_BLOCK ? n - b : SUM_BLOCK;
                const uint16_t *part0 = (const uint16_t *)slots + b;
                for (int64_t i = 0; i < m; i++) total[i] = bf16_to_f32(part0[i]);
                for (int64_t r = 1; r < world; r++) {
                    const uint16_t *part = (const uint16_t *)(slots + r * slot_bytes) + b;
                    for (int64_t i = 0; i < m; i++) total[i] += bf16_to_f32(part[i]);
                }
                for (int64_t i = 0; i < m; i++) out[b + i] = f32_to_bf16(total[i]);
            }
        }
    }
    return TUILI_OK;
}
