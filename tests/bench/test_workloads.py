"""Workloads: prompt lengths checked against a real tokenizer, dataset files, length sampling."""

import asyncio
import json
import random

import pytest

from tuili.bench.tokens import LocalTokenizer
from tuili.bench.workloads import (
    FileWorkload,
    MultiTurnWorkload,
    PromptBuilder,
    RandomWorkload,
    SharedPrefixWorkload,
    collect,
    sample_length,
)
from tuili.errors import TuiliError


def run(coro):
    return asyncio.run(coro)


def test_prompt_builder_hits_the_token_count_of_a_real_tokenizer(local_tokenizer, reference_tokenizer):
    builder = PromptBuilder(local_tokenizer)
    rng = random.Random(1)
    run(builder.calibrate(rng))
    for seed, target in enumerate((1, 2, 7, 64, 300, 2000)):
        text, counted = run(builder.text(seed, target))
        actual = len(reference_tokenizer.encode(text, add_special_tokens=False).ids)
        assert counted == actual
        assert abs(actual - target) <= max(1, target // 100), (target, actual)


def test_without_a_counter_one_token_per_word_is_assumed():
    text, counted = run(PromptBuilder(None).text(0, 50))
    assert counted is None and len(text.split()) == 50


def test_sample_length_is_uniform_over_its_range():
    rng = random.Random(0)
    draws = [sample_length(rng, 100, 0.2) for _ in range(20000)]
    assert min(draws) == 80 and max(draws) == 120
    assert sum(draws) / len(draws) == pytest.approx(100, rel=0.01)
    assert {sample_length(rng, 100, 0.0) for _ in range(10)} == {100}
    assert min(sample_length(rng, 1, 0.9) for _ in range(100)) == 1


def test_random_workload_is_reproducible_and_unique():
    def sessions(seed):
        workload = RandomWorkload(PromptBuilder(None), 20, 8, 0.5, seed)
        return run(collect(workload.sessions(), 30))

    first, again, other = sessions(3), sessions(3), sessions(4)
    prompts = [s.turns[0].user for s in first]
    assert prompts == [s.turns[0].user for s in again]
    assert prompts != [s.turns[0].user for s in other]
    assert len(set(prompts)) == 30
    assert all(4 <= s.turns[0].max_tokens <= 12 for s in first)


def test_shared_prefix_workload_has_k_prefixes_each_with_n_questions():
    workload = SharedPrefixWorkload(PromptBuilder(None), groups=3, prefix_len=40, questions=4, input_len=10,
                                    output_len=5, range_ratio=0.0, seed=0)
    sessions = run(collect(workload.sessions(), workload.default_requests))
    assert len(sessions) == 12
    systems = [s.context[0]["content"] for s in sessions]
    assert len(set(systems)) == 3 and all(systems.count(p) == 4 for p in set(systems))
    assert all(len(p.split()) == 40 for p in systems)
    assert len({s.turns[0].user for s in sessions}) == 12


def test_multi_turn_collect_cuts_the_last_conversation_to_the_request_count():
    workload = MultiTurnWorkload(PromptBuilder(None), turns=4, input_len=5, output_len=5, range_ratio=0, seed=0)
    sessions = run(collect(workload.sessions(), 10))
    assert [len(s.turns) for s in sessions] == [4, 4, 2]


def test_dataset_file_of_prompts_messages_and_sharegpt(tmp_path, local_tokenizer, reference_tokenizer):
    reply = "Paris is the capital of France, and it has been for a long time."
    records = [
        {"prompt": "Say hi", "max_tokens": 7},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]},
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "Capital of France?"},
                           {"from": "gpt", "value": reply}, {"from": "human", "value": "And Spain?"}]},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    workload = FileWorkload(path, output_len=33, tokenizer=local_tokenizer)
    a, b, c = workload.records
    assert (a.turns[0].user, a.turns[0].max_tokens, a.context) == ("Say hi", 7, [])
    assert (b.turns[0].user, b.turns[0].max_tokens) == ("Why?", 33)
    assert b.context == [{"role": "system", "content": "Be brief."}]
    assert c.context == [{"role": "system", "content": "sys"}]
    assert [t.user for t in c.turns] == ["Capital of France?", "And Spain?"]
    assert c.turns[0].max_tokens == len(reference_tokenizer.encode(reply, add_special_tokens=False).ids)
    assert c.turns[1].max_tokens == 33
    assert workload.default_requests == 4

    as_array = tmp_path / "sharegpt.json"
    as_array.write_text(json.dumps(records))
    assert len(FileWorkload(as_array, output_len=33).records) == 3


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "x"}\n{"nothing": 1}\n', r"data.jsonl:2: .* expected a 'prompt' string"),
    ('{"prompt": "x", "max_tokens": 0}\n', r"data.jsonl:1: .* integer >= 1"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}\n', r"ending with a user message"),
    ('{"conversations": [{"from": "gpt", "value": "x"}]}\n', r"at least one 'human' message"),
    ("{not json\n", r"not valid JSON"),
    ("", r"holds no records"),
])
def test_bad_dataset_files_name_the_record_and_what_was_expected(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(TuiliError, match=message):
        FileWorkload(path, output_len=10)


def test_missing_dataset_and_tokenizer_files():
    with pytest.raises(TuiliError, match="cannot be read"):
        FileWorkload("/nonexistent/data.jsonl", output_len=10)
    with pytest.raises(TuiliError, match="expected a tokenizer.json"):
        LocalTokenizer("/nonexistent")
