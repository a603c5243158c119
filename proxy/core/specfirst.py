"""Speculative-first decisions: which requests may be drafted, how a draft chunk is verified, how
the answer grows round by round, and when a tenant's traffic stops being drafted.

Rules:
- **Exact for greedy.** A draft chunk is checked against the target's ``prompt_logprobs`` (top-1
  per position) for ``prompt + answer so far + chunk``: the chunk is kept up to the first position
  where the target's top-1 differs, and there the target's own token is taken. If every drafted
  token is kept, the token the target generated after the chunk is appended. Every token of the
  answer is therefore the target's greedy token for the context before it.
- **Ends of answers are the target's.** A token ends the answer only if the *target* stops on it
  (``TokenFacts``: the configured ``eos_token_ids`` and what the target's own finish reasons
  showed, never the draft's). The token that closes a round (the target's correction, its bonus
  token, or the token the draft stopped on) is asked of the target when its role is unknown
  (``Step.ask``). A kept drafted token the draft went on after is taken to go on unless it is a
  known stop: draft and target share a tokenizer and so its EOS; a stop id that only the
  target's generation config adds must be listed in ``eos_token_ids``.
- **Approximate for sampling** (``temperature_policy = "approximate"``): the speculative-sampling
  test on the top-k log-probabilities both engines return; tokens outside the target's top-k count
  as probability 0. It is documented as approximate and never used unless configured.
- **Only what verification can vouch for is drafted** (``eligibility``): anything that changes the
  target's token choice beyond the prompt (penalties, biases, grammars, tools), asks for more than
  one answer or for log-probabilities, or stops on strings goes to the target unchanged.
- **History**: per (tenant, alias), the per-token agreement over the last rounds; above the
  configured rejection rate the key is served target-only for ``retry_s``, then drafted again and
  judged afresh. The chunk shrinks with agreement (a long chunk only wastes draft time when the
  first token is usually wrong).
- **Verification that reads the target's prefix cache** (``cached_covers``): vLLM computes no
  logits for positions its prefix cache supplied, so a prompt log-probability is trusted only
  where the engine says it computed the position before it (entry ``j`` needs position ``j - 1``);
  otherwise the round is verified again without the cache.
- Pure: no I/O, the clock and the random source are passed in.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.core.errors import UpstreamError

# Fields of a request that leave the target's next-token choice a function of the context alone
# (or only say how the answer is delivered): with nothing else present, drafting is exact.
_DRAFTABLE = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "user",
    "priority", "timeout", "cache_salt", "skip_special_tokens", "metadata", "store",
    "add_generation_prompt", "chat_template_kwargs", "echo", "logprobs", "top_logprobs",
})
# Request fields whose *default* value is harmless.
_NEUTRAL = {"n": (None, 1), "echo": (None, False), "logprobs": (None, False),
            "top_logprobs": (None, 0), "skip_special_tokens": (None, True)}
MAX_FACTS = 1 << 18  # token ids remembered per alias (a vocabulary is ~32k..256k)


@dataclass(frozen=True)
class Eligibility:
    """Whether a request may be drafted; ``reason`` names why not (a metrics label)."""

    draft: bool
    reason: str = ""
    sampled: bool = False  # temperature > 0: only under the approximate policy


def eligibility(body: Mapping[str, Any], *, approximate: bool) -> Eligibility:
    """Decide from the request body alone (the caller adds history and limits)."""
    for name in body:
        if name not in _DRAFTABLE:
            return Eligibility(False, f"field:{name}" if len(name) <= 40 else "field")
    if "stream_options" in body and body.get("stream") is not True:
        # The target refuses stream options without a stream: so must the alias (it serves the
        # request unchanged, and the engine's 400 reaches the client).
        return Eligibility(False, "stream_options")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        # Identity and type, not ==: logprobs = 0 (the chosen token's) is not logprobs = false.
        if not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
            return Eligibility(False, name)
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not isinstance(temperature, int | float) or temperature > 0:
        return Eligibility(approximate, "" if approximate else "temperature", sampled=True)
    return Eligibility(True)


# --- reading the engines' answers ----------------------------------------------------------------


def top1(entry: Mapping[str, Any] | None) -> int:
    """The rank-1 token of one ``prompt_logprobs`` / ``top_logprobs`` entry."""
    if not isinstance(entry, Mapping):
        raise UpstreamError("the target engine sent no prompt_logprobs for a drafted token")
    for key, info in entry.items():
        if isinstance(info, Mapping) and info.get("rank") == 1:
            return _token_id(key)
    raise UpstreamError("the target engine's prompt_logprobs have no rank-1 token")


def _token_id(key: object) -> int:
    try:
        value = int(str(key))
    except ValueError:
        raise UpstreamError("the target engine's prompt_logprobs name a bad token id") from None
    if value < 0:
        raise UpstreamError("the target engine's prompt_logprobs name a bad token id")
    return value


def distribution(entry: Mapping[str, Any] | None, temperature: float) -> dict[int, float]:
    """Probabilities over an entry's listed tokens at ``temperature``, renormalised over them
    (approximate: the unlisted tokens' mass is unknown)."""
    if not isinstance(entry, Mapping):
        return {}
    logits = {}
    for key, info in entry.items():
        if isinstance(info, Mapping) and isinstance(info.get("logprob"), int | float):
            logits[_token_id(key)] = float(info["logprob"]) / max(temperature, 1e-6)
    if not logits:
        return {}
    top = max(logits.values())
    weights = {t: math.exp(v - top) for t, v in logits.items()}
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


# --- verification ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """Draft tokens kept, and the target's token at the first disagreement (None: all kept)."""

    accepted: int
    correction: int | None


def verify_greedy(draft: Sequence[int], entries: Sequence[Mapping[str, Any] | None]) -> Verdict:
    """``entries``: the target's prompt logprobs at the drafted positions, in order."""
    if len(entries) != len(draft):
        raise UpstreamError("the target engine's prompt_logprobs do not cover the draft")
    for j, token in enumerate(draft):
        best = top1(entries[j])
        if best != token:
            return Verdict(j, best)
    return Verdict(len(draft), None)


def cached_covers(n_ids: int, n_draft: int, cached: int | None) -> bool:
    """Whether the prompt log-probabilities of the last ``n_draft`` of ``n_ids`` prompt tokens
    are computed when the engine read ``cached`` tokens from its prefix cache (None: it did not
    say, so nothing can be trusted)."""
    return cached is not None and 0 <= cached <= n_ids - n_draft - 1


def verify_sampled(
    draft: Sequence[int],
    draft_entries: Sequence[Mapping[str, Any] | None],
    target_entries: Sequence[Mapping[str, Any] | None],
    temperature: float,
    rng: random.Random,
) -> Verdict:
    """The speculative-sampling test (Leviathan et al. 2023; Chen et al. 2023) on top-k lists:
    keep token x with probability min(1, p_target(x) / p_draft(x)); at the first rejection draw
    from the residual max(0, p_target - p_draft). Approximate: only the listed tokens are known."""
    if len(target_entries) != len(draft) or len(draft_entries) != len(draft):
        raise UpstreamError("the engines' log-probabilities do not cover the draft")
    for j, token in enumerate(draft):
        p_t = distribution(target_entries[j], temperature)
        p_d = distribution(draft_entries[j], temperature)
        q = p_d.get(token, 0.0)
        if q > 0 and rng.random() < min(1.0, p_t.get(token, 0.0) / q):
            continue
        return Verdict(j, _residual_draw(p_t, p_d, rng))
    return Verdict(len(draft), None)


def _residual_draw(p_t: dict[int, float], p_d: dict[int, float], rng: random.Random) -> int:
    residual = {t: max(0.0, p - p_d.get(t, 0.0)) for t, p in p_t.items()}
    if sum(residual.values()) <= 0:
        residual = p_t
    if not residual:
        raise UpstreamError("the target engine sent no log-probabilities to sample from")
    tokens = sorted(residual)
    return rng.choices(tokens, weights=[residual[t] for t in tokens])[0]


# --- which tokens end an answer ------------------------------------------------------------------


@dataclass
class TokenFacts:
    """What the target is known to do at a token: stop (EOS) or go on. Learned only from the
    target's own answers (finish reasons) and the configured ``eos_token_ids``."""

    stops: set[int] = field(default_factory=set)
    goes_on: set[int] = field(default_factory=set)

    def stop(self, token: int) -> bool | None:
        if token in self.stops:
            return True
        return False if token in self.goes_on else None

    def learn(self, token: int, *, stopped: bool) -> None:
        if len(self.stops) + len(self.goes_on) >= MAX_FACTS:
            return
        (self.stops if stopped else self.goes_on).add(token)


# --- the answer, round by round ------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """One round's inputs: the draft's tokens and how it finished, the verdict, and the token the
    target generated after the whole chunk with its finish reason."""

    draft: tuple[int, ...]
    draft_finish: str
    verdict: Verdict
    bonus: int | None = None
    bonus_finish: str | None = None


@dataclass(frozen=True)
class Step:
    """What the answer gained: ``tokens``, of which the first ``from_draft`` were drafted (the
    rest are the target's), and either the finish reason, or ``ask``: a token whose role (stop or
    go on) the target must be asked about before it is appended (``settle``)."""

    tokens: tuple[int, ...]
    from_draft: int
    finish: str | None = None
    ask: int | None = None
    ask_drafted: bool = False


def advance(rnd: Round, facts: TokenFacts, remaining: int) -> Step:
    """Apply one verified round to an answer that may still grow by ``remaining`` tokens."""
    kept = rnd.draft[: rnd.verdict.accepted]
    stop = next((i for i, t in enumerate(kept) if t in facts.stops), None)
    if stop is not None:  # a kept token the target is known to stop on ends the answer there
        return Step(kept[: stop + 1], stop + 1, "stop")
    if rnd.verdict.correction is not None:
        return _close(kept, rnd.verdict.correction, False, facts, remaining)
    if rnd.draft_finish == "stop" and kept:
        # The draft stopped on its last token; whether the target stops there is the target's.
        return _close(kept[:-1], kept[-1], True, facts, remaining)
    if len(kept) >= remaining or rnd.bonus is None:
        done = "length" if len(kept) >= remaining else None
        return Step(kept[:remaining], min(len(kept), remaining), done)
    if rnd.bonus_finish in ("stop", "length"):
        facts.learn(rnd.bonus, stopped=rnd.bonus_finish == "stop")
    return _close(kept, rnd.bonus, False, facts, remaining)


def _close(kept: tuple[int, ...], last: int, drafted: bool, facts: TokenFacts,
           remaining: int) -> Step:
    """``kept`` (all drafted) then ``last``, whose role decides whether the answer ends."""
    role = facts.stop(last)
    step = Step(kept, len(kept), ask=last, ask_drafted=drafted)
    return step if role is None else settle(step, stopped=role, remaining=remaining)


def settle(step: Step, *, stopped: bool, remaining: int) -> Step:
    """Append ``step.ask``, whose role is now known; the answer ends if the target stops on it."""
    if step.ask is None:
        return step
    tokens = (*step.tokens, step.ask)
    from_draft = step.from_draft + int(step.ask_drafted)
    if stopped:
        return Step(tokens, from_draft, "stop")
    return Step(tokens, from_draft, "length" if len(tokens) >= remaining else None)


# --- per-tenant history --------------------------------------------------------------------------


@dataclass
class _Record:
    rounds: deque[tuple[int, int]]
    accepted: int = 0
    mismatches: int = 0
    fallback_until: float | None = None


@dataclass(frozen=True)
class HistoryConfig:
    window_rounds: int = 64
    min_tokens: int = 32  # drafted tokens judged before a key may fall back
    max_rejection: float = 0.6
    retry_s: float = 30.0
    min_chunk: int = 2
    max_chunk: int = 8
    max_keys: int = 10_000


class AcceptanceHistory:
    """Per (tenant, alias): agreement of the draft with the target, and the fallback state."""

    def __init__(self, cfg: HistoryConfig) -> None:
        self._cfg = cfg
        self._keys: OrderedDict[tuple[str, str], _Record] = OrderedDict()

    def _record(self, key: tuple[str, str]) -> _Record:
        rec = self._keys.get(key)
        if rec is None:
            rec = _Record(deque())
            self._keys[key] = rec
            if len(self._keys) > self._cfg.max_keys:
                self._keys.popitem(last=False)
        self._keys.move_to_end(key)
        return rec

    def agreement(self, key: tuple[str, str]) -> float | None:
        """Per-token agreement over the window: kept / (kept + disagreements)."""
        rec = self._keys.get(key)
        if rec is None or rec.accepted + rec.mismatches == 0:
            return None
        return rec.accepted / (rec.accepted + rec.mismatches)

    def drafting(self, key: tuple[str, str], now: float) -> bool:
        """Whether this key's next request is drafted (False while it is fallen back)."""
        rec = self._record(key)
        if rec.fallback_until is None:
            return True
        if now < rec.fallback_until:
            return False
        rec.fallback_until = None  # retry: judged afresh on new rounds
        return True

    def chunk(self, key: tuple[str, str]) -> int:
        """Draft tokens per round: about twice the expected run of agreeing tokens."""
        cfg = self._cfg
        p = self.agreement(key)
        if p is None:
            return cfg.max_chunk
        run = p / max(1e-6, 1.0 - p)
        return max(cfg.min_chunk, min(cfg.max_chunk, math.ceil(2 * run)))

    def record(self, key: tuple[str, str], accepted: int, mismatched: bool, now: float) -> bool:
        """Count one round; True when it made the key fall back to the target alone."""
        cfg, rec = self._cfg, self._record(key)
        if rec.fallback_until is not None:
            return False  # answers drafted before the fallback are not judged again
        rec.rounds.append((accepted, int(mismatched)))
        rec.accepted += accepted
        rec.mismatches += int(mismatched)
        while len(rec.rounds) > cfg.window_rounds:
            a, m = rec.rounds.popleft()
            rec.accepted -= a
            rec.mismatches -= m
        judged = rec.accepted + rec.mismatches
        if judged < cfg.min_tokens or rec.mismatches / judged <= cfg.max_rejection:
            return False
        rec.fallback_until = now + cfg.retry_s
        rec.rounds.clear()
        rec.accepted = rec.mismatches = 0
        return True
