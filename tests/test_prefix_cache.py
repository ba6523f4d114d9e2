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


# -- the engine with a prefix cache ---------------------------------------------------------------------
import torch  # noqa: E402

from specdecode.sampling import SamplingParams  # noqa: E402
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy, serving  # noqa: E402

V = 32
TOK = make_tokenizer(V)
_g = torch.Generator().manual_seed(5)
BASE = torch.randint(1, V, (40,), generator=_g).tolist()
OTHER = torch.randint(1, V, (37,), generator=_g).tolist()
# a session's prompts: the base, then the base grown, cut back, and with another ending
PROMPTS = [BASE, BASE + [3, 4, 5, 6], BASE[:30] + [7] * 9, OTHER, BASE + [3, 4, 9], OTHER[:-1] + [1]]


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, seed=3, hidden=32)
    return target, perturbed_copy(target, noise=0.3)


def _engine(pair, cache_mb: int = 0, backend: str | None = None, **settings):
    target, draft = pair
    return make_engine(
        target, TOK, draft, k=3, num_slots=2, max_len=160, backend=backend, prefix_cache_mb=cache_mb, **settings
    )


def _one_by_one(engine, prompts, params):
    return [engine.generate([p], [params])[0] for p in prompts]  # each after the last: the cache holds them


@pytest.mark.parametrize("backend", [None, pytest.param("llamacpp", marks=pytest.mark.llamacpp)])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_cached_prefix_changes_no_output(pair, backend, sampling) -> None:
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp", reason="needs the llama.cpp backend (scripts/install-llamacpp.sh)")
    temperature, seed = (0.0, None) if sampling == "greedy" else (0.8, 7)
    params = SamplingParams(max_new_tokens=10, temperature=temperature, seed=seed, ignore_eos=True)
    plain = _one_by_one(_engine(pair, backend=backend), PROMPTS, params)
    engine = _engine(pair, cache_mb=1, backend=backend)
    cached = _one_by_one(engine, PROMPTS, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    hits = [o.stats.prefill_cached for o in cached]
    assert hits[0] == 0 and hits[3] == 0  # nothing earlier shares their start
    assert hits[1] >= len(BASE)  # the base (and its output) were kept
    assert hits[2] == 30 and hits[4] >= len(BASE) and hits[5] == len(OTHER) - 1
    assert all(h <= len(p) - 1 for h, p in zip(hits, PROMPTS))  # the last prompt token is always fed again
    assert sum(o.stats.accepted for o in cached) > 0  # speculation ran on the restored prefixes
    stats = engine.prefix_cache.index.stats
    assert stats.hit_tokens == sum(hits) and engine.prefix_cache.index.nbytes <= 1 << 20
    draft = engine.drafter.prefixes.index  # the draft model kept and restored its own KV too
    assert draft.stats.hit_tokens >= len(BASE) and draft.nbytes <= 1 << 20


def test_chunked_prefill_continues_after_a_cached_prefix(pair) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    plain = _one_by_one(_engine(pair, **serving(max_num_batched_tokens=8)), PROMPTS, params)
    engine = _engine(pair, cache_mb=1, **serving(max_num_batched_tokens=8))
    starts = []
    real = engine.drafter.prefill  # (the draft model's chunks: the first one starts after its kept prefix)
    engine.drafter.prefill = lambda slots, pieces, st: starts.extend(st) or real(slots, pieces, st)
    cached = _one_by_one(engine, PROMPTS, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert sum(o.stats.prefill_cached for o in cached) > 0 and sum(o.stats.accepted for o in cached) > 0
    assert engine.drafter.inner.prefixes.index.stats.hit_tokens > 0  # (the server's drafter is in its fault guard)
    assert any(start >= 16 and start % 8 for start in starts)  # a chunk began at a restored length, not a multiple of 8


def test_concurrent_prompts_sharing_all_but_the_last_token_are_not_answered_from_each_other(pair) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    alone = _engine(pair)
    outputs = {y: alone.generate([BASE + [y]], [params])[0].token_ids for y in range(1, V)}
    y = next(y for y in range(2, V) if outputs[y] != outputs[1])  # two last tokens that lead elsewhere
    a, b = BASE + [1], BASE + [y]
    plain = [outputs[1], outputs[y]]
    engine = _engine(pair, cache_mb=1)
    engine.generate([BASE + [0]], [params])  # the shared prefix is cached
    out = engine.generate([a, b], [params, params])
    assert [o.token_ids for o in out] == plain and plain[0] != plain[1]
    assert [o.stats.prefill_cached for o in out] == [len(BASE), len(BASE)]


def test_negative_control_a_wrong_entry_is_caught(pair) -> None:
    """Swap two entries' saved KV (a stale or wrong-prefix entry): the outputs restored from them must then
    differ from plain decoding, so the equality above would catch such a cache."""
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [BASE + [3, 4, 5, 6], OTHER + [2, 2]]
    plain = _one_by_one(_engine(pair), prompts, params)
    engine = _engine(pair, cache_mb=1)
    _one_by_one(engine, [BASE, OTHER], params)
    first, second = engine.prefix_cache.index.entries.values()
    first.value, second.value = second.value, first.value
    wrong = _one_by_one(engine, prompts, params)
    assert all(o.stats.prefill_cached > 0 for o in wrong)
    assert [o.token_ids for o in wrong] != [o.token_ids for o in plain]


def test_a_small_budget_evicts_and_no_cache_without_saved_state(pair) -> None:
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine = _engine(pair, cache_mb=1)
    per_token = engine.target.kv_bytes() // (2 * (160 + engine.window))  # bytes per cached token of one slot
    engine.prefix_cache.index.budget_bytes = per_token * 60  # room for about one prompt and its output
    _one_by_one(engine, [BASE, OTHER, BASE + [1]], params)
    index = engine.prefix_cache.index
    assert index.nbytes <= index.budget_bytes and index.stats.evictions + index.stats.superseded >= 1
    assert _engine(pair).prefix_cache is None  # 0 MiB: off


def test_one_budget_is_split_between_the_target_and_the_draft_by_their_kv_per_position() -> None:
    from specdecode.prefix_cache import position_bytes

    target = make_model(V, seed=3, hidden=64, layers=3)  # a target whose KV per position is 3x the draft's
    engine = make_engine(
        target, TOK, make_model(V, seed=4, hidden=32, layers=2), k=3, num_slots=2, max_len=64, prefix_cache_mb=3
    )
    mine, theirs = engine.prefix_cache.index.budget_bytes, engine.drafter.prefixes.index.budget_bytes
    assert mine + theirs == 3 << 20  # the flag is the budget of both caches together
    t, d = position_bytes(engine.target), position_bytes(engine.drafter.runner)
    assert t > d and abs(theirs / mine - d / t) < 1e-3


# -- the server -------------------------------------------------------------------------------------------
def test_the_server_reports_cached_tokens_and_its_cache_in_metrics() -> None:
    import httpx

    from test_server_harness import KEY, MODEL, engine, reference, serve, tokenizer

    prompt = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    with serve(engine(k=3, slots=4, prefix_cache_mb=1)) as s:
        headers = {"Authorization": f"Bearer {KEY}"}

        def complete(text: str) -> dict:
            body = {"model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0}
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        first, again = complete(prompt), complete(prompt + "print(fib(10))")
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        n = len(tokenizer()(prompt).input_ids)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] <= n + 8
        text, finish, _ = reference(tokenizer()(prompt + "print(fib(10))").input_ids, max_new_tokens=8)
        assert (again["choices"][0]["text"], again["choices"][0]["finish_reason"]) == (text, finish)
        assert again["speculation"]["drafted"] > 0
        metrics = httpx.get(f"{s.url}/metrics", headers=headers, timeout=60).text
    hits = [line for line in metrics.splitlines() if line.startswith("specdecode_prefix_cache_hit_tokens_total")]
    assert hits and float(hits[0].split()[-1]) >= 16
    assert any(
        line.startswith("specdecode_prefix_cache_entries ") and float(line.split()[-1]) >= 1
        for line in metrics.splitlines()
    )
    # the draft model's share of the one budget is reported beside the target's
    gauges = {
        line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("specdecode_")
    }
    assert gauges["specdecode_prefix_cache_draft_bytes"] > 0 and gauges["specdecode_prefix_cache_bytes"] > 0
    assert gauges["specdecode_prefix_cache_draft_bytes"] + gauges["specdecode_prefix_cache_bytes"] <= 1 << 20
