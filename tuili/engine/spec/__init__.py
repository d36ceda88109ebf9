"""Speculative decoding: proposers guess a sequence's next tokens cheaply, one forward of the
target model verifies them, and the rejection sampler keeps the output exactly the target's.

* config.py — `SpeculativeConfig`, vLLM's `speculative_config` dict, validated once.
* ngram.py — prompt lookup: the continuation of the latest earlier occurrence of the text's end.
* draft.py — a smaller model (or a quantized copy of the target) with its own KV pool.
* mtp.py — the target checkpoint's multi-token-prediction layers, fed its hidden states, their
  KV beside the target's blocks.
* verify.py — acceptance: greedy (longest agreeing prefix + the target's token) and rejection
  sampling (accept min(1, p/q), else draw from the normalised residual).
* adaptive.py — how many tokens to propose per sequence per step, from measured acceptance
  and the measured cost of a row in a step.
* speculator.py — the engine's one hook: propose before scheduling, record after verifying.
"""
