"""The cost model: parameters, FLOPs and bytes of a model, computed from its config alone.

Definitions (docs/ruler.md explains each with the seeds' worked figures):

* **FLOPs** count a multiply-add as 2. A token costs 2 x (parameters of the matmuls it passes
  through) — for a mixture of experts, only its top-k experts — plus attention: per attention
  layer and head, QK^T and PV are 2 x head_dim FLOPs each per key attended. A causal prefill
  chunk counts exactly the keys each query sees (its own position and everything before it,
  within the sliding window if the layer has one), not the full square. The lm_head runs only
  where logits are needed: the last token of a prefill, every decoded token. A Gated DeltaNet
  layer adds its depthwise convolution (2 x channels x kernel) and the recurrence (7 FLOPs per
  state value: decay, read k^T S, rank-1 write, read q^T S). Norms, rotary embedding, softmax and
  activations are elementwise and not counted (well under 1% of the total).
* **Bytes** of one decode step are what must cross the memory bus: every weight once (an untied
  input embedding only for the rows looked up; a mixture of experts only for the experts its
  tokens were routed to, in expectation under uniform routing), each sequence's K and V for every
  token it attends, and each sequence's linear-attention state, read and written back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tuili.errors import TuiliError
from tuili.perf.formats import WeightFormat, dtype_bytes, weight_format
from tuili.perf.shapes import FULL, KINDS, SLIDING, ModelShape, Weight

# FLOPs per value of a Gated DeltaNet state per token: decay (1), k^T S (2), k delta^T (2), q^T S (2).
DELTANET_FLOPS_PER_STATE_VALUE = 7


@dataclass(frozen=True)
class CheckpointBytes:
    """Bytes a real checkpoint stores per kind of weight, read from its file headers.

    Within a kind, bytes are spread over tensors in proportion to their parameter counts (exact
    when a kind is stored at one precision, which is how checkpoints are made).
    """

    bytes_by_kind: Mapping[str, int]
    source: str  # what was read, for reports ("3 safetensors files", "GGUF Q4_1 ...")
    ignored_bytes: int = 0  # tensors outside the language model (vision tower, MTP head)


WeightStorage = WeightFormat | CheckpointBytes


class ModelCost:
    """FLOPs, bytes and parameter counts of one model; cheap to build, pure arithmetic to query."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self.weights: list[Weight] = shape.weights()
        attn = [t for t in shape.layer_types if t in (FULL, SLIDING)]
        self._full_layers = sum(t == FULL for t in attn)
        self._sliding_layers = sum(t == SLIDING for t in attn)
        # Per attention layer and key attended: QK^T and PV, 2 FLOPs per multiply-add each.
        self._attn_flops_per_key = 4 * shape.num_heads * shape.head_dim
        self._token_flops = sum(2 * self._active_numel(w) for w in self.weights
                                if w.op in ("matmul", "conv") and w.kind != "lm_head")
        self._state_flops_per_token = 0
        if shape.linear is not None:
            la = shape.linear
            state = la.value_heads * la.key_dim * la.value_dim
            self._state_flops_per_token = shape.linear_layers * DELTANET_FLOPS_PER_STATE_VALUE * state
            self._token_flops += self._state_flops_per_token
        self._lm_head_flops = 2 * shape.hidden_size * shape.vocab_size

    @classmethod
    def from_config(cls, config: dict) -> ModelCost:
        """From a Hugging Face config.json dict (or a GGUF header's equivalent)."""
        return cls(ModelShape.from_config(config))

    # ---- parameters -------------------------------------------------------------------------

    def params_by_kind(self) -> dict[str, int]:
        """Parameters per kind (embedding, attention, linear_attention, mlp, experts, router, norm, lm_head)."""
        counts = dict.fromkeys(KINDS, 0)
        for w in self.weights:
            counts[w.kind] += w.numel
        return counts

    @property
    def params_total(self) -> int:
        return sum(w.numel for w in self.weights)

    @property
    def params_matmul(self) -> int:
        """Parameters in matrix multiplications: projections, experts, routers and the lm_head
        (the embedding matrix when it is tied to the lm_head)."""
        total = sum(w.numel for w in self.weights if w.op == "matmul")
        if self.shape.tie_word_embeddings:
            total += self.shape.vocab_size * self.shape.hidden_size
        return total

    @property
    def params_active(self) -> int:
        """Matmul parameters one token passes through: like params_matmul, with top-k experts only."""
        total = sum(self._active_numel(w) for w in self.weights if w.op == "matmul")
        if self.shape.tie_word_embeddings:
            total += self.shape.vocab_size * self.shape.hidden_size
        return round(total)

    def _active_numel(self, w: Weight) -> float:
        if w.experts:
            assert self.shape.moe is not None
            return w.numel * self.shape.moe.top_k / w.experts
        return w.numel

    # ---- FLOPs ------------------------------------------------------------------------------

    def prefill_flops(self, start: int, length: int, *, logits: bool = True) -> int:
        """FLOPs of a prefill chunk of ``length`` tokens after ``start`` tokens already in the cache.

        ``logits``: the chunk ends the prompt, so the lm_head runs for its last token.
        """
        flops = length * self._token_flops + self.prefill_attention_flops(start, length)
        return round(flops + (self._lm_head_flops if logits else 0))

    def prefill_attention_flops(self, start: int, length: int) -> int:
        """The part of prefill_flops that is attention over the keys (scores and weighted values)."""
        _check_count("start", start, 0)
        _check_count("length", length, 1)
        return self._attn_flops_per_key * self._keys_attended(start, length)

    def prefill_state_flops(self, length: int) -> int:
        """The part of prefill_flops that is the Gated DeltaNet rule on the state (0 without
        linear attention)."""
        _check_count("length", length, 1)
        return length * self._state_flops_per_token

    def decode_flops(self, context_lens: Sequence[int]) -> int:
        """FLOPs of one decode step: one new token per sequence, each at its context length
        (which includes the new token)."""
        total = 0.0
        for c in context_lens:
            _check_count("context length", c, 1)
            total += self._token_flops + self._lm_head_flops + self._attn_flops_per_key * self._keys_attended(c - 1, 1)
        return round(total)

    def flops_per_token(self, context_len: int = 1) -> int:
        """FLOPs of one decoded token at ``context_len`` (lm_head included)."""
        return self.decode_flops([context_len])

    def _keys_attended(self, start: int, length: int) -> int:
        """Keys all attention layers see, summed, for queries at positions start .. start+length-1."""
        def upto(m: int, window: int | None) -> int:
            # sum over q = 1..m of min(q, window): the keys of the first m queries
            if window is None or m <= window:
                return m * (m + 1) // 2
            return window * (window + 1) // 2 + (m - window) * window

        end = start + length
        keys = self._full_layers * (upto(end, None) - upto(start, None))
        if self._sliding_layers:
            w = self.shape.sliding_window
            keys += self._sliding_layers * (upto(end, w) - upto(start, w))
        return keys

    # ---- weight bytes -----------------------------------------------------------------------

    def weight_bytes(self, storage: WeightStorage | str) -> int:
        """Bytes of all weights stored at ``storage`` (a format name like "int4", a WeightFormat,
        or a checkpoint's real CheckpointBytes)."""
        return round(sum(self._bytes_each(storage)))

    def weight_bytes_by_kind(self, storage: WeightStorage | str) -> dict[str, int]:
        by_kind = dict.fromkeys(KINDS, 0.0)
        for w, b in zip(self.weights, self._bytes_each(storage), strict=True):
            by_kind[w.kind] += b
        return {k: round(v) for k, v in by_kind.items()}

    def weight_bytes_per_device(self, storage: WeightStorage | str, tp: int = 1) -> int:
        """Bytes of weights the most loaded of ``tp`` tensor-parallel devices holds. A tensor split
        into units (heads, channels) that ``tp`` does not divide is split unevenly (or padded):
        that device holds ceil(units/tp), or ceil(groups/tp) whole groups (tuili/parallel/shard.py)."""
        _check_count("tp", tp, 1)
        return round(sum(b * _weight_share(w, tp) for w, b in zip(self.weights, self._bytes_each(storage), strict=True)))

    def weight_bytes_per_stage(self, storage: WeightStorage | str, pp: int, tp: int = 1) -> list[int]:
        """Bytes of weights each of ``pp`` pipeline stages holds (per device of the stage's ``tp``
        group), as the engine splits them (tuili/parallel/pipeline.py): contiguous layers, the
        first ``layers % pp`` stages one more; the embedding on the first stage; the final norm
        and the output matrix on the last, which for a tied model is a second copy of the
        embedding table. A layer holds 1/layers of the decoder weights (exact for uniform layers;
        an average across a hybrid's or a partly-MoE model's kinds of layer)."""
        _check_count("pp", pp, 1)
        layers = self.shape.num_layers
        if pp > layers:
            raise TuiliError(f"--pp {pp} exceeds the model's {layers} decoder layers: each stage needs one")
        shared = {"embed_tokens": 0.0, "norm": 0.0, "lm_head": 0.0}
        decoder = 0.0
        for w, b in zip(self.weights, self._bytes_each(storage), strict=True):
            held = b * _shard(w.tp_units, tp)
            if w.name in shared:
                shared[w.name] = held
            else:
                decoder += held
        head = shared["lm_head"]
        if self.shape.tie_word_embeddings and pp > 1:
            head = shared["embed_tokens"]  # the table again, on the last stage
        out = []
        for stage, count in enumerate(stage_layer_counts(layers, pp)):
            held = decoder * count / layers
            held += shared["embed_tokens"] if stage == 0 else 0
            held += shared["norm"] + head if stage == pp - 1 else 0
            out.append(round(held))
        return out

    def stage_layer_kinds(self, pp: int) -> list[tuple[int, int]]:
        """(attention layers, those with a KV cache; other layers, linear attention with a
        state) in each of ``pp`` pipeline stages."""
        kinds = self.shape.layer_types
        counts, start = [], 0
        for count in stage_layer_counts(len(kinds), pp):
            attention = sum(t in (FULL, SLIDING) for t in kinds[start : start + count])
            counts.append((attention, count - attention))
            start += count
        return counts

    def decode_weight_bytes(self, storage: WeightStorage | str, batch: int = 1, tp: int = 1) -> int:
        """Bytes of weights one decode step of ``batch`` sequences reads (per device under ``tp``)."""
        _check_count("batch", batch, 1)
        total = 0.0
        for w, b in zip(self.weights, self._bytes_each(storage), strict=True):
            total += b * _weight_share(w, tp) * self._read_fraction(w, batch)
        return round(total)

    def weight_read_fraction(self, batch: int = 1, storage: WeightStorage | str = "bf16") -> float:
        """Share of all weight bytes one decode step of ``batch`` tokens reads (1.0 for a dense
        model with tied embeddings)."""
        total = self.weight_bytes(storage)
        return self.decode_weight_bytes(storage, batch) / total

    def _read_fraction(self, w: Weight, batch: int) -> float:
        if w.kind == "embedding" and not self.shape.tie_word_embeddings:
            return min(batch, w.shape[0]) / w.shape[0]  # only the looked-up rows
        if w.experts:
            assert self.shape.moe is not None
            return expected_experts_touched(w.experts, self.shape.moe.top_k, batch) / w.experts
        return 1.0

    def _bytes_each(self, storage: WeightStorage | str) -> list[float]:
        if isinstance(storage, str):
            storage = weight_format(storage)
        if isinstance(storage, CheckpointBytes):
            params = self.params_by_kind()
            missing = [k for k, n in params.items() if n and not storage.bytes_by_kind.get(k)]
            if missing:
                raise TuiliError(
                    f"{storage.source} holds no tensors of kind {', '.join(missing)} that the config "
                    f"describes; the checkpoint does not match its config"
                )
            return [storage.bytes_by_kind[w.kind] * w.numel / params[w.kind] for w in self.weights]
        return [_format_bytes(w, storage) for w in self.weights]

    # ---- KV cache and states ----------------------------------------------------------------

    def kv_bytes_per_token(self, kv_dtype: str = "bf16", tp: int = 1) -> int:
        """K and V of one token over all attention layers (per device under ``tp``: each device
        keeps ceil(kv_heads / tp) heads, replicating heads when tp exceeds their number)."""
        _check_count("tp", tp, 1)
        s = self.shape
        heads = math.ceil(s.num_kv_heads / tp)
        return 2 * s.attention_layers * heads * s.head_dim * dtype_bytes(kv_dtype)

    def kv_tokens_read(self, context_len: int) -> float:
        """Tokens of KV one sequence at ``context_len`` reads per decode step, averaged over the
        attention layers (fewer than context_len when sliding-window layers stop at the window)."""
        layers = self._full_layers + self._sliding_layers
        if not layers:
            return 0.0
        window = self.shape.sliding_window or context_len
        return (self._full_layers * context_len + self._sliding_layers * min(context_len, window)) / layers

    def state_bytes_per_sequence(self, state_dtype: str = "fp32", conv_dtype: str = "bf16", tp: int = 1) -> int:
        """Fixed per-sequence state of the linear-attention layers: per value head a key_dim x
        value_dim matrix (fp32 unless told), plus the last kernel-1 inputs of the convolution."""
        la = self.shape.linear
        if la is None:
            return 0
        _check_count("tp", tp, 1)
        share = _shard(la.key_heads, tp)
        recurrent = la.value_heads * la.key_dim * la.value_dim * dtype_bytes(state_dtype)
        conv = la.conv_channels * (la.conv_kernel - 1) * dtype_bytes(conv_dtype)
        return round(self.shape.linear_layers * (recurrent + conv) * share)

    # ---- one decode step --------------------------------------------------------------------

    def decode_bytes(
        self, weight_bytes_read: int, kv_bytes_per_token: int, context_lens: Sequence[int],
        state_bytes_per_sequence: int = 0,
    ) -> int:
        """Bytes of a decode step from its parts: weights read, each sequence's KV for the tokens
        it attends, each state read and written back."""
        kv = sum(kv_bytes_per_token * self.kv_tokens_read(c) for c in context_lens)
        return round(weight_bytes_read + kv + 2 * state_bytes_per_sequence * len(context_lens))

    def decode_step_bytes(
        self, storage: WeightStorage | str, context_lens: Sequence[int], kv_dtype: str = "bf16",
        state_dtype: str = "fp32", tp: int = 1,
    ) -> int:
        """Bytes one decode step must move (per device under ``tp``)."""
        if not context_lens:
            raise TuiliError("a decode step needs at least one sequence")
        return self.decode_bytes(
            self.decode_weight_bytes(storage, len(context_lens), tp),
            self.kv_bytes_per_token(kv_dtype, tp),
            context_lens,
            self.state_bytes_per_sequence(state_dtype, tp=tp),
        )


def expected_experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a layer reads for ``tokens`` tokens that each pick ``top_k`` of ``experts``
    uniformly: experts x (1 - (1 - k/E)^tokens)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _format_bytes(w: Weight, fmt: WeightFormat) -> float:
    if len(w.shape) == 2 and w.op in ("matmul", "gather"):
        if w.kind in ("embedding", "lm_head") and not fmt.quantize_embeddings:
            return 2 * w.numel  # kept at 16 bits, as FP8/INT8/INT4 checkpoints do
        return fmt.matrix_bytes(*w.shape) * w.count
    return fmt.vector_bytes * w.numel


def stage_layer_counts(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: as even as possible, the first ``layers % pp`` one more."""
    base, extra = divmod(layers, pp)
    return [base + (1 if stage < extra else 0) for stage in range(pp)]


def _shard(units: int, tp: int) -> float:
    """Share of a tensor one of ``tp`` devices holds."""
    if not units or tp == 1:
        return 1.0
    return math.ceil(units / tp) / units


def _weight_share(w: Weight, tp: int) -> float:
    """Share of tensor `w` the most loaded of ``tp`` devices holds."""
    if w.tp_units and w.tp_groups >= tp > 1:  # whole groups of units (query heads with their KV head)
        return _shard(w.tp_groups, tp)
    return _shard(w.tp_units, tp)


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TuiliError(f"{name}={value!r} is invalid: expected an integer >= {minimum}")
