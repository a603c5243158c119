"""When a speculative-first verification may go to its target engine: batching them into one step.

Rules:
- A verification of a short chunk costs the target about one decode step whatever else that step
  carries (the weights are read once per step; a few dozen new tokens add little compute), so
  verifications that reach an idle engine one by one each buy a step of their own. Holding a
  ready verification briefly, while other answers on the same target engine are still drafting,
  lets their verifications join it in one step.
- A batch is held only while some *other* answer drafting for the same target engine is
  expected to be ready within what is left of the window (its ``eta``: its chunk times the
  draft's measured seconds per token, from when it began, minus the time since; unknown is 0),
  and never longer than the window after the first verification of the batch became ready.
  With nobody about to join (low load, or drafts far from done) nothing waits.
- Pure: times in, a decision out.
"""

from __future__ import annotations

from collections.abc import Iterable


def hold(etas: Iterable[float], waited_s: float, window_s: float) -> bool:
    """Whether a batch whose first verification became ready ``waited_s`` ago keeps waiting,
    ``etas`` being the other drafting answers' expected seconds until they are ready."""
    left = window_s - waited_s
    return window_s > 0 and left > 0 and any(eta <= left for eta in etas)


def eta(started: float, tokens: int, s_per_token: float | None, now: float) -> float:
    """Expected seconds until a draft of ``tokens`` begun at ``started`` is back."""
    if s_per_token is None:
        return 0.0
    return started + tokens * s_per_token - now
