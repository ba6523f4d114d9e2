"""The check with the prefix cache on (``--prefix-cache-mb``): every speculative admission restores its prompt.

A check run whose engines keep a prefix cache must prove the cache changes nothing, and it can only do so
where the cache answers. Left alone it would rarely answer: the check's prompts are short (the index
skips prompts under one block of tokens) and the reference engine sees each prompt once. So
:func:`forcing_hits` changes each engine the factory builds:

* a speculative engine's caches (the target's and the draft model's) index single tokens, so a prefix of
  any length can hit, and are seeded with every prompt of the check but its last few tokens, as the
  runner itself computes them (a prefill of that prefix, then the cache's own ``save``). The first
  admission of a prompt then restores a prefix and prefills the rest on top of it; later ones restore all
  but the pending token (from the entry the engine saved at prefill-done or at release, truncated);
* the target-only reference keeps no cache: it is the cold target that the speculative, cached engines
  are compared with, so a wrong entry cannot make both sides wrong alike.

:class:`HitCount` counts, per part, how many lookups each cache answered and how many tokens it restored;
:func:`account` writes that into the part's evidence and makes a part that ran with the cache on but never
restored anything an ERROR, so a run with the cache on cannot pass without exercising it.
"""

from __future__ import annotations

from specdecode.check.common import EngineFactory, EnginePool
from specdecode.check.report import ERROR, PASS, WEAK, PartResult
from specdecode.prefix_cache import RunnerPrefixCache

HOLD = 2  # tokens before a prompt's pending one left out of its seeded entry: the first admission prefills them
BLOCK = 1  # the forced caches' block: any shared prefix is a hit


def forcing_hits(factory: EngineFactory, prompts: list[list[int]]) -> EngineFactory:
    """``factory`` whose engines, where they keep a prefix cache, restore the check's prompts from it."""

    def make(k: int, batch: int):
        engine = factory(k, batch)
        if not k:
            engine.prefix_cache = None  # the reference is the cold target
        else:
            force_hits(engine, prompts)
        return engine

    return make


def prefix_caches(engine) -> list[tuple[str, RunnerPrefixCache]]:
    """The engine's prefix caches by role: the target's and each draft model's that keeps prefixes."""
    out: list[tuple[str, RunnerPrefixCache]] = []
    if engine.prefix_cache is not None:
        out.append(("target", engine.prefix_cache))
    todo = [engine.drafts._raw]  # (outside its fault guard: the drafter that owns the cache)
    while todo:
        drafter = todo.pop()
        if isinstance(getattr(drafter, "prefixes", None), RunnerPrefixCache):
            out.append(("draft", drafter.prefixes))
        todo.extend(getattr(drafter, "parts", {}).values())  # (a multi-drafter's members)
    return out


def force_hits(engine, prompts: list[list[int]]) -> None:
    """Index the engine's caches by single tokens and seed them with ``prompts`` (once per engine)."""
    if getattr(engine, "_check_hits_forced", False):
        return
    engine._check_hits_forced = True
    for _, cache in prefix_caches(engine):
        if not cache.index.entries:  # (the block sets the hashed keys: change it only while nothing is kept)
            cache.index.block = BLOCK
        for prompt in prompts:
            if len(prompt) < 2:
                continue  # nothing before the pending token to restore
            keep = max(1, len(prompt) - 1 - HOLD)
            cache.runner.prefill([0], [prompt[:keep]])
            cache.save(0, prompt[:keep])


class HitCount:
    """Lookups, hits and restored tokens of every cache in a pool's engines, from when it was made."""

    FIELDS = ("lookups", "hits", "hit_tokens")

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.start = {id(cache): self._stats(cache) for _, cache in self._caches()}

    def _caches(self) -> list[tuple[str, RunnerPrefixCache]]:
        return [c for engine in self.pool.engines() for c in prefix_caches(engine)]

    def _stats(self, cache: RunnerPrefixCache) -> tuple[int, ...]:
        return tuple(getattr(cache.index.stats, f) for f in self.FIELDS)

    def since(self) -> dict[str, dict[str, int]]:
        """By role (``target``, ``draft``): what the caches did since this count began; {} with no cache."""
        out: dict[str, dict[str, int]] = {}
        for role, cache in self._caches():
            before = self.start.get(id(cache), (0,) * len(self.FIELDS))
            row = out.setdefault(role, dict.fromkeys(self.FIELDS, 0))
            for name, now, then in zip(self.FIELDS, self._stats(cache), before):
                row[name] += now - then
        return out


def account(result: PartResult, count: HitCount) -> PartResult:
    """The part's cache evidence (``details["prefix_cache"]``, a clause of its summary); with a cache on
    that restored nothing in this part (a role with no hit), a passing part becomes an ERROR."""
    hits = count.since()
    if not hits:
        return result
    result.details["prefix_cache"] = hits
    clause = ", ".join(
        f"{role} {h['hits']}/{h['lookups']} admissions, {h['hit_tokens']} tokens" for role, h in hits.items()
    )
    missing = [role for role, h in hits.items() if not h["hits"]]
    if missing and result.status in (PASS, WEAK):
        result.status = ERROR
        result.summary = (
            f"the prefix cache is on but the {' and '.join(missing)} cache restored nothing ({clause}): "
            f"this part did not exercise it; was: {result.summary}"
        )
    else:
        result.summary += f"; restored from the prefix cache: {clause}"
    return result
