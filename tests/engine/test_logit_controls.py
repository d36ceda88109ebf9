"""logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens through the engine: in
decode steps replayed from CPU graphs exactly as in eager ones, together with a grammar's mask,
and refused by value when they name tokens the model does not have."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from tuili import LLM, SamplingParams, StructuredOutputsParams, kernels
from tuili.errors import RequestError


def run(path, prompts, params, **options):
    llm = LLM(model=str(path), device="cpu", block_size=4, kv_cache_memory=1 << 22, max_model_len=128, **options)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    return llm, [o.outputs[0].token_ids for o in outs]


PROMPTS = [[5, 17, 250, 3, 99], [42], list(range(30, 53)), [7, 7, 7, 200, 201]]
ALLOWED = [11, 12, 13, 200]


def batch_params() -> list[SamplingParams]:
    """A mixed batch: greedy and seeded rows, each with a different control (one with none)."""
    return [
        SamplingParams(temperature=0.9, seed=1, max_tokens=12, ignore_eos=True, allowed_token_ids=ALLOWED),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logit_bias={77: 100.0}),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=4, max_tokens=10, ignore_eos=True, logit_bias={3: 8.0, 9: -100.0},
                       allowed_token_ids=[3, 9, 150, 151]),
    ]


@pytest.mark.skipif(not kernels.available(), reason="CPU graphs replay the native kernels")
def test_controls_hold_in_graph_replayed_decode_steps_as_in_eager_ones(tiny_qwen3_bf16):
    llm, replayed = run(tiny_qwen3_bf16, PROMPTS, batch_params(), dtype="bfloat16")
    _, eager = run(tiny_qwen3_bf16, PROMPTS, batch_params(), dtype="bfloat16", enforce_eager=True)
    assert replayed == eager
    # The controls never stop a step from replaying: sampling runs on the graph's logits.
    assert llm.engine.runner.graphs.captured_batch_sizes() == [1, 2, 3, 4]
    assert set(replayed[0]) <= set(ALLOWED)
    assert replayed[1] == [77] * 9
    assert set(replayed[3]) <= {3, 150, 151}  # 9 is allowed but biased away
    _, plain = run(tiny_qwen3_bf16, PROMPTS[2:3], [batch_params()[2]], dtype="bfloat16")
    assert replayed[2] == plain[0]  # a row without controls is not touched by its neighbours'


def test_out_of_vocabulary_ids_and_bad_words_without_a_tokenizer_are_refused(tiny_qwen3_bf16):
    llm = LLM(model=str(tiny_qwen3_bf16), device="cpu", dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)
    prompt = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(RequestError, match=r"logit_bias token id 320 is out of range: expected token ids in \[0, 320\)"):
        llm.generate(prompt, SamplingParams(logit_bias={320: 1.0}))
    with pytest.raises(RequestError, match="allowed_token_ids token id 1000"):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[1, 1000]))
    with pytest.raises(RequestError, match="bad_words need a tokenizer"):
        llm.generate(prompt, SamplingParams(bad_words=["sea"]))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(tiny_qwen3_bf16):
    llm = LLM(model=str(tiny_qwen3_bf16), device="cpu", dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)
    long_prompt = list(range(1, 101))  # longer than the context
    cut = llm.generate({"prompt_token_ids": long_prompt}, SamplingParams(temperature=0, max_tokens=5,
                                                                       truncate_prompt_tokens=20))[0]
    direct = llm.generate({"prompt_token_ids": long_prompt[-20:]}, SamplingParams(temperature=0, max_tokens=5))[0]
    assert cut.prompt_token_ids == long_prompt[-20:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(RequestError, match="prompt has 64 tokens but max_model_len is 64"):
        llm.generate({"prompt_token_ids": long_prompt}, SamplingParams(truncate_prompt_tokens=-1))
    with pytest.raises(RequestError, match="truncate_prompt_tokens=65"):
        llm.generate({"prompt_token_ids": long_prompt}, SamplingParams(truncate_prompt_tokens=65))


@pytest.fixture(scope="module")
def qwen3_with_tokenizer(tmp_path_factory, real_tokenizer_dirs):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=151645,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("qwen3-tok") / "model"
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_tokenizer_dirs["qwen3"] / name, path / name)
    return path


def test_controls_compose_with_a_grammar(qwen3_with_tokenizer):
    llm = LLM(model=str(qwen3_with_tokenizer), device="cpu", dtype="float32", kv_cache_memory=16 << 20,
              max_model_len=128)
    tokenizer = llm.engine.tokenizer
    choice = StructuredOutputsParams(choice=["cat", "dog"])
    dog = tokenizer.encode("dog", add_special_tokens=False)
    eos = sorted(tokenizer.eos_token_ids)
    # "cat" has many spellings in tokens the grammar allows; banning one first token would not
    # stop it, so the controls steer towards "dog" instead.
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=8, structured_outputs=choice,
                             logit_bias={dog[0]: 100.0}) for seed in range(4)]
    params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=8, structured_outputs=choice,
                              allowed_token_ids=dog + eos) for seed in range(4)]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=8, structured_outputs=choice))
    outs = llm.generate(["Pick one:"] * len(params), params)
    texts = [o.outputs[0].text for o in outs]
    assert texts[:-1] == ["dog"] * (len(params) - 1)
    assert texts[-1] in ("cat", "dog")  # the grammar alone


def test_controls_hold_in_speculative_verification(tiny_qwen3_bf16):
    """Verification rows see the controls as if the proposed tokens had been generated: the
    greedy outputs equal those without speculation."""
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], [5, 6, 5, 6, 5, 6, 5]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8, 9]),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={6: 5.0, 5: 5.0})]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm, speculated = run(tiny_qwen3_bf16, prompts, params, dtype="float32", speculative_config=spec)
    _, plain = run(tiny_qwen3_bf16, prompts, params, dtype="float32")
    assert speculated == plain
    assert set(speculated[0]) <= {5, 6, 7, 8, 9}
    assert llm.engine.stats().spec.num_accepted_tokens > 0  # the proposals were verified, some kept
