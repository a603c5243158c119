"""Routing decisions serialised through Redis: the shell around ``proxy.core.claims``.

Rules:
- Two hashes, one Redis Cluster slot (hash tag ``{claims}``): ``<prefix>{claims}:pending``,
  field ``<replica>|<engine>``: the prompt tokens that replica has claimed there (its requests
  without a first byte), and ``<prefix>{claims}:live``, field ``<replica>``: until when (ms of
  Redis's own clock) its claims count. A replica renews its entry every sharing round; one that
  dies stops counting ``sharing.ttl_s`` later, and the next script that sees it expired deletes
  its fields. Both keys expire ``4 * ttl_s`` after the last write.
- ``decide``: one EVALSHA of ``DECIDE`` (loaded once, reloaded on NOSCRIPT by redis-py's
  ``Script``); the request waits for it ``sharing.decision_timeout_s`` at most. On a timeout,
  Redis down or in back-off, or a reply out of bounds the caller uses its local decision (the
  spread included); every outcome counts in ``kvproxy_shared_decisions_total{outcome, reason}``
  and every call's round trip in ``kvproxy_shared_decision_seconds``.
- A call the request stopped waiting for runs on (shielded, under the link's own
  ``op_timeout_s``; the calls are owned and cancelled on shutdown): cancelling it would close its
  connection (redis-py cannot reuse a connection with an answer half read), and the next call
  would pay a new connection, which on a busy host starts a cascade of timeouts. Its answer still
  reaches the ledger, so the claim it made is known and the next round moves it to where the
  request went. Only a call that fails leaves the ledger unsure. A decision's timeout is no Redis
  failure and starts no back-off; an error or the link's own timeout does.
- The caller asks only while a peer is live (``engaged``): one replica alone, or sharing off, or
  sharing over the workers' hub, makes no Redis call on the request path.
- ``refresh`` (every sharing round, off the request path): renews the live entry and moves the
  claims to this replica's prefill backlogs (``ClaimLedger``), deleting expired replicas' fields
  for every engine it knows.
- The store's contents are hostile: the scripts ignore what ``claims.amount`` ignores, treat a
  live entry that is not a number or lies further ahead than ``4 * ttl`` as not live, and refuse
  (``[0]``) a live hash of more than ``MAX_LIVE`` entries rather than read it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from proxy.core.claims import MAX_TEXT, MAX_TOKENS, Claimable, ClaimLedger, Writes, parse_reply
from proxy.core.sharing import Backlog
from proxy.tenancy.redis_link import RedisClient, RedisLink, RedisUnavailable

MAX_LIVE = 64
# Loop passes a decision past its deadline may take to read an answer already received.
_GRACE_PASSES = 4

_AMOUNT = f"""
local function amount(v)
  if type(v) ~= 'string' or #v > {MAX_TEXT} then return nil end
  local x = tonumber(v)
  if x == nil or x ~= x or x < 0 or x > {MAX_TOKENS:.0f} then return nil end
  return x
end
local function stamp(v)
  if type(v) ~= 'string' or #v > {MAX_TEXT} then return nil end
  local x = tonumber(v)
  if x == nil or x ~= x then return nil end
  return x
end
local replica, ttl, max_live = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Both keys are hashes of the replicas' own writing: one of another type is not state any
-- replica wrote (and would fail every call, or be kept alive by them); it goes, as if expired.
for _, k in ipairs(KEYS) do
  local kind = redis.call('TYPE', k)['ok']
  if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', k) end
end
-- Other replicas: live ones, and dead ones (expired or unreadable) to clean up.
local function replicas()
  local peers, dead = {{}}, {{}}
  local flat = redis.call('HGETALL', KEYS[2])
  for i = 1, #flat, 2 do
    local r = flat[i]
    if r ~= replica then
      local exp = stamp(flat[i + 1])
      if exp ~= nil and exp > now and exp <= now + 4 * ttl then peers[#peers + 1] = r
      elseif exp == nil or exp <= now then dead[#dead + 1] = r end
    end
  end
  return peers, dead
end
local function bury(dead, engines)
  for _, r in ipairs(dead) do
    redis.call('HDEL', KEYS[2], r)
    for _, e in ipairs(engines) do redis.call('HDEL', KEYS[1], r .. '|' .. e) end
  end
end
local function keep()
  redis.call('HSET', KEYS[2], replica, now + ttl)
  redis.call('PEXPIRE', KEYS[1], 4 * ttl)
  redis.call('PEXPIRE', KEYS[2], 4 * ttl)
end
local function store(field, value)
  if value > 0 then redis.call('HSET', KEYS[1], field, string.format('%.17g', value))
  else redis.call('HDEL', KEYS[1], field) end
end
"""

# ARGV: replica, ttl_ms, max_live, tolerance, n, then n x (engine, cost, slope, held, tokens,
# claimed). Reply: {1, pick index from 0, others' tokens at the pick, live peers} or {0}.
DECIDE = _AMOUNT + """
if redis.call('HLEN', KEYS[2]) > max_live then return {0} end
local tol, n = tonumber(ARGV[4]), tonumber(ARGV[5])
local peers, dead = replicas()
local totals, held, others, engines = {}, {}, {}, {}
for c = 1, n do
  local b = 6 + (c - 1) * 6
  local engine = ARGV[b]
  engines[c] = engine
  local fields = {replica .. '|' .. engine}
  for _, r in ipairs(peers) do fields[#fields + 1] = r .. '|' .. engine end
  local vals = redis.call('HMGET', KEYS[1], unpack(fields))
  local sum = (amount(vals[1]) or 0) - tonumber(ARGV[b + 5])
  if sum < 0 then sum = 0 end
  for i = 2, #vals do sum = sum + (amount(vals[i]) or 0) end
  others[c] = sum
  totals[c] = tonumber(ARGV[b + 1]) + tonumber(ARGV[b + 2]) * sum
  held[c] = tonumber(ARGV[b + 3])
end
local best = totals[1]
for c = 2, n do if totals[c] < best then best = totals[c] end end
local pick = nil
for c = 1, n do
  if totals[c] <= best + math.abs(best) * tol then
    if pick == nil or held[c] > held[pick] or (held[c] == held[pick] and totals[c] < totals[pick])
    then pick = c end
  end
end
local field = replica .. '|' .. engines[pick]
local mine = amount(redis.call('HGET', KEYS[1], field)) or 0
store(field, mine + tonumber(ARGV[6 + (pick - 1) * 6 + 4]))
bury(dead, engines)
keep()
return {1, pick - 1, tostring(others[pick]), #peers}
"""

# ARGV: replica, ttl_ms, max_live, absolute (1 or 0), n, then n x (engine, value).
REFRESH = _AMOUNT + """
local absolute, n = ARGV[4] == '1', tonumber(ARGV[5])
local engines = {}
for c = 1, n do
  local engine, value = ARGV[4 + 2 * c], tonumber(ARGV[5 + 2 * c])
  engines[c] = engine
  local field = replica .. '|' .. engine
  if absolute then store(field, value)
  elseif value ~= 0 then store(field, (amount(redis.call('HGET', KEYS[1], field)) or 0) + value)
  end
end
if redis.call('HLEN', KEYS[2]) <= max_live then
  local _, dead = replicas()
  bury(dead, engines)
end
keep()
return 1
"""


class HasBacklog(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def backlog(self) -> Backlog: ...


@dataclass
class _Waiter:
    """Whether the request that asked for a decision has stopped waiting for it."""

    gone: bool = False


class DecisionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "kvproxy_shared_decisions",
            "Routing decisions while other proxy processes are live: made in Redis (shared) or "
            "locally, and why", ["outcome", "reason"], registry=registry,
        )  # fmt: skip
        self.seconds = Histogram(
            "kvproxy_shared_decision_seconds",
            "Round trip of one routing decision serialised through Redis",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
            registry=registry,
        )  # fmt: skip


class SharedDecider:
    """Serialises this replica's routing decisions with the others' through Redis."""

    def __init__(
        self,
        link: RedisLink,
        *,
        ttl_s: float,
        timeout_s: float,
        tolerance: float,
        registry: CollectorRegistry,
        replica: str,
        peers: Callable[[], int] = lambda: 0,
    ) -> None:
        self._link = link
        self._keys = [link.key("{claims}", "pending"), link.key("{claims}", "live")]
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self._tolerance = tolerance
        self.replica = replica
        self.peers = peers
        self.ledger = ClaimLedger()
        self.metrics = DecisionMetrics(registry)
        self._decide = link.client.register_script(DECIDE)
        self._refresh = link.client.register_script(REFRESH)
        self._calls: set[asyncio.Task[int | None]] = set()

    def engaged(self) -> bool:
        """Whether a decision should go through Redis: only while another process is live."""
        return self.peers() > 0

    async def decide(self, cands: Sequence[Claimable]) -> int | None:
        """The index of the pick among ``cands``, claimed in Redis; None: decide locally."""
        # The ledger is read now, with the costs the caller has just computed: by the time the
        # call's task starts, an earlier decision's answer may have moved it (and its request
        # into the local backlog those costs did not see).
        args: list[Any] = [self.replica, self._ttl_ms, MAX_LIVE, repr(self._tolerance), len(cands)]
        for c in cands:
            args += [c.name, repr(c.cost_s), repr(c.slope_s), repr(c.held), repr(c.tokens),
                     repr(self.ledger.at(c.name))]
        self.ledger.outstanding += 1
        waiter = _Waiter()
        call = asyncio.create_task(self._call(cands, args, waiter),
                                   name="kvproxy-shared-decision")
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        try:
            pick = await self._wait(call)
        except TimeoutError:
            waiter.gone = True  # from now on the call records its own claim
            self._local("timeout")
            return None
        except RedisUnavailable as exc:
            self._local(exc.kind if exc.kind != "error" else "redis_error")
            return None
        if pick is None:
            self._local("bad_state")
            return None
        # Recorded here, where the caller dispatches the request in the same step: another
        # decision never sees the claim in the ledger without the request in the backlog.
        self.ledger.granted(cands[pick].name, cands[pick].tokens)
        self.metrics.decisions.labels("shared", "").inc()
        return pick

    async def _wait(self, call: asyncio.Task[int | None]) -> int | None:
        """``call``'s answer, waiting ``timeout_s`` at most (``TimeoutError``). Shielded: a late
        answer still lands, keeping the connection and the ledger. At the deadline the loop gets
        a few passes to read an answer already received: an event loop that lags (a burst of
        requests being parsed) runs its timers before it polls the sockets, so without them the
        loop's own lag would pass for Redis being slow."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.shield(call)
        except TimeoutError:
            for _ in range(_GRACE_PASSES):
                if call.done():
                    return call.result()
                await asyncio.sleep(0)
            if call.done():  # the caller marks the call abandoned in this same step
                return call.result()
            raise

    async def _call(self, cands: Sequence[Claimable], args: list[Any],
                    waiter: _Waiter) -> int | None:
        """One script call under the link's own timeout; the ledger learns its claim even when
        the request that asked has stopped waiting (the next round moves it where it went)."""
        keys = self._keys

        async def run(r: RedisClient) -> object:
            return await self._decide(keys=keys, args=args, client=r)

        started = time.perf_counter()
        try:
            raw = await self._link.run("shared_decision", run)
        except RedisUnavailable as exc:
            if exc.kind != "backoff":
                self.ledger.lost()  # the claim may have been made
            raise
        finally:
            self.ledger.outstanding -= 1
            self.metrics.seconds.observe(time.perf_counter() - started)
        pick = parse_reply(raw, len(cands))
        if pick is not None and waiter.gone:
            self.ledger.granted(cands[pick].name, cands[pick].tokens)
        return pick

    async def close(self) -> None:
        """Cancel the calls still under way (shutdown)."""
        calls = list(self._calls)
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    def _local(self, reason: str) -> None:
        self.metrics.decisions.labels("local", reason).inc()

    async def refresh(self, engines: Iterable[HasBacklog]) -> None:
        """One round: renew this replica's live entry, move its claims to its backlogs."""
        backlog = {e.name: e.backlog.tokens for e in engines}
        writes = self.ledger.plan(backlog)
        names = sorted(set(backlog) | set(writes.values))
        args: list[Any] = [self.replica, self._ttl_ms, MAX_LIVE, int(writes.absolute), len(names)]
        for name in names:
            args += [name, repr(writes.values.get(name, 0.0))]
        keys = self._keys

        async def call(r: RedisClient) -> object:
            return await self._refresh(keys=keys, args=args, client=r)

        try:
            await self._link.run("shared_decision_refresh", call)
        except RedisUnavailable as exc:
            if exc.kind != "backoff":
                self.ledger.lost()
            return
        self.ledger.applied(_only(writes, names))


def _only(writes: Writes, names: Sequence[str]) -> Writes:
    """In absolute mode every listed engine was set (0 for those without a figure)."""
    if not writes.absolute:
        return writes
    return Writes(True, {n: writes.values.get(n, 0.0) for n in names})
