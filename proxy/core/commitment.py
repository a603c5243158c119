"""KV commitments: the KV blocks this proxy's in-flight requests will still take on an engine.

An engine admits a request on its prompt's blocks; the blocks of its answer are taken one by one
while it decodes. A burst admitted at low KV usage therefore fills the cache only later, after
every figure the engine reports. The proxy knows what it sent: this module books, per engine, what
each request it has in flight there still owes, so the guard sees a burst's KV at dispatch.

Rules:
- A request owes its prompt blocks until its first byte (the engine has computed the prompt by
  then; afterwards they are in the engine's reported usage), plus the blocks of the output still to
  come: its expected length minus what it has produced, never below zero.
- Expected length = the request's ``max_tokens`` (or ``max_completion_tokens``) capped by the
  pool's expected answer length: the mean completion tokens of the last ``output_window`` answers
  (from ``usage``), or ``prior_output_tokens`` until ``output_min_samples`` answers are known.
  The mean, not a high quantile: the guard compares a *sum* over many requests with the capacity,
  and the sum's best estimate is the number of requests times the mean; the thresholds' headroom
  absorbs its spread, the growth and preemption signals catch the rest.
- Produced so far is counted without parsing the stream: bytes relayed divided by the pool's
  bytes per output token, learned from answers that carried ``usage``; unknown until then (0
  produced: the commitment errs on the safe side). A non-streamed answer produces nothing visible
  before it ends, so it owes its whole expected output until then.
- Learning happens once per answer, at its end, from the last bytes relayed (a bounded tail);
  nothing on the relay's hot path besides adding a chunk's length to a counter.
- The relay counts ``relayed`` straight into a flight (its hot path); nothing is produced before
  the first byte, so a flight's prompt and output count at their full size until then whatever it
  says. A flight's ``prompt_tokens`` and ``output_tokens`` are fixed once dispatched.
- ``owed_blocks`` is asked per engine on every admission: the flights not answered yet owe a sum
  that changes only on dispatch, first byte and settle, kept as a running total in exact integer
  arithmetic (floats scaled by 2**1074, so adding and taking away never drift: the total equals
  a fresh exact re-sum after any sequence of operations); only answered flights, whose relayed
  bytes grow outside this module, are summed, and not on every call: asked with the time, the
  answered flights' sum is kept for ``ANSWERED_REFRESH_S`` and re-summed after that, with the
  pool's bytes per token of that moment (it moves with every answer; a sum per change would be a
  sum per answer). Between two sums it is an upper bound of a sum at that bytes-per-token figure:
  a flight's owed output only shrinks as its bytes are relayed, one answered since is added at its
  owed then, one settled since is taken off at its owed now. So the guard errs on the safe side by
  at most what the engine's answers produced in that time, and admission stops summing every open
  stream of the pool on every request (at 1,000 open streams that sum was the proxy's largest
  own cost).
  Asked without the time, the sum is fresh and exact.
- Pure bookkeeping: no clock, no I/O. Projection is a function of (reported usage, what is owed,
  capacity); with the capacity or block size unknown there is no commitment signal (None).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from proxy.core.config import PressureConfig

# Answers shorter than this many bytes per token, or longer, are not SSE as vLLM writes it.
_BYTES_PER_TOKEN_RANGE = (4.0, 4096.0)
# How long the answered flights' summed output is kept. The sum is added to reported usage that is
# a scrape interval old (200 ms by default): 50 ms of decoding more counts a few blocks per engine,
# against capacities of thousands.
ANSWERED_REFRESH_S = 0.05


@dataclass
class Flight:
    """One request in flight on one engine; ``relayed`` grows as its answer is relayed."""

    prompt_tokens: float  # of the prompt the engine does not hold yet
    output_tokens: float  # expected total output
    answered: bool = False  # first byte seen: the prompt is computed
    relayed: int = 0  # bytes of the answer relayed to the client so far


class OutputEstimate:
    """A pool's expected answer length and bytes per output token, learned from its answers."""

    def __init__(self, cfg: PressureConfig) -> None:
        self._cfg = cfg
        self._window: deque[int] = deque(maxlen=cfg.output_window)
        self._sum = 0
        self.bytes_per_token: float | None = None

    @property
    def samples(self) -> int:
        return len(self._window)

    def mean(self) -> float:
        """The expected answer length of this pool, in tokens."""
        if len(self._window) < self._cfg.output_min_samples:
            return float(self._cfg.prior_output_tokens)
        return self._sum / len(self._window)

    def expected(self, max_tokens: int | None) -> float:
        """The output a request with this ``max_tokens`` is expected to produce."""
        mean = self.mean()
        return mean if max_tokens is None else min(float(max_tokens), mean)

    def learn(self, tokens: int, relayed: int | None = None) -> None:
        """One finished answer: its completion tokens and, for a stream, the bytes relayed."""
        if tokens < 0:
            return
        if len(self._window) == self._window.maxlen:
            self._sum -= self._window[0]
        self._window.append(tokens)
        self._sum += tokens
        if relayed is not None and tokens > 0:
            ratio = relayed / tokens
            low, high = _BYTES_PER_TOKEN_RANGE
            if low <= ratio <= high:
                # Moving average over about 32 answers: framing depends on the model name, ids
                # and the client's stream options, all stable within a pool.
                old = self.bytes_per_token
                self.bytes_per_token = ratio if old is None else old + (ratio - old) / 32

    def learn_answer(
        self, tokens: int | None, size: int, *, streamed: bool, max_tokens: int | None = None
    ) -> None:
        """Learn from a complete answer of ``size`` bytes: its ``completion_tokens`` from usage
        when known, else (a stream) its size over the learned bytes per token. An engine's figure
        is believed only up to what the answer could hold: its size in bytes and ``max_tokens``."""
        from_usage = tokens is not None
        if tokens is None:
            if not (streamed and self.bytes_per_token):
                return
            tokens = int(size / self.bytes_per_token)
        bound = size if max_tokens is None else min(size, max_tokens)
        self.learn(min(tokens, bound), size if streamed and from_usage else None)


# Every finite float is an integer multiple of 2**-1074: scaled by this, sums of them are exact.
_SCALE = 1 << 1074


def exact(value: float) -> int:
    """``value`` scaled by ``_SCALE``, exactly (its denominator is a power of two)."""
    numerator, denominator = value.as_integer_ratio()
    return numerator * (_SCALE // denominator)


class Commitments:
    """The flights of one engine, by dispatch ticket: the unanswered ones' owed tokens as an
    exact running total, the answered ones apart (their relayed bytes change by themselves)."""

    def __init__(self, refresh_s: float = ANSWERED_REFRESH_S) -> None:
        self._waiting: dict[int, Flight] = {}  # dispatched, no first byte yet
        self._answered: dict[int, Flight] = {}
        self._waiting_owed = 0  # exact(prompt) + exact(output) over ``_waiting``
        self._refresh_s = refresh_s
        # The answered flights' owed tokens as summed at ``_kept_at`` with ``_kept_bpt``, kept up
        # to date by membership since (an upper bound of a sum at that figure now); None: not kept.
        self._kept: float | None = None
        self._kept_at = 0.0
        self._kept_bpt: float | None = None

    def __len__(self) -> int:
        return len(self._waiting) + len(self._answered)

    def dispatch(self, ticket: int, flight: Flight) -> Flight:
        self.settle(ticket)  # a ticket booked twice counts once, as the latest flight
        if flight.answered:
            self._answered[ticket] = flight
            self._keep_added(flight)
        else:
            self._waiting[ticket] = flight
            self._waiting_owed += _unanswered(flight)
        return flight

    def first_byte(self, ticket: int) -> None:
        flight = self._waiting.pop(ticket, None)
        if flight is not None:
            self._waiting_owed -= _unanswered(flight)
            flight.answered = True
            self._answered[ticket] = flight
            self._keep_added(flight)

    def settle(self, ticket: int) -> Flight | None:
        flight = self._waiting.pop(ticket, None)
        if flight is not None:
            self._waiting_owed -= _unanswered(flight)
            return flight
        flight = self._answered.pop(ticket, None)
        if flight is not None and self._kept is not None:
            # Its current owed: never more than it added to the kept sum, which stays a bound.
            self._kept = max(0.0, self._kept - owed_tokens(flight, self._kept_bpt))
        return flight

    def _keep_added(self, flight: Flight) -> None:
        if self._kept is not None:
            self._kept += owed_tokens(flight, self._kept_bpt)

    def relayed(self) -> dict[int, int]:
        """Bytes relayed so far of each answered flight, by ticket."""
        return {ticket: flight.relayed for ticket, flight in self._answered.items()}

    @property
    def waiting_owed(self) -> int:
        """The running total, scaled by ``_SCALE`` (for checking it against a fresh sum)."""
        return self._waiting_owed

    def owed_blocks(
        self, block_size: int, bytes_per_token: float | None, now: float | None = None
    ) -> float:
        """KV blocks the flights will still take on the engine beyond what it holds now: exact
        without ``now``; with it, the answered flights' part as kept for ``refresh_s`` (an upper
        bound, see the module's rules)."""
        waiting = self._waiting_owed / _SCALE  # int / int: rounded once, correctly
        if now is None:
            return self._plus_answered(waiting, bytes_per_token) / block_size
        kept = self._kept
        if kept is None or not 0.0 <= now - self._kept_at < self._refresh_s:
            kept = self._kept = self._plus_answered(0.0, bytes_per_token)
            self._kept_at, self._kept_bpt = now, bytes_per_token
        return (waiting + kept) / block_size

    def _plus_answered(self, tokens: float, bytes_per_token: float | None) -> float:
        """``tokens`` plus every answered flight's owed tokens, summed now."""
        # ``owed_tokens`` of each answered flight, inlined: admission reads this for every engine
        # of the pool on every request, and a call per flight was most of its cost. The same
        # float operations in the same order, so the same total to the last bit. A flight owing
        # nothing is skipped rather than added as ``max(0.0, left)``: adding 0.0 to a sum that is
        # never -0.0 leaves it as it is, a NaN ``left`` is skipped as ``max`` dropped it, and a
        # builtin call per flight was a third of the loop.
        divisor = bytes_per_token or None
        for f in self._answered.values():
            left = f.output_tokens - (f.relayed / divisor if divisor else 0.0)
            if left > 0.0:
                tokens += left
        return tokens


def _unanswered(flight: Flight) -> int:
    # Finite by construction: an estimated prompt size and min(max_tokens, a mean of counts).
    return exact(flight.prompt_tokens) + exact(max(0.0, flight.output_tokens))


def owed_tokens(flight: Flight, bytes_per_token: float | None) -> float:
    """One flight's remaining tokens: prompt until answered, plus the output still to come."""
    if not flight.answered:
        return flight.prompt_tokens + max(0.0, flight.output_tokens)  # none produced before it
    produced = flight.relayed / bytes_per_token if bytes_per_token else 0.0
    return max(0.0, flight.output_tokens - produced)


def owed(flight: Flight, block_size: int, bytes_per_token: float | None) -> float:
    """One flight's remaining blocks."""
    return owed_tokens(flight, bytes_per_token) / block_size


def projected_usage(
    kv_usage: float, owed: float, block_size: int | None, num_gpu_blocks: int | None
) -> float | None:
    """Reported usage plus what is owed, as a fraction of capacity; None when capacity unknown."""
    if not block_size or not num_gpu_blocks or num_gpu_blocks <= 0:
        return None
    return kv_usage + owed / num_gpu_blocks


