"""The pure core: configuration objects and every decision the proxy makes.

Rules: nothing here performs I/O, reads a clock, sleeps, or imports a framework (no aiohttp, no
Redis client, no Prometheus client, no asyncio); time is passed in as ``now``, randomness is seeded.
Parsing a request, keying it for the cache and for routing, choosing a pool, admitting or shedding,
ranking engines, judging an engine's health, breaker, outlier state and KV pressure are all
functions of their inputs, tested without sockets. Everything above this package performs what it
decides; nothing here imports from above.
"""
