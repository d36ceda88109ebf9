"""The EOS policy: which token ids end a sequence, and when they may be sampled at all.

The one place that decides it. The engine's EOS ids are the model config's and the
tokenizer's (its generation_config) together. Two rules use them, with a request's own
`stop_token_ids`:

* until `min_tokens` tokens are generated, EOS and the stop ids may not be sampled (the runner
  puts them in each SamplingRow's suppressed ids, with `ignore_eos` too, as vLLM does), unless
  a structured output's grammar is complete (then nothing but a stop token may be allowed);
* from then on, a sampled EOS (unless `ignore_eos`) or stop id ends the sequence with "stop"
  (the output processor asks; such a token is not detokenized into the text).
"""

from __future__ import annotations

from dataclasses import dataclass

from tuili.sampling import SamplingParams


@dataclass(frozen=True)
class StopTokens:
    eos_token_ids: frozenset[int]

    def suppressed(self, params: SamplingParams, num_output_tokens: int, grammar_complete: bool = False) -> list[int]:
        """Ids the sampler must not draw for a sequence with `num_output_tokens` generated so far.

        None once a structured output is complete (`grammar_complete`): its grammar may allow
        nothing but a stop token then, and the grammar wins over min_tokens."""
        if num_output_tokens >= params.min_tokens or grammar_complete:
            return []
        return sorted(self.eos_token_ids.union(params.stop_token_ids))

    def ends(self, params: SamplingParams, token_id: int, num_output_tokens: int) -> bool:
        """Whether `token_id`, just appended as generated token number `num_output_tokens`,
        ends its sequence."""
        if num_output_tokens < params.min_tokens:
            return False
        return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)
