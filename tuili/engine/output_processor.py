"""From sampled tokens to RequestOutputs: the output side of each sequence.

Per sequence it keeps the text so far (incremental detokenization, held back while it could
be the start of a stop string), the logprobs, and decides when a token ends the sequence:
a stop token or EOS (tuili/engine/stopping.py), a stop string, max_tokens or max_model_len.
Per request it files the prompt logprobs the runner scored, by prompt position. Logprobs are
vLLM's `Logprob` objects (logprob, rank, the token's text). It never touches the scheduler or the runner: the engine's step loop retires what it reports
finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tuili.engine.prompt_logprobs import PromptLogprobs
from tuili.engine.request import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    Sequence,
)
from tuili.engine.stopping import StopTokens
from tuili.layers.sampler import SampledToken
from tuili.sampling import SamplingParams
from tuili.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclass
class SequenceText:
    """Output-side state of one sequence: its text so far and how it is produced."""

    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher | None
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: str | int | None = None


@dataclass
class RequestState:
    """One request between add_request and its last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    texts: dict[int, SequenceText] = field(default_factory=dict)  # by seq_id
    embedding: list[float] | None = None  # an embedding request's vector, once pooled
    # With params.prompt_logprobs: per prompt position scored so far (None at position 0).
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, stop_tokens: StopTokens, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.stop_tokens = stop_tokens
        self.max_model_len = max_model_len
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token, decoded once per id

    def token_text(self, token_id: int) -> str | None:
        """A token's own text (special tokens spelled out), for Logprob.decoded_token."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def add_prompt_logprobs(self, req: RequestState, scored: PromptLogprobs) -> None:
        """File a chunk's prompt logprobs. Positions already filed (a chunk recomputed after a
        preemption scores the same tokens again, to the same values) are kept as they are."""
        filed = req.prompt_logprobs
        assert filed is not None, f"request {req.request_id} did not ask for prompt logprobs"
        if scored.first_token > len(filed):
            raise RuntimeError(
                f"request {req.request_id}: prompt scored from position {scored.first_token} but only "
                f"{len(filed)} positions were scored before (a cached prefix was taken)"
            )
        prompt = req.prompt_token_ids
        for i in range(len(filed) - scored.first_token, len(scored.logprobs)):
            position = scored.first_token + i
            entry = {t: Logprob(lp, rank + 1, self.token_text(t)) for rank, (t, lp) in
                     enumerate(zip(scored.top_ids[i], scored.top_logprobs[i], strict=True))}
            token = prompt[position]
            if token not in entry:
                entry[token] = Logprob(scored.logprobs[i], scored.ranks[i], self.token_text(token))
            filed.append(entry)

    def new_text(self, prompt_token_ids: list[int], params: SamplingParams) -> SequenceText:
        """The output state of a new sequence (no text without a tokenizer: token ids only)."""
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        matcher = StopStringMatcher(params.stop_strings, params.include_stop_str_in_output) if params.stop_strings else None
        return SequenceText(detok, matcher, logprobs=[] if params.logprobs is not None else None)

    def append(self, seq: Sequence, state: SequenceText, token: SampledToken) -> str | None:
        """Append `token` to `seq` and its text. Returns the finish reason ("stop" or "length")
        when the token ends the sequence, with the text then final; None otherwise."""
        params = seq.params
        seq.token_ids.append(token.token_id)
        if state.logprobs is not None:
            # The sampler lists the top `logprobs` tokens most likely first, then the chosen one
            # when it is not among them: ranks as vLLM gives them (a top-k entry keeps its place).
            top = list((token.top_logprobs or {}).items())[: params.logprobs]
            entry = {t: Logprob(lp, rank + 1, self.token_text(t)) for rank, (t, lp) in enumerate(top)}
            if token.token_id not in entry:
                entry[token.token_id] = Logprob(token.logprob, token.rank, self.token_text(token.token_id))
            state.logprobs.append(entry)
            state.cumulative_logprob += token.logprob or 0.0

        n_out = seq.num_output_tokens
        stop_token = self.stop_tokens.ends(params, token.token_id, n_out)
        # A stop token or EOS is not text; min_tokens also holds back a stop string's match.
        if state.detokenizer is not None and not stop_token:
            delta = state.detokenizer.add(token.token_id)
            if state.stop_matcher is not None:
                delta, stopped = state.stop_matcher.feed(delta)
                state.text += delta
                if stopped and n_out >= params.min_tokens:
                    state.stop_reason = state.stop_matcher.matched
                    return "stop"  # the text ends where the stop string begins (or after it)
            else:
                state.text += delta

        if stop_token:
            state.stop_reason = token.token_id if token.token_id in params.stop_token_ids else None
            reason = "stop"
        elif (params.max_tokens is not None and n_out >= params.max_tokens) or seq.num_tokens >= self.max_model_len:
            reason = "length"
        else:
            return None
        self._flush(state)
        return reason

    @staticmethod
    def _flush(state: SequenceText) -> None:
        """Release the text held back at the end: bytes of a character the last token left
        incomplete, then what the stop-string matcher kept because it could have begun a stop
        string (unless it now completes one)."""
        tail = state.detokenizer.flush() if state.detokenizer is not None else ""
        if state.stop_matcher is not None:
            tail, stopped = state.stop_matcher.feed(tail)
            if stopped:
                state.stop_reason = state.stop_matcher.matched
            else:
                tail += state.stop_matcher.flush()
        state.text += tail

    @staticmethod
    def output(req: RequestState) -> RequestOutput:
        """The request's cumulative output: every sequence's text and tokens so far."""
        completions = []
        for seq in req.seqs:
            state = req.texts.get(seq.seq_id)
            if state is None:  # an embedding request: no text, no tokens
                continue
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=state.text,
                    token_ids=seq.output_token_ids,
                    finish_reason=seq.finish_reason,
                    # Copies, like token_ids: an output is a snapshot. A reader on another thread
                    # (the server's streams) formats it while later steps append to the live
                    # lists, and must see token ids and logprobs of the same length.
                    logprobs=list(state.logprobs) if state.logprobs is not None else None,
                    cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
                    stop_reason=state.stop_reason,
                )
            )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            metrics=req.metrics,
            embedding=req.embedding,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        )
