"""Pipeline parallelism: which decoder layers a stage holds, and the stage's part of the network.

A model of L layers over M stages: contiguous runs of layers, as even as possible, the first
`L % M` stages holding one layer more (the last stage also holds the final norm and the output
head, the heaviest single matrix, so the extra layers go to the front). The first stage holds
the token embedding, the last the final norm and the output head (and, for a tied model, its
own copy of the embedding table as the output matrix). Each stage is one rank (one process):
it builds only its layers from the weight plan, so it reads only their tensors from the
checkpoint, and the runner gives it a KV cache for its layers only.

Between stages goes the residual stream: a layer's output not yet added to the residual, and
the residual, stacked as one [2, tokens, hidden] tensor (so the next stage continues exactly
as the whole model would, the add fused with its first norm).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tuili.config import ModelConfig
from tuili.errors import TuiliError
from tuili.layers.attention import AttentionBackend
from tuili.layers.norm import RMSNorm
from tuili.layers.rotary import RotaryEmbedding
from tuili.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from tuili.models.weights import WeightPlan
from tuili.parallel.group import TensorParallelGroup
from tuili.parallel.shard import TensorShard


@dataclass(frozen=True)
class PipelineStage:
    """Stage `rank` of `world`: which layers it holds. Combined with tensor parallelism each
    stage is a group of `tp` ranks, global rank = stage * tp + tp_rank: the stage's layers split
    among them as tensor parallelism splits a whole model, each sending its (replicated)
    hidden states to the rank of the same tp_rank in the next stage."""

    rank: int
    world: int
    tp_rank: int = 0
    tp: int = 1

    def peer(self, stage: int) -> int:
        """The global rank of this rank's counterpart (same tp_rank) in `stage`."""
        return stage * self.tp + self.tp_rank

    @property
    def is_scheduler(self) -> bool:
        """Global rank 0: the first stage's first rank, where the engine runs."""
        return self.rank == 0 and self.tp_rank == 0

    def layers(self, num_layers: int) -> range:
        base, extra = divmod(num_layers, self.world)
        first = self.rank * base + min(self.rank, extra)
        return range(first, first + base + (1 if self.rank < extra else 0))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1


def join_stage(whole: TensorParallelGroup, tp: int, pp: int) -> tuple[PipelineStage, TensorParallelGroup | None]:
    """This rank's stage in a world of `pp` stages x `tp` ranks, and (tp > 1) its stage's
    tensor-parallel group: collectives on the stage's ranks only, timed apart, whose failure
    fails the whole group."""
    rank = whole.rank
    stage = PipelineStage(rank // tp, pp, rank % tp, tp)
    if tp == 1:
        return stage, None
    # Every rank creates every stage's group, in the same order (torch.distributed's rule).
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    stage_group = TensorParallelGroup(
        TensorShard(stage.tp_rank, tp), whole.device, "tensor-parallel", groups[stage.rank], stage.rank * tp,
    )
    stage_group.on_failure = whole.fail
    stage_group.parent = whole
    whole.children.append(stage_group)
    stage_group.connect_shared_memory()
    return stage, stage_group


def check_supported(cfg: ModelConfig, world: int) -> None:
    """Refuse what pipeline parallelism does not cover, naming it."""
    if cfg.is_hybrid or cfg.moe is not None:
        kind = "linear-attention (hybrid)" if cfg.is_hybrid else "mixture-of-experts"
        raise TuiliError(
            f"pipeline_parallel_size={world}: {cfg.architecture} has {kind} layers, which pipeline "
            "parallelism does not run yet (dense Llama-family models only); run it with pipeline_parallel_size=1"
        )
    if cfg.num_layers < world:
        raise TuiliError(
            f"pipeline_parallel_size={world} exceeds the {cfg.num_layers} decoder layers of {cfg.architecture}: "
            "every stage needs at least one layer"
        )


def stage_config(cfg: ModelConfig, stage: PipelineStage) -> ModelConfig:
    """The config of the stage's network: its layers only (what the KV pool is planned from)."""
    layers = stage.layers(cfg.num_layers)
    types = cfg.layer_types[layers.start : layers.stop] if cfg.layer_types else ()
    return dataclasses.replace(cfg, num_layers=len(layers), layer_types=types)


class StageNetwork(nn.Module):
    """One stage of a Llama-family network. Module paths are the checkpoint's (model.layers.N
    keeps the layer's global index N), so the weight plan and `fill` read exactly this stage's
    tensors. The runner drives it in three parts: `embed` (first stage), `run_layers` (every
    stage) and `finish` + `compute_logits` (last stage)."""

    stacked_projections = LlamaForCausalLM.stacked_projections

    def __init__(
        self, cfg: ModelConfig, stage: PipelineStage, max_positions: int, plan: WeightPlan, attention: AttentionBackend,
    ) -> None:
        super().__init__()
        self.config = stage_config(cfg, stage)
        self.stage = stage
        self.platform, self.attention = plan.platform, attention
        self.model = nn.Module()  # a container, so that parameter names match the checkpoint's
        if stage.is_first:
            self.model.embed_tokens = plan.embedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size, tied=cfg.tie_word_embeddings)
        self.model.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.model.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, plan, attention, i) for i in stage.layers(cfg.num_layers)}
        )
        if stage.is_last:
            self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plan.platform)
            embedding = self.model.embed_tokens if stage.is_first else None
            if embedding is None:
                # The output head needs the table's shape, and a tied head the table itself;
                # only the head keeps a reference to it.
                if cfg.tie_word_embeddings:
                    embedding = plan.embedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size, tied=True)
                else:
                    embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
            self.lm_head = plan.output_head("lm_head", embedding, cfg.tie_word_embeddings)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def run_layers(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers over `x` (the first stage: the embeddings, residual None; later
        stages: what the previous stage returned). Returns the last layer's output, not yet
        added to the residual, and the residual."""
        rope = self.model.rotary.tables(positions)
        for layer in self.model.layers.values():
            x, residual = layer(x, residual, rope, meta)
        assert residual is not None
        return x, residual

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The final hidden states (last stage)."""
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers.values()]

    def linear_attention_layers(self) -> list[nn.Module]:
        return []
