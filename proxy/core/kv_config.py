"""Settings of precise routing: where each engine publishes its KV events, and how the proxy
listens to them.

Rules:
- An engine's ``kv_events`` table names its publisher as vLLM's ``--kv-events-config`` does:
  ``endpoint`` (PUB) and optionally ``replay_endpoint`` (ROUTER), ``tcp://HOST:PORT`` or
  ``ipc://PATH``. By default the proxy connects to them (vLLM binds a wildcard endpoint such as
  ``tcp://*:5557``); ``bind = true`` makes the proxy bind ``endpoint`` instead, for an engine
  configured to connect to the proxy (then only one proxy can listen). A data-parallel engine
  publishes one port per rank: ``ranks = N`` listens on the endpoint's port + 0..N-1 (and the replay
  port + 0..N-1), as vLLM offsets them.
- The ``[kv_events]`` section tunes the listening for all engines; its bounds keep memory and
  time finite whatever an engine sends.
- Validation names the field (``pools[0].engines[1].kv_events.endpoint``): a malformed endpoint
  is a start-up error; one that refuses at run time is a fallback (``proxy.fleet.kvevents``).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.core.config_checks import require as _require

_SCHEMES = ("tcp://", "ipc://")


def endpoint_problem(endpoint: str, *, bind: bool) -> str | None:
    """Why ``endpoint`` cannot be used (None: it can)."""
    if not endpoint.startswith(_SCHEMES):
        return "must start with tcp:// or ipc://"
    if endpoint.startswith("ipc://"):
        return None if len(endpoint) > len("ipc://") else "must name a path after ipc://"
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
        return "must look like tcp://HOST:PORT with a port in 1..65535"
    if "*" in host and not bind:
        return "names a wildcard host: give the engine's address (or set bind = true)"
    return None


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank ``rank``: the TCP port moved up by ``rank``, an IPC path
    suffixed ``_dp<rank>`` (vLLM's offsets)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


@dataclass(frozen=True)
class EngineEvents:
    """One engine's KV-event publisher (``pools[].engines[].kv_events``)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False
    ranks: int = 1

    def __post_init__(self) -> None:
        problem = endpoint_problem(self.endpoint, bind=self.bind)
        _require(problem is None, "endpoint", problem or "")
        if self.replay_endpoint is not None:
            problem = endpoint_problem(self.replay_endpoint, bind=False)
            _require(problem is None, "replay_endpoint", problem or "")
        _require(1 <= self.ranks <= 64, "ranks", "must be in 1..64")
        top = self.endpoint.rpartition(":")[2]
        _require(not self.endpoint.startswith("tcp://") or int(top) + self.ranks - 1 <= 65535,
                 "ranks", "moves the port past 65535")
        _require(len(self.topic) <= 256, "topic", "must be at most 256 characters")

    def endpoints(self) -> list[tuple[str, str | None]]:
        """(endpoint, replay endpoint) of every rank, rank 0 first."""
        replay = self.replay_endpoint
        return [(rank_endpoint(self.endpoint, r), None if replay is None else
                 rank_endpoint(replay, r)) for r in range(self.ranks)]


@dataclass(frozen=True)
class KvEventsConfig:
    """How the proxy listens to KV events (``[kv_events]``)."""

    # Blocks remembered per engine (each about 100 bytes); beyond it the oldest stored go first,
    # so the index can only under-state what an engine holds, never over-state it.
    max_blocks_per_engine: int = 262_144
    # A message larger than this is dropped by the socket (vLLM's batches are kilobytes).
    max_message_bytes: int = 16 * 1024 * 1024
    # Events in one batch, hashes in one event: more is a bad batch, dropped whole (and so is a
    # batch with more hashes in all than ``max_blocks_per_engine``).
    max_events_per_batch: int = 65_536
    max_hashes_per_event: int = 65_536
    # A replay must answer within this, or the gap is given up on (the index restarts empty).
    replay_timeout_s: float = 2.0
    # An engine the proxy sent new prompt blocks to that has published nothing for this long
    # has fallen silent: it is routed from the approximate index until it publishes again.
    silent_after_s: float = 10.0
    # How long a dispatch counts as holding the prompt's blocks before the engine reports them
    # (so a burst sharing a new prefix follows its first request).
    provisional_s: float = 5.0
    # The longest prompt prefix hashed for matching, in blocks.
    max_prompt_blocks: int = 4096
    # The ZMQ receive high-water mark: batches queued in the socket before it drops (a drop is a
    # gap, filled by replay). An engine publishes a batch a step, tens a second: this is minutes
    # of them, and bounds what a publisher can make the proxy queue.
    rcvhwm: int = 10_000

    def __post_init__(self) -> None:
        for name in ("max_blocks_per_engine", "max_events_per_batch", "max_hashes_per_event",
                     "max_prompt_blocks", "rcvhwm"):
            _require(getattr(self, name) >= 1, name, "must be >= 1")
        _require(self.max_message_bytes >= 1024, "max_message_bytes", "must be >= 1024")
        for name in ("replay_timeout_s", "silent_after_s"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(self.provisional_s >= 0, "provisional_s", "must be >= 0")
