"""Configuration of one simulated engine and of its injected faults.

Rules: ``SimEngineConfig`` is frozen and validated at construction (``ValueError`` names the field);
every field has a default so a test can build one with a single keyword. ``FaultConfig`` is the one
mutable object: the admin endpoint and tests change it while the engine runs, and every read of it
happens at the moment a fault could fire, so a change takes effect on the next request or token.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from engine_sidecar.sim.kvevents import KvEventsSettings
from engine_sidecar.sim.profiles import PROFILES
from engine_sidecar.sim.speculation import SimSpecConfig

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass
class FaultConfig:
    """Faults an engine injects; all off by default. Mutated in place by ``update``/``clear``."""

    error_rate: float = 0.0
    error_status: int = 500
    reset_after_tokens: int | None = None
    stall_after_tokens: int | None = None
    stall_s: float = 0.0
    header_delay_s: float = 0.0
    metrics_status: int | None = None
    metrics_frozen: bool = False
    metrics_missing: tuple[str, ...] = ()
    metric_overrides: dict[str, float] = field(default_factory=dict)
    restart_fails: bool = False  # a reconfiguring restart fails (the old schedule stays)

    def update(self, body: Mapping[str, object]) -> None:
        """Apply the fields of an admin request; unknown or ill-typed fields raise ``ValueError``.

        The whole body is validated before anything changes, so a bad request leaves no half-state.
        """
        staged = dataclasses.replace(self, metric_overrides=dict(self.metric_overrides))
        for key, value in body.items():
            _set_fault(staged, key, value)
        _validate_faults(staged)
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(staged, f.name))

    def clear(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(FaultConfig(), f.name))

    def as_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["metrics_missing"] = list(self.metrics_missing)
        return data


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"fault {key!r} must be a number")
    return float(value)


def _optional_int(key: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"fault {key!r} must be an integer or null")
    return value


def _set_fault(faults: FaultConfig, key: str, value: object) -> None:
    if key in ("error_rate", "stall_s", "header_delay_s"):
        setattr(faults, key, _number(key, value))
    elif key in ("reset_after_tokens", "stall_after_tokens", "metrics_status"):
        setattr(faults, key, _optional_int(key, value))
    elif key == "error_status":
        status = _optional_int(key, value)
        faults.error_status = 500 if status is None else status
    elif key in ("metrics_frozen", "restart_fails"):
        if not isinstance(value, bool):
            raise ValueError(f"fault {key!r} must be a boolean")
        setattr(faults, key, value)
    elif key == "metrics_missing":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("fault 'metrics_missing' must be a list of metric names")
        faults.metrics_missing = tuple(str(v) for v in value)
    elif key == "metric_overrides":
        if not isinstance(value, dict):
            raise ValueError("fault 'metric_overrides' must be an object of name -> number")
        faults.metric_overrides = {str(k): _number(str(k), v) for k, v in value.items()}
    else:
        raise ValueError(f"unknown fault {key!r}")


def _validate_faults(faults: FaultConfig) -> None:
    if not 0.0 <= faults.error_rate <= 1.0:
        raise ValueError("fault 'error_rate' must be within 0..1")
    if not 400 <= faults.error_status <= 599:
        raise ValueError("fault 'error_status' must be an HTTP error status (400..599)")
    if faults.metrics_status is not None and not 100 <= faults.metrics_status <= 599:
        raise ValueError("fault 'metrics_status' must be an HTTP status")
    for key in ("reset_after_tokens", "stall_after_tokens"):
        value = getattr(faults, key)
        if value is not None and value < 0:
            raise ValueError(f"fault {key!r} must be >= 0")
    if faults.stall_s < 0 or faults.header_delay_s < 0:
        raise ValueError("fault delays must be >= 0")


@dataclass(frozen=True)
class SimEngineConfig:
    """One simulated engine. ``num_gpu_blocks=None`` derives the count from the profile's GPU."""

    model: str = "sim-model"
    name: str | None = None
    profile: str = "llama8b-l4"
    num_gpu_blocks: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    scheduling_policy: SchedulingPolicy = "fcfs"
    enable_prefix_caching: bool = True
    time_scale: float = 1.0
    num_speculative_tokens: int = 0
    acceptance: tuple[float, ...] = ()
    # Per-request acceptance, drift, batch-size schedule and restart time (sim/speculation.py).
    spec: SimSpecConfig = field(default_factory=SimSpecConfig)
    legacy_kv_metric: bool = False
    seed: int = 0
    stop_len_range: tuple[int, int] = (64, 512)
    kv_events: KvEventsSettings = field(default_factory=KvEventsSettings)  # off: no endpoint
    # A draft model's greedy words agree with the target's with this probability (1.0: this
    # engine is the target model); per ``X-Workload-Class`` where listed (sim/agreement.py).
    draft_agreement: float = 1.0
    draft_agreement_by_workload: tuple[tuple[str, float], ...] = ()
    # A real model's tokenizer (tokenizer.json or its directory, chat template beside it) instead
    # of the 4-bytes-per-token one: prompts get the token ids a vLLM engine of that model gives.
    tokenizer: str | None = None
    # vLLM's ``--enable-scale-out``: serve the token-in ``/inference/v1/generate`` (generate.py).
    scale_out: bool = True
    faults: FaultConfig = field(default_factory=FaultConfig, compare=False)

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be >= 1")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}, not {self.profile!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self._validate_speculation()
        if self.tokenizer is not None and not (
                os.path.isfile(self.tokenizer)
                or os.path.isfile(os.path.join(self.tokenizer, "tokenizer.json"))):
            raise ValueError(f"tokenizer: no tokenizer.json at {self.tokenizer}")
        low, high = self.stop_len_range
        if not 1 <= low <= high:
            raise ValueError("stop_len_range must be (low, high) with 1 <= low <= high")

    def _validate_speculation(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        agreements = [self.draft_agreement, *(p for _, p in self.draft_agreement_by_workload)]
        if not all(0.0 <= p <= 1.0 for p in agreements):
            raise ValueError("draft agreement probabilities must be within 0..1")
        if not all(0.0 <= p <= 1.0 for p in self.acceptance):
            raise ValueError("acceptance probabilities must be within 0..1")
        if self.spec.schedule is not None:
            self.spec.checked_schedule(self.num_speculative_tokens)

    @property
    def acceptance_per_pos(self) -> tuple[float, ...]:
        """Acceptance probability of each draft position; the last given value repeats."""
        k = self.num_speculative_tokens
        given = self.acceptance or (0.8,)
        return tuple(given[min(i, len(given) - 1)] for i in range(k))

    @property
    def blocks(self) -> int:
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        return PROFILES[self.profile].num_gpu_blocks(self.block_size)
