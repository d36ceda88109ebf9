"""The next token of every sequence in a batch, each with its own sampling parameters.

For each row of the logits, in this order:

0. **Logit controls** (vLLM's order: before the penalties). ``allowed_token_ids`` gives every
   other token logit -inf; ``bad_words`` gives -inf to the last token of each banned word
   whose other tokens the output ends with (a one-token word always; vLLM's rule, over the
   generated tokens only); ``logit_bias`` adds its bias to its tokens' logits (OpenAI's rule:
   -100 all but bans a token, +100 all but forces it).
1. **Penalties.** ``repetition_penalty`` (CTRL / Hugging Face definition) over every token of
   the prompt and the output so far: a positive logit is divided by the penalty, a negative
   one multiplied. Then ``presence_penalty`` and ``frequency_penalty`` (OpenAI definition) over
   the generated tokens only: ``logit -= presence * (count > 0) + frequency * count``. This is
   vLLM's order.
2. **Grammar.** A row that follows a grammar (structured output, tuili/layers/grammar.py)
   gets logit -inf for every token its grammar does not allow next; the mask was filled on a
   worker thread while the forward pass ran.
3. **Suppression.** The row's ``suppressed_token_ids`` (the engine puts EOS and stop ids there
   while ``min_tokens`` is not reached) get logit -inf; ids outside the vocabulary are ignored.
4. **Logprobs** (when ``params.logprobs`` is set) are ``log_softmax`` of these processed logits:
   the distribution the request's penalties define, before temperature and the filters below
   reshape it for drawing. (vLLM returns the raw model distribution instead; ours answers
   "how likely was this token under this request's rules", and is what greedy decoding ranks.)
5. **Greedy** rows (``temperature < 1e-5``, or ``top_k == 1``, which keeps only the arg-max)
   take the arg-max of the processed logits; the rest continue.
6. **Temperature**: logits / temperature.
7. **top_k** keeps the k largest logits (ties at the k-th value are all kept).
8. **top_p** keeps the smallest set of most likely tokens whose probability reaches top_p
   (a token is dropped when the tokens ranked above it already hold ≥ top_p; as Hugging Face's
   ``TopPLogitsWarper``), plus any token tied with the last one kept. The most likely token
   always stays.
9. **min_p** drops tokens whose probability is below ``min_p × (largest probability)``
   (Hugging Face's ``MinPLogitsWarper``; the ratio does not depend on earlier filters).
10. **Draw** from the softmax of what is left by inverse-CDF sampling with one uniform number
   per row. A seeded row takes its number from its own generator and nothing else does, so a
   seeded sequence gets the same tokens whatever batch it sits in; unseeded rows share one
   draw from the global RNG.

Every step is a batched tensor operation over the rows that use it; only seeded rows loop
in Python (one draw each), and step 0 makes one tensor edit per row that has a control (its
ids become tensors once, at the request's first step) and compares each bad word with the
output's tail; nothing loops over the vocabulary. A batch of plain greedy rows (no logit
control, penalty, suppression or logprobs) skips steps 0-4 and the float32 copy they edit: on CPU one native pass (tuili/kernels) reads
the logits as step 1's nan_to_num would leave them and picks each row's arg-max in one pass
(docs/kernels.md, Measured crossovers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tuili import kernels
from tuili.layers.grammar import TokenMasks
from tuili.platform import Platform
from tuili.sampling import SamplingParams

# How many of the most likely tokens top_p first looks at (see _nucleus).
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingRow:
    """One sequence asking for its next token.

    `token_ids` is the sequence's own list (prompt, then the tokens generated before this
    step), not a copy: building a row costs nothing whatever the length, and the prompt and
    output lists are sliced from it only when a penalty reads them. It must not change while
    the sampler runs."""

    params: SamplingParams
    token_ids: list[int]
    prompt_len: int
    # Set when params.seed is not None; owned by the sequence, on the logits' device.
    generator: torch.Generator | None = None
    suppressed_token_ids: list[int] = field(default_factory=list)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


def seeded_stream(seed: int, index: int, device: torch.device, salt: int = 0) -> torch.Generator:
    """The random stream of output ``index`` of a request seeded with ``seed`` (a sequence's
    SamplingRow.generator): each of its n outputs draws from its own, a rerun with the same seed
    repeats them, and ``salt`` keeps another stream of the same output apart (a draft model's
    proposals)."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + index * 1_000_003 + salt) % 2**64)
    return generator


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # of token_id, when params.logprobs is not None
    # params.logprobs most likely tokens (id -> logprob), plus token_id when not among them.
    top_logprobs: dict[int, float] | None = None
    # With logprob: 1 + how many other tokens are at least as likely (vLLM's rank; ties count).
    rank: int | None = None


class Sampler:
    """Picks one token per row of ``logits`` [B, V] as the module docstring describes."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], masks: TokenMasks | None = None
                 ) -> list[SampledToken]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
        if masks is not None:
            # In place: -inf commutes with the penalties and the suppression (each keeps -inf),
            # so masking first equals masking second, and plain greedy rows keep the native path.
            if logits.dtype != torch.float32 or not logits.is_contiguous():
                logits = logits.to(torch.float32).contiguous()
            masks.apply(logits)
        if self.platform.native_kernels and _native_greedy(logits, rows):
            return _results(kernels.argmax_rows(logits), rows, [], None)
        logits = self.process(logits, rows)
        want_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        logprobs = torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None

        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):  # no row-indexed copy of [rows, vocab] logits in the common case
            token_ids = logits.argmax(dim=-1)
        elif greedy:
            token_ids[greedy] = logits[greedy].argmax(dim=-1)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random:
            random_rows = [rows[i] for i in random]
            sub = logits if len(random) == len(rows) else logits[random]  # no copy in the common case
            filtered = _apply_temperature_and_filters(sub, random_rows)
            token_ids[random] = _inverse_cdf_draw(filtered, random_rows)

        return _results(token_ids, rows, want_logprobs, logprobs)


    @staticmethod
    def process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Steps 0-3 on a float32 copy of ``logits``: the distribution each row's controls,
        penalties and suppression define, what greedy rows take the arg-max of and logprobs report."""
        logits = logits.to(torch.float32, copy=True)  # everything below edits it in place
        _apply_logit_controls(logits, rows)
        _apply_repetition_penalty(logits, rows)
        _apply_presence_frequency_penalties(logits, rows)
        _suppress(logits, rows)
        # Extreme penalties can overflow a logit to +inf; keep it the largest finite value so
        # that softmax stays defined.
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
        return logits

    @staticmethod
    def draw_probabilities(processed: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Steps 5-8 on rows of `process`'s output (edited in place): the float32 probabilities
        a non-greedy row draws from (speculative decoding's target distribution)."""
        return torch.softmax(_apply_temperature_and_filters(processed, rows), dim=-1)

    @staticmethod
    def results(token_ids: torch.Tensor, rows: list[SamplingRow], processed: torch.Tensor) -> list[SampledToken]:
        """The chosen tokens with their logprobs (step 3) where a row asks for them."""
        want_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        logprobs = torch.log_softmax(processed[want_logprobs], dim=-1) if want_logprobs else None
        return _results(token_ids, rows, want_logprobs, logprobs)


def _native_greedy(logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
    """Whether every row takes the plain arg-max of its logits and the native kernel can read them."""
    return (
        logits.dtype == torch.float32
        and logits.is_cpu
        and logits.is_contiguous()
        and all(
            row.params.greedy
            and row.params.logprobs is None
            and row.params.repetition_penalty == 1.0
            and row.params.presence_penalty == 0.0
            and row.params.frequency_penalty == 0.0
            and not row.suppressed_token_ids
            and not row.params.controls_logits
            for row in rows
        )
    )


def _param_column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """One parameter per row as a [R, 1] tensor that broadcasts over the vocabulary."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float tensor: how often each token occurs in each list."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    # Pad with an extra id V whose column is dropped afterwards.
    padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.long)
    for r, tokens in enumerate(token_lists):
        padded[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


@dataclass
class _ControlTensors:
    """One request's allowed_token_ids and logit_bias as tensors, ids within the vocabulary."""

    allowed: torch.Tensor | None  # [k] int64
    bias_ids: torch.Tensor | None  # [m] int64
    bias_values: torch.Tensor | None  # [m] float32


def _control_tensors(params: SamplingParams, vocab_size: int) -> _ControlTensors:
    """Built once per request and vocabulary size (params.logit_control_cache)."""
    cached = params.logit_control_cache.get(vocab_size)
    if cached is None:
        allowed = bias_ids = bias_values = None
        if params.allowed_token_ids:
            allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long)
            allowed = allowed[allowed < vocab_size]
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
            inside = bias_ids < vocab_size
            bias_ids, bias_values = bias_ids[inside], bias_values[inside]
        cached = params.logit_control_cache[vocab_size] = _ControlTensors(allowed, bias_ids, bias_values)
    return cached


def _apply_logit_controls(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Step 0: allowed_token_ids, bad_words and logit_bias. Each row's listed ids are tensors
    built at its first step; a step makes one tensor edit per row that uses a control (no loop
    over the vocabulary). Ids outside the vocabulary are skipped (the engine refuses them; a
    draft model's vocabulary may be the smaller one)."""
    if not any(row.params.controls_logits for row in rows):
        return
    vocab_size = logits.shape[1]
    device = logits.device
    banned: tuple[list[int], list[int]] = ([], [])
    for i, row in enumerate(rows):
        params = row.params
        if not params.controls_logits:
            continue
        controls = _control_tensors(params, vocab_size)
        if controls.allowed is not None:
            kept = logits[i].index_select(0, controls.allowed.to(device))
            logits[i].fill_(float("-inf")).index_copy_(0, controls.allowed.to(device), kept)
        for word in params.bad_words_token_ids:
            prefix = len(word) - 1
            generated = len(row.token_ids) - row.prompt_len
            if prefix <= generated and (prefix == 0 or row.token_ids[-prefix:] == word[:-1]) and word[-1] < vocab_size:
                banned[0].append(i)
                banned[1].append(word[-1])
        if controls.bias_ids is not None:
            logits[i].index_add_(0, controls.bias_ids.to(device), controls.bias_values.to(device))
    if banned[0]:
        logits[torch.tensor(banned[0], device=device), torch.tensor(banned[1], device=device)] = float("-inf")


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    idx = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not idx:
        return
    context = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in idx]
    seen = _token_counts(context, logits.shape[1], logits.device) > 0
    penalty = _param_column([rows[i].params.repetition_penalty for i in idx], logits)
    sub = logits[idx]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[idx] = torch.where(seen, penalised, sub)


def _apply_presence_frequency_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    idx = [
        i
        for i, row in enumerate(rows)
        if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0
    ]
    if not idx:
        return
    counts = _token_counts([rows[i].output_token_ids for i in idx], logits.shape[1], logits.device)
    presence = _param_column([rows[i].params.presence_penalty for i in idx], logits)
    frequency = _param_column([rows[i].params.frequency_penalty for i in idx], logits)
    logits[idx] -= presence * (counts > 0) + frequency * counts


def _suppress(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        # An id beyond the vocabulary (say a user's stop_token_ids) can never be drawn anyway.
        tokens = [t for t in row.suppressed_token_ids if 0 <= t < vocab_size]
        row_idx += [i] * len(tokens)
        token_idx += tokens
    if token_idx:
        logits[torch.tensor(row_idx, device=logits.device), torch.tensor(token_idx, device=logits.device)] = (
            float("-inf")
        )


def _apply_temperature_and_filters(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p on ``logits`` [R, V], in place; filtered tokens get -inf."""
    logits /= _param_column([row.params.temperature for row in rows], logits)
    torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
    vocab_size = logits.shape[1]

    top_k = [i for i, row in enumerate(rows) if 0 < row.params.top_k < vocab_size]
    if top_k:
        k = torch.tensor([rows[i].params.top_k for i in top_k], device=logits.device).unsqueeze(1)
        sub = logits[top_k]
        kth_largest = sub.topk(int(k.max()), dim=-1).values.gather(1, k - 1)
        logits[top_k] = sub.masked_fill(sub < kth_largest, float("-inf"))

    top_p = [i for i, row in enumerate(rows) if row.params.top_p < 1.0]
    if top_p:
        sub = logits[top_p]
        keep = _nucleus(
            torch.softmax(sub, dim=-1), _param_column([rows[i].params.top_p for i in top_p], logits)
        )
        logits[top_p] = sub.masked_fill(~keep, float("-inf"))

    min_p = [i for i, row in enumerate(rows) if row.params.min_p > 0.0]
    if min_p:
        sub = logits[min_p]
        probs = torch.softmax(sub, dim=-1)
        min_p_column = _param_column([rows[i].params.min_p for i in min_p], logits)
        threshold = min_p_column * probs.amax(dim=-1, keepdim=True)
        logits[min_p] = sub.masked_fill(probs < threshold, float("-inf"))

    return logits


def _inverse_cdf_draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row from softmax(logits): the first whose cumulative probability exceeds
    u × total for a uniform u (O(V) work and one random number per row, where an exponential
    race would need V random numbers). float64 keeps the running sum's rounding far below any
    probability that matters."""
    cdf = torch.softmax(logits, dim=-1).to(torch.float64).cumsum_(dim=-1)
    u = torch.rand(len(rows), 1, dtype=torch.float64, device=logits.device)  # global RNG: unseeded rows
    for i, row in enumerate(rows):
        if row.generator is not None:
            u[i] = torch.rand(1, dtype=torch.float64, device=logits.device, generator=row.generator)
    total = cdf[:, -1:]
    # Strictly below the total, so the search lands on a token; a token of probability 0 never
    # holds the first cdf value above the target, as its cdf equals its predecessor's.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool mask [R, V] of the tokens top_p keeps: a token stays while the more likely tokens
    hold less than top_p of the probability (and so do the tokens tied with the last one kept).

    The nucleus is almost always a small part of the vocabulary, so it is looked for among the
    most likely ``_TOP_P_CANDIDATES`` tokens first (a partial sort, much cheaper than sorting
    all V) and among more only when some row's nucleus reaches past them.
    """
    vocab_size = probs.shape[1]
    k = min(_TOP_P_CANDIDATES, vocab_size)
    while True:
        sorted_probs = probs.topk(k, dim=-1).values
        cumulative = sorted_probs.cumsum(dim=-1)
        # Every token past the k-th is dropped when the k most likely already hold top_p.
        if k == vocab_size or bool((cumulative[:, -1:] >= top_p).all()):
            break
        k = min(vocab_size, 8 * k)
    # The kept tokens are a prefix of the sorted order (the mass above grows along it); at
    # least the most likely one stays whatever the rounding. Comparing with the smallest kept
    # probability rather than marking sorted positions keeps every token tied with it, so the
    # result does not depend on how the sort ordered equal probabilities.
    kept = (cumulative - sorted_probs < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    return probs >= sorted_probs.gather(1, kept - 1)


def _results(
    token_ids: torch.Tensor, rows: list[SamplingRow], want_logprobs: list[int], logprobs: torch.Tensor | None
) -> list[SampledToken]:
    chosen = token_ids.tolist()
    results = [SampledToken(token_id=t) for t in chosen]
    if logprobs is None:
        return results
    chosen_column = logprobs.gather(1, token_ids[want_logprobs].unsqueeze(1))
    ranks = (logprobs >= chosen_column).sum(dim=1).tolist()
    chosen_logprob = chosen_column.squeeze(1).tolist()
    k_max = min(max(rows[i].params.logprobs for i in want_logprobs), logprobs.shape[1])
    top_values, top_ids = (t.tolist() for t in logprobs.topk(k_max, dim=-1))
    for r, i in enumerate(want_logprobs):
        k = rows[i].params.logprobs
        top = dict(zip(top_ids[r][:k], top_values[r][:k], strict=True))
        top.setdefault(chosen[i], chosen_logprob[r])
        results[i].logprob = chosen_logprob[r]
        results[i].top_logprobs = top
        results[i].rank = ranks[r]
    return results
