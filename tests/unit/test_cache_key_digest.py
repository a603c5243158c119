"""The response cache key is the HMAC-SHA256 of the length-prefixed fields, however computed."""

from __future__ import annotations

import hashlib
import hmac

from proxy.core.cache_key import _KEY_DOMAIN, KeyMaker, cache_key, canonical_body

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
