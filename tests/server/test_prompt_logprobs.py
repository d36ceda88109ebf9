"""Prompt logprobs over HTTP: `echo` with `logprobs` (max_tokens 0 allowed with echo) and vLLM's
`prompt_logprobs` field, through the official `openai` client against a real `tuili serve` of a
tiny random Llama (float32) with Llama 3's tokenizer, checked against transformers'
log_softmax; and lm-eval's `local-completions` scoring a local multiple-choice task (its
log-likelihood requests: echo, logprobs, max_tokens 1, token-id prompts), per choice against
transformers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from tests.server.conftest import ServerProcess

MODEL = "tiny-llama"
TEXT = "The quick brown fox jumps over the lazy dog, and then it sleeps."
TOLERANCE = 2e-4  # float32, same weights: only the order of the sums differs


@dataclass
class Tiny:
    path: Path
    hf: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    server: ServerProcess

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """transformers' log_softmax at every position of `ids` (row i predicts ids[i + 1])."""
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module")
def tiny(real_tokenizer_dirs, tmp_path_factory):
    tokenizer = transformers.AutoTokenizer.from_pretrained(real_tokenizer_dirs["llama3"])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path_factory.mktemp("served") / "llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    server = ServerProcess("--model", str(path), "--served-model-name", MODEL, "--dtype", "float32",
                           "--max-model-len", "256", "--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "13")
    yield Tiny(path, model, tokenizer, server)
    server.stop()


@pytest.fixture(scope="module")
def tiny_client(tiny) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny.server.url}/v1", api_key="none", max_retries=0, timeout=300)


def test_echo_with_logprobs_and_max_tokens_0_on_token_id_prompts(tiny, tiny_client):
    """lm-eval's loglikelihood request shape, two prompts in one call: the prompt back, each
    token's logprob (the first null), nothing generated."""
    prompts = [tiny.tokenizer.encode(TEXT), tiny.tokenizer.encode("Hello there", add_special_tokens=False)]
    response = tiny_client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0,
                                              temperature=0)
    assert response.usage.prompt_tokens == sum(map(len, prompts)) and response.usage.completion_tokens == 0
    for ids, choice in zip(prompts, sorted(response.choices, key=lambda c: c.index), strict=True):
        assert choice.text == tiny.tokenizer.decode(ids)  # the BOS spelled out, as in the tokens
        assert choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        reference = tiny.logprobs(ids)
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(reference[i - 1, ids[i]].item(), abs=TOLERANCE)
            top = lp.top_logprobs[i]
            best = int(reference[i - 1].argmax())
            assert top[tiny.tokenizer.decode([best])] == pytest.approx(reference[i - 1, best].item(), abs=TOLERANCE)
            assert top[lp.tokens[i]] == lp.token_logprobs[i] and len(top) <= 2
        assert lp.tokens == [tiny.tokenizer.decode([t]) for t in ids]


def test_echo_with_generation_puts_the_prompt_first(tiny, tiny_client):
    common = dict(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    plain = tiny_client.completions.create(**{k: v for k, v in common.items() if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True}).choices[0]
    echoed = tiny_client.completions.create(**{k: v for k, v in common.items() if k != "ignore_eos"}, echo=True,
                                            extra_body={"ignore_eos": True})
    choice = echoed.choices[0]
    ids = tiny.tokenizer.encode(TEXT)
    assert choice.text == TEXT + plain.text
    assert echoed.usage.completion_tokens == 4
    assert choice.logprobs.tokens[len(ids):] == plain.logprobs.tokens
    assert choice.logprobs.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    reference = tiny.logprobs(ids)
    assert choice.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
        [reference[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=TOLERANCE)
    # the text offsets run through the prompt's tokens into the generated ones
    offsets = choice.logprobs.text_offset
    steps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0 and steps == [len(t) for t in choice.logprobs.tokens[:-1]]


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_concatenates_to_the_whole_response(tiny, tiny_client, max_tokens):
    common = dict(model=MODEL, prompt=[tiny.tokenizer.encode(TEXT), tiny.tokenizer.encode("Hi")], echo=True,
                  logprobs=2, max_tokens=max_tokens, temperature=0)
    whole = {c.index: c for c in tiny_client.completions.create(**common).choices}
    text: dict[int, str] = {}
    tokens: dict[int, list] = {}
    values: dict[int, list] = {}
    offsets: dict[int, list] = {}
    finish: dict[int, str] = {}
    for chunk in tiny_client.completions.create(**common, stream=True):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                values.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(text) == sorted(whole) == [0, 1]
    for index, choice in whole.items():
        assert text[index] == choice.text and finish[index] == choice.finish_reason
        assert tokens[index] == choice.logprobs.tokens
        assert values[index] == choice.logprobs.token_logprobs and values[index][0] is None
        assert offsets[index][: len(tiny.tokenizer.encode(TEXT))] == choice.logprobs.text_offset[
            : len(tiny.tokenizer.encode(TEXT))]


def _check_prompt_logprobs(tiny: Tiny, ids: list[int], field: list, k: int) -> None:
    """vLLM's prompt_logprobs JSON: null, then per position token id -> {logprob, rank, decoded_token}."""
    assert len(field) == len(ids) and field[0] is None
    reference = tiny.logprobs(ids)
    for i in range(1, len(ids)):
        entry = {int(t): lp for t, lp in field[i].items()}
        row, token = reference[i - 1], ids[i]
        assert entry[token]["logprob"] == pytest.approx(row[token].item(), abs=TOLERANCE)
        # the rank within the reference's: values within TOLERANCE of the token's may order either way
        # (a 128k vocabulary has neighbours 1e-5 apart)
        rank, value = entry[token]["rank"], row[token]
        assert int((row >= value + TOLERANCE).sum()) + 1 <= rank <= int((row >= value - TOLERANCE).sum())
        assert entry[token]["decoded_token"] == tiny.tokenizer.decode([token])
        best = row.topk(k).indices.tolist()
        assert [entry[t]["rank"] for t in best] == list(range(1, k + 1))
        assert set(entry) == set(best) | {token}


def test_prompt_logprobs_field_on_both_endpoints(tiny, tiny_client):
    ids = tiny.tokenizer.encode(TEXT)
    response = tiny_client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, extra_body={"prompt_logprobs": 3})
    _check_prompt_logprobs(tiny, ids, response.choices[0].model_extra["prompt_logprobs"], 3)
    assert response.choices[0].logprobs is None  # the generated tokens' are a separate field

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = tiny_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                               extra_body={"prompt_logprobs": 0})
    chat_ids = tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    assert chat.usage.prompt_tokens == len(chat_ids)
    _check_prompt_logprobs(tiny, chat_ids, chat.model_extra["prompt_logprobs"], 0)

    plain = httpx.post(f"{tiny.server.url}/v1/completions", json={"model": MODEL, "prompt": TEXT, "max_tokens": 1},
                       timeout=60).json()
    assert "prompt_logprobs" not in plain["choices"][0]  # only when asked


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": TEXT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": TEXT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": TEXT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": TEXT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
])  # fmt: skip
def test_what_is_not_honoured_is_refused_by_name(tiny, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(f"{tiny.server.url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and param in response.json()["error"]["message"]


TASK = """\
task: tuili_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
DOCS = [
    {"question": "What colour is the sky on a clear day?", "choices": ["blue", "green", "red"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten", "twelve"], "answer": 1},
    {"question": "Which is a fruit?", "choices": ["carrot", "apple"], "answer": 1},
]


def test_lm_eval_local_completions_matches_transformers(tiny, tmp_path, monkeypatch):
    """lm-eval scores each choice as its continuation's summed logprob from an echo request; the
    sums must be transformers' on the same tokens (tokenized as lm-eval does: the context's
    trailing spaces moved to the continuation, no BOS)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    results = simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={tiny.server.url}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={tiny.path},num_concurrent=1,max_retries=1,max_length=256",
        tasks=["tuili_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
        batch_size=4,
    )  # fmt: skip
    samples = results["samples"]["tuili_tiny_mc"]
    assert sum(len(s["arguments"]) for s in samples) == sum(len(d["choices"]) for d in DOCS)
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            context, continuation = context[: len(context.rstrip())], context[len(context.rstrip()):] + continuation
            whole = tiny.tokenizer(context + continuation, add_special_tokens=False).input_ids
            start = len(tiny.tokenizer(context, add_special_tokens=False).input_ids)
            reference = tiny.logprobs(whole)
            expected = sum(reference[i - 1, whole[i]].item() for i in range(start, len(whole)))
            loglikelihood = response[0][0]
            assert math.isfinite(loglikelihood) and loglikelihood == pytest.approx(expected, abs=1e-3)
