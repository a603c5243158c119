"""When a speculative-first verification may go to its target engine: batching them into one step.

Rules:
- A verification of a short chunk costs the target about one decode step whatever else that step
  carries (the weights are read once per step; a few dozen new tokens add little compute), so
  verifications that reach an idle engine one by one each buy a step of their own. Holding a
  ready verification briefly, while other answers on the same target engine are still drafting,
  lets their verifications join it in one step.
- A batch opens (the first ready verification waits) only if some *other* answer drafting for
  the same target engine is expected back within the window (its ``eta``: its chunk times the
  draft's measured seconds per token, from when it began; unknown is 0). With nobody about to
  join (low load, or drafts far from done) nothing waits.
- An open batch waits for every drafter until the window has passed (later verifications
  join it) and goes at once when nobody is drafting for that engine any more.
- Pure: times in, a decision out.
"""

from __future__ import annotations

from collections.abc import Sequence


def hold(etas: Sequence[float], waited_s: float, window_s: float, *, opening: bool) -> bool:
    """Whether a batch whose first verification became ready ``waited_s`` ago keeps waiting,
    ``etas`` being the other drafting answers' expected seconds until they are ready (opening:
    the batch has no verification yet but the one deciding)."""
    if window_s <= 0 or waited_s >= window_s or not etas:
        return False
    return not opening or any(eta <= window_s for eta in etas)


def eta(started: float, tokens: int, s_per_token: float | None, now: float) -> float:
    """Expected seconds until a draft of ``tokens`` begun at ``started`` is back."""
    if s_per_token is None:
        return 0.0
    return started + tokens * s_per_token - now
