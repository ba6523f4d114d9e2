"""The prefix cache's index: longest prefix, budget, LRU, pins, superseding, and a forced hash collision."""

from __future__ import annotations

import pytest

from specdecode.prefix_cache import PrefixCache


def _cache(budget: int = 1000, block: int = 4):
    evicted: list = []
    return PrefixCache(budget, block, on_evict=lambda e: evicted.append(e.value)), evicted


def test_longest_prefix_wins_and_respects_the_limit() -> None:
    cache, _ = _cache()
    a = cache.insert(list(range(12)), "a", 10)
    b = cache.insert([0, 1, 2, 3, 4, 5, 9, 9, 9, 9], "b", 10)
    entry, n = cache.lookup(list(range(20)))
    assert entry is a and n == 12
    entry, n = cache.lookup([0, 1, 2, 3, 4, 5, 9, 9, 7])
    assert entry is b and n == 8  # two whole blocks, then 8 = 6 + "9, 9" past them
    entry, n = cache.lookup(list(range(12)), limit=11)  # the last token is fed again
    assert entry is a and n == 11
    assert cache.lookup([0, 1, 2, 7, 8]) == (None, 0)  # less than one block in common: no hit
    assert cache.lookup([5, 5, 5, 5, 5]) == (None, 0)
    assert cache.stats.hits == 3 and cache.stats.hit_tokens == 12 + 8 + 11


def test_an_entry_that_is_a_prefix_of_a_new_one_is_superseded() -> None:
    cache, evicted = _cache()
    cache.insert(list(range(8)), "turn1", 10)
    cache.insert(list(range(16)), "turn2", 20)
    assert len(cache) == 1 and evicted == ["turn1"] and cache.nbytes == 20
    assert cache.lookup(list(range(8)) + [99])[0].value == "turn2"


def test_budget_evicts_least_recently_used_but_never_a_pinned_entry() -> None:
    cache, evicted = _cache(budget=30)
    a = cache.insert([1] * 8, "a", 10)
    cache.insert([2] * 8, "b", 10)
    cache.insert([3] * 8, "c", 10)
    cache.lookup([1] * 9)  # a is now the most recently used
    cache.insert([4] * 8, "d", 10)
    assert evicted == ["b"] and cache.nbytes == 30
    cache.pin(a)
    cache.insert([5] * 8, "e", 20)  # needs 20: c and d go (least recently used first), a is pinned
    assert evicted == ["b", "c", "d"] and {e.value for e in cache.entries.values()} == {"a", "e"}
    assert cache.insert([6] * 8, "f", 25) is None  # 25 fits only by evicting pinned a: refused, e kept
    assert evicted[-1] == "f" and {e.value for e in cache.entries.values()} == {"a", "e"}
    cache.unpin(a)
    with pytest.raises(ValueError):
        cache.unpin(a)
    assert cache.insert([7] * 8, "g", 40) is None and evicted[-1] == "g"  # larger than the budget
    assert cache.insert([8] * 3, "short", 1) is None  # shorter than a block: nothing to reuse
    assert cache.nbytes == sum(e.nbytes for e in cache.entries.values()) <= 30


def test_a_hash_collision_never_hands_out_another_prompts_kv(monkeypatch) -> None:
    """Negative control: every block hashes alike, so the index offers a wrong entry; the token check
    must catch it (a match is only ever the tokens both really share)."""
    cache, _ = _cache()
    monkeypatch.setattr(PrefixCache, "_keys", lambda self, tokens: iter([7] * (len(tokens) // self.block)))
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], "other", 10)
    assert cache.lookup([9, 9, 9, 9, 9, 9, 9, 9]) == (None, 0)
    entry, n = cache.lookup([1, 2, 3, 4, 5, 0, 0, 0])
    assert entry.value == "other" and n == 5


def test_stats_and_clear() -> None:
    cache, evicted = _cache()
    cache.insert(list(range(8)), "a", 10)
    cache.lookup(list(range(8)) + [1, 2], limit=9)
    cache.lookup([100] * 10)
    assert cache.stats.lookup_tokens == 20 and cache.stats.hit_rate == pytest.approx(8 / 20)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and evicted == ["a"] and not cache.by_key
