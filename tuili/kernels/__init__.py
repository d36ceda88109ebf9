"""Native CPU kernels (C11 + OpenMP), compiled on first use; the torch code is the fallback.

Check `available()` before calling a kernel: it is False when no C compiler works, when the
build fails, or when `TUILI_NATIVE_KERNELS=0` is set, and `unavailable_reason()` says why.
Every kernel checks its tensors' dtype, shape, contiguity and device and raises ValueError
naming the bad argument; each runs on `torch.get_num_threads()` threads. docs/kernels.md has
the build, the cache and the measurements.

paged_attention(q, k_cache, v_cache, block_tables, seq_info, scale, out, k_scale=None, v_scale=None, split_keys=0)
    Causal attention of a flat batch of query rows over the paged KV cache, read in place
    through the block table (no gather, no K/V copy for grouped-query attention).

    q, out        [T, Hq, D] float32 or bfloat16 (out has q's dtype). Rows that belong to no
                  sequence are left untouched; out must not overlap q. out is contiguous; q's
                  tokens may lie any distance apart (a view into the fused qkv product) as long
                  as each token's heads are contiguous.
    k_cache,      [num_blocks, block_size, Hkv, D], float32, bfloat16 or float8_e4m3fn;
    v_cache       Hq must be a multiple of Hkv (query head h reads KV head h // (Hq // Hkv)).
    block_tables  [B, max_blocks] int32 or int64: sequence b's key at position p is in block
                  block_tables[b, p // block_size], offset p % block_size. Only the first
                  ceil(context / block_size) entries of a row are read.
    seq_info      [B, 3] int32 or int64: per sequence (first row in q, number of query rows n,
                  absolute position p0 of its first query). Its query i is row first + i at
                  position p0 + i and sees keys 0 .. p0 + i (a decode: n = 1, p0 = context - 1;
                  a prompt chunk continuing at position p0: n = chunk length).
    scale         the softmax scale (usually D ** -0.5).
    k_scale,      float32 [Hkv], required with a float8 cache and only then: stored values
    v_scale       are multiplied by their KV head's scale.

    split_keys    0: the keys of a (sequence, KV head) are split across threads when there are
                  too few sequences to occupy them (decode at batch 1), so a row's rounding
                  depends on the batch. > 0: they are split at fixed positions, every
                  split_keys keys (rounded up to 16), whatever the batch: a row's result then
                  depends only on its query, its keys and its position (batch invariance: a
                  decode, a continuing chunk and a prompt from position 0 agree bit for bit).

    Softmax and accumulation in float32 (online softmax). Agrees with torch's
    scaled_dot_product_attention on the gathered, dequantized cache to float32 rounding.

kv_store(k, v, k_cache, v_cache, slot_mapping)
    Token t's keys and values (k, v [T, Hkv, D], views into qkv allowed as for q above) written
    at slot slot_mapping[t] (int64) of the caches, which have k's dtype: a copy, no conversion.
    All slots are checked first; a bad one raises ValueError and writes nothing.

dequantize_int4_tiles(packed, scale_zero, first_tile, out)
    W^T of tiles first_tile .. first_tile + out.shape[1] // 64 - 1 of an Int4Linear
    (tuili/layers/quant.py): packed [N / 64, K, 32] uint8, scale_zero [K / group, N, 2]
    float32 or bfloat16, out [K, 64 * tiles] float32 or bfloat16, written as
    w = scale * (q - 8) + zero (float32 multiply, then add, then rounded to out's dtype), which
    is bit for bit `Int4Linear.dequantize()` (rounded to out's dtype) so that
    `torch.matmul(x, out)` is the tile's part of the layer's output.

dequantize_int8_group_tiles(packed, scales, first_tile, out)
    The same for an Int8GroupLinear (GGUF Q8_0: its codes as two int4 halves, packed
    [N / 64, 2K, 32], and its scales [K / group, N]): q = 16h + l - 128 rebuilt from the
    halves' nibbles, w = s * q.

linear_int4(x, packed, scale_zero, out, copies=1, exact=False)
    out = x @ W.T for 1..64 rows of x [M, K] (float32 or bfloat16), W an Int4Linear's packed
    weight read as stored (packed [N / 64, K, 32] uint8, scale_zero [K / group, N, 2]
    bfloat16); copies 2 reads an Int8GroupLinear's (GGUF Q8_0) instead: packed [N / 64, 2K, 32],
    its two nibble halves read as q = 16h + l - 128, and its scales [K / group, N] bfloat16;
    copies 3 an Int6GroupLinear's 6-bit codes (packed [N / 64, 3K / 2, 32]: a nibble plane and
    2-bit planes, q = 16h + l - 32) and its scales, only where `linear_int6_available()`
    (AVX512-VNNI and VBMI in the build) and not `exact`. out [M, n], n <= N (the padding rows
    are not written), float32 or bfloat16, its rows contiguous but possibly further apart (a
    column range of a wider output). Per group: scale * sum x (q - 8) + zero * sum x, float32
    sums, one rounding. On AVX512-VNNI CPUs x is first written per group as two int8 parts
    (integer dot products; error at most max |x| / 64516 per value) unless `exact`.
    Any number of rows up to 64; a row's result does not depend on the other rows.

linear_small(x, weight, bias, out)
    out = x @ weight.T + bias for a few rows of x (decode at batch 1..8), streaming the weight
    from memory once at close to the memory bandwidth (torch's bf16 F.linear at one row does not).

    x       [M, K] with 1 <= M <= 8, float32 or bfloat16.
    weight  [N, K] of x's dtype (row-major, as nn.Linear stores it).
    bias    [N] of x's dtype, or None.
    out     [M, N] of x's dtype; must not overlap x, weight or bias.

    Products and sums in float32 (bf16: AVX512-BF16's dot-product instruction where the CPU has
    it, which treats subnormal bf16 inputs as zero), the bias added in float32, then one rounding
    to out's dtype. Each thread reads its own static chunk of weight rows.

linear_rows(x, weight, bias, out)
    linear_small for any number of rows, each row's bits exactly what linear_small gives it
    alone (the batch-invariant mode's products on CPUs without AMX). Above 8 rows, tiles of
    weight rows that stay in L2, each against every row of x, so the weight streams from memory
    once per call (built without AVX-512, each tile widened to float32 once).

linear_amx(x, weight, bias, out)
    The same product in bfloat16 on Intel AMX tiles, for any number of rows: x [M, K] with K a
    multiple of 32, weight [N, K], bias [N] or None, out [M, N], all bfloat16. The weight is read
    as stored (a row-major weight is already an AMX A tile; x is repacked instead), once per
    128 rows of x. Float32 accumulation (AMX treats subnormal bf16 inputs as zero), bias added in
    float32, one rounding. Only where `amx_available()`: a CPU with AMX-BF16, a compiler that
    targets it, and an OS that grants the process the tile registers (Linux arch_prctl).

linear_packed(x, packed, bias, out, one_path=False)
pack_weight(weight), unpack_weight(packed)
    The same product with the weight packed once (pack_weight) into 16-row panels, the layout AMX
    reads as a B tile: [N / 16, K / 2, 16, 2], element [b, p, c, e] = weight[16 b + c, 2 p + e],
    N a multiple of 16, K of 32; any number of rows of x [M, K], all bfloat16 (out may be
    float32, then unrounded). Each panel of 16 weight rows is one contiguous stream. Up to 4 rows:
    AVX512-BF16 dot products on 16 outputs at a time; more: AMX tiles where the CPU grants them,
    else the same dot products as the GEMV in register blocks. A row's result does not depend on
    the other rows or on M within each path; without AMX there is one path, so not at all; with
    AMX, `one_path=True` runs the tiles from the first row (batch invariance). Only where
    `linear_packed_available()`: AVX512-BF16 or AMX in the build.

prompt_attention(q, k, v, scale, out)
    Causal attention of one prompt over itself (a prefill chunk from position 0) on AMX tiles,
    flash-attention style: q [T, Hq, D], k and v [T, Hkv, D], out [T, Hq, D], all bfloat16; q, k
    and v may be views into the qkv product (each token's heads contiguous), out is contiguous.
    D a multiple of 32 up to 256; query head h reads KV head h // (Hq // Hkv). Scores as float32
    sums of bf16 products, an online softmax in float32, the probabilities rounded to bf16 for
    the product with v (as torch's CPU flash attention does), float32 accumulation, one
    rounding. Only where `amx_available()`.

argmax_rows(x)
    Greedy decoding's pick (csrc/argmax.c): the first index of each float32 row's largest value,
    NaN read as -inf and +inf as the largest finite float, in one pass over the row.
rms_norm(x, weight, eps, out, residual=None)
qk_norm_rope(qkv, num_q_heads, q_weight, k_weight, cos, sin, eps, offset=False, q_step=1, q_out=None)
silu_mul(gate_up, out)
sigmoid_gate(x, gate)
    The elementwise work of a decoder layer, fused (csrc/elementwise.c): RMSNorm over rows of
    x [rows, dim], after adding x into `residual` when given; in place on qkv [T, Hq + 2 Hkv, D],
    per-head RMSNorm of q and k (Qwen3; skipped when the weights are None; Qwen3-Next's offset
    form, q heads interleaved with output gates, q written apart) and the rotary embedding of the
    first 2 * cos.shape[1] values (cos, sin float32 [T, rotary_dim / 2]); SiLU(gate) * up from
    gate_up [rows, 2 I]; x *= sigmoid(gate) per head (Qwen3-Next's attention output gate).
    float32 or bfloat16, rounding where tuili/layers' torch code rounds.
deltanet_decode(mixed, z, b, a, conv_weight, conv_state, recurrent, rows, slots, a_log, dt_bias,
                norm_weight, num_k_heads, eps, out)
    Gated DeltaNet's decode step in one call (csrc/deltanet.c): for each single-token row, the
    causal conv step, the gated delta rule on the sequence's float32 state slot (in place) and
    the gated RMSNorm, rounding where tuili/layers/deltanet.py rounds; each (row, head) computed
    alone in a fixed order, so a sequence's bits do not depend on the batch.
deltanet_chunks(mixed, z, b, a, conv_weight, conv_state, recurrent, chunks, cuts, a_log, dt_bias,
                norm_weight, num_k_heads, eps, out)
    The same arithmetic over prompt chunks, token after token (a chunk of n tokens is exactly n
    decode steps, so a prompt's bits do not depend on its split), with prefix-cache checkpoints
    of the state copied out inside a chunk.
"""

from tuili.kernels.cpu import (
    LINEAR_INT4_MAX_ROWS,
    LINEAR_SMALL_MAX_ROWS,
    amx_available,
    argmax_rows,
    available,
    deltanet_chunks,
    deltanet_decode,
    dequantize_int4_tiles,
    dequantize_int8_group_tiles,
    kv_store,
    linear_amx,
    linear_int4,
    linear_int6_available,
    linear_packed,
    linear_packed_available,
    linear_rows,
    linear_small,
    pack_weight,
    paged_attention,
    prompt_attention,
    qk_norm_rope,
    rms_norm,
    sigmoid_gate,
    silu_mul,
    unavailable_reason,
    unpack_weight,
)

__all__ = [
    "LINEAR_INT4_MAX_ROWS",
    "LINEAR_SMALL_MAX_ROWS",
    "amx_available",
    "argmax_rows",
    "available",
    "deltanet_chunks",
    "deltanet_decode",
    "dequantize_int4_tiles",
    "dequantize_int8_group_tiles",
    "kv_store",
    "linear_amx",
    "linear_int4",
    "linear_packed",
    "linear_int6_available",
    "linear_packed_available",
    "linear_rows",
    "linear_small",
    "pack_weight",
    "paged_attention",
    "prompt_attention",
    "qk_norm_rope",
    "rms_norm",
    "sigmoid_gate",
    "silu_mul",
    "unpack_weight",
    "unavailable_reason",
]
