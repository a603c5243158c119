"""How many client connections one proxy process keeps open at once.

Rules:
- Up to the cap, connections are served as usual. Past it, a grace of a few more (``grace``)
  are let in, each to be answered one request and closed (the proxy's probes still answered, a
  proxied request refused): a client is told why, and an orchestrator's probes still reach the
  proxy. Past cap and grace together, a connection is closed as soon as it is accepted, so that
  a flood of connections holds no more descriptors than the cap and the grace.
- A configured ``server.max_connections`` is the cap as given.
- Unset, the cap comes from the process's open-files limit: a client connection that streams holds
  one engine connection too, so clients get half of what is left after a fixed reserve (listening
  sockets, logs, Redis, the scrape and KV-event connections of each engine) and the grace. At
  that cap, every client let in finds a descriptor for its engine connection; without it, a flood
  of idle connections made the proxy's next engine connection fail for want of descriptors, and
  requests already admitted with it (``upstream.proxy_short``).
- No limit on open files (``RLIM_INFINITY``) means no cap.
"""

from __future__ import annotations

# Descriptors kept back from clients and their engine connections: listeners, the event loop's
# own, log files, Redis, worker pipes.
RESERVE = 64
# Each engine's scrape connection and KV-event sockets (subscriber and replay).
PER_ENGINE = 3
# Never a smaller cap, however low the limit: a proxy that can serve a few clients should.
FLOOR = 16
# The grace past a cap of n: n / GRACE_SHARE, within these bounds.
GRACE_MIN = 4
GRACE_MAX = 256
GRACE_SHARE = 16


def grace(cap: int) -> int:
    """Connections let in past ``cap``, each for one request."""
    return max(GRACE_MIN, min(GRACE_MAX, cap // GRACE_SHARE))


def client_cap(configured: int | None, open_files: int | None, engines: int) -> int | None:
    """The cap on client connections, or None for none. ``open_files`` is the soft limit
    (None: unlimited)."""
    if configured is not None:
        return configured
    if open_files is None:
        return None
    spare = open_files - RESERVE - PER_ENGINE * engines
    # grace(cap) <= grace(spare) for any cap <= spare: the grace taken off here covers it.
    return max(FLOOR, (spare - grace(spare)) // 2)
