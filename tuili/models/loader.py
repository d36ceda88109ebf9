"""Load a checkpoint from a local path: a Hugging Face directory (config.json + safetensors)
or a single GGUF file. Every failure is a CheckpointError that names the path and the problem."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tuili.config import ModelConfig
from tuili.errors import CheckpointError
from tuili.layers.linear import pack_linears
from tuili.models.llama import LlamaForCausalLM
from tuili.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tuili.models.gguf import GGUFCheckpoint

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
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
    device: torch.device,
    max_positions: int | None = None,
    quantization: str | None = None,
    packed_dtype: torch.dtype | None = None,
) -> LoadedModel:
    """Load `model` with its float weights in `dtype` on `device`.

    Linear weights stay quantized ("packed", tuili/layers/quant.py) in two cases:
    `quantization` ("int8" | "int4") quantizes the checkpoint's linears at load (a GGUF file is
    dequantized first); otherwise, when `packed_dtype` is given, a GGUF file's Q4_0, Q4_1 and Q8_0
    linears are kept as stored. Packed linears compute in `packed_dtype` (default: `dtype`).
    With no quantization and no packed_dtype every weight is dequantized to `dtype`.

    On a CPU with AMX, the decoder layers' bf16 linears are then laid out once for the AMX
    kernel (tuili/layers/linear.py PackedLinear); the logits keep reading the row-major matrix
    (a tied one is also the token lookup's table)."""
    path = resolve_model_path(model)
    if quantization is not None:
        from tuili.layers.quant import check_quantization_method

        check_quantization_method(quantization)
    keep_gguf = packed_dtype if quantization is None else None
    if path.is_file():
        loaded = _load_gguf(path, dtype, device, max_positions, keep_gguf)
    else:
        loaded = _load_hf_dir(path, dtype, device, max_positions)
    if quantization is not None:
        _quantize(loaded, quantization, packed_dtype or dtype)
    if device.type == "cpu":
        packed = pack_linears(loaded.model.model.layers)
        if packed:
            logger.info("laid out %d bf16 linears for AMX tiles (PackedLinear)", packed)
    return loaded


def _quantize(loaded: LoadedModel, method: str, compute_dtype: torch.dtype) -> None:
    """Quantize every linear in place; a tied model's logits get an int8 copy of the embedding
    matrix (the token lookup keeps reading the float one), as llama.cpp keeps its output
    matrix at 8 bits: the logits are the most sensitive projection."""
    from tuili.layers.quant import make_linear, quantize_int8, quantize_model

    model = loaded.model
    report = quantize_model(model, method, compute_dtype=compute_dtype)
    if model.lm_head is None:
        embedding = model.model.embed_tokens.weight
        model.lm_head = make_linear(quantize_int8(embedding, compute_dtype), None, compute_dtype).to(embedding.device)
    loaded.quantized = method
    logger.info(
        "quantized %d linears to %s: %.1f MB packed instead of %.1f MB",
        report.linears, method, report.packed_bytes / 1e6, report.original_bytes / 1e6,
    )


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device, max_positions: int | None) -> LoadedModel:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json: expected a Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from e
    cfg = ModelConfig.from_hf_config(raw)
    files = _safetensors_files(path)

    def tensors() -> Iterable[tuple[str, Callable[[], torch.Tensor]]]:
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
                for name in handle.keys():
                    yield name, (lambda h=handle, n=name: h.get_tensor(n))
            except (SafetensorError, OSError, RuntimeError) as e:
                raise CheckpointError(f"{file} is truncated or corrupt: {e}") from e

    model = _build(cfg, tensors(), dtype, device, max_positions or cfg.max_position_embeddings, str(path))
    return LoadedModel(model, cfg, Tokenizer.from_pretrained_dir(path), path, "safetensors")


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


def _load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device, max_positions: int | None, packed_dtype: torch.dtype | None
) -> LoadedModel:
    from tuili.models.gguf import open_gguf

    ckpt = open_gguf(path)
    cfg = ModelConfig.from_hf_config(ckpt.config)
    modules = _gguf_packed_modules(ckpt, packed_dtype) if packed_dtype is not None else {}
    tensors = ((name, (lambda n=name: ckpt.load_tensor(n, torch.float32))) for name in ckpt.tensor_names())
    model = _build(cfg, tensors, dtype, device, max_positions or cfg.max_position_embeddings, str(path), modules)
    if modules:
        from tuili.layers.quant import gguf_packed_logits

        model.packed_logits = gguf_packed_logits(ckpt, packed_dtype)
    hf_tokenizer = ckpt.load_tokenizer()
    # Chat models end a turn with an end-of-turn token that llama.cpp records apart from EOS.
    eot = [ckpt.metadata(key, None) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    tokenizer = Tokenizer(hf_tokenizer, [int(t) for t in eot if t is not None]) if hf_tokenizer else None
    return LoadedModel(model, cfg, tokenizer, path, "gguf", "gguf" if modules else None)


def _gguf_packed_modules(ckpt: GGUFCheckpoint, compute_dtype: torch.dtype) -> dict[str, nn.Module]:
    """The decoder linears of the file that can run as stored (Q4_0/Q4_1/Q8_0), by module path.
    The output matrix stays a float matrix in the working dtype, beside a packed copy for
    decode-sized logits (LlamaForCausalLM.packed_logits): the packed kernels are slow for many
    rows of a vocabulary-sized matrix."""
    from tuili.layers.quant import gguf_packed_linears

    return dict(gguf_packed_linears(ckpt, LlamaForCausalLM.packed_modules, compute_dtype).modules)


def _build(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]],
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    source: str,
    modules: dict[str, nn.Module] | None = None,
) -> LlamaForCausalLM:
    """Construct the network without allocating weights, install the prebuilt `modules` (by
    module path, e.g. quantized linears), then assign each checkpoint tensor (cast to the
    working dtype) by name; every remaining parameter must be covered exactly once.
    Checkpoint tensors of a packed parameter (q/k/v -> qkv_proj) are stacked in order."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    for path, module in (modules or {}).items():
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, module)
    params = dict(model.named_parameters())
    packed_into = {part: (fused, i) for fused, parts in model.packed_modules.items() for i, part in enumerate(parts)}
    loaded: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, load in tensors:
        target, index = _packed_target(name, packed_into)
        if target not in params:
            continue  # e.g. lm_head.weight beside tied embeddings, rotary inv_freq buffers
        tensor = load().to(device=device, dtype=dtype)
        if index is None:
            loaded[target] = tensor
        else:
            parts.setdefault(target, {})[index] = tensor
    for target, pieces in parts.items():
        fused = target.split(".")[-2]
        if len(pieces) == len(model.packed_modules[fused]):
            loaded[target] = torch.cat([pieces[i] for i in range(len(pieces))])
    for name, tensor in loaded.items():
        if tensor.shape != params[name].shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(params[name].shape)} from the config"
            )
    missing = sorted(set(params) - set(loaded))
    if missing:
        names = [_checkpoint_names(m, model.packed_modules, parts.get(m, {})) for m in missing]
        flat = [n for group in names for n in group]
        shown = ", ".join(flat[:5]) + (f" and {len(flat) - 5} more" if len(flat) > 5 else "")
        raise CheckpointError(f"{source} lacks weights the config requires: {shown}")
    model.load_state_dict(loaded, strict=False, assign=True)
    return model.to(device).eval()


def _packed_target(name: str, packed_into: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """'...self_attn.k_proj.weight' -> ('...self_attn.qkv_proj.weight', 1); others unchanged."""
    *prefix, module, leaf = name.split(".")
    if module in packed_into:
        fused, index = packed_into[module]
        return ".".join([*prefix, fused, leaf]), index
    return name, None


def _checkpoint_names(param: str, packed: dict[str, tuple[str, ...]], present: dict[int, torch.Tensor]) -> list[str]:
    """The checkpoint tensor names a missing parameter stands for (only the absent parts)."""
    *prefix, module, leaf = param.split(".")
    if module not in packed:
        return [param]
    return [".".join([*prefix, part, leaf]) for i, part in enumerate(packed[module]) if i not in present]
