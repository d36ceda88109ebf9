"""The output head: the logits of the rows that are sampled, hidden [R, H] -> float32 [R, V].

One module owns every way a model's output matrix is held, so that the model file says only
"the logits are `lm_head(hidden)`". The loader's weight plan builds it whole:

- `projection` multiplies by the output matrix: in bf16 on a CPU whose kernels read 16-row
  panels, a `PanelLinear` (for tied embeddings the table itself, held once: the token lookup
  reads its rows back from the panels, `PanelEmbedding`); else a float `Linear` over it (tied:
  the embedding table itself, one tensor for both), or a quantized linear (`--quantization`);
- `decode_copy`, when present, is a quantized copy of the same matrix (a GGUF file run packed),
  which its native GEMV reads in fewer bytes than the float matrix: it serves steps of up to
  `DECODE_COPY_MAX_ROWS` rows, where that kernel runs and beats the float matrix's products
  (a measured crossover: docs/kernels.md). More rows read the float matrix, except in the
  batch-invariant mode (`Platform.batch_invariant`), where the copy serves every row count: the
  two hold different roundings of the matrix, so a row's logits would depend on its step's rows.
- where the copy holds the file's own codes of a tied matrix (Q8_0, Q6_K at 6 bits) and the
  copy serves every row count anyway (the batch-invariant mode), there is no `projection`: the
  token lookup reads its rows from the copy too (`PackedEmbedding`), so the matrix is held once,
  at the file's size (a Qwen3-0.6B-shape Q4_0 file: 0.38 GB held instead of 0.70);
- a float `Linear` head takes a few rows more than its GEMV's `NATIVE_MAX_ROWS` (speculative
  decoding's verification steps: 1 + k rows per sequence) in slices of at most that many rows,
  up to `GEMV_SLICES` slices: on SmolLM2's 49152 x 576 bf16 matrix the GEMV took 1.8-2.0 ms per
  slice of 1-4 rows where F.linear took 11.1 ms at 5 and 11.5 ms at 8 rows (oneDNN reorders the
  weight on every call; machine B, 1 thread, loaded, 2026-12-02). Each row's logits are then the
  GEMV's, as in a decode step of that row alone.
"""

from __future__ import annotations

import torch
from torch import nn

from tuili.layers.linear import NATIVE_MAX_ROWS, Linear
from tuili.layers.quant import QuantizedLinear

DECODE_COPY_MAX_ROWS = 8
GEMV_SLICES = 3


class OutputHead(nn.Module):
    def __init__(self, projection: nn.Module | None, decode_copy: QuantizedLinear | None = None) -> None:
        super().__init__()
        if projection is None and decode_copy is None:
            raise ValueError("an output head needs a projection, a decode copy, or both")
        self.projection = projection
        self.decode_copy = decode_copy

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits; from bf16 weights, unrounded where the native kernels run."""
        if self._copy_serves(hidden.shape[0], hidden.device):
            assert self.decode_copy is not None
            return self.decode_copy(hidden, out_dtype=torch.float32)
        rows = hidden.shape[0]
        gemv_rows = NATIVE_MAX_ROWS.get(hidden.dtype, 0)
        if (isinstance(self.projection, Linear) and hidden.is_cpu and gemv_rows
                and gemv_rows < rows <= GEMV_SLICES * gemv_rows):
            return torch.cat([self.projection(part, out_dtype=torch.float32).float()
                              for part in hidden.split(gemv_rows)])
        return self.projection(hidden, out_dtype=torch.float32).float()

    def weights_read(self, rows: int, device: torch.device) -> list[torch.Tensor]:
        """The weight tensors a step of `rows` sampled rows reads (for the ruler's byte counts)."""
        module = self.decode_copy if self._copy_serves(rows, device) else self.projection
        assert module is not None
        return [*module.parameters(), *(b for b in module.buffers() if b is not None)]

    def _copy_serves(self, rows: int, device: torch.device) -> bool:
        copy = self.decode_copy
        if copy is None:
            return False
        if self.projection is None:
            return True
        return (rows <= DECODE_COPY_MAX_ROWS or copy.platform.batch_invariant) and copy.kernel_for(rows, device) == "gemv"
