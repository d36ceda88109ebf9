"""Speculative decoding (tuili/engine/spec/): outputs do not change.

Greedy outputs are token for token those without speculation, for every method, with
preemption and prefix-cache hits in the mix (float32, where the tiny model's products are
batch-invariant); sampled outputs keep the target's distribution (a chi-square test against
transformers' probabilities); no block is leaked after many rejections, aborts and errors."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from scipy import stats as scipy_stats

from tuili import LLM, SamplingParams
from tuili.config import EngineConfig
from tuili.engine.block_manager import slot
from tuili.engine.spec.adaptive import AdaptiveK
from tuili.errors import TuiliError

# Periodic prompts (prompt lookup finds them), shared prefixes (prefix-cache hits) and noise.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6, 7],
    [1, 2, 3, 4] * 6 + [1, 2],
    list(range(40, 80)),
    [100 + (i * 37) % 150 for i in range(30)],
]


def spec_configs(draft_path) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False},
        "draft_model": {"model": str(draft_path), "num_speculative_tokens": 3, "adaptive": False},
        "self_int4": {"model": "self", "quantization": "int4", "num_speculative_tokens": 3, "adaptive": False},
    }


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "self_int4"])
def test_greedy_output_is_unchanged_with_preemption_and_prefix_hits(method, tiny_llama, tiny_llama_draft,
                                                                     greedy_reference, assert_nothing_held):
    # 12 blocks of 16 tokens for 4 sequences growing to 58-72 tokens: preemption is certain.
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=12 * 16 * 512, max_model_len=128, max_num_seqs=4,
              speculative_config=spec_configs(tiny_llama_draft)[method])
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert token_ids(llm.generate(prompts, params)) == greedy_reference
    assert token_ids(llm.generate(prompts[::-1], params)) == greedy_reference[::-1]  # prefix-cache hits
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache.hit_tokens > 0
    spec = stats.spec
    # Both paths ran many times: proposals kept and proposals rejected.
    assert spec.num_accepted_tokens > 10
    assert spec.num_proposed_tokens - spec.num_accepted_tokens > 3
    assert_nothing_held(llm)


def test_a_self_draft_adopts_the_targets_kv_instead_of_computing_it(tiny_llama):
    """A self-draft's shadow holds the target's keys and values for the prompt and for the kept
    proposals, bit for bit (its own int8 weights would give others), and computes only the last
    token and its proposals. A draft named by path computes its own."""
    for model, adopts in (("self", True), (str(tiny_llama), False)):
        llm = LLM(str(tiny_llama), dtype="float32", block_size=4, speculative_config={
            "model": model, "quantization": "int8", "num_speculative_tokens": 3, "adaptive": False})
        engine = llm.engine
        engine.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for _ in range(3):  # the prompt, then two steps with proposals
            engine.step()
        draft = engine.speculator.proposer
        (seq,) = engine.scheduler.running
        shadow = draft._shadows[seq.seq_id]
        # The target's tokens as of the shadow's last sync: the prompt and the first step's
        # verified tokens (the shadow's KV after them is its own proposals').
        adopted = draft._synced[seq.seq_id] - 1
        assert adopted > len(PROMPTS[0])
        same = []
        for theirs, ours in zip(engine.runner.model.attention_layers(), draft.runner.model.attention_layers(), strict=True):
            for position in range(adopted):
                a = theirs.kv_cache.key.view(-1, *theirs.kv_cache.key.shape[2:])[slot(seq.block_table, position, 4)]
                b = ours.kv_cache.key.view(-1, *ours.kv_cache.key.shape[2:])[slot(shadow.block_table, position, 4)]
                same.append(torch.equal(a, b))
        assert all(same) if adopts else not any(same), model
        while engine.has_unfinished_requests():
            engine.step()


def test_adaptive_greedy_output_is_unchanged(tiny_llama, greedy_reference, assert_nothing_held):
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)) == greedy_reference
    assert llm.engine.stats().spec.num_verifications > 0
    assert_nothing_held(llm)


@pytest.fixture(scope="module")
def tokenizer_llama(tmp_path_factory, real_tokenizer_dirs):
    """A tiny random Llama with Llama 3's real tokenizer (stop strings need text)."""
    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001,
    )
    path = tmp_path_factory.mktemp("tok") / "llama"
    transformers.AutoModelForCausalLM.from_config(config).float().eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_tokenizer_dirs["llama3"] / name, path / name)
    return path


def test_sampling_parameters_behave_as_without_speculation(tokenizer_llama, assert_nothing_held):
    """Penalties, logprobs, min_tokens, stop ids, stop strings and max_tokens landing inside a
    proposal: the same tokens, text, logprobs and finish as without speculation (greedy)."""
    base = LLM(str(tokenizer_llama), dtype="float32")
    spec = LLM(str(tokenizer_llama), dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
                                   "adaptive": False})
    prompt = "one two three four one two three four one two three four one two three"
    reference = base.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    stop_text = base.engine.tokenizer.decode(reference.token_ids[9:11])
    cases = [
        SamplingParams(temperature=0, max_tokens=23, logprobs=3),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=7, stop_token_ids=[reference.token_ids[3]]),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_text], include_stop_str_in_output=True),
    ]
    for params in cases:
        want = base.generate(prompt, params)[0].outputs[0]
        got = spec.generate(prompt, params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), params
        if params.logprobs is not None:
            for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
                assert mine.keys() == theirs.keys()
                assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)
    assert spec.engine.stats().spec.num_accepted_tokens > 0
    assert_nothing_held(spec)


def exact_pair_probabilities(path, prompt: list[int], temperature: float, top_k: int) -> dict[tuple[int, int], float]:
    """P(first two generated tokens) under temperature and top_k, from transformers' logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def next_probs(ids_batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(ids_batch).logits[:, -1].double() / temperature
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)

    first = next_probs(torch.tensor([prompt]))[0]
    firsts = first.nonzero().flatten().tolist()
    second = next_probs(torch.tensor([prompt + [t] for t in firsts]))
    return {(a, b): float(first[a] * second[i, b]) for i, a in enumerate(firsts) for b in second[i].nonzero().flatten().tolist()}


def copy_prompt(path, prompt: list[int], top_k: int) -> list[int]:
    """`prompt` after pairs "t u" for every token t the model may sample first, u the model's
    likeliest token after t, so that prompt lookup proposes a plausible token after any t."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tail: list[int] = []
    for _ in range(10):
        with torch.no_grad():
            candidates = model(torch.tensor([tail + prompt])).logits[0, -1].topk(top_k).indices.tolist()
            new = [t for t in candidates if t not in tail[::2]]
            if not new:
                return tail + prompt
            after = model(torch.tensor([tail + prompt + [t] for t in new])).logits[:, -1].argmax(-1).tolist()
        tail += [t for pair in zip(new, after, strict=True) for t in pair]
    raise AssertionError("no stable copy prompt")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_outputs_keep_the_target_distribution(method, tiny_llama, tiny_llama_draft, assert_nothing_held):
    """Chi-square goodness of fit of the first two sampled tokens (the second is always
    verified) against transformers' exact pair probabilities. 3000 seeded samples; the test
    rejects at p < 1e-4, so a correct sampler fails it for one seed set in 10,000."""
    temperature, top_k, samples = 1.5, 5, 3000
    prompt = copy_prompt(tiny_llama, [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6], top_k)
    exact = exact_pair_probabilities(tiny_llama, prompt, temperature, top_k)
    config = spec_configs(tiny_llama_draft)[method] | {"num_speculative_tokens": 2}
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=config, max_num_seqs=256)
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, seed=i, ignore_eos=True)
              for i in range(samples)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * samples, params)
    observed: dict[tuple[int, int], int] = {}
    for out in outputs:
        pair = tuple(out.outputs[0].token_ids[:2])
        assert pair in exact, f"{pair} has probability 0 under the target"
        observed[pair] = observed.get(pair, 0) + 1
    # Cells expected fewer than 5 times are pooled into one.
    keys = sorted(exact, key=exact.get, reverse=True)
    big = [k for k in keys if exact[k] * samples >= 5]
    f_obs = [observed.get(k, 0) for k in big]
    f_exp = [exact[k] * samples for k in big]
    if len(big) < len(keys):
        f_obs.append(samples - sum(f_obs))
        f_exp.append(samples - sum(f_exp))
    f_exp = [e * samples / sum(f_exp) for e in f_exp]  # float64 rounding: the totals must agree
    result = scipy_stats.chisquare(f_obs, f_exp)
    assert result.pvalue > 1e-4, (result, f_obs, f_exp)
    spec = llm.engine.stats().spec
    assert spec.num_accepted_tokens > 200 and spec.num_proposed_tokens - spec.num_accepted_tokens > 200, spec
    # Seeded requests are reproducible.
    again = llm.generate([{"prompt_token_ids": prompt}] * 20, params[:20])
    assert token_ids(again) == token_ids(outputs[:20])
    assert_nothing_held(llm)


def test_no_blocks_leak_after_aborts_mid_draft_and_errors(tiny_llama, tiny_llama_draft, abort_odd_requests, assert_nothing_held):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=24 * 16 * 512, max_model_len=128,
              speculative_config=spec_configs(tiny_llama_draft)["draft_model"])
    engine = llm.engine
    abort_some = abort_odd_requests(engine)

    params = [SamplingParams(temperature=t, max_tokens=40, ignore_eos=True, seed=s)
              for s, t in enumerate([0, 0.8, 0, 1.0, 0.5, 0])]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params[: len(PROMPTS)], on_step=abort_some)
    assert abort_some.aborted and any(o.outputs[0].finish_reason == "abort" for o in outs)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                     [SamplingParams(), SamplingParams(max_tokens=0)])
    assert engine.stats().spec.num_proposed_tokens > engine.stats().spec.num_accepted_tokens
    assert_nothing_held(llm)
    # The engine still serves after all that.
    assert len(llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(max_tokens=5))[0].outputs[0].token_ids) == 5


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle' is not supported"),
    ({"method": "mtp", "model": "x", "num_speculative_tokens": 2}, "method='mtp' takes no model"),
    ({"method": "ngram"}, "num_speculative_tokens=None is invalid"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 is invalid"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "not supported"),
    ({"model": "self", "num_speculative_tokens": 2}, "needs a quantization"),
    ({"model": "self", "quantization": "fp8", "num_speculative_tokens": 2}, "quantization='fp8'"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "takes no model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive='yes'"),
    ("ngram", "expected a dict"),
])
def test_bad_speculative_config_is_a_clear_error(config, message):
    with pytest.raises(TuiliError, match=message):
        EngineConfig(speculative_config=config).validate()


def test_vllm_spellings_are_understood():
    config = EngineConfig(speculative_config={"model": "[ngram]", "num_speculative_tokens": 3,
                                              "prompt_lookup_max": 4})
    config.validate()
    spec = config.speculative_config
    assert (spec.method, spec.model, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", None, 4, 4)


def test_adaptive_k_stops_speculating_when_rows_are_expensive_and_acceptance_low():
    adaptive = AdaptiveK(max_k=4)
    seqs = list(range(32))
    # Steps cost 1 ms plus 1 ms per row: verifying 4 proposals quintuples a batch of 32's step.
    for rows, verified in [(32, False), (36, True), (34, True), (32, False), (160, True)]:
        adaptive.record_step(rows, verified, 0.001 + 0.001 * rows)
    for s in seqs:
        adaptive.record_acceptance(s, 4, 0)  # nothing kept
    assert adaptive.choose(seqs, [4] * 32) == [0] * 32
    # One sequence with cheap rows and proposals always kept: speculate, up to its limit.
    cheap = AdaptiveK(max_k=4)
    for rows, verified in [(1, False), (5, True), (3, True), (1, False)]:
        cheap.record_step(rows, verified, 0.02 + 0.0005 * rows)
    for _ in range(10):
        cheap.record_acceptance(0, 4, 4)
    assert cheap.choose([0], [3]) == [3]


def test_adaptive_k_looks_again_after_switching_off_and_new_sequences_start_from_the_overall_rate():
    """A verification step measured slow (say, while it captured a CPU graph) must not switch
    speculation off for good: after 16 plain steps one sequence verifies again. And a new
    sequence of a workload that accepts well is proposed for at once (the overall rate), where a
    Beta(1, 1) prior of 1/2 would not pay for the verification step."""
    adaptive = AdaptiveK(max_k=4)
    for rows, verified, seconds in [(1, False, 0.010), (5, True, 0.060), (3, True, 0.055)]:
        adaptive.record_step(rows, verified, seconds)
    assert adaptive.choose([7], [4]) == [0]  # verification looks 5x as dear as a plain step
    for step in range(16):
        assert adaptive.choose([7], [4]) == [0], step
        adaptive.record_step(1, False, 0.010)
    assert adaptive.choose([7], [4]) == [4]  # a look, at the full proposals
    adaptive.record_step(5, True, 0.014)  # ... cheap after all: the fit learns from it
    assert adaptive.choose([7], [4]) == [0]  # and the count starts again
    # The overall rate: verifications of other sequences, all kept, and cheap verification steps.
    fresh = AdaptiveK(max_k=4)
    for rows, verified, seconds in [(1, False, 0.010), (5, True, 0.030), (3, True, 0.026)]:
        fresh.record_step(rows, verified, seconds)
    assert fresh.choose([1], [4]) == [0]  # prior 1/2: at best 1.9 tokens in 30 ms, against 1 in 10
    for seq in range(2, 6):
        fresh.record_acceptance(seq, 4, 4)
    assert fresh.choose([1], [4]) == [4]  # sequence 1 has no verifications: the overall rate


def test_looks_that_leave_speculation_off_take_a_bounded_share_and_the_sequence_least_behind():
    """Where verifying never pays, the first look comes after 16 plain steps and measures what it
    cost (its proposals' time and its step beyond a plain one); each next look waits until the
    plain steps took 1 / 0.01 of that, so looks take at most 1% of the time. A look drafts for the
    sequence whose proposer has the fewest tokens to catch up (a draft model's shadow)."""
    adaptive = AdaptiveK(max_k=4)
    for rows, verified, seconds in [(3, False, 0.010), (7, True, 0.060), (5, True, 0.055)]:
        adaptive.record_step(rows, verified, seconds)
    gaps, looked, plain = [], [], 0
    while len(gaps) < 3:
        ks = adaptive.choose([1, 2, 3], [4] * 3, [100, 5, 60])
        if any(ks):
            gaps.append(plain)
            looked.append(ks)
            plain = 0
            adaptive.record_proposals(0.0205)  # the draft's time for the look
            adaptive.record_step(7, True, 0.060)  # still dear: speculation stays off
        else:
            plain += 1
            adaptive.record_step(3, False, 0.010)
    # a look costs 20.5 ms of proposals + 50 ms over a 10 ms plain step: 70.5 ms / 0.01 = 705 plain steps
    # (the 705th lands on the bound exactly: float rounding may take one more)
    assert gaps[0] == 16 and all(gap in (705, 706) for gap in gaps[1:]), gaps
    assert looked == [[0, 4, 0]] * 3


def test_a_draft_forward_is_paid_per_proposal_not_all_by_the_first():
    """SmolLM2-135M's int4 self-draft at batch 1 as measured on machine A: a 17.3 ms step, 0.31
    ms a row, 8.35 ms a draft forward, 95% kept. Three proposals give 3.71 tokens in ~44 ms (84 a
    second, against 58 plain, 74 with one proposal): the first proposal alone must not be made to
    pay for the three forwards of the depth (it then never paid, and k stayed at 1)."""
    adaptive = AdaptiveK(max_k=3)
    for rows, verified, seconds in [(1, False, 0.0173), (2, True, 0.0179), (4, True, 0.0185)]:
        adaptive.record_step(rows, verified, seconds)
    for _ in range(20):
        adaptive.record_acceptance(0, 3, 3)
    adaptive.record_acceptance(0, 3, 1)
    adaptive.record_draft_forward(0.00835, 1)
    assert adaptive.choose([0], [3]) == [3]


def test_a_draft_forward_measured_for_one_sequence_does_not_make_a_batch_look_free():
    """The draft's cost per forward is fitted to the sequences it drafts for: seen only at one
    sequence it is taken as proportional, so 32 sequences' proposals are weighed at 32 times it."""
    adaptive = AdaptiveK(max_k=3)
    # Target steps: ~10 ms, 0.1 ms a row (memory-bound decode), verifying costs nothing more.
    for rows, verified, seconds in [(1, False, 0.0100), (32, False, 0.0131), (35, True, 0.0134), (34, True, 0.0133)]:
        adaptive.record_step(rows, verified, seconds)
    for seq in range(32):
        adaptive.record_acceptance(seq, 3, 3)
    adaptive.record_draft_forward(0.002, 1)  # one explored sequence: 2 ms per forward
    assert adaptive.choose([0], [3]) == [3]  # alone, drafting pays
    assert adaptive.choose(list(range(32)), [3] * 32) == [0] * 32  # 32 x 2 ms per depth does not
    adaptive.record_draft_forward(0.003, 32)  # measured: a forward for 32 costs 3 ms
    assert all(k >= 2 for k in adaptive.choose(list(range(32)), [3] * 32))  # now every one drafts


def test_a_look_at_a_large_batch_is_charged_its_measured_cost_under_a_noisy_fit():
    """Batch 32 as measured on machine A with an int4 self-draft: plain steps of 38 ms (40 ms at
    30 rows: noise makes the slope negative), a look's eager 35-row step 72 ms and its proposals
    33 ms, so a look costs 72 - 38 + 33 = 67 ms and the next waits 67 / 0.01 = 6.7 s of plain
    steps, 176 of them. A least-squares fit clipped after the fact (a negative c_plain set to 0,
    the slope it came with kept) put the plain step at 64 ms and the look at 41 ms: looks came
    40% sooner than their budget allows."""
    adaptive = AdaptiveK(max_k=3)
    for rows, verified, seconds in [(30, False, 0.040), (32, False, 0.038), (35, True, 0.072), (34, True, 0.070)] * 3:
        adaptive.record_step(rows, verified, seconds)
    adaptive.record_draft_forward(0.009, 1)
    gaps, plain = [], 0
    while len(gaps) < 3:
        if any(adaptive.choose(list(range(32)), [3] * 32, [1] * 32)):
            gaps.append(plain)
            plain = 0
            adaptive.record_proposals(0.033)
            adaptive.record_step(35, True, 0.072)
        else:
            plain += 1
            adaptive.record_step(32, False, 0.038)
    assert gaps[0] == 16 and all(abs(gap - 176) <= 1 for gap in gaps[1:]), gaps
