import pytest

from proxy.core.config import AdmissionConfig, Config
from proxy.core.errors import NotFound
from proxy.core.fleet_config import AliasConfig, EngineConfig, PoolConfig
from proxy.core.pools import (
    SHOWN_CHARS,
    ModelEntry,
    PoolPlan,
    find_model,
    model_names,
    resolve_model,
    upstream_model,
)


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


def fleet(*, degrade: bool = True) -> Config:
    """Three free-named pools: one with a LoRA adapter, one model on two GPU types."""
    return Config(
        pools=(
            PoolConfig("h100", "llama-70b", (EngineConfig("h0", "http://h0"),)),
            PoolConfig("a100", "llama-70b", (EngineConfig("a0", "http://a0"),)),
            PoolConfig(
                "small", engines=(EngineConfig("s0", "http://s0"),), models=("llama-8b", "lora")
            ),
        ),
        aliases=(
            AliasConfig("llama-70b", pools=("h100", "a100")),
            AliasConfig("chat", pools=("h100", "a100", "small")),
            AliasConfig("cheap", "small"),
        ),
        admission=AdmissionConfig(degrade_to_draft=degrade),
    )


def test_two_pool_layout_keeps_its_meaning() -> None:
    cfg = config()
    assert resolve_model(cfg, "big") == PoolPlan(("target",))
    assert resolve_model(cfg, "small") == PoolPlan(("draft",))
    assert resolve_model(cfg, "chat") == PoolPlan(("target", "draft"))
    assert resolve_model(cfg, "fast") == PoolPlan(("draft",))
    assert resolve_model(cfg, "chat").fallbacks == ("draft",)


def test_degrade_can_be_turned_off() -> None:
    assert resolve_model(config(degrade=False), "chat") == PoolPlan(("target",))
    assert resolve_model(fleet(degrade=False), "chat") == PoolPlan(("h100",))
    # /v1/models lists the pools requests take, not the chain that is off.
    listed = {e.id: e.pools for e in model_names(fleet(degrade=False))}
    assert listed["chat"] == ("h100",)
    entry = find_model(fleet(degrade=False), "chat")
    assert entry is not None and entry.pools == ("h100",)


def test_tier_chains_and_shared_model_names() -> None:
    cfg = fleet()
    assert resolve_model(cfg, "chat") == PoolPlan(("h100", "a100", "small"))
    assert resolve_model(cfg, "llama-70b") == PoolPlan(("h100", "a100"))
    assert resolve_model(cfg, "lora") == PoolPlan(("small",))
    assert resolve_model(cfg, "cheap").pool == "small"


def test_unknown_model() -> None:
    with pytest.raises(NotFound) as info:
        resolve_model(config(), "gpt-9")
    assert info.value.status == 404 and info.value.code == "model_not_found"
    assert info.value.param == "model"
    assert find_model(config(), "gpt-9") is None
    assert "'gpt-9'" in str(info.value)


def test_an_unknown_model_name_is_echoed_cut() -> None:
    # A 100 KB model name must not come back as a 100 KB error.
    with pytest.raises(NotFound) as info:
        resolve_model(config(), "x" * 100_000)
    message = str(info.value)
    assert len(message) < SHOWN_CHARS + 64 and "xxx'..." in message


def test_upstream_model() -> None:
    cfg = config()
    assert upstream_model(cfg, "draft", "chat") == "small"
    assert upstream_model(cfg, "target", "chat") == "big"
    with pytest.raises(NotFound):
        upstream_model(config(draft=False), "draft", "chat")
    many = fleet()
    # A name the pool serves goes through as asked (LoRA adapter, same model on other GPUs) ...
    assert upstream_model(many, "small", "lora") == "lora"
    assert upstream_model(many, "a100", "llama-70b") == "llama-70b"
    # ... anything else (an alias, a degraded request) as the pool's own model.
    assert upstream_model(many, "small", "chat") == "llama-8b"


def test_listing() -> None:
    assert model_names(config()) == [
        ModelEntry("big", ("target",), alias=False),
        ModelEntry("small", ("draft",), alias=False),
        ModelEntry("chat", ("target", "draft"), alias=True),
        ModelEntry("fast", ("draft",), alias=True),
    ]
    listed = {e.id: e.pools for e in model_names(fleet())}
    assert listed == {
        "llama-70b": ("h100", "a100"),
        "llama-8b": ("small",),
        "lora": ("small",),
        "chat": ("h100", "a100", "small"),
        "cheap": ("small",),
    }
