"""Verification: which proposed tokens a sequence keeps, and the target's token after them.

A verifying sequence's step computes k+1 positions: its last sampled token and the k proposed
ones. Row j's logits give the target's distribution p_j of the token after proposal j-1 — with
every sampling rule applied as if the proposals before it had been generated: penalties count
them, min_tokens counts them (the runner builds row j's SamplingRow that way), then temperature,
top-k, top-p and min-p (Sampler.draw_probabilities).

* Greedy rows keep the longest prefix of proposals equal to the row-wise arg-max, then the
  arg-max of the first disagreeing row (or of the last row, the "bonus" token, when all agree):
  token for token what decoding one at a time picks from the same logits.
* Sampled rows use rejection sampling (Leviathan et al. 2023; Chen et al. 2023): proposal d_j,
  drawn from q_j, is kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
  the token is drawn from the residual max(0, p_j - q_j), normalised; when all are kept the
  bonus token is drawn from p_k. Every emitted token is then distributed exactly as p. For
  prompt lookup q_j is a point mass on d_j (keep with probability p_j(d_j), residual p_j without
  d_j). Uniform numbers come from the sequence's seeded generator (else the global RNG), so a
  seeded request is reproducible for the same proposals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tuili.layers.sampler import SampledToken, Sampler, SamplingRow


@dataclass
class Proposal:
    """Tokens proposed for one sequence, and the distribution each was drawn from: `probs`
    [k, vocab] (a draft model sampling), or None for point masses (prompt lookup, greedy drafts)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


def verify(logits: torch.Tensor, rows: list[SamplingRow], proposals: list[Proposal | None]) -> list[list[SampledToken]]:
    """The tokens each sequence emits this step. `logits` [R, vocab] and `rows` hold, per
    sequence in order, len(proposal) + 1 consecutive rows (one for a sequence without a
    proposal); returns, per sequence, its accepted proposals then the target's token."""
    processed = Sampler.process(logits, rows)
    num_rows = len(rows)
    chosen = [0] * num_rows
    greedy = [r for r, row in enumerate(rows) if row.params.greedy]
    argmax = [0] * num_rows
    if greedy:
        for r, t in zip(greedy, processed[greedy].argmax(dim=-1).tolist(), strict=True):
            argmax[r] = t
    sampled = [r for r, row in enumerate(rows) if not row.params.greedy]
    probs: dict[int, torch.Tensor] = {}
    if sampled:
        table = Sampler.draw_probabilities(processed[sampled], [rows[r] for r in sampled])
        probs = {r: table[i] for i, r in enumerate(sampled)}

    emitted: list[tuple[int, int]] = []  # per sequence: (first row, tokens emitted)
    start = 0
    for proposal in proposals:
        draft = proposal.token_ids if proposal is not None else []
        row = rows[start]
        if row.params.greedy:
            n = _accept_greedy(draft, argmax, start, chosen)
        else:
            n = _accept_sampled(draft, proposal.probs if proposal is not None else None, probs, start, chosen,
                                row.generator)
        emitted.append((start, n))
        start += len(draft) + 1
    if start != num_rows:
        raise ValueError(f"{num_rows} rows for proposals that need {start}")
    results = Sampler.results(torch.tensor(chosen, dtype=torch.long, device=logits.device), rows, processed)
    return [results[first : first + n] for first, n in emitted]


def _accept_greedy(draft: list[int], argmax: list[int], start: int, chosen: list[int]) -> int:
    for j, token in enumerate(draft):
        target = argmax[start + j]
        chosen[start + j] = target
        if target != token:
            return j + 1
    chosen[start + len(draft)] = argmax[start + len(draft)]
    return len(draft) + 1


def _accept_sampled(draft: list[int], q: torch.Tensor | None, probs: dict[int, torch.Tensor], start: int,
                    chosen: list[int], generator: torch.Generator | None) -> int:
    for j, token in enumerate(draft):
        p = probs[start + j]
        p_token = float(p[token])
        q_token = float(q[j, token]) if q is not None else 1.0
        # Keep with probability min(1, p/q); q_token > 0 since the token was drawn from q.
        if _uniform(generator, p.device) * q_token < p_token:
            chosen[start + j] = token
            continue
        if q is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - q[j].to(p.dtype)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection was a rounding artefact
            residual = p
        chosen[start + j] = _draw(residual, _uniform(generator, p.device))
        return j + 1
    chosen[start + len(draft)] = _draw(probs[start + len(draft)], _uniform(generator, probs[start].device))
    return len(draft) + 1


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand(1, dtype=torch.float64, device=device, generator=generator))


def _draw(weights: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from unnormalised `weights` (as the sampler draws: float64 running sum,
    the target kept strictly below the total so a zero-weight token is never chosen)."""
    cdf = weights.to(torch.float64).cumsum(dim=0)
    total = cdf[-1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, target.reshape(1), right=True))
