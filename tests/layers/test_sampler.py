"""tuili.layers.sampler: each parameter against a direct computation of its definition, and
statistical checks that draws follow the filtered, renormalised distribution."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from tuili.layers.sampler import Sampler, SamplingRow
from tuili.platform import Platform
from tuili.sampling import SamplingParams

sampler = Sampler(Platform.detect())

# The sampler runs wherever the logits are; where a GPU is present, the key tests run there too.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    suppressed: list[int] | None = None,
    device: str = "cpu",
    **params,
) -> SamplingRow:
    sampling = SamplingParams(**params)
    generator = None if sampling.seed is None else torch.Generator(device).manual_seed(sampling.seed)
    prompt, output = list(prompt or []), list(output or [])
    return SamplingRow(sampling, prompt + output, len(prompt), generator, list(suppressed or []))


def full_logprobs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The processed distribution as the sampler reports it (logprobs=V returns every token)."""
    (result,) = sampler(logits.unsqueeze(0), [row])
    values = torch.full((logits.shape[0],), float("nan"))
    for token, logprob in result.top_logprobs.items():
        values[token] = logprob
    return values


# ---- greedy and seeds -------------------------------------------------------------------------


def test_temperature_zero_and_top_k_one_are_argmax():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(dim=-1).tolist()
    for params in (
        {"temperature": 0.0},
        {"temperature": 1.3, "top_k": 1},
        {"temperature": 0.7, "top_k": 1, "top_p": 0.5},
    ):
        rows = [make_row(**params) for _ in range(64)]
        assert [t.token_id for t in sampler(logits, rows)] == expected


def test_greedy_over_non_finite_logits_and_ties_is_the_same_natively_and_in_torch():
    """Plain greedy rows go to the native arg-max where it builds; it must pick what the torch path
    picks after nan_to_num: the first of tied maxima, +inf as the largest finite value, never NaN."""
    logits = torch.randn(7, 3001, generator=torch.Generator().manual_seed(5))
    logits[0, 17] = logits[0, 2900] = 50.0  # a tie: the first wins
    logits[1, 5] = float("nan")
    logits[1, 6] = 40.0
    logits[2, 100] = logits[2, 3000] = float("inf")  # both read as the largest float: the first wins
    logits[3, :] = float("nan")
    logits[4, :] = float("-inf")
    logits[5, 3000] = 60.0  # the maximum in the last, odd element
    rows = [make_row(temperature=0.0) for _ in range(7)]
    native = [t.token_id for t in sampler(logits, rows)]
    assert [t.token_id for t in Sampler(Platform.portable())(logits, rows)] == native
    assert native[:3] == [17, 6, 100] and native[5] == 3000


def test_input_logits_are_left_alone_and_any_float_dtype_works():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = logits.clone()
    rows = [make_row(temperature=0.0, repetition_penalty=2.0, prompt=[1, 2, 3], suppressed=[4])] * 4
    tokens = [t.token_id for t in sampler(logits, rows)]
    assert torch.equal(logits, before)
    assert len(tokens) == 4 and all(0 <= t < 50 for t in tokens)


def generate(
    logits_per_step: list[torch.Tensor],
    row_position: int,
    batch_size: int,
    seed: int,
    mates: list[dict],
    device: str = "cpu",
):
    """Tokens of one seeded sequence sampled over several steps inside a batch of ``batch_size``."""
    params = dict(
        temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, presence_penalty=0.5, repetition_penalty=1.2
    )
    target = make_row(prompt=[5, 6, 7], seed=seed, device=device, **params)
    others = [make_row(prompt=[1], device=device, **mates[i % len(mates)]) for i in range(batch_size - 1)]
    noise = torch.Generator().manual_seed(1000 + batch_size)  # batch-mates' logits differ per batch
    tokens = []
    for step_logits in logits_per_step:
        batch = torch.randn(batch_size, step_logits.shape[0], generator=noise) * 3
        batch[row_position] = step_logits
        rows = others[:row_position] + [target] + others[row_position:]
        results = sampler(batch.to(device), rows)
        for row, result in zip(rows, results, strict=True):
            row.output_token_ids.append(result.token_id)
        tokens.append(results[row_position].token_id)
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sequence_is_the_same_in_any_batch(device):
    steps = [torch.randn(300, generator=torch.Generator().manual_seed(s)) * 2 for s in range(30)]
    alone = generate(steps, row_position=0, batch_size=1, seed=1234, mates=[{}], device=device)
    mates = [
        {},  # unseeded, global RNG
        {"seed": 7, "temperature": 1.5},
        {"temperature": 0.0},
        {"top_p": 0.5, "min_p": 0.1, "frequency_penalty": 1.0},
        {"top_k": 5, "seed": 99, "logprobs": 3},
    ]
    torch.manual_seed(0)
    in_batch_of_6 = generate(steps, row_position=3, batch_size=6, seed=1234, mates=mates, device=device)
    torch.manual_seed(1)
    in_batch_of_17 = generate(
        steps, row_position=16, batch_size=17, seed=1234, mates=mates[::-1], device=device
    )
    assert alone == in_batch_of_6 == in_batch_of_17
    # The seed matters: another seed gives another sequence (30 draws over a broad distribution).
    assert generate(steps, row_position=0, batch_size=1, seed=4321, mates=[{}], device=device) != alone


# ---- the filters draw from the right sets with the right frequencies ---------------------------

# A fixed distribution over 8 tokens, deliberately not sorted by token id.
P = torch.tensor([0.12, 0.30, 0.02, 0.20, 0.07, 0.15, 0.04, 0.10])
LOGITS = P.log()


def reference_distribution(temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0):
    """The definitions, token by token: temperature, then top_k, top_p, min_p, each filter
    seeing the distribution the previous one left, renormalised (as transformers' warpers do)."""

    def renormalised(weights: dict[int, float]) -> dict[int, float]:
        total = sum(weights.values())
        return {i: w / total for i, w in weights.items()}

    probs = renormalised({i: float(P[i]) ** (1.0 / temperature) for i in range(len(P))})
    if top_k > 0:
        probs = renormalised({i: probs[i] for i in sorted(probs, key=probs.get, reverse=True)[:top_k]})
    nucleus, mass = {}, 0.0
    for i in sorted(probs, key=probs.get, reverse=True):  # smallest most-likely set reaching top_p
        if mass >= top_p:
            break
        nucleus[i] = probs[i]
        mass += probs[i]
    probs = renormalised(nucleus)
    top = max(probs.values())
    return renormalised({i: p for i, p in probs.items() if p >= min_p * top})


FILTER_CASES = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 2.0},
    {"top_k": 3},
    {"top_p": 0.6},  # keeps 0.30, 0.20, 0.15 (the mass above 0.12 is 0.65)
    {"top_p": 0.6, "temperature": 1.7},
    {"min_p": 0.3},  # keeps p >= 0.09
    {"min_p": 0.5, "temperature": 0.8},
    {"top_k": 5, "top_p": 0.8, "min_p": 0.2, "temperature": 1.2},
]
DRAWS = 10_000


def check_frequencies(tokens: list[int], expected: dict[int, float]) -> None:
    drawn = set(tokens)
    assert drawn <= set(expected), f"drew {sorted(drawn - set(expected))} outside {sorted(expected)}"
    for token, p in expected.items():
        frequency = tokens.count(token) / len(tokens)
        sigma = math.sqrt(p * (1 - p) / len(tokens))
        assert abs(frequency - p) < 5 * sigma + 1e-9, (token, frequency, p)


@pytest.mark.parametrize("device", DEVICES)
def test_filters_draw_from_the_right_sets_with_renormalised_frequencies(device):
    # All cases in one batch, so per-row parameters must also stay apart.
    rows = [row for case in FILTER_CASES for row in [make_row(**case)] * DRAWS]
    torch.manual_seed(0)
    tokens = [t.token_id for t in sampler(LOGITS.to(device).expand(len(rows), -1), rows)]
    for c, case in enumerate(FILTER_CASES):
        expected = reference_distribution(**case)
        if set(case) != {"temperature"}:
            assert len(expected) < len(P)  # the case's filters do remove tokens
        check_frequencies(tokens[c * DRAWS : (c + 1) * DRAWS], expected)


def test_top_p_over_a_large_vocabulary():
    # 10 likely tokens hold half the mass; 1990 tail tokens (distinct, decreasing) the other half.
    # top_p=0.9 reaches ~1600 tokens deep, past the sampler's first partial sort (1024 tokens);
    # 0.3 stays shallow.
    head = torch.arange(10, 0, -1, dtype=torch.float64)
    tail = torch.linspace(2.0, 1.0, 1990, dtype=torch.float64)
    probs = torch.cat([head / head.sum() / 2, tail / tail.sum() / 2])
    permutation = torch.randperm(len(probs), generator=torch.Generator().manual_seed(0))
    probs = probs[permutation]
    for top_p in (0.9, 0.3):
        ranked = probs.argsort(descending=True).tolist()
        nucleus, mass = [], 0.0
        for token in ranked:
            if mass >= top_p:
                break
            nucleus.append(token)
            mass += float(probs[token])
        draws = 5000
        rows = [make_row(top_p=top_p)] * draws
        torch.manual_seed(0)
        tokens = [t.token_id for t in sampler(probs.log().float().expand(draws, -1), rows)]
        assert set(tokens) <= set(nucleus)
        # Frequencies: each of the 10 most likely tokens alone, the rest of the nucleus together.
        buckets = {token: float(probs[token]) / mass for token in nucleus[:10]}
        in_rest = [t if t in buckets else -1 for t in tokens]
        buckets[-1] = 1.0 - sum(buckets.values())
        check_frequencies(in_rest, buckets)


def test_top_p_keeps_tokens_tied_with_the_last_one_kept():
    logits = torch.tensor([0.4, 0.2, 0.2, 0.2]).log()
    rows = [make_row(top_p=0.5)] * DRAWS  # 0.4 + one 0.2 reach 0.5; its twins stay too
    torch.manual_seed(0)
    tokens = [t.token_id for t in sampler(logits.expand(DRAWS, -1), rows)]
    check_frequencies(tokens, {0: 0.4, 1: 0.2, 2: 0.2, 3: 0.2})


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_draw_with_the_right_frequencies(device):
    case = {"top_p": 0.8, "temperature": 0.9}
    rows = [make_row(seed=s, device=device, **case) for s in range(4000)]
    tokens = [t.token_id for t in sampler(LOGITS.to(device).expand(len(rows), -1), rows)]
    check_frequencies(tokens, reference_distribution(**case))


def test_suppressed_tokens_are_never_drawn():
    suppressed = [1, 3]  # the two most likely tokens
    rows = [make_row(suppressed=suppressed + [10**6])] * DRAWS  # an id past V is ignored
    rows += [make_row(temperature=0.0, suppressed=suppressed)]
    torch.manual_seed(0)
    tokens = [t.token_id for t in sampler(LOGITS.expand(len(rows), -1), rows)]
    assert tokens[-1] == 5  # the best token left
    rest = {i: float(P[i]) for i in range(len(P)) if i not in suppressed}
    check_frequencies(tokens[:-1], {i: p / sum(rest.values()) for i, p in rest.items()})


# ---- penalties -------------------------------------------------------------------------------


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(20, generator=torch.Generator().manual_seed(3)) * 3
    prompt, output = [0, 1, 2, 2, 7], [7, 11, 3, 3, 3]
    for penalty in (1.5, 0.7):
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        reference = processor(torch.tensor([prompt + output]), logits.clone().unsqueeze(0))[0]
        got = full_logprobs(logits, make_row(prompt, output, repetition_penalty=penalty, logprobs=20))
        torch.testing.assert_close(got, reference.log_softmax(-1))


def test_presence_and_frequency_penalties_follow_the_openai_definition():
    logits = torch.randn(20, generator=torch.Generator().manual_seed(4)) * 3
    prompt, output = [0, 1, 2, 5], [5, 9, 9, 9, 12, 5]
    presence, frequency = 0.8, 0.5
    reference = logits.clone()
    for token in set(output):  # only generated tokens count; prompt-only tokens 0, 1, 2 are untouched
        reference[token] -= presence + frequency * output.count(token)
    row = make_row(prompt, output, presence_penalty=presence, frequency_penalty=frequency, logprobs=20)
    torch.testing.assert_close(full_logprobs(logits, row), reference.log_softmax(-1))


def test_all_penalties_together_apply_repetition_first():
    logits = torch.randn(20, generator=torch.Generator().manual_seed(5)) * 3
    prompt, output = [4, 8], [8, 8, 13, 19]
    reference = logits.clone()
    for token in set(prompt + output):
        reference[token] = reference[token] / 1.3 if reference[token] > 0 else reference[token] * 1.3
    for token in set(output):
        reference[token] -= -0.4 + 0.25 * output.count(token)
    row = make_row(
        prompt, output, repetition_penalty=1.3, presence_penalty=-0.4, frequency_penalty=0.25, logprobs=20
    )
    torch.testing.assert_close(full_logprobs(logits, row), reference.log_softmax(-1))


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([5.0, 4.0, 1.0])
    assert sampler(logits.unsqueeze(0), [make_row(output=[0], temperature=0.0)])[0].token_id == 0
    assert (
        sampler(logits.unsqueeze(0), [make_row(output=[0], temperature=0.0, frequency_penalty=1.5)])[
            0
        ].token_id
        == 1
    )
    assert (
        sampler(logits.unsqueeze(0), [make_row(prompt=[0], temperature=0.0, repetition_penalty=1.5)])[
            0
        ].token_id
        == 1
    )
    # Presence and frequency look at generated tokens only.
    assert (
        sampler(logits.unsqueeze(0), [make_row(prompt=[0], temperature=0.0, presence_penalty=2.0)])[
            0
        ].token_id
        == 0
    )


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_the_processed_distribution_before_temperature():
    logits = torch.randn(20, generator=torch.Generator().manual_seed(6)) * 2
    row = make_row(temperature=0.5, top_p=0.5, suppressed=[3], logprobs=20)
    got = full_logprobs(logits, row)
    reference = logits.clone()
    reference[3] = float("-inf")
    torch.testing.assert_close(got, reference.log_softmax(-1))
    assert math.isclose(got.exp().sum().item(), 1.0, abs_tol=1e-5)


def test_logprobs_include_the_chosen_token():
    logits = torch.tensor([4.0, 3.5, 1.0, 0.5, 0.0, -1.0])
    reference = logits.log_softmax(-1)
    rows = [make_row(temperature=50.0, logprobs=2) for _ in range(200)] + [
        make_row(temperature=50.0, logprobs=0)
    ]
    torch.manual_seed(0)
    results = sampler(logits.expand(len(rows), -1), rows)
    assert any(r.token_id not in (0, 1) for r in results)  # high temperature: often outside the top 2
    for r in results[:-1]:
        assert r.logprob == pytest.approx(reference[r.token_id].item(), abs=1e-6)
        assert set(r.top_logprobs) == {0, 1, r.token_id}
        for token, logprob in r.top_logprobs.items():
            assert logprob == pytest.approx(reference[token].item(), abs=1e-6)
    last = results[-1]
    assert last.top_logprobs == {last.token_id: last.logprob}


def test_no_logprobs_unless_asked():
    (result,) = sampler(torch.randn(1, 10), [make_row()])
    assert result.logprob is None and result.top_logprobs is None


def test_logits_rows_must_match_the_rows():
    with pytest.raises(ValueError, match="2 rows"):
        sampler(torch.randn(3, 10), [make_row(), make_row()])


def test_extreme_parameters_never_draw_outside_the_vocabulary():
    """Found by the server's property-based test: a tiny temperature or repetition penalty used
    to overflow the logits to inf, and the draw then returned an id past the vocabulary."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 10
    rows = [
        SamplingRow(SamplingParams(temperature=1e-300), [1, 2, 3], 2),
        SamplingRow(SamplingParams(temperature=1e-4), [1, 2, 3], 2),
        SamplingRow(SamplingParams(temperature=1.0, repetition_penalty=5e-324), list(range(50)), 50),
        SamplingRow(SamplingParams(temperature=0.7, repetition_penalty=1e300, presence_penalty=2.0), [5, 5, 6], 1),
    ]
    for _ in range(20):
        tokens = [t.token_id for t in Sampler(Platform.detect())(logits, rows)]
        assert all(0 <= t < 50 for t in tokens)
    assert tokens[0] == int(logits[0].argmax())  # below 1e-5 counts as greedy


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "presence_penalty"])
def test_non_finite_parameters_are_refused(field):
    with pytest.raises(ValueError, match=f"^{field}=nan"):
        SamplingParams(**{field: float("nan")})


def test_seed_must_fit_64_bits():
    with pytest.raises(ValueError, match="^seed="):
        SamplingParams(seed=2**70)
    SamplingParams(seed=2**63 - 1)
