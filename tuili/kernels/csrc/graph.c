/* Replay of a recorded sequence of kernel calls: a CPU graph (tuili/kernels/graph.py).
 *
 * A program is a flat int64 array of calls, each one word naming the kernel (enum graph_op)
 * followed by that kernel's arguments in the order of its prototype in kernels.h: pointers as
 * addresses, integers as they are, floats as their 32 bits. The Python side writes it from the
 * calls a forward made while recording; here each call is made again with the same arguments,
 * in order, on the calling thread (each kernel forks its own OpenMP team, as when Python calls
 * it). A kernel's error pointer argument is recorded as 0 and replaced by the replayer's own. */
#include "common.h"
#include "kernels.h"

enum graph_op {
    OP_PAGED_ATTENTION,
    OP_KV_STORE,
    OP_LINEAR_SMALL,
    OP_LINEAR_AMX,
    OP_LINEAR_INT4,
    OP_RMS_NORM,
    OP_QK_NORM_ROPE,
    OP_SILU_MUL,
    OP_LINEAR_PACKED,
    OP_DELTANET_DECODE,
    OP_SIGMOID_GATE,
    OP_SHM_ALL_REDUCE,
    OP_LINEAR_ROWS,
    OP_COUNT
};

static const struct {
    const char *name;
    int args;
} OPS[OP_COUNT] = {
    [OP_PAGED_ATTENTION] = {"tuili_paged_attention", 25},
    [OP_KV_STORE] = {"tuili_kv_store", 11},
    [OP_LINEAR_SMALL] = {"tuili_linear_small", 10},
    [OP_LINEAR_AMX] = {"tuili_linear_amx", 9},
    [OP_LINEAR_INT4] = {"tuili_linear_int4", 16},
    [OP_RMS_NORM] = {"tuili_rms_norm", 10},
    [OP_QK_NORM_ROPE] = {"tuili_qk_norm_rope", 16},
    [OP_SILU_MUL] = {"tuili_silu_mul", 6},
    [OP_LINEAR_PACKED] = {"tuili_linear_packed", 10},
    [OP_DELTANET_DECODE] = {"tuili_deltanet_decode", 29},
    [OP_SIGMOID_GATE] = {"tuili_sigmoid_gate", 9},
    [OP_SHM_ALL_REDUCE] = {"tuili_shm_all_reduce", 11},
    [OP_LINEAR_ROWS] = {"tuili_linear_rows", 10},
};

/* The name and argument count of graph op `op`, or NULL past the last one: how Python learns
 * the numbering. */
const char *tuili_graph_op(int op, int *args) {
    if (op < 0 || op >= OP_COUNT) return NULL;
    *args = OPS[op].args;
    return OPS[op].name;
}

#define P(i) ((void *)(intptr_t)a[i])
#define I(i) ((int)a[i])
#define F(i) bits_to_f32((uint32_t)a[i])

static int run(int64_t op, const int64_t *a, int64_t *error) {
    switch (op) {
    case OP_PAGED_ATTENTION:
        return tuili_paged_attention(P(0), I(1), a[2], a[3], a[4], a[5], P(6), P(7), I(8), a[9], a[10], a[11], P(12),
                                     P(13), P(14), I(15), a[16], a[17], P(18), I(19), F(20), P(21), a[22], I(23), error);
    case OP_KV_STORE:
        return tuili_kv_store(P(0), P(1), a[2], P(3), P(4), a[5], P(6), a[7], a[8], I(9), error);
    case OP_LINEAR_SMALL:
        return tuili_linear_small(P(0), P(1), P(2), P(3), I(4), I(5), a[6], a[7], a[8], I(9));
    case OP_LINEAR_AMX:
        return tuili_linear_amx(P(0), P(1), P(2), P(3), I(4), a[5], a[6], a[7], I(8));
    case OP_LINEAR_INT4:
        return tuili_linear_int4(P(0), I(1), P(2), P(3), P(4), I(5), a[6], a[7], a[8], a[9], a[10], a[11], a[12], I(13),
                                 I(14), I(15));
    case OP_RMS_NORM:
        return tuili_rms_norm(P(0), P(1), P(2), P(3), a[4], a[5], F(6), I(7), I(8), I(9));
    case OP_QK_NORM_ROPE:
        return tuili_qk_norm_rope(P(0), P(1), P(2), P(3), P(4), a[5], a[6], a[7], a[8], a[9], a[10], I(11), P(12), F(13),
                                  I(14), I(15));
    case OP_SILU_MUL:
        return tuili_silu_mul(P(0), P(1), a[2], a[3], I(4), I(5));
    case OP_LINEAR_PACKED:
        return tuili_linear_packed(P(0), P(1), P(2), P(3), I(4), a[5], a[6], a[7], I(8), I(9));
    case OP_DELTANET_DECODE:
        return tuili_deltanet_decode(P(0), a[1], P(2), a[3], P(4), P(5), a[6], P(7), P(8), P(9), a[10], P(11), P(12),
                                     a[13], a[14], P(15), P(16), P(17), a[18], a[19], a[20], a[21], a[22], F(23), I(24),
                                     P(25), a[26], I(27), error);
    case OP_SIGMOID_GATE:
        return tuili_sigmoid_gate(P(0), P(1), a[2], a[3], a[4], a[5], a[6], I(7), I(8));
    case OP_SHM_ALL_REDUCE:
        return tuili_shm_all_reduce(P(0), a[1], a[2], a[3], a[4], a[5], P(6), P(7), P(8), a[9], I(10));
    case OP_LINEAR_ROWS:
        return tuili_linear_rows(P(0), P(1), P(2), P(3), I(4), I(5), a[6], a[7], a[8], I(9));
    default:
        return TUILI_BAD_PROGRAM;
    }
}

/* Runs `program` (`length` words). Returns 0, or the first failing kernel's status with
 * error[1..2] its details (as the kernel reports them) and error[3] the failing call's index
 * (-1: the program itself is malformed). */
int tuili_graph_replay(const int64_t *program, int64_t length, int64_t *error) {
    int64_t call = 0;
    for (int64_t at = 0; at < length; call++) {
        const int64_t op = program[at];
        if (op < 0 || op >= OP_COUNT || at + 1 + OPS[op].args > length) {
            error[3] = -1;
            return (int)(error[0] = TUILI_BAD_PROGRAM);
        }
        int64_t kernel_error[3] = {0, 0, 0};
        const int status = run(op, program + at + 1, kernel_error);
        if (status != TUILI_OK) {
            error[1] = kernel_error[1];
            error[2] = kernel_error[2];
            error[3] = call;
            return (int)(error[0] = status);
        }
        at += 1 + OPS[op].args;
    }
    return TUILI_OK;
}
