/* The library's entry points, one prototype per kernel: what tuili/kernels/cpu.py declares to
 * ctypes and what graph.c replays. Each kernel's source includes this header, so a signature
 * changed in one place and not the other fails to compile. Every kernel returns a
 * tuili_error (common.h); tuili/kernels/__init__.py documents what each computes. */
#ifndef TUILI_KERNELS_H
#define TUILI_KERNELS_H

#include <stdint.h>

int tuili_paged_attention(const void *q, int q_dtype, int64_t q_stride, int64_t num_tokens, int64_t num_heads,
                          int64_t head_dim, const void *k_cache, const void *v_cache, int cache_dtype,
                          int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, const float *k_scale,
                          const float *v_scale, const void *block_tables, int tables_int64, int64_t num_seqs,
                          int64_t max_blocks, const void *seq_info, int seq_info_int64, float scale, void *out,
                          int64_t split_keys, int num_threads, int64_t *error);
int tuili_kv_store(const void *k, const void *v, int64_t src_stride, void *k_cache, void *v_cache, int64_t num_slots,
                   const int64_t *slot_mapping, int64_t num_tokens, int64_t row_bytes, int num_threads,
                   int64_t *error);
int tuili_linear_small(const void *x, const void *weight, const void *bias, void *out, int dtype, int out_dtype,
                       int64_t m, int64_t n, int64_t k, int num_threads);
int tuili_linear_rows(const void *x, const void *weight, const void *bias, void *out, int dtype, int out_dtype,
                      int64_t m, int64_t n, int64_t k, int num_threads);
int tuili_amx_init(void);
int tuili_linear_amx(const void *x, const void *weight, const void *bias, void *out, int out_f32, int64_t m,
                     int64_t n, int64_t k, int num_threads);
int tuili_linear_packed_available(void);
int tuili_linear_packed(const void *x, const void *packed, const void *bias, void *out, int out_f32, int64_t m,
                        int64_t n, int64_t k, int one_path, int num_threads);
int tuili_prompt_attention(const void *q, const void *k, const void *v, int64_t q_stride, int64_t kv_stride,
                           int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, void *out,
                           int num_threads);
int tuili_linear_int4(const void *x, int x_dtype, const void *packed, const void *scale_zero, void *out,
                      int out_dtype, int64_t m, int64_t k, int64_t copies, int64_t tiles, int64_t group,
                      int64_t n_out, int64_t out_stride, int exact, int pairs, int num_threads);
int tuili_linear_int6_available(void);
int tuili_dequant_int4(const uint8_t *packed, int64_t k, const void *scale_zero, int scale_dtype, int pairs, int64_t n,
                       int64_t group_size, int64_t first_tile, int64_t num_tiles, void *out, int out_dtype,
                       int num_threads);
int tuili_dequant_int8_group(const uint8_t *packed, int64_t k, const void *scales, int scale_dtype, int64_t n,
                             int64_t group_size, int64_t first_tile, int64_t num_tiles, void *out, int out_dtype,
                             int num_threads);
int tuili_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim, float eps,
                   int offset, int dtype, int num_threads);
int tuili_qk_norm_rope(void *qkv, const void *q_weight, const void *k_weight, const float *cos, const float *sin,
                       int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim,
                       int64_t q_step, int offset, void *q_out, float eps, int dtype, int num_threads);
int tuili_sigmoid_gate(void *x, const void *gate, int64_t rows, int64_t heads, int64_t head_dim, int64_t gate_stride,
                       int64_t gate_head_stride, int dtype, int num_threads);
int tuili_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype, int num_threads);
int tuili_deltanet_decode(const void *mixed, int64_t mixed_stride, const void *z, int64_t z_stride, const void *b,
                          const void *a, int64_t ba_stride, const void *conv_weight, void *conv_state,
                          float *recurrent, int64_t num_slots, const int64_t *rows, const int64_t *slots,
                          int64_t num_rows, int64_t num_tokens, const void *a_log, const void *dt_bias, const void *norm_weight,
                          int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, int64_t kernel, float eps,
                          int dtype, void *out, int64_t out_stride, int num_threads, int64_t *error);
int tuili_deltanet_chunks(const void *mixed, int64_t mixed_stride, const void *z, int64_t z_stride, const void *b,
                          const void *a, int64_t ba_stride, const void *conv_weight, void *conv_state,
                          float *recurrent, int64_t num_slots, const int64_t *firsts, const int64_t *counts,
                          const int64_t *slots, int64_t num_items, const int64_t *cut_starts,
                          const int64_t *cut_offsets, const int64_t *cut_rows, int64_t num_tokens,
                          const void *a_log, const void *dt_bias, const void *norm_weight, int64_t k_heads,
                          int64_t v_heads, int64_t dk, int64_t dv, int64_t kernel, float eps, int dtype, void *out,
                          int64_t out_stride, int num_threads, int64_t *error);
int tuili_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads);
int tuili_shm_arrive(int64_t *counters, int64_t stride, int64_t rank, int64_t seq);
int tuili_shm_wait(const int64_t *counters, int64_t stride, int64_t world, int64_t first, int64_t count, int64_t seq,
                   int64_t timeout_ns);
int tuili_shm_all_reduce(void *segment, int64_t stride, int64_t world, int64_t rank, int64_t header_bytes,
                         int64_t slot_bytes, int64_t *seq, int64_t *stats, void *x, int64_t numel, int dtype);

#endif
