"""How many tokens to propose, per sequence and step, so that speculation never slows the engine.

A proposal pays when the tokens it is expected to add are worth more than the time its extra
row costs. Two things are measured as the engine runs:

* acceptance: per sequence, the chance that a proposed token is kept given the ones before it
  were (counts halved as they grow, so a change of text is followed); a sequence without
  verifications of its own takes the engine's recent rate over all sequences (itself from a
  Beta(1, 1) prior), so a new request of a workload that accepts well is proposed for at once;
  proposal j (1-based) then adds alpha^j expected tokens;
* cost: the step time as a linear function of the rows computed, fitted by least squares to the
  median time of each kind of recent step that only decoded or verified (the last `_HISTORY`
  plain steps and the last `_HISTORY` verifying ones), with a separate constant for steps that verify
  (they run eagerly and attend through gathered blocks, where plain decodes may replay a CPU
  graph): t = c_plain + c_row * rows, plus c_spec when verifying. No coefficient is negative (a
  noisy slope over two nearby batch sizes is dropped, not clipped: the others are fitted again
  without it). The fit is taken again when a new kind of step appears and every
  `_REFIT_EVERY` steps otherwise: the medians of 64 steps hardly move in a few, and refitting at
  every step cost ~1 ms of a ~40 ms batch-32 step. A draft model's forwards are
  paid once per proposal depth of the step, at a cost fitted the same way to the sequences they
  draft for: d_fixed + d_seq * sequences (with one size seen so far, taken as proportional to
  the sequences: a draft forward measured on one explored sequence must not make 32 look free):
  the step pays d_fixed for each depth, a sequence d_seq for each proposal it draws.

Each step, for each depth K, the candidates (sequence, j <= K) are taken in order of alpha^j
while the added tokens per added second beat the step's tokens per second; the plan of the
fastest depth in tokens per second wins, or proposing nothing when that is faster. Before the fit has both kinds of steps
at two sizes it explores, cheaply at any batch size: a plain step, then one sequence verifying
all its proposals, then half of them. Once it has chosen to propose nothing, neither the fit nor
any acceptance would ever change again (a verification step's cost measured while it captured a
CPU graph, or a new request's prior acceptance of 1/2, would switch speculation off for good), so
after `_REEXPLORE_AFTER` steps without a verification one sequence verifies its proposals once
more. What a look costs is measured (its proposals' time and its step's time beyond the fitted
plain step), and the next look waits until the plain steps since the last verification have
taken 1 / `_LOOK_SHARE` times that: where speculation does not pay (a large batch, whose look
turns the whole step eager and catches a draft's shadow up), looks take at most that share of
the time.

A draft model's shadow that has not proposed for a while must first compute the tokens it
missed (its backlog: a chunk, the whole prompt the first time), which the per-step plan does not
weigh: a sequence that speculates keeps its backlog at one or two tokens. Looks and the first
exploration take the sequence with the smallest backlog, so a look at a large batch catches up
the same shadow each time, over the tokens since its last look, not a new prompt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

_HISTORY = 64  # steps the cost fit remembers
_DECAY_AT = 32.0  # acceptance counts are halved when their trials reach this
_REEXPLORE_AFTER = 16  # steps without a verification before one sequence verifies again
_LOOK_SHARE = 0.01  # ... and no sooner than the plain steps since then took a look's cost / this
_REFIT_EVERY = 8  # steps recorded between two fits of the step cost (a new kind of step refits at once)


@dataclass
class _Acceptance:
    kept: float = 0.0
    trials: float = 0.0

    @property
    def rate(self) -> float:
        return (self.kept + 1.0) / (self.trials + 2.0)

    def add(self, proposed: int, accepted: int) -> None:
        self.kept += accepted
        self.trials += accepted + (1 if accepted < proposed else 0)
        if self.trials >= _DECAY_AT:
            self.kept /= 2
            self.trials /= 2


class AdaptiveK:
    def __init__(self, max_k: int, adaptive: bool = True) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self._acceptance: dict[int, _Acceptance] = {}  # by seq_id
        self._overall = _Acceptance()  # every sequence's verifications: a new sequence's rate
        # (rows, seconds) of recent steps, by whether they verified: kept apart, so that a long run
        # of plain steps does not push the last verifications' costs out of the fit
        self._steps: dict[bool, deque[tuple[int, float]]] = {v: deque(maxlen=_HISTORY) for v in (False, True)}
        self._draft: deque[tuple[int, float]] = deque(maxlen=_HISTORY)  # (sequences, seconds per forward)
        self._explore = 0
        self._steps_since_verified = 0
        self._plain_seconds = 0.0  # time of the plain steps since the last verification
        self._look_cost: float | None = None  # seconds the last look added (None: none measured)
        self._look_rows: int | None = None  # the plain rows of the step now looking (None: none is)
        self._proposal_seconds = 0.0  # the proposer's time in the step now being taken
        self._fitted: tuple[float, float, float] | None = None  # the last fit, while still fresh
        self._unfitted_steps: int | None = None  # steps recorded since it (None: refit now)
        self._draft_fit: tuple[float, float] | None = None  # _draft_cost's, until a draft forward is recorded

    def choose(self, seq_ids: list[int], limits: list[int], backlogs: list[int] | None = None) -> list[int]:
        """Proposals per decoding sequence this step, each at most its limit; `backlogs`: the
        tokens each sequence's proposer computes before proposing (None: none)."""
        if not self.adaptive or not seq_ids:
            return [min(self.max_k, lim) for lim in limits]
        full = [min(self.max_k, lim) for lim in limits]
        backlogs = backlogs or [0] * len(full)
        fit = self._fit()
        if fit is None:  # explore: plain, then one sequence with full and with half its proposals
            self._explore += 1
            phase = self._explore % 3
            ks = [0] * len(full)
            if phase:
                i = min(range(len(full)), key=lambda i: (full[i] == 0, backlogs[i]))  # the cheapest to draft for
                ks[i] = full[i] if phase == 1 else (full[i] + 1) // 2
            return ks
        c_plain, c_row, c_spec = fit
        batch = len(seq_ids)
        plain_rate = batch / max(c_plain + c_row * batch, 1e-9)
        rates = [self._acceptance.get(s, self._overall).rate for s in seq_ids]
        # A draft model's forwards are paid per step (one per proposal position, whatever the
        # number of sequences): each depth K is a plan of its own, the best one wins.
        d_fixed, d_seq = self._draft_cost()
        best_rate, best = plain_rate, [0] * batch
        # A plan adds its proposals' gains (each at most the best rate) for at least their costs
        # (each c_row + d_seq): where even the best proposal adds tokens more slowly than a plain
        # step makes them, no plan beats plain steps, and the search below is skipped.
        depths = range(1, max(full) + 1) if max(rates) > plain_rate * (c_row + d_seq) else range(0)
        for depth in depths:
            candidates = sorted(
                ((rates[i] ** j, i, j) for i in range(batch) for j in range(1, min(full[i], depth) + 1)), reverse=True,
            )
            tokens, seconds = float(batch), c_plain + c_spec + c_row * batch + d_fixed * depth
            ks = [0] * batch
            for gain, i, j in candidates:
                if ks[i] != j - 1:  # its earlier proposal did not pay: neither does this one
                    continue
                # Each proposal is one more of the sequence's draft forwards (a shadow leaves the
                # draft's batch once it has its proposals), and one more row of the step.
                cost = c_row + d_seq
                if gain * seconds < cost * tokens:  # adds fewer tokens per second than the step makes
                    # and so does every later candidate: gains only fall, while the plan's rate
                    # only rises (each proposal taken adds tokens at least at that rate)
                    break
                ks[i] += 1
                tokens += gain
                seconds += cost
            if any(ks) and tokens / seconds > best_rate:
                best_rate, best = tokens / seconds, ks
        if not any(best) and any(full) and self._look_due():
            self._explore += 1
            self._look_rows = batch
            # the cheapest to draft for, then the likeliest to gain
            i = min(range(batch), key=lambda i: (full[i] == 0, backlogs[i], -rates[i]))
            best[i] = full[i]
        return best

    def _look_due(self) -> bool:
        if self._steps_since_verified < _REEXPLORE_AFTER:
            return False
        return self._look_cost is None or self._plain_seconds * _LOOK_SHARE >= self._look_cost

    def record_proposals(self, seconds: float) -> None:
        """The proposer's time this step (drafting, a shadow's catch-up): a look's cost too."""
        self._proposal_seconds = seconds

    def record_step(self, rows: int, verified: bool, seconds: float) -> None:
        """A step that only decoded or verified: `rows` positions computed in `seconds`."""
        looked = verified and self._look_rows is not None
        if looked and (fit := self._fit()) is not None:  # a look's step
            plain = fit[0] + fit[1] * self._look_rows
            self._look_cost = max(seconds - plain, 0.0) + self._proposal_seconds
        self._look_rows, self._proposal_seconds = None, 0.0
        if looked or all(r != rows for r, _ in self._steps[verified]):
            self._unfitted_steps = None  # a look's news, or a new kind of step: fit again at once
        elif self._unfitted_steps is not None:
            self._unfitted_steps += 1
        self._steps[verified].append((rows, seconds))
        self._steps_since_verified = 0 if verified else self._steps_since_verified + 1
        self._plain_seconds = 0.0 if verified else self._plain_seconds + seconds

    def record_acceptance(self, seq_id: int, proposed: int, accepted: int) -> None:
        self._acceptance.setdefault(seq_id, _Acceptance()).add(proposed, accepted)
        self._overall.add(proposed, accepted)

    def record_draft_forward(self, seconds: float, sequences: int) -> None:
        """A draft model's forward (one proposal depth) for `sequences` sequences took `seconds`."""
        self._draft.append((sequences, seconds))
        self._draft_fit = None

    def _draft_cost(self) -> tuple[float, float]:
        """(d_fixed, d_seq): a draft forward's seconds as d_fixed + d_seq * sequences, from the
        median of each size seen; proportional with one size; (0, 0) without a draft model."""
        if self._draft_fit is None:
            self._draft_fit = self._fit_draft()
        return self._draft_fit

    def _fit_draft(self) -> tuple[float, float]:
        groups: dict[int, list[float]] = {}
        for sequences, seconds in self._draft:
            groups.setdefault(sequences, []).append(seconds)
        if not groups:
            return 0.0, 0.0
        sizes = sorted(groups)
        medians = [float(np.median(groups[n])) for n in sizes]
        if len(sizes) == 1:
            return 0.0, medians[0] / sizes[0]
        (d_fixed, d_seq), *_ = np.linalg.lstsq(np.array([[1.0, n] for n in sizes]), np.array(medians), rcond=None)
        return max(float(d_fixed), 0.0), max(float(d_seq), 0.0)

    def release(self, seq_id: int) -> None:
        self._acceptance.pop(seq_id, None)

    def _fit(self) -> tuple[float, float, float] | None:
        """(c_plain, c_row, c_spec) from the recent steps, or None until they determine it."""
        if self._unfitted_steps is None or self._unfitted_steps >= _REFIT_EVERY:
            self._fitted, self._unfitted_steps = self._fit_steps(), 0
        return self._fitted

    def _fit_steps(self) -> tuple[float, float, float] | None:
        """The fit of the recent steps. Each kind of step (rows, verified) enters once, as the
        median of its times weighted by its count: a step that met another process on the core
        is an outlier that must not move the fit. (Steps that captured a CPU graph are never
        recorded: a verification shape explored once would have that capture as its only
        sample, and the fit would hold it for good.) Least squares with no negative coefficient:
        of the fits on each subset of the three terms whose coefficients are all >= 0, the one
        with the smallest residual (the full fit where it is feasible)."""
        groups: dict[tuple[int, bool], list[float]] = {}
        for verified, steps in self._steps.items():
            for rows, seconds in steps:
                groups.setdefault((rows, verified), []).append(seconds)
        if not any(not verified for _, verified in groups) or len({r for r, v in groups if v}) < 2:
            return None
        keys = list(groups)
        weights = np.sqrt([len(groups[k]) for k in keys])
        x = np.array([[1.0, rows, 1.0 if verified else 0.0] for rows, verified in keys]) * weights[:, None]
        y = np.array([float(np.median(groups[k])) for k in keys]) * weights
        best, best_residual = (0.0, 0.0, 0.0), float(np.sum(y * y))
        for terms in ([0, 1, 2], [0, 2], [1, 2], [0, 1], [0], [1], [2]):
            solution, *_ = np.linalg.lstsq(x[:, terms], y, rcond=None)
            if (solution < 0).any():
                continue
            residual = float(np.sum((x[:, terms] @ solution - y) ** 2))
            if residual < best_residual - 1e-18:
                coefficients = [0.0, 0.0, 0.0]
                for term, value in zip(terms, solution, strict=True):
                    coefficients[term] = float(value)
                best, best_residual = (coefficients[0], coefficients[1], coefficients[2]), residual
            if len(terms) == 3:
                break  # the unconstrained fit is feasible: nothing smaller fits better
        return best
