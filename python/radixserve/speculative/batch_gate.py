"""The batch-level back-off rule: draft in a step only when the drafts are expected to pay for the
verify step's extra cost at this batch size.

Why per-request back-off is not enough: one drafting request turns the whole batch's step into a
verify step (the module forward and the extend kernel instead of the fused decode path), so at
batch 4 every request pays for its neighbour's drafts. On text that does not repeat, requests
accept a draft now and then, each such round resets their own back-off, and the batch ends up
verifying most steps for about half a token each (issue 19: NGRAM 0.86x on open-ended text at
concurrency 4).

The rule. A plain decode step of a batch of bs requests yields bs tokens in T_decode(bs); a verify
step yields bs + A tokens in T_verify(bs), where A is the number of drafts it accepts. Drafting pays
when (bs + A) / T_verify > bs / T_decode, i.e. when

    A > bs * (T_verify(bs) / T_decode(bs) - 1)      (the step's extra cost, in tokens)

- T_decode and T_verify are measured: the scheduler reports every decode and verify step's wall
  time, kept per batch size as moving averages (StepCosts). Until both are known for a batch size,
  steps draft (which measures T_verify) and plain decodes measure T_decode.
- A is estimated per request as a moving average of the drafts it accepted per verify round
  (SpecReqState.accept_ema; a new request starts at its draft limit, i.e. optimistic). The step's
  expected A is the sum over the requests that draft this step.
- A step that does not pay runs as a plain decode. Its would-be drafters' estimates do not change,
  so a request gated PROBE_AFTER steps in a row drafts anyway (a probe), which re-measures its
  acceptance when its text turns repetitive.
The per-request back-off (ngram_drafter.SpecReqState) still applies first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMA_ALPHA = 0.2  # weight of the newest step time
MIN_SAMPLES = 3  # step times per batch size before the rule trusts its average
PROBE_AFTER = 16  # gated steps in a row after which a request drafts anyway


@dataclass
class _Average:
    value: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.count == 0 else self.value + EMA_ALPHA * (x - self.value)
        self.count += 1


@dataclass
class StepCosts:
    """Moving averages of decode and verify step wall times, per batch size."""

    decode: dict[int, _Average] = field(default_factory=dict)
    verify: dict[int, _Average] = field(default_factory=dict)

    def observe(self, verify: bool, bs: int, seconds: float) -> None:
        table = self.verify if verify else self.decode
        table.setdefault(bs, _Average()).add(seconds)

    def extra_cost(self, bs: int) -> float | None:
        """bs * (T_verify / T_decode - 1): the drafts a verify step of bs requests must gain to
        beat a plain decode step; None until both are measured at this batch size."""
        d, v = self.decode.get(bs), self.verify.get(bs)
        if d is None or v is None or d.count < MIN_SAMPLES or v.count < MIN_SAMPLES or d.value <= 0:
            return None
        return bs * (v.value / d.value - 1.0)


def step_pays(expected_gain: float, bs: int, costs: StepCosts, probe: bool) -> bool:
    """Whether a step whose drafters expect `expected_gain` accepted drafts in total should verify."""
    if probe:
        return True
    extra = costs.extra_cost(bs)
    return extra is None or expected_gain > extra
