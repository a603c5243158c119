"""How many client connections one proxy process keeps open at once.

Rules:
- A configured ``server.max_connections`` is the cap as given.
- Unset, the cap comes from the process's open-files limit: a client connection that streams holds
  one engine connection too, so clients get half of what is left after a fixed reserve (listening
  sockets, logs, Redis, the scrape and KV-event connections of each engine). At that cap a flood
  of client connections is answered 503 before the proxy lacks a descriptor for an engine
  connection, where every request already admitted would fail (``upstream.proxy_short``).
- No limit on open files (``RLIM_INFINITY``) means no cap.
"""

from __future__ import annotations

# Descriptors kept back from clients and their engine connections: listeners, the event loop's
# own, log files, Redis, worker pipes.
RESERVE = 64
# Each engine's scrape connection and KV-event sockets (subscriber and replay).
PER_ENGINE = 3
# A cap below this would refuse an ordinary test client's pool; a limit that low is refused
# here rather than serving a handful of clients.
FLOOR = 16


def client_cap(configured: int | None, open_files: int | None, engines: int) -> int | None:
    """The cap on client connections, or None for none. ``open_files`` is the soft limit
    (None: unlimited)."""
    if configured is not None:
        return configured
    if open_files is None:
        return None
    spare = open_files - RESERVE - PER_ENGINE * engines
    return max(FLOOR, spare // 2)
