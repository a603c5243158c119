"""The engines as the proxy knows them: their telemetry, the sessions that reach them, and the
background loops that keep what the proxy knows of them fresh.

Rules: each engine's state is the core's (health, breaker, outliers, pressure) fed by the scraper
and the model discovery loop, each a named task owned by the application. Everything that comes
from an engine is hostile until checked (sizes, encodings, ranges, no redirects followed). The
upstream sessions are shared by the request path and never used for anything else.
"""
