"""Speculative-first metrics: how requests were served, who wrote the tokens, and each tenant's
draft agreement and fallbacks.

Rules: every series is named ``kvproxy_specfirst_*`` and registers in the proxy's own registry;
every label is bounded (alias names come from the configuration, tenants through the proxy's
``TenantLabels``, ``path``, ``source`` and ``mode`` from fixed sets).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

PATHS: tuple[str, ...] = (
    "speculative", "fallback", "ineligible", "draft_shed", "unverified", "prompt_too_long",
)


class SpecFirstMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "kvproxy_specfirst_requests",
            "Requests to speculative-first aliases, by how they were served "
            "(speculative, or target-only and why)", ["alias", "path"], registry=r)
        self.tokens = Counter(
            "kvproxy_specfirst_tokens",
            "Answer tokens of speculative-first requests by who wrote them (draft or target)",
            ["alias", "tenant", "source"], registry=r)
        self.drafted = Counter(
            "kvproxy_specfirst_drafted_tokens",
            "Tokens the draft pool proposed (kept or not)", ["alias", "tenant"], registry=r)
        self.agreement = Gauge(
            "kvproxy_specfirst_agreement",
            "Share of drafted tokens the target agreed with, over the recent rounds",
            ["alias", "tenant"], registry=r)
        self.fallbacks = Counter(
            "kvproxy_specfirst_fallbacks",
            "Times a tenant's traffic on an alias fell back to the target alone",
            ["alias", "tenant"], registry=r)
        self.draft_failures = Counter(
            "kvproxy_specfirst_draft_failures",
            "Answers that lost their draft engine midway and went on with the target alone",
            ["alias"], registry=r)
        self.verifications = Counter(
            "kvproxy_specfirst_verifications",
            "Verification calls to the target by how they were made: cached (the prefix cache "
            "read), recomputed (prompt_logprobs, the whole context computed again) or redone "
            "(a cache-reading verification whose answer could not be used: the cache covered "
            "the draft, or the engine could not serialise the uncomputed positions)",
            ["alias", "mode"], registry=r)
        self.role_checks = Counter(
            "kvproxy_specfirst_token_role_checks",
            "Calls asking the target whether it stops on a token", ["alias"], registry=r)
