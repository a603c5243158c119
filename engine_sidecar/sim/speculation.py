"""How speculation behaves inside a simulated engine: who accepts what, when, and at which K.

Rules:
- Acceptance is per request: a request's workload class (``X-Workload-Class`` header, or
  ``Sampling.workload`` in-process) picks a per-position acceptance profile from ``classes``;
  an unknown or missing class gets the engine's default (``SimEngineConfig.acceptance``). The
  default can drift during a run: ``drift`` lists ``(sim_time_s, acceptance)`` steps, a domain
  shift at that time for every request submitted after it.
- Values are *conditional* per position: position ``i`` is tried only if ``i - 1`` was accepted,
  and accepted with probability ``acceptance[i]`` (the last value repeats), so the unconditional
  rate vLLM's per-position counters show is the running product.
- K per step follows vLLM 0.32's ``num_speculative_tokens_per_batch_size`` (see
  ``engine_sidecar.speculation.schedule``): with a schedule, a step of ``b`` running requests
  drafts ``lookup[b]`` tokens, capped at ``num_speculative_tokens``; without one, always
  ``num_speculative_tokens``.
- ``restart_s`` is how long (simulated seconds) a "restart" with a new schedule keeps the engine
  out after it drained, like vLLM loading weights and warming up again.
- Pure and frozen; the engine applies it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine_sidecar.speculation import schedule as sch

Acceptance = tuple[float, ...]


def _check(values: Sequence[float], what: str) -> None:
    if not values or not all(0.0 <= p <= 1.0 for p in values):
        raise ValueError(f"{what}: acceptance probabilities must be within 0..1 (at least one)")


@dataclass(frozen=True)
class SimSpecConfig:
    schedule: tuple[tuple[int, int, int], ...] | None = None
    classes: tuple[tuple[str, Acceptance], ...] = ()
    drift: tuple[tuple[float, Acceptance], ...] = ()
    restart_s: float = 30.0

    def __post_init__(self) -> None:
        for name, values in self.classes:
            _check(values, f"speculation class {name!r}")
        for at, values in self.drift:
            _check(values, f"speculation drift at {at}")
        if self.restart_s < 0:
            raise ValueError("restart_s must be >= 0")
        if list(self.drift) != sorted(self.drift):
            raise ValueError("speculation drift steps must be in time order")

    @classmethod
    def build(cls, *, schedule: Sequence[Sequence[int]] | None = None,
              classes: Mapping[str, Sequence[float]] | None = None,
              drift: Sequence[tuple[float, Sequence[float]]] = (),
              restart_s: float = 30.0) -> SimSpecConfig:
        return cls(
            schedule=None if schedule is None else tuple(
                (int(a), int(b), int(k)) for a, b, k in schedule),
            classes=tuple((str(n), tuple(v)) for n, v in (classes or {}).items()),
            drift=tuple((float(t), tuple(v)) for t, v in drift), restart_s=restart_s)

    def checked_schedule(self, max_k: int) -> sch.Schedule | None:
        """The schedule validated against ``max_k`` (``ScheduleError`` names the problem)."""
        if self.schedule is None:
            return None
        return sch.validate([list(r) for r in self.schedule], max_k=max_k)


def per_position(given: Acceptance, max_k: int) -> Acceptance:
    """``given`` stretched to ``max_k`` positions, its last value repeating."""
    values = given or (0.8,)
    return tuple(values[min(i, len(values) - 1)] for i in range(max_k))


def acceptance_for(spec: SimSpecConfig, default: Acceptance, workload: str | None,
                   sim_time: float, max_k: int) -> Acceptance:
    """The conditional per-position acceptance of a request submitted at ``sim_time``."""
    chosen = default
    for at, values in spec.drift:
        if sim_time >= at:
            chosen = values
    if workload is not None:
        chosen = dict(spec.classes).get(workload, chosen)
    return per_position(chosen, max_k)


def lookup(schedule: sch.Schedule | None, max_num_seqs: int, max_k: int) -> tuple[int, ...]:
    """``k[b]`` for every batch size ``b`` (index 0 unused)."""
    if schedule is None:
        return (0, *([max_k] * max_num_seqs))
    return sch.dense(schedule, max_num_seqs, max_k)
