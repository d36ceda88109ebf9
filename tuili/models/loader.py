"""Load a checkpoint from a local path: a Hugging Face directory (config.json + safetensors)
or a single GGUF file. Every failure is a CheckpointError that names the path and the problem."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from tuili.config import ModelConfig
from tuili.errors import CheckpointError
from tuili.layers.attention import attention_backend
from tuili.layers.linear import PanelLinear
from tuili.layers.quant import DEFAULT_INT4_GROUP_SIZE
from tuili.models.llama import LlamaForCausalLM
from tuili.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3NextForCausalLM
from tuili.models.weights import GGUF_BLOCK, SliceReader, TensorSource, WeightPlan
from tuili.parallel import pipeline
from tuili.parallel.shard import ShardPlan, TensorShard, check_supported, local_config
from tuili.platform import Platform
from tuili.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tuili.models.gguf import GGUFCheckpoint

logger = logging.getLogger(__name__)


# The network class of each family that does not run as the Llama family.
NETWORKS: dict[str, type[LlamaForCausalLM] | type[Qwen3NextForCausalLM]] = {
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5ForCausalLM,
}

# A multimodal checkpoint (Qwen3_5ForConditionalGeneration) stores its language model under this
# prefix and its vision encoder under VISION_PREFIX.
LANGUAGE_MODEL_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."


@dataclass
class LoadedModel:
    model: LlamaForCausalLM | Qwen3NextForCausalLM | pipeline.StageNetwork
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path
    weight_format: str  # "safetensors" or "gguf"
    quantized: str | None = None  # how linears are held: None (floats), "gguf", "int8" or "int4"


def resolve_model_path(model: str | None) -> Path:
    """The path to load; with none named, the embedded SmolLM2 model (and say so)."""
    if model is None:
        from tuili.models.default_model import default_model_path

        path = default_model_path()
        logger.info("no model named: using the embedded default %s", path.name)
        return path
    path = Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"model path {str(path)!r} does not exist: expected a Hugging Face model directory "
            "(config.json + *.safetensors) or a .gguf file"
        )
    return path


def load_model(
    model: str | None,
    dtype: torch.dtype,
    platform: Platform,
    max_positions: int | None = None,
    quantization: str | None = None,
    packed_dtype: torch.dtype | None = None,
    tensor_parallel: tuple[TensorShard, object] | None = None,
    pipeline_stage: pipeline.PipelineStage | None = None,
) -> LoadedModel:
    """Load `model` with its float weights in `dtype` on `platform`'s device, built whole from
    its weight plan (tuili/models/weights.py) with the platform's attention backend.

    Linear weights stay quantized in two cases: `quantization` ("int8" | "int4") quantizes the
    checkpoint's linears at load (a GGUF file is dequantized first); otherwise, when
    `packed_dtype` is given, a GGUF file's linears in PACKED_GGUF_TYPES are kept as their codes.
    Quantized linears compute in `packed_dtype` (default: `dtype`). With no quantization and no
    packed_dtype every weight is dequantized to `dtype`.

    `tensor_parallel` (this rank's TensorShard, its TensorParallelGroup): build this rank's
    part of the network only (tuili/parallel/shard.py), reading only its slices of the weights;
    the network's config is then the rank's (its heads and channels), LoadedModel.config the
    whole model's.

    `pipeline_stage`: build that stage's layers only (tuili/parallel/pipeline.py), reading only
    their tensors (with `tensor_parallel` too: the rank's slices of them); LoadedModel.config is
    the whole model's."""
    path = resolve_model_path(model)
    read_slice: SliceReader | None = None
    if path.is_file():
        cfg, tensors, shapes, tokenizer, ckpt = _open_gguf(path)
        weight_format = "gguf"
    else:
        cfg, tensors, shapes, tokenizer, read_slice = _open_hf_dir(path)
        ckpt, weight_format = None, "safetensors"
    network_class = NETWORKS.get(cfg.family, LlamaForCausalLM)
    if issubclass(network_class, Qwen3NextForCausalLM):
        mtp = [name for name in tensors if name.startswith("mtp.")]
        if mtp:
            # The multi-token-prediction head is a draft for speculative decoding: held beside
            # the network (model.mtp), run only by speculative_config {"method": "mtp"}.
            logger.info("holding %d multi-token-prediction tensors (mtp.*) for speculative decoding "
                        "(speculative_config method 'mtp')", len(mtp))
    gguf_packed = ckpt if quantization is None and packed_dtype is not None else None
    sharded, network_cfg = None, cfg
    if tensor_parallel is not None:
        shard, group = tensor_parallel
        # Quantization groups (int4's, a GGUF block's 32) are never cut between ranks. A GGUF
        # file's expert stacks are cut by whole blocks where each rank gets one, else read as
        # floats and cut by channel (WeightPlan.experts).
        ffn_unit = DEFAULT_INT4_GROUP_SIZE if quantization == "int4" else GGUF_BLOCK if gguf_packed is not None else 1
        expert_unit = ffn_unit
        if gguf_packed is not None and cfg.moe is not None and -(-cfg.moe.intermediate_size // GGUF_BLOCK) < shard.world:
            expert_unit = 1
        check_supported(cfg, shard, ffn_unit, expert_unit)
        sharded = ShardPlan(shard, cfg, ffn_unit, group, expert_unit)
        network_cfg = local_config(cfg, shard, ffn_unit, expert_unit)
    plan = WeightPlan(
        platform, dtype, tensors, network_class.stacked_projections, str(path), quantization,
        quantized_dtype=packed_dtype or dtype, gguf_packed=gguf_packed, shapes=shapes, sharded=sharded,
        read_slice=read_slice,
    )  # fmt: skip
    max_positions = max_positions or cfg.max_position_embeddings
    if pipeline_stage is not None:
        pipeline.check_supported(cfg, pipeline_stage.world)
        network: LlamaForCausalLM | Qwen3NextForCausalLM | pipeline.StageNetwork = pipeline.StageNetwork(
            network_cfg, pipeline_stage, max_positions, plan, attention_backend(platform, dtype)
        )
    else:
        network = network_class(network_cfg, max_positions, plan, attention_backend(platform, dtype))
    plan.fill(network)
    network = network.to(platform.device).eval()
    panels = sum(isinstance(m, PanelLinear) for m in network.modules())
    if panels:
        logger.info("laid out %d bf16 linears in 16-row panels (PanelLinear)", panels)
    if quantization is not None:
        logger.info("quantized the linears to %s", quantization)
    return LoadedModel(network, cfg, tokenizer, path, weight_format, plan.quantized)


def _open_hf_dir(
    path: Path,
) -> tuple[ModelConfig, TensorSource, dict[str, tuple[int, ...]], Tokenizer | None, SliceReader]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json: expected a Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from e
    cfg = ModelConfig.from_hf_config(raw)
    tensors: TensorSource = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in _safetensors_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
            for name in handle.keys():
                tensors[name] = functools.partial(_read_tensor, handle, name, file)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{file} is truncated or corrupt: {e}") from e
    tensors, shapes = _language_model_tensors(tensors, shapes, path)

    def read_slice(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        # `name` as the plan knows it; tensors[name] reads it under its checkpoint name, which
        # differs for a multimodal checkpoint's language model (_language_model_tensors).
        handle, checkpoint_name, file = tensors[name].args  # type: ignore[attr-defined]
        try:
            sliced = handle.get_slice(checkpoint_name)
            return sliced[(slice(None),) * dim + (slice(start, stop),)]
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{file} is truncated or corrupt: {e}") from e

    return cfg, tensors, shapes, Tokenizer.from_pretrained_dir(path), read_slice


def _language_model_tensors(
    tensors: TensorSource, shapes: dict[str, tuple[int, ...]], path: Path
) -> tuple[TensorSource, dict[str, tuple[int, ...]]]:
    """A multimodal checkpoint's language model under the names a text-only one uses
    (model.language_model.X -> model.X), without its vision encoder (model.visual.*), which tuili
    does not run: it serves text only, and says so. A text-only checkpoint passes unchanged."""
    if not any(name.startswith(LANGUAGE_MODEL_PREFIX) for name in tensors):
        return tensors, shapes
    vision = [name for name in tensors if name.startswith(VISION_PREFIX)]
    if vision:
        logger.info("%s: ignoring %d vision-encoder tensors (%s*): tuili serves this model's language model, "
                    "text in and text out", path, len(vision), VISION_PREFIX)

    def rename(name: str) -> str:
        return "model." + name.removeprefix(LANGUAGE_MODEL_PREFIX) if name.startswith(LANGUAGE_MODEL_PREFIX) else name

    kept = [name for name in tensors if not name.startswith(VISION_PREFIX)]
    return {rename(n): tensors[n] for n in kept}, {rename(n): shapes[n] for n in kept if n in shapes}


def _read_tensor(handle: Any, name: str, file: Path) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{file} is truncated or corrupt: {e}") from e


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shard(s) that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights (only safetensors checkpoints are read)")
    return files


def _open_gguf(
    path: Path,
) -> tuple[ModelConfig, TensorSource, dict[str, tuple[int, ...]], Tokenizer | None, GGUFCheckpoint]:
    from tuili.models.gguf import open_gguf

    ckpt = open_gguf(path)
    cfg = ModelConfig.from_hf_config(ckpt.config)
    tensors: TensorSource = {name: functools.partial(ckpt.load_tensor, name, torch.float32) for name in ckpt.tensor_names()}
    shapes = {name: tuple(ckpt.tensor_info(name).shape) for name in ckpt.tensor_names()}
    hf_tokenizer = ckpt.load_tokenizer()
    # Chat models end a turn with an end-of-turn token that llama.cpp records apart from EOS.
    eot = [ckpt.metadata(key, None) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    tokenizer = Tokenizer(hf_tokenizer, [int(t) for t in eot if t is not None]) if hf_tokenizer else None
    return cfg, tensors, shapes, tokenizer, ckpt
