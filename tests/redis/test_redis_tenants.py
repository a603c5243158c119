"""API keys to tenants: config keys, Redis keys, and keys never appearing in logs."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

import pytest
from redisproc import SLOW_OK, RedisFactory, RedisServer

from proxy.core.door_config import AuthConfig, RedisConfig, TenantConfig, key_digest
from proxy.core.errors import ConfigError, NoCapacity, Unauthorized
from proxy.tenancy import tenants
from proxy.tenancy.redis_link import RedisLink
from proxy.tenancy.tenants import TenantDirectory, bearer_token, register_key, revoke_key

KEY_A = "sk-acme-0123456789"
KEY_B = "sk-beta-0123456789"


def auth(required: bool = True, **extra: object) -> AuthConfig:
    tenants = (
        TenantConfig("acme", keys=(KEY_A,)),
        TenantConfig("beta", key_sha256=(key_digest(KEY_B),)),
    )
    return AuthConfig(required=required, tenants=tenants, **extra)  # type: ignore[arg-type]


@dataclasses.dataclass
class Keyed:
    server: RedisServer
    link: RedisLink
    directory: TenantDirectory


@pytest.fixture
async def keyed(redis_factory: RedisFactory) -> AsyncIterator[Keyed]:
    """Keys in a Redis of the test's own (it may be stopped), looked up afresh every time."""
    server = redis_factory.start()
    link = RedisLink(RedisConfig(url=server.url, **SLOW_OK))
    try:
        yield Keyed(server, link, TenantDirectory(auth(redis_keys=True, redis_cache_s=0.0), link))
    finally:
        await link.close()


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


async def test_config_keys() -> None:
    directory = TenantDirectory(auth())
    assert await directory.identify(f"Bearer {KEY_A}") == "acme"
    assert await directory.identify(f"Bearer {KEY_B}") == "beta"
    with pytest.raises(Unauthorized) as exc:
        await directory.identify("Bearer sk-wrong")
    assert exc.value.status == 401 and KEY_A not in str(exc.value)
    with pytest.raises(Unauthorized):
        await directory.identify(None)


async def test_open_mode_defaults_but_keeps_known_tenants() -> None:
    directory = TenantDirectory(auth(required=False))
    assert await directory.identify(None) == "default"
    assert await directory.identify("Bearer whatever") == "default"
    assert await directory.identify(f"Bearer {KEY_A}") == "acme"


def test_keys_never_in_repr_or_errors() -> None:
    cfg = auth()
    assert KEY_A not in repr(cfg)
    with pytest.raises(ConfigError) as exc:
        AuthConfig.from_mapping(
            {"tenants": [{"name": "a", "keys": [KEY_A]}, {"name": "b", "keys": [KEY_A]}]}, "auth"
        )
    assert exc.value.field == "auth.tenants[1]" and KEY_A not in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        AuthConfig.from_mapping({"tenants": [{"name": "a", "key_sha256": ["abc"]}]}, "auth")
    assert exc.value.field == "auth.tenants[0].key_sha256[0]"
    with pytest.raises(ConfigError) as exc:
        AuthConfig.from_mapping({"required": True}, "auth")
    assert exc.value.field == "auth.required"


async def test_redis_keys(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    link = RedisLink(RedisConfig(url=redis_server.url, **SLOW_OK))
    directory = TenantDirectory(auth(redis_keys=True, redis_cache_s=0), link)
    try:
        await register_key(link, "sk-from-redis-1", "gamma")
        assert await directory.identify("Bearer sk-from-redis-1") == "gamma"
        stored = await link.client.hgetall(link.key("apikeys"))
        assert stored == {key_digest("sk-from-redis-1").encode(): b"gamma"}
        await revoke_key(link, "sk-from-redis-1")
        with pytest.raises(Unauthorized):
            await directory.identify("Bearer sk-from-redis-1")
        await link.client.hset(link.key("apikeys"), key_digest("sk-bad-name-1"), "{bad}")
        with pytest.raises(Unauthorized):
            await directory.identify("Bearer sk-bad-name-1")
    finally:
        await link.close()
    assert "sk-from-redis-1" not in caplog.text and "sk-bad-name-1" not in caplog.text


async def test_redis_outage_keeps_known_keys(keyed: Keyed) -> None:
    directory = keyed.directory
    await register_key(keyed.link, "sk-known-key-1", "gamma")
    assert await directory.identify("Bearer sk-known-key-1") == "gamma"
    keyed.server.stop()
    # Remembered: still gamma. Config keys: unaffected. Unknown: 503, not 401.
    assert await directory.identify("Bearer sk-known-key-1") == "gamma"
    assert await directory.identify(f"Bearer {KEY_A}") == "acme"
    with pytest.raises(NoCapacity) as exc:
        await directory.identify("Bearer sk-never-seen-1")
    assert exc.value.status == 503 and exc.value.reason == "auth_unavailable"


async def test_with_keys_optional_a_key_redis_cannot_check_is_never_the_default_tenant(
    keyed: Keyed,
) -> None:
    # Served as the default tenant, a tenant's answers would reach the response cache and the
    # engines' cache scope that clients without a key share.
    directory = TenantDirectory(auth(required=False, redis_keys=True, redis_cache_s=0.0),
                                keyed.link)
    await register_key(keyed.link, "sk-tenant-key-1", "xcorp")
    keyed.server.stop()
    with pytest.raises(NoCapacity) as exc:
        await directory.identify("Bearer sk-tenant-key-1")
    assert exc.value.status == 503 and exc.value.reason == "auth_unavailable"
    assert await directory.identify(None) == "default"  # no key: the default tenant, as ever
    assert await directory.identify(f"Bearer {KEY_A}") == "acme"


async def test_a_key_that_is_not_utf8_is_refused_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPROXY_TEST_ADMIN_KEY", "sk-admin-0123456789")
    directory = TenantDirectory(auth(admin_key_env="KVPROXY_TEST_ADMIN_KEY"))
    # aiohttp hands a header's undecodable bytes on as surrogates.
    raw = b"Bearer \xff\xfe\xe9".decode("utf-8", "surrogateescape")
    with pytest.raises(Unauthorized) as exc:
        await directory.identify(raw)
    assert exc.value.status == 401
    with pytest.raises(Unauthorized):
        directory.check_admin(raw)
    assert key_digest(raw.removeprefix("Bearer ")) != key_digest("\ufffd\ufffd\ufffd")


async def test_a_flood_of_bad_keys_does_not_push_out_a_good_one(
    keyed: Keyed, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tenants, "_REMEMBERED_MAX", 50)
    await register_key(keyed.link, "sk-known-key-2", "gamma")
    assert await keyed.directory.identify("Bearer sk-known-key-2") == "gamma"
    for i in range(200):  # four times what is remembered of either kind
        with pytest.raises(Unauthorized):
            await keyed.directory.identify(f"Bearer sk-junk-{i}")
    keyed.server.stop()
    assert await keyed.directory.identify("Bearer sk-known-key-2") == "gamma"


async def test_a_revoked_key_is_not_accepted_through_an_outage(keyed: Keyed) -> None:
    await register_key(keyed.link, "sk-known-key-3", "gamma")
    assert await keyed.directory.identify("Bearer sk-known-key-3") == "gamma"
    await revoke_key(keyed.link, "sk-known-key-3")
    with pytest.raises(Unauthorized):
        await keyed.directory.identify("Bearer sk-known-key-3")
    keyed.server.stop()
    with pytest.raises((Unauthorized, NoCapacity)):
        await keyed.directory.identify("Bearer sk-known-key-3")
