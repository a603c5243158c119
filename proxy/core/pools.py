"""Pools: which pools a requested model may be served by, in order, and under which model name.

Rules:
- An alias is looked up first, then the pools' model names: an alias is how a model name that
  several pools serve is routed (config validation makes sure one exists).
- A plan is a tier chain: its first pool serves the request; under pressure, ``sheddable``
  requests may go to the next pool of the chain that admits them instead of being shed (the
  caller decides when, using admission; this module only says where). ``admission.degrade_to_draft
  = false`` turns every chain into its first pool.
- The engines get the model name asked for when their pool serves that name (a LoRA adapter, the
  same model on another GPU type), else the pool's own model (an alias, a degraded request).
- An unknown model is ``NotFound`` (404, code ``model_not_found``).
- Pure: the answers depend on the configuration only.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.core.config import Config
from proxy.core.errors import NotFound


@dataclass(frozen=True)
class PoolPlan:
    pools: tuple[str, ...]  # degrade order; the first serves unless it would shed

    @property
    def pool(self) -> str:
        return self.pools[0]

    @property
    def fallbacks(self) -> tuple[str, ...]:
        return self.pools[1:]


@dataclass(frozen=True)
class ModelEntry:
    """One public model name, as ``/v1/models`` lists it."""

    id: str
    pools: tuple[str, ...]
    alias: bool


# A client's name echoed in an error is cut to this many characters: a refusal must not cost
# more than the request that caused it.
SHOWN_CHARS = 128


def shown(name: str) -> str:
    """``name`` quoted for an error message, cut to ``SHOWN_CHARS``."""
    return repr(name) if len(name) <= SHOWN_CHARS else f"{name[:SHOWN_CHARS]!r}..."


def resolve_model(cfg: Config, model: str) -> PoolPlan:
    """The pools (in degrade order) serving requests for ``model``."""
    entry = find_model(cfg, model)
    if entry is None:
        raise NotFound(f"The model {shown(model)} does not exist", param="model")
    return PoolPlan(entry.pools)


def _chain(cfg: Config, chain: tuple[str, ...]) -> tuple[str, ...]:
    """An alias's pools as requests take them: its first one alone when chains are off."""
    return chain if cfg.admission.degrade_to_draft else chain[:1]


def find_model(cfg: Config, model: str) -> ModelEntry | None:
    names = [p.name for p in cfg.pools]
    for alias in cfg.aliases:
        if alias.name == model:
            return ModelEntry(model, _chain(cfg, alias.chain(names)), alias=True)
    for pool in cfg.pools:
        if model in pool.served:
            return ModelEntry(model, (pool.name,), alias=False)
    return None


def upstream_model(cfg: Config, pool: str, asked: str) -> str:
    """The model name written into the body sent to the engines of ``pool``."""
    found = cfg.pool(pool)
    if found is None:
        raise NotFound(f"No pool {pool!r} is configured", param="model")
    return asked if asked in found.served else found.model


def model_names(cfg: Config) -> list[ModelEntry]:
    """Every public model name: the pools' served names, then the aliases."""
    entries: dict[str, ModelEntry] = {}
    for pool in cfg.pools:
        for model in pool.served:
            entries.setdefault(model, ModelEntry(model, (pool.name,), alias=False))
    names = [p.name for p in cfg.pools]
    for alias in cfg.aliases:
        # An alias named like a model several pools serve replaces that model's entry.
        entries[alias.name] = ModelEntry(alias.name, _chain(cfg, alias.chain(names)), alias=True)
    return list(entries.values())
