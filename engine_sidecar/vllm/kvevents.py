"""KV-cache events of a sidecar's vLLM: the profile's settings and the command-line flags.

Rules:
- Off by default. ``kv_events = true`` in ``[engine]`` makes vLLM publish ``BlockStored``,
  ``BlockRemoved`` and ``AllBlocksCleared`` over ZMQ: the sidecar passes ``--kv-events-config``
  (JSON of vLLM's ``KVEventsConfig``) and ``--prefix-caching-hash-algo sha256_cbor``, the one
  algorithm whose block hashes a router can recompute from token ids without vLLM's Python (CBOR
  is language-neutral, and its seed is fixed).
- For the same reason the hash seed must be vLLM's default: a ``PYTHONHASHSEED`` inherited by the
  sidecar is not passed on to vLLM while events are on (one set in the profile's ``env`` is, on
  purpose).
- Endpoints follow vLLM's rule: one with ``*`` or ``::`` is bound (``tcp://*:5557``), one naming a
  host is connected to (the subscriber binds). The advertised endpoint replaces a wildcard host by
  the host the proxy reaches the engine at. Pure: no sockets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

HASH_ALGO = "sha256_cbor"
HASH_SEED_ENV = "PYTHONHASHSEED"
_SCHEMES = ("tcp://", "ipc://")


@dataclass(frozen=True)
class KvEventsProfile:
    """``kv_events*`` fields of ``[engine]``."""

    enabled: bool = False
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int | None = None

    def validate(self) -> str | None:
        """The dotted field that is wrong, with why, or ``None``."""
        for name, value in (("kv_events_endpoint", self.endpoint),
                            ("kv_events_replay_endpoint", self.replay_endpoint)):
            if value is not None and not _valid_endpoint(value):
                return f"engine.{name}: must be tcp://HOST:PORT or ipc://PATH"
        if self.buffer_steps is not None and self.buffer_steps < 1:
            return "engine.kv_events_buffer_steps: must be >= 1"
        return None


def _valid_endpoint(endpoint: str) -> bool:
    if not endpoint.startswith(_SCHEMES):
        return False
    if endpoint.startswith("ipc://"):
        return len(endpoint) > len("ipc://")
    port = endpoint.rpartition(":")[2]
    return port.isdigit() and 0 < int(port) <= 65535


def kv_events_args(events: KvEventsProfile) -> list[str]:
    """The vLLM flags for ``events`` (none when off)."""
    if not events.enabled:
        return []
    config: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": events.endpoint, "topic": events.topic}
    if events.replay_endpoint is not None:
        config["replay_endpoint"] = events.replay_endpoint
    if events.buffer_steps is not None:
        config["buffer_steps"] = events.buffer_steps
    return ["--kv-events-config", json.dumps(config, sort_keys=True, separators=(",", ":")),
            "--prefix-caching-hash-algo", HASH_ALGO]


def kv_events_env(events: KvEventsProfile, env: dict[str, str], profile_env: Mapping[str, str]
                  ) -> None:
    """Keep vLLM's block-hash seed at its default unless the profile sets one itself."""
    if events.enabled and HASH_SEED_ENV not in profile_env:
        env.pop(HASH_SEED_ENV, None)


def advertised(endpoint: str, host: str) -> str:
    """``endpoint`` as a subscriber elsewhere reaches it: a wildcard host becomes ``host``."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    addr, _, port = endpoint[len("tcp://"):].rpartition(":")
    if addr in ("*", "0.0.0.0", "[::]", "::", ""):
        addr = f"[{host}]" if ":" in host else host
    return f"tcp://{addr}:{port}"


def describe_kv_events(events: KvEventsProfile, host: str) -> dict[str, object]:
    """What the sidecar advertises so a router can subscribe (``/ready`` and the registry)."""
    if not events.enabled:
        return {"kv_events": None}
    replay = events.replay_endpoint
    return {"kv_events": {
        "endpoint": advertised(events.endpoint, host),
        # "connect": vLLM connects to a subscriber bound at the endpoint; "bind": subscribe to it.
        "mode": "bind" if "*" in events.endpoint or "::" in events.endpoint
        or events.endpoint.startswith("ipc://") else "connect",
        "replay_endpoint": advertised(replay, host) if replay else None,
        "topic": events.topic, "hash_algo": HASH_ALGO,
    }}
