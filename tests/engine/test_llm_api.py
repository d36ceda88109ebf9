"""The offline `LLM` API in the shapes vLLM users write: use_tqdm, {"prompt": text} prompts,
gpu_memory_utilization."""

from __future__ import annotations

import pytest

from tuili import LLM, SamplingParams

PROMPTS = ["The capital of France is", "One, two, three,"]
GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)


def test_use_tqdm_shows_a_bar_only_when_asked(llm, capsys):
    quiet = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    shown = llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "tok/s" in err
    assert [r.outputs[0].text for r in shown] == [r.outputs[0].text for r in quiet]
    assert llm.generate(PROMPTS, GREEDY)[0].outputs[0].text == quiet[0].outputs[0].text  # default: quiet
    assert capsys.readouterr().err == ""


def test_use_tqdm_takes_a_bar_class(llm):
    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.done, self.closed = total, 0, False
            bars.append(self)

        def update(self, n):
            self.done += n

        def set_postfix_str(self, text):
            pass

        def close(self):
            self.closed = True

    llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=Bar)
    assert [(b.total, b.done, b.closed) for b in bars] == [(1, 1, True)]


def test_a_text_prompt_dict_is_the_text(llm):
    as_text = llm.generate(PROMPTS, GREEDY)
    as_dicts = llm.generate([{"prompt": p} for p in PROMPTS], GREEDY)
    assert [r.outputs[0].text for r in as_dicts] == [r.outputs[0].text for r in as_text]
    assert [r.prompt_token_ids for r in as_dicts] == [r.prompt_token_ids for r in as_text]
    assert [r.prompt for r in as_dicts] == PROMPTS
    one = llm.generate({"prompt": PROMPTS[0]}, GREEDY)  # a lone dict is one prompt
    assert len(one) == 1 and one[0].outputs[0].text == as_text[0].outputs[0].text
    ids = llm.generate({"prompt_token_ids": as_text[1].prompt_token_ids}, GREEDY)
    assert ids[0].outputs[0].text == as_text[1].outputs[0].text


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": 5}, "'prompt'=5 is invalid: expected text"),
    ({"prompt": ""}, "prompt is empty"),
    ({}, "expected 'prompt' (text) or 'prompt_token_ids'"),
    ({"prompt": "Hi", "multi_modal_data": {}}, "keys ['multi_modal_data', 'prompt'] is invalid"),
])
def test_a_bad_prompt_dict_is_refused_by_name(llm, prompt, message):
    from tuili.errors import RequestError

    with pytest.raises(RequestError) as refused:
        llm.generate(prompt, GREEDY)
    assert message in str(refused.value)


def test_gpu_memory_utilization_is_that_fraction_of_available_ram_on_a_cpu(tiny_llama, monkeypatch):
    from tuili.engine import pool

    monkeypatch.setattr(pool, "available_ram", lambda: 64 << 20)

    def pool_tokens(**options) -> int:
        return LLM(str(tiny_llama), device="cpu", **options).engine.pool.num_tokens

    half, quarter = pool_tokens(gpu_memory_utilization=0.5), pool_tokens(gpu_memory_utilization=0.25)
    assert half == pool_tokens(kv_cache_memory=32 << 20)
    assert quarter == pool_tokens(kv_cache_memory=16 << 20) and 0 < quarter < half
    assert pool_tokens(gpu_memory_utilization=1) == pool_tokens(kv_cache_memory=64 << 20)


def test_the_cpu_default_pool_stops_at_twice_what_every_sequence_at_full_length_holds():
    """The fixed 2 GiB default: a model with little KV per token gets twice max_num_seqs
    sequences of max_model_len tokens, not gigabytes; one with more KV gets the 2 GiB; a budget
    the user gives is taken whole."""
    import torch
    import transformers

    from tuili.config import EngineConfig, ModelConfig
    from tuili.engine.pool import plan_pool

    def model(layers: int, kv_heads: int) -> ModelConfig:
        config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=kv_heads,
                                          num_hidden_layers=layers, max_position_embeddings=1000)
        return ModelConfig.from_hf_config(config.to_dict() | {"architectures": ["LlamaForCausalLM"]})

    def plan(cfg: ModelConfig, **options):
        return plan_pool(cfg, EngineConfig(**options), torch.float32, torch.device("cpu"))

    small, large = model(2, 1), model(32, 4)
    assert plan(small).num_blocks == 2 * 64 * 63  # ceil(1000 / 16) blocks a sequence
    assert plan(small, max_num_seqs=4, max_model_len=100).num_blocks == 2 * 4 * 7
    assert plan(small, kv_cache_memory=2 << 30).num_blocks * plan(small).bytes_per_block == 2 << 30
    assert plan(large).num_blocks * plan(large).bytes_per_block == 2 << 30


@pytest.mark.parametrize("options, message", [
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization=0 is invalid: expected a fraction, 0 < x <= 1"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5 is invalid"),
    ({"gpu_memory_utilization": True}, "gpu_memory_utilization=True is invalid"),
    ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization='0.9' is invalid"),
    ({"gpu_memory_utilization": 0.5, "kv_cache_memory": 1 << 20},
     "gpu_memory_utilization=0.5 and kv_cache_memory=1048576 both size the KV cache: give one of them"),
])
def test_bad_gpu_memory_utilization_is_refused(tiny_llama, options, message):
    from tuili.errors import TuiliError

    with pytest.raises(TuiliError) as refused:
        LLM(str(tiny_llama), device="cpu", **options)
    assert message in str(refused.value)


def test_get_tokenizer_is_the_models_hugging_face_tokenizer(llm):
    from transformers import PreTrainedTokenizerFast

    tokenizer = llm.get_tokenizer()
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer.eos_token_id in llm.engine.eos_token_ids
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text.endswith("assistant\n")  # SmolLM2's ChatML template
    ids = tokenizer.encode(text, add_special_tokens=False)
    by_chat = llm.chat(conversation, GREEDY)[0]
    assert ids == by_chat.prompt_token_ids
    by_text = llm.generate({"prompt": text}, GREEDY)[0]  # vLLM users' way: the template's text as the prompt
    assert by_text.prompt_token_ids == ids and by_text.outputs[0].text == by_chat.outputs[0].text


def test_get_tokenizer_of_a_hugging_face_directory(tmp_path, real_tokenizer_dirs):
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
        eos_token_id=151645,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_tokenizer_dirs["qwen3"] / name, tmp_path / name)
    tokenizer = LLM(str(tmp_path), dtype="float32", kv_cache_memory=8 << 20, max_model_len=128).get_tokenizer()
    reference = transformers.AutoTokenizer.from_pretrained(real_tokenizer_dirs["qwen3"])
    conversation = [{"role": "user", "content": "Hi"}]
    assert tokenizer.eos_token_id == reference.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True))
    assert tokenizer("Hello, wörld")["input_ids"] == reference("Hello, wörld")["input_ids"]
