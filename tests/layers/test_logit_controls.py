"""The sampler's logit controls (logit_bias, allowed_token_ids, bad_words) against transformers'
logits processors of the same definition, in mixed batches, greedy and sampled. With a grammar
and through the engine: tests/engine/test_logit_controls.py."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

from tuili.errors import RequestError
from tuili.layers.sampler import Sampler, SamplingRow
from tuili.platform import Platform
from tuili.sampling import SamplingParams

sampler = Sampler(Platform.detect())
VOCAB = 50


def row(prompt: list[int], output: list[int], bad_word_ids: list[list[int]] | None = None, **params) -> SamplingRow:
    sampling = SamplingParams(**params)
    sampling.bad_words_token_ids = bad_word_ids or []  # what the engine tokenizes bad_words into
    generator = None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
    return SamplingRow(sampling, prompt + output, len(prompt), generator)


def processed_logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return torch.log_softmax(Sampler.process(logits, rows), dim=-1)


def test_logit_bias_is_transformers_sequence_bias_of_single_tokens():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    bias = {3: 5.0, 17: -100.0, 40: 2.5}
    rows = [row([1, 2], [4], logit_bias=bias), row([1], [], temperature=0.0), row([5], [6], logit_bias={3: -7.0})]
    got = processed_logprobs(logits, rows)
    for r, b in ((0, bias), (2, {3: -7.0})):
        reference = SequenceBiasLogitsProcessor([[[t], v] for t, v in b.items()])
        expected = reference(torch.tensor([rows[r].token_ids]), logits[r : r + 1].clone())[0]
        torch.testing.assert_close(got[r], expected.log_softmax(-1))
    torch.testing.assert_close(got[1], logits[1].log_softmax(-1))  # a row without controls is untouched


def test_logit_bias_forces_and_bans_greedy_and_sampled_tokens():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    favourite = int(logits[0].argmax())
    rows = [row([1], [], temperature=0.0, logit_bias={favourite: -100.0}),
            row([1], [], temperature=0.0, logit_bias={7: 100.0}),
            row([1], [], temperature=1.0, seed=3, logit_bias={9: 100.0}),
            row([1], [], temperature=0.0)]
    tokens = [t.token_id for t in sampler(logits, rows)]
    assert tokens[0] != favourite and tokens[0] == int(logits[0].topk(2).indices[1])
    assert tokens[1:3] == [7, 9]
    assert tokens[3] == int(logits[3].argmax())


def test_allowed_token_ids_keep_only_those_tokens():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    allowed = [4, 11, 30]
    rows = [row([1], [], temperature=1.0, allowed_token_ids=allowed), row([1], [], temperature=0.0,
                                                                           allowed_token_ids=allowed)]
    torch.manual_seed(0)
    draws = {sampler(logits, rows)[0].token_id for _ in range(300)}
    assert draws == set(allowed)  # each has probability > 1% here; none outside
    got = processed_logprobs(logits, rows)[0]
    expected = torch.full((VOCAB,), float("-inf"))
    expected[allowed] = logits[0, allowed].log_softmax(-1)
    torch.testing.assert_close(got, expected)
    assert sampler(logits, rows)[1].token_id == allowed[int(logits[1, allowed].argmax())]


def test_bad_words_match_transformers_no_bad_words_over_the_output():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    words = [[8], [20, 21], [30, 31, 32]]
    outputs = [[5, 20], [30, 31], [30, 9], []]  # prefix of word 2, of word 3, of none, nothing
    rows = [row([0], out, words, temperature=0.0) for out in outputs]
    got = processed_logprobs(logits, rows)
    reference = NoBadWordsLogitsProcessor(words, eos_token_id=VOCAB - 1)
    for r, out in enumerate(outputs):
        expected = reference(torch.tensor([[0, *out]]), logits[r : r + 1].clone())[0]
        torch.testing.assert_close(got[r], expected.log_softmax(-1))


def test_a_multi_token_bad_word_is_banned_only_as_a_whole_and_only_in_the_output():
    logits = torch.zeros(2, VOCAB)
    logits[:, 21] = 10.0
    word = [[20, 21]]
    # The prompt ends with 20, but vLLM matches the generated tokens only.
    tokens = [t.token_id for t in sampler(logits, [row([20], [], word, temperature=0.0),
                                                   row([1], [20], word, temperature=0.0)])]
    assert tokens[0] == 21 and tokens[1] != 21


def test_controls_compose_with_each_other_and_the_penalties():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    rows = [row([1], [3], [[5]], temperature=0.0, allowed_token_ids=[3, 5, 6, 7], logit_bias={6: 50.0},
                frequency_penalty=2.0)]
    expected = logits[0].clone()
    keep = torch.full((VOCAB,), float("-inf"))
    keep[[3, 6, 7]] = 0.0  # 5 is a bad word
    expected = expected + keep
    expected[6] += 50.0
    expected[3] -= 2.0  # generated once
    torch.testing.assert_close(processed_logprobs(logits, rows)[0], expected.log_softmax(-1))
    assert sampler(logits, rows)[0].token_id == 6


def test_controls_take_the_torch_path_not_the_native_greedy_one():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5))
    rows = [row([1], [], temperature=0.0) for _ in range(7)] + [row([1], [], temperature=0.0, logit_bias={0: 100.0})]
    assert sampler(logits, rows)[-1].token_id == 0


@pytest.mark.parametrize(("field", "value"), [
    ("logit_bias", {3: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"3": 1.0}), ("logit_bias", {3: float("nan")}),
    ("allowed_token_ids", []), ("allowed_token_ids", [1, -2]), ("bad_words", [""]), ("bad_words", "word"),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
])
def test_bad_values_are_refused_by_name(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_truncate_keeps_the_last_tokens():
    ids = list(range(10))
    assert SamplingParams(truncate_prompt_tokens=3).truncate(ids, 32) == [7, 8, 9]
    assert SamplingParams(truncate_prompt_tokens=-1).truncate(ids, 4) == [6, 7, 8, 9]
    assert SamplingParams().truncate(ids, 4) == ids
    with pytest.raises(RequestError, match="truncate_prompt_tokens=33"):
        SamplingParams(truncate_prompt_tokens=33).truncate(ids, 32)


def test_token_ids_beyond_the_vocabulary_are_refused_naming_them():
    with pytest.raises(RequestError, match="logit_bias token id 50 .*\\[0, 50\\)"):
        SamplingParams(logit_bias={50: 1.0}).check_token_ids(VOCAB)
    with pytest.raises(RequestError, match="allowed_token_ids token id 99"):
        SamplingParams(allowed_token_ids=[1, 99]).check_token_ids(VOCAB)
