"""What a model path holds, read from headers only: its config and the bytes its weights really take.

A Hugging Face directory gives config.json and the safetensors headers (each tensor's dtype, shape
and byte range: quantized checkpoints' scales and zero points included). A GGUF file gives the
config its loader derives and every tensor's real GGUF type and size. No tensor data is read.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tuili.errors import CheckpointError
from tuili.perf.cost import CheckpointBytes
from tuili.perf.shapes import KINDS

# Parts of multimodal / multi-token-prediction checkpoints that a decode step of the language model
# never reads.
_OUTSIDE_LANGUAGE_MODEL = {"visual", "vision_tower", "vision_model", "multi_modal_projector", "mtp", "audio_tower"}


@dataclass(frozen=True)
class ModelSource:
    path: Path
    config: dict
    weights: CheckpointBytes | None  # None: a bare config.json, no tensors to measure


def read_config(path: str | os.PathLike) -> dict:
    """A config.json file as a dict."""
    p = Path(path)
    try:
        config = json.loads(p.read_text())
    except OSError as e:
        raise CheckpointError(f"cannot read config {str(p)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{p} must hold a JSON object, got {type(config).__name__}")
    return config


def read_model(path: str | os.PathLike) -> ModelSource:
    """A Hugging Face checkpoint directory, a config.json, or a GGUF file."""
    p = Path(path)
    if p.is_dir():
        config_path = p / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{p} has no config.json: expected a Hugging Face checkpoint directory")
        files = sorted(p.glob("*.safetensors"))
        weights = _safetensors_bytes(files) if files else None
        return ModelSource(p, read_config(config_path), weights)
    if p.suffix.lower() == ".gguf":
        return _gguf(p)
    if p.suffix.lower() == ".json":
        return ModelSource(p, read_config(p), None)
    if not p.exists():
        raise CheckpointError(f"model path {str(p)!r} does not exist")
    raise CheckpointError(f"{p} is neither a checkpoint directory, a config.json nor a .gguf file")


def tensor_kind(name: str) -> str | None:
    """The cost model's kind of a Hugging Face tensor name (scales and zero points of quantized
    weights go with their weight); None for tensors outside the language model."""
    parts = name.split(".")
    if _OUTSIDE_LANGUAGE_MODEL.intersection(parts):
        return None
    module = parts[-2] if len(parts) >= 2 else ""
    if "embed_tokens" in parts:
        return "embedding"
    if parts[0] == "lm_head":
        return "lm_head"
    if "norm" in module:
        return "norm"
    if "experts" in parts:
        return "experts"
    if module in ("gate", "shared_expert_gate") and any(p in ("mlp", "block_sparse_moe") for p in parts):
        return "router"
    if "mlp" in parts:
        return "mlp"
    if "self_attn" in parts:
        return "attention"
    if "linear_attn" in parts:
        return "linear_attention"
    return None


def _tally(sizes: list[tuple[str, int]], source: str) -> CheckpointBytes:
    by_kind = dict.fromkeys(KINDS, 0)
    ignored = 0
    for name, nbytes in sizes:
        kind = tensor_kind(name)
        if kind is None:
            ignored += nbytes
        else:
            by_kind[kind] += nbytes
    return CheckpointBytes(by_kind, source, ignored)


def _safetensors_bytes(files: list[Path]) -> CheckpointBytes:
    sizes = []
    dtypes: Counter[str] = Counter()
    for f in files:
        for name, info in _safetensors_header(f).items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            sizes.append((name, end - start))
            dtypes[info["dtype"]] += 1
    summary = ", ".join(f"{d} x{n}" for d, n in dtypes.most_common())
    return _tally(sizes, f"{len(files)} safetensors file(s): {summary}")


def _safetensors_header(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100_000_000:
                raise ValueError("header length out of range")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a malformed safetensors header")
    return header


def _gguf(path: Path) -> ModelSource:
    from tuili.models.gguf import open_gguf

    checkpoint = open_gguf(path)
    infos = [checkpoint.tensor_info(name) for name in checkpoint.tensor_names()]
    types = Counter(info.ggml_type.name for info in infos)
    summary = ", ".join(f"{t} x{n}" for t, n in types.most_common())
    weights = _tally([(name, info.n_bytes) for name, info in zip(checkpoint.tensor_names(), infos, strict=True)],
                     f"GGUF {path.name}: {summary}")
    return ModelSource(path, checkpoint.config, weights)
