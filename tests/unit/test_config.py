import dataclasses
import os
from pathlib import Path

import pytest

from proxy.core.config import ClassThreshold, Config
from proxy.core.config_checks import http_url
from proxy.core.configload import ENV_PREFIX, SCALAR_SECTIONS, load_config, scalar_paths
from proxy.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
[server]
host = "0.0.0.0"
port = 8001

[routing]
policy = "least_load"

[admission.sheddable]
shed_above = 0.8

[[pools]]
name = "target"
model = "llama-70b"
priority_scheduling = true
  [[pools.engines]]
  name = "t0"
  url = "http://10.0.0.5:8000/"
  [[pools.engines]]
  name = "t1"
  url = "http://10.0.0.6:8000"
  metrics_url = "http://10.0.0.6:9100/metrics"

[[pools]]
name = "draft"
model = "llama-1b"
  [[pools.engines]]
  name = "d0"
  url = "http://10.0.0.7:8000"

[[aliases]]
name = "chat"
pool = "target"
tiering = true
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvproxy.toml"
    path.write_text(text)
    return str(path)


def error_for(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env or {}, [])
    return info.value


def test_defaults() -> None:
    cfg = Config.default()
    assert cfg.server.port == 8000
    assert cfg.server.max_body_bytes == 4 * 1024 * 1024
    assert cfg.telemetry.interval_s == 0.2
    assert cfg.routing.policy == "expected_ttft"
    assert cfg.routing.load_factor == 2.0
    assert cfg.admission.sheddable == ClassThreshold(0.85, 0.75)
    assert cfg.breaker.failure_threshold == 3
    assert cfg.pools == ()
    assert load_config(None, {}, []) == cfg


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config.default().server.port = 1  # type: ignore[misc]


def test_full_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD), {}, [])
    assert cfg.server.host == "0.0.0.0"
    assert cfg.routing.policy == "least_load"
    # A partial nested table keeps the defaults it leaves out.
    assert cfg.admission.sheddable == ClassThreshold(0.8, 0.75)
    target = cfg.pool("target")
    assert target is not None and target.priority_scheduling
    assert target.engines[0].url == "http://10.0.0.5:8000"
    assert target.engines[0].metrics_url == "http://10.0.0.5:8000/metrics"
    assert target.engines[1].metrics_url == "http://10.0.0.6:9100/metrics"
    assert cfg.aliases[0].tiering


def test_env_then_cli(tmp_path: Path) -> None:
    env = {
        "KVPROXY_SERVER_PORT": "9000",
        "KVPROXY_ROUTING_LOAD_FACTOR": "1.5",
        "KVPROXY_ADMISSION_SHEDDABLE_SHED_ABOVE": "0.9",
        "KVPROXY_ADMISSION_DEGRADE_TO_DRAFT": "false",
        "KVPROXY_VLLM_PYTHON": "/usr/bin/python3",  # not a config section: not ours
        "PATH": "/bin",
    }
    cfg = load_config(
        write(tmp_path, GOOD), env, ["server.port=9100", "routing.policy=round_robin"]
    )
    assert cfg.server.port == 9100  # CLI beats env
    assert cfg.routing.load_factor == 1.5
    assert cfg.routing.policy == "round_robin"
    assert cfg.admission.sheddable.shed_above == 0.9
    assert cfg.admission.degrade_to_draft is False


@pytest.mark.parametrize(
    ("env", "overrides", "field"),
    [
        ({"KVPROXY_SERVER_PROT": "1"}, [], "KVPROXY_SERVER_PROT"),
        ({"KVPROXY_SERVER_PORT": "eighty"}, [], "server.port"),
        ({"KVPROXY_ADMISSION_DEGRADE_TO_DRAFT": "maybe"}, [], "admission.degrade_to_draft"),
        ({}, ["server.prot=1"], "server.prot"),
        ({}, ["server.port"], "server.port"),
        ({}, ["pools.name=x"], "pools.name"),
        ({}, ["routing.policy=fastest"], "routing.policy"),
        ({}, ["server.port=70000"], "server.port"),
        ({}, ["server.gc_young_threshold=0"], "server.gc_young_threshold"),
        ({"KVPROXY_SERVER_GC_YOUNG_THRESHOLD": "2000000"}, [], "server.gc_young_threshold"),
        ({}, ["server.gc_middle_threshold=0"], "server.gc_middle_threshold"),
        ({}, ["server.worker_stuck_after_s=0.5"], "server.worker_stuck_after_s"),
        ({"KVPROXY_SERVER_WORKER_STUCK_AFTER_S": "nan"}, [], "server.worker_stuck_after_s"),
        ({}, ["server.max_connections=0"], "server.max_connections"),
        ({"KVPROXY_SERVER_MAX_CONNECTIONS": "many"}, [], "server.max_connections"),
        # NaN passes a check written as "if x < 0: refuse"; infinity fails where it is used.
        ({}, ["cache.ttl_s=nan"], "cache.ttl_s"),
        ({}, ["cache.single_flight_timeout_s=nan"], "cache.single_flight_timeout_s"),
        ({}, ["redis.op_timeout_s=nan"], "redis.op_timeout_s"),
        ({}, ["redis.connect_timeout_s=nan"], "redis.connect_timeout_s"),
        ({}, ["redis.retry_after_failure_s=nan"], "redis.retry_after_failure_s"),
        ({}, ["auth.redis_cache_s=nan"], "auth.redis_cache_s"),
        ({}, ["limits.lease_ttl_s=nan"], "limits.lease_ttl_s"),
        ({}, ["limits.tokens_per_min=nan"], "limits.tokens_per_min"),
        ({"KVPROXY_UPSTREAM_CONNECT_TIMEOUT_S": "1e309"}, [], "upstream.connect_timeout_s"),
        ({}, ["routing.decode_step_s=inf"], "routing.decode_step_s"),
        ({}, ["routing.decode_seq_step_s=inf"], "routing.decode_seq_step_s"),
        # Every number setting, whatever its own range check: none has a use for either.
        ({}, ["routing.load_factor=inf"], "routing.load_factor"),
        ({"KVPROXY_ROUTING_LOAD_FACTOR": "1e400"}, [], "routing.load_factor"),
        ({}, ["pressure.horizon_scrapes=inf"], "pressure.horizon_scrapes"),
        ({"KVPROXY_ADMISSION_SHEDDABLE_SHED_ABOVE": "nan"}, [],
         "admission.sheddable.shed_above"),
        ({}, ["routing.seed=18446744073709551616"], "routing.seed"),
        ({}, ["pressure.output_window=1000000000000000000000000000000"],
         "pressure.output_window"),
    ],
)
def test_env_and_cli_errors(env: dict[str, str], overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env, overrides)
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_variables_the_project_reads_itself_never_look_like_proxy_settings() -> None:
    """A profile's or a test's own ``KVPROXY_*`` variable that starts like a config section
    would stop ``kvproxy serve`` from starting in a shell that exports it."""
    import re  # noqa: PLC0415

    reserved = tuple(ENV_PREFIX + s.upper() + "_" for s in SCALAR_SECTIONS)
    own: set[str] = set()
    for pattern in ("profiles/*.toml", "tests/**/conftest.py", "deploy/**/*", "compose.yaml"):
        for path in ROOT.glob(pattern):
            if path.is_file():
                own |= set(re.findall(r"\$\{(KVPROXY_[A-Z0-9_]+)", path.read_text("utf-8")))
                own |= set(re.findall(r'"(KVPROXY_[A-Z0-9_]+)":', path.read_text("utf-8")))
    paths = scalar_paths(Config, SCALAR_SECTIONS)
    settings = {ENV_PREFIX + p.replace(".", "_").upper() for p in paths}
    assert own, "no project variables found: the globs above are stale"
    clashes = sorted(v for v in own - settings if v.startswith(reserved))
    assert not clashes


def engines_toml(*urls: str, names: tuple[str, ...] | None = None) -> str:
    names = names or tuple(f"e{i}" for i in range(len(urls)))
    body = "".join(
        f'  [[pools.engines]]\n  name = "{n}"\n  url = "{u}"\n'
        for n, u in zip(names, urls, strict=True)
    )
    return f'[[pools]]\nname = "target"\nmodel = "m"\n{body}'


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        (engines_toml("http://a", "ftp://b"), "pools[0].engines[1].url", "http(s) URL"),
        (engines_toml("http://a/v1/"), "pools[0].engines[0].url", "without /v1"),
        (engines_toml("http://a", "http://b", names=("x", "x")), "pools[0].engines[1].name", "dup"),
        ("[server]\nprot = 1\n", "server.prot", "unknown key"),
        ("[serve]\nport = 1\n", "serve", "unknown key"),
        ('[server]\nport = "80"\n', "server.port", "integer"),
        ("[server]\nport = true\n", "server.port", "integer"),
        ("[telemetry]\ninterval_s = 0.1\ntimeout_s = 0.2\n", "telemetry.timeout_s", "<"),
        (
            "[admission.standard]\nshed_above = 0.5\nadmit_below = 0.6\n",
            "admission.standard.admit_below",
            "<=",
        ),
        ("[routing]\nload_factor = 0.5\n", "routing.load_factor", ">= 1.0"),
        ("[routing]\nload_factor = inf\n", "routing.load_factor", "finite"),
        ("[pressure]\nhorizon_scrapes = nan\n", "pressure.horizon_scrapes", "finite"),
        (
            '[[pools]]\nname = "big gpu"\nmodel = "m"\n'
            + engines_toml("http://a").split("\n", 3)[3],
            "pools[0].name",
            "letters, digits",
        ),
        (
            '[[pools]]\nname = "big"\nmodels = ["m", "m"]\n'
            + engines_toml("http://a").split("\n", 3)[3],
            "pools[0].models[1]",
            "duplicate",
        ),
        (
            engines_toml("http://a") + '[[aliases]]\nname = "c"\npools = ["target", "small"]\n',
            "aliases[0].pools[1]",
            "no pool 'small'",
        ),
        (
            engines_toml("http://a")
            + '[[aliases]]\nname = "c"\npool = "target"\npools = ["target"]\n',
            "aliases[0].pools",
            "not both",
        ),
        (
            engines_toml("http://a")
            + '[[aliases]]\nname = "c"\npools = ["target"]\ntiering = true\n',
            "aliases[0].tiering",
            "remove tiering",
        ),
        (engines_toml("http://a") + '[[aliases]]\nname = "c"\n', "aliases[0].pool", "required"),
        ('[[pools]]\nname = "target"\nmodel = "m"\nengines = []\n', "pools[0].engines", "at least"),
        ('[[pools]]\nname = "target"\nengines = []\n', "pools[0].model", "required"),
        (
            engines_toml("http://a") + '[[aliases]]\nname = "m"\npool = "target"\n',
            "aliases[0].name",
            "collides",
        ),
        (
            engines_toml("http://a") + '[[aliases]]\nname = "c"\npool = "draft"\n',
            "aliases[0].pool",
            "no pool",
        ),
        (
            engines_toml("http://a") + '[[aliases]]\nname = "c"\npool = "target"\ntiering = true\n',
            "aliases[0].tiering",
            "draft",
        ),
        (
            engines_toml("http://a") + '[[aliases]]\nname = "c"\npool = "target"\nfoo = 1\n',
            "aliases[0].foo",
            "unknown",
        ),
        ("pools = 3\n", "pools", "array"),
        (engines_toml("http://127.0.0.1:99999"), "pools[0].engines[0].url", "http(s) URL"),
        (engines_toml("http://127.0.0.1:abc"), "pools[0].engines[0].url", "http(s) URL"),
        (engines_toml("http://[::1:19601"), "pools[0].engines[0].url", "http(s) URL"),
        (engines_toml("http://u:p@h:1"), "pools[0].engines[0].url", "http(s) URL"),
        (engines_toml("http://h:1?x=1"), "pools[0].engines[0].url", "http(s) URL"),
        (engines_toml("http://h :1"), "pools[0].engines[0].url", "http(s) URL"),
        (engines_toml("http://a", names=("e0\\r\\nX-Evil: 1",)),
         "pools[0].engines[0].name", "printable"),
        (engines_toml("http://a") + '[[aliases]]\nname = "c"\npool = "target"\nchunk = 99\n',
         "aliases[0].chunk", "speculative_first\" only"),
        (engines_toml("http://a") + '[[aliases]]\nname = "c"\npool = "target"\n'
         'leg_timeout_s = -1.0\n', "aliases[0].leg_timeout_s", "speculative_first\" only"),
        ("server = 3\n", "server", "table"),
    ],
)
def test_file_errors_name_the_field(tmp_path: Path, text: str, field: str, words: str) -> None:
    err = error_for(tmp_path, text)
    assert err.field == field
    assert words in str(err)


def test_duplicate_engine_across_pools(tmp_path: Path) -> None:
    text = engines_toml("http://a") + engines_toml("http://b").replace('"target"', '"draft"', 1)
    text = text.replace('model = "m"', 'model = "n"', 1)
    err = error_for(tmp_path, text)
    assert err.field == "pools[1].engines[0].name"


def test_tiering_without_a_draft_pool_says_what_to_write(tmp_path: Path) -> None:
    text = engines_toml("http://a") + '[[aliases]]\nname = "c"\npool = "target"\ntiering = true\n'
    err = error_for(tmp_path, text)
    assert err.field == "aliases[0].tiering"
    assert 'pools = ["target", "<smaller pool>"]' in str(err)


def test_one_model_in_two_pools_needs_an_alias_naming_the_order(tmp_path: Path) -> None:
    two = engines_toml("http://a") + engines_toml("http://b", names=("f0",)).replace(
        '"target"', '"a100"', 1
    )
    err = error_for(tmp_path, two)
    assert err.field == "aliases" and "target, a100" in str(err)
    alias = '[[aliases]]\nname = "m"\npools = ["a100", "target"]\n'
    cfg = load_config(write(tmp_path, two + alias), {}, [])
    assert cfg.aliases[0].chain(["target", "a100"]) == ("a100", "target")


def test_free_named_pools_with_several_models(tmp_path: Path) -> None:
    text = (
        '[[pools]]\nname = "gpu-h100.big"\nmodels = ["base", "base-sql-lora"]\n'
        '  [[pools.engines]]\n  name = "h0"\n  url = "http://a"\n'
        '[[pools]]\nname = "small"\nmodel = "tiny"\nmodels = ["tiny", "tiny-lora"]\n'
        '  [[pools.engines]]\n  name = "s0"\n  url = "http://b"\n'
        '[[aliases]]\nname = "chat"\npools = ["gpu-h100.big", "small"]\n'
    )
    cfg = load_config(write(tmp_path, text), {}, [])
    big, small = cfg.pools
    assert big.model == "base" and big.served == ("base", "base-sql-lora")
    assert small.served == ("tiny", "tiny-lora")
    assert cfg.aliases[0].chain(["gpu-h100.big", "small"]) == ("gpu-h100.big", "small")


def test_missing_and_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.toml"), {}, [])
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[server\n"), {}, [])


def test_example_file_loads() -> None:
    cfg = load_config(str(ROOT / "examples" / "kvproxy.toml"), {}, [])
    assert {p.name for p in cfg.pools} == {"draft", "target"}
    assert any(a.tiering for a in cfg.aliases)


def test_every_setting_has_a_distinct_env_name_and_is_documented() -> None:
    paths = scalar_paths(Config, SCALAR_SECTIONS)
    env_names = {ENV_PREFIX + p.replace(".", "_").upper() for p in paths}
    assert len(env_names) == len(paths)
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert all(name in doc for name in env_names)


def test_a_config_that_is_not_readable_toml_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "kvproxy.toml"
    for body in (b"\xff\xfe[server]\n", b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n"):
        path.write_bytes(body)
        with pytest.raises(ConfigError, match="invalid TOML"):
            load_config(str(path), {}, [])
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(str(tmp_path), {}, [])
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # opening it would block the start-up for ever
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(str(fifo), {}, [])


def test_an_engine_url_may_have_a_path_and_an_ipv6_host() -> None:
    assert http_url("http://10.0.0.7:8000/vllm") and http_url("https://[::1]:8443")
    assert http_url("http://engine-0.svc:8000")
