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
