"""Pure decode steps on a CPU replayed from graphs (tuili/kernels/graph.py), one per batch size.

A step in which every scheduled sequence adds one token and samples makes the same kernel calls
on the same shapes every time for a given number of sequences B; only the values in the inputs
change. The first such step of B sequences is captured: run eagerly while recorded, replayed
once on the same inputs and kept only if the replay's result equals the eager one bit for bit.
Later steps of B sequences write their inputs (embeddings, rotary tables, slots, block tables,
positions) into the captured buffers and replay: one native call instead of ten Python-driven
kernel calls per layer. Everything else runs eagerly: prefills, mixed steps, batch sizes above
MAX_GRAPH_BATCH, caches the native kernels do not write (fp8), and any batch size whose capture
was refused (a torch op in the forward, e.g. a float32 model's F.linear beyond the native GEMV's
rows); the reason is logged once.

Speculative decoding's verification steps are captured the same way, keyed by the query rows of
each sequence (1 for a decode, 1 + proposals for a verification): their rows go to the paged
kernel as a few causal queries per sequence, and the graph returns every row's logits. So are
short sampled chunks of at most MAX_CHUNK_ROWS tokens (a draft model catching up on the target's
last proposal and bonus token in one forward), whose last row's logits the runner keeps. Only
steps of at most MAX_VERIFY_BATCH sequences, and at most MAX_VERIFY_SHAPES shapes, are captured;
others run eagerly.

Hybrid models (Gated DeltaNet layers) are captured too, for pure decodes only: each sequence's
linear-attention state lives in its slot, which the step's buffers name (`state_slots`) and the
decode kernel updates in place. A step that zeroes a slot (a sequence's first token), restores a
prefix-cache checkpoint or saves one runs eagerly. Because a replay moves the state on, the
capture's check first puts back the slots' state the eager run changed, and a refused capture
leaves them as they were before the step, for the eager run that follows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tuili.engine.block_manager import slot
from tuili.engine.scheduler import ScheduledSeq
from tuili.kernels.graph import Arena, Graph, GraphCaptureError, GraphReplayError, capture
from tuili.layers.attention import AttentionMetadata, PagedBatch
from tuili.layers.deltanet import StateBatch
from tuili.models.llama import LlamaForCausalLM
from tuili.models.qwen3_next import Qwen3NextForCausalLM

log = logging.getLogger(__name__)

# Most sequences of a captured step. Beyond a few dozen the step's arithmetic dwarfs the time
# between kernels, and each batch size captured costs one more eager step and its buffers.
MAX_GRAPH_BATCH = 64
MAX_VERIFY_SHAPES = 32  # verification shapes (query rows per sequence) captured at most
# Most sequences of a captured verification step: the shapes multiply with the batch (each
# sequence's rows vary), and a large batch's step is arithmetic, not time between kernels.
MAX_VERIFY_BATCH = 4
# Most tokens of a sampled chunk that is not a verification (a draft's catch-up) in a captured
# step: a graph computes every row's logits, which at a few rows costs about one row's.
MAX_CHUNK_ROWS = 8

# A step's shape: its batch size for pure decodes, else the query rows of each sequence.
Shape = int | tuple[int, ...]


@dataclass(frozen=True)
class DecodeStep:
    """What a graph reads from its step: plain data, so that a tensor-parallel rank 0 can send it
    to the other ranks, which replay their shard's graph on it (tuili/parallel/runner.py)."""

    shape: Shape
    tokens: list[int]  # every query row's token, sequence by sequence
    positions: list[int]
    slots: list[int]  # every row's KV cache slot
    starts: list[int]  # each sequence's first query position
    block_tables: list[list[int]]
    state_slots: list[int]  # each sequence's linear-attention state slot (hybrid models), else []

    @classmethod
    def of(cls, batch: list[ScheduledSeq], block_size: int, hybrid: bool) -> DecodeStep:
        starts = [item.start for item in batch]
        if all(item.num_tokens == 1 for item in batch):
            positions = starts
            tokens = [item.seq.token_ids[item.start] for item in batch]
        else:
            positions, tokens = [], []
            for item in batch:
                positions.extend(range(item.start, item.start + item.num_tokens))
                tokens.extend(item.token_ids())
        rows_of = [item for item in batch for _ in range(item.num_tokens)]
        slots = [slot(item.seq.block_table, p, block_size) for item, p in zip(rows_of, positions, strict=True)]
        return cls(
            shape=DecodeGraphs.shape(batch), tokens=tokens, positions=positions, slots=slots, starts=starts,
            block_tables=[list(item.seq.block_table) for item in batch],
            state_slots=[item.seq.state_slot for item in batch] if hybrid else [],
        )

    @property
    def rows_per_seq(self) -> list[int]:
        return [1] * self.shape if isinstance(self.shape, int) else list(self.shape)


@dataclass
class _StepBuffers:
    """The inputs of a B-sequence decode step, at the addresses its graph reads."""

    x: torch.Tensor  # [R, hidden] embeddings of the R query rows (overwritten by the first layer's residual add)
    cos: torch.Tensor  # [R, 1, head_dim / 2] float32
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [R] int64
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32; only each row's used prefix is read
    seq_info: torch.Tensor  # [B, 3] int32: first row, query rows, first position
    state_slots: torch.Tensor  # [B] int64: each sequence's linear-attention state slot (hybrid models)
    meta: AttentionMetadata


@dataclass
class _Captured:
    graph: Graph
    buffers: _StepBuffers
    logits_in_graph: bool  # else the graph ends at the final norm and the logits run eagerly


def _describe(shape: Shape) -> str:
    return f"{shape} sequences" if isinstance(shape, int) else f"query rows {shape} per sequence"


class DecodeGraphs:
    """Captures and replays `model`'s pure decode steps. The caller's conditions: a CPU, the native
    kernels available, KV caches of the model's dtype, sequences of at most max_blocks_per_seq
    blocks."""

    def __init__(self, model: LlamaForCausalLM | Qwen3NextForCausalLM, block_size: int, max_blocks_per_seq: int) -> None:
        # Capturing runs the step under a TorchDispatchMode, whose first use imports
        # torch._dynamo (about a second): pay it here, when the engine is built, not inside
        # the first request's first decode step (where `tuili generate`'s meter would count it).
        import torch._dynamo  # noqa: F401

        self.model = model
        self.hybrid = model.config.is_hybrid
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._arena = Arena()
        self._graphs: dict[tuple[Shape, int], _Captured] = {}  # (shape, threads) -> its graph
        self.refused: dict[Shape, str] = {}  # shape -> why it runs eagerly
        # Captures tried so far, kept or refused: a step that tried one ran eagerly, recorded and
        # replayed, several times a steady step's time (timers that fit step costs skip it).
        self.captures = 0
        self._said: set[tuple[str, Shape]] = set()  # (what, shape) already logged at info

    def captured_batch_sizes(self) -> list[int]:
        return sorted({shape for shape, _ in self._graphs if isinstance(shape, int)})

    def captured_row_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of captured steps with a chunk of several rows (query rows per sequence)."""
        return sorted({shape for shape, _ in self._graphs if isinstance(shape, tuple)})

    @staticmethod
    def shape(batch: list[ScheduledSeq]) -> Shape:
        if all(item.num_tokens == 1 for item in batch):
            return len(batch)
        return tuple(item.num_tokens for item in batch)

    def takes(self, batch: list[ScheduledSeq]) -> bool:
        """Whether `batch` is a pure decode (or verification) step of a shape that has, or may
        get, a graph."""
        if not (0 < len(batch) <= MAX_GRAPH_BATCH
                and all(item.num_tokens == 1 or (item.samples and (item.draft or item.num_tokens <= MAX_CHUNK_ROWS))
                        for item in batch)
                and all(len(item.seq.block_table) <= self.max_blocks_per_seq for item in batch)):
            return False
        if self.hybrid and not all(item.num_tokens == 1 and item.start > 0 and item.restore_checkpoint is None
                                   and not item.save_checkpoints for item in batch):
            return False  # the graph steps states on; it neither zeroes, restores nor saves them
        shape = self.shape(batch)
        if shape in self.refused:
            return False
        if isinstance(shape, tuple):
            key = (shape, torch.get_num_threads())
            verify_shapes = sum(1 for s, _ in self._graphs if isinstance(s, tuple))
            return (len(shape) <= MAX_VERIFY_BATCH and sum(shape) <= MAX_GRAPH_BATCH
                    and (key in self._graphs or verify_shapes < MAX_VERIFY_SHAPES))
        return True

    def step(self, batch: list[ScheduledSeq]) -> DecodeStep:
        """The inputs of a step `takes` accepted, for `logits`."""
        return DecodeStep.of(batch, self.block_size, self.hybrid)

    def logits(self, step: DecodeStep) -> torch.Tensor | None:
        """Float32 logits [B, vocab] of a step `takes` accepted, valid until the next call; None
        when this step must run eagerly instead (its capture was refused, or a kernel refused its
        inputs, which the eager run then reports by name)."""
        key = (step.shape, torch.get_num_threads())
        captured = self._graphs.get(key)
        if captured is None:
            return self._capture(step, key)
        self._write_inputs(captured.buffers, step)
        try:
            (out,) = captured.graph.replay()
        except GraphReplayError:
            return None
        return out if captured.logits_in_graph else self.model.compute_logits(out)

    def _capture(self, step: DecodeStep, key: tuple[Shape, int]) -> torch.Tensor | None:
        """Captures the step with its logits, else (an output layer that is not all native
        kernels, such as torch's int8 op) without them, the logits then computed eagerly."""
        shape = key[0]
        self.captures += 1
        buffers = self._buffers(step.rows_per_seq)
        model = self.model
        reasons = []
        before = self._states(step)
        for logits_in_graph in (True, False):

            def forward(logits_in_graph: bool = logits_in_graph) -> list[torch.Tensor]:
                hidden = model.run_layers(buffers.x, (buffers.cos, buffers.sin), buffers.meta)
                return [model.compute_logits(hidden) if logits_in_graph else hidden]

            self._write_inputs(buffers, step)
            try:
                (eager,), graph = capture(forward, self._arena)
                self._write_inputs(buffers, step)  # the capture overwrote x; the KV writes repeat
                self._put_back(before)  # the replay steps the states on from where the eager run did
                (replayed,) = graph.replay()
                if not torch.equal(replayed.view(torch.uint8), eager.view(torch.uint8)):
                    raise GraphCaptureError("its replay's result differs from the eager run's")
            except GraphCaptureError as error:
                self._put_back(before)
                reasons.append(str(error))
                continue
            self._graphs[key] = _Captured(graph, buffers, logits_in_graph)
            log.debug("captured a decode graph of %s: %d kernel calls", _describe(shape), graph.calls)
            if logits_in_graph:
                return eager
            self._say("logits", "the logits of decode steps of %s run eagerly: %s", shape, reasons[0])
            return model.compute_logits(eager)
        self.refused[shape] = reasons[-1]
        self._say("step", "decode steps of %s run eagerly: %s", shape, reasons[-1])
        return None

    def _states(self, step: DecodeStep) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Copies of the step's state slots in every linear-attention layer (none for a
        transformer): (slots, conv, recurrent) per layer."""
        if not self.hybrid:
            return []
        slots = torch.tensor(step.state_slots, dtype=torch.long)
        return [(slots, layer.state.conv[slots], layer.state.recurrent[slots])
                for layer in self.model.linear_attention_layers()]  # fmt: skip

    def _put_back(self, states: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        for layer, (slots, conv, recurrent) in zip(self.model.linear_attention_layers(), states, strict=True):
            layer.state.conv[slots] = conv
            layer.state.recurrent[slots] = recurrent

    def _say(self, what: str, message: str, size: Shape, reason: str) -> None:
        """Log `message` at info once per batch size, at debug after that: a server under load
        meets the same shapes again and again (a new thread count recaptures them), and a line
        per step grew its log by hundreds of MB an hour (issue 20)."""
        level = logging.DEBUG if (what, size) in self._said else logging.INFO
        self._said.add((what, size))
        log.log(level, message, _describe(size), reason)

    def _buffers(self, rows_per_seq: list[int]) -> _StepBuffers:
        embedding = self.model.model.embed_tokens
        half_dim = self.model.model.rotary.cos.shape[1]
        batch_size, rows = len(rows_per_seq), sum(rows_per_seq)
        block_tables = torch.zeros(batch_size, self.max_blocks_per_seq, dtype=torch.int32)
        seq_info = torch.zeros(batch_size, 3, dtype=torch.int32)
        counts = torch.tensor(rows_per_seq, dtype=torch.int32)
        seq_info[:, 0] = torch.cumsum(counts, 0) - counts
        seq_info[:, 1] = counts
        slot_mapping = torch.zeros(rows, dtype=torch.int64)
        state_slots = torch.zeros(batch_size, dtype=torch.int64)
        meta = AttentionMetadata(slot_mapping, [], [], PagedBatch(block_tables, seq_info))
        if self.hybrid:  # pure decodes: row b is sequence b's one token, stepping the state in its slot
            nothing = torch.zeros(0, dtype=torch.int64)
            meta.states = StateBatch(nothing, torch.arange(batch_size), state_slots, [], nothing, nothing, {}, nothing,
                                     nothing)  # fmt: skip
        return _StepBuffers(
            # the lookup's rows: the table's dtype, or what a packed table's lookup returns
            x=torch.empty(rows, embedding.embedding_dim, dtype=getattr(embedding, "out_dtype", embedding.weight.dtype)),
            cos=torch.empty(rows, 1, half_dim),
            sin=torch.empty(rows, 1, half_dim),
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_info=seq_info,
            state_slots=state_slots,
            meta=meta,
        )

    def _write_inputs(self, buffers: _StepBuffers, step: DecodeStep) -> None:
        x, (cos, sin) = self.model.embed(torch.tensor(step.tokens), torch.tensor(step.positions))
        buffers.x.copy_(x)
        buffers.cos.copy_(cos)
        buffers.sin.copy_(sin)
        tables = buffers.block_tables.numpy()
        for row, table in enumerate(step.block_tables):
            tables[row, : len(table)] = table
        buffers.slot_mapping.numpy()[:] = step.slots
        buffers.seq_info.numpy()[:, 2] = step.starts
        if self.hybrid:
            buffers.state_slots.numpy()[:] = step.state_slots
