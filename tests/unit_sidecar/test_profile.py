"""Sidecar profiles: parsing, validation naming the field, and the vLLM command they produce."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine_sidecar.vllm.profile import (
    ProfileError,
    build_command,
    build_env,
    describe,
    expand_env,
    load_profile,
    parse_profile,
    resolve_python,
    with_overrides,
)

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = '[engine]\nmodel = "/m/target"\nserved_model_name = "t"\n'


def parse(text: str, **env: str):
    return parse_profile(text, name="p", env=env)


def test_env_references_expand_with_defaults() -> None:
    env = {"A": "x", "EMPTY": ""}
    assert expand_env("${A}/${B:-dflt}/${EMPTY:-e}", env) == "x/dflt/e"
    with pytest.raises(KeyError):
        expand_env("${MISSING}", env)


def test_missing_env_is_an_error_naming_the_field() -> None:
    with pytest.raises(ProfileError) as exc:
        parse('[engine]\nmodel = "${NOPE}"\nserved_model_name = "t"\n')
    assert exc.value.field == "engine.model"
    assert "NOPE" in str(exc.value)


@pytest.mark.parametrize(("text", "field"), [
    ('[engine]\nserved_model_name = "t"\n', "engine.model"),
    (MINIMAL + 'role = "judge"\n', "engine.role"),
    (MINIMAL + 'scheduling_policy = "lifo"\n', "engine.scheduling_policy"),
    (MINIMAL + "max_model_len = \"long\"\n", "engine.max_model_len"),
    (MINIMAL + "enable_prefix_caching = 1\n", "engine.enable_prefix_caching"),
    (MINIMAL + "gpu_memory_utilization = 1.5\n", "engine.gpu_memory_utilization"),
    (MINIMAL + 'device = "cpu"\nblock_size = 48\n', "engine.block_size"),
    (MINIMAL + "speculative = { method = \"ngram\" }\n",
     "engine.speculative.num_speculative_tokens"),
    (MINIMAL + "colour = 1\n", "engine.colour"),
    (MINIMAL + "[sidecar]\nport = 70000\n", "sidecar.port"),
    (MINIMAL + "[sidecar]\nrestart_initial_s = 10.0\nrestart_max_s = 1.0\n",
     "sidecar.restart_max_s"),
    (MINIMAL + "[extras]\n", "extras"),
    ("[engine\n", "p"),
    ("engine = [1]\n", "engine"),
    (MINIMAL + "[sidecar]\nstartup_timeout_s = -1.0\n", "sidecar.startup_timeout_s"),
    (MINIMAL + "[sidecar]\nhealth_interval_s = 0.0\n", "sidecar.health_interval_s"),
    (MINIMAL + "[sidecar]\nwarmup_requests = -3\n", "sidecar.warmup_requests"),
    (MINIMAL + "[sidecar]\nheartbeat_ttl_s = -1.0\n", "sidecar.heartbeat_ttl_s"),
    ("a = " + "[" * 3000 + "]" * 3000 + "\n", "p"),
])
def test_invalid_profiles_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ProfileError) as exc:
        parse(text)
    assert exc.value.field == field
    assert field in str(exc.value)


def test_command_for_a_full_profile() -> None:
    profile = parse(MINIMAL + """
role = "target"
device = "gpu"
dtype = "bfloat16"
quantization = "awq_marlin"
max_model_len = 4096
block_size = 16
max_num_seqs = 64
max_num_batched_tokens = 8192
gpu_memory_utilization = 0.9
tensor_parallel_size = 2
scheduling_policy = "priority"
seed = 7
speculative = { model = "/m/draft", num_speculative_tokens = 4 }
extra_args = ["--enforce-eager"]
[sidecar]
vllm_host = "0.0.0.0"
vllm_port = 9000
""")
    cmd = build_command(profile, "/py")
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == "/m/target"
    assert cmd[cmd.index("--served-model-name") + 1] == "t"
    assert cmd[cmd.index("--port") + 1] == "9000"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--scheduling-policy") + 1] == "priority"
    assert "--enable-prefix-caching" in cmd
    for flag, value in (("--quantization", "awq_marlin"), ("--tensor-parallel-size", "2"),
                        ("--max-model-len", "4096"), ("--gpu-memory-utilization", "0.9"),
                        ("--block-size", "16"), ("--max-num-seqs", "64"), ("--seed", "7"),
                        ("--dtype", "bfloat16"), ("--max-num-batched-tokens", "8192")):
        assert cmd[cmd.index(flag) + 1] == value
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"model": "/m/draft", "num_speculative_tokens": 4}
    assert cmd[-1] == "--enforce-eager"
    assert profile.engine.num_speculative_tokens == 4


def test_minimal_profile_omits_unset_flags_and_can_disable_prefix_caching() -> None:
    cmd = build_command(parse(MINIMAL + "enable_prefix_caching = false\n"), "py")
    assert "--no-enable-prefix-caching" in cmd
    for flag in ("--quantization", "--speculative-config", "--max-model-len", "--dtype"):
        assert flag not in cmd


def test_cpu_environment() -> None:
    profile = parse(MINIMAL + 'device = "cpu"\ncpu_kvcache_space_gib = 2\n'
                    'cpu_threads_bind = "1"\nenv = { EXTRA = "1" }\n')
    env = build_env(profile, {"PATH": "/bin"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1"  # a local model path never needs the hub
    assert env["EXTRA"] == "1" and env["PATH"] == "/bin"


def test_gpu_environment_with_a_hub_model_stays_online() -> None:
    profile = parse('[engine]\nmodel = "org/model"\nserved_model_name = "t"\n')
    env = build_env(profile, {})
    assert "HF_HUB_OFFLINE" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env


def test_overrides_and_advertised_url() -> None:
    profile = with_overrides(parse(MINIMAL), engine={"model": "/other", "served_model_name": None},
                             sidecar={"vllm_port": 8123, "advertise_host": "target"})
    assert profile.engine.model == "/other" and profile.engine.served_model_name == "t"
    assert profile.engine_url == "http://target:8123"
    assert profile.local_engine_url == "http://127.0.0.1:8123"
    assert describe(profile)["engine_url"] == "http://target:8123"


def test_python_resolution_order(tmp_path: Path) -> None:
    env = {"KVPROXY_VLLM_PYTHON": "/env/py"}
    assert resolve_python("/cfg/py", env, tmp_path, "/me") == "/cfg/py"
    assert resolve_python(None, env, tmp_path, "/me") == "/env/py"
    assert resolve_python(None, {}, tmp_path, "/me") == "/me"
    venv = tmp_path / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    assert resolve_python(None, {}, tmp_path, "/me") == str(venv / "python")


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "profiles").glob("*.toml")))
def test_shipped_profiles_load(name: str) -> None:
    profile = load_profile(ROOT / "profiles" / name, {})
    cmd = build_command(profile, "python")
    assert "--served-model-name" in cmd
    assert profile.engine.role in ("draft", "target")


def test_kv_events_flags_hash_algo_and_advertised_endpoints() -> None:
    text = (MINIMAL + 'kv_events = true\nkv_events_replay_endpoint = "tcp://*:5558"\n'
            'kv_events_topic = "kv"\nkv_events_buffer_steps = 500\n')
    profile = with_overrides(parse(text), sidecar={"advertise_host": "gpu1"})
    cmd = build_command(profile, "py")
    config = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                      "topic": "kv", "buffer_steps": 500}
    assert cmd[cmd.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert describe(profile)["kv_events"] == {
        "endpoint": "tcp://gpu1:5557", "mode": "bind", "replay_endpoint": "tcp://gpu1:5558",
        "topic": "kv", "hash_algo": "sha256_cbor"}
    # An inherited hash seed would change every block hash; one the profile sets is kept.
    assert "PYTHONHASHSEED" not in build_env(profile, {"PYTHONHASHSEED": "7"})
    seeded = parse(MINIMAL + 'kv_events = true\nenv = { PYTHONHASHSEED = "3" }\n')
    assert build_env(seeded, {"PYTHONHASHSEED": "7"})["PYTHONHASHSEED"] == "3"


def test_kv_events_are_off_by_default_and_validated() -> None:
    plain = parse(MINIMAL)
    assert "--kv-events-config" not in build_command(plain, "py")
    assert "--prefix-caching-hash-algo" not in build_command(plain, "py")
    assert describe(plain)["kv_events"] is None
    assert build_env(plain, {"PYTHONHASHSEED": "7"})["PYTHONHASHSEED"] == "7"
    with pytest.raises(ProfileError) as bad:
        parse(MINIMAL + 'kv_events = true\nkv_events_endpoint = "http://x:1"\n')
    assert bad.value.field == "engine.kv_events_endpoint"
    with pytest.raises(ProfileError) as off:
        parse(MINIMAL + 'kv_events = true\nenable_prefix_caching = false\n')
    assert off.value.field == "engine.kv_events"


@pytest.mark.parametrize(("engine", "field"), [
    ('model = "${NOPE_UNSET_VAR"', "engine.model"),
    ('model = "${A_UNSET:-${B_UNSET}}"', "engine.model"),
    ('model = "m"\nmax_model_len = -5', "engine.max_model_len"),
    ('model = "m"\nmax_model_len = 99999999999999', "engine.max_model_len"),
    ('model = "m"\ntensor_parallel_size = 0', "engine.tensor_parallel_size"),
    ('model = "m"\nspeculative = { method = "ngram", num_speculative_tokens = 99999999999 }',
     "engine.speculative.num_speculative_tokens"),
])
def test_a_profile_vllm_could_not_start_with_is_refused_naming_the_field(
    engine: str, field: str
) -> None:
    text = f'[engine]\n{engine}\nserved_model_name = "s"\n'
    with pytest.raises(ProfileError) as info:
        parse_profile(text, name="p.toml", env={})
    assert str(info.value).startswith(field)


def test_a_sidecar_duration_that_is_not_finite_is_refused() -> None:
    text = '[engine]\nmodel = "m"\nserved_model_name = "s"\n[sidecar]\ndrain_timeout_s = inf\n'
    with pytest.raises(ProfileError, match=r"sidecar\.drain_timeout_s"):
        parse_profile(text, name="p.toml", env={})


def test_a_port_given_on_the_command_line_is_checked_as_the_profiles_is() -> None:
    profile = parse(MINIMAL)
    for name in ("port", "vllm_port"):
        for bad in (99999, -5):
            with pytest.raises(ProfileError) as exc:
                with_overrides(profile, sidecar={name: bad})
            assert exc.value.field == f"sidecar.{name}"


def test_a_redis_url_redis_could_not_connect_with_is_refused_in_the_profile_and_the_cli() -> None:
    profile = parse(MINIMAL)
    for bad in ("redis://:hunter2@r:6379/0?socket_timeot=1", "redis://r:notaport", "http://r:6379"):
        text = f'[engine]\nmodel = "m"\nserved_model_name = "s"\n[sidecar]\nredis_url = "{bad}"\n'
        with pytest.raises(ProfileError) as exc:
            parse_profile(text, name="p.toml", env={})
        assert exc.value.field == "sidecar.redis_url" and "hunter2" not in str(exc.value)
        with pytest.raises(ProfileError) as exc:
            with_overrides(profile, sidecar={"redis_url": bad})
        assert exc.value.field == "sidecar.redis_url"
    assert with_overrides(profile, sidecar={"redis_url": "redis://redis:6379/0"})


def test_a_profile_file_that_is_not_text_or_not_a_file_is_a_profile_error(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_bytes(b"\xff\xfe[engine]\n")
    with pytest.raises(ProfileError, match="not UTF-8"):
        load_profile(path, {})
    fifo = tmp_path / "f.toml"
    os.mkfifo(fifo)
    with pytest.raises(ProfileError, match="not a regular file"):
        load_profile(fifo, {})
