"""The response cache key is the HMAC-SHA256 of the length-prefixed fields, however computed."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.cache_key import (
    _KEY_DOMAIN,
    TRANSPORT_FIELDS,
    KeyMaker,
    cache_key,
    canonical_body,
)

SECRET = b"k" * 32


def reference(tenant: str, model: str, endpoint: str, body: dict[str, object]) -> str:
    mac = hmac.new(SECRET, _KEY_DOMAIN, hashlib.sha256)
    for part in (tenant.encode(), model.encode(), endpoint.encode(), canonical_body(body)):
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.hexdigest()


def test_the_key_is_the_hmac_of_the_fields_part_by_part() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hé"}], "temperature": 0.0}
    keys = KeyMaker(SECRET)
    for tenant, model in (("t", "m"), ("", "m"), ("tenant-2", "model/x")):
        want = reference(tenant, model, "/v1/chat/completions", body)
        assert keys.key(tenant=tenant, model=model, endpoint="/v1/chat/completions",
                        body=body) == want
        assert cache_key(SECRET, tenant=tenant, model=model, endpoint="/v1/chat/completions",
                         body=body) == want


_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**60), 2**60), st.text(max_size=5),
                    st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0.0, -0.0, 1.0, 2.0**53, 2.0**53 + 2, 1e300, 0.5]))
_VALUES = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=3), inner, max_size=4), max_leaves=20)


def _shape(value: Any) -> Any:
    """``value`` with every object as its key/value pairs in order, and each number with its
    type (so that order, ``2`` against ``2.0``, and nesting all show in a comparison)."""
    if isinstance(value, dict):
        return ("object", [(k, _shape(v)) for k, v in value.items()])
    if isinstance(value, list):
        return [_shape(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (type(value).__name__, value)
    return value


def _top_level_number(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


@given(st.dictionaries(st.sampled_from(["model", "messages", "temperature", "stream", "tools",
                                        "seed", "x"]), _VALUES, max_size=6))
def test_the_canonical_body_sorts_and_normalises_the_top_level_and_keeps_the_rest(
        body: dict[str, Any]) -> None:
    want = {k: _top_level_number(body[k]) for k in sorted(body) if k not in TRANSPORT_FIELDS}
    got = json.loads(canonical_body(body), object_pairs_hook=dict)
    assert _shape(got) == _shape(want)


def test_a_change_of_the_key_format_changes_its_version() -> None:
    # Replicas of two versions share a Redis cache during a rollout: if the same request would
    # be keyed differently, ``_KEY_DOMAIN`` must change with it, or each version would answer
    # requests it tells apart with the other's entries. This pins the format; when it fails,
    # bump the version and update the key here.
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"schema": {"properties": {"b": {}, "a": {}}}}}}
    assert _KEY_DOMAIN == b"kvproxy-response-cache-v2"
    pinned = "5d1ca177084658ddc0f0747919cdd251cea4affc1b2e51ab3385f58e74cbfc98"
    assert cache_key(SECRET, tenant="t", model="m", endpoint="/v1/chat/completions",
                     body=body) == pinned
