"""``--draft-context N``: the draft model reads only the last N tokens of a prompt (specdecode.drafters.window).

Exactness: greedy outputs equal target-only decoding with the window on, on torch and llama.cpp, for chains,
trees, chunked prefill and the prefix cache, with prompts of different lengths in one batch (each row its own
offset), and tokens were drafted and accepted. The fast path against a reference: a windowed draft over a
whole prompt proposes exactly what an unwindowed draft proposes given only the window as its prompt. And
what it saves: the draft prefills at most N tokens of each prompt."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.window import window_start
from specdecode.sampling import SamplingParams
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy, runner_for, serving

V = 32
TOK = make_tokenizer(V)
_g = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(1, V, (n,), generator=_g).tolist() for n in (45, 9, 30, 61)]
P, S, M = 28, 29, 30  # FIM markers for the tests (tiny vocabulary ids)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, seed=3, hidden=32)
    return target, perturbed_copy(target, noise=0.2)


class _Counting:
    """Wraps a runner's prefill to count the prompt tokens it is given."""

    def __init__(self, runner) -> None:
        self.tokens = 0
        self._prefill = runner.prefill
        runner.prefill = self

    def __call__(self, slots, prompts, layers=(), starts=None):
        self.tokens += sum(map(len, prompts))
        return self._prefill(slots, prompts, layers, starts=starts)


def _engine(pair, context: int, backend=None, tree_topk: int = 1, **settings):
    target, draft = pair
    runner = runner_for(draft, backend)
    drafter = DraftModelDrafter(runner, context=context, tree_topk=tree_topk, tree_nodes=6 if tree_topk > 1 else 0)
    engine = make_engine(
        target,
        TOK,
        drafter=drafter,
        k=3,
        num_slots=4,
        max_len=128,
        backend=backend,
        max_tree_nodes=6 if tree_topk > 1 else 0,
        **settings,
    )
    return engine, drafter, _Counting(runner)


def _reference(pair, backend=None):
    target, _ = pair
    return [
        o.token_ids
        for o in make_engine(target, TOK, num_slots=4, max_len=128, backend=backend).generate(
            PROMPTS, [GREEDY] * len(PROMPTS)
        )
    ]


@pytest.mark.parametrize(
    "case", ["chain", "tree", "chunked", "prefix-cache", pytest.param("llamacpp", marks=pytest.mark.llamacpp)]
)
def test_a_bounded_draft_context_changes_no_greedy_output(pair, case) -> None:
    backend = "llamacpp" if case == "llamacpp" else None
    if backend:
        pytest.importorskip("llama_cpp", reason="needs the llama.cpp backend (scripts/install-llamacpp.sh)")
    settings: dict = {}
    if case == "chunked":
        settings = serving(max_num_batched_tokens=16)
    if case == "prefix-cache":
        settings = {"prefix_cache_mb": 1}
    context = 8
    engine, drafter, counted = _engine(pair, context, backend, tree_topk=2 if case == "tree" else 1, **settings)
    runs = 2 if case == "prefix-cache" else 1  # the second run restores the windows the first one kept
    for _ in range(runs):
        out = engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))
        assert [o.token_ids for o in out] == _reference(pair, backend)
        assert sum(o.stats.drafted for o in out) > 0 and sum(o.stats.accepted for o in out) > 0
    # the draft read at most the window of each prompt (and, after a late start, the first output token)
    window = sum(len(p) - 1 - window_start(len(p), context) for p in PROMPTS)
    assert counted.tokens <= runs * (window + len(PROMPTS) * 2)
    assert counted.tokens < sum(len(p) - 1 for p in PROMPTS)
    assert not getattr(drafter._kv, "offsets", {})  # every slot released its window


@pytest.mark.parametrize("fim", [False, True])
def test_a_windowed_draft_proposes_what_a_draft_given_only_the_window_proposes(pair, fim) -> None:
    """The fast path (positions shifted into each slot's view) against the reference (a plain draft whose
    prompt is the view): the same tokens and the same draft probabilities, bit for bit; for plain prompts
    (the view is their tail) and fill-in-the-middle ones (the code around the cursor)."""
    from specdecode.drafters.window import draft_view

    _, draft = pair
    context = 10
    markers = (P, S, M) if fim else None
    prompts = [[P, *p[: len(p) // 2], S, *p[len(p) // 2 :], M] for p in PROMPTS] if fim else PROMPTS
    windowed = DraftModelDrafter(runner_for(draft), context=context, fim=markers)
    plain = DraftModelDrafter(runner_for(draft))
    for d in (windowed, plain):
        d.reserve(4, 128)
        d.runner.ensure_capacity(4, 128)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=3)

    class View:
        def __init__(self, slot, ids):
            self.slot, self.token_ids, self.params = slot, ids, params
            self.generator = torch.Generator().manual_seed(9)

    slots = list(range(len(prompts)))
    windows = [draft_view(p, context, markers) for p in prompts]
    assert all(len(w) < len(p) for w, p in zip(windows, prompts[:1]))
    windowed.start(slots, prompts)
    plain.start(slots, windows)
    a = windowed.propose([View(s, p) for s, p in zip(slots, prompts)], [4] * len(slots))
    b = plain.propose([View(s, w) for s, w in zip(slots, windows)], [4] * len(slots))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_tokens, b.num_tokens)
    assert a.probs is not None and b.probs is not None and torch.equal(a.probs, b.probs)
    # a sequence moved to another slot keeps its window
    windowed.move(3, 0)
    plain.move(3, 0)
    went_on = a.tokens[3, :2].tolist() + [5]  # two draft tokens accepted, then the target's own token
    a2 = windowed.propose([View(0, prompts[3] + went_on)], [3])
    b2 = plain.propose([View(0, windows[3] + went_on)], [3])
    assert torch.equal(a2.tokens, b2.tokens) and torch.equal(a2.probs, b2.probs)


def test_lag_counts_only_the_window_of_a_slot_not_seen_yet(pair) -> None:
    _, draft = pair

    class View:
        slot, token_ids = 2, list(range(1, 31))

    assert DraftModelDrafter(runner_for(draft), context=8).lag(View()) == 30 - window_start(30, 8) - 2 == 8
    assert DraftModelDrafter(runner_for(draft)).lag(View()) == 30 - 2


def test_a_grown_prompt_restores_the_window_it_shares_from_the_drafts_prefix_cache(pair) -> None:
    target, draft = pair
    drafter = DraftModelDrafter(runner_for(draft), context=16)
    engine = make_engine(target, TOK, drafter=drafter, k=3, num_slots=2, max_len=128, prefix_cache_mb=1)
    first = PROMPTS[3][:61]  # window starts at 44 for both prompts
    grown = first + [3, 4]
    assert window_start(len(first), 16) == window_start(len(grown), 16) == 44
    out = [engine.generate([p], [GREEDY])[0] for p in (first, grown)]
    reference = make_engine(target, TOK, num_slots=2, max_len=128)
    assert [o.token_ids for o in out] == [reference.generate([p], [GREEDY])[0].token_ids for p in (first, grown)]
    assert drafter.prefixes is not None and drafter.prefixes.index.stats.hit_tokens >= 16
    assert sum(o.stats.drafted for o in out) > 0


def test_a_fim_view_keeps_the_code_around_the_cursor() -> None:
    from specdecode.drafters.window import draft_view

    prefix, suffix = list(range(100, 400)), list(range(500, 700))
    prompt = [P, *prefix, S, *suffix, M]
    view = draft_view(prompt, 64, (P, S, M))
    assert view[0] == P and view[-1] == M and S in view  # a well-formed FIM prompt, ending as the prompt does
    kept_prefix, kept_suffix = view[1 : view.index(S)], view[view.index(S) + 1 : -1]
    assert kept_prefix == prefix[-len(kept_prefix) :] and kept_suffix == suffix[: len(kept_suffix)]
    assert 48 <= len(kept_prefix) <= 48 + 12 and len(kept_suffix) == 16  # three quarters / a quarter of 64
    # generated tokens after the middle marker are kept whole; a plain prompt keeps its tail
    assert draft_view(prompt + [1, 2, 3], 64, (P, S, M))[-4:] == [M, 1, 2, 3]
    assert draft_view(prefix, 64, (P, S, M)) == prefix[window_start(len(prefix), 64) :]
    assert draft_view(prompt, 64, None) == prompt[window_start(len(prompt), 64) :]  # no markers: the tail
    assert draft_view(prompt[:40], 64, (P, S, M)) == prompt[:40]  # short: all of it


def test_fim_prompts_with_a_fim_view_change_no_greedy_output(pair) -> None:
    target, draft = pair
    g = torch.Generator().manual_seed(2)
    prompts = [
        [P, *torch.randint(1, 27, (n,), generator=g).tolist(), S, *torch.randint(1, 27, (m,), generator=g).tolist(), M]
        for n, m in ((50, 20), (30, 40))
    ]
    drafter = DraftModelDrafter(runner_for(draft), context=16, fim=(P, S, M))
    counted = _Counting(drafter.runner)
    engine = make_engine(target, TOK, drafter=drafter, k=3, num_slots=2, max_len=128, prefix_cache_mb=1)
    reference = make_engine(target, TOK, num_slots=2, max_len=128).generate(prompts, [GREEDY] * 2)
    for _ in range(2):  # the second time from the draft's prefix cache (views are what it keys)
        out = engine.generate(prompts, [GREEDY] * 2)
        assert [o.token_ids for o in out] == [o.token_ids for o in reference]
        assert sum(o.stats.accepted for o in out) > 0
    assert counted.tokens < sum(len(p) for p in prompts)  # it read the views, not the prompts
    assert drafter.prefixes is not None and drafter.prefixes.index.stats.hit_tokens > 0


def test_window_start() -> None:
    assert window_start(100, 0) == 0 and window_start(5, 8) == 0 and window_start(100, 8) == 90
    assert window_start(1001, 256) == 704  # 744 back to a multiple of 64: 296 tokens read
    # prompts that grow by a few tokens keep their window's start (the draft's prefix cache can match it)
    assert len({window_start(n, 256) for n in range(1001, 1025)}) == 1


def test_draft_context_without_a_draft_model_is_refused() -> None:
    from specdecode.build import validate_config
    from specdecode.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="--draft-context"):
        validate_config(EngineConfig("t", "ngram", draft_context=64))
    with pytest.raises(ConfigError, match="--draft-context"):
        EngineConfig("t", "model:x", draft_context=-1)
