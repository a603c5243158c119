"""A client that retries a refused request the way the OpenAI SDKs do.

Real chat clients do not give up on the first 503: the OpenAI SDKs (Python and Node) retry 408,
409, 429 and 5xx answers a bounded number of times, waiting what ``Retry-After`` says. A benchmark
of admission control whose clients never retry counts every deferred request as lost, which
flatters whichever arm sheds least; one whose clients retry without bound never loses anything.
This module sits between the two, as the SDKs do.

Rules:
- Only a refusal is retried: 503 (shed) and 429 (rate limited), answered before any work was done.
  A request that reached an engine (200, or an error after it started) is never sent twice, so a
  retry never duplicates generated tokens.
- At most ``max_retries`` retries (the SDKs' default: 2, i.e. three attempts); a request still
  refused after them is lost, and its record is the last refusal.
- The wait before retry *n* (0-based) is the answer's ``Retry-After`` when that is a number of
  seconds in (0, 60]; otherwise 0.5 s x 2^n, at most 8 s, less up to 25 % of jitter (the SDKs'
  rule). The jitter comes from a generator seeded per request, so that a run is reproducible.
- The record returned is the last attempt's with its times counted from the *first* send: the
  TTFT a user sees includes the time spent waiting to retry. ``retries`` says how many were made.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping

import aiohttp

from bench.loadgen import Endpoint, send_one
from bench.stats import RequestRecord

RETRIED_STATUSES = frozenset({429, 503})
MAX_RETRY_AFTER_S = 60.0
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


def retry_delay(attempt: int, retry_after_s: float | None, rng: random.Random) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based)."""
    if retry_after_s is not None and 0.0 < retry_after_s <= MAX_RETRY_AFTER_S:
        return retry_after_s
    backoff = min(INITIAL_BACKOFF_S * 2.0**attempt, MAX_BACKOFF_S)
    return backoff * (1.0 - 0.25 * rng.random())


async def send_retrying(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    body: bytes,
    *,
    index: int,
    run_start: float,
    max_retries: int,
    seed: object,
    timeout_s: float = 600.0,
    headers: Mapping[str, str] | None = None,
) -> RequestRecord:
    """Send ``body``, retrying refusals as described in the module docstring."""
    rng = random.Random(f"{seed}-{index}")
    first = time.perf_counter()
    attempt = 0
    while True:
        rec = await send_one(session, endpoint, body, index=index, run_start=run_start,
                             timeout_s=timeout_s, headers=headers)
        if rec.status not in RETRIED_STATUSES or attempt >= max_retries:
            return _from_first_send(rec, first, run_start, attempt)
        await asyncio.sleep(retry_delay(attempt, rec.retry_after_s, rng))
        attempt += 1


def _from_first_send(rec: RequestRecord, first: float, run_start: float,
                     retries: int) -> RequestRecord:
    waited = (run_start + rec.sent_at) - first  # from the first send to this attempt's
    rec.sent_at = first - run_start
    if rec.ttft is not None:
        rec.ttft += waited
    if rec.e2e is not None:
        rec.e2e += waited
    rec.retries = retries
    return rec
