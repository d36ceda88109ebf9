"""The weight plan: how each linear, the embedding and the output head of a model are held,
decided at load and handed to the model, which is built whole from it.

A linear is held one of four ways, decided here once per module from the checkpoint, the
request and the platform (first match):

1. **GGUF blocks as stored** (`gguf_packed`): a decoder linear whose parts are all of
   PACKED_GGUF_TYPES (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K to Q6_K; parts of different types in
   one format, `stack_parts`) runs on the packed kernels (tuili/layers/quant), computing in
   `quantized_dtype`.
2. **Quantized at load** (`quantization` "int8" | "int4"): the float weight (a GGUF file's
   dequantized) is quantized; "int4" keeps an untied output matrix at int8, as llama.cpp keeps
   its output matrix at 6 or 8 bits (the logits are the most sensitive projection).
3. **Panel layout**: a bf16 decoder linear whose shape the layout takes, on a CPU with
   AVX512-BF16 or AMX (`PanelLinear`): laid out once in 16-row panels, one copy.
4. **Float**, row-major (`Linear`): everything else.

Stacked projections (q, k, v -> qkv_proj) are the checkpoint's tensors concatenated along the
output dimension, in the model class's order. A mixture-of-experts layer's routed experts are
float tensors [experts, out, in] (`experts`: a checkpoint's fused 3-D tensor, or its per-expert
matrices stacked), never quantized: `quantization` on such a model is refused, and a GGUF file's
quantized expert stacks are read dequantized (`TensorSource` gives floats). The output head holds the embedding table itself
when tied (one tensor), an int8 copy of it under `quantization`, and, for a GGUF file run packed,
a quantized decode copy (tuili/layers/logits.py), which in the batch-invariant mode is also the
token lookup's table where it holds the file's own codes (no float table then). An untied GGUF
table run packed stays as the file stores it, read a row at a time (`PackedEmbedding`). The rest
(norms) is assigned by name in `fill`.
Every checkpoint tensor the config requires must be present: a CheckpointError names the
missing ones by their checkpoint names.

Under tensor parallelism (`sharded`, tuili/parallel/shard.py) the plan reads only this rank's
slice of each tensor (safetensors slices through `read_slice`; a GGUF tensor one at a time,
whole, then cut; a packed GGUF linear's blocks cut along rows or whole groups of columns), then
holds it one of the four ways above: q/k/v and gate/up keep their heads' and channels' rows,
o and down their columns and end in an all-reduce, the embedding and the output head their
vocabulary rows. A rank's part of a stacked part may be several runs of rows (Qwen3.5's flat
in_proj_qkv: its q, k and v rows), read one by one and concatenated in order; a DeltaNet's conv
channels, A_log and dt_bias are cut the same way in `fill`; routed experts keep their share of
every expert's intermediate channels (a GGUF file's packed expert stacks cut by whole
blocks, or read as floats where the channels do not split into a block per rank), and a mixture of experts sums its output over the ranks once (`summed_over_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tuili.config import QUANTIZATION_METHODS
from tuili.errors import CheckpointError, TuiliError
from tuili.layers.linear import Linear, PanelEmbedding, PanelLinear, panel_holds
from tuili.layers.logits import OutputHead
from tuili.layers.moe import Experts, QuantizedExperts, RoutedExperts
from tuili.layers.quant import (
    DEFAULT_INT4_GROUP_SIZE,
    INT4_GROUP_SIZES,
    Int8GroupWeight,
    PackedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    StackedLinear,
    int6_fits,
    int8_group_size,
    make_linear,
    quantize_int4,
    quantize_int8_for_kernels,
    quantize_int8_group,
    stack_parts,
)
from tuili.parallel.layers import (
    RowParallelLinear,
    SummedOverRanks,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from tuili.parallel.shard import ShardPlan, narrow
from tuili.platform import Platform

if TYPE_CHECKING:
    from tuili.models.gguf import GGUFCheckpoint

TensorSource = dict[str, Callable[[], torch.Tensor]]  # checkpoint name -> its tensor, read on demand
# (name, dim, start, stop) -> that slice of the tensor, read without the rest (safetensors)
SliceReader = Callable[[str, int, int, int], torch.Tensor]
GGUF_BLOCK = 32  # inputs per group of the packed GGUF types as held (32; Q6_K's 16 divide it)


@dataclass
class WeightPlan:
    platform: Platform
    dtype: torch.dtype  # float weights' dtype
    tensors: TensorSource
    stacked: dict[str, tuple[str, ...]]  # the model class's stacked_projections
    source: str  # the checkpoint's path, for error messages
    quantization: str | None = None
    quantized_dtype: torch.dtype = torch.bfloat16  # what quantized linears compute in
    gguf_packed: GGUFCheckpoint | None = None  # a GGUF file whose PACKED_GGUF_TYPES linears run as stored
    group_size: int = DEFAULT_INT4_GROUP_SIZE
    # checkpoint name -> shape, as the file's header records it (read without loading the tensor)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    sharded: ShardPlan | None = None  # tensor parallelism: this rank's cut of every weight
    read_slice: SliceReader | None = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise TuiliError(
                f"quantization {self.quantization!r} is not supported: expected one of {', '.join(QUANTIZATION_METHODS)}"
            )
        if self.quantization == "int4":
            check_int4_shapes(
                [(name, shape[1]) for name, shape in self._linear_weight_shapes() if not _is_output(name)],
                self.group_size,
            )

    @property
    def quantized(self) -> str | None:
        """How the linears are held, for reports: None (floats), "gguf", "int8" or "int4"."""
        return self.quantization or ("gguf" if self.gguf_packed is not None else None)

    @property
    def device(self) -> torch.device:
        return self.platform.device

    # -- what the model asks for ---------------------------------------------------------

    def linear(self, path: str, in_features: int, out_features: int, bias: bool, reduce: bool = True) -> nn.Module:
        """The module for linear `path` (e.g. "model.layers.0.self_attn.qkv_proj"). Under tensor
        parallelism a row-parallel linear sums its output over the ranks unless `reduce` is
        False (a shared expert's down projection, summed with the routed experts' once)."""
        parts = self._part_names(path)
        decoder = path.startswith("model.layers.")
        slices = self.sharded.linear_slices(path, len(parts)) if self.sharded and decoder else None
        cut = None
        pieces = parts  # one checkpoint name per range read, in order
        if slices is not None:
            dim, ranges = slices
            pieces = [part for part, runs in zip(parts, ranges, strict=True) for _ in runs]
            cut = (dim, [run for runs in ranges for run in runs])
        if decoder and self.gguf_packed is not None:
            module = self._gguf_linear(pieces, parts, bias, cut)
            if module is not None:
                return self._row_parallel(module, cut, reduce)
        weight = self._stacked([f"{p}.weight" for p in pieces], (out_features, in_features), cut)
        b = None
        if bias and (cut is None or cut[0] == 0):
            b = self._stacked([f"{p}.bias" for p in pieces], (out_features,), cut)
        elif bias and self.sharded is not None and self.sharded.shard.rank == 0:  # row-parallel: rank 0 adds it
            b = self._stacked([f"{p}.bias" for p in parts], (out_features,))
        return self._row_parallel(self._hold(path, weight, b, decoder), cut, reduce)

    def _row_parallel(self, module: nn.Module, cut: tuple[int, list[tuple[int, int]]] | None, reduce: bool) -> nn.Module:
        if cut is None or cut[0] == 0 or not reduce:
            return module
        assert self.sharded is not None
        return RowParallelLinear(module, self.sharded.group)  # type: ignore[arg-type]

    def summed_over_ranks(self, module: nn.Module) -> nn.Module:
        """`module`, whose output under tensor parallelism is this rank's partial sum (a mixture
        of experts over its share of every expert's channels), made to return the whole sum."""
        if self.sharded is None:
            return module
        return SummedOverRanks(module, self.sharded.group)  # type: ignore[arg-type]

    def _hold(self, path: str, weight: torch.Tensor, b: torch.Tensor | None, decoder: bool) -> nn.Module:
        """The module holding float `weight` (whole, or this rank's cut of it): ways 2 to 4."""
        if self.quantization is not None:
            quantized = quantize_int4(weight, self.group_size, self.quantized_dtype) if (
                self.quantization == "int4" and not _is_output(path)
            ) else quantize_int8_for_kernels(weight, self.quantized_dtype)
            return make_linear(quantized, b, self.quantized_dtype, platform=self.platform).to(self.device)
        if decoder and panel_holds(weight, b, self.platform):
            return PanelLinear(weight, b, one_path=self.platform.batch_invariant)
        return Linear.holding(weight, b, self.platform)

    def experts(self, prefix: str, num_experts: int, hidden: int, intermediate: int) -> RoutedExperts:
        """The routed experts under `prefix` (e.g. "model.layers.0.mlp.experts"): gate_up_proj
        [num_experts, 2 * intermediate, hidden] and down_proj [num_experts, hidden, intermediate].

        Held packed (QuantizedExperts) when a GGUF file run packed stores both stacks in packed
        types (PACKED_GGUF_TYPES, one per stack: the blocks' codes, as `_gguf_linear` holds a
        dense linear), or under `quantization`, each expert's matrices quantized as `_hold` quantizes
        a dense linear ("int8" per row, "int4" per group of `group_size`); float otherwise."""
        paths = (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")
        shapes = ((num_experts, 2 * intermediate, hidden), (num_experts, hidden, intermediate))
        # Under tensor parallelism (`intermediate` is then the rank's share) a GGUF file's packed
        # stacks are cut by whole blocks, where the rank's channels are whole blocks.
        if self.gguf_packed is not None and (self.sharded is None or self.sharded.expert_unit % GGUF_BLOCK == 0):
            packed = [self._gguf_experts(path, shape) for path, shape in zip(paths, shapes, strict=True)]
            gate_up, down = packed
            if gate_up is not None and down is not None:  # else both float: one kind of module per layer
                return QuantizedExperts(gate_up, down, self.quantized_dtype, self.platform).to(self.device)
        floats = [self._float_experts(path, shape) for path, shape in zip(paths, shapes, strict=True)]
        if self.quantization is None:
            return Experts(*floats, self.platform)

        def quantize(w: torch.Tensor) -> QuantizedWeight:
            if self.quantization == "int4":
                return quantize_int4(w, self.group_size, self.quantized_dtype)
            return quantize_int8_for_kernels(w, self.quantized_dtype)

        gate_up, down = ([quantize(w) for w in stack] for stack in floats)
        del floats
        return QuantizedExperts(gate_up, down, self.quantized_dtype, self.platform).to(self.device)

    def _float_experts(self, path: str, shape: tuple[int, int, int]) -> torch.Tensor:
        """One stack of experts' matrices `path` (e.g. "model.layers.0.mlp.experts.gate_up_proj")
        as one float tensor `shape` [num_experts, out, in]: the checkpoint's 3-D tensor named
        `path` where it stores the experts fused (transformers' own layout), else expert e's
        `{prefix}.{e}.{part}.weight` tensors (what save_pretrained writes), its parts stacked as
        `linear` stacks them (gate_up_proj -> gate_proj, up_proj). Under tensor parallelism, the
        rank's intermediate channels of every expert: gate_up's gate and up rows, down's columns."""
        prefix, _, leaf = path.rpartition(".")
        cut = None
        if self.sharded is not None:
            start, stop = self.sharded.expert_channels()
            cut = (0, [(start, stop), (start, stop)]) if leaf == "gate_up_proj" else (1, [(start, stop)])
        if path in self.tensors:
            if cut is None:
                return self._stacked([path], shape)
            whole = self.sharded.config.moe.intermediate_size  # type: ignore[union-attr]
            dim, ranges = (1, [cut[1][0], (whole + start, whole + stop)]) if cut[0] == 0 else (2, cut[1])
            pieces = [self._read(path, dim, a, b) for a, b in ranges]
            tensor = torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"{self.source}: tensor {path} cut to {tuple(tensor.shape)}, expected {shape}")
            return tensor
        parts = self.stacked.get(leaf, (leaf,))
        first = [f"{prefix}.0.{part}.weight" for part in parts]
        if not all(name in self.tensors for name in first):
            # Neither layout: name the fused tensor and expert 0's, which the reader can look for.
            _raise_missing(self.source, [path, *[n for n in first if n not in self.tensors]])
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        for e in range(shape[0]):
            out[e] = self._stacked([f"{prefix}.{e}.{part}.weight" for part in parts], shape[1:], cut)
        return out

    def _gguf_experts(self, path: str, shape: tuple[int, int, int]) -> list[QuantizedWeight] | None:
        """Expert e's matrix of the GGUF file's stack `path` as stored (one QuantizedWeight per
        expert, rows e*out .. (e+1)*out of the stack), or None when the stack cannot run packed
        (a K-quant, F16, ...): it is then read as floats. Under tensor parallelism (`shape` is
        then the rank's) each expert's blocks are cut: gate_up's gate and up rows of the rank's
        channels, down's columns at block boundaries (`ShardPlan.expert_unit`)."""
        ckpt = self.gguf_packed
        assert ckpt is not None
        if path not in set(ckpt.tensor_names()) or not ckpt.runs_packed(path):
            return None
        whole = shape
        if self.sharded is not None:
            inter = self.sharded.config.moe.intermediate_size  # type: ignore[union-attr]
            whole = (shape[0], 2 * inter, shape[2]) if path.endswith("gate_up_proj") else (*shape[:2], inter)
        if ckpt.tensor_info(path).shape != whole:
            raise CheckpointError(
                f"{self.source}: tensor {path} has shape {ckpt.tensor_info(path).shape}, expected {whole} from the config"
            )
        stack = ckpt.quantized_tensor(path)  # [E * out, in], Hugging Face row order
        if not _held_packed(stack, self.quantized_dtype, self.platform):
            return None
        num, out = whole[0], whole[1]
        experts = [narrow(stack, 0, e * out, (e + 1) * out) for e in range(num)]
        if self.sharded is None:
            return experts
        start, stop = self.sharded.expert_channels()
        if path.endswith("gate_up_proj"):  # rows [gate (I), up (I)]: the rank's of each
            half = out // 2
            return [type(w).cat([narrow(w, 0, start, stop), narrow(w, 0, half + start, half + stop)])  # type: ignore[arg-type]
                    for w in experts]  # fmt: skip
        return [narrow(w, 1, start, stop) for w in experts]

    def embedding(self, path: str, num_embeddings: int, dim: int, *, tied: bool) -> nn.Module:
        """The token lookup's table. Untied, from a GGUF file run packed whose table the packed
        modules take, it stays as the file stores it (`PackedEmbedding`: rows dequantized on
        lookup, as llama.cpp reads them); else it is a float table (a tied one: the output head's
        matrix too, token_lookup)."""
        if self.sharded is not None:
            start, stop = self.sharded.vocab()
            weight = self._stacked([f"{path}.weight"], (stop - start, dim), (0, [(start, stop)]))
            return VocabParallelEmbedding(weight, start, stop, self.sharded.group)  # type: ignore[arg-type]
        table = None if tied else self._gguf_table(f"{path}.weight")
        if table is not None:
            return PackedEmbedding(table, self.dtype, owner=True)
        weight = self._stacked([f"{path}.weight"], (num_embeddings, dim))
        return nn.Embedding.from_pretrained(weight, freeze=True)

    def _gguf_table(self, name: str) -> QuantizedLinear | None:
        """An untied table as the file stores it, where the packed modules take it (and the
        working dtype is the one they compute in); else None."""
        ckpt = self.gguf_packed
        if ckpt is None or self.dtype != self.quantized_dtype or not ckpt.runs_packed(name):
            return None
        weight = ckpt.quantized_tensor(name)
        if not _held_packed(weight, self.quantized_dtype, self.platform):
            return None
        return make_linear(weight, None, self.quantized_dtype, platform=self.platform).to(self.device)

    def output_head(self, path: str, embedding: nn.Module, tied: bool) -> nn.Module:
        """The logits' module: over the embedding table when `tied`, else over `path`.weight
        (under tensor parallelism: this rank's vocabulary rows, gathered to rank 0)."""
        decode_copy, stored = self._gguf_decode_copy() if self.gguf_packed is not None else (None, False)
        projection: nn.Module | None
        if tied and stored and self.sharded is None and self.platform.batch_invariant:
            # The copy is the file's own matrix and, in the batch-invariant mode, serves every
            # logit: it serves the token lookup too (token_lookup), and no float projection is
            # built beside it. (Outside that mode the float table stays for steps of more rows,
            # where it is faster: tuili/layers/logits.py.)
            projection, matrix = None, None
        elif tied:
            matrix = embedding.weight
            projection = self._output_projection(matrix)
        elif self.sharded is not None:
            start, stop = self.sharded.vocab()
            weight = self._stacked([f"{path}.weight"], (stop - start, embedding.embedding_dim), (0, [(start, stop)]))
            projection = self._hold(path, weight, None, decoder=False)
            matrix = None
        else:
            projection = self.linear(path, embedding.embedding_dim, embedding.num_embeddings, bias=False)
            if isinstance(projection, Linear) and projection.weight.dtype == torch.bfloat16 and self.quantization is None:
                projection = self._output_projection(projection.weight)
            matrix = None
        if self.quantization is not None and matrix is not None:
            # A tied matrix is also the token lookup's table, which keeps reading the float one.
            weight = quantize_int8_for_kernels(matrix, self.quantized_dtype)
            projection = make_linear(weight, None, self.quantized_dtype, platform=self.platform).to(self.device)
        head = OutputHead(projection, decode_copy)
        if self.sharded is None:
            return head
        return VocabParallelHead(head, self.sharded.vocab_widths(), self.sharded.group)  # type: ignore[arg-type]

    def _output_projection(self, matrix: torch.Tensor) -> nn.Module:
        """The float output matrix's module: a PanelLinear where it can be one (its GEMV reads
        the 16-row panels at 43 GB/s where the row-major GEMV reads 31, and 16 rows cost it one
        read of the matrix instead of two: Qwen3.5-0.8B's 248,320 x 1024 head at 16 rows, 21 ms
        against 39 on machine B, 2 threads), else a Linear over it. Whole heads only: a tensor-
        parallel rank's vocabulary slice keeps its Linear."""
        if self.sharded is None and self.quantization is None and panel_holds(matrix, None, self.platform):
            return PanelLinear(matrix, None, one_path=self.platform.batch_invariant)
        return Linear.holding(matrix, None, self.platform)

    @staticmethod
    def token_lookup(embedding: nn.Module, head: nn.Module) -> nn.Module:
        """The token lookup a tied model keeps: read from the output head's panels when the head
        holds the table as a PanelLinear, from its packed copy when it holds no float table (then
        the model holds the matrix once either way), else `embedding`."""
        projection = getattr(head, "projection", None)
        if isinstance(embedding, nn.Embedding):
            if isinstance(projection, PanelLinear):
                return PanelEmbedding(projection)
            if projection is None and isinstance(head, OutputHead):
                return PackedEmbedding(head.decode_copy, embedding.weight.dtype, owner=False)  # type: ignore[arg-type]
        return embedding

    def fill(self, model: nn.Module) -> None:
        """Assign the parameters the plan did not build (norms) from the checkpoint, by name;
        raise if any the model has is missing from it."""
        loaded, missing = {}, []
        for name, param in model.named_parameters(remove_duplicate=False):
            if _built_by_plan(model, name):
                continue
            if name not in self.tensors:
                missing.append(name)
                continue
            rows = self.sharded.parameter_rows(name) if self.sharded is not None else None
            if rows is None:
                tensor = self.tensors[name]().to(device=self.device, dtype=self.dtype)
            else:  # this rank's runs of rows (a DeltaNet's conv channels, its value heads' A_log)
                tensor = torch.cat([self._read(name, 0, start, stop) for start, stop in rows])
            if tensor.shape != param.shape:
                raise CheckpointError(
                    f"{self.source}: tensor {name} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(param.shape)} from the config"
                )
            loaded[name] = tensor
        if missing:
            _raise_missing(self.source, missing)
        model.load_state_dict(loaded, strict=False, assign=True)

    # -- how -----------------------------------------------------------------------------

    def _part_names(self, path: str) -> list[str]:
        """The checkpoint module names a model module stacks: qkv_proj -> q_proj, k_proj, v_proj."""
        prefix, _, leaf = path.rpartition(".")
        parts = self.stacked.get(leaf, (leaf,))
        return [f"{prefix}.{part}" if prefix else part for part in parts]

    def _stacked(
        self, names: list[str], shape: tuple[int, ...], cut: tuple[int, list[tuple[int, int]]] | None = None
    ) -> torch.Tensor:
        """The checkpoint tensors `names` concatenated along dim 0, in the float dtype on the
        device, checked against `shape`; with `cut` (dim, a [start, stop) per name), only those
        slices of them."""
        missing = [n for n in names if n not in self.tensors]
        if missing:
            _raise_missing(self.source, missing)
        if cut is None:
            pieces = [self.tensors[n]().to(device=self.device, dtype=self.dtype) for n in names]
        else:
            dim, ranges = cut
            dim = min(dim, len(shape) - 1)  # a bias is cut along its only dimension
            pieces = [self._read(n, dim, start, stop) for n, (start, stop) in zip(names, ranges, strict=True)]
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if tuple(tensor.shape) != shape:
            shown = names[0] if len(names) == 1 else f"{', '.join(names)} stacked"
            raise CheckpointError(
                f"{self.source}: tensor {shown} has shape {tuple(tensor.shape)}, expected {shape} from the config"
            )
        return tensor

    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Slice [start, stop) along `dim` of tensor `name`: read alone where the file allows,
        else cut from the whole tensor (copied, so the rest is freed at once)."""
        if self.read_slice is not None:
            piece = self.read_slice(name, dim, start, stop)
        else:
            piece = self.tensors[name]().narrow(dim, start, stop - start).clone()
        piece = piece.to(device=self.device, dtype=self.dtype).contiguous()
        # A row slice may still be a view of the whole tensor's storage, which it would keep.
        return piece.clone() if piece.untyped_storage().nbytes() > piece.nbytes else piece

    def _gguf_linear(
        self, pieces: list[str], parts: list[str], bias: bool, cut: tuple[int, list[tuple[int, int]]] | None = None
    ) -> QuantizedLinear | None:
        """A packed linear from the GGUF file's blocks (`pieces`: the part read for each range
        of `cut`; `parts`: the linear's stacked parts; parts of different types in one format,
        `stack_parts`), or None when a part's type cannot run packed (or is absent): that linear
        is then loaded as floats."""
        ckpt = self.gguf_packed
        assert ckpt is not None
        names = [f"{p}.weight" for p in pieces]
        known = set(ckpt.tensor_names())
        if not all(n in known and ckpt.runs_packed(n) for n in names):
            return None
        weights = [ckpt.quantized_tensor(n) for n in names]
        if cut is not None:
            weights = [narrow(w, cut[0], start, stop) for w, (start, stop) in zip(weights, cut[1], strict=True)]
        b = None
        if bias and (cut is None or cut[0] == 0):
            b = self._stacked([f"{p}.bias" for p in pieces], (sum(w.q.shape[0] for w in weights),), cut)
        elif bias and self.sharded is not None and self.sharded.shard.rank == 0:
            b = self._stacked([f"{p}.bias" for p in parts], (weights[0].q.shape[0],))
        runs = stack_parts(weights)  # type: ignore[arg-type]
        if any(not _held_packed(run, self.quantized_dtype, self.platform) for run in runs):
            return None
        if len(runs) == 1:
            return make_linear(runs[0], b, self.quantized_dtype, platform=self.platform).to(self.device)
        linears = [make_linear(run, None, self.quantized_dtype, platform=self.platform) for run in runs]
        return StackedLinear(linears, b, platform=self.platform).to(self.device)

    def _gguf_decode_copy(self) -> tuple[QuantizedLinear | None, bool]:
        """A quantized copy of the output matrix (the embedding when tied) for few-row logits, as
        llama.cpp reads its output matrix quantized, and whether it holds the file's own codes:
        the file's own blocks when they are Q8_0, or Q6_K where they run at 6 bits (`int6_fits`:
        the same bytes per step as llama.cpp, almost), else int8 per group (`int8_group_size`) of
        the dequantized matrix. None when the input size takes no group."""
        ckpt = self.gguf_packed
        assert ckpt is not None
        name = "lm_head.weight" if "lm_head.weight" in ckpt.tensor_names() else "model.embed_tokens.weight"
        shape = ckpt.tensor_info(name).shape
        kind = ckpt.tensor_info(name).ggml_type.name if ckpt.runs_packed(name) else None
        stored = ckpt.quantized_tensor(name) if kind in ("Q8_0", "Q6_K") else None
        own = kind == "Q8_0" or (kind == "Q6_K" and int6_fits(stored, self.quantized_dtype, self.platform))  # type: ignore[arg-type]
        if own:
            weight = stored
            if self.sharded is not None:
                weight = narrow(weight, 0, *self.sharded.vocab())
        else:
            group = int8_group_size(shape[1]) if len(shape) == 2 else None
            if group is None:
                return None, False
            matrix = ckpt.load_tensor(name, torch.float32)
            if self.sharded is not None:
                start, stop = self.sharded.vocab()
                matrix = matrix[start:stop]
            weight = quantize_int8_group(matrix, group, self.quantized_dtype)
        return make_linear(weight, None, self.quantized_dtype, platform=self.platform).to(self.device), own

    def _linear_weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(checkpoint name, [out, in]) of every linear weight the checkpoint holds (for checks
        that must run before anything is built), from the header where the loader gave it: the
        2-D weights, and each fused [experts, out, in] stack of a mixture of experts as its
        experts' [out, in]."""
        shapes = []
        for name, load in self.tensors.items():
            fused_experts = ".experts." in name and not name.endswith((".weight", ".bias"))
            if not (fused_experts or name.endswith(".weight")):
                continue
            if name.startswith("model.layers.") or _is_output(name):
                shape = self.shapes.get(name) or tuple(load().shape)
                if len(shape) == 2 or (fused_experts and len(shape) == 3):
                    shapes.append((name, shape[-2:]))
        return shapes


def check_int4_shapes(linears: list[tuple[str, int]], group_size: int) -> None:
    """Every linear (name, input size) must split into groups of `group_size`: checked for all
    before any is built, so that the error names the first misfit and the group sizes that fit."""
    if group_size not in INT4_GROUP_SIZES:
        raise TuiliError(
            f"int4 group size {group_size!r} is not supported: expected one of "
            f"{', '.join(map(str, INT4_GROUP_SIZES))}"
        )
    bad = [(name, k) for name, k in linears if k % group_size]
    if not bad:
        return
    name, k = bad[0]
    fits = [g for g in INT4_GROUP_SIZES if all(k_ % g == 0 for _, k_ in linears)]
    hint = f"group sizes that fit every layer: {', '.join(map(str, fits))}" if fits else (
        "no supported group size divides every input size; use int8"
    )
    raise TuiliError(
        f"int4 with group size {group_size} needs every linear's input size to be a multiple of "
        f"{group_size}, but {name} has {k} inputs ({k} % {group_size} = {k % group_size}"
        f"{f', and {len(bad) - 1} more layers' if len(bad) > 1 else ''}); {hint}"
    )


def _held_packed(weight: QuantizedWeight, compute_dtype: torch.dtype, platform: Platform) -> bool:
    """Whether a packed module takes `weight`: every format does, except int8 codes with zeros
    (GGUF Q5_1, Q5_K), which run only as 6-bit codes (`int6_fits`); elsewhere they are read as
    floats."""
    with_zeros = isinstance(weight, Int8GroupWeight) and weight.zero is not None
    return not with_zeros or int6_fits(weight, compute_dtype, platform)


def _is_output(name: str) -> bool:
    return name.removesuffix(".weight").split(".")[-1] == "lm_head"


def _built_by_plan(model: nn.Module, param_name: str) -> bool:
    """Whether parameter `param_name` belongs to a module the plan built with its weights: the
    linears, the experts, the embedding and the output head (everything but the norms)."""
    module_path = param_name.rpartition(".")[0]
    module = model.get_submodule(module_path) if module_path else model
    return isinstance(module, (Linear, nn.Embedding, RoutedExperts))


def _raise_missing(source: str, names: list[str]) -> None:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise CheckpointError(f"{source} lacks weights the config requires: {shown}")
