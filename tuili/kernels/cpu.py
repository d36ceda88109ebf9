"""The torch-facing side of the C kernels in csrc/: availability, argument checks, calls.

tuili/kernels/__init__.py documents what each kernel computes; build.py how the library is
compiled and cached. If it cannot be built, or `TUILI_NATIVE_KERNELS=0` is set, `available()` is
False and `unavailable_reason()` says why (also logged once at INFO), so that callers keep their
torch code. Tensors are passed by address after their dtype, shape, contiguity and device are
checked here; the C code checks the values inside the index tensors. Each call runs on
`torch.get_num_threads()` OpenMP threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import os
import threading
from collections.abc import Iterator

import torch

from tuili.kernels import build
from tuili.kernels.layout import AMX_K_MULTIPLE, AMX_TILE_ROWS, INT4_TILE_ROWS

log = logging.getLogger(__name__)

# Element types as csrc/common.h numbers them.
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16)
_CACHE_DTYPES = tuple(_DTYPE_CODES)
_INDEX_DTYPES = (torch.int32, torch.int64)
LINEAR_SMALL_MAX_ROWS = 8  # MAX_M of csrc/linear_small.c
# Rows per call. The kernel takes any M (x's int8 forms cost ~8 bytes per input value and row);
# the batch-invariant mode runs prompts through it in blocks of this many, each block reading
# and unpacking the whole weight: with 64-row blocks a 512-token Q4_0 prompt spent 10% more in
# this kernel than with 256 (docs/kernels.md, Measured crossovers).
LINEAR_INT4_MAX_ROWS = 256
LINEAR_INT4_MAX_GROUP = 256  # inputs per group: 256 x 255 x 127 x 254 < 2^31 (csrc/linear_int4.c, VNNI)

# Error codes of csrc/common.h.
_BAD_SEQ_ROWS, _BAD_SEQ_POS, _TOO_FEW_BLOCKS, _BAD_BLOCK_ID, _NO_MEMORY, _NO_AMX = 1, 2, 3, 4, 5, 6
_BAD_SLOT = 8
SHM_COUNTER_STRIDE = 16  # int64s: one shared-memory counter per 128 bytes, so ranks never share a cache line
_PROMPT_ATTENTION_MAX_HEAD_DIM = 256  # MAX_HEAD_DIM of csrc/prompt_attention.c


# -- loading ---------------------------------------------------------------------------------------


def available() -> bool:
    """Whether the native kernels can run in this process (builds them on first call)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the native kernels cannot run, or None when they can."""
    if os.environ.get("TUILI_NATIVE_KERNELS", "1").strip() == "0":
        _log_disabled()
        return "disabled by TUILI_NATIVE_KERNELS=0"
    return _loaded().reason


@functools.cache
def _log_disabled() -> None:
    log.info("native CPU kernels disabled by TUILI_NATIVE_KERNELS=0; using the torch code")


@functools.cache
def _loaded() -> build.Build:
    """This process's one attempt to build and load the library. torch is imported by now (by
    this module), so the library's libgomp is torch's: one OpenMP thread pool for both."""
    loaded = build.load()
    if loaded.library is not None:
        _declare(loaded.library)
    return loaded


def _declare(library: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    library.tuili_paged_attention.argtypes = [
        p, i32, i64, i64, i64, i64,  # q, dtype, token stride, tokens, heads, head dim
        p, p, i32, i64, i64, i64,  # k/v cache, dtype, blocks, block size, kv heads
        p, p,  # k/v scales
        p, i32, i64, i64,  # block tables, is int64, sequences, max blocks
        p, i32,  # seq info, is int64
        f32, p, i64, i32, p,  # scale, out, fixed key split (0: none), threads, error
    ]  # fmt: skip
    library.tuili_paged_attention.restype = i32
    library.tuili_kv_store.argtypes = [
        p, p, i64, p, p, i64,  # k, v, their token stride in bytes, k/v cache, slots
        p, i64, i64, i32, p,  # slot mapping, tokens, row bytes, threads, error
    ]  # fmt: skip
    library.tuili_kv_store.restype = i32
    # packed, K, scales, their dtype, (int4: whether they are (scale, zero) pairs,) N, group, first
    # tile, tiles, out, its dtype, threads
    library.tuili_dequant_int4.argtypes = [p, i64, p, i32, i32, i64, i64, i64, i64, p, i32, i32]
    library.tuili_dequant_int8_group.argtypes = [p, i64, p, i32, i64, i64, i64, i64, p, i32, i32]
    for name in ("tuili_dequant_int4", "tuili_dequant_int8_group"):
        getattr(library, name).restype = i32
    for name in ("tuili_linear_small", "tuili_linear_rows"):
        function = getattr(library, name)
        function.argtypes = [
            p, p, p, p, i32, i32,  # x, weight, bias, out, dtype, out dtype
            i64, i64, i64, i32,  # M, N, K, threads
        ]  # fmt: skip
        function.restype = i32
    library.tuili_rms_norm.argtypes = [p, p, p, p, i64, i64, f32, i32, i32, i32]  # x, residual, weight, out, rows, dim, eps, offset
    library.tuili_qk_norm_rope.argtypes = [
        p, p, p, p, p,  # qkv, q weight, k weight, cos, sin
        i64, i64, i64, i64, i64, i64, i32, p,  # tokens, q heads, kv heads, head dim, rotary dim, q step, offset, q out
        f32, i32, i32,  # eps, dtype, threads
    ]  # fmt: skip
    library.tuili_sigmoid_gate.argtypes = [p, p, i64, i64, i64, i64, i64, i32, i32]  # x, gate, rows, heads, dim, strides
    library.tuili_silu_mul.argtypes = [p, p, i64, i64, i32, i32]  # gate_up, out, rows, inter, dtype, threads
    for name in ("tuili_rms_norm", "tuili_qk_norm_rope", "tuili_silu_mul", "tuili_sigmoid_gate"):
        getattr(library, name).restype = i32
    library.tuili_linear_int4.argtypes = [
        p, i32, p, p, p, i32,  # x, dtype, packed, scale_zero, out, out dtype
        i64, i64, i64, i64, i64, i64, i64, i32, i32, i32,  # M, K, copies, tiles, group, n out, out's row stride,
                                                           # exact, pairs, threads
    ]  # fmt: skip
    library.tuili_linear_int4.restype = i32
    library.tuili_deltanet_decode.argtypes = [
        p, i64, p, i64, p, p, i64,  # mixed, its row stride, z, its row stride, b, a, their row stride
        p, p, p, i64, p, p, i64, i64,  # conv weight, conv/recurrent state, slots held, rows, slots, decode rows, tokens
        p, p, p,  # A_log, dt_bias, norm weight
        i64, i64, i64, i64, i64, f32, i32, p, i64, i32, p,  # Hk, Hv, Dk, Dv, conv width, eps, dtype, out, its row stride, threads, error
    ]  # fmt: skip
    library.tuili_deltanet_decode.restype = i32
    library.tuili_deltanet_chunks.argtypes = [
        p, i64, p, i64, p, p, i64,  # mixed, its row stride, z, its row stride, b, a, their row stride
        p, p, p, i64, p, p, p, i64,  # conv weight, conv/recurrent state, slots held, firsts, counts, slots, items
        p, p, p, i64,  # cut starts, cut offsets, cut rows, tokens
        p, p, p,  # A_log, dt_bias, norm weight
        i64, i64, i64, i64, i64, f32, i32, p, i64, i32, p,  # Hk, Hv, Dk, Dv, conv width, eps, dtype, out, its row stride, threads, error
    ]  # fmt: skip
    library.tuili_deltanet_chunks.restype = i32
    library.tuili_argmax_rows.argtypes = [p, i64, i64, p, i32]  # x, rows, n, out, threads
    library.tuili_argmax_rows.restype = i32
    library.tuili_shm_arrive.argtypes = [p, i64, i64, i64]  # counters, their stride, rank, sequence number
    library.tuili_shm_arrive.restype = i32
    library.tuili_shm_wait.argtypes = [p, i64, i64, i64, i64, i64, i64]  # counters, stride, world, first, count, seq, timeout
    library.tuili_shm_wait.restype = i32
    library.tuili_shm_all_reduce.argtypes = [
        p, i64, i64, i64, i64, i64,  # segment, counter stride, world, rank, header bytes, slot bytes
        p, p, p, i64, i32,  # sequence number cell, stats (ns, calls), x, its elements, dtype
    ]  # fmt: skip
    library.tuili_shm_all_reduce.restype = i32
    library.tuili_amx_init.argtypes = []
    library.tuili_amx_init.restype = i32
    library.tuili_linear_amx.argtypes = [
        p, p, p, p, i32,  # x, weight, bias, out, out is float32
        i64, i64, i64, i32,  # M, N, K, threads
    ]  # fmt: skip
    library.tuili_linear_amx.restype = i32
    library.tuili_linear_packed.argtypes = [
        p, p, p, p, i32,  # x, packed weight, bias, out, out is float32
        i64, i64, i64, i32, i32,  # M, N, K, one path at every M, threads
    ]  # fmt: skip
    library.tuili_linear_packed_available.argtypes = []
    library.tuili_linear_packed_available.restype = i32
    library.tuili_linear_int6_available.argtypes = []
    library.tuili_linear_int6_available.restype = i32
    library.tuili_linear_packed.restype = i32
    library.tuili_prompt_attention.argtypes = [
        p, p, p, i64, i64,  # q, k, v, q's token stride, k's and v's token stride
        i64, i64, i64, i64, f32, p, i32,  # tokens, heads, KV heads, head dim, scale, out, threads
    ]  # fmt: skip
    library.tuili_prompt_attention.restype = i32
    library.tuili_graph_op.argtypes = [i32, ctypes.POINTER(i32)]
    library.tuili_graph_op.restype = ctypes.c_char_p
    library.tuili_graph_replay.argtypes = [p, i64, p]
    library.tuili_graph_replay.restype = i32


def _library() -> ctypes.CDLL:
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the native CPU kernels are unavailable ({reason}); check available() first")
    library = _loaded().library
    assert library is not None
    return library


class _Recording(threading.local):
    """The calls this thread makes while it captures a graph (tuili/kernels/graph.py), else None:
    per thread, so that another engine's steps on another thread are never recorded."""

    calls: list[tuple[str, tuple[object, ...]]] | None = None


_recording = _Recording()


def _call(name: str, *args: object) -> int:
    """Calls kernel `name` of the library with ctypes arguments; while this thread captures a
    graph, also records the call for replay."""
    status = getattr(_library(), name)(*args)
    if _recording.calls is not None:
        _recording.calls.append((name, args))
    return status


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, tuple[object, ...]]]]:
    """Within the block, every kernel call this thread makes is also appended, as (function
    name, ctypes arguments), to the list yielded. Not reentrant."""
    if _recording.calls is not None:
        raise RuntimeError("this thread is already recording kernel calls for a graph")
    _recording.calls = calls = []
    try:
        yield calls
    finally:
        _recording.calls = None


def is_recording() -> bool:
    """Whether this thread is recording kernel calls for a graph."""
    return _recording.calls is not None


# -- argument checks -----------------------------------------------------------------------------


def _check(
    name: str, value: object, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | int
) -> torch.Tensor:
    """`value` as a contiguous CPU tensor of one of `dtypes` whose shape is `shape` (an int: any
    shape with that many dimensions); otherwise a ValueError naming the argument. Runs several
    times per layer and step, so the common case is one short-circuited test."""
    if (
        isinstance(value, torch.Tensor)
        and value.dtype in dtypes
        and value.is_cpu
        and value.is_contiguous()
        and (value.dim() == shape if isinstance(shape, int) else value.shape == shape)
    ):
        return value
    raise ValueError(_problem(name, value, dtypes, shape))


def _check_token_rows(name: str, value: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """`value` as a CPU tensor [tokens, heads, head_dim] of one of `dtypes` whose tokens may lie any
    distance apart (a view into the fused qkv product) but each hold its heads x head_dim values
    contiguously; otherwise a ValueError naming the argument."""
    if isinstance(value, torch.Tensor) and value.dim() == 3 and value.dtype in dtypes and value.is_cpu:
        tokens, heads, head_dim = value.shape
        token_stride, head_stride, dim_stride = value.stride()
        if (
            (dim_stride == 1 or head_dim == 1)
            and (head_stride == head_dim or heads == 1)
            and (token_stride >= heads * head_dim or tokens == 1)
        ):
            return value
    return _check(name, value, dtypes, 3)  # raises: names what is wrong


def _check_rows(name: str, value: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """`value` as a CPU tensor [rows, n] of one of `dtypes` whose rows may lie any distance apart
    (at least n: a column range of a wider tensor) but each hold its n values contiguously;
    otherwise a ValueError naming the argument."""
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.dtype in dtypes and value.is_cpu:
        rows, n = value.shape
        row_stride, column_stride = value.stride()
        if (column_stride == 1 or n == 1) and (row_stride >= n or rows == 1):
            return value
    return _check(name, value, dtypes, 2)  # raises: names what is wrong


def _problem(name: str, value: object, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | int) -> str:
    """What is wrong with an argument that failed _check."""
    if not isinstance(value, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(value).__name__}"
    if value.dtype not in dtypes:
        return f"{name} has dtype {value.dtype}; expected {' or '.join(map(str, dtypes))}"
    if not value.is_cpu:
        return f"{name} is on {value.device}; the native kernels take CPU tensors only"
    if not value.is_contiguous():
        return f"{name} must be contiguous (its strides are {value.stride()})"
    expected = f"{shape} dimensions" if isinstance(shape, int) else list(shape)
    return f"{name} has shape {list(value.shape)}; expected {expected}"


# -- kernels -------------------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_info: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split_keys: int = 0,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its keys in the paged cache; writes
    and returns `out`. See tuili/kernels/__init__.py for the shapes and meaning."""
    if not isinstance(split_keys, int) or split_keys < 0:
        raise ValueError(f"split_keys={split_keys!r}; expected 0 (split as the threads need) or a positive key count")
    q = _check_token_rows("q", q, _FLOAT_DTYPES)
    tokens, heads, head_dim = q.shape
    k_cache = _check("k_cache", k_cache, _CACHE_DTYPES, 4)
    num_blocks, block_size, kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"k_cache has shape {list(k_cache.shape)}; expected [blocks, block size, KV heads, {head_dim}] "
            f"with KV heads dividing q's {heads} heads"
        )
    v_cache = _check("v_cache", v_cache, (k_cache.dtype,), k_cache.shape)
    block_tables = _check("block_tables", block_tables, _INDEX_DTYPES, 2)
    seqs, max_blocks = block_tables.shape
    seq_info = _check("seq_info", seq_info, _INDEX_DTYPES, (seqs, 3))
    out = _check("out", out, (q.dtype,), q.shape)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ValueError(
            "k_scale and v_scale (float32 [kv_heads]) are required with a float8_e4m3fn cache and "
            f"only then; the cache is {k_cache.dtype}, k_scale is {'given' if k_scale is not None else 'None'}, "
            f"v_scale is {'given' if v_scale is not None else 'None'}"
        )
    if fp8:
        k_scale = _check("k_scale", k_scale, (torch.float32,), (kv_heads,))
        v_scale = _check("v_scale", v_scale, (torch.float32,), (kv_heads,))
    error = (ctypes.c_int64 * 3)()
    status = _call(
        "tuili_paged_attention",
        q.data_ptr(), _DTYPE_CODES[q.dtype], q.stride(0), tokens, heads, head_dim,
        k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype], num_blocks, block_size, kv_heads,
        k_scale.data_ptr() if fp8 else None, v_scale.data_ptr() if fp8 else None,
        block_tables.data_ptr(), block_tables.dtype == torch.int64, seqs, max_blocks,
        seq_info.data_ptr(), seq_info.dtype == torch.int64,
        scale, out.data_ptr(), split_keys, torch.get_num_threads(), error,
    )  # fmt: skip
    if status != 0:
        _raise_attention_error(status, error[1], error[2], tokens, num_blocks, max_blocks)
    return out


def kv_store(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes token t's keys k[t] and values v[t] ([T, Hkv, D], rows possibly views into the fused
    qkv product, as for paged_attention's q) at slot slot_mapping[t] (int64 [T]) of the caches
    ([num_blocks, block_size, Hkv, D], the same dtype as k and v). A slot outside the cache raises
    ValueError and nothing is written."""
    k = _check_token_rows("k", k, _CACHE_DTYPES)
    tokens, kv_heads, head_dim = k.shape
    v = _check_token_rows("v", v, (k.dtype,))
    if v.shape != k.shape or v.stride(0) != k.stride(0):
        raise ValueError(
            f"v has shape {list(v.shape)} and token stride {v.stride(0)}; expected k's {list(k.shape)} and {k.stride(0)}"
        )
    k_cache = _check("k_cache", k_cache, (k.dtype,), 4)
    if k_cache.shape[2:] != (kv_heads, head_dim):
        raise ValueError(f"k_cache has shape {list(k_cache.shape)}; expected [blocks, block size, {kv_heads}, {head_dim}]")
    v_cache = _check("v_cache", v_cache, (k.dtype,), k_cache.shape)
    slot_mapping = _check("slot_mapping", slot_mapping, (torch.int64,), (tokens,))
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    error = (ctypes.c_int64 * 3)()
    element = k.element_size()
    status = _call(
        "tuili_kv_store",
        k.data_ptr(), v.data_ptr(), k.stride(0) * element, k_cache.data_ptr(), v_cache.data_ptr(), num_slots,
        slot_mapping.data_ptr(), tokens, kv_heads * head_dim * element, torch.get_num_threads(), error,
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"slot_mapping: token {error[1]} has slot {error[2]}, outside the cache's [0, {num_slots})")


def _raise_attention_error(
    status: int, seq: int, value: int, tokens: int, num_blocks: int, max_blocks: int
) -> None:
    if status == _BAD_SEQ_ROWS:
        raise ValueError(f"seq_info: sequence {seq}'s query rows end at row {value}, but q has {tokens} rows")
    if status == _BAD_SEQ_POS:
        raise ValueError(
            f"seq_info: sequence {seq} has the negative entry {value}; expected [first row, rows, first position] >= 0"
        )
    if status == _TOO_FEW_BLOCKS:
        raise ValueError(
            f"block_tables: sequence {seq}'s context needs {value} blocks, but the table has {max_blocks} columns"
        )
    if status == _BAD_BLOCK_ID:
        raise ValueError(
            f"block_tables: sequence {seq} refers to block {value}, outside the cache's [0, {num_blocks})"
        )
    if status == _NO_MEMORY:
        raise MemoryError("the paged attention kernel could not allocate its scratch memory")
    raise RuntimeError(f"the paged attention kernel failed with status {status}")


def dequantize_int4_tiles(
    packed: torch.Tensor, scale_zero: torch.Tensor, first_tile: int, out: torch.Tensor
) -> torch.Tensor:
    """W^T of Int4Linear's tiles first_tile .. first_tile + out.shape[1] // 64 - 1 into `out`
    ([K, 64 * tiles], float32 or bfloat16); returns `out`. `scale_zero` [K / group, N, 2], or
    [K / group, N] where the zeros are all 0 (the scales alone)."""
    return _dequantize("tuili_dequant_int4", packed, scale_zero, first_tile, out, halves=1)


def dequantize_int8_group_tiles(
    packed: torch.Tensor, scales: torch.Tensor, first_tile: int, out: torch.Tensor
) -> torch.Tensor:
    """W^T of Int8GroupLinear's tiles (a Q8_0 weight's codes as two int4 halves [N, 2K] and its
    scales [K / group, N], rebuilt into w = s * q) first_tile .. first_tile + out.shape[1] // 64 - 1
    into `out` ([K, 64 * tiles], float32 or bfloat16); returns `out`."""
    return _dequantize("tuili_dequant_int8_group", packed, scales, first_tile, out, halves=2)


def _dequantize(
    function: str,
    packed: torch.Tensor,
    scale_zero: torch.Tensor,
    first_tile: int,
    out: torch.Tensor,
    halves: int,
) -> torch.Tensor:
    """halves: 1 for Int4Linear, 2 for Int8GroupLinear (whose packed K holds two halves and
    `scale_zero` is its scales alone)."""
    packed, scale_zero, group_size = _int4_layout(packed, scale_zero, _FLOAT_DTYPES, halves)
    tiles, packed_k, _ = packed.shape
    layout = (int(scale_zero.dim() == 3),) if halves == 1 else ()  # int4: (scale, zero) pairs or scales
    k = packed_k // halves
    out = _check("out", out, _FLOAT_DTYPES, 2)
    if out.shape[0] != k or out.shape[1] % INT4_TILE_ROWS:
        raise ValueError(
            f"out has shape {list(out.shape)}; expected [{k}, a multiple of {INT4_TILE_ROWS}] (whole tiles)"
        )
    count = out.shape[1] // INT4_TILE_ROWS
    if not 0 <= first_tile <= tiles - count:
        raise ValueError(
            f"tiles {first_tile} .. {first_tile + count - 1} are outside the weight's {tiles} tiles"
        )
    _call(
        function,
        packed.data_ptr(), k, scale_zero.data_ptr(), _DTYPE_CODES[scale_zero.dtype], *layout, scale_zero.shape[1],
        group_size, first_tile, count, out.data_ptr(), _DTYPE_CODES[out.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return out


def _int4_layout(
    packed: object, scale_zero: object, scale_dtypes: tuple[torch.dtype, ...], halves: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Int4Linear's packed [tiles, K, 32] uint8 and scale_zero [groups, 64 tiles, 2] (or its
    scales alone, [groups, 64 tiles], where the zeros are all 0), or with halves 2
    Int8GroupLinear's packed [tiles, 2K, 32] (its two nibble halves) and scales [groups, 64 tiles],
    or with halves 3 Int6GroupLinear's packed [tiles, 3K / 2, 32] (a nibble plane and 2-bit
    planes) and scales; checked; with the group size K / groups."""
    packed = _check("packed", packed, (torch.uint8,), 3)
    tiles, packed_k, half_tile = packed.shape
    if half_tile != INT4_TILE_ROWS // 2:
        raise ValueError(f"packed has shape {list(packed.shape)}; expected [tiles, K, {INT4_TILE_ROWS // 2}]")
    alone = halves == 2 or (isinstance(scale_zero, torch.Tensor) and scale_zero.dim() == 2)
    name, per_row = ("scales", ()) if alone else ("scale_zero", (2,))
    scale_zero = _check(name, scale_zero, scale_dtypes, 2 + len(per_row))
    if scale_zero.shape[1:] != (tiles * INT4_TILE_ROWS, *per_row):
        expected = ", ".join(map(str, ["groups", tiles * INT4_TILE_ROWS, *per_row]))
        raise ValueError(
            f"{name} has shape {list(scale_zero.shape)}; expected [{expected}] for packed's {tiles} tiles"
        )
    # the group size is implied: K / groups
    groups = scale_zero.shape[0]
    k, rest = divmod(packed_k * 2, 3) if halves == 3 else divmod(packed_k, halves)
    if groups == 0 or rest or k % groups:
        raise ValueError(
            f"{name} has {groups} groups, which does not divide the packed weight's {k} inputs"
            + {1: "", 2: " (half of its rows: two nibble halves)", 3: " (two thirds of its rows: 6-bit codes)"}[halves]
        )
    return packed, scale_zero, k // groups


def linear_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale_zero: torch.Tensor,
    out: torch.Tensor,
    copies: int = 1,
    exact: bool = False,
) -> torch.Tensor:
    """out = x @ W.T for a few rows of x [M, K] (float32 or bfloat16) and an Int4Linear's packed
    weight (packed [N / 64, K, 32] uint8, scale_zero [K / group, N, 2] bfloat16, or its scales
    alone [K / group, N] where the zeros are all 0), read as stored; or with copies 2 an
    Int8GroupLinear's (packed [N / 64, 2K, 32], its two halves, q = 16h + l - 128; scale_zero
    its scales [K / group, N] bfloat16).
    out [M, n] float32 or bfloat16, n <= N: the first n output rows; its rows may lie further
    apart than n (a column range of a wider output), each contiguous. `exact`: float32 sums of x as
    given on every CPU (else AVX512-VNNI CPUs round x to int8 per group). Writes and returns `out`."""
    x = _check("x", x, _FLOAT_DTYPES, 2)
    rows, k = x.shape
    if not 1 <= rows <= LINEAR_INT4_MAX_ROWS:
        raise ValueError(f"x has {rows} rows; linear_int4 takes 1 to {LINEAR_INT4_MAX_ROWS}")
    if copies not in (1, 2, 3):
        raise ValueError(f"copies={copies!r}; expected 1 (int4), 2 (the halves of a Q8_0 weight) or 3 (6-bit codes)")
    if copies == 3 and (exact or not linear_int6_available()):
        raise ValueError("6-bit codes (copies 3) run only on the integer dots of AVX512-VNNI CPUs, not exact")
    packed, scale_zero, group_size = _int4_layout(packed, scale_zero, (torch.bfloat16,), copies)
    # The integer sums of a group must fit in int32; the kernels take k four at a time.
    if group_size > LINEAR_INT4_MAX_GROUP or group_size % 4:
        raise ValueError(
            f"groups of {group_size} inputs; linear_int4 takes groups of a multiple of 4 up to {LINEAR_INT4_MAX_GROUP}"
        )
    tiles, packed_k, _ = packed.shape
    if packed_k != (3 * k // 2 if copies == 3 else copies * k):
        raise ValueError(f"packed has {packed_k} inputs; expected {copies} x {k}{' / 2' * (copies == 3)} (x has {k} columns)")
    out = _check_rows("out", out, _FLOAT_DTYPES)
    if out.shape[0] != rows or not 0 < out.shape[1] <= tiles * INT4_TILE_ROWS:
        raise ValueError(f"out has shape {list(out.shape)}; expected [{rows}, 1 .. {tiles * INT4_TILE_ROWS}]")
    status = _call(
        "tuili_linear_int4",
        x.data_ptr(), _DTYPE_CODES[x.dtype], packed.data_ptr(), scale_zero.data_ptr(), out.data_ptr(),
        _DTYPE_CODES[out.dtype], rows, k, copies, tiles, group_size, out.shape[1], out.stride(0),
        int(bool(exact)), int(scale_zero.dim() == 3), torch.get_num_threads(),
    )  # fmt: skip
    if status == _NO_MEMORY:
        raise MemoryError(f"linear_int4 could not allocate a float32 copy of x ({rows} x {packed_k})")
    return out


def _linear_operands(
    x: torch.Tensor, weight: object, bias: object, out: object
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """weight [N, K], bias [N] or None and out [M, N], checked against an already checked x [M, K]:
    all of x's dtype (out may also be float32), contiguous, on the CPU."""
    rows, k = x.shape
    weight = _check("weight", weight, (x.dtype,), 2)
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has shape {list(weight.shape)}; expected [N, {k}] (x has {k} columns)")
    if bias is not None:
        bias = _check("bias", bias, (x.dtype,), (n,))
    return weight, bias, _check("out", out, (x.dtype, torch.float32), (rows, n))


def linear_small(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """out = x @ weight.T + bias for x [M, K] with 1 <= M <= 8, weight [N, K], bias [N] or None,
    out [M, N], all float32 or all bfloat16 (float32 accumulation; out may be float32 too, then
    unrounded); writes and returns `out`."""
    x = _check("x", x, _FLOAT_DTYPES, 2)
    rows, k = x.shape
    if not 1 <= rows <= LINEAR_SMALL_MAX_ROWS:
        raise ValueError(
            f"x has {rows} rows; linear_small takes 1 to {LINEAR_SMALL_MAX_ROWS} (use torch's matmul for more)"
        )
    weight, bias, out = _linear_operands(x, weight, bias, out)
    n = weight.shape[0]
    status = _call(
        "tuili_linear_small",
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        _DTYPE_CODES[x.dtype], _DTYPE_CODES[out.dtype], rows, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if status == _NO_MEMORY:  # only without AVX512-BF16: x widened to float32 first
        raise MemoryError("linear_small could not allocate a float32 copy of x")
    return out


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """linear_small for x [M, K] with any M >= 1: row i of out is bit for bit what linear_small
    gives row i alone. Same operands as linear_small; writes and returns `out`."""
    x = _check("x", x, _FLOAT_DTYPES, 2)
    rows, k = x.shape
    if rows < 1:
        raise ValueError("x has 0 rows; linear_rows takes 1 or more")
    weight, bias, out = _linear_operands(x, weight, bias, out)
    status = _call(
        "tuili_linear_rows",
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        _DTYPE_CODES[x.dtype], _DTYPE_CODES[out.dtype], rows, weight.shape[0], k, torch.get_num_threads(),
    )  # fmt: skip
    if status == _NO_MEMORY:  # x widened to float32 (without AVX512-BF16); the tiles' copies and sums
        raise MemoryError("linear_rows could not allocate its float32 copies of x and the weight's tiles")
    return out


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of one prompt over itself on AMX tiles, all bfloat16: q [T, Hq, D], k and
    v [T, Hkv, D] (views into the qkv product allowed; k and v with the same token stride), D a
    multiple of 32 up to 256, Hkv dividing Hq; writes and returns out [T, Hq, D] (contiguous).
    Check amx_available() first."""
    q = _check_token_rows("q", q, (torch.bfloat16,))
    tokens, heads, head_dim = q.shape
    k = _check_token_rows("k", k, (torch.bfloat16,))
    if k.shape[0] != tokens or k.shape[2] != head_dim or k.shape[1] == 0 or heads % k.shape[1]:
        raise ValueError(
            f"k has shape {list(k.shape)}; expected [{tokens}, KV heads, {head_dim}] with KV heads dividing {heads}"
        )
    v = _check_token_rows("v", v, (torch.bfloat16,))
    if v.shape != k.shape or (tokens > 1 and v.stride(0) != k.stride(0)):
        raise ValueError(f"v has shape {list(v.shape)} and strides {v.stride()}; expected k's, {list(k.shape)} and {k.stride()}")
    if head_dim % AMX_K_MULTIPLE or head_dim > _PROMPT_ATTENTION_MAX_HEAD_DIM:
        raise ValueError(
            f"prompt_attention takes a head dim that is a multiple of {AMX_K_MULTIPLE} up to "
            f"{_PROMPT_ATTENTION_MAX_HEAD_DIM}, got {head_dim}"
        )
    if not scale > 0:  # the kernel scales each row's largest score, not every score, for its max
        raise ValueError(f"scale must be positive, got {scale!r}")
    out = _check("out", out, (torch.bfloat16,), q.shape)
    if tokens == 0:
        return out
    status = _call(
        "tuili_prompt_attention",
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0),
        tokens, heads, k.shape[1], head_dim, scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _check_amx_status(status, f"the repacked keys and values ({tokens} tokens)")
    return out


def amx_available() -> bool:
    """Whether linear_amx can run: the kernels are available, this build has the AMX code (the
    compiler targeted a CPU with AMX-BF16) and the OS lets this process use the tile registers."""
    return available() and _amx_granted()


def linear_int6_available() -> bool:
    """Whether linear_int4 reads 6-bit codes (copies 3): the kernels are available and this build
    has AVX512-VNNI and VBMI (the integer dots, whose unpacking alone knows the 2-bit planes)."""
    return available() and _int6_built()


@functools.cache
def _int6_built() -> bool:
    return _library().tuili_linear_int6_available() == 1


def linear_packed_available() -> bool:
    """Whether linear_packed can run: the kernels are available and this build has AVX512-BF16
    (its GEMV and dot products) or AMX."""
    return available() and _packed_built()


@functools.cache
def _packed_built() -> bool:
    return _library().tuili_linear_packed_available() == 1


@functools.cache
def _amx_granted() -> bool:
    """The build's and the OS's answer, asked once per process (available() may change with the
    environment; this does not)."""
    return _library().tuili_amx_init() == 0


def linear_amx(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = x @ weight.T + bias for any number of rows of x [M, K] (K a multiple of 32), weight
    [N, K], bias [N] or None, out [M, N], all bfloat16 (float32 accumulation on AMX tiles; out
    may be float32 too, then unrounded); writes and returns `out`. Check amx_available() first."""
    x = _check_amx_x("linear_amx", x)
    weight, bias, out = _linear_operands(x, weight, bias, out)
    rows, k = x.shape
    if rows == 0:
        return out
    return _amx_product("tuili_linear_amx", x, weight, bias, out, f"the repacked copy of x ({rows} x {k})")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (N a multiple of 16, K of 32) in linear_packed's layout: [N / 16, K / 2,
    16, 2], element [b, p, c, e] = weight[16 b + c, 2 p + e]. A new tensor; the same bytes."""
    n, k = weight.shape
    if n % AMX_TILE_ROWS or k % AMX_K_MULTIPLE:
        raise ValueError(
            f"weight has shape {[n, k]}; packing takes N a multiple of {AMX_TILE_ROWS} and K of {AMX_K_MULTIPLE}"
        )
    return weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """pack_weight's inverse: the row-major [N, K] weight (a new tensor)."""
    panels, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(panels * 16, pairs * 2)


def linear_packed(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, one_path: bool = False
) -> torch.Tensor:
    """out = x @ W.T + bias for any number of rows of x [M, K], W given packed by pack_weight
    ([N / 16, K / 2, 16, 2]), bias [N] or None, out [M, N], all bfloat16 (out may be float32,
    then unrounded); writes and returns `out`. `one_path`: the same arithmetic at every M (AMX
    tiles from the first row where the CPU has them), so that a row's bits never depend on M.
    Check linear_packed_available() first."""
    x = _check_amx_x("linear_packed", x)
    rows, k = x.shape
    packed = _check("packed", packed, (torch.bfloat16,), 4)
    if tuple(packed.shape[1:]) != (k // 2, 16, 2):
        raise ValueError(f"packed has shape {list(packed.shape)}; expected [N / 16, {k // 2}, 16, 2] (x has {k} columns)")
    n = packed.shape[0] * 16
    if bias is not None:
        bias = _check("bias", bias, (torch.bfloat16,), (n,))
    out = _check("out", out, (torch.bfloat16, torch.float32), (rows, n))
    return _amx_product(
        "tuili_linear_packed", x, packed, bias, out, f"a padded copy of x's last rows (16 x {k})", (bool(one_path),)
    )


def _check_amx_x(kernel: str, x: torch.Tensor) -> torch.Tensor:
    """x for an AMX product: bf16 [M, K] with K a multiple of one tile's 32 values."""
    x = _check("x", x, (torch.bfloat16,), 2)
    if x.shape[1] % AMX_K_MULTIPLE:
        raise ValueError(f"x has {x.shape[1]} columns; {kernel} takes a multiple of {AMX_K_MULTIPLE}")
    return x


def _amx_product(
    kernel: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    scratch: str,
    options: tuple[int, ...] = (),
) -> torch.Tensor:
    """Runs an AMX linear on checked operands (`weight` in the kernel's layout, out [M, N], the
    kernel's own `options` before the thread count); its errors raised, naming the `scratch` it
    allocates."""
    rows, n = out.shape
    status = _call(
        kernel, x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        out.dtype == torch.float32, rows, n, x.shape[1], *options, torch.get_num_threads(),
    )  # fmt: skip
    _check_amx_status(status, scratch)
    return out


def _check_amx_status(status: int, repacked: str) -> None:
    """The errors an AMX kernel returns, raised: it could not allocate `repacked`, or the process
    may not use the tiles."""
    if status == _NO_MEMORY:
        raise MemoryError(f"could not allocate {repacked}")
    if status == _NO_AMX:
        raise RuntimeError(
            "this build has neither AMX tiles this process may use nor AVX512-BF16; check amx_available() "
            "(linear_amx) or linear_packed_available() (linear_packed) first"
        )


_MAX_NORM_DIM = 16384  # MAX_DIM of csrc/elementwise.c
_MAX_DELTANET_HEAD_DIM = 1024  # MAX_HEAD_DIM of csrc/deltanet.c


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, residual: torch.Tensor | None = None,
    offset: bool = False,
) -> torch.Tensor:
    """out = weight * round(x * rsqrt(mean(x^2) + eps)) row by row over the last dimension of
    x [rows, dim]; with `offset` (weights stored centred on zero, Qwen3-Next's norms),
    out = round(x * rsqrt(mean(x^2) + eps) * (1 + weight)) with one rounding. With `residual`
    ([rows, dim]), x + residual (rounded) is normalized instead and also written to residual. All
    float32 or all bfloat16; writes and returns `out`."""
    x = _check("x", x, _FLOAT_DTYPES, 2)
    rows, dim = x.shape
    if dim > _MAX_NORM_DIM:
        raise ValueError(f"x has rows of {dim} values; rms_norm takes at most {_MAX_NORM_DIM}")
    weight = _check("weight", weight, (x.dtype,), (dim,))
    out = _check("out", out, (x.dtype,), x.shape)
    if residual is not None:
        residual = _check("residual", residual, (x.dtype,), x.shape)
    _call(
        "tuili_rms_norm",
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        rows, dim, eps, int(offset), _DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return out


def qk_norm_rope(
    qkv: torch.Tensor,
    num_q_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    offset: bool = False,
    q_step: int = 1,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """On qkv [tokens, num_q_heads * q_step + 2 * kv_heads, head_dim] (float32 or bfloat16): each
    q head (every q_step-th head from the first; the heads between, Qwen3-Next's output gates, are
    left alone) and each k head after them RMS-normalized with q_weight / k_weight ([head_dim], or
    both None for none; `offset` as in rms_norm), then its first rotary_dim = 2 * cos.shape[1]
    values rotated by cos / sin (float32 [tokens, rotary_dim / 2], rotate-half layout); v untouched.
    k in place; q in place, or written to q_out [tokens, num_q_heads, head_dim] when given. Returns
    qkv."""
    qkv = _check("qkv", qkv, _FLOAT_DTYPES, 3)
    tokens, heads, head_dim = qkv.shape
    kv_heads = (heads - num_q_heads * q_step) // 2
    if num_q_heads < 1 or q_step < 1 or kv_heads < 1 or num_q_heads * q_step + 2 * kv_heads != heads:
        raise ValueError(
            f"qkv has {heads} heads; expected {num_q_heads} q heads every {q_step} and two equal groups of k and v heads"
        )
    if head_dim % 2 or head_dim > _MAX_NORM_DIM:
        raise ValueError(f"qkv has heads of {head_dim} values; expected an even number up to {_MAX_NORM_DIM}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight are given together or not at all")
    if q_weight is not None:
        q_weight = _check("q_weight", q_weight, (qkv.dtype,), (head_dim,))
        k_weight = _check("k_weight", k_weight, (qkv.dtype,), (head_dim,))
    cos = _check("cos", cos, (torch.float32,), 2)
    half = cos.shape[1]
    if cos.shape[0] != tokens or not 0 < half <= head_dim // 2:
        raise ValueError(f"cos has shape {list(cos.shape)}; expected [{tokens}, rotary_dim / 2 <= {head_dim // 2}]")
    sin = _check("sin", sin, (torch.float32,), cos.shape)
    if q_out is not None:
        q_out = _check("q_out", q_out, (qkv.dtype,), (tokens, num_q_heads, head_dim))
    _call(
        "tuili_qk_norm_rope",
        qkv.data_ptr(), None if q_weight is None else q_weight.data_ptr(),
        None if k_weight is None else k_weight.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        tokens, num_q_heads, kv_heads, head_dim, 2 * half, q_step, int(offset),
        None if q_out is None else q_out.data_ptr(), eps, _DTYPE_CODES[qkv.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return qkv


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] *= sigmoid(gate) in place, the sigmoid rounded to x's dtype and so
    the product (float32 or bfloat16): Qwen3-Next's gated attention output. gate [rows, heads,
    head_dim] may be a view whose rows and heads lie any distance apart (the per-head gates
    interleaved with q in the fused projection's output). Returns x."""
    x = _check("x", x, _FLOAT_DTYPES, 3)
    rows, heads, head_dim = x.shape
    if not (isinstance(gate, torch.Tensor) and gate.dtype == x.dtype and gate.is_cpu and gate.shape == x.shape
            and gate.stride(2) == 1):  # fmt: skip
        got = f"{gate.dtype} {list(gate.shape)} strides {gate.stride()}" if isinstance(gate, torch.Tensor) else gate
        raise ValueError(f"gate must be a CPU {x.dtype} tensor {list(x.shape)} with each head's values contiguous; "
                         f"got {got}")  # fmt: skip
    if head_dim > _MAX_NORM_DIM:
        raise ValueError(f"x has heads of {head_dim} values; sigmoid_gate takes at most {_MAX_NORM_DIM}")
    _call(
        "tuili_sigmoid_gate", x.data_ptr(), gate.data_ptr(), rows, heads, head_dim, gate.stride(0), gate.stride(1),
        _DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return x


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [rows, inter] = round(silu(gate)) * up for gate_up [rows, 2 * inter] holding gate then
    up, float32 or bfloat16; writes and returns `out`."""
    gate_up = _check("gate_up", gate_up, _FLOAT_DTYPES, 2)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has {width} columns; expected gate and up of equal width")
    out = _check("out", out, (gate_up.dtype,), (rows, width // 2))
    _call(
        "tuili_silu_mul",
        gate_up.data_ptr(), out.data_ptr(), rows, width // 2, _DTYPE_CODES[gate_up.dtype], torch.get_num_threads()
    )
    return out


def _check_rows_view(name: str, value: object, dtype: torch.dtype, width: int) -> torch.Tensor:
    """`value` as a CPU tensor [rows, width] of `dtype` whose rows may lie any distance apart (a
    view into a fused projection's output) but whose values within a row are contiguous."""
    if (
        isinstance(value, torch.Tensor) and value.dtype == dtype and value.is_cpu and value.dim() == 2
        and value.shape[1] == width and (value.stride(1) == 1 or width == 1) and value.stride(0) >= width
    ):  # fmt: skip
        return value
    raise ValueError(
        f"{name} must be a CPU {dtype} tensor of rows of {width} contiguous values; got "
        + (f"{value.dtype} {list(value.shape)} with strides {value.stride()}" if isinstance(value, torch.Tensor)
           else type(value).__name__)
    )  # fmt: skip


def deltanet_decode(
    mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
    conv_state: torch.Tensor, recurrent: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, num_k_heads: int, eps: float,
    out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Gated DeltaNet's decode step (csrc/deltanet.c) for the single-token rows `rows` (int64 [D])
    of a step, sequence d's state in slot slots[d] (int64 [D]): the conv over mixed [T, C] (q, k,
    v channels; C = 2 Hk Dk + Hv Dv), the gated delta rule on recurrent [S, Hv, Dk, Dv] (float32,
    in place) and conv_state [S, C, K-1] (in place), the gated RMSNorm with z [T, Hv * Dv]; writes
    rows `rows` of out [T, Hv * Dv] and leaves the others. b and a [T, Hv] are the write-strength
    and decay inputs. mixed, z, b, a may be views with a row stride. Everything but the float32
    state has mixed's dtype (float32 or bfloat16); conv_weight is [C, 1, K] or [C, K], A_log and
    dt_bias [Hv], norm_weight [Dv]. A row outside the inputs or a slot outside the state raises
    ValueError and nothing is written. Returns out."""
    rows = _check("rows", rows, (torch.int64,), 1)
    slots = _check("slots", slots, (torch.int64,), rows.shape)
    return _deltanet(
        "tuili_deltanet_decode", mixed, z, b, a, conv_weight, conv_state, recurrent, a_log, dt_bias, norm_weight,
        num_k_heads, eps, out, (rows.data_ptr(), slots.data_ptr(), rows.numel()), "decode row",
    )  # fmt: skip


def deltanet_chunks(
    mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
    conv_state: torch.Tensor, recurrent: torch.Tensor, chunks: list[tuple[int, int, int]],
    cuts: list[list[tuple[int, int]]], a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
    num_k_heads: int, eps: float, out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """deltanet_decode's arithmetic over prompt chunks, token after token (csrc/deltanet.c): chunk
    i = chunks[i] = (first row, tokens, slot) is that many consecutive rows of one sequence, its
    state in `slot`; cuts[i] lists (tokens into the chunk, row) pairs, increasing: the state after
    that many tokens (0 .. tokens) is copied to that row of conv_state and recurrent (a prefix-cache
    checkpoint). Each token gets exactly the bits a decode step would give it. Other arguments and
    checks as deltanet_decode. Returns out."""
    if len(cuts) != len(chunks):
        raise ValueError(f"{len(cuts)} lists of cuts for {len(chunks)} chunks; expected one per chunk")
    firsts, counts, slots = (torch.tensor([c[i] for c in chunks], dtype=torch.int64) for i in range(3))
    starts = torch.tensor([0, *itertools.accumulate(len(c) for c in cuts)], dtype=torch.int64)
    offsets = torch.tensor([o for c in cuts for o, _ in c], dtype=torch.int64)
    cut_rows = torch.tensor([r for c in cuts for _, r in c], dtype=torch.int64)
    items = (firsts.data_ptr(), counts.data_ptr(), slots.data_ptr(), len(chunks), starts.data_ptr(),
             offsets.data_ptr(), cut_rows.data_ptr())  # fmt: skip
    return _deltanet(
        "tuili_deltanet_chunks", mixed, z, b, a, conv_weight, conv_state, recurrent, a_log, dt_bias, norm_weight,
        num_k_heads, eps, out, items, "chunk",
    )  # fmt: skip


def _deltanet(
    function: str, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
    conv_weight: torch.Tensor, conv_state: torch.Tensor, recurrent: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, norm_weight: torch.Tensor, num_k_heads: int, eps: float, out: torch.Tensor,
    items: tuple[int, ...], item: str,
) -> torch.Tensor:  # fmt: skip
    """The checks and the call shared by deltanet_decode and deltanet_chunks; `items` are the
    function's item arguments (pointers and counts), `item` names one in errors."""
    slots_held, v_heads, dk, dv = _check("recurrent", recurrent, (torch.float32,), 4).shape
    dtype = mixed.dtype if isinstance(mixed, torch.Tensor) and mixed.dtype in _FLOAT_DTYPES else torch.float32
    conv_state = _check("conv_state", conv_state, (dtype,), 3)
    channels, kernel = conv_state.shape[1], conv_state.shape[2] + 1
    mixed = _check_rows_view("mixed", mixed, dtype, channels)
    key_dim = (channels - v_heads * dv) // 2
    if num_k_heads < 1 or v_heads % num_k_heads or key_dim != num_k_heads * dk:
        raise ValueError(
            f"conv_state has {channels} channels and recurrent {v_heads} value heads of [{dk}, {dv}]; expected "
            f"2 x {num_k_heads} key heads x {dk} + {v_heads} x {dv} channels, Hv a multiple of Hk"
        )
    if max(dk, dv) > _MAX_DELTANET_HEAD_DIM:
        raise ValueError(f"heads of [{dk}, {dv}]; the DeltaNet kernels take at most {_MAX_DELTANET_HEAD_DIM}")
    if conv_state.shape[0] != slots_held:
        raise ValueError(f"conv_state has {conv_state.shape[0]} slots; recurrent has {slots_held}")
    conv_weight = _check("conv_weight", conv_weight.reshape(channels, -1) if isinstance(conv_weight, torch.Tensor)
                         else conv_weight, (dtype,), (channels, kernel))  # fmt: skip
    z = _check_rows_view("z", z, dtype, v_heads * dv)
    b, a = _check_rows_view("b", b, dtype, v_heads), _check_rows_view("a", a, dtype, v_heads)
    if b.stride(0) != a.stride(0):
        raise ValueError(f"b and a have row strides {b.stride(0)} and {a.stride(0)}; expected one stride")
    a_log, dt_bias = _check("a_log", a_log, (dtype,), (v_heads,)), _check("dt_bias", dt_bias, (dtype,), (v_heads,))
    norm_weight = _check("norm_weight", norm_weight, (dtype,), (dv,))
    out = _check_rows_view("out", out, dtype, v_heads * dv)
    tokens = min(t.shape[0] for t in (mixed, z, b, a, out))
    error = (ctypes.c_int64 * 3)()
    status = _call(
        function,
        mixed.data_ptr(), mixed.stride(0), z.data_ptr(), z.stride(0), b.data_ptr(), a.data_ptr(), b.stride(0),
        conv_weight.data_ptr(), conv_state.data_ptr(), recurrent.data_ptr(), slots_held, *items, tokens,
        a_log.data_ptr(), dt_bias.data_ptr(), norm_weight.data_ptr(),
        num_k_heads, v_heads, dk, dv, kernel, eps, _DTYPE_CODES[dtype], out.data_ptr(), out.stride(0),
        torch.get_num_threads(), error,
    )  # fmt: skip
    if status == _BAD_SEQ_ROWS:
        raise ValueError(f"{item} {error[1]} starts at row {error[2]}: its rows are not all in the inputs' [0, {tokens})")
    if status == _BAD_SLOT:
        raise ValueError(
            f"{item} {error[1]} names state row {error[2]} (slot or cut), outside the state's [0, {slots_held}), "
            "or a cut outside the chunk or out of order"
        )
    if status == _NO_MEMORY:
        raise MemoryError("the DeltaNet kernel could not allocate its scratch memory")
    if status != 0:
        raise RuntimeError(f"the DeltaNet kernel failed with status {status}")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value for x [rows, n] float32, as int64 [rows]: the first
    one on ties, NaN read as -inf and +inf as the largest finite float (what the sampler's
    nan_to_num leaves), 0 for a row with nothing above -inf."""
    x = _check("x", x, (torch.float32,), 2)
    rows, n = x.shape
    out = torch.zeros(rows, dtype=torch.int64)
    if n:
        _call("tuili_argmax_rows", x.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
    return out



def shm_arrive(counters: torch.Tensor, rank: int, seq: int) -> None:
    """Raise rank `rank`'s counter to `seq` after every write this thread made before (a release
    store). counters: int64 [world + 1, stride] at the start of a shared segment, the last row's
    first word the group's abort flag (tuili/parallel/shm.py)."""
    _check_counters(counters, rank)
    _library().tuili_shm_arrive(counters.data_ptr(), counters.stride(0), rank, seq)


def shm_wait(counters: torch.Tensor, first: int, count: int, seq: int, timeout_s: float) -> bool | None:
    """Whether the counters of ranks first .. first + count - 1 all reached `seq` within
    `timeout_s` seconds (0: look once); None if the group was aborted. Once True, their writes
    before arriving are visible here. Spins, then yields the core between looks; the GIL is
    released while it waits."""
    _check_counters(counters, first + count - 1)
    status = _library().tuili_shm_wait(counters.data_ptr(), counters.stride(0), counters.shape[0] - 1, first, count,
                                       seq, int(timeout_s * 1e9))
    return None if status < 0 else bool(status)


def shm_all_reduce(segment: torch.Tensor, world: int, rank: int, header_bytes: int, slot_bytes: int,
                   seq: torch.Tensor, stats: torch.Tensor, x: torch.Tensor) -> bool:
    """x (contiguous float32 or bfloat16) summed over the ranks in place through `segment`, in
    exchanges numbered on from seq[0] (int64 [1], moved on); False if the group was aborted.
    Every rank adds in rank order in float32 and rounds once: all hold the same bits. stats
    (int64 [2]) gains the nanoseconds spent and one call. A CPU graph may record it."""
    x = _check("x", x, _FLOAT_DTYPES, x.dim())
    segment = _check("segment", segment, (torch.uint8,), 1)
    if segment.numel() < header_bytes + 2 * world * slot_bytes or not 0 <= rank < world:
        raise ValueError(f"a segment of {segment.numel()} bytes does not hold rank {rank} of {world}'s slots")
    seq = _check("seq", seq, (torch.int64,), (1,))
    stats = _check("stats", stats, (torch.int64,), (2,))
    status = _call("tuili_shm_all_reduce", segment.data_ptr(), SHM_COUNTER_STRIDE, world, rank, header_bytes, slot_bytes,
                   seq.data_ptr(), stats.data_ptr(), x.data_ptr(), x.numel(), _DTYPE_CODES[x.dtype])
    return status == 0




def _check_counters(counters: torch.Tensor, rank: int) -> None:
    # Only shm_all_reduce may be captured in a CPU graph (it numbers its exchanges itself);
    # these calls belong to the Python side of an exchange, which a replay would skip.
    if _recording.calls is not None:
        raise RuntimeError("a shared-memory exchange driven from Python cannot be captured in a CPU graph")
    _check("counters", counters, (torch.int64,), (counters.shape[0], SHM_COUNTER_STRIDE))
    if not 0 <= rank < counters.shape[0] - 1:
        raise ValueError(f"rank {rank} is outside the {counters.shape[0] - 1} ranks' counters")
