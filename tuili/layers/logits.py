"""The output head: the logits of the rows that are sampled, hidden [R, H] -> float32 [R, V].

One module owns every way a model's output matrix is held, so that the model file says only
"the logits are `lm_head(hidden)`". The loader's weight plan builds it whole:

- `projection` multiplies by the output matrix: a float `Linear` over it (for tied embeddings
  the embedding table itself, one tensor for both), or a quantized linear (`--quantization`);
- `decode_copy`, when present, is a quantized copy of the same matrix (a GGUF file run packed),
  which its native GEMV reads in fewer bytes than the float matrix: it serves steps of up to
  `DECODE_COPY_MAX_ROWS` rows, where that kernel runs and beats the float matrix's products
  (a measured crossover: docs/kernels.md). More rows read the float matrix, except in the
  batch-invariant mode (`Platform.batch_invariant`), where the copy serves every row count: the
  two hold different roundings of the matrix, so a row's logits would depend on its step's rows.
"""

from __future__ import annotations

import torch
from torch import nn

from tuili.layers.quant import QuantizedLinear

DECODE_COPY_MAX_ROWS = 8


class OutputHead(nn.Module):
    def __init__(self, projection: nn.Module, decode_copy: QuantizedLinear | None = None) -> None:
        super().__init__()
        self.projection = projection
        self.decode_copy = decode_copy

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits; from bf16 weights, unrounded where the native kernels run."""
        if self._copy_serves(hidden.shape[0], hidden.device):
            assert self.decode_copy is not None
            return self.decode_copy(hidden, out_dtype=torch.float32)
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
        return (rows <= DECODE_COPY_MAX_ROWS or copy.platform.batch_invariant) and copy.kernel_for(rows, device) == "gemv"
