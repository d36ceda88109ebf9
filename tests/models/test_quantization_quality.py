"""Quality of quantized weights on real text (issue 7): the embedded SmolLM2-135M-Instruct GGUF
with `quantization="int8"` / `"int4"` against the same model unquantized, on a fixed English text
written for the tests (tests/data/english_eval.txt) and ten chat prompts
(tests/data/chat_prompts.json). Measured figures: docs/quantization.md, "Quality of quantized
weights".

The bf16 baseline is what the quantizer starts from: the file's Q4_1 weights dequantized (in
float32, as the loader does) and rounded to bf16, held as plain float linears. On a CPU,
`LLM(dtype="bfloat16")` alone runs the Q4_1 linears packed instead, so the baseline is that model
with its packed linears swapped for float ones holding the float32 model's weights in bf16.

Perplexity: the whole text is scored as one prompt, in one prefill through the engine's runner
(every token after the first is predicted from all the text before it).

Greedy agreement over the ten answers' first 32 tokens is measured two ways. Free-running
(each model generates its own answer): on this 135M model one flipped near-tie changes the rest
of the answer, and bf16 rounding of the float32 weights alone keeps only ~75% of the tokens, so
int8's 51% says little (both recorded in docs/quantization.md; not asserted). Teacher-forced
(the int8 model reads the bf16 model's prompt and answer and predicts each answer token from the
same context): the share of the 32 positions where both pick the same token. That is the
agreement the int8 bound (>= 90%) checks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from tuili import LLM, SamplingParams
from tuili.engine.request import Sequence
from tuili.engine.scheduler import ScheduledSeq
from tuili.layers.linear import Linear, PanelLinear, panel_holds
from tuili.layers.logits import OutputHead
from tuili.layers.quant import QuantizedLinear
from tuili.models.weights import WeightPlan

DATA = Path(__file__).parents[1] / "data"
MAX_MODEL_LEN = 2560  # the text is 2,281 tokens
MAX_TOKENS = 32
# Prefix caching off: every model computes the chat prompts in the same batch shapes, so the
# answers differ only by the weights (in bf16 a different batch shape can flip a token).
OPTIONS = dict(
    device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_memory=128 << 20, enable_prefix_caching=False
)


@dataclass
class Measured:
    perplexity: float
    answers: list[list[int]]  # greedy token ids, one list per chat prompt
    llm: LLM


def perplexity(llm: LLM, prompt_logits: Callable, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of every token after the first."""
    logits = prompt_logits(llm, [ids])
    return math.exp(nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def measure(
    llm: LLM, prompt_logits: Callable, ids: list[int], prompts: list[str], chat: bool = True
) -> Measured:
    answers = []
    if chat:
        outs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        )
        answers = [out.outputs[0].token_ids for out in outs]
    return Measured(perplexity(llm, prompt_logits, ids), answers, llm)


def agreement_position_wise(reference: list[list[int]], other: list[list[int]]) -> float:
    same = sum(
        a == b for ref, oth in zip(reference, other, strict=True) for a, b in zip(ref, oth, strict=False)
    )
    return same / sum(max(len(ref), len(oth)) for ref, oth in zip(reference, other, strict=True))


def agreement_up_to_divergence(reference: list[list[int]], other: list[list[int]]) -> float:
    shared = 0
    for ref, oth in zip(reference, other, strict=True):
        for a, b in zip(ref, oth, strict=False):
            if a != b:
                break
            shared += 1
    return shared / sum(max(len(ref), len(oth)) for ref, oth in zip(reference, other, strict=True))


def teacher_forced_agreement(
    reference: Measured, other: Measured, prompt_logits: Callable, prompts: list[str]
) -> float:
    """Share of the reference answers' positions where both models, reading the same prompt and
    reference answer, pick the same next token."""
    same = total = 0
    for prompt, answer in zip(prompts, reference.answers, strict=True):
        ids = reference.llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        picks = [prompt_logits(m.llm, [ids + answer])[len(ids) - 1 : -1].argmax(-1) for m in (reference, other)]
        same += int((picks[0] == picks[1]).sum())
        total += len(answer)
    return same / total


def decode_logits(llm: LLM, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Float32 logits [len(answer), vocab] predicting each answer token from the prompt and the
    answer before it, computed as generation computes them: the prompt in one prefill, then one
    decode step (a one-row forward) per answer token. Blocks are freed afterwards."""
    engine = llm.engine
    seq = Sequence(seq_id=-1, request_id="decode_logits", index=0, token_ids=list(prompt),
                   prompt_len=len(prompt), params=SamplingParams())
    try:
        engine.block_manager.grow(seq, len(prompt))
        rows = [engine.runner.logits([ScheduledSeq.next_chunk(seq, len(prompt))])[-1]]
        seq.num_computed_tokens = len(prompt)
        for token in answer[:-1]:
            seq.token_ids.append(token)
            engine.block_manager.grow(seq, seq.num_tokens)
            rows.append(engine.runner.logits([ScheduledSeq.next_chunk(seq, 1)])[-1])
            seq.num_computed_tokens += 1
    finally:
        engine.block_manager.free(seq)
    return torch.stack(rows)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return json.loads((DATA / "chat_prompts.json").read_text())


@pytest.fixture(scope="module")
def float32_llm() -> LLM:
    """The GGUF dequantized to float32 at load: the exact reference."""
    return LLM(dtype="float32", **OPTIONS)


@pytest.fixture(scope="module")
def text_ids(float32_llm) -> list[int]:
    return float32_llm.engine.tokenizer.encode((DATA / "english_eval.txt").read_text())


@pytest.fixture(scope="module")
def float32(float32_llm, prompt_logits, text_ids, prompts) -> Measured:
    return measure(float32_llm, prompt_logits, text_ids, prompts)


@pytest.fixture(scope="module")
def bf16(float32_llm, prompt_logits, text_ids, prompts) -> Measured:
    """The baseline (see the module docstring): a bf16 model whose packed linears are replaced by
    float linears (the float32 model's class) holding its weights rounded to bf16."""
    llm = LLM(dtype="bfloat16", **OPTIONS)
    model, float_modules = llm.engine.runner.model, dict(float32_llm.engine.runner.model.named_modules())
    # The logits and the token lookup read the float table rounded to bf16, as the float32
    # model's read it unrounded (the packed model reads both from its Q8_0 copy), held as the
    # loader holds a bf16 table: panels where they run, the lookup reading its rows back.
    table = float_modules["model.embed_tokens"].weight.detach().to(torch.bfloat16)
    if panel_holds(table, None, model.platform):
        model.lm_head = OutputHead(PanelLinear(table, None, one_path=model.platform.batch_invariant))
    else:
        model.lm_head = OutputHead(Linear.holding(table, None, model.platform))
    model.model.embed_tokens = WeightPlan.token_lookup(nn.Embedding.from_pretrained(table, freeze=True), model.lm_head)
    swapped = 0
    for path, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            source = float_modules[path]
            assert isinstance(source, nn.Linear) and source.bias is None
            # the loader's own float linear class, so the baseline runs the float model's kernels
            linear = Linear.holding(source.weight.detach().to(torch.bfloat16), None, model.platform)
            model.set_submodule(path, linear)
            swapped += 1
    assert swapped == 4 * model.config.num_layers  # qkv, o, gate_up, down of every layer
    return measure(llm, prompt_logits, text_ids, prompts)


@pytest.fixture(scope="module")
def int8(prompt_logits, text_ids, prompts) -> Measured:
    return measure(LLM(dtype="bfloat16", quantization="int8", **OPTIONS), prompt_logits, text_ids, prompts)


@pytest.fixture(scope="module")
def int4(prompt_logits, text_ids, prompts) -> Measured:
    llm = LLM(dtype="bfloat16", quantization="int4", **OPTIONS)
    return measure(llm, prompt_logits, text_ids, prompts, chat=False)


@pytest.fixture(scope="module")
def packed_default(prompt_logits, text_ids, prompts) -> Measured:
    """No quantization, dtype auto: on this CPU bf16 activations, with the GGUF's Q4_1/Q8_0
    linears run packed as stored (computing in bf16)."""
    llm = LLM(**OPTIONS)
    assert llm.engine.weights_quantized == "gguf"
    return measure(llm, prompt_logits, text_ids, prompts)


def test_the_evaluation_data_is_what_the_issue_asks(text_ids, prompts):
    assert 2000 <= len(text_ids) - 1 and len(text_ids) <= MAX_MODEL_LEN
    assert len(prompts) == 10 and len(set(prompts)) == 10


def test_bf16_baseline_is_the_float32_model_rounded(bf16, float32):
    # The same weights rounded to bf16: measured 0.06% apart. A wrong swap is far off.
    assert abs(bf16.perplexity / float32.perplexity - 1) < 0.005, (bf16.perplexity, float32.perplexity)


def test_int8_perplexity_within_1_percent_of_bf16(int8, bf16):
    assert abs(int8.perplexity / bf16.perplexity - 1) <= 0.01, (int8.perplexity, bf16.perplexity)


def test_int4_perplexity_within_5_percent_of_bf16(int4, bf16):
    assert abs(int4.perplexity / bf16.perplexity - 1) <= 0.05, (int4.perplexity, bf16.perplexity)


def test_int8_greedy_answers_agree_with_bf16(int8, bf16, prompt_logits, prompts):
    agree = teacher_forced_agreement(bf16, int8, prompt_logits, prompts)
    free = agreement_position_wise(bf16.answers, int8.answers)
    print(f"int8 vs bf16: teacher-forced {agree:.3f}, free-running position-wise {free:.3f}, "
          f"up to divergence {agreement_up_to_divergence(bf16.answers, int8.answers):.3f}")
    assert agree >= 0.9, agree


def test_packed_gguf_default_matches_float32(packed_default, float32, prompt_logits, prompts):
    """The default on this CPU: bf16 activations, the packed Q4_1/Q8_0 kernels computing the stored
    weights with bf16 scales and zero points and, at decode, x rounded to int8 per group of 32 as
    llama.cpp does (on CPUs with AVX512-VNNI only), and decode logits from a packed copy of the
    output matrix. docs/quantization.md, "The packed default against float32", has the figures.

    Perplexity scores the text in one prefill, which runs the tiled kernels (bf16 x, no int8
    rounding): measured 0.01% off float32 on every CPU. Decode is checked teacher-forced through
    the decode path itself (one row per step: the gemv kernel and the packed logits), reading
    float32's own answers, so that each position is judged on the same context; float32's logits
    for those positions come from one prefill of each prompt and answer (the same sums as its
    decode steps up to float32 rounding, far below the bounds):

    * the logits' RMS error, as a share of their spread, median over the answers' positions:
      0.089 with the int8 rounding of x (Xeon with AMX and EPYC Zen 5 alike: both have VNNI),
      0.030 without it (AVX-512 without VNNI, AVX2), where plain bf16 weights give 0.029. Bound
      0.15. Checked to fail: nibbles swapped give 2.2, down_proj's scales 10% too large 0.25.
    * the top-1 pick agrees with float32 at 93.0% of the 230 positions with VNNI, 99.6% on
      AVX-512 without it and 98.7% on AVX2. Every disagreement measured is a position where
      float32's own top two logits were within 0.9 of each other (28 of the 230 are within
      0.25). Bound 85% (nibbles swapped: 0%).

    Both bounds are about the size of the perturbation, not its exact rounding, so a change of
    summation order (batch-invariant kernels, say) moves the figures by bf16 noise, well inside.

    Free-running greedy agreement (each model continuing its own answer) is printed, not
    asserted: on this 135M model one flipped near-tie changes the rest of an answer, so it
    measures where the near-ties fall more than the kernels. It read 48% on a Xeon with AMX and
    31% on an EPYC Zen 5 with the same kernels at decode; the two differ in the prompt's prefill
    (AMX tiles against oneDNN's AVX512-BF16 products), which moves which near-ties flip. On the
    EPYC, an AVX2 build read 92% and the same build without the packed logits copy 29%."""
    ratio = packed_default.perplexity / float32.perplexity
    assert abs(ratio - 1) < 0.01, (packed_default.perplexity, float32.perplexity)

    errors, same, total = [], 0, 0
    for prompt, answer in zip(prompts, float32.answers, strict=True):
        ids = float32.llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        reference = prompt_logits(float32.llm, [ids + answer])[len(ids) - 1 : -1]
        logits = decode_logits(packed_default.llm, ids, answer)
        errors.append((logits - reference).pow(2).mean(-1).sqrt() / reference.std(-1))
        same += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        total += len(answer)
    error, agree = float(torch.cat(errors).median()), same / total
    free = agreement_up_to_divergence(float32.answers, packed_default.answers)
    print(f"packed default vs float32 at decode: relative logit error {error:.3f}, teacher-forced "
          f"{agree:.3f}, free-running up to divergence {free:.3f}")
    assert error <= 0.15, error
    assert agree >= 0.85, agree
