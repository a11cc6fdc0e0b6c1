"""The batch-level back-off rule: how many tokens each request drafts in a step, and whether the
step drafts at all, from what a verify row is measured to cost at this batch size.

Why per-request back-off is not enough: one drafting request turns the whole batch's step into a
verify step (the module forward and the extend kernel over every request's rows), so at batch 4
every request pays for its neighbour's drafts. On text that does not repeat, requests accept a
draft now and then, each such round resets their own back-off, and the batch ends up verifying
most steps for about half a token each (issue 19: NGRAM 0.86x on open-ended text at concurrency 4).

The cost. A plain decode step of bs requests yields bs tokens in T_decode(bs). A verify step with
E drafted rows on top of the bs requests' own rows takes T_decode(bs) + O + E * t: a fixed
overhead O (the extend path where the decode step had its fused one, the acceptance; the
drafting itself runs before the timed forward) and t per extra row (on CPU the rows are compute:
~270 MFLOP each for the built-in model, LM head included). In tokens of plain decoding (a second is
worth bs / T_decode(bs) tokens), the step must gain
    overhead = O * bs / T_decode        and        per_row = t * bs / T_decode per drafted row.
- T_decode, O and t are the scheduler's own measurements (StepCosts): the wall time of every
  decode step, a moving average per batch size; and per batch size a moving least-squares fit of
  every verify step's time against its drafted rows (O and t; with too little spread in the row
  counts, all of the extra time is charged to the rows). Until a batch size has MIN_SAMPLES of
  each, steps draft at full length (which measures them).
- A draft j is accepted with probability alpha_j given that drafts 1 .. j-1 were (a draft counts
  only if every draft before it was accepted), so it is worth alpha_1 * .. * alpha_j tokens.
  SpecReqState.draft_alphas estimates them: the request's own acceptance (accepted drafts /
  (accepted drafts + rounds that ended on a rejected draft), decayed so that it follows the text,
  from a prior of 1/2), raised for NGRAM chains where drafts matched on as long a context were
  accepted more often across the server (ngram_drafter.MatchAcceptance): a long match raises it at
  once.
- Draft length: a request's drafts are cut after the last one still worth its row,
  alpha_1 * .. * alpha_n > per_row. A request whose first draft is not worth its row drafts nothing.
- The step drafts when its expected gain, the sum over the requests of their drafts' worth,
  exceeds overhead + E * per_row; else it runs as a plain decode.
- A request held back PROBE_AFTER steps in a row drafts one token anyway (a probe), which
  re-measures its acceptance when its text turns repetitive; its alpha then grows the length.
The per-request back-off (ngram_drafter.SpecReqState cooldown) still applies first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

EMA_ALPHA = 0.2  # weight of the newest step time
MIN_SAMPLES = 3  # step times per batch size before the rule trusts its averages
PROBE_AFTER = 16  # steps held back in a row after which a request drafts anyway
MIN_ROW_SPREAD = 1.0  # variance of drafted rows (rows^2) below which O is not fitted apart from t


@dataclass
class _Average:
    value: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.count == 0 else self.value + EMA_ALPHA * (x - self.value)
        self.count += 1


@dataclass
class _RowFit:
    """Moving least squares of a verify step's time T against its drafted rows E: T = a + b E."""

    e: _Average = field(default_factory=_Average)
    t: _Average = field(default_factory=_Average)
    ee: _Average = field(default_factory=_Average)
    et: _Average = field(default_factory=_Average)

    def add(self, rows: float, seconds: float) -> None:
        for avg, x in ((self.e, rows), (self.t, seconds), (self.ee, rows * rows), (self.et, rows * seconds)):
            avg.add(x)

    @property
    def count(self) -> int:
        return self.t.count

    def split(self, decode_s: float) -> tuple[float, float]:
        """(O, t): the fixed overhead over a decode step and the time per drafted row."""
        extra = max(self.t.value - decode_s, 0.0)
        var = self.ee.value - self.e.value**2
        if var >= MIN_ROW_SPREAD:
            slope = (self.et.value - self.e.value * self.t.value) / var
            overhead = extra - slope * self.e.value
            if slope > 0 and overhead >= 0:
                return overhead, slope
        return 0.0, extra / max(self.e.value, 1.0)  # every extra second charged to the rows


@dataclass(frozen=True)
class RowCost:
    """What a verify step must gain, in tokens of plain decoding at its batch size."""

    overhead: float  # per step
    per_row: float  # per drafted row


@dataclass
class StepCosts:
    """Decode step times per batch size, and the verify steps' fit against their drafted rows."""

    decode: dict[int, _Average] = field(default_factory=dict)
    verify: dict[int, _RowFit] = field(default_factory=dict)

    def observe(self, verify: bool, bs: int, seconds: float, rows: int | None = None) -> None:
        """A step's wall time; `rows` is a verify step's row count (bs + drafted rows)."""
        if verify:
            self.verify.setdefault(bs, _RowFit()).add(float((rows or bs) - bs), seconds)
        else:
            self.decode.setdefault(bs, _Average()).add(seconds)

    def row_cost(self, bs: int) -> RowCost | None:
        """None until both step kinds are measured MIN_SAMPLES times at this batch size."""
        d, v = self.decode.get(bs), self.verify.get(bs)
        if d is None or v is None or d.count < MIN_SAMPLES or v.count < MIN_SAMPLES or d.value <= 0:
            return None
        overhead, per_row = v.split(d.value)
        tokens_per_second = bs / d.value
        return RowCost(overhead * tokens_per_second, per_row * tokens_per_second)


def draft_length(alphas: Sequence[float], cost: RowCost | None) -> int:
    """How many of the drafts whose acceptance chances are `alphas` pay for their rows: the longest
    n with alpha_1 * .. * alpha_n > cost.per_row; all of them while costs are not measured yet."""
    if cost is None:
        return len(alphas)
    n, worth = 0, 1.0
    for alpha in alphas:
        worth *= alpha
        if worth <= cost.per_row:
            break
        n += 1
    return n


def expected_accepts(alphas: Sequence[float]) -> float:
    """alpha_1 + alpha_1 alpha_2 + .. + alpha_1 .. alpha_n: the drafts a chain is expected to get
    accepted."""
    total, worth = 0.0, 1.0
    for alpha in alphas:
        worth *= alpha
        total += worth
    return total


def step_pays(expected_gain: float, drafted_rows: int, cost: RowCost | None, probe: bool) -> bool:
    """Whether a step whose drafters expect `expected_gain` accepted drafts from `drafted_rows`
    rows should verify."""
    if probe or cost is None:
        return True
    return expected_gain > cost.overhead + drafted_rows * cost.per_row
