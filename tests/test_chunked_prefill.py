"""Chunked prefill: a prompt's prefill split across engine steps, between the running batch's steps.

Equality with whole-prompt prefill (greedy and seeded sampling, chains, feature drafters, the
batch-invariant mode), the token bound of every chunk, the slot bookkeeping when sequences finish
or are aborted while others are mid-prefill, and the step order a long prompt sees beside running
streams. Orderings and counts only, never a clock."""

from __future__ import annotations

import pytest
import torch

from specdecode.config import EngineSettings
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.engine import Engine, PrefillError
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy

V = 32
TOK = make_tokenizer(V)
g = torch.Generator().manual_seed(11)
# lengths 1 .. 57: a one-token prompt (nothing to prefill), short ones, several that need many chunks
PROMPTS = [torch.randint(1, V, (n,), generator=g).tolist() for n in (23, 3, 57, 1, 9, 40, 5, 31)]


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, seed=3, hidden=32)
    return target, perturbed_copy(target, noise=0.3)


def _engine(pair, k=3, budget=None, slots=3, draft=True, first_token_from_target=False, **settings):
    target, draft_model = pair
    return make_engine(
        target,
        TOK,
        draft_model if draft else None,
        k=k,
        num_slots=slots,
        max_len=160,
        max_num_batched_tokens=budget,
        first_token_from_target=first_token_from_target,
        **settings,
    )


def _feature_engine(drafter, target, **settings) -> Engine:
    """An engine drafting 3 tokens with a feature drafter (Medusa, EAGLE), built with ``settings``."""
    return Engine(HFRunner(target), TOK, drafter, 3, EngineSettings(max_batch_size=4, max_context=128, **settings))


def _record_prefills(owner) -> list[tuple[list[int], list[int], list[int]]]:
    """Log (slots, chunk lengths, starts) of every prefill call of ``owner``'s runner (an engine's
    target or a draft model drafter's)."""
    runner = getattr(owner, "target", None) or owner.runner
    calls, real = [], runner.prefill

    def prefill(slots, prompts, layers=(), starts=None):
        calls.append((list(slots), [len(p) for p in prompts], list(starts or [0] * len(prompts))))
        return real(slots, prompts, layers, starts=starts)

    runner.prefill = prefill
    return calls


@pytest.mark.parametrize("budget", [5, 16, 64])
def test_chunked_prefill_gives_the_greedy_outputs_of_whole_prompt_prefill(pair, budget):
    params = [
        SamplingParams(max_new_tokens=6 + 5 * (i % 3), temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))
    ]
    whole = _engine(pair, first_token_from_target=True).generate(PROMPTS, params)
    eng = _engine(pair, budget=budget, first_token_from_target=True)
    calls = _record_prefills(eng)
    draft_calls = _record_prefills(eng.drafter)  # the draft model's prompt prefill, in chunks too
    chunked = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    assert all(sum(lengths) <= budget for _, lengths, _ in calls)  # every call within the step's budget
    assert all(n <= budget for _, lengths, _ in draft_calls for n in lengths)  # per sequence for the drafter
    if budget < 57:  # the 57-token prompt took several calls, each continuing where the last stopped
        assert any(start > 0 for _, _, starts in calls for start in starts)
        assert any(start > 0 for _, _, starts in draft_calls for start in starts)
    assert sum(o.stats.accepted for o in chunked) > 0
    assert not eng.running and not eng.prefilling


@pytest.mark.parametrize("budget", [5, 64])
def test_seeded_samples_with_chunked_prefill_do_not_depend_on_the_batch(pair, budget):
    """When a request's drafter is ready (so when it drafts, and which random draws it uses) depends
    only on its own prompt and the budget: batched equals alone, draw for draw."""
    params = [
        SamplingParams(max_new_tokens=6 + 5 * (i % 3), temperature=0.8, seed=100 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    alone = [
        _engine(pair, budget=budget, slots=1, first_token_from_target=True).generate([p], [sp])[0].token_ids
        for p, sp in zip(PROMPTS, params)
    ]
    batched = _engine(pair, budget=budget, slots=3, first_token_from_target=True).generate(PROMPTS, params)
    assert [o.token_ids for o in batched] == alone


def test_target_only_chunked_equals_target_only_whole(pair):
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    whole = _engine(pair, k=0, draft=False).generate(PROMPTS, params)
    chunked = _engine(pair, k=0, draft=False, budget=7).generate(PROMPTS, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_chunk_budget_is_the_step_budget_less_the_verify_windows(pair):
    eng = _engine(pair, k=3, budget=20, slots=2)
    calls = _record_prefills(eng)
    greedy = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    eng.admit([(PROMPTS[1], greedy, "short")])
    eng.step()  # its whole (2-token) prefill and its first, target-only step
    eng.step()  # now drafting 3 tokens per step: a verify window of 4
    eng.admit([(PROMPTS[2], greedy, "long")])
    eng.step()
    assert calls[-1] == ([1], [16], [0])  # 20 - 4
    eng.max_num_batched_tokens = 8
    eng.step()
    assert calls[-1] == ([1], [4], [16])  # 8 - 4
    eng.max_num_batched_tokens = 4
    eng.step()
    assert calls[-1] == ([1], [1], [20])  # never below a quarter of the budget


def test_step_budget_grows_with_the_admitted_sequences(pair):
    """``batched_tokens_per_seq``: the step budget is that many tokens per admitted sequence (running
    or prefilling) when that is more than ``max_num_batched_tokens``; the chunk is what is left after
    the verify windows. 0 (the engine's default) keeps the budget fixed."""
    eng = _engine(pair, k=3, budget=8, slots=3)
    calls = _record_prefills(eng)
    greedy = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    eng.admit([(PROMPTS[1], greedy, "short")])
    assert eng.step_token_budget() == 8  # fixed
    eng.batched_tokens_per_seq = 5
    assert eng.step_token_budget() == 8  # 5 per sequence is less than the budget
    eng.step()
    eng.step()  # drafting 3 tokens per step now: a verify window of 4
    eng.admit([(PROMPTS[2], greedy, "long"), (PROMPTS[5], greedy, "long2")])
    assert eng.step_token_budget() == 15  # 3 admitted x 5
    eng.step()
    assert calls[-1] == ([1], [11], [0])  # 15 - 4
    eng.batched_tokens_per_seq = 0
    eng.step()
    assert calls[-1] == ([1], [4], [11])  # fixed again: 8 - 4
    with pytest.raises(ValueError, match="--batched-tokens-per-seq"):
        Engine(eng.target, TOK, None, 0, EngineSettings(max_batch_size=1, max_context=64, batched_tokens_per_seq=-1))


def test_slots_stay_packed_when_sequences_finish_or_abort_mid_prefill(pair):
    """Short requests finish while long prompts wait mid-prefill in the slots after them: the waiting
    prompts move down (their partial K/V copied) and still decode exactly."""
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    eng = _engine(pair, budget=6, slots=4, first_token_from_target=True)
    copies, real_copy = [], eng.target.copy_slot
    eng.target.copy_slot = lambda src, dst, n: copies.append((src, dst, n)) or real_copy(src, dst, n)
    short = eng.admit([(PROMPTS[1], greedy, "s1"), (PROMPTS[4], greedy, "s2")])
    eng.step()  # s1 whole + 4 of s2's 8 tokens
    long = eng.admit([(PROMPTS[2], long_params, "l1"), (PROMPTS[5], long_params, "l2")])
    assert [s.slot for s in eng.running + eng.prefilling] == [0, 1, 2, 3]
    done = {}
    while eng.running or eng.prefilling:
        for ev in eng.step():
            if ev.finished:
                done[ev.seq.request_id] = ev.seq.output_ids
        assert [s.slot for s in eng.running + eng.prefilling] == list(range(len(eng.running) + len(eng.prefilling)))
    assert any(n > 0 for _, _, n in copies)  # a partially prefilled prompt did move
    assert not eng.drafter._cached  # nothing left behind by sequences that ended before their drafter was ready
    ref = _engine(pair, k=0, draft=False)
    for seq, p, params in zip(
        short + long, [PROMPTS[1], PROMPTS[4], PROMPTS[2], PROMPTS[5]], [greedy, greedy, long_params, long_params]
    ):
        assert done[seq.request_id] == ref.generate([p], params)[0].token_ids


def test_abort_mid_prefill_frees_the_slot_and_spares_the_others(pair):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    eng = _engine(pair, budget=8, slots=3)
    a, b, c = eng.admit([(PROMPTS[2], greedy, "a"), (PROMPTS[5], greedy, "b"), (PROMPTS[0], greedy, "c")])
    eng.step()
    assert 0 < a.prefilled < len(a.prompt_ids) - 1 and b.prefilled == 0
    eng.abort(a)
    assert a.finish_reason == "abort" and eng.prefilling == [b, c] and (b.slot, c.slot) == (0, 1)
    assert eng.free_slots() == 1
    late = eng.admit([(PROMPTS[6], greedy, "d")])[0]
    out = {}
    while eng.running or eng.prefilling:
        for ev in eng.step():
            if ev.finished:
                out[ev.seq.request_id] = ev.seq.output_ids
    ref = _engine(pair, k=0, draft=False)
    for seq in (b, c, late):
        assert out[seq.request_id] == ref.generate([seq.prompt_ids], greedy)[0].token_ids
    assert "a" not in out


def test_a_cancelled_sequence_gets_no_step_after_its_last_chunk(pair):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    eng = _engine(pair, budget=64, slots=2)
    seq = eng.admit([(PROMPTS[0], greedy, "gone")])[0]
    seq.cancelled = True  # the client left while its prefill ran
    assert eng.step() == [] and seq.finish_reason == "abort" and not eng.running and eng.free_slots() == 2


def test_a_failed_prefill_aborts_only_its_prompts(pair):
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    eng = _engine(pair, budget=16, slots=3)
    running = eng.admit([(PROMPTS[1], greedy, "ok")])[0]
    eng.step()
    bad = eng.admit([(PROMPTS[2], greedy, "bad")])[0]
    real = eng.target.prefill

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    eng.target.prefill = broken
    with pytest.raises(PrefillError) as err:
        eng.step()
    assert err.value.seqs == [bad] and bad.finish_reason == "abort" and eng.running == [running]
    eng.target.prefill = real
    while eng.running:
        eng.step()
    ref = _engine(pair, k=0, draft=False).generate([PROMPTS[1]], greedy)[0].token_ids
    assert running.output_ids == ref


def test_drafter_prefill_in_chunks_starts_drafting_late_and_survives_a_fault(pair):
    """A draft model caches a long prompt a chunk per step (the sequence decodes target-only
    meanwhile); a drafter failing in its chunked prefill only makes that row decode target-only."""
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    ref = _engine(pair, k=0, draft=False).generate([PROMPTS[2]], greedy)[0].token_ids
    eng = _engine(pair, budget=8, slots=2, first_token_from_target=True)
    seq = eng.admit([(PROMPTS[2], greedy, "long")])[0]
    drafted_from = None
    while not seq.finished:
        for ev in eng.step():
            if ev.drafted and drafted_from is None:
                drafted_from = len(seq.output_ids) - len(ev.new_token_ids)
    # target prefill: 7 steps of 8 tokens, the first token in the last; then 7 drafter chunks of 8, one
    # per step from the second token on, the step of the 7th drafting at once: tokens 2..7 target-only
    assert seq.draft.prefilled == 56 and drafted_from == 7 and seq.output_ids == ref

    eng = _engine(pair, budget=8, slots=2, first_token_from_target=True, isolate_drafter_faults=True)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    eng.drafter.inner.prefill = broken
    out = eng.generate([PROMPTS[2]], greedy)[0]
    assert eng.drafter_faults == (1, 0) and out.token_ids == ref  # (its prefill failed once, alone)


def test_long_prompt_chunks_interleave_with_the_running_streams(pair):
    """Between two chunks of a long prompt, every running sequence emits tokens (the step order)."""
    greedy = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    eng = _engine(pair, budget=16, slots=3)
    log, real = [], eng.target.prefill

    def prefill(slots, prompts, layers=(), starts=None):
        log.append(("chunk", sum(len(p) for p in prompts)))
        return real(slots, prompts, layers, starts=starts)

    eng.target.prefill = prefill
    first = eng.admit([(PROMPTS[1], greedy, "r1"), (PROMPTS[4], greedy, "r2")])
    for _ in range(3):
        eng.step()
    long = eng.admit([(PROMPTS[2], greedy, "long")])[0]
    log.clear()
    while long.in_prefill:
        before = [len(s.output_ids) for s in first]
        eng.step()
        log.append(("tokens", [len(s.output_ids) - b for s, b in zip(first, before)]))
    chunks = [n for what, n in log if what == "chunk"]
    assert chunks == [8] * 7  # 16 less two verify windows of 4; 56 prompt tokens to cache
    assert [what for what, _ in log] == ["chunk", "tokens"] * 7
    steps = [t for what, t in log if what == "tokens"]
    assert all(all(n >= 1 for n in t) for t in steps)  # each chunk's step advanced both running streams


def test_feature_drafters_see_the_same_prompt_features_in_chunks():
    from test_eagle import tiny_eagle
    from test_medusa import tiny_heads

    target = make_model(V, seed=3, hidden=32)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    for build in (
        lambda **settings: _feature_engine(MedusaDrafter(tiny_heads(target)), target, **settings),
        lambda **settings: _feature_engine(
            EagleDrafter(tiny_eagle(target, layers=("layer1", "layer2")), HFRunner(target)), target, **settings
        ),
    ):
        # (both first_token_from_target: the same draft schedule, see above)
        whole = build(first_token_from_target=True).generate(PROMPTS, params)
        chunked = build(max_num_batched_tokens=6, first_token_from_target=True).generate(PROMPTS, params)
        assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
        # the drafts too: the drafter was fed the prompt's features chunk by chunk, in order
        assert [o.stats.accepted for o in chunked] == [o.stats.accepted for o in whole]


def test_batch_invariant_chunked_prefill_is_bitwise_whole_prefill():
    from specdecode.models import batch_invariant as bi

    target = make_model(64, seed=7, layers=2, hidden=128, dtype=torch.bfloat16)
    bi.enable(target)
    prompt = torch.randint(1, 64, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = HFRunner(target, num_slots=2, max_len=128)
    runner.prefill([0], [prompt])
    for lo, hi in [(0, 7), (7, 20), (20, 45)]:  # slot 1: the same prompt in three chunks
        runner.prefill([1], [prompt[lo:hi]], starts=[lo])
    step = runner.forward(torch.tensor([0, 1]), torch.tensor([[5], [5]]), torch.tensor([[45], [45]]))
    logits = runner.logits(step.hidden)
    assert torch.equal(logits[0], logits[1])


def test_runner_prefill_continues_where_the_slot_ends(pair):
    target, _ = pair
    runner = HFRunner(target, num_slots=2, max_len=80)
    p = PROMPTS[2]
    whole = runner.prefill([0], [p], layers=(-1,))[0][-1]
    parts = [runner.prefill([1], [p[lo:hi]], layers=(-1,), starts=[lo])[0][-1] for lo, hi in [(0, 20), (20, 57)]]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="past the cache"):
        runner.prefill([1], [p], starts=[50])


def test_engine_refuses_a_budget_below_one(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        Engine(
            HFRunner(target), TOK, None, 0, EngineSettings(max_batch_size=1, max_context=64, max_num_batched_tokens=0)
        )


@pytest.mark.parametrize("budget", [None, 7])
def test_equal_prompts_admitted_together_share_one_prefill(pair, budget):
    """Three copies of one prompt and another prompt in one batch (the choices of an n > 1 request), served
    (first token from the target): the target prefills each distinct prompt once (whole or in chunks) and copies
    its cache to the copies, which cost no budget; every output equals its request run alone at the same budget
    (greedy and seeded: a copy's drafter starts when it would alone), with tokens drafted."""
    a, b = PROMPTS[2], PROMPTS[5]
    prompts = [a, a, b, a]
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=10, temperature=1.0, seed=8, ignore_eos=True),
        SamplingParams(max_new_tokens=10, temperature=1.0, seed=9, ignore_eos=True),
    ]
    alone = [
        _engine(pair, budget=budget, slots=1, first_token_from_target=True).generate([p], [q])[0]
        for p, q in zip(prompts, params)
    ]
    eng = _engine(pair, budget=budget, slots=4, first_token_from_target=True)
    calls = _record_prefills(eng)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert sum(o.stats.drafted for o in outs) > 0
    computed = sum(sum(lengths) for _, lengths, _ in calls)
    assert computed == (len(a) - 1) + (len(b) - 1)  # each distinct prompt once
    assert [o.stats.prefill_copied for o in outs] == [0, len(a) - 1, 0, len(a) - 1]
    if budget is not None:
        assert all(sum(lengths) <= budget for _, lengths, _ in calls)


def test_a_shared_prefill_that_fails_aborts_its_copies_too(pair):
    eng = _engine(pair, slots=3)
    real = eng.target.prefill

    def broken(slots, prompts, layers=(), starts=None):
        raise RuntimeError("injected")

    eng.target.prefill = broken
    seqs = eng.admit([(PROMPTS[0], SamplingParams(max_new_tokens=3), None)] * 2)
    with pytest.raises(PrefillError) as err:
        eng.prefill()
    assert set(map(id, err.value.seqs)) == set(map(id, seqs)) and not eng.prefilling
    eng.target.prefill = real
    assert eng.generate([PROMPTS[1]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids


def test_equal_prompts_share_the_prefill_with_feature_drafters_too():
    """EAGLE and Medusa read the target's prompt features: a copy takes its leader's features of the same
    chunk, so its drafts (and outputs) are those it would make alone; budget 6 (chunks) and whole."""
    from test_eagle import tiny_eagle
    from test_medusa import tiny_heads

    target = make_model(V, seed=3, hidden=32)
    prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[0], PROMPTS[2]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    for build in (
        lambda **settings: _feature_engine(MedusaDrafter(tiny_heads(target)), target, **settings),
        lambda **settings: _feature_engine(
            EagleDrafter(tiny_eagle(target, layers=("layer1", "layer2")), HFRunner(target)), target, **settings
        ),
    ):
        for budget in (None, 6):
            eng = build(max_num_batched_tokens=budget, first_token_from_target=True)
            alone = [eng.generate([p], params)[0] for p in prompts]
            eng = build(max_num_batched_tokens=budget, first_token_from_target=True)
            outs = eng.generate(prompts, params)
            assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
            assert [o.stats.accepted for o in outs] == [o.stats.accepted for o in alone]
            assert sum(o.stats.prefill_copied for o in outs) == 2 * (len(PROMPTS[2]) - 1)
