"""Model and engine configuration: plain dataclasses, validated once at the edge."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from tuili.errors import CheckpointError, TuiliError, UnsupportedModelError
from tuili.platform import Platform
from tuili.pooling import PoolerConfig

# Architectures (as config.json's "architectures" names them) that tuili's Llama-family
# network runs, and what each one changes in that network.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",  # its own network: tuili/models/qwen3_next.py
    "Qwen3_5ForCausalLM": "qwen3_5",  # the hybrid network with Qwen3.5's projections, dense MLPs
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",  # the same, every MLP a mixture of experts
    # Multimodal wrappers of the two (text_config, weights under model.language_model.): tuili
    # runs their language model and ignores the vision encoder (tuili/models/loader.py says so).
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}

# Families whose network is the hybrid one (tuili/models/qwen3_next.py): Gated DeltaNet and gated
# full attention per layer_types.
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

LAYER_TYPES = ("full_attention", "linear_attention")

_REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts MLPs of a model (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE), validated when read."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each routed expert's SwiGLU width (moe_intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: a mixture of experts (else the dense MLP)
    shared_intermediate_size: int = 0  # a shared expert with a sigmoid gate when > 0 (none in Qwen3-MoE)


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5), validated when read."""

    num_k_heads: int  # query/key heads (linear_num_key_heads)
    num_v_heads: int  # value heads, a multiple of num_k_heads (linear_num_value_heads)
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int  # width of the causal depthwise conv over the q/k/v channels (>= 2)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face config.json dict."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2; Llama's and Qwen3's attention_bias)
    o_bias: bool  # bias on the output projection (Llama's and Qwen3's attention_bias)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # None: every layer's MLP is dense
    # Per layer "full_attention" or "linear_attention" (hybrid models); empty: all full attention.
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionConfig | None = None  # set exactly when some layer is linear attention
    rotary_dim: int | None = None  # leading dims of each head that RoPE rotates; None: all (head_dim)
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention, with per-sequence state beside the KV cache."""
        return self.linear is not None

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (full attention)."""
        return self.layer_types.count("full_attention") if self.layer_types else self.num_layers

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        if "text_config" in cfg and "hidden_size" not in cfg:
            # A multimodal wrapper: the language model's fields are in text_config; the wrapper's
            # architectures name the model, and its tie_word_embeddings is the one transformers
            # applies to the whole model (the text_config's is not read).
            outer = cfg
            cfg = {**cfg["text_config"], "architectures": outer.get("architectures")}
            if "tie_word_embeddings" in outer:
                cfg["tie_word_embeddings"] = outer["tie_word_embeddings"]
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        # Qwen3.5-MoE has no dense MLP, hence no intermediate_size.
        required = [k for k in _REQUIRED_FIELDS if not (family == "qwen3_5_moe" and k == "intermediate_size")]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise CheckpointError(f"config is missing required field(s) {missing} for {arch}")
        _refuse_sliding_window(family, cfg)

        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 folds rope_theta into "rope_parameters".
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise UnsupportedModelError(
                    f"rope_scaling type {kind!r} is not supported; supported: 'default', 'llama3'"
                )
            if kind == "default":
                rope_scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(cfg.get("attention_bias", False))
        num_layers = int(cfg["num_hidden_layers"])
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),  # 0: no dense MLP (Qwen3.5-MoE)
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # As transformers builds them: Qwen2's q/k/v bias is unconditional; Llama's and Qwen3's
            # attention_bias covers q, k, v and o; Mistral's attention has no biases at all.
            qkv_bias=family == "qwen2" or (family in _ATTENTION_BIAS_FAMILIES and attention_bias),
            o_bias=family in _ATTENTION_BIAS_FAMILIES and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", *HYBRID_FAMILIES),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=_moe_config(cfg, num_layers, family) if family in ("qwen3_moe", "qwen3_5_moe") or (
                family == "qwen3_next" and _expert_count(cfg) != 0
            ) else None,
            **(_hybrid_fields(cfg, num_layers, int(head_dim)) if family in HYBRID_FAMILIES else {}),
            raw=dict(cfg),
        )  # fmt: skip


def _integer(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"config {key}={value!r} is invalid: expected an integer >= {minimum}")
    return value


def _expert_count(cfg: dict[str, Any]) -> Any:
    """The expert count as written (num_experts or num_local_experts), None when neither is."""
    return next((cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None), None)


def _hybrid_fields(cfg: dict[str, Any], num_layers: int, head_dim: int) -> dict[str, Any]:
    """A hybrid's (Qwen3-Next, Qwen3.5) layer pattern, linear-attention shape and partial rotary,
    each checked once. layer_types is read as written, else built as transformers builds it: every
    `full_attention_interval`-th layer (1-based, default 4) full attention, the others linear.
    partial_rotary_factor defaults to 0.25 when the config has none, as transformers' configs of
    all three families set it."""
    types = cfg.get("layer_types")
    if types is None:
        interval = _integer("full_attention_interval", cfg.get("full_attention_interval", 4), 1)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(
            f"config layer_types={types!r} is invalid: expected {num_layers} entries (num_hidden_layers), "
            f"each one of {', '.join(LAYER_TYPES)}"
        )
    if "full_attention" not in types:
        raise UnsupportedModelError(
            "config layer_types has no full_attention layer: tuili's hybrid models need at least one (the KV cache)"
        )
    fields = {}
    for key, default in (("linear_num_key_heads", None), ("linear_num_value_heads", None),
                         ("linear_key_head_dim", None), ("linear_value_head_dim", None),
                         ("linear_conv_kernel_dim", 4)):  # fmt: skip
        value = cfg.get(key, default)
        if value is None:
            raise CheckpointError(f"config is missing required field {key!r} for a hybrid (Qwen3-Next/Qwen3.5) model")
        fields[key] = _integer(key, value, 2 if key == "linear_conv_kernel_dim" else 1)
    hk, hv = fields["linear_num_key_heads"], fields["linear_num_value_heads"]
    if hv % hk:
        raise CheckpointError(
            f"config linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}"
        )
    linear = LinearAttentionConfig(hk, hv, fields["linear_key_head_dim"], fields["linear_value_head_dim"],
                                   fields["linear_conv_kernel_dim"])  # fmt: skip
    # Published checkpoints write partial_rotary_factor at the top level; transformers >= 5 in
    # rope_parameters.
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(f"config partial_rotary_factor={factor!r} is invalid: expected a number in (0, 1]")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise CheckpointError(
            f"config partial_rotary_factor={factor!r} rotates {rotary_dim} of head_dim={head_dim} dimensions: "
            "expected an even number >= 2"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config hidden_act={act!r} is not supported: the hybrids' conv and MLPs are SiLU")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError("config attention_bias=true is not supported for Qwen3-Next/Qwen3.5 (no checkpoint has it)")
    return dict(layer_types=tuple(types), linear=linear, rotary_dim=rotary_dim)


def _moe_config(cfg: dict[str, Any], num_layers: int, family: str) -> MoEConfig:
    """The expert fields, each checked once: a bad value is named here, not met later as a
    shape error. transformers >= 5 writes the expert count as num_local_experts, the published
    checkpoints as num_experts. Qwen3.5-MoE, as transformers defines it, has a mixture of experts
    in every layer and always renormalises the top-k weights (its config has no
    decoder_sparse_step, mlp_only_layers or norm_topk_prob: any written there are not read)."""

    def integer(key: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise CheckpointError(f"config {key}={value!r} is invalid: expected an integer >= {minimum}")
        return value

    counts = {k: cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None}
    if not counts:
        raise CheckpointError("config has neither num_experts nor num_local_experts: a mixture-of-experts model needs its expert count")
    if len(set(map(repr, counts.values()))) > 1:
        raise CheckpointError(f"config num_experts={counts['num_experts']!r} and num_local_experts="
                              f"{counts['num_local_experts']!r} disagree")
    key, value = next(iter(counts.items()))
    num_experts = integer(key, value, 1)
    for required in ("num_experts_per_tok", "moe_intermediate_size"):
        if cfg.get(required) is None:
            raise CheckpointError(f"config is missing required field {required!r} for a mixture-of-experts model")
    top_k = integer("num_experts_per_tok", cfg["num_experts_per_tok"], 1)
    if top_k > num_experts:
        raise CheckpointError(f"config num_experts_per_tok={top_k} exceeds the number of experts ({num_experts})")
    inter = integer("moe_intermediate_size", cfg["moe_intermediate_size"], 1)
    every_layer = family == "qwen3_5_moe"
    step = 1 if every_layer else integer("decoder_sparse_step", cfg.get("decoder_sparse_step", 1), 1)
    dense = [] if every_layer else cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise CheckpointError(f"config mlp_only_layers={dense!r} is invalid: expected a list of layer indices")
    outside = [i for i in dense if not 0 <= i < num_layers]
    if outside:
        raise CheckpointError(
            f"config mlp_only_layers={dense!r} names layer(s) {outside} outside 0..{num_layers - 1}"
        )
    # transformers' defaults when the config has none: False for Qwen3-MoE, True for Qwen3-Next.
    norm = True if every_layer else cfg.get("norm_topk_prob", family == "qwen3_next")
    if not isinstance(norm, bool):
        raise CheckpointError(f"config norm_topk_prob={norm!r} is invalid: expected true or false")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config hidden_act={act!r} is not supported: tuili's experts are SwiGLU (silu)")
    # As transformers decides it: a layer is sparse unless listed in mlp_only_layers, every
    # decoder_sparse_step-th layer (1-based).
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = _integer("shared_expert_intermediate_size", cfg.get("shared_expert_intermediate_size") or 0, 0)
    return MoEConfig(num_experts, top_k, inter, norm, sparse, shared)


def _refuse_sliding_window(family: str, cfg: dict[str, Any]) -> None:
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        active = bool(cfg.get("use_sliding_window", False)) and window is not None
    else:
        active = window is not None
    if active:
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={window}) is not supported yet; "
            "tuili only runs full attention. Use a checkpoint whose config sets sliding_window to null."
        )


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise TuiliError(f"device={device!r} is invalid: expected 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TuiliError(f"device={device!r} requested but torch sees no CUDA GPU")
    if dev.type not in ("cpu", "cuda"):
        raise TuiliError(f"device={device!r} is not supported: expected 'cpu' or 'cuda'")
    return dev


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def packed_compute_dtype(requested: str | torch.dtype | None, device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype quantized ("packed") linears compute in, or None when GGUF files are to be
    dequantized at load. On a CPU: bf16, where PyTorch's weight-only int4/int8 kernels are fast
    (their fp32 paths are scalar loops), unless float32 was asked for by name: that is the
    exact reference path, with GGUF files dequantized to float32. On a GPU the portable kernels
    only, so GGUF files are dequantized at load and --quantization computes in the working dtype."""
    if device.type != "cpu":
        return None
    if requested in (torch.float32, "float32", "fp32", "float"):
        return None
    return torch.bfloat16


def resolve_dtype(dtype: str | torch.dtype | None, platform: Platform) -> torch.dtype:
    """The working dtype. "auto": fp16 on GPUs without bf16 (V100), bf16 on newer GPUs; on a CPU
    bf16 where tuili's kernels run, else fp32. The kernels read bf16 in place on every CPU (widened
    to float32 in registers where there is no bf16 arithmetic), so bf16 halves the bytes a decode
    step reads; PyTorch's own bf16 products are slower than its fp32 ones on CPUs without
    AVX512-BF16 or AMX (docs/engine.md, Configuration)."""
    device = platform.device
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise TuiliError(f"dtype={dtype} is not supported: expected float32, bfloat16 or float16")
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if platform.native_kernels else torch.float32
    if dtype not in _DTYPES:
        raise TuiliError(f"dtype={dtype!r} is not supported: expected auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


_ATTENTION_BIAS_FAMILIES = ("llama", "qwen3", "qwen3_moe")  # attention_bias on q, k, v and o

# Quantizations of float checkpoints at load (tuili/models/weights.py).
QUANTIZATION_METHODS = ("int8", "int4")

# KV cache storage: the working dtype, or float8 e4m3 with per-head scales ("fp8" as in vLLM).
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# The keys of vLLM's speculative_config that tuili reads, and tuili's own "adaptive".
_SPECULATIVE_KEYS = (
    "method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "quantization",
    "adaptive",
)
SELF_DRAFT = "self"  # speculative_config {"model": "self", "quantization": "int4"}: the target, quantized, drafts


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, from vLLM's `speculative_config` dict (docs/engine.md).

    `method` "ngram" proposes by prompt lookup (the n-gram of `prompt_lookup_min`..`_max`
    tokens ending the text, found earlier in prompt or output); "draft_model" runs `model`, a
    smaller checkpoint with the target's vocabulary, or "self": the target's own checkpoint
    quantized as `quantization` says ("int4" drafting for a bf16 model); "mtp" runs the target
    checkpoint's own multi-token-prediction layers (`mtp.*`). `num_speculative_tokens`
    is the most tokens proposed per sequence per step; with `adaptive` (default) the engine
    proposes fewer, or none, where measured acceptance and step cost say they would not pay."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    quantization: str | None = None
    adaptive: bool = True

    @classmethod
    def parse(cls, value: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Validate vLLM's dict; raises TuiliError naming the bad key and what was expected."""
        if isinstance(value, SpeculativeConfig):
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            raise TuiliError(f"speculative_config={value!r} is invalid: expected a dict such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise TuiliError(f"speculative_config key(s) {unknown} are not supported: expected some of "
                             f"{list(_SPECULATIVE_KEYS)}")
        model = value.get("model")
        method = value.get("method")
        if method is None:  # vLLM infers the method from the model: "ngram" (its old spelling) or a draft
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model" if model is not None else None
            model = None if method == "ngram" else model
        if method not in SPECULATIVE_METHODS:
            raise TuiliError(f"speculative_config method={method!r} is not supported: expected one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")

        def integer(key: str, default: int | None, minimum: int, maximum: int) -> int:
            v = value.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
                raise TuiliError(f"speculative_config {key}={v!r} is invalid: expected an integer in "
                                 f"[{minimum}, {maximum}]")
            return v

        k = integer("num_speculative_tokens", None, 1, 16)
        lo_given, hi_given = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        # vLLM's rule: one bound given sets the other.
        lo = integer("prompt_lookup_min", lo_given if lo_given is not None else (hi_given or 2), 1, 64)
        hi = integer("prompt_lookup_max", hi_given if hi_given is not None else max(lo, 5), 1, 64)
        if lo > hi:
            raise TuiliError(f"speculative_config prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}")
        quantization = value.get("quantization")
        if quantization is not None and quantization not in QUANTIZATION_METHODS:
            raise TuiliError(f"speculative_config quantization={quantization!r} is not supported: expected one "
                             f"of {', '.join(QUANTIZATION_METHODS)}")
        if method == "ngram" and (model is not None or quantization is not None):
            raise TuiliError("speculative_config method='ngram' takes no model or quantization: it needs no draft model")
        if method == "mtp" and (model is not None or quantization is not None):
            raise TuiliError("speculative_config method='mtp' takes no model or quantization: it runs the target "
                             "checkpoint's own multi-token-prediction layers (mtp.*)")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise TuiliError(f"speculative_config model={model!r} is invalid: method 'draft_model' needs a "
                                 f"checkpoint path, or {SELF_DRAFT!r} with a quantization")
            if model == SELF_DRAFT and quantization is None:
                raise TuiliError(f"speculative_config model={SELF_DRAFT!r} needs a quantization ('int4' or 'int8'): "
                                 "the unquantized target drafting for itself cannot be faster")
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise TuiliError(f"speculative_config adaptive={adaptive!r} is invalid: expected true or false")
        return cls(method, k, lo, hi, model, quantization, adaptive)


@dataclass
class EngineConfig:
    """Engine knobs; `validate()` runs once when the engine is built."""

    model: str | None = None
    dtype: str | torch.dtype | None = "auto"
    device: str | None = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    kv_cache_memory: int | None = None  # bytes; None = a default for the device
    # vLLM's name: the KV budget is this fraction of the memory free after loading (CUDA) or of
    # the RAM available (CPU); tuili/engine/pool.py. Excludes kv_cache_memory.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    kv_offload_memory: int = 0  # bytes of host memory for evicted prefix-cache blocks; 0 = off
    # Hybrid models' prefix cache: the linear-attention state is checkpointed every this many
    # KV blocks of a prompt (tuili/engine/state_checkpoints.py); 4 x 16 = every 64 tokens.
    state_checkpoint_interval: int = 4
    hardware: str | None = None  # preset name or spec file for MFU/MBU; None = probed or estimated
    quantization: str | None = None  # "int8" | "int4": quantize the checkpoint's linears at load
    kv_cache_dtype: str = "auto"  # "auto" (the working dtype) or "fp8" (e4m3, per-head scales)
    enforce_eager: bool = False  # no CPU decode graphs (tuili/engine/decode_graphs.py): every step eager
    # While sequences decode, a step's prompt chunks are cut so the step takes about this many
    # times a decode-only step (tuili/engine/pacing.py); None = only max_num_batched_tokens.
    max_itl_stretch: float | None = None
    # One fixed arithmetic order per token: outputs independent of the batch, the prefix cache and
    # the chunking (docs/engine.md, "Batch invariance"); False trades that for the fastest kernels.
    batch_invariant: bool = True
    seed: int = 0
    # Ranks the model is split over (tuili/parallel): 1 runs it whole in this process.
    tensor_parallel_size: int = 1
    # Stages the layers are split over (tuili/parallel/pipeline.py), each tensor_parallel_size
    # ranks: 1 = no pipeline.
    pipeline_parallel_size: int = 1
    # vLLM's dict ({"method": "ngram", "num_speculative_tokens": 4, ...}); None: no speculation
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None
    # Embeddings (LLM.embed, /v1/embeddings): vLLM's dict ({"pooling_type": "LAST" | "MEAN",
    # "normalize": true}); None: LAST, normalized (tuili/pooling.py).
    pooler_config: dict[str, Any] | PoolerConfig | None = None

    def validate(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise TuiliError(f"tensor_parallel_size={tp!r} is invalid: expected an integer >= 1")
        pp = self.pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise TuiliError(f"pipeline_parallel_size={pp!r} is invalid: expected an integer >= 1")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "state_checkpoint_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TuiliError(f"{name}={value!r} is invalid: expected an integer >= 1")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise TuiliError(f"max_model_len={self.max_model_len!r} is invalid: expected an integer >= 2")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory <= 0):
            raise TuiliError(f"kv_cache_memory={self.kv_cache_memory!r} is invalid: expected a positive number of bytes")
        utilization = self.gpu_memory_utilization
        if utilization is not None:
            if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
                raise TuiliError(
                    f"gpu_memory_utilization={utilization!r} is invalid: expected a fraction, 0 < x <= 1"
                )
            if self.kv_cache_memory is not None:
                raise TuiliError(
                    f"gpu_memory_utilization={utilization!r} and kv_cache_memory={self.kv_cache_memory!r} both "
                    "size the KV cache: give one of them"
                )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise TuiliError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: expected one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise TuiliError(
                f"quantization {self.quantization!r} is not supported: expected one of {', '.join(QUANTIZATION_METHODS)}"
            )
        stretch = self.max_itl_stretch
        if stretch is not None and (isinstance(stretch, bool) or not isinstance(stretch, (int, float)) or not stretch > 1):
            raise TuiliError(f"max_itl_stretch={stretch!r} is invalid: expected a number above 1, or None for no limit")
        if not isinstance(self.kv_offload_memory, int) or self.kv_offload_memory < 0:
            raise TuiliError(f"kv_offload_memory={self.kv_offload_memory!r} is invalid: expected bytes >= 0")
        if not isinstance(self.batch_invariant, bool):
            raise TuiliError(f"batch_invariant={self.batch_invariant!r} is invalid: expected True or False")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
