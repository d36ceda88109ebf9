"""What speculative decoding adds to a plan: the proposer's network, its memory, and the tokens a
verification step is expected to yield.

A speculating engine's decode step verifies each sequence's k proposals: its last token and the k
proposed ones are k + 1 query rows of one forward of the target (plan.py, ``Roofline.verify``).
Before it, the proposer spends its own forwards: prompt lookup ("ngram") none; a draft model k
decode forwards of its own weights and KV at the step's batch; MTP k forwards of the checkpoint's
multi-token-prediction block (its layers, its fc and the target's shared output head). Whether
this pays depends on how many proposals the target keeps, which the plan cannot know: it assumes
each proposal is accepted with probability ``acceptance``, independently (docs/ruler.md).

Memory, as the engine holds it (tuili/engine/pool.py, tuili/engine/spec/): a hybrid target's
state slot carries k more rows (the state after each proposed position); a draft model has its
own weights and a KV pool of as many blocks as the target's, in the working dtype, and a hybrid
draft a state slot of k + 3 rows per sequence (the slot and its ring of k + 2); MTP keeps its
layers' KV beside the target's pool for the same blocks, plus scratch blocks per sequence for the
positions its chain writes past the sequence's own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tuili.config import SELF_DRAFT, SpeculativeConfig
from tuili.errors import TuiliError
from tuili.perf.cost import CheckpointBytes, ModelCost, WeightStorage
from tuili.perf.formats import weight_format
from tuili.perf.shapes import FULL, ModelShape, Weight

# An assumption, not a measurement: a well-matched draft on chat text keeps most of its
# proposals; prompt lookup on copy-heavy text keeps more, on free text far fewer. --measure sets
# the run's own rate beside it.
DEFAULT_ACCEPTANCE = 0.7
BLOCK_SIZE = 16  # the engine's default KV block size, which the MTP scratch blocks come in
DRAFT_RING_ROWS = 2  # a hybrid draft's ring holds k + 2 states per slot (tuili/engine/spec/draft.py)


def check_acceptance(acceptance: float) -> float:
    """``acceptance`` if it is a probability, else a TuiliError naming it."""
    if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0 <= acceptance <= 1:
        raise TuiliError(f"--spec-acceptance {acceptance!r} is invalid: expected the probability that the "
                         f"target keeps a proposed token, a number in [0, 1] (default {DEFAULT_ACCEPTANCE})")
    return float(acceptance)


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Tokens one verification of k proposals yields, on average, when each proposal is kept with
    probability ``acceptance`` independently and the first rejection ends the run: the kept
    prefix plus the target's own token, sum_{i=0..k} a^i = (1 - a^(k+1)) / (1 - a) (Leviathan,
    Kalman and Matias, "Fast Inference from Transformers via Speculative Decoding", 2023, eq. 1).
    k + 1 when every proposal is kept."""
    if acceptance == 1:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


@dataclass(frozen=True)
class Speculation:
    """A speculative decoding setup for the plan. ``proposer``: the network that proposes (a draft
    model, or the MTP block with the target's head), None for prompt lookup; ``proposer_weights``:
    how its weights are stored; ``proposer_state_rows``: state rows per sequence a hybrid draft
    holds; ``scratch_tokens``: MTP KV positions per sequence beyond its own blocks."""

    config: SpeculativeConfig
    acceptance: float = DEFAULT_ACCEPTANCE
    proposer: ModelCost | None = None
    proposer_weights: WeightStorage | None = None
    proposer_state_rows: int = 0
    scratch_tokens: int = 0
    # MTP: the head is the target's, already counted in its weights; a draft holds its own
    head_shared: bool = False
    # plan --measure: the packed formats of the engine's draft's linears (PlanInputs.packed_formats)
    proposer_formats: dict[str, float] = field(default_factory=dict)

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens a sequence gains per verification step."""
        return expected_tokens_per_step(self.acceptance, self.k)

    def proposer_held_bytes(self) -> int:
        """Bytes of weights the proposer adds to the device (0: n-gram; MTP: its block without
        the shared head and embedding)."""
        if self.proposer is None:
            return 0
        assert self.proposer_weights is not None
        if not self.head_shared:
            return self.proposer.weight_bytes(self.proposer_weights)
        by_kind = self.proposer.weight_bytes_by_kind(self.proposer_weights)
        return sum(b for kind, b in by_kind.items() if kind not in ("embedding", "lm_head"))

    def proposer_bytes_per_request(self, context: int, kv_dtype: str, working_dtype: str) -> float:
        """KV and state one request makes the proposer hold at ``context`` tokens: a draft's KV in
        the working dtype and its state rows, MTP's KV in the KV cache's dtype plus its scratch."""
        if self.proposer is None:
            return 0.0
        if self.head_shared:  # MTP: beside the target's blocks, in the target pool's dtype
            return self.proposer.kv_bytes_per_token(kv_dtype) * (context + self.scratch_tokens)
        state = self.proposer.state_bytes_per_sequence(conv_dtype=working_dtype)
        return self.proposer.kv_bytes_per_token(working_dtype) * context + state * self.proposer_state_rows


def speculation_for(
    value: dict | SpeculativeConfig, acceptance: float, target_config: dict, target_weights: WeightStorage,
) -> Speculation:  # fmt: skip
    """The plan's Speculation for vLLM's ``speculative_config`` dict (validated as the engine
    validates it) on a target of ``target_config`` stored as ``target_weights``. A draft model's
    config and weights are read from its checkpoint's headers (tuili/perf/checkpoint.py)."""
    config = SpeculativeConfig.parse(value)
    acceptance = check_acceptance(acceptance)
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return Speculation(config, acceptance)
    if config.method == "mtp":
        block = mtp_cost(target_config)
        target = ModelCost.from_config(target_config)
        scratch = max(1, (k - 2) // BLOCK_SIZE + 1) * BLOCK_SIZE
        return Speculation(config, acceptance, block, scaled_storage(target, target_weights, block), 0, scratch, True)
    if config.model == SELF_DRAFT:
        draft, storage = ModelCost.from_config(target_config), weight_format(config.quantization)
    else:
        from tuili.perf.checkpoint import read_model

        source = read_model(config.model)
        draft = ModelCost.from_config(source.config)
        target_vocab = ModelShape.from_config(target_config).vocab_size
        if draft.shape.vocab_size > target_vocab:
            raise TuiliError(f"speculative_config model={config.model!r} has vocab_size={draft.shape.vocab_size}, "
                             f"more than the target's {target_vocab}: a draft must share the target's tokenizer")
        if config.quantization is not None:
            storage = weight_format(config.quantization)
        else:
            storage = source.weights or weight_format("bf16")
    rows = 1 + k + DRAFT_RING_ROWS if draft.shape.linear is not None else 0
    return Speculation(config, acceptance, draft, storage, rows)


class _MTPShape(ModelShape):
    """The MTP block as a model of its own: its decoder layers (full attention, the target's MLP
    kind), the fc that joins the next token's embedding with the hidden state (2h -> h), the two
    norms before it and its final norm, and the target's embedding and output head."""

    def weights(self) -> list[Weight]:
        h = self.hidden_size
        return [
            *super().weights(),
            # The fc is a projection of the block's input: counted with the attention kind, whose
            # storage (dtype, quantization) it shares in the checkpoints that carry it.
            Weight("mtp.fc", "attention", (h, 2 * h)),
            Weight("mtp.pre_fc_norm_embedding+pre_fc_norm_hidden", "norm", (h,), 2, "vector"),
        ]


def mtp_cost(target_config: dict) -> ModelCost:
    """The cost model of a target's MTP block (``mtp_num_hidden_layers``, default 1: its
    decoder layers; Qwen3-Next and Qwen3.5 checkpoints)."""
    target = ModelShape.from_config(target_config)
    if target.linear is None:
        raise TuiliError(f"speculative_config method='mtp' needs a checkpoint with multi-token-prediction layers "
                         f"(Qwen3-Next, Qwen3.5): {target.model_type} has none")
    text = target_config.get("text_config", target_config)
    layers = text.get("mtp_num_hidden_layers", target_config.get("mtp_num_hidden_layers", 1))
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise TuiliError(f"config mtp_num_hidden_layers={layers!r} is invalid: expected an integer >= 1")
    fields = {f.name: getattr(target, f.name) for f in dataclasses.fields(target)}
    # Every MTP layer is a full-attention layer with the target's kind of MLP (experts when it has them).
    fields |= {"layer_types": (FULL,) * layers, "moe_layers": (target.moe is not None,) * layers, "linear": None}
    return ModelCost(_MTPShape(**fields))


def scaled_storage(target: ModelCost, storage: WeightStorage, block: ModelCost) -> WeightStorage:
    """The storage of ``block`` (the MTP block) at the bytes per parameter of each kind of the
    target's ``storage``: a format is a format; a checkpoint's bytes are scaled by kind."""
    if not isinstance(storage, CheckpointBytes):
        return storage
    target_params, block_params = target.params_by_kind(), block.params_by_kind()
    by_kind = {kind: math.ceil(storage.bytes_by_kind.get(kind, 0) * n / target_params[kind]) if n else 0
               for kind, n in block_params.items() if target_params.get(kind)}  # fmt: skip
    return CheckpointBytes(by_kind, f"{storage.source}, scaled to the MTP block")
