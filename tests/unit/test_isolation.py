"""Engine cache salts per tenant (pure): stable, keyed, never the client's value, never shared."""

from __future__ import annotations

import orjson
import pytest

from proxy.core.errors import BadRequest, ConfigError
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.core.inbound import rewrite
from proxy.core.isolation import TenantSalts, client_salt
from proxy.core.prefix import prefix_chain

SECRET = "s" * 32


def test_salt_is_stable_per_tenant_and_differs_across_tenants() -> None:
    salts = TenantSalts(SECRET, tenants_known=True)
    again = TenantSalts(SECRET, tenants_known=True)
    assert salts.salt("acme", None) == again.salt("acme", None)  # replicas with one secret agree
    assert salts.salt("acme", None) != salts.salt("beta", None)
    assert salts.salt("acme", None) != TenantSalts("t" * 32, tenants_known=True).salt("acme", None)


def test_salt_is_what_vllm_accepts_and_hides_the_tenant() -> None:
    salt = TenantSalts(SECRET, tenants_known=True).salt("acme", "user/1")
    assert len(salt) == 64 and set(salt) <= set("0123456789abcdef")
    assert "acme" not in salt


def test_client_salt_is_combined_not_forwarded() -> None:
    salts = TenantSalts(SECRET, tenants_known=True)
    acme = salts.salting("tenant", "acme", None)
    # Another tenant sending acme's very salt still gets its own.
    beta = salts.salting("tenant", "beta", acme.salt)
    assert beta.salt not in (acme.salt, None)
    assert salts.salting("tenant", "acme", "u1").salt not in (acme.salt, None)
    # Length prefixes: moving characters between tenant and client salt changes the salt.
    assert salts.salt("ab", "c") != salts.salt("a", "bc")


def test_scope_seeds_routing_apart_exactly_when_salts_differ() -> None:
    salts = TenantSalts(SECRET, tenants_known=True)
    scopes = {
        salts.salting("tenant", "acme", None).scope,
        salts.salting("tenant", "beta", None).scope,
        salts.salting("tenant", "acme", "u1").scope,
    }
    chains = {prefix_chain("x" * 600, model="m", tenant=s, block_chars=256, max_blocks=4)
              for s in scopes}  # fmt: skip
    assert len(chains) == 3
    assert all(not set(a) & set(b) for a in chains for b in chains if a != b)


def test_none_mode_and_no_tenants_leave_the_body_alone() -> None:
    known = TenantSalts(SECRET, tenants_known=True)
    assert known.salting("none", "acme", "u1").salt is None
    assert known.salting("none", "acme", "u1").scope == "acme"  # routing as before
    unknown = TenantSalts("", tenants_known=False)
    assert unknown.salting("tenant", "default", None).salt is None


def test_rewrite_replaces_the_client_salt_only_when_given_one() -> None:
    body = {"model": "public", "cache_salt": "mine", "messages": []}
    sent = orjson.loads(rewrite(body, model="served", priority=None, cache_salt="abc"))
    assert sent["cache_salt"] == "abc" and sent["model"] == "served"
    kept = orjson.loads(rewrite(body, model="served", priority=None))
    assert kept["cache_salt"] == "mine"


@pytest.mark.parametrize("bad", ["", 3, ["a"], "a@b", "a/b", "a\\b", "a\x00b", "x" * 129])
def test_client_salt_is_checked_as_vllm_checks_it(bad: object) -> None:
    with pytest.raises(BadRequest) as err:
        client_salt({"cache_salt": bad})
    assert err.value.param == "cache_salt"


def test_client_salt_absent_or_fine() -> None:
    assert client_salt({}) is None
    assert client_salt({"cache_salt": None}) is None
    assert client_salt({"cache_salt": "x" * 128}) == "x" * 128


def test_pool_isolation_setting_is_validated() -> None:
    engines = (EngineConfig("e", "http://127.0.0.1:1"),)
    assert PoolConfig("target", "m", engines).isolation == "tenant"
    assert PoolConfig("target", "m", engines, isolation="none").isolation == "none"
    with pytest.raises(ConfigError) as err:
        PoolConfig("target", "m", engines, isolation="tenants")
    assert err.value.field == "isolation"
