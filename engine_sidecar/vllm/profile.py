"""Sidecar profiles: a TOML file describing one vLLM engine and how the sidecar runs it.

Rules:
- Pure: loading takes the file's text and an environment mapping; building the command line and
  the engine's environment takes a frozen profile. Nothing here starts processes or reads clocks.
- String values may reference the environment as ``${NAME}`` or ``${NAME:-default}`` (the same
  spelling compose uses), so one profile serves a laptop, CI and a GPU host.
- Every validation error is a :class:`ProfileError` naming the dotted field.
- A batch-size speculation schedule (``engine.speculative.num_speculative_tokens_per_batch_size``)
  is checked as vLLM would check it, here, so a bad one never costs a start-up.
- The ``[speculation]`` table (the adaptive loop) is kept raw here and read by ``adaptive``.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine_sidecar.speculation import schedule as sch
from engine_sidecar.vllm.kvevents import (
    KvEventsProfile,
    describe_kv_events,
    kv_events_args,
    kv_events_env,
)
from proxy.core.errors import ConfigError
from proxy.core.redis_url import check_redis_url

ROLES = ("draft", "target")
SCHEDULING_POLICIES = ("fcfs", "priority")
DEVICES = ("cpu", "gpu")
PYTHON_ENV = "KVPROXY_VLLM_PYTHON"
_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ProfileError(ValueError):
    """A profile is invalid; ``field`` is the dotted path of the offending entry."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class EngineProfile:
    """What vLLM is asked to serve and how (``[engine]``)."""

    model: str
    served_model_name: str
    role: str = "target"
    device: str = "gpu"
    dtype: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "priority"
    speculative: Mapping[str, Any] | None = None
    seed: int | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # CPU only: KV cache size in GiB and the cores the engine's OpenMP threads are bound to.
    cpu_kvcache_space_gib: int | None = None
    cpu_threads_bind: str | None = None
    # KV-cache events over ZMQ (engine_sidecar.vllm.kvevents); off by default.
    kv_events: bool = False
    kv_events_endpoint: str = "tcp://*:5557"
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_buffer_steps: int | None = None

    @property
    def events(self) -> KvEventsProfile:
        return KvEventsProfile(self.kv_events, self.kv_events_endpoint,
                               self.kv_events_replay_endpoint, self.kv_events_topic,
                               self.kv_events_buffer_steps)

    @property
    def num_speculative_tokens(self) -> int:
        if not self.speculative:
            return 0
        return int(self.speculative.get("num_speculative_tokens", 0))


@dataclass(frozen=True)
class SidecarSettings:
    """How the sidecar runs and watches the engine (``[sidecar]``)."""

    host: str = "127.0.0.1"
    port: int = 8100
    vllm_host: str = "127.0.0.1"
    vllm_port: int = 8000
    advertise_host: str | None = None
    python: str | None = None
    startup_timeout_s: float = 900.0
    health_interval_s: float = 2.0
    warmup_requests: int = 3
    warmup_max_tokens: int = 8
    drain_timeout_s: float = 30.0
    # Draining is shown for at least this long before an idle engine is stopped, so that every
    # proxy scrapes the flag (every 200 ms by default) and stops routing here first.
    drain_notice_s: float = 1.0
    stop_timeout_s: float = 20.0
    restart_initial_s: float = 1.0
    restart_max_s: float = 60.0
    restart_reset_after_s: float = 300.0
    spec_window_s: float = 60.0
    spec_poll_s: float = 5.0
    # Cost of one drafted token relative to one target decode step; used to pick the best
    # num_speculative_tokens (see spec.best_num_speculative_tokens).
    spec_token_cost: float = 0.1
    redis_url: str | None = None
    heartbeat_ttl_s: float = 15.0


@dataclass(frozen=True)
class Profile:
    name: str
    engine: EngineProfile
    sidecar: SidecarSettings
    speculation: Mapping[str, Any] = field(default_factory=dict)

    @property
    def engine_url(self) -> str:
        host = self.sidecar.advertise_host or _connectable(self.sidecar.vllm_host)
        return f"http://{host}:{self.sidecar.vllm_port}"

    @property
    def local_engine_url(self) -> str:
        return f"http://{_connectable(self.sidecar.vllm_host)}:{self.sidecar.vllm_port}"


def _connectable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def expand_env(value: str, env: Mapping[str, str]) -> str:
    """Replace ``${NAME}`` and ``${NAME:-default}``; an unset name without default is an error."""

    def sub(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if default is not None and "${" in default:
            raise ValueError("a ${...} reference inside another's default is not read")
        if env.get(name):
            return env[name]
        if default is not None:
            return default
        raise KeyError(name)

    out = _ENV_REF.sub(sub, value)
    if "${" in value and "${" in _ENV_REF.sub("", value):
        # A reference the pattern does not read (unterminated, or one inside another's
        # default): left as it is, it would reach vLLM's command line as literal text.
        raise ValueError("a ${...} reference that is not ${NAME} or ${NAME:-default}")
    return out


def _expand_tree(value: Any, env: Mapping[str, str], path: str) -> Any:
    if isinstance(value, str):
        try:
            return expand_env(value, env)
        except KeyError as exc:
            raise ProfileError(path, f"environment variable {exc.args[0]} is not set") from None
        except ValueError as exc:
            raise ProfileError(path, str(exc)) from None
    if isinstance(value, dict):
        return {k: _expand_tree(v, env, f"{path}.{k}" if path else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_tree(v, env, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


_ENGINE_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "served_model_name": (str,), "role": (str,), "device": (str,),
    "dtype": (str,), "quantization": (str,), "max_model_len": (int,), "block_size": (int,),
    "max_num_seqs": (int,), "max_num_batched_tokens": (int,),
    "gpu_memory_utilization": (float, int), "tensor_parallel_size": (int,),
    "enable_prefix_caching": (bool,), "scheduling_policy": (str,), "speculative": (dict,),
    "seed": (int,), "extra_args": (list,), "env": (dict,), "cpu_kvcache_space_gib": (int,),
    "cpu_threads_bind": (str,), "kv_events": (bool,), "kv_events_endpoint": (str,),
    "kv_events_replay_endpoint": (str,), "kv_events_topic": (str,),
    "kv_events_buffer_steps": (int,),
}
_SIDECAR_TYPES: dict[str, tuple[type, ...]] = {
    name: (str,) if default is None or isinstance(default, str)
    else (float, int) if isinstance(default, float) else (int,)
    for name, default in vars(SidecarSettings()).items()
}


def _check_table(table: Mapping[str, Any], types: Mapping[str, tuple[type, ...]],
                 section: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{section}.{key}"
        if key not in types:
            raise ProfileError(path, "unknown field")
        allowed = types[key]
        # bool is an int subclass; only accept it where bool is the declared type.
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            names = " or ".join(t.__name__ for t in allowed)
            raise ProfileError(path, f"expected {names}, got {type(value).__name__}")
        out[key] = float(value) if float in allowed and isinstance(value, int) else value
    return out


def _engine_from(table: object) -> EngineProfile:
    if not isinstance(table, Mapping):
        raise ProfileError("engine", "must be a table")
    values = _check_table(table, _ENGINE_TYPES, "engine")
    for required in ("model", "served_model_name"):
        if not values.get(required):
            raise ProfileError(f"engine.{required}", "is required")
    values["extra_args"] = tuple(str(a) for a in values.get("extra_args", ()))
    values["env"] = {str(k): str(v) for k, v in values.get("env", {}).items()}
    engine = EngineProfile(**values)
    _validate_engine(engine)
    return engine


# Integer engine fields and the values vLLM could be started with at all.
_ENGINE_RANGES: tuple[tuple[str, int, int], ...] = (
    ("max_model_len", 1, 1 << 24), ("block_size", 1, 1024), ("max_num_seqs", 1, 1 << 16),
    ("max_num_batched_tokens", 1, 1 << 24), ("tensor_parallel_size", 1, 1024),
    ("cpu_kvcache_space_gib", 1, 1 << 14), ("kv_events_buffer_steps", 1, 1 << 24),
)
# Draft tokens per step: beyond this a draft is never accepted whole and only costs.
_MAX_SPECULATIVE_TOKENS = 64


def _validate_engine(engine: EngineProfile) -> None:
    if engine.role not in ROLES:
        raise ProfileError("engine.role", f"must be one of {', '.join(ROLES)}")
    if engine.device not in DEVICES:
        raise ProfileError("engine.device", f"must be one of {', '.join(DEVICES)}")
    if engine.scheduling_policy not in SCHEDULING_POLICIES:
        raise ProfileError("engine.scheduling_policy",
                           f"must be one of {', '.join(SCHEDULING_POLICIES)}")
    if engine.speculative is not None:
        k = engine.speculative.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ProfileError("engine.speculative.num_speculative_tokens",
                               "must be an integer >= 1")
        if sch.SCHEDULE_FIELD in engine.speculative:
            try:
                sch.validate(engine.speculative[sch.SCHEDULE_FIELD], max_k=k)
            except sch.ScheduleError as exc:
                raise ProfileError(f"engine.speculative.{sch.SCHEDULE_FIELD}",
                                   str(exc).removeprefix(sch.SCHEDULE_FIELD + ": ")) from None
    util = engine.gpu_memory_utilization
    if util is not None and not 0.0 < util <= 1.0:
        raise ProfileError("engine.gpu_memory_utilization", "must be in (0, 1]")
    for name, low, high in _ENGINE_RANGES:
        value = getattr(engine, name)
        if value is not None and not low <= value <= high:
            raise ProfileError(f"engine.{name}", f"must be in {low}..{high}")
    k = engine.num_speculative_tokens
    if k > _MAX_SPECULATIVE_TOKENS:
        raise ProfileError("engine.speculative.num_speculative_tokens",
                           f"must be at most {_MAX_SPECULATIVE_TOKENS}")
    if engine.device == "cpu" and engine.block_size is not None and engine.block_size % 32:
        raise ProfileError("engine.block_size", "must be a multiple of 32 on CPU")
    _validate_events(engine)


def _validate_events(engine: EngineProfile) -> None:
    problem = engine.events.validate()
    if problem is not None:
        name, _, message = problem.partition(": ")
        raise ProfileError(name, message)
    if engine.kv_events and not engine.enable_prefix_caching:
        raise ProfileError("engine.kv_events", "needs enable_prefix_caching (vLLM emits no "
                           "events without it)")


# Durations and counts a sidecar cannot work with at or below zero (a start-up timeout of -1 s
# fails every start; a health interval of 0 spins), and those that may be zero.
_SIDECAR_POSITIVE = ("startup_timeout_s", "health_interval_s", "stop_timeout_s",
                     "restart_reset_after_s", "spec_poll_s", "heartbeat_ttl_s",
                     "warmup_max_tokens")
_SIDECAR_NOT_NEGATIVE = ("warmup_requests", "drain_timeout_s", "spec_token_cost")


def _sidecar_from(table: Mapping[str, Any]) -> SidecarSettings:
    settings = SidecarSettings(**_check_table(table, _SIDECAR_TYPES, "sidecar"))
    _validate_sidecar(settings)
    return settings


def _validate_sidecar(settings: SidecarSettings) -> None:
    for name in _SIDECAR_POSITIVE:
        if not getattr(settings, name) > 0:
            raise ProfileError(f"sidecar.{name}", "must be > 0")
    for name in _SIDECAR_NOT_NEGATIVE:
        if not getattr(settings, name) >= 0:
            raise ProfileError(f"sidecar.{name}", "must be >= 0")
    for name in ("port", "vllm_port"):
        if not 0 <= getattr(settings, name) <= 65535:
            raise ProfileError(f"sidecar.{name}", "must be a TCP port")
    if settings.restart_initial_s <= 0 or settings.restart_max_s < settings.restart_initial_s:
        raise ProfileError("sidecar.restart_max_s",
                           "need 0 < restart_initial_s <= restart_max_s")
    if settings.spec_window_s <= 0:
        raise ProfileError("sidecar.spec_window_s", "must be > 0")
    if not 0 <= settings.drain_notice_s <= settings.drain_timeout_s:
        raise ProfileError("sidecar.drain_notice_s", "must be in [0, drain_timeout_s]")
    for name, value in vars(settings).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ProfileError(f"sidecar.{name}", "must be a finite number")
    try:  # the proxy's check: redis-py takes a bad option at start-up and fails every connection
        check_redis_url(settings.redis_url or "")
    except ConfigError as exc:
        raise ProfileError("sidecar.redis_url", exc.reason) from None


def parse_profile(text: str, *, name: str, env: Mapping[str, str]) -> Profile:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(name, f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ProfileError(name, "not valid TOML: nested too deeply") from None
    unknown = set(raw) - {"engine", "sidecar", "speculation"}
    if unknown:
        raise ProfileError(sorted(unknown)[0], "unknown section")
    tree = _expand_tree(raw, env, "")
    for section in ("sidecar", "speculation"):
        if not isinstance(tree.get(section, {}), Mapping):
            raise ProfileError(section, "must be a table")
    return Profile(name=name, engine=_engine_from(tree.get("engine", {})),
                   sidecar=_sidecar_from(tree.get("sidecar", {})),
                   speculation=dict(tree.get("speculation", {})))


def load_profile(path: str | Path, env: Mapping[str, str]) -> Profile:
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ProfileError(path.name, "not a regular file")  # a FIFO would block in the read
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ProfileError(path.stem, "not valid TOML: not UTF-8 text") from None
    return parse_profile(text, name=path.stem, env=env)


def with_overrides(profile: Profile, *, engine: Mapping[str, Any] | None = None,
                   sidecar: Mapping[str, Any] | None = None) -> Profile:
    """Apply CLI overrides (already typed); ``None`` values mean "not given"."""
    eng = {k: v for k, v in (engine or {}).items() if v is not None}
    side = {k: v for k, v in (sidecar or {}).items() if v is not None}
    new_engine = replace(profile.engine, **eng)
    _validate_engine(new_engine)
    new_sidecar = replace(profile.sidecar, **side)
    _validate_sidecar(new_sidecar)  # --port and --vllm-port are checked as the profile's are
    return replace(profile, engine=new_engine, sidecar=new_sidecar)


def resolve_python(configured: str | None, env: Mapping[str, str], repo_root: Path,
                   fallback: str) -> str:
    """Interpreter that runs vLLM: profile/CLI, then $KVPROXY_VLLM_PYTHON, then the repository's
    ``.venv-vllm`` if present, then the sidecar's own interpreter."""
    if configured:
        return configured
    if env.get(PYTHON_ENV):
        return env[PYTHON_ENV]
    candidate = repo_root / ".venv-vllm" / "bin" / "python"
    return str(candidate) if candidate.exists() else fallback


def _opt(flag: str, value: object | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


def build_command(profile: Profile, python: str) -> list[str]:
    """The vLLM OpenAI server command line for ``profile``."""
    eng, side = profile.engine, profile.sidecar
    cmd = [python, "-m", _API_SERVER_MODULE, "--model", eng.model,
           "--served-model-name", eng.served_model_name,
           "--host", side.vllm_host, "--port", str(side.vllm_port),
           "--scheduling-policy", eng.scheduling_policy,
           "--enable-prefix-caching" if eng.enable_prefix_caching
           else "--no-enable-prefix-caching"]
    cmd += _opt("--dtype", eng.dtype) + _opt("--quantization", eng.quantization)
    cmd += _opt("--max-model-len", eng.max_model_len) + _opt("--block-size", eng.block_size)
    cmd += _opt("--max-num-seqs", eng.max_num_seqs)
    cmd += _opt("--max-num-batched-tokens", eng.max_num_batched_tokens)
    cmd += _opt("--gpu-memory-utilization", eng.gpu_memory_utilization)
    cmd += _opt("--tensor-parallel-size", eng.tensor_parallel_size)
    cmd += _opt("--seed", eng.seed)
    if eng.speculative:
        spec = json.dumps(dict(eng.speculative), sort_keys=True, separators=(",", ":"))
        cmd += ["--speculative-config", spec]
    return cmd + kv_events_args(eng.events) + list(eng.extra_args)


def build_env(profile: Profile, base: Mapping[str, str]) -> dict[str, str]:
    """The engine's environment: ``base`` plus what the device needs plus the profile's ``env``."""
    eng = profile.engine
    env = dict(base)
    if _is_local_path(eng.model):
        # A generated or pre-fetched model never needs the hub; offline also avoids its timeouts.
        env.setdefault("HF_HUB_OFFLINE", "1")
    if eng.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(eng.cpu_kvcache_space_gib or 1)
        if eng.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = eng.cpu_threads_bind
    kv_events_env(eng.events, env, eng.env)
    env.update(eng.env)
    return env


def _is_local_path(model: str) -> bool:
    return model.startswith(("/", ".", "~"))


def describe(profile: Profile) -> dict[str, object]:
    """What the sidecar advertises about its engine (``/ready`` and the registry)."""
    return {
        "profile": profile.name,
        "role": profile.engine.role,
        "model": profile.engine.served_model_name,
        "engine_url": profile.engine_url,
        "scheduling_policy": profile.engine.scheduling_policy,
        "prefix_caching": profile.engine.enable_prefix_caching,
        "num_speculative_tokens": profile.engine.num_speculative_tokens,
        **describe_kv_events(profile.engine.events, _engine_host(profile)),
        sch.SCHEDULE_FIELD: (profile.engine.speculative or {}).get(sch.SCHEDULE_FIELD),
    }


def _engine_host(profile: Profile) -> str:
    return profile.sidecar.advertise_host or _connectable(profile.sidecar.vllm_host)


def with_schedule(profile: Profile, schedule: sch.Schedule) -> Profile:
    """``profile`` whose engine runs the batch-size speculation ``schedule``."""
    spec = {**(profile.engine.speculative or {}), sch.SCHEDULE_FIELD: sch.to_json(schedule)}
    return replace(profile, engine=replace(profile.engine, speculative=spec))


def flatten_args(cmd: Sequence[str]) -> str:
    """A shell-readable rendering for logs."""
    return " ".join(a if a and " " not in a and '"' not in a else json.dumps(a) for a in cmd)


def registry_key_parts(profile: Profile) -> tuple[str, str]:
    return profile.engine.role, profile.engine_url
