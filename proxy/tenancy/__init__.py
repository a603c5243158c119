"""Tenants and what they share: API keys, per-tenant limits, the response cache, and the state
replicas share through Redis (breakers, pressure, the engine registry).

Rules: the front door is the only way in from the request path. Redis is optional and never a
client's problem: a Redis failure or timeout is a cache miss, an open limit, or a local judgement,
always counted in metrics. A tenant never sees another tenant's answer.
"""
