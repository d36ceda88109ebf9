"""GGUF checkpoints: one llama.cpp file holding metadata, tensors and the tokenizer.

`open_gguf` validates the file once (magic, version 3, every byte it names present, a supported
architecture and tensor types) and returns a `GGUFCheckpoint` that speaks Hugging Face: a
config.json-style dict, tensors under Hugging Face names in Hugging Face layout (what llama.cpp's
convert_hf_to_gguf.py split, reordered or rescaled is put back: GGUFTensorInfo), and a
transformers tokenizer with the chat template. Tensors stay memory-mapped until asked for, and are
then dequantized by the vectorized torch code at the end of this module.
"""

from __future__ import annotations

import inspect
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from tuili.errors import CheckpointError, UnsupportedModelError
from tuili.layers.quant.formats import Int4Weight, Int8GroupWeight, Int8Weight, QuantizedWeight

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

GGUF_VERSION = 3
# llama.cpp stores Mistral models as "llama": the same network, run with full attention.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe")
_HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
_HYBRID = ("qwen3next", "qwen35", "qwen35moe")  # Gated DeltaNet and gated full attention
_MOE = ("qwen3moe", "qwen3next", "qwen35moe")
_OFFSET_NORMS = _HYBRID  # RMSNorm weights centred on zero (scale 1 + w): stored as 1 + w
_TILED_VALUE_HEADS = ("qwen35", "qwen35moe")  # see GGUFCheckpoint._grouped_value_heads
# llama.cpp's Llama 3 converter drops rope_scaling's original context length; Llama 3 used 8192.
_LLAMA3_ORIGINAL_CONTEXT = 8192

# GGUF tensor names (llama.cpp's) → Hugging Face names.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per layer, by architecture: a tensor another architecture uses (a Mixtral-style "llama" file's
# experts, say) has no place here and is refused, not silently left unread.
_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_DENSE_MLP = {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_DELTANET = {
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_conv1d": "linear_attn.conv1d",  # stored [C, K]; HF [C, 1, K]
}
# Qwen3.5's DeltaNet projections, stored apart (Qwen3-Next's: split or fused, below)
_DELTANET_35 = _DELTANET | {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
}
_HYBRID_NORM = {"post_attention_norm": "post_attention_layernorm"}
_ROUTER = {"ffn_gate_inp": "mlp.gate"}
_LAYER_TENSORS = {
    "llama": _ATTENTION | _DENSE_MLP,
    "qwen2": _ATTENTION | _DENSE_MLP,
    "qwen3": _ATTENTION | _DENSE_MLP,
    "qwen3moe": _ATTENTION | {"ffn_norm": "post_attention_layernorm"} | _ROUTER,
    "qwen3next": _ATTENTION | _HYBRID_NORM | _ROUTER | _SHARED_EXPERT | _DELTANET | {"ssm_ba": "linear_attn.in_proj_ba"},
    "qwen35": _ATTENTION | _HYBRID_NORM | {k: v for k, v in _DENSE_MLP.items() if k != "ffn_norm"} | _DELTANET_35,
    "qwen35moe": _ATTENTION | _HYBRID_NORM | _ROUTER | _SHARED_EXPERT | _DELTANET_35,
}
# Tensors the converter renamed whole (no ".weight"/".bias" of theirs left): GGUF layer tensor,
# suffix included → Hugging Face name within the layer.
_DELTANET_WHOLE = {
    "ssm_a": "linear_attn.A_log",  # stored as -exp(A_log)
    "ssm_dt.bias": "linear_attn.dt_bias",
}
_LAYER_TENSORS_WHOLE = {arch: _DELTANET_WHOLE for arch in _HYBRID}
# Hugging Face tensors the converter split: each GGUF part → (the HF tensor, the part's place).
# A mixture of experts' matrices are stacked [experts, out, in] (ffn_*_exps); the HF tensors are
# transformers' fused 3-D ones, which WeightPlan.experts reads as they are.
_EXPERTS = {
    "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj", 0),
    "ffn_up_exps.weight": ("mlp.experts.gate_up_proj", 1),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", 0),
}
_LAYER_TENSOR_PARTS = {
    "qwen3moe": _EXPERTS,
    "qwen35moe": _EXPERTS,
    "qwen3next": _EXPERTS | {
        # the DeltaNet input projection: [q, k, v] of all heads, then z (_qkvz_rows)
        "attn_qkv.weight": ("linear_attn.in_proj_qkvz.weight", 0),
        "attn_gate.weight": ("linear_attn.in_proj_qkvz.weight", 1),
    },
}
_SPLIT = {"gate_up_proj": 2, "in_proj_qkvz": 2}  # HF leaf module → how many GGUF parts make it
# qwen3next's and qwen35's multi-token-prediction block: llama.cpp appends it as the last block(s) (its
# nextn_predict_layers), its own tensors named nextn.*; Hugging Face names them mtp.*
# (mtp.layers.N.* for the decoder layers).
_NEXTN_TENSORS = {
    "nextn.eh_proj": "mtp.fc",
    "nextn.enorm": "mtp.pre_fc_norm_embedding",
    "nextn.hnorm": "mtp.pre_fc_norm_hidden",
    "nextn.shared_head_norm": "mtp.norm",
}
# What undoes the converter's arithmetic on a tensor's values.
_VALUE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "A_log": lambda a: torch.log(-a),  # llama.cpp stores -exp(A_log)
    # llama.cpp stores the hybrids' zero-centred RMSNorm weights as 1 + w. Subtracting 1 is exact
    # for stored values in [0.5, 2], so 1 + w recomputed equals the stored value.
    "minus_one": lambda w: w - 1,
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([\w.]+?)(\.weight|\.bias|)")
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3 rope scaling, folded into the config
_REQUIRED = object()  # marks a metadata key without a default


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as the file stores it."""

    name: str  # the GGUF name
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major order: GGUF lists dimensions innermost first
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """A Hugging Face tensor and how it is made from the file's tensors (`parts`, most often one).

    The parts are read as rows (a 1-D tensor: one value a row; else the last dimension a row),
    concatenated, taken in `rows` order when set (HF row i is row rows[i]: llama's q/k rows that
    llama.cpp permuted per head, a split projection interleaved back), their columns in `columns`
    order when set (qwen35's out_proj), mapped value by value by `values` when set (what undoes the converter's arithmetic, see _VALUE_MAPS), and reshaped to
    `shape`, the Hugging Face shape."""

    parts: tuple[StoredTensor, ...]
    shape: tuple[int, ...]
    rows: torch.Tensor | None = None
    values: str | None = None
    rope_heads: int | None = None  # set for llama q/k projections, whose rows llama.cpp permuted per head
    columns: torch.Tensor | None = None  # HF column j is stored column columns[j]

    @property
    def gguf_name(self) -> str:
        return " + ".join(p.name for p in self.parts)

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        """The parts' type (the first part's where they differ, which llama.cpp's converter does
        not write for tensors split from one)."""
        return self.parts[0].ggml_type

    @property
    def n_bytes(self) -> int:
        return sum(p.n_bytes for p in self.parts)


def open_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Open and validate a GGUF v3 file; every problem is a CheckpointError naming the file."""
    path = Path(path)
    _check_header(path)
    try:
        reader = _READER(path)
    except _PastEnd as e:
        raise CheckpointError(
            f"{path} is truncated: it has {e.size} bytes but its header and tensor table need "
            f"{e.needed} (an interrupted download or copy?)"
        ) from e
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as e:
        raise CheckpointError(f"{path} is a corrupt GGUF file: {e}") from e
    except OSError as e:
        raise CheckpointError(f"{path} cannot be memory-mapped: {e.strerror}") from e
    return GGUFCheckpoint(path, reader)


class GGUFCheckpoint:
    """A validated GGUF file, presented with Hugging Face names, layout and config keys."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self._reader = reader
        self._bytes = reader.data.view(np.ndarray)  # the whole file, memory-mapped
        self.architecture = self._architecture()
        self._tensors = self._tensor_table()
        self.config = self._config()
        self.chat_template: str | None = self.metadata("tokenizer.chat_template", None)

    # -- tensors -------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """Hugging Face names of the tensors in the file, in file order."""
        return list(self._tensors)

    def tensor_info(self, hf_name: str) -> GGUFTensorInfo:
        """How the tensor `hf_name` is stored: its GGUF name, type, shape and place in the file."""
        info = self._tensors.get(hf_name)
        if info is None:
            raise CheckpointError(f"{self.path} has no tensor {hf_name!r}")
        return info

    def raw_tensor(self, hf_name: str) -> np.ndarray:
        """The tensor's bytes as stored (quantized, GGUF row order), memory-mapped and read-only;
        only for a tensor stored whole, as one GGUF tensor."""
        info = self.tensor_info(hf_name)
        if len(info.parts) != 1:
            raise CheckpointError(f"{self.path}: {hf_name} is stored in {len(info.parts)} parts ({info.gguf_name})")
        return self._stored_bytes(info.parts[0])

    def load_tensor(self, hf_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor `hf_name`, dequantized, in Hugging Face layout ([out, in] for linear weights)."""
        info = self.tensor_info(hf_name)
        rows = torch.cat([_as_rows(dequantize(self._stored_bytes(p), p.ggml_type, p.shape)) for p in info.parts])
        if info.rows is not None:
            rows = rows[info.rows]
        if info.columns is not None:
            rows = rows[:, info.columns]
        if info.values is not None:
            rows = _VALUE_MAPS[info.values](rows)
        return rows.reshape(info.shape).to(dtype)

    def runs_packed(self, hf_name: str) -> bool:
        """Whether the tensor is one the packed kernels read as stored (quantized_tensor): a
        matrix, or a mixture of experts' stack of matrices [experts, out, in], whose parts are
        all of one packed type, its values as stored."""
        info = self.tensor_info(hf_name)
        return (
            len(info.shape) in (2, 3)
            and info.values is None
            and len({p.ggml_type for p in info.parts}) == 1
            and info.ggml_type in PACKED_GGUF_TYPES
            # blocks run along the columns: a column order must move whole blocks
            and (info.columns is None or _whole_groups(info.columns, GGML_QUANT_SIZES[info.ggml_type][0]) is not None)
        )

    def quantized_tensor(self, hf_name: str) -> QuantizedWeight:
        """The tensor `hf_name` as stored, not dequantized (PACKED_GGUF_TYPES: quantized_weight),
        in Hugging Face row order; a stack of experts' matrices [E, out, in] as its [E * out, in]
        rows (expert e's are rows e * out .. (e + 1) * out)."""
        info = self.tensor_info(hf_name)
        parts = [quantized_weight(self._stored_bytes(p), p.ggml_type, _rows_shape(p.shape)) for p in info.parts]
        weight = parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)  # type: ignore[arg-type]
        # Whole rows move (llama's q/k order, a split projection's), so whole rows of blocks do.
        if info.rows is not None:
            weight = _take_rows(weight, info.rows)
        if info.columns is not None:
            weight = _take_columns(weight, info.columns, hf_name)
        return weight

    def _stored_bytes(self, part: StoredTensor) -> np.ndarray:
        return self._bytes[part.offset : part.offset + part.n_bytes]

    # -- tokenizer -----------------------------------------------------------------------

    def load_tokenizer(self) -> PreTrainedTokenizerFast | None:
        """The tokenizer stored in the metadata, with its chat template; None if the file has none.

        transformers builds it from the metadata. PreTrainedTokenizerFast is asked directly rather
        than AutoTokenizer, which first derives a model config from the file with the slow generic
        GGUF reader only to pick a tokenizer class (much slower: docs/kernels.md, Measured
        crossovers); the tokenizer itself comes from the same GGUF converter either way.
        """
        if "tokenizer.ggml.model" not in self._reader.fields:
            return None
        from transformers import PreTrainedTokenizerFast  # importing transformers takes seconds

        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(
                str(self.path.parent), gguf_file=self.path.name
            )
        except (ValueError, KeyError, IndexError, OSError, NotImplementedError) as e:
            raise CheckpointError(f"{self.path}: cannot build a tokenizer from its metadata: {e}") from e
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        return tokenizer

    # -- reading the metadata ------------------------------------------------------------

    def metadata(self, key: str, default: Any = _REQUIRED) -> Any:
        """The value of a GGUF metadata key; a CheckpointError if it is absent and has no default."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path} lacks the metadata key {key!r}")
            return default
        return _field_value(field)

    def _arch_meta(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.metadata(f"{self.architecture}.{key}", default)

    def _architecture(self) -> str:
        arch = self.metadata("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path} holds a {arch!r} model; tuili runs the GGUF architectures "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Mistral models are stored as 'llama')"
            )
        window = self.metadata(f"{arch}.attention.sliding_window", None)
        if window:
            raise UnsupportedModelError(
                f"{self.path} uses sliding-window attention ({arch}.attention.sliding_window = {window}), "
                "which tuili does not support yet; it only runs full attention"
            )
        return arch

    def _head_counts(self) -> tuple[int, int]:
        heads = self._arch_meta("attention.head_count")
        kv_heads = self._arch_meta("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # one value per layer
            if len(set(kv_heads)) != 1:
                raise UnsupportedModelError(
                    f"{self.path}: layers with different numbers of KV heads {sorted(set(kv_heads))} "
                    "are not supported"
                )
            kv_heads = kv_heads[0]
        return heads, kv_heads

    def _tensor_table(self) -> dict[str, GGUFTensorInfo]:
        placed: dict[str, list[tuple[int, StoredTensor]]] = {}
        main_blocks = self._main_block_count()
        for t in self._reader.tensors:
            if t.name == _ROPE_FREQS:
                continue
            place = _hf_place(self.architecture, t.name, main_blocks)
            if place is None:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name!r} has no place in tuili's {self.architecture} network"
                )
            if t.tensor_type not in _DEQUANTIZERS:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which tuili cannot "
                    f"dequantize; supported types: {', '.join(q.name for q in _DEQUANTIZERS)}"
                )
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            stored = StoredTensor(t.name, t.tensor_type, shape, int(t.data_offset), int(t.n_bytes))
            hf_name, index = place
            placed.setdefault(hf_name, []).append((index, stored))
        table: dict[str, GGUFTensorInfo] = {}
        for hf_name, indexed in placed.items():
            indexed.sort(key=lambda item: item[0])
            parts = tuple(stored for _, stored in indexed)
            expected = _SPLIT.get(hf_name.removesuffix(".weight").rpartition(".")[2], 1)
            if [i for i, _ in indexed] != list(range(expected)):
                raise CheckpointError(
                    f"{self.path}: {hf_name} is stored in {expected} GGUF tensors, but the file has "
                    f"{len(parts)} of them ({', '.join(p.name for p in parts)})"
                )
            table[hf_name] = self._tensor_info(hf_name, parts)
        return table

    def _main_block_count(self) -> int:
        """Blocks of the network itself: llama.cpp counts a multi-token-prediction block in
        block_count and says how many with nextn_predict_layers."""
        return self._arch_meta("block_count") - self._arch_meta("nextn_predict_layers", 0)

    def _tensor_info(self, hf_name: str, parts: tuple[StoredTensor, ...]) -> GGUFTensorInfo:
        """How the Hugging Face tensor `hf_name` is made from `parts` (checked against each other
        and the metadata)."""
        first = parts[0]
        module = hf_name.split(".")[-2] if hf_name.endswith((".weight", ".bias")) else hf_name.rpartition(".")[2]
        if module == "gate_up_proj":  # [E, I, H] gate and up → [E, 2I, H]: per expert, gate rows then up rows
            if parts[1].shape != first.shape or len(first.shape) != 3:
                raise CheckpointError(
                    f"{self.path}: {first.name} {first.shape} and {parts[1].name} {parts[1].shape} "
                    "should be [experts, expert width, hidden] alike"
                )
            experts, width, hidden = first.shape
            rows = torch.arange(2 * experts * width).view(2, experts, width).transpose(0, 1).reshape(-1)
            return GGUFTensorInfo(parts, (experts, 2 * width, hidden), rows)
        if module == "in_proj_qkvz":
            return GGUFTensorInfo(parts, *self._qkvz_rows(parts))
        shape = first.shape
        if module == "conv1d":  # [C, K] → [C, 1, K], the checkpoint's depthwise conv weight
            shape = (first.shape[0], 1, first.shape[-1])
        values = None
        if module == "A_log":
            values = "A_log"
        elif self.architecture in _OFFSET_NORMS and first.name.endswith("norm.weight") and ".ssm_norm." not in first.name:
            values = "minus_one"  # the converter adds 1 to every norm but the DeltaNet's gated one
        rows, columns, rope_heads = None, None, None
        # llama.cpp reorders q/k rows for its rope layout only in files it labels "llama".
        if self.architecture == "llama" and module in ("q_proj", "k_proj"):
            heads, kv_heads = self._head_counts()
            rope_heads = heads if module == "q_proj" else kv_heads
            if first.shape[0] % (2 * rope_heads) != 0:
                raise CheckpointError(
                    f"{self.path}: tensor {first.name!r} has {first.shape[0]} rows, which cannot be "
                    f"{rope_heads} heads of an even size"
                )
            rows = _undo_rope_permutation(torch.arange(first.shape[0]), rope_heads)
        if self.architecture in _TILED_VALUE_HEADS and hf_name.startswith("model.layers."):
            rows, columns = self._grouped_value_heads(module, first)
        return GGUFTensorInfo(parts, shape, rows, values, rope_heads, columns)

    def _grouped_value_heads(self, module: str, stored: StoredTensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The row and column orders that undo qwen35's value-head reordering (none when Hv = Hk).

        For ggml's broadcasting, the converter stores Qwen3.5's value heads tiled over the key heads
        ([v0 of every key head, v1 of every key head, ...]) where Hugging Face groups them by key
        head ([the r = Hv/Hk value heads of key head 0, ...]): in the v rows of in_proj_qkv and the
        v channels of conv1d, the rows of in_proj_z, in_proj_b, in_proj_a, the values of A_log and
        dt_bias, and the columns of out_proj."""
        hk, hv = self._arch_meta("ssm.group_count"), self._arch_meta("ssm.time_step_rank")
        key = 2 * hk * self._arch_meta("ssm.state_size")  # q and k channels, never reordered
        dv = self._arch_meta("ssm.inner_size") // max(hv, 1)
        if hk == hv or module not in ("in_proj_qkv", "conv1d", "in_proj_z", "in_proj_b", "in_proj_a", "A_log",
                                      "dt_bias", "out_proj"):  # fmt: skip
            return None, None

        def grouped(size: int) -> torch.Tensor:  # HF index → stored index over hv heads of `size`
            return torch.arange(hv * size).view(hv // hk, hk, size).transpose(0, 1).reshape(-1)

        if module in ("in_proj_qkv", "conv1d"):
            order = torch.cat([torch.arange(key), key + grouped(dv)])
        else:
            order = grouped(dv if module in ("in_proj_z", "out_proj") else 1)
        axis = -1 if module == "out_proj" else 0
        if stored.shape[axis] != len(order):
            raise CheckpointError(
                f"{self.path}: {stored.name} {stored.shape} does not fit {hk} key heads and {hv} value heads "
                f"of {dv} ({len(order)} {'columns' if axis else 'rows'} expected)"
            )
        return (None, order) if module == "out_proj" else (order, None)

    def _qkvz_rows(self, parts: tuple[StoredTensor, ...]) -> tuple[tuple[int, ...], torch.Tensor]:
        """The HF shape and row order of a DeltaNet's in_proj_qkvz from llama.cpp's attn_qkv (q of
        every key head, then k, then v of every value head) and attn_gate (z of every value head):
        HF groups the rows by key head, [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] with r = Hv/Hk."""
        qkv, gate = parts
        hk, dk = self._arch_meta("ssm.group_count"), self._arch_meta("ssm.state_size")
        hv, value = self._arch_meta("ssm.time_step_rank"), self._arch_meta("ssm.inner_size")
        key = hk * dk
        hidden = qkv.shape[-1]
        if hv % hk or value % hk or qkv.shape != (2 * key + value, hidden) or gate.shape != (value, hidden):
            raise CheckpointError(
                f"{self.path}: {qkv.name} {qkv.shape} and {gate.name} {gate.shape} do not fit "
                f"{hk} key heads of {dk} and {hv} value heads ({value} values) on {hidden} inputs"
            )
        q = torch.arange(key).view(hk, dk)
        v = 2 * key + torch.arange(value).view(hk, value // hk)
        rows = torch.cat([q, key + q, v, value + v], dim=1).reshape(-1)
        return (2 * key + 2 * value, hidden), rows

    def _config(self) -> dict[str, Any]:
        """A config.json dict for the Hugging Face class of this architecture."""
        arch = self.architecture
        hidden = self._arch_meta("embedding_length")
        heads, kv_heads = self._head_counts()
        embeddings = self._tensors.get("model.embed_tokens.weight")
        if embeddings is None:
            raise CheckpointError(f"{self.path} has no token embeddings (token_embd.weight)")
        head_dim = self._arch_meta("attention.key_length", hidden // heads)
        if self._arch_meta("attention.value_length", head_dim) != head_dim:
            raise UnsupportedModelError(f"{self.path}: keys and values of different widths are not supported")
        rotary_dim = self._arch_meta("rope.dimension_count", head_dim)
        if rotary_dim != head_dim and arch not in _HYBRID:
            raise UnsupportedModelError(
                f"{self.path}: rotary embedding on part of each head is not supported for {arch!r}"
            )
        rope_theta = _float32_value(self._arch_meta("rope.freq_base", 10000.0))
        hf_class, model_type = _HF_ARCHITECTURES[arch]
        config: dict[str, Any] = {
            "architectures": [hf_class],
            "model_type": model_type,
            "hidden_size": hidden,
            # qwen35moe has no dense MLP, hence perhaps no feed_forward_length
            "intermediate_size": self._arch_meta("feed_forward_length", 0 if arch == "qwen35moe" else _REQUIRED),
            "num_hidden_layers": self._main_block_count(),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": _float32_value(self._arch_meta("attention.layer_norm_rms_epsilon")),
            "rope_theta": rope_theta,
            "rope_scaling": self._rope_scaling(rope_theta, head_dim),
            "max_position_embeddings": self._arch_meta("context_length"),
            "vocab_size": embeddings.shape[0],
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": any(name.endswith("self_attn.q_proj.bias") for name in self._tensors),
        }
        if arch in _MOE:
            config |= self._moe_config()
        if arch in _HYBRID:
            config |= self._hybrid_config(head_dim, rotary_dim)
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            value = self.metadata(f"tokenizer.ggml.{key}", None)
            if value is not None:
                config[key.replace("padding", "pad")] = value
        return config

    def _moe_config(self) -> dict[str, Any]:
        """The experts' config keys. llama.cpp renormalises the top-k routing weights of every MoE
        architecture here (norm_topk_prob; a file does not say) and makes every layer a mixture of
        experts; an expert's width defaults, as there, to feed_forward_length / experts used."""
        used = self._arch_meta("expert_used_count")
        config = {
            "num_experts": self._arch_meta("expert_count"),
            "num_experts_per_tok": used,
            "moe_intermediate_size": self._arch_meta(
                "expert_feed_forward_length", self._arch_meta("feed_forward_length", 0) // max(used, 1)
            ),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        shared = self._arch_meta("expert_shared_feed_forward_length", None)
        if shared:
            config["shared_expert_intermediate_size"] = shared
        return config

    def _hybrid_config(self, head_dim: int, rotary_dim: int) -> dict[str, Any]:
        """A hybrid's layer pattern (recurrent_layers, else every full_attention_interval-th layer
        full attention, as llama.cpp reads it), DeltaNet shape (ssm.*) and partial rotary."""
        layers = self._main_block_count()
        recurrent = self._arch_meta("attention.recurrent_layers", None)
        if recurrent is None:
            interval = self._arch_meta("full_attention_interval", 4)
            recurrent = [(i + 1) % interval != 0 for i in range(layers)]
        value_heads = self._arch_meta("ssm.time_step_rank")
        inner = self._arch_meta("ssm.inner_size")
        if value_heads <= 0 or inner % value_heads:
            raise CheckpointError(
                f"{self.path}: ssm.inner_size {inner} is not {value_heads} (ssm.time_step_rank) value heads"
            )
        return {
            "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
            "linear_num_key_heads": self._arch_meta("ssm.group_count"),
            "linear_num_value_heads": value_heads,
            "linear_key_head_dim": self._arch_meta("ssm.state_size"),
            "linear_value_head_dim": inner // value_heads,
            "linear_conv_kernel_dim": self._arch_meta("ssm.conv_kernel"),
            "partial_rotary_factor": rotary_dim / head_dim,
        }

    def _rope_scaling(self, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
        kind = self._arch_meta("rope.scaling.type", None)
        factor = self._arch_meta("rope.scaling.factor", None)
        original = self._arch_meta("rope.scaling.original_context_length", None)
        rope_freqs = next((t for t in self._reader.tensors if t.name == _ROPE_FREQS), None)
        if rope_freqs is not None:
            if kind not in (None, "none"):
                raise UnsupportedModelError(f"{self.path} has both {_ROPE_FREQS} and rope scaling {kind!r}")
            stored = self._bytes[rope_freqs.data_offset : rope_freqs.data_offset + rope_freqs.n_bytes]
            divisors = dequantize(stored, rope_freqs.tensor_type, (rope_freqs.n_elements,)).double()
            return _llama3_rope_scaling(
                divisors, rope_theta, head_dim, original or _LLAMA3_ORIGINAL_CONTEXT, self.path
            )
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": factor}
        if kind == "yarn":
            scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
            for key in ("beta_fast", "beta_slow"):
                value = self._arch_meta(f"rope.scaling.yarn_{key}", None)
                if value is not None:
                    scaling[key] = value
            return scaling
        raise UnsupportedModelError(f"{self.path}: rope scaling type {kind!r} is not supported")


def _hf_place(architecture: str, gguf_name: str, main_blocks: int) -> tuple[str, int] | None:
    """The Hugging Face tensor a GGUF tensor makes (with the part it is, for split ones), or None.
    Blocks from `main_blocks` on are the multi-token-prediction block(s): mtp.*."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name], 0
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None:
        return None
    block, base, suffix = int(match[1]), match[2], match[3]
    if block >= main_blocks:
        if base in _NEXTN_TENSORS:
            return f"{_NEXTN_TENSORS[base]}{suffix}", 0
        prefix = f"mtp.layers.{block - main_blocks}"
    else:
        prefix = f"model.layers.{block}"
    whole = _LAYER_TENSORS_WHOLE.get(architecture, {}).get(base + suffix)
    if whole is not None:
        return f"{prefix}.{whole}", 0
    part = _LAYER_TENSOR_PARTS.get(architecture, {}).get(base + suffix)
    if part is not None:
        return f"{prefix}.{part[0]}", part[1]
    module = _LAYER_TENSORS[architecture].get(base)
    if module is None or not suffix:
        return None
    return f"{prefix}.{module}{suffix}", 0


def _rows_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """`shape` as [rows, row length]: a 1-D tensor's values are one a row, else the last dimension
    is the row."""
    return (shape[0], 1) if len(shape) == 1 else (math.prod(shape[:-1]), shape[-1])


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(_rows_shape(tuple(tensor.shape)))


def _undo_rope_permutation(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's convert_hf_to_gguf permutation of q/k rows (and biases).

    Hugging Face rotates the two halves of each head's dimensions together (rotate_half);
    llama.cpp rotates adjacent pairs, so its converter interleaves the halves: within each head,
    GGUF row 2i holds HF row i and GGUF row 2i+1 holds HF row i + head_dim/2.
    """
    rows = tensor.shape[0]
    pairs = tensor.reshape(n_heads, rows // n_heads // 2, 2, *tensor.shape[1:])
    return pairs.transpose(1, 2).reshape(tensor.shape)


def _llama3_rope_scaling(
    divisors: torch.Tensor, rope_theta: float, head_dim: int, original_context: int, path: Path
) -> dict[str, Any] | None:
    """Recover Llama 3's rope_scaling from the per-frequency divisors llama.cpp stores instead.

    The converter writes f_i = 1 for wavelengths below L/high_freq_factor, f_i = factor above
    L/low_freq_factor, and between them 1/f_i = (1 - s_i)/factor + s_i with
    s_i = (L/wavelength_i - low_freq_factor) / (high_freq_factor - low_freq_factor).
    s is affine in L/wavelength, so a least-squares line through the in-between frequencies gives
    both factors. L itself cannot be told apart from a rescaling of the two factors (each choice
    yields the same divisors), so it comes from the metadata or defaults to Llama 3's 8192.
    """
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    x = original_context * inv_freq / (2 * math.pi)  # L / wavelength
    between = (divisors > 1 + 1e-5) & (divisors < factor * (1 - 1e-5))
    if len(divisors) != len(inv_freq) or int(between.sum()) < 2:
        raise UnsupportedModelError(
            f"{path}: {_ROPE_FREQS} ({len(divisors)} values) does not follow Llama 3's rope scaling"
        )
    s = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(x[between].numpy(), s.numpy(), 1)
    low = round(float(-intercept / slope), 6)
    high = round(float(low + 1 / slope), 6)
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original_context,
    }
    # The fit must reproduce every stored divisor, or the file uses some other scheme.
    smooth = ((x - low) / (high - low)).clamp(0, 1)
    rebuilt = 1 / ((1 - smooth) / factor + smooth)
    if not torch.allclose(rebuilt, divisors, rtol=1e-4, atol=0):
        raise UnsupportedModelError(f"{path}: {_ROPE_FREQS} does not follow Llama 3's rope scaling")
    return scaling


# -- reading the file --------------------------------------------------------------------


def _check_header(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: expected a .gguf file")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file: expected a .gguf file")
    try:
        with path.open("rb") as f:
            header = f.read(8)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror}") from e
    if header[:4] != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file: it starts with {header[:4]!r}, not b'GGUF'")
    if len(header) < 8:
        raise CheckpointError(f"{path} is truncated: it ends inside the GGUF header")
    version = int.from_bytes(header[4:8], "little")
    if version & 0xFFFF == 0:  # the version field reads byte-swapped: a big-endian file
        raise CheckpointError(f"{path} is a big-endian GGUF file; tuili reads little-endian GGUF files")
    if version != GGUF_VERSION:
        raise CheckpointError(
            f"{path} is GGUF version {version}; tuili reads GGUF version {GGUF_VERSION} "
            "(convert it again with a current llama.cpp)"
        )


class _PastEnd(Exception):
    def __init__(self, needed: int, size: int) -> None:
        super().__init__(f"needs {needed} bytes, file has {size}")
        self.needed, self.size = needed, size


class _Reader(GGUFReader):
    """GGUFReader that refuses to read past the end of the file, and reads faster.

    Every read GGUFReader makes goes through `_get` (a private method, unchanged from gguf 0.10
    to 0.19). Unchecked, a short read surfaces far from its cause, as an IndexError
    or a failed reshape; here it raises _PastEnd. Slicing a plain ndarray view of the memory map
    instead of the np.memmap itself also skips memmap's per-slice bookkeeping, which makes parsing a
    large vocabulary faster (docs/kernels.md, Measured crossovers).
    """

    _plain: np.ndarray | None = None

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        end = offset + dtype.itemsize * int(count)
        if end > self._plain.size:
            raise _PastEnd(end, self._plain.size)
        values = self._plain[offset:end].view(dtype)
        return values.view(values.dtype.newbyteorder(override_order or self.byte_order))


# Should a later gguf read differently, use its reader unchanged: slower, with vaguer messages
# for truncated files (which tests/models/test_gguf.py would then flag).
_READER = (
    _Reader
    if list(inspect.signature(GGUFReader._get).parameters)
    == ["self", "offset", "dtype", "count", "override_order"]
    else GGUFReader
)


def _field_value(field: Any) -> Any:
    """The Python value of a metadata field (a scalar, a string, or a list of either)."""
    kind = field.types[0]
    parts = [field.parts[i] for i in field.data]
    if kind == GGUFValueType.ARRAY:
        if len(field.types) == 1:  # an empty array records no item type
            return []
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(p).decode("utf-8") for p in parts]
        return [p.tolist()[0] for p in parts]
    if kind == GGUFValueType.STRING:
        return bytes(parts[0]).decode("utf-8")
    return parts[0].tolist()[0]


def _float32_value(value: float) -> float:
    """GGUF stores floats as float32: give back the short decimal it came from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


# -- dequantization ----------------------------------------------------------------------
#
# Each function turns a [n_blocks, bytes_per_block] uint8 tensor into [n_blocks, block_size]
# float32 values, following ggml's block layouts (ggml-common.h). Scales are float16. 4-bit
# values come two to a byte: within each group of 32 values the low nibbles hold the first 16
# and the high nibbles the last 16. The arithmetic order matches gguf.quants bit for bit.


def dequantize(raw: Any, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantize `raw` (bytes-like or a uint8 array) holding a tensor of `shape` to float32.

    `shape` is row-major (the last dimension is contiguous and blocked), i.e. the Hugging Face
    shape, the reverse of the dimension list a GGUF file records.
    """
    ggml_type = GGMLQuantizationType(ggml_type)
    convert = _DEQUANTIZERS.get(ggml_type)
    if convert is None:
        raise CheckpointError(
            f"tensor type {ggml_type.name} cannot be dequantized; supported types: "
            f"{', '.join(q.name for q in _DEQUANTIZERS)}"
        )
    return convert(_blocks(raw, ggml_type, shape)).reshape(shape)


def _blocks(raw: Any, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` as its blocks, [n_blocks, block bytes] uint8 (a copy: the file map is read-only),
    after checking that rows of `shape` are whole blocks and that the bytes are all there."""
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    n_values = math.prod(shape)
    data = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if not shape or shape[-1] % block_size != 0 or data.size != n_values // block_size * block_bytes:
        raise CheckpointError(
            f"a {ggml_type.name} weight of shape {tuple(shape)} needs rows in multiples of {block_size} "
            f"and {n_values // block_size * block_bytes} bytes; got {data.size} bytes"
        )
    return torch.from_numpy(data.copy()).reshape(-1, block_bytes)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as a float32 column [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes → [..., 2k] 4-bit values: all low nibbles, then all high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes → [..., 8k] bits, least significant first (a little-endian bit string)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _bit_planes(packed: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes → [..., 8m] bits, plane by plane: value j·m + i is bit j of byte i (the
    K-quants' extra code bits)."""
    shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
    return ((packed.unsqueeze(-2) >> shifts) & 1).flatten(-2)


def _crumbs(packed: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes → [..., 4m] 2-bit values, pair by pair: value s·m + i is bits 2s, 2s + 1 of
    byte i (Q2_K's and Q3_K's codes, Q6_K's high bits, Q3_K's scales' top bits)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    return ((packed.unsqueeze(-2) >> shifts) & 3).flatten(-2)


def _dequantize_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float32)


def _dequantize_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float16).float()


def _dequantize_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.bfloat16).float()


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | q: 32 x int8
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | q: 32 x 4 bits, offset by 8
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8)


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | m: f16 | q: 32 x 4 bits; x = d*q + m
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


def _q5_0_codes(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | fifth bits: 32 bits | q: 32 x 4 bits, offset by 16
    return _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6]) << 4)


def _dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_q5_0_codes(blocks).float() - 16)


def _q5_1_codes(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16 | m: f16 | fifth bits: 32 bits | q: 32 x 4 bits; x = d*q + m
    return _nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8]) << 4)


def _dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _q5_1_codes(blocks).float() + _f16(blocks, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of a Q4_K/Q5_K block from their 12 bytes.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 take
    their low 4 bits from bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits from
    the spare top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    first, second, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([first & 63, (rest & 0x0F) | ((first >> 2) & 0x30)], dim=-1)
    mins = torch.cat([second & 63, (rest >> 4) | ((second >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K block's codes [n_blocks, 8, 32] (0..15) and its sub-blocks' steps and offsets
    [n_blocks, 8]: w = step * q - offset.

    d: f16 | dmin: f16 | scales and mins: 12 bytes | q: 256 x 4 bits, 8 sub-blocks of 32."""
    scales, mins = _k_scales(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return q, _f16(blocks, 0) * scales, _f16(blocks, 2) * mins


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    q, step, offset = _q4_k_parts(blocks)
    return (step.unsqueeze(-1) * q.float() - offset.unsqueeze(-1)).reshape(-1, 256)


def _q5_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q5_K block's codes [n_blocks, 8, 32] (0..31) and its sub-blocks' steps and offsets
    [n_blocks, 8]: w = step * q - offset.

    d | dmin | scales and mins: 12 bytes | fifth bits: 32 bytes (bit j for sub-block j) | q: 256 x 4 bits."""
    scales, mins = _k_scales(blocks[:, 4:16])
    low = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = _bit_planes(blocks[:, 16:48]).reshape(-1, 8, 32)
    return low | (high << 4), _f16(blocks, 0) * scales, _f16(blocks, 2) * mins


def _dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    q, step, offset = _q5_k_parts(blocks)
    return (step.unsqueeze(-1) * q.float() - offset.unsqueeze(-1)).reshape(-1, 256)


def _q2_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q2_K block's codes [n_blocks, 16, 16] (0..3) and its sub-blocks' steps and offsets
    [n_blocks, 16]: w = step * q - offset.

    scales: 16 bytes (a sub-block's scale in the low nibble, its min in the high) | q: 64 bytes of
    2-bit codes, values 0-31 of each 128 from bit pairs 0-1 of 32 bytes, 32-63 from 2-3, ... | d:
    f16 | dmin: f16."""
    scales = blocks[:, :16]
    q = _crumbs(blocks[:, 16:80].reshape(-1, 2, 32)).reshape(-1, 16, 16)
    return q, _f16(blocks, 80) * (scales & 0x0F).float(), _f16(blocks, 82) * (scales >> 4).float()


def _dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    q, step, offset = _q2_k_parts(blocks)
    return (step.unsqueeze(-1) * q.float() - offset.unsqueeze(-1)).reshape(-1, 256)


def _q3_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q3_K block's codes [n_blocks, 16, 16] (int8, -4..3) and its sub-blocks' steps
    [n_blocks, 16]: w = step * q.

    hmask: 32 bytes (a code's third bit, bit j of byte i for value 32j + i; set means no -4) | q:
    64 bytes of 2-bit codes laid out as Q2_K's | scales: 12 bytes of 6-bit values less 32 (low
    nibbles from bytes 0-7, low then high nibble; top two bits from bytes 8-11, bit pairs 0-1
    to 6-7) | d: f16."""
    low = _crumbs(blocks[:, 32:96].reshape(-1, 2, 32)).reshape(-1, 16, 16)
    high = _bit_planes(blocks[:, :32]).reshape(-1, 16, 16)
    q = low.view(torch.int8) - ((high ^ 1) << 2).view(torch.int8)
    packed = blocks[:, 96:108]
    nibbles = _nibbles(packed[:, :8])
    tops = _crumbs(packed[:, 8:12])
    scales = (nibbles | (tops << 4)).view(torch.int8) - 32
    return q, _f16(blocks, 108) * scales.float()


def _dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    q, step = _q3_k_parts(blocks)
    return (step.unsqueeze(-1) * q.float()).reshape(-1, 256)


def _q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q6_K block's codes [n_blocks, 16, 16] (int8, -32..31) and its sub-blocks' steps
    [n_blocks, 16]: w = step * q.

    low 4 bits: 128 bytes | high 2 bits: 64 bytes | 16 int8 scales | d: f16; two halves of 128
    values. In each half, 64 low-bit bytes give values 0-63 (low nibbles) and 64-127 (high
    nibbles); 32 high-bit bytes give values 0-31, 32-63, 64-95, 96-127 from bit pairs 0-1, 2-3,
    4-5, 6-7."""
    low = _nibbles(blocks[:, :128].reshape(-1, 2, 64))
    high = _crumbs(blocks[:, 128:192].reshape(-1, 2, 32)).reshape(-1, 2, 128)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(-1, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    return q, _f16(blocks, 208) * scales


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    q, step = _q6_k_parts(blocks)
    return (step.unsqueeze(-1) * q.float()).reshape(-1, 256)


_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.F32: _dequantize_f32,
    GGMLQuantizationType.F16: _dequantize_f16,
    GGMLQuantizationType.BF16: _dequantize_bf16,
    GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    GGMLQuantizationType.Q4_1: _dequantize_q4_1,
    GGMLQuantizationType.Q5_0: _dequantize_q5_0,
    GGMLQuantizationType.Q5_1: _dequantize_q5_1,
    GGMLQuantizationType.Q2_K: _dequantize_q2_k,
    GGMLQuantizationType.Q3_K: _dequantize_q3_k,
    GGMLQuantizationType.Q4_K: _dequantize_q4_k,
    GGMLQuantizationType.Q5_K: _dequantize_q5_k,
    GGMLQuantizationType.Q6_K: _dequantize_q6_k,
}


# -- quantized weights, read without dequantizing ----------------------------------------------

# Types whose blocks the packed kernels read as their codes (quantized_weight); the others are
# dequantized at load.
PACKED_GGUF_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q2_K,
)


def quantized_weight(raw: Any, ggml_type: GGMLQuantizationType | int, shape: tuple[int, int]) -> QuantizedWeight:
    """The quantized weight held in a GGUF tensor's raw bytes, in row-major ([out, in]) shape,
    for the packed kernels (tuili/layers/quant), the blocks' codes as stored and their scales in
    float32 (exact; the modules round them to their compute dtype):

    - Q4_0 (d, 16 bytes of nibbles, w = d*(q - 8)) and Q4_1 (d, m, w = d*q + m): Int4Weight;
    - Q4_K (8 sub-blocks of 32 of a 256 block, w = step*q - offset): Int4Weight in groups of 32,
      scale = step and zero = 8*step - offset;
    - Q8_0 (d, 32 int8, w = d*q): Int8GroupWeight in groups of 32;
    - Q5_0 (d, 5-bit q, w = d*(q - 16)): Int8GroupWeight in groups of 32, codes q - 16;
    - Q6_K (16 sub-blocks of 16 of a 256 block, w = step*(q - 32)): Int8GroupWeight in groups of
      16, codes q - 32;
    - Q5_1 (d, m, 5-bit q, w = d*q + m) and Q5_K (8 sub-blocks of 32, w = step*q - offset):
      Int8GroupWeights with zeros in groups of 32, codes q - 16, zero m + 16d (16 step - offset);
    - Q3_K (16 sub-blocks of 16, w = step*q, q in -4..3): Int8GroupWeight in groups of 16;
    - Q2_K (16 sub-blocks of 16, w = step*q - offset, q in 0..3): Int8GroupWeight with zeros in
      groups of 16, codes q - 2, zero 2 step - offset.

    The 2- to 6-bit codes lie in -32..31: Int6GroupLinear holds them at 6 bits where the kernels
    read 6-bit codes, Int8GroupLinear at 8 elsewhere, except those with zeros (Q5_1, Q5_K, Q2_K),
    which its kernels do not take: the loader dequantizes those there."""
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in PACKED_GGUF_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor type {ggml_type.name} cannot run packed; packed types: "
            f"{', '.join(t.name for t in PACKED_GGUF_TYPES)} (others are dequantized at load)"
        )
    if len(shape) != 2:
        raise CheckpointError(f"a {ggml_type.name} weight must be 2-D to run packed; got shape {tuple(shape)}")
    blocks = _blocks(raw, ggml_type, shape)
    n, k = shape
    if ggml_type == GGMLQuantizationType.Q4_K:
        q, step, offset = _q4_k_parts(blocks)
        step, offset = step.view(n, k // 32), offset.view(n, k // 32)
        return Int4Weight(q.reshape(n, k), step, 8 * step - offset, 32)
    if ggml_type == GGMLQuantizationType.Q6_K:
        q, step = _q6_k_parts(blocks)
        return Int8GroupWeight(q.reshape(n, k), step.view(n, k // 16), 16)
    if ggml_type == GGMLQuantizationType.Q3_K:
        q, step = _q3_k_parts(blocks)
        return Int8GroupWeight(q.reshape(n, k), step.view(n, k // 16), 16)
    if ggml_type == GGMLQuantizationType.Q2_K:
        q, step, offset = _q2_k_parts(blocks)
        step, offset = step.view(n, k // 16), offset.view(n, k // 16)
        return Int8GroupWeight((q.view(torch.int8) - 2).reshape(n, k), step, 16, 2 * step - offset)
    if ggml_type == GGMLQuantizationType.Q5_K:
        q, step, offset = _q5_k_parts(blocks)
        step, offset = step.view(n, k // 32), offset.view(n, k // 32)
        return Int8GroupWeight((q.view(torch.int8) - 16).reshape(n, k), step, 32, 16 * step - offset)
    d = _f16(blocks, 0).view(n, k // 32)
    if ggml_type == GGMLQuantizationType.Q8_0:
        return Int8GroupWeight(blocks[:, 2:].contiguous().view(torch.int8).reshape(n, k), d, 32)
    if ggml_type == GGMLQuantizationType.Q5_0:
        return Int8GroupWeight((_q5_0_codes(blocks).view(torch.int8) - 16).reshape(n, k), d, 32)
    if ggml_type == GGMLQuantizationType.Q5_1:
        m = _f16(blocks, 2).view(n, k // 32)
        return Int8GroupWeight((_q5_1_codes(blocks).view(torch.int8) - 16).reshape(n, k), d, 32, m + 16 * d)
    q = _nibbles(blocks[:, 2:] if ggml_type == GGMLQuantizationType.Q4_0 else blocks[:, 4:]).reshape(n, k)
    if ggml_type == GGMLQuantizationType.Q4_0:
        return Int4Weight(q, d, torch.zeros_like(d), 32)
    m = _f16(blocks, 2).view(n, k // 32)
    return Int4Weight(q, d, m + 8 * d, 32)


def _whole_groups(columns: torch.Tensor, group: int) -> torch.Tensor | None:
    """The order of the groups of `group` columns when `columns` moves whole groups, else None."""
    if len(columns) % group:
        return None
    runs = columns.view(-1, group)
    starts = runs[:, 0]
    if bool((starts % group).any()) or not torch.equal(runs, starts[:, None] + torch.arange(group)):
        return None
    return starts // group


def _take_columns(weight: QuantizedWeight, columns: torch.Tensor, name: str) -> QuantizedWeight:
    groups = None if isinstance(weight, Int8Weight) else _whole_groups(columns, weight.group_size)
    if groups is None:
        raise CheckpointError(f"{name}: its column order splits quantization blocks; it cannot run packed")
    if isinstance(weight, Int4Weight):
        return Int4Weight(weight.q[:, columns], weight.scale[:, groups], weight.zero[:, groups], weight.group_size)
    assert isinstance(weight, Int8GroupWeight)
    zero = None if weight.zero is None else weight.zero[:, groups]
    return Int8GroupWeight(weight.q[:, columns], weight.scale[:, groups], weight.group_size, zero)


def _take_rows(weight: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    if isinstance(weight, Int4Weight):
        return Int4Weight(weight.q[rows], weight.scale[rows], weight.zero[rows], weight.group_size)
    if isinstance(weight, Int8GroupWeight):
        zero = None if weight.zero is None else weight.zero[rows]
        return Int8GroupWeight(weight.q[rows], weight.scale[rows], weight.group_size, zero)
    return Int8Weight(weight.q[rows], weight.scale[rows])
