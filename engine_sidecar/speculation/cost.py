"""Step time as a function of batch size and draft length, and its calibration from measurements.

Rules:
- The model is the roofline the simulator uses, reduced to five figures an operator can read off
  a profile or a benchmark: one decode step of ``b`` sequences drafting ``k`` tokens each costs

      t(b, k) = fixed + max(weights + kv_per_seq * b, compute_per_token * b * (1 + k))
                + draft_pass * k

  so verification is free while the step is bandwidth-bound (small batches) and costs
  ``compute_per_token`` per extra token once it is compute-bound (large batches), and drafting
  costs ``k`` sequential passes of the draft model.
- Prefill shares the steps (chunked prefill): at steady state every output token brings
  ``prefill_per_token`` prompt tokens to compute (measured: prefix-cache queries minus hits over
  generated tokens, so cached prefixes and recomputation after preemption count as they cost),
  arriving in chunks of ``prefill_chunk`` tokens. A step carrying a chunk is compute-bound even
  at a batch where pure decoding would be bandwidth-bound, and there every verified draft token
  costs FLOPs; the more tokens a step accepts, the sooner requests finish and the more steps
  carry a chunk. The model takes the mixture of steps with and without a chunk (a mean of the
  two step times, not the step time of the mean load, which would hide the compute-bound ones).
  With nothing measured (``prefill_per_token`` 0) it is the pure decode step above.
- Measurements correct the model, never replace its shape: the mean inter-token latency of a
  window (vLLM observes one ITL per request and step, so it is the step time) divided by what the
  model predicts for the batch sizes seen is a factor, kept separately for steps with and
  without speculation, so a wrong guess of verification cost is corrected by what the engine does.
  Until one kind has been measured it borrows the other's factor: an error common to both (say,
  prefill chunks the model leaves out) must not be blamed on speculation.
- Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

_FACTOR_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class StepCost:
    fixed_s: float = 0.004
    weights_s: float = 0.006
    kv_per_seq_s: float = 0.00005
    compute_per_token_s: float = 0.00003
    draft_pass_s: float = 0.0005
    # Prompt tokens computed per output token, and per request (see the rules); 0: unmeasured.
    prefill_per_token: float = 0.0
    prefill_chunk: float = 0.0
    # Measured / modelled step time, for steps without (off) and with (on) speculation;
    # None until measured.
    factor_off: float | None = None
    factor_on: float | None = None

    def __post_init__(self) -> None:
        for name in ("fixed_s", "weights_s", "kv_per_seq_s", "compute_per_token_s",
                     "draft_pass_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.fixed_s + self.weights_s <= 0:
            raise ValueError("fixed_s + weights_s must be > 0")

    def modelled(self, batch: int, k: int, tokens: float = 1.0) -> float:
        """Step time of ``batch`` sequences drafting ``k``, each step yielding ``tokens`` per
        sequence (what brings prefill in: see the module rules)."""
        b = max(1, batch)
        memory = self.weights_s + self.kv_per_seq_s * b

        def step(extra: float) -> float:
            return max(memory, self.compute_per_token_s * (b * (1 + k) + extra))

        prefill = self.prefill_per_token * b * tokens  # prompt tokens per step, on average
        if prefill <= 0 or self.prefill_chunk <= 0:
            mixed = step(0.0)
        elif prefill >= self.prefill_chunk:
            mixed = step(prefill)
        else:
            share = prefill / self.prefill_chunk  # steps that carry a chunk
            mixed = (1 - share) * step(0.0) + share * step(self.prefill_chunk)
        return self.fixed_s + mixed + self.draft_pass_s * k

    def factor(self, on: bool) -> float:
        mine, other = (self.factor_on, self.factor_off) if on else (self.factor_off,
                                                                    self.factor_on)
        return mine if mine is not None else other if other is not None else 1.0

    def step_time(self, batch: int, k: int, tokens: float = 1.0) -> float:
        return self.modelled(batch, k, tokens) * self.factor(k > 0)


def tokens_per_step(per_position: tuple[float, ...], k: int) -> float:
    """The bonus token plus each draft position's chance of being reached and accepted."""
    return 1.0 + sum(per_position[:k])


def mean_step_time(batch_weights: Mapping[int, float], k_of: Callable[[int], int],
                   step: Callable[[int, int], float]) -> float | None:
    """Mean ITL a window would show: batch ``b`` held the engine a share ``w_b`` of the time and
    produced ``b / t_b`` ITL observations per second, each of ``t_b``."""
    obs = sum(w * b / step(b, k_of(b)) for b, w in batch_weights.items() if b > 0)
    if obs <= 0:
        return None
    return sum(w * b for b, w in batch_weights.items() if b > 0) / obs


def calibrate(cost: StepCost, *, measured_itl_s: float, batch_weights: Mapping[int, float],
              k_of: Callable[[int], int], smoothing: float = 0.5,
              per_position: tuple[float, ...] = ()) -> StepCost:
    """``cost`` with the factor of the window's kind (all steps on, or all off) moved towards
    measured / modelled. A window that mixed both kinds says nothing about either: unchanged."""
    kinds = {k_of(b) > 0 for b, w in batch_weights.items() if b > 0 and w > 0}
    predicted = mean_step_time(batch_weights, k_of, lambda b, k: cost.modelled(
        b, k, tokens_per_step(per_position, k)))
    if len(kinds) != 1 or predicted is None or measured_itl_s <= 0:
        return cost
    low, high = _FACTOR_RANGE
    target = min(high, max(low, measured_itl_s / predicted))
    on = kinds == {True}
    old = cost.factor_on if on else cost.factor_off
    new = target if old is None else old + smoothing * (target - old)
    return replace(cost, factor_on=new) if on else replace(cost, factor_off=new)
