"""The shape of a model read from its config: which layers it has and every weight tensor they hold.

This is what the cost model needs to know about a network, and nothing more. It reads a Hugging
Face ``config.json`` dict (or the same kind of dict a GGUF header produces), validates the fields
it uses once, and applies the defaults transformers applies for the fields a config may omit, so
the tensors it lists are exactly those transformers instantiates (tests/perf check that on the
meta device). A multimodal wrapper (``text_config``) is reduced to its language model: the vision
encoder runs once per image, not per token, and is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tuili.errors import CheckpointError, UnsupportedModelError

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"

# Kinds a weight can be of; params and bytes are reported per kind.
KINDS = ("embedding", "attention", "linear_attention", "mlp", "experts", "router", "norm", "lm_head")


@dataclass(frozen=True)
class Traits:
    """What distinguishes one model family's tensors from the Llama baseline."""

    qkv_bias: bool | str = False  # True, or the config field that switches q/k/v biases on
    o_bias: bool | str = False  # True, or the config field that switches the o_proj bias on
    mlp_bias: bool | str = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (Qwen3)
    attn_output_gate: bool = False  # q_proj also produces a sigmoid gate for the output (Qwen3-Next)
    linear_attention: bool = False  # layer_types may hold Gated DeltaNet layers
    moe: str | None = None  # "qwen" (num_experts, optional shared expert) or "mixtral"
    moe_every_layer: bool = False  # no decoder_sparse_step / mlp_only_layers (Qwen3.5-MoE)
    head_dim_default: int | None = None  # transformers' default when the config has no head_dim
    kv_heads_default: int | None = None  # None: default to num_attention_heads
    sliding_default: int | None = None  # transformers' default sliding_window when absent
    hybrid_interval_default: int = 4  # full_attention_interval when layer_types is absent


_QWEN3_NEXT = Traits(
    qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, attn_output_gate=True,
    linear_attention=True, head_dim_default=256, kv_heads_default=2,
)
_QWEN3_5 = Traits(
    qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, attn_output_gate=True,
    linear_attention=True, head_dim_default=256, kv_heads_default=4,
)
ARCHITECTURES: dict[str, Traits] = {
    "llama": Traits(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": Traits(sliding_default=4096, kv_heads_default=8),
    "qwen2": Traits(qkv_bias=True, kv_heads_default=32),
    "qwen3": Traits(
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, head_dim_default=128,
        kv_heads_default=32,
    ),
    "qwen3_moe": Traits(
        qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, moe="qwen", kv_heads_default=4,
    ),
    "mixtral": Traits(moe="mixtral", kv_heads_default=8),
    "qwen3_next": replace(_QWEN3_NEXT, moe="qwen"),
    "qwen3_5": _QWEN3_5,
    "qwen3_5_text": _QWEN3_5,
    "qwen3_5_moe": replace(_QWEN3_5, moe="qwen", moe_every_layer=True, kv_heads_default=2),
    "qwen3_5_moe_text": replace(_QWEN3_5, moe="qwen", moe_every_layer=True, kv_heads_default=2),
}


@dataclass(frozen=True)
class Weight:
    """``count`` identical tensors of ``shape`` (one per layer, or per layer and expert).

    ``op`` says how a token uses it: "matmul" (2 FLOPs per value per token), "conv" (a depthwise
    convolution: also 2 FLOPs per value per token), "gather" (embedding rows) or "vector" (norm
    weights, biases, gates: elementwise, counted as no FLOPs). ``tp_units`` is the number of units
    (heads, channels, vocabulary rows) tensor parallelism splits this tensor into; 0 = replicated.
    ``tp_groups`` > 0: the units go to devices in that many whole groups when there are at least
    as many groups as devices (query heads with their KV head: 12 query / 4 KV heads over 3
    devices puts 2 groups, 6 query heads, on the first), else one by one.
    ``experts`` > 0 marks one routed expert's tensor out of that many per layer.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    count: int = 1
    op: str = "matmul"
    tp_units: int = 0
    experts: int = 0
    tp_groups: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.count


@dataclass(frozen=True)
class LinearAttentionShape:
    """A Gated DeltaNet layer: per value head a key_dim x value_dim state, fed by a causal conv."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        """q, k and v pass through the short convolution together."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class MoEShape:
    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int = 0  # 0: no shared expert
    shared_gate: bool = False  # a sigmoid gate (hidden -> 1) on the shared expert's output


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only language model, as far as FLOPs, bytes and parameter counts are concerned."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    moe_layers: tuple[bool, ...]  # per layer: is its MLP a mixture of experts
    tie_word_embeddings: bool
    sliding_window: int | None = None
    linear: LinearAttentionShape | None = None
    moe: MoEShape | None = None
    traits: Traits = field(default_factory=Traits)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> int:
        """Layers that keep a KV cache (full or sliding-window attention)."""
        return sum(t in (FULL, SLIDING) for t in self.layer_types)

    @property
    def linear_layers(self) -> int:
        return sum(t == LINEAR for t in self.layer_types)

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """Read a Hugging Face config dict; raise CheckpointError naming a missing or bad field."""
        if not isinstance(config, dict):
            raise CheckpointError(f"a model config must be a JSON object, got {type(config).__name__}")
        outer = config
        if isinstance(config.get("text_config"), dict):
            # A multimodal wrapper: the language model's fields live in text_config; a few
            # (tie_word_embeddings) may sit at the top level only.
            config = {**{k: v for k, v in outer.items() if k != "text_config"}, **outer["text_config"]}
        model_type = config.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"config model_type={model_type!r} is not one the cost model knows: expected one of "
                f"{', '.join(sorted(ARCHITECTURES))}"
            )
        traits = ARCHITECTURES[model_type]
        reader = _Reader(config, model_type)
        hidden = reader.int("hidden_size")
        layers = reader.int("num_hidden_layers")
        heads = reader.int("num_attention_heads")
        vocab = reader.int("vocab_size")
        kv_heads = reader.int("num_key_value_heads", traits.kv_heads_default or heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"config num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        if config.get("head_dim") is None and traits.head_dim_default is None:
            head_dim = _divide(hidden, heads, "hidden_size")  # transformers' fallback
        else:
            head_dim = reader.int("head_dim", traits.head_dim_default)
        layer_types = _layer_types(reader, traits, layers)
        sliding = reader.int("sliding_window", traits.sliding_default) if SLIDING in layer_types else None

        moe, moe_layers = _moe(reader, traits, layers)
        # The dense MLP width; a model whose every MLP is a mixture of experts has none.
        intermediate = reader.int("intermediate_size") if not all(moe_layers) else 0

        linear = None
        if LINEAR in layer_types:
            linear = LinearAttentionShape(
                key_heads=reader.int("linear_num_key_heads", 16),
                value_heads=reader.int("linear_num_value_heads", 32),
                key_dim=reader.int("linear_key_head_dim", 128),
                value_dim=reader.int("linear_value_head_dim", 128),
                conv_kernel=reader.int("linear_conv_kernel_dim", 4),
            )
            if linear.value_heads % linear.key_heads:
                raise CheckpointError(
                    f"config linear_num_value_heads={linear.value_heads} is not a multiple of "
                    f"linear_num_key_heads={linear.key_heads}"
                )
        tie = reader.bool("tie_word_embeddings", False)
        return cls(
            model_type=model_type, hidden_size=hidden, vocab_size=vocab, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
            layer_types=layer_types, moe_layers=moe_layers, tie_word_embeddings=tie,
            sliding_window=sliding, linear=linear, moe=moe, traits=traits,
            qkv_bias=reader.flag(traits.qkv_bias), o_bias=reader.flag(traits.o_bias),
            mlp_bias=reader.flag(traits.mlp_bias),
        )

    def weights(self) -> list[Weight]:
        """Every weight tensor of the model (grouped by identical shape), as transformers builds it."""
        h, v = self.hidden_size, self.vocab_size
        out = [Weight("embed_tokens", "embedding", (v, h), op="gather", tp_units=v)]
        n_attn = self.attention_layers
        if n_attn:
            out += self._attention_weights(n_attn)
        if self.linear_layers:
            out += self._linear_attention_weights(self.linear_layers)
        out += self._mlp_weights()
        out.append(Weight("input_layernorm+post_attention_layernorm", "norm", (h,), 2 * self.num_layers, "vector"))
        out.append(Weight("norm", "norm", (h,), 1, "vector"))
        if not self.tie_word_embeddings:
            out.append(Weight("lm_head", "lm_head", (v, h), tp_units=v))
        return out

    def _attention_weights(self, n: int) -> list[Weight]:
        h, heads, kv, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        q_rows = heads * d * (2 if self.traits.attn_output_gate else 1)
        out = [
            Weight("self_attn.q_proj", "attention", (q_rows, h), n, tp_units=heads, tp_groups=kv),
            Weight("self_attn.k_proj+v_proj", "attention", (kv * d, h), 2 * n, tp_units=kv),
            Weight("self_attn.o_proj", "attention", (h, heads * d), n, tp_units=heads, tp_groups=kv),
        ]
        if self.qkv_bias:
            out += [
                Weight("self_attn.q_proj.bias", "attention", (q_rows,), n, "vector", tp_units=heads, tp_groups=kv),
                Weight("self_attn.k_proj+v_proj.bias", "attention", (kv * d,), 2 * n, "vector", tp_units=kv),
            ]
        if self.o_bias:
            out.append(Weight("self_attn.o_proj.bias", "attention", (h,), n, "vector"))
        if self.traits.qk_norm:
            out.append(Weight("self_attn.q_norm+k_norm", "norm", (d,), 2 * n, "vector"))
        return out

    def _linear_attention_weights(self, n: int) -> list[Weight]:
        la, h = self.linear, self.hidden_size
        assert la is not None
        value = la.value_heads * la.value_dim
        return [
            # in_proj_qkv + in_proj_z (Qwen3.5) == in_proj_qkvz (Qwen3-Next): q, k, v and the output gate z.
            Weight("linear_attn.in_proj_qkvz", "linear_attention", (la.conv_channels + value, h), n,
                   tp_units=la.key_heads),
            # in_proj_b + in_proj_a: per value head, the write strength beta and the decay input a.
            Weight("linear_attn.in_proj_ba", "linear_attention", (2 * la.value_heads, h), n,
                   tp_units=la.key_heads),
            Weight("linear_attn.conv1d", "linear_attention", (la.conv_channels, 1, la.conv_kernel), n, "conv",
                   tp_units=la.key_heads),
            Weight("linear_attn.A_log+dt_bias", "linear_attention", (la.value_heads,), 2 * n, "vector",
                   tp_units=la.key_heads),
            Weight("linear_attn.norm", "norm", (la.value_dim,), n, "vector"),
            Weight("linear_attn.out_proj", "linear_attention", (h, value), n, tp_units=la.key_heads),
        ]

    def _mlp_weights(self) -> list[Weight]:
        h = self.hidden_size
        out = []
        dense = sum(not m for m in self.moe_layers)
        if dense:
            out += _gated_mlp("mlp", "mlp", h, self.intermediate_size, dense, self.mlp_bias)
        n_moe = sum(self.moe_layers)
        if n_moe and self.moe is not None:
            moe = self.moe
            e, i = moe.experts, moe.expert_intermediate
            out += [
                Weight("mlp.gate", "router", (e, h), n_moe),
                Weight("mlp.experts.gate_up_proj", "experts", (2 * i, h), n_moe * e, tp_units=i, experts=e),
                Weight("mlp.experts.down_proj", "experts", (h, i), n_moe * e, tp_units=i, experts=e),
            ]
            if moe.shared_intermediate:
                out += _gated_mlp("mlp.shared_expert", "mlp", h, moe.shared_intermediate, n_moe, False)
            if moe.shared_gate:
                out.append(Weight("mlp.shared_expert_gate", "router", (1, h), n_moe))
        return out


def _gated_mlp(prefix: str, kind: str, hidden: int, inter: int, n: int, bias: bool) -> list[Weight]:
    out = [
        Weight(f"{prefix}.gate_proj+up_proj", kind, (inter, hidden), 2 * n, tp_units=inter),
        Weight(f"{prefix}.down_proj", kind, (hidden, inter), n, tp_units=inter),
    ]
    if bias:
        out += [
            Weight(f"{prefix}.gate_proj+up_proj.bias", kind, (inter,), 2 * n, "vector", tp_units=inter),
            Weight(f"{prefix}.down_proj.bias", kind, (hidden,), n, "vector"),
        ]
    return out


def _divide(a: int, b: int, name: str) -> int:
    if a % b:
        raise CheckpointError(f"config {name}={a} is not a multiple of num_attention_heads={b}; give head_dim")
    return a // b


def _layer_types(reader: _Reader, traits: Traits, layers: int) -> tuple[str, ...]:
    types = reader.raw("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise CheckpointError(
                f"config layer_types must list one type per layer ({layers}), got {types!r}"
            )
        allowed = (FULL, SLIDING, LINEAR) if traits.linear_attention else (FULL, SLIDING)
        for t in types:
            if t not in allowed:
                raise CheckpointError(f"config layer_types holds {t!r}: expected one of {', '.join(allowed)}")
        return tuple(types)
    if traits.linear_attention:
        interval = reader.int("full_attention_interval", traits.hybrid_interval_default)
        return tuple(LINEAR if (i + 1) % interval else FULL for i in range(layers))
    if traits.sliding_default is not None or reader.model_type == "mixtral":
        # Mistral/Mixtral: a sliding_window, when set, applies to every layer.
        window = reader.raw("sliding_window", traits.sliding_default)
        return tuple(SLIDING if window else FULL for _ in range(layers))
    if reader.raw("use_sliding_window", False) and reader.raw("sliding_window", 4096):
        # Qwen2/Qwen3: layers from max_window_layers on use the window.
        first = reader.int("max_window_layers", 28)
        return tuple(SLIDING if i >= first else FULL for i in range(layers))
    return tuple(FULL for _ in range(layers))


def _moe(reader: _Reader, traits: Traits, layers: int) -> tuple[MoEShape | None, tuple[bool, ...]]:
    if traits.moe is None:
        return None, tuple(False for _ in range(layers))
    if traits.moe == "mixtral":
        moe = MoEShape(
            experts=reader.int("num_local_experts", 8),
            top_k=reader.int("num_experts_per_tok", 2),
            expert_intermediate=reader.int("intermediate_size"),
        )
        return moe, tuple(True for _ in range(layers))
    shared = reader.int("shared_expert_intermediate_size", 0, minimum=0)
    # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts (its attribute_map),
    # the published configs as num_experts.
    written_by_v5 = reader.raw("num_experts") is None and reader.raw("num_local_experts") is not None
    count_key = "num_local_experts" if written_by_v5 else "num_experts"
    moe = MoEShape(
        experts=reader.int(count_key),
        top_k=reader.int("num_experts_per_tok"),
        expert_intermediate=reader.int("moe_intermediate_size"),
        shared_intermediate=shared,
        shared_gate=shared > 0,
    )
    if moe.top_k > moe.experts:
        raise CheckpointError(f"config num_experts_per_tok={moe.top_k} exceeds num_experts={moe.experts}")
    if traits.moe_every_layer:
        return moe, tuple(True for _ in range(layers))
    step = reader.int("decoder_sparse_step", 1)
    dense_only = set(reader.raw("mlp_only_layers", None) or [])
    return moe, tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))


class _Reader:
    """Typed access to config fields with errors that name the field and what was expected."""

    def __init__(self, config: dict, model_type: str) -> None:
        self.config = config
        self.model_type = model_type

    def raw(self, key: str, default: object = None) -> object:
        value = self.config.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.config.get(key)
        if value is None:
            if default is None:
                raise CheckpointError(
                    f"the {self.model_type} config has no {key!r}, which the cost model needs "
                    f"(expected an integer >= {minimum})"
                )
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise CheckpointError(f"config {key}={value!r} is invalid: expected an integer >= {minimum}")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise CheckpointError(f"config {key}={value!r} is invalid: expected true or false")
        return value

    def flag(self, spec: bool | str) -> bool:
        """A trait that is either fixed for the family or switched by a config field."""
        return self.bool(spec, False) if isinstance(spec, str) else spec
