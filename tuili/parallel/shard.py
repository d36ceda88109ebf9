"""Which part of every weight one tensor-parallel rank holds.

Splits are contiguous and uneven where the count does not divide: the first `units % world`
ranks hold one unit more (vLLM pads instead; an uneven split holds no padding and computes
nothing twice). The units:

- attention: whole KV-head groups (a KV head with the query heads that read it), so that every
  rank keeps the uniform query-to-KV mapping the attention kernels assume. With fewer KV heads
  than ranks each KV head is replicated on world / kv ranks, which split its query heads.
  TP=3 over 4 KV heads gives ranks 2, 1 and 1 KV heads (and their query heads): the most any
  rank holds is ceil(4 / 3) = 2 heads, what the ruler counts, at the cost of rank 0 doing two
  KV groups' attention while the others do one.
- MLP: intermediate channels, in blocks of `ffn_unit` (a quantization group, so that no group
  is cut; 1 for floats).
- vocabulary: rows of the embedding and of the output matrix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tuili.config import ModelConfig
from tuili.errors import TuiliError


@dataclass(frozen=True)
class TensorShard:
    rank: int
    world: int

    def split(self, units: int, unit_size: int = 1, total: int | None = None) -> tuple[int, int]:
        """This rank's [start, stop) of `units` units of `unit_size` each (uneven: the first
        ranks take one more), clipped to `total` where the last unit is partial."""
        base, extra = divmod(units, self.world)
        first = self.rank * base + min(self.rank, extra)
        count = base + (1 if self.rank < extra else 0)
        end = units * unit_size if total is None else total
        return min(first * unit_size, end), min((first + count) * unit_size, end)


@dataclass(frozen=True)
class AttentionSplit:
    """A rank's query heads [q_start, q_stop) and KV heads [kv_start, kv_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


def attention_split(cfg: ModelConfig, shard: TensorShard) -> AttentionSplit:
    heads, kv, world = cfg.num_heads, cfg.num_kv_heads, shard.world
    group = heads // kv
    if kv >= world:
        kv_start, kv_stop = shard.split(kv)
        return AttentionSplit(kv_start * group, kv_stop * group, kv_start, kv_stop)
    if world % kv or group % (world // kv):
        raise TuiliError(
            f"tensor_parallel_size={world} cannot split {kv} KV heads with {heads} query heads: with fewer "
            f"KV heads than ranks the ranks must be a multiple of the KV heads ({kv}) and each KV head's "
            f"{group} query heads must split evenly over the ranks that share it"
        )
    replicas = world // kv
    kv_head = shard.rank // replicas
    per_rank = group // replicas
    q_start = kv_head * group + (shard.rank % replicas) * per_rank
    return AttentionSplit(q_start, q_start + per_rank, kv_head, kv_head + 1)


def ffn_split(cfg: ModelConfig, shard: TensorShard, unit: int) -> tuple[int, int]:
    """This rank's intermediate channels [start, stop)."""
    size = cfg.intermediate_size
    return shard.split(-(-size // unit), unit, size)


def vocab_split(vocab_size: int, shard: TensorShard) -> tuple[int, int]:
    return shard.split(vocab_size)


def check_supported(cfg: ModelConfig, shard: TensorShard) -> None:
    """Refuse what tensor parallelism does not cover yet, naming it."""
    if cfg.is_hybrid or cfg.moe is not None:
        kind = "linear-attention (hybrid)" if cfg.is_hybrid else "mixture-of-experts"
        raise TuiliError(
            f"tensor_parallel_size={shard.world}: {cfg.architecture} has {kind} layers, which tensor "
            "parallelism does not split yet; run it with tensor_parallel_size=1"
        )
    attention_split(cfg, shard)
    if cfg.intermediate_size < shard.world or cfg.vocab_size < shard.world:
        raise TuiliError(
            f"tensor_parallel_size={shard.world} exceeds the intermediate size ({cfg.intermediate_size}) or "
            f"the vocabulary ({cfg.vocab_size}) of {cfg.architecture}"
        )


def local_config(cfg: ModelConfig, shard: TensorShard, ffn_unit: int) -> ModelConfig:
    """The config the rank's network is built from: its heads and intermediate channels. The
    vocabulary, the hidden size and everything else stay whole."""
    split = attention_split(cfg, shard)
    start, stop = ffn_split(cfg, shard, ffn_unit)
    return dataclasses.replace(
        cfg, num_heads=split.num_heads, num_kv_heads=split.num_kv_heads, intermediate_size=stop - start
    )


def narrow(weight, dim: int, start: int, stop: int):
    """Rows (dim 0) or columns (dim 1) [start, stop) of a float tensor or a quantized weight
    (tuili/layers/quant/formats.py: q [N, K] with per-row or per-group scales). A quantized
    weight's columns are cut at group boundaries only."""
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, start, stop - start)
    changes = {}
    group = getattr(weight, "group_size", None)
    for field in dataclasses.fields(weight):
        value = getattr(weight, field.name)
        if not isinstance(value, torch.Tensor):
            continue
        if dim == 0:
            changes[field.name] = value[start:stop].contiguous()
        elif field.name == "q":
            changes[field.name] = value[:, start:stop].contiguous()
        elif value.dim() == 2:  # per-group scales and zeros
            if group is None or start % group or (stop % group and stop != weight.q.shape[1]):
                raise TuiliError(f"a quantized weight's columns {start}:{stop} cut its groups of {group}")
            changes[field.name] = value[:, start // group : -(-stop // group)].contiguous()
        # else a per-row scale, which holds for any of the row's columns: kept whole
    return dataclasses.replace(weight, **changes)


@dataclass(frozen=True)
class ShardPlan:
    """What a rank's weight plan needs to cut the checkpoint: the rank, the whole model's
    config, the FFN split unit and the group its communicating modules use."""

    shard: TensorShard
    config: ModelConfig  # the whole model's
    ffn_unit: int
    group: object  # TensorParallelGroup (typed loosely: the plan only hands it on)

    def linear_slices(self, leaf: str, parts: int) -> tuple[int, list[tuple[int, int]]]:
        """How decoder linear `leaf` is cut: the dimension (0: output rows, column-parallel;
        1: input columns, row-parallel) and each stacked part's [start, stop) along it."""
        cfg, split = self.config, attention_split(self.config, self.shard)
        hd = cfg.head_dim
        q = (split.q_start * hd, split.q_stop * hd)
        kv = (split.kv_start * hd, split.kv_stop * hd)
        ffn = ffn_split(cfg, self.shard, self.ffn_unit)
        cuts = {"qkv_proj": (0, [q, kv, kv]), "gate_up_proj": (0, [ffn, ffn]), "o_proj": (1, [q]),
                "down_proj": (1, [ffn]), "q_proj": (0, [q]), "k_proj": (0, [kv]), "v_proj": (0, [kv]),
                "gate_proj": (0, [ffn]), "up_proj": (0, [ffn])}
        if leaf not in cuts or len(cuts[leaf][1]) != parts:
            raise TuiliError(f"tensor parallelism does not know how to split linear {leaf!r}")
        return cuts[leaf]

    def vocab(self) -> tuple[int, int]:
        return vocab_split(self.config.vocab_size, self.shard)

    def vocab_widths(self) -> list[int]:
        bounds = [vocab_split(self.config.vocab_size, TensorShard(r, self.shard.world)) for r in range(self.shard.world)]
        return [stop - start for start, stop in bounds]
