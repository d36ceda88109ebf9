"""Prompt-lookup proposals: no model, only the sequence's own tokens.

The last n tokens of the sequence (n from `prompt_lookup_max` down to `prompt_lookup_min`,
longest first) are looked for earlier in the prompt and output; at the latest earlier
occurrence, the tokens that followed it are the proposal. Copy-heavy work (editing or
summarising a given text, refactoring code) repeats long runs of the prompt, which this finds
for free. vLLM's proposer takes the earliest occurrence; the latest is the one the text is most
likely copying now (the same paragraph, not its first mention), so tuili takes that.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
        (min_n <= n <= max_n) ending `token_ids`; [] when none occurs."""
        if k < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        # Candidate ends: earlier positions holding the last token (the match's last token).
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if ends.size == 0:
            return []
        best_n, best_end = 0, -1
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            fits = ends[ends >= n - 1]
            if fits.size == 0:
                continue
            match = np.ones(fits.size, dtype=bool)
            for back in range(1, n):
                match &= tokens[fits - back] == tokens[last - back]
            hits = fits[match]
            if hits.size:
                best_n, best_end = n, int(hits[-1])  # the latest occurrence
                break
        if best_n == 0:
            return []
        return token_ids[best_end + 1 : best_end + 1 + k]
