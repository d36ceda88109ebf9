"""How big the KV pool is: blocks on the device, blocks of the host tier, and the longest
sequence they let the engine accept.

One pure function of the model's shape and the engine's knobs, decided once before the pool
is allocated; the runner allocates what the plan says and the block manager hands it out.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tuili.config import KV_CACHE_DTYPES, EngineConfig, ModelConfig, SpeculativeConfig
from tuili.errors import TuiliError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolPlan:
    """The KV pool's shape. Invariant: num_blocks * block_size >= max_model_len, so that any
    request the engine accepts can finish."""

    num_blocks: int
    block_size: int  # tokens per block
    num_host_blocks: int  # the prefix cache's host tier; 0 = off
    kv_dtype: torch.dtype
    max_model_len: int  # after capping at what the pool holds
    bytes_per_block: int  # keys and values of every full-attention layer for block_size tokens
    # Hybrid models: per-sequence linear-attention state slots, reserved from the same budget;
    # at most this many sequences run at once. 0 for models without linear attention.
    num_state_slots: int = 0
    state_bytes_per_slot: int = 0
    # Hybrid models with prefix caching: checkpoints of the linear-attention state at block
    # boundaries (tuili/engine/state_checkpoints.py), state_bytes_per_slot each, from the same budget.
    num_state_checkpoints: int = 0
    # ... and their host tier, from kv_offload_memory: checkpoints spilled when the device's are
    # evicted, copied back on a hit (as the KV blocks of the host tier).
    num_host_checkpoints: int = 0
    # Hybrid models with speculative decoding: per state slot, this many more rows (the most
    # proposals a step verifies), for the state after each proposed position of a verification
    # chunk, so that a rejection leaves the slot at the last accepted one (docs/engine.md).
    verify_rows_per_slot: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for `block_size` tokens, stored in `dtype` (an fp8 cache's
    per-head scales are a few bytes per layer, not per block)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_attention_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element


def state_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One sequence's state in every linear-attention layer: the conv's last K-1 inputs in the
    working `dtype` and the float32 recurrent state [Hv, Dk, Dv]. 0 without linear attention."""
    lin = cfg.linear
    if lin is None:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    conv = lin.conv_dim * (lin.conv_kernel - 1) * element
    recurrent = lin.num_v_heads * lin.head_k_dim * lin.head_v_dim * 4
    return cfg.num_linear_layers * (conv + recurrent)


CHECKPOINT_SHARE = 0.25  # of the KV budget, at most, for a hybrid model's state checkpoints


def state_checkpoint_count(budget: int, block_bytes: int, slot_bytes: int, interval_blocks: int) -> int:
    """How many state checkpoints a hybrid model's prefix cache gets from a budget of `budget`
    bytes: CHECKPOINT_SHARE of it, and no more than one per `interval_blocks` KV blocks the
    whole budget would hold (more could never all sit on cached prefixes). `tuili plan` counts
    the same bytes."""
    share = int(budget * CHECKPOINT_SHARE) // slot_bytes
    return min(share, -(-budget // (block_bytes * interval_blocks)))


_ACTIVATION_RESERVE = 1 << 30  # GPU memory left beside the KV pool for activations


def default_kv_cache_memory(device: torch.device, utilization: float | None = None) -> int:
    """The KV budget when kv_cache_memory is not given. On a GPU, `utilization` (default 0.9)
    of the memory still free after the weights, less a reserve of 1 GiB for activations. On a
    CPU, `utilization` of the RAM available now (MemAvailable) when it is given, else 2 GiB
    (ample for the small models CPU serving targets; set kv_cache_memory for more)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(int(free * (0.9 if utilization is None else utilization)) - _ACTIVATION_RESERVE, 0)
    if utilization is None:
        return 2 << 30
    return int(available_ram() * utilization)


def available_ram() -> int:
    """Bytes of RAM the kernel says can be had without swapping (MemAvailable), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_pool(model: ModelConfig, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> PoolPlan:
    """Size the pool from `config.kv_cache_memory` (else the device's default) in the KV dtype
    (`config.kv_cache_dtype`, else the working `dtype`). An unset max_model_len is the model's,
    capped (and logged) at what the pool holds; a set one the pool cannot hold is an error.
    Call after the weights are loaded: a GPU's default budget is what they left free."""
    kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or dtype
    block_bytes = kv_bytes_per_block(model, config.block_size, kv_dtype)
    slot_bytes = state_bytes_per_slot(model, dtype)
    spec = config.speculative_config
    verify_rows = spec.num_speculative_tokens if slot_bytes and isinstance(spec, SpeculativeConfig) else 0
    sequence_bytes = slot_bytes * (1 + verify_rows)  # a slot and its verification rows
    max_len = config.max_model_len or model.max_position_embeddings
    budget = config.kv_cache_memory or default_kv_cache_memory(device, config.gpu_memory_utilization)
    if config.kv_cache_memory is None and config.gpu_memory_utilization is None and device.type != "cuda":
        # The CPU's fixed default never takes more than twice what max_num_seqs sequences at
        # full length hold (the second half for the prefix cache and state checkpoints): a
        # model with little KV per token would otherwise zero gigabytes of RAM it never uses.
        per_sequence = -(-max_len // config.block_size) * block_bytes + sequence_bytes
        budget = min(budget, 2 * config.max_num_seqs * per_sequence)
    num_slots = num_checkpoints = 0
    if slot_bytes:
        total = budget
        num_slots = _state_slots(model, config, budget, block_bytes, sequence_bytes)
        budget -= num_slots * sequence_bytes
        if config.enable_prefix_caching:
            # After the slots (a cache never costs concurrency), and above the KV blocks' floor.
            if config.max_model_len is not None:
                kv_floor = -(-config.max_model_len // config.block_size) * block_bytes
            else:
                kv_floor = budget // 2
            num_checkpoints = min(
                state_checkpoint_count(total, block_bytes, slot_bytes, config.state_checkpoint_interval),
                max(0, (budget - kv_floor) // slot_bytes),
            )
            budget -= num_checkpoints * slot_bytes
    num_blocks = budget // block_bytes
    pool_tokens = num_blocks * config.block_size
    if config.max_model_len is None and pool_tokens < max_len:
        logger.info("capping max_model_len at %d: the KV pool holds %d tokens", pool_tokens, pool_tokens)
        max_len = pool_tokens
    if pool_tokens < max_len or num_blocks < 1:
        raise TuiliError(
            f"kv_cache_memory={budget} bytes holds {pool_tokens} tokens, fewer than "
            f"max_model_len={max_len}: raise kv_cache_memory or lower max_model_len"
        )
    host_budget = config.kv_offload_memory if config.enable_prefix_caching else 0
    # A hybrid's host tier holds state checkpoints beside the blocks, shared as on the device:
    # without them, KV blocks brought back from the host could not be used past the deepest
    # checkpoint still on the device.
    num_host_checkpoints = 0
    if num_checkpoints and host_budget:
        num_host_checkpoints = state_checkpoint_count(host_budget, block_bytes, slot_bytes, config.state_checkpoint_interval)
        host_budget -= num_host_checkpoints * slot_bytes
    return PoolPlan(
        num_blocks, config.block_size, host_budget // block_bytes, kv_dtype, max_len, block_bytes, num_slots,
        slot_bytes, num_checkpoints, num_host_checkpoints, verify_rows,
    )  # fmt: skip


def _state_slots(model: ModelConfig, config: EngineConfig, budget: int, block_bytes: int, slot_bytes: int) -> int:
    """How many sequences' linear-attention state the budget reserves: max_num_seqs, capped
    (and logged) so that the KV blocks keep their floor, which is room for a set max_model_len,
    else half the budget (an unset max_model_len is then capped at what the blocks hold)."""
    if config.max_model_len is not None:
        kv_floor = -(-config.max_model_len // config.block_size) * block_bytes
    else:
        kv_floor = budget // 2
    fits = (budget - kv_floor) // slot_bytes
    if fits < 1:
        raise TuiliError(
            f"kv_cache_memory={budget} bytes cannot hold one sequence's linear-attention state "
            f"({slot_bytes} bytes) beside {kv_floor} bytes of KV blocks"
            + (f" for max_model_len={config.max_model_len}" if config.max_model_len is not None else
               " (half the budget)")
            + ": raise kv_cache_memory" + (" or lower max_model_len" if config.max_model_len is not None else "")
        )  # fmt: skip
    if fits < config.max_num_seqs:
        logger.info(
            "capping concurrent sequences at %d (max_num_seqs=%d): each holds %d bytes of linear-attention state",
            fits, config.max_num_seqs, slot_bytes,
        )  # fmt: skip
    return min(fits, config.max_num_seqs)
