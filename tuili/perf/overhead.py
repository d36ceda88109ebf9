"""What an eager engine's step costs beyond the roofline.

**Host overhead.** Every torch op a step dispatches costs a fixed time on top of its work (Python,
the dispatcher, allocating the output, waking threads, launching a GPU kernel), and so does every
module call and every engine step's bookkeeping (scheduling, building the input tensors,
sampling). On a small model, or at small batch on a fast device, these fixed costs add up to as
much as the roofline: tuili's decoder layer dispatches some 50-80 torch ops, SmolLM2 has 30 layers.
A step's predicted time is ``max(compute, memory) + overhead`` (plan.py), with

    overhead = step seconds + layers x layer seconds (+ Qwen3's q/k norms' seconds per layer)

The seconds are the spec's ``host_overhead_seconds``, which `tuili probe` measures by running
tuili's own engine on toy models of 1 and 4 layers (64 wide, so that the work is nil and the time
is all fixed cost): the slope is the layer's, the intercept the step's, for decode and prefill
steps, float and packed int4 linears (``HOST_KEYS``). Measuring the engine itself keeps the figure
true as the engine changes (re-probe after an upgrade); the counts come from the config.
Datasheet presets have none: their predictions stay the roofline floor.

**Packed linears** (tuili/layers/quant/) also do work that neither bytes nor FLOPs measure:
unpacking their codes, in their weight-only kernel or, for a step of more rows, by dequantizing
every weight tile by tile before multiplying (``packed_work``, at the spec's measured
``packed_kernel_seconds_per_value`` and ``packed_dequant_seconds_per_value`` for each format the
layers hold: PACKED_FORMATS).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tuili.kernels import LINEAR_INT4_MAX_ROWS
from tuili.layers.quant import INT4_GEMV_MAX_ROWS, INT4_TILE_ROWS, KERNEL_FORMATS
from tuili.perf.shapes import ModelShape

# The fixed host seconds `tuili probe` measures; a missing key counts as 0, except that a packed
# layer without its own figure takes the float layer's.
HOST_KEYS = (
    "decode_step",  # a decode step's cost outside the layers: scheduling, inputs, lm_head call, sampling
    "decode_layer",  # one decoder layer in a decode step
    "prefill_step",  # the same for a step that prefills one fresh prompt chunk
    "prefill_layer",
    "packed_decode_layer",  # a decoder layer whose linears are packed int4
    "packed_prefill_layer",
    "qk_norm_layer",  # what Qwen3's q and k RMSNorms add to a layer
)

# tuili/layers/quant.py's packed int4 linear: up to INT4_GEMV_MAX_ROWS rows it calls tuili's
# native kernel on the packed bytes (PyTorch's weight-only op where those are not built); beyond,
# it dequantizes its weight in tiles of whole 64-row blocks and multiplies each. Imported, so that
# the planner follows the engine's thresholds.
PACKED_OP_MAX_ROWS = INT4_GEMV_MAX_ROWS
PACKED_BLOCK_ROWS = INT4_TILE_ROWS
PACKED_CALL_MAX_ROWS = LINEAR_INT4_MAX_ROWS  # rows per call of that kernel: more go in blocks of this many
# The kinds of weight (tuili/perf/shapes.py KINDS) whose matrices the engine packs: every decoder
# layer's projections (full attention, a Gated DeltaNet's in_proj_qkvz, in_proj_ba and out_proj),
# its dense MLP or shared expert, and a MoE layer's router and shared-expert gate. Routed experts
# run their own grouped kernels.
PACKED_KINDS = ("attention", "linear_attention", "mlp", "router")
# What the packed kernel reads (the codes' width, "+zeros" with a zero per group): GGUF Q4_0 is
# "int4", Q4_1, Q4_K and `--quantization int4` "int4+zeros", Q8_0 "int8", Q6_K and Q5_0 "int6"
# where the CPU's kernels read 6-bit codes, Q5_1 and Q5_K "int6+zeros".
PACKED_FORMATS = KERNEL_FORMATS


@dataclass(frozen=True)
class Step:
    """One engine step: a decode step of ``tokens`` sequences, or one prompt chunk of ``tokens``
    tokens from position 0 (``prefill``; a one-token chunk runs as a decode)."""

    prefill: bool
    tokens: int = 1
    packed: bool = False  # the layers' linears are packed int4 modules


def host_seconds(shape: ModelShape, step: Step, seconds: Mapping[str, float]) -> float:
    """The fixed host cost of ``step`` at the spec's measured ``seconds`` (HOST_KEYS)."""
    kind = "prefill" if step.prefill and step.tokens > 1 else "decode"
    layer = seconds.get(f"{kind}_layer", 0.0)
    if step.packed:
        layer = seconds.get(f"packed_{kind}_layer", layer)
    if shape.traits.qk_norm:
        layer += seconds.get("qk_norm_layer", 0.0)
    return seconds.get(f"{kind}_step", 0.0) + shape.num_layers * layer


@dataclass(frozen=True)
class PackedWork:
    """The work of a step's packed int4 linears beyond bytes and FLOPs. Their weight-only kernel
    unpacks the codes as it multiplies, each linear in ``calls`` of so many rows (a step's rows in
    blocks of up to PACKED_CALL_MAX_ROWS), at a measured time per weight value and call; a step
    of more rows dequantizes every weight once, tile by tile, into the compute dtype and
    multiplies the tiles (``dequantized``)."""

    values: int  # weight values of the packed linears (whole 64-row blocks)
    calls: tuple[int, ...]  # the rows of each weight-only kernel call per linear; () when tiled
    dequantized: int  # values dequantized into tiles; 0 when the kernel runs


def kernel_calls(rows: int) -> tuple[int, ...]:
    """The rows of each call the packed module makes for ``rows`` rows (its blocks)."""
    full, rest = divmod(rows, PACKED_CALL_MAX_ROWS)
    return (PACKED_CALL_MAX_ROWS,) * full + ((rest,) if rest else ())


def packed_work(shape: ModelShape, step: Step, kernel_takes_many_rows: bool = False) -> PackedWork | None:
    """None unless the step's linears are packed. ``kernel_takes_many_rows``: the engine runs
    steps of more than PACKED_OP_MAX_ROWS rows through the weight-only kernel too (the
    batch-invariant mode with native kernels), so nothing is dequantized."""
    if not step.packed:
        return None
    values = sum(
        math.ceil(w.shape[0] / PACKED_BLOCK_ROWS) * PACKED_BLOCK_ROWS * w.shape[1] * w.count
        for w in shape.weights()
        if w.kind in PACKED_KINDS and w.op == "matmul"
    )
    if step.tokens <= PACKED_OP_MAX_ROWS or kernel_takes_many_rows:
        return PackedWork(values, kernel_calls(step.tokens), 0)
    return PackedWork(values, (), values)
