import pytest

from proxy.config import AdmissionConfig, AliasConfig, Config, EngineConfig, PoolConfig
from proxy.errors import NotFound
from proxy.pools import PoolPlan, model_names, resolve_model, upstream_model


def config(*, degrade: bool = True, draft: bool = True) -> Config:
    pools = [PoolConfig("target", "big", (EngineConfig("t0", "http://t0"),))]
    if draft:
        pools.append(PoolConfig("draft", "small", (EngineConfig("d0", "http://d0"),)))
    aliases = [AliasConfig("chat", "target", tiering=True), AliasConfig("fast", "draft")]
    return Config(
        pools=tuple(pools),
        aliases=tuple(aliases) if draft else (),
        admission=AdmissionConfig(degrade_to_draft=degrade),
    )


def test_pool_models_and_aliases() -> None:
    cfg = config()
    assert resolve_model(cfg, "big") == PoolPlan("target", None)
    assert resolve_model(cfg, "small") == PoolPlan("draft", None)
    assert resolve_model(cfg, "chat") == PoolPlan("target", "draft")
    assert resolve_model(cfg, "fast") == PoolPlan("draft", None)


def test_degrade_can_be_turned_off() -> None:
    assert resolve_model(config(degrade=False), "chat") == PoolPlan("target", None)


def test_unknown_model() -> None:
    with pytest.raises(NotFound) as info:
        resolve_model(config(), "gpt-9")
    assert info.value.status == 404 and info.value.code == "model_not_found"
    assert info.value.param == "model"


def test_upstream_model_and_listing() -> None:
    cfg = config()
    assert upstream_model(cfg, "draft") == "small"
    assert upstream_model(cfg, "target") == "big"
    with pytest.raises(NotFound):
        upstream_model(config(draft=False), "draft")
    assert model_names(cfg) == [
        ("big", "target"),
        ("small", "draft"),
        ("chat", "target"),
        ("fast", "draft"),
    ]
