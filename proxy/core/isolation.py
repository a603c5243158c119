"""Tenant isolation inside the engines: the ``cache_salt`` kvproxy sends with each request.

vLLM keys every prefix-cache block by a chained hash that includes the request's ``cache_salt``
(the first block only; the chain carries it on). Two requests share KV blocks only when their salts
are equal, so a salt per tenant keeps one tenant's prompts from warming — and, by the timing of its
own requests, from probing — another tenant's cache.

Rules (pure, no I/O):
- A pool with ``isolation = "tenant"`` gets ``cache_salt`` = hex HMAC-SHA256 under the server-side
  secret (``cache.secret``, else a random one per process) over the tenant and the client's own
  ``cache_salt``, each length-prefixed. The client's value is never sent on as it is: it can only
  split its own tenant's cache further (e.g. per end user), never name another tenant's salt, and
  the engine never sees the tenant's name.
- Salting needs tenants to tell apart: with no ``[[auth.tenants]]`` and no Redis keys every request
  is the default tenant and nothing is salted (a per-process secret would only cost cache hits
  across replicas).
- ``isolation = "none"``, or no tenants: the body's ``cache_salt`` goes to the engine untouched, as
  before this existed.
- A client ``cache_salt`` is checked as vLLM checks it (non-empty string, at most 128 characters,
  none of ``@ / \\`` or NUL), so a bad one is a 400 naming ``cache_salt`` whatever the mode.
- The routing key follows the salt: ``scope`` is what prefix chains are seeded with, the tenant
  plus the client's salt when salted, so two requests that cannot share engine blocks never share
  a routing key either.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.core.errors import BadRequest

ISOLATION_MODES: tuple[str, ...] = ("tenant", "none")
SALT_FIELD = "cache_salt"
_DOMAIN = b"kvproxy-engine-cache-salt-v1"
_MAX_SALT_CHARS = 128  # vLLM's limit
_FORBIDDEN = frozenset("@/\\\x00")  # vLLM refuses these in a salt


def client_salt(body: Mapping[str, Any]) -> str | None:
    """The client's own ``cache_salt``, checked as vLLM checks it; None when absent."""
    value = body.get(SALT_FIELD)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest("'cache_salt' must be a non-empty string", param=SALT_FIELD)
    if len(value) > _MAX_SALT_CHARS or any(c in _FORBIDDEN for c in value):
        raise BadRequest(
            "'cache_salt' must be at most 128 characters, without '@', '/', '\\' or NUL",
            param=SALT_FIELD,
        )
    return value


@dataclass(frozen=True)
class Salting:
    """One request's isolation: the salt to send (None: leave the body's as it is) and the
    routing scope its prefix chain is seeded with."""

    salt: str | None
    scope: str


class TenantSalts:
    """Derives per-tenant engine cache salts under one secret."""

    def __init__(self, secret: str, *, tenants_known: bool) -> None:
        self._secret = secret.encode() if secret else secrets.token_bytes(32)
        self.tenants_known = tenants_known

    def salting(self, mode: str, tenant: str, client: str | None) -> Salting:
        """What ``mode`` makes of a request by ``tenant`` that carried ``client`` as its salt."""
        if mode != "tenant" or not self.tenants_known:
            return Salting(None, tenant)
        scope = tenant if client is None else f"{tenant}\x00{client}"
        return Salting(self.salt(tenant, client), scope)

    def salt(self, tenant: str, client: str | None) -> str:
        mac = hmac.new(self._secret, _DOMAIN, hashlib.sha256)
        # A flag byte keeps "no client salt" apart from an empty one (which is refused anyway).
        parts = (tenant.encode(), b"\x00" if client is None else b"\x01" + client.encode())
        for part in parts:
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.hexdigest()
