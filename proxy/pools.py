"""Pools: which pool a requested model goes to, and where it may fall back under pressure.

Rules:
- A pool's own model name selects that pool; a configured alias selects its pool.
- A tiering alias that points at the target pool has the draft pool as fallback: under target
  pressure ``sheddable`` requests are served by the draft pool instead of being shed (the caller
  decides when, using admission; this module only says where).
- An unknown model is ``NotFound`` (404, code ``model_not_found``).
- Pure: the answers depend on the configuration only.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import Config
from proxy.errors import NotFound


@dataclass(frozen=True)
class PoolPlan:
    pool: str
    fallback: str | None = None  # the draft pool for a tiering alias


def resolve_model(cfg: Config, model: str) -> PoolPlan:
    """The pool (and fallback) serving requests for ``model``."""
    for pool in cfg.pools:
        if pool.model == model:
            return PoolPlan(pool.name)
    for alias in cfg.aliases:
        if alias.name == model:
            fallback = _fallback(cfg, alias.pool) if alias.tiering else None
            return PoolPlan(alias.pool, fallback)
    raise NotFound(f"The model {model!r} does not exist", param="model")


def _fallback(cfg: Config, pool: str) -> str | None:
    if pool == "draft" or not cfg.admission.degrade_to_draft or cfg.pool("draft") is None:
        return None
    return "draft"


def upstream_model(cfg: Config, pool: str) -> str:
    """The model name the engines of ``pool`` serve (written into the upstream body)."""
    found = cfg.pool(pool)
    if found is None:
        raise NotFound(f"No pool {pool!r} is configured", param="model")
    return found.model


def model_names(cfg: Config) -> list[tuple[str, str]]:
    """(model name, pool) for every pool model and alias, as ``/v1/models`` lists them."""
    names = [(p.model, p.name) for p in cfg.pools]
    names.extend((a.name, a.pool) for a in cfg.aliases)
    return names
