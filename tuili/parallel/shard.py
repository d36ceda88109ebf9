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
  Hybrid models' full attention is gated (Qwen3-Next, Qwen3.5: q_proj yields per head its
  query then its sigmoid gate), so its q rows are cut two heads' worth per query head.
- linear attention (Gated DeltaNet): whole key-head groups (a key head with the num_v_heads /
  num_k_heads value heads that read it): the rank's q/k/v projection rows and conv channels,
  its value heads' z, b, a rows, A_log and dt_bias, out_proj's columns. The gated norm is per
  head (replicated). 16 key / 48 value heads over 3 ranks: 6/5/5 key heads, 18/15/15 value heads.
- MLP: intermediate channels, in blocks of `ffn_unit` (a quantization group, so that no group
  is cut; 1 for floats). A mixture of experts splits every routed expert's (in blocks of
  `expert_unit`) and the shared expert's intermediate channels the same way (vLLM's default
  expert TP); the router and the shared expert's gate are replicated, and the layer's combined
  output is summed over the ranks once. Every rank holds at least one block of each.
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


@dataclass(frozen=True)
class LinearAttentionSplit:
    """A rank's linear-attention key heads [k_start, k_stop) and the value heads that read
    them, [v_start, v_stop) (value head j reads key head j // (num_v_heads / num_k_heads))."""

    k_start: int
    k_stop: int
    v_start: int
    v_stop: int


def linear_attention_split(cfg: ModelConfig, shard: TensorShard) -> LinearAttentionSplit:
    lin = cfg.linear
    assert lin is not None
    per_key = lin.num_v_heads // lin.num_k_heads
    k_start, k_stop = shard.split(lin.num_k_heads)
    return LinearAttentionSplit(k_start, k_stop, k_start * per_key, k_stop * per_key)


def channel_split(size: int, shard: TensorShard, unit: int) -> tuple[int, int]:
    """This rank's [start, stop) of `size` intermediate channels, cut in blocks of `unit`."""
    return shard.split(-(-size // unit), unit, size)


def ffn_split(cfg: ModelConfig, shard: TensorShard, unit: int) -> tuple[int, int]:
    """This rank's intermediate channels [start, stop) of the dense MLP."""
    return channel_split(cfg.intermediate_size, shard, unit)


def vocab_split(vocab_size: int, shard: TensorShard) -> tuple[int, int]:
    return shard.split(vocab_size)


def check_supported(cfg: ModelConfig, shard: TensorShard, ffn_unit: int = 1, expert_unit: int = 1) -> None:
    """Refuse what tensor parallelism cannot split, naming it: every rank must hold at least one
    head of each kind and one block of channels of each MLP."""
    world = shard.world
    attention_split(cfg, shard)
    if cfg.linear is not None and cfg.linear.num_k_heads < world:
        raise TuiliError(
            f"tensor_parallel_size={world} exceeds the {cfg.linear.num_k_heads} linear-attention key heads of "
            f"{cfg.architecture}: each rank needs at least one key head (with its value heads)"
        )
    sizes = {"vocabulary": (cfg.vocab_size, 1)}
    if cfg.moe is None or not all(cfg.moe.sparse_layers):
        sizes["intermediate size"] = (cfg.intermediate_size, ffn_unit)
    if cfg.moe is not None:
        sizes["expert intermediate size"] = (cfg.moe.intermediate_size, expert_unit)
        if cfg.moe.shared_intermediate_size:
            sizes["shared expert intermediate size"] = (cfg.moe.shared_intermediate_size, ffn_unit)
    for what, (size, unit) in sizes.items():
        if -(-size // unit) < world:
            blocks = f" in blocks of {unit} (quantization groups, never cut)" if unit > 1 else ""
            raise TuiliError(f"tensor_parallel_size={world} exceeds the {what} ({size}{blocks}) of {cfg.architecture}")


def local_config(cfg: ModelConfig, shard: TensorShard, ffn_unit: int, expert_unit: int = 1) -> ModelConfig:
    """The config the rank's network is built from: its attention and linear-attention heads and
    its intermediate channels (dense, experts', shared expert's). The vocabulary, the hidden size,
    the number of experts and everything else stay whole."""
    split = attention_split(cfg, shard)
    start, stop = ffn_split(cfg, shard, ffn_unit)
    linear, moe = cfg.linear, cfg.moe
    if linear is not None:
        heads = linear_attention_split(cfg, shard)
        linear = dataclasses.replace(
            linear, num_k_heads=heads.k_stop - heads.k_start, num_v_heads=heads.v_stop - heads.v_start
        )
    if moe is not None:
        expert = channel_split(moe.intermediate_size, shard, expert_unit)
        shared = channel_split(moe.shared_intermediate_size, shard, ffn_unit)
        moe = dataclasses.replace(
            moe, intermediate_size=expert[1] - expert[0], shared_intermediate_size=shared[1] - shared[0]
        )
    return dataclasses.replace(
        cfg, num_heads=split.num_heads, num_kv_heads=split.num_kv_heads, intermediate_size=stop - start,
        linear=linear, moe=moe,
    )  # fmt: skip


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
    expert_unit: int = 1  # the routed experts' block of channels

    def linear_slices(self, path: str, parts: int) -> tuple[int, list[list[tuple[int, int]]]] | None:
        """How decoder linear `path` is cut: None when every rank holds it whole (a router, a
        shared expert's gate), else the dimension (0: output rows, column-parallel; 1: input
        columns, row-parallel) and, per stacked part, the [start, stop) ranges along it that the
        rank holds, concatenated in order (a flat Qwen3.5 in_proj_qkv gives three: its q, k, v)."""
        leaf = path.rpartition(".")[2]
        if leaf in ("gate", "shared_expert_gate"):
            return None
        cfg, split = self.config, attention_split(self.config, self.shard)
        hd = cfg.head_dim
        # A hybrid model's gated q_proj holds two rows of head_dim per query head: query, gate.
        q_rows = 2 if cfg.is_hybrid else 1
        q = (split.q_start * hd * q_rows, split.q_stop * hd * q_rows)
        o = (split.q_start * hd, split.q_stop * hd)
        kv = (split.kv_start * hd, split.kv_stop * hd)
        ffn = self._mlp_channels(path)
        cuts: dict[str, tuple[int, list[list[tuple[int, int]]]]] = {
            "qkv_proj": (0, [[q], [kv], [kv]]), "gate_up_proj": (0, [[ffn], [ffn]]), "o_proj": (1, [[o]]),
            "down_proj": (1, [[ffn]]), "q_proj": (0, [[q]]), "k_proj": (0, [[kv]]), "v_proj": (0, [[kv]]),
            "gate_proj": (0, [[ffn]]), "up_proj": (0, [[ffn]]),
        }  # fmt: skip
        if cfg.linear is not None:
            cuts |= self._linear_attention_cuts(parts)
        if leaf not in cuts or len(cuts[leaf][1]) != parts:
            raise TuiliError(f"tensor parallelism does not know how to split linear {leaf!r}")
        return cuts[leaf]

    def _mlp_channels(self, path: str) -> tuple[int, int]:
        """The rank's intermediate channels of the MLP linear `path`: a shared expert's, or the
        dense MLP's."""
        moe = self.config.moe
        if moe is not None and ".shared_expert." in path:
            return channel_split(moe.shared_intermediate_size, self.shard, self.ffn_unit)
        return ffn_split(self.config, self.shard, self.ffn_unit)

    def expert_channels(self) -> tuple[int, int]:
        """The rank's [start, stop) of each routed expert's intermediate channels."""
        assert self.config.moe is not None
        return channel_split(self.config.moe.intermediate_size, self.shard, self.expert_unit)

    def _linear_attention_cuts(self, parts: int) -> dict[str, tuple[int, list[list[tuple[int, int]]]]]:
        """Gated DeltaNet's projections, in the layout the checkpoint stores: Qwen3-Next's fused
        in_proj_qkvz / in_proj_ba are grouped by key head (one part each: the rank's key heads
        are one run of rows), Qwen3.5's are flat and stored apart (in_proj_qkv + in_proj_z,
        in_proj_b + in_proj_a: the rank's q, k and v rows are three runs)."""
        lin = self.config.linear
        assert lin is not None
        heads = linear_attention_split(self.config, self.shard)
        per_key = lin.num_v_heads // lin.num_k_heads
        values = [(heads.v_start * lin.head_v_dim, heads.v_stop * lin.head_v_dim)]
        if parts == 1:  # grouped by key head: [q, k, v, z] and [b, a] per key head
            group = 2 * lin.head_k_dim + 2 * per_key * lin.head_v_dim
            return {"in_proj_qkvz": (0, [[(heads.k_start * group, heads.k_stop * group)]]),
                    "in_proj_ba": (0, [[(heads.k_start * 2 * per_key, heads.k_stop * 2 * per_key)]]),
                    "out_proj": (1, [values])}  # fmt: skip
        value_heads = [(heads.v_start, heads.v_stop)]
        return {"in_proj_qkvz": (0, [self.conv_channels(), values]), "in_proj_ba": (0, [value_heads, value_heads]),
                "out_proj": (1, [values])}  # fmt: skip

    def conv_channels(self) -> list[tuple[int, int]]:
        """The rank's runs of the conv's channels (flat [q, k, v] in every layout): its key heads'
        q and k channels and its value heads' v channels."""
        lin = self.config.linear
        assert lin is not None
        heads = linear_attention_split(self.config, self.shard)
        key_dim, dk, dv = lin.num_k_heads * lin.head_k_dim, lin.head_k_dim, lin.head_v_dim
        return [(heads.k_start * dk, heads.k_stop * dk), (key_dim + heads.k_start * dk, key_dim + heads.k_stop * dk),
                (2 * key_dim + heads.v_start * dv, 2 * key_dim + heads.v_stop * dv)]  # fmt: skip

    def parameter_rows(self, name: str) -> list[tuple[int, int]] | None:
        """The runs of dim-0 rows the rank holds of parameter `name` filled by name (norms and
        the DeltaNet's own parameters); None: held whole."""
        if self.config.linear is None or ".linear_attn." not in name:
            return None
        if name.endswith(".conv1d.weight"):
            return self.conv_channels()
        if name.endswith((".A_log", ".dt_bias")):
            heads = linear_attention_split(self.config, self.shard)
            return [(heads.v_start, heads.v_stop)]
        return None

    def vocab(self) -> tuple[int, int]:
        return vocab_split(self.config.vocab_size, self.shard)

    def vocab_widths(self) -> list[int]:
        bounds = [vocab_split(self.config.vocab_size, TensorShard(r, self.shard.world)) for r in range(self.shard.world)]
        return [stop - start for start, stop in bounds]
