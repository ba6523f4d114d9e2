import pytest

from specdecode.config import EngineSettings
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import Engine
from specdecode.models.hf import HFRunner
from specdecode.policy import AcceptancePolicy, BudgetPolicy, FixedPolicy, PerSequence, Plan
from specdecode.sampling import SamplingParams
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy

V = 32
TOK = make_tokenizer(V)


def test_acceptance_policy_schedule_is_per_sequence_and_bounded():
    policy = AcceptancePolicy(start_k=3, max_k=6, min_k=1, grow=2)
    a, b = object(), object()
    assert policy.num_draft(a, 2) == 3 and policy.num_draft(b, 2) == 3
    policy.observe(a, 3, 3)  # all accepted: +2
    policy.observe(b, 3, 1)  # a rejection: -1
    assert policy.num_draft(a, 2) == 5 and policy.num_draft(b, 2) == 2
    for _ in range(5):
        policy.observe(a, 5, 5)
        policy.observe(b, 2, 0)
    assert policy.num_draft(a, 2) == 6 and policy.num_draft(b, 2) == 1
    policy.observe(b, 0, 0)  # nothing drafted (budget end): no change
    assert policy.num_draft(b, 2) == 1
    policy.forget(a)
    assert policy.num_draft(a, 2) == 3


@pytest.mark.parametrize("kwargs", [dict(start_k=5, max_k=4), dict(min_k=-1), dict(grow=1.5)])
def test_bad_policy_arguments(kwargs):
    with pytest.raises(ValueError):
        AcceptancePolicy(**kwargs)
    with pytest.raises(ValueError):
        FixedPolicy(-1)


def _engine(target, draft, policy, slots=3, max_len=128):
    runner = lambda m: HFRunner(m, slots, max_len + policy.max_k + 1)  # noqa: E731
    return Engine(runner(target), TOK, DraftModelDrafter(runner(draft)), policy, EngineSettings(max_context=max_len))


def test_adaptive_drafts_grow_with_acceptance_and_keep_greedy_output():
    target = make_model(V, seed=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9], [10, 11, 12, 13, 14]]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (40, 25, 33, 12)]
    base = make_engine(target, TOK, num_slots=3).generate(prompts, params)
    same = _engine(target, perturbed_copy(target, 0.0), AcceptancePolicy(start_k=2, max_k=8)).generate(prompts, params)
    noisy = _engine(target, perturbed_copy(target, 0.3), AcceptancePolicy(start_k=2, max_k=8)).generate(prompts, params)
    for b, s, n in zip(base, same, noisy):
        assert s.token_ids == b.token_ids and n.token_ids == b.token_ids
    # an identical draft is always accepted, so drafts grow to max_k and steps emit up to 9 tokens
    assert max(len(s.stats.drafted_at) for s in same) == 8
    assert same[0].stats.tokens_per_step > 5
    assert sum(n.stats.accepted for n in noisy) < sum(n.stats.drafted for n in noisy)


def _confident_engine(target, draft, k, confidence, slots=3, max_len=128):
    runner = lambda m: HFRunner(m, slots, max_len + k + 1)  # noqa: E731
    return Engine(
        runner(target),
        TOK,
        DraftModelDrafter(runner(draft), confidence=confidence),
        FixedPolicy(k),
        EngineSettings(max_context=max_len),
    )


def test_draft_confidence_shortens_chains_and_keeps_greedy_output():
    target = make_model(V, seed=4)
    draft = perturbed_copy(target, 0.3)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9], [10, 11, 12, 13, 14]]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (40, 25, 33, 12)]
    base = make_engine(target, TOK, num_slots=3).generate(prompts, params)
    full = _confident_engine(target, draft, 6, 0.0).generate(prompts, params)
    short = _confident_engine(target, draft, 6, 0.5).generate(prompts, params)
    for b, f, s in zip(base, full, short):
        assert f.token_ids == b.token_ids and s.token_ids == b.token_ids
    # without a threshold a step drafts min(6, budget left - 1); with one, chains end early
    full_rate = sum(f.stats.drafted for f in full) / sum(f.stats.target_steps for f in full)
    short_rate = sum(s.stats.drafted for s in short) / sum(s.stats.target_steps for s in short)
    assert full_rate > 4 and 0 < short_rate < full_rate - 1
    # the tokens a threshold cuts are the ones the target tends to reject
    acc = lambda outs: sum(o.stats.accepted for o in outs) / sum(o.stats.drafted for o in outs)  # noqa: E731
    assert acc(short) > acc(full)


@pytest.mark.parametrize("confidence", [-0.1, 1.0, 1.5])
def test_bad_draft_confidence(confidence):
    target = make_model(V, seed=4)
    with pytest.raises(ValueError, match="confidence"):
        DraftModelDrafter(HFRunner(target, 1, 16), confidence=confidence)


def test_budget_policy_caps_the_draft_by_batch_size():
    policy = BudgetPolicy(FixedPolicy(6), budget=16)
    seq = object()
    assert [policy.num_draft(seq, b) for b in (1, 2, 3, 4, 8, 15, 16, 40)] == [6, 6, 4, 3, 1, 0, 0, 0]
    assert policy.max_k == 6
    inner = AcceptancePolicy(start_k=2, max_k=8)
    capped = BudgetPolicy(inner, budget=8)
    capped.observe(seq, 2, 2)  # the inner policy still hears every step
    assert inner.num_draft(seq, 1) == 4 and capped.num_draft(seq, 1) == 4 and capped.num_draft(seq, 4) == 1
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="budget"):
            BudgetPolicy(FixedPolicy(2), bad)


class _Recording(PerSequence):
    """A policy wrapper that records (batch size, draft length) for every request (deciding per
    sequence: the rest of the protocol from PerSequence)."""

    def __init__(self, inner):
        self.inner, self.max_k, self.calls = inner, inner.max_k, []

    def num_draft(self, seq, batch_size):
        k = self.inner.num_draft(seq, batch_size)
        self.calls.append((batch_size, k))
        return k

    def observe(self, seq, drafted, accepted):
        self.inner.observe(seq, drafted, accepted)

    def forget(self, seq):
        self.inner.forget(seq)


def test_budget_policy_under_a_shrinking_batch_keeps_greedy_output():
    target = make_model(V, seed=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9], [10, 11, 12, 13, 14]]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (40, 25, 33, 12)]
    base = make_engine(target, TOK, num_slots=4).generate(prompts, params)
    policy = _Recording(BudgetPolicy(FixedPolicy(5), budget=8))
    outs = _engine(target, perturbed_copy(target, 0.1), policy, slots=4).generate(prompts, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert {b: k for b, k in policy.calls} == {4: 1, 3: 1, 2: 3, 1: 5}  # 8 // B - 1, at most 5


def test_draft_confidence_in_a_mixed_greedy_and_sampled_batch():
    target = make_model(V, seed=4)
    draft = perturbed_copy(target, 0.3)
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=3, max_new_tokens=30, ignore_eos=True)
    base = make_engine(target, TOK, num_slots=3).generate([[1, 2, 3]], [greedy])[0]
    mixed = _confident_engine(target, draft, 6, 0.5).generate([[1, 2, 3], [4, 5]], [greedy, sampled])
    assert mixed[0].token_ids == base.token_ids  # the greedy row's chain ends on its own softmax
    alone = _confident_engine(target, draft, 6, 0.5).generate([[1, 2, 3]], [greedy])[0]
    assert mixed[0].stats.drafted == alone.stats.drafted  # same stopping decisions with a sampled neighbour
    assert mixed[0].stats.drafted < 6 * mixed[0].stats.target_steps


class _Planner(PerSequence):
    """A policy that plans ahead (as the selector does) and records what it is asked."""

    max_k = 4

    def __init__(self):
        self.calls = []

    def num_draft(self, seq, batch_size):
        return 4

    def plan(self, seqs, batch_size):
        self.calls.append(("plan", len(seqs)))
        return Plan([4] * len(seqs))

    def idle(self, seqs):
        self.calls.append(("idle", len(seqs)))

    def observe(self, seq, drafted, accepted):
        pass

    def forget(self, seq):
        pass

    def label(self, seq, k):
        return f"k{k}"


def test_a_budget_at_its_cap_idles_the_policy_instead_of_planning():
    inner = _Planner()
    capped = BudgetPolicy(inner, budget=4)
    seqs = [object() for _ in range(4)]
    assert capped.plan(seqs, 4).lengths == [0] * 4 and inner.calls == [("idle", 4)]  # 4 // 4 - 1 = 0: nothing may draft
    assert capped.plan(seqs[:2], 2).lengths == [1, 1] and inner.calls[-1] == ("plan", 2)
    assert capped.label(seqs[0], 1) == "k1"  # the rest of the protocol reaches the inner policy as it is
    assert FixedPolicy(2).label(seqs[0], 2) is None and FixedPolicy(2).idle(seqs) is None  # (the defaults)
