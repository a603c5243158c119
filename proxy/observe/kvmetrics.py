"""Metrics of precise routing: the KV events each engine sent and what became of them.

Rules: every series is named ``kvproxy_kv_*`` and labelled by engine (bounded: configured and
discovered engines only). Counters count events and batches as received; ``fallbacks`` counts every
move of an engine off the exact index, by the state it moved to (``refused``, ``disconnected``,
``silent``); the gauges are refreshed right before each exposition.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class KvEventMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.events = Counter(
            "kvproxy_kv_events", "KV events applied to the exact index, by engine and type",
            ["engine", "type"], registry=r,
        )  # fmt: skip
        self.bad = Counter(
            "kvproxy_kv_event_bad_messages",
            "KV-event messages dropped as malformed (framing, msgpack or content)", ["engine"],
            registry=r,
        )  # fmt: skip
        self.gaps = Counter(
            "kvproxy_kv_event_gaps", "Gaps in an engine's KV-event sequence numbers", ["engine"],
            registry=r,
        )  # fmt: skip
        self.replays = Counter(
            "kvproxy_kv_event_replays",
            "Replays asked of an engine's replay socket, by outcome (filled, partial, failed)",
            ["engine", "outcome"], registry=r,
        )  # fmt: skip
        self.restarts = Counter(
            "kvproxy_kv_event_restarts",
            "Times an engine's exact index was emptied (publisher restarted, gap not filled)",
            ["engine", "reason"], registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            "kvproxy_kv_event_fallbacks",
            "Moves of an engine to the approximate index, by the state it moved to",
            ["engine", "state"], registry=r,
        )  # fmt: skip
        self.precise = Gauge(
            "kvproxy_kv_precise", "1 while the engine is routed from its KV events, else 0",
            ["engine"], registry=r,
        )  # fmt: skip
        self.blocks = Gauge(
            "kvproxy_kv_index_blocks", "Blocks the exact index holds for the engine", ["engine"],
            registry=r,
        )  # fmt: skip
        self.tokenize_failures = Counter(
            "kvproxy_kv_tokenize_failures",
            "Requests of a precise pool that could not be tokenized (routed approximately)",
            ["pool"], registry=r,
        )  # fmt: skip
