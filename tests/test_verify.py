"""Verifier tests: greedy tables, fast path vs slow reference, and the exact sampling law.

Statistical tests use Pearson's chi-square goodness of fit at significance ALPHA = 1e-4 each, so a
correct verifier fails any one of them with probability <= 1e-4 (asymptotically; every expected
cell count here is >= 50). The negative controls (a wrong rule) must fail the same test: they show
the test has power.
"""

import pytest
import torch
from scipy.stats import chisquare

from specdecode.sampling import sample
from specdecode.verify import verify_greedy, verify_speculative

ALPHA = 1e-4


def reference_greedy(draft, target_argmax, num_draft):
    """Slow loop version of greedy verification for one row."""
    out = []
    for j in range(num_draft):
        if draft[j] != target_argmax[j]:
            return out + [target_argmax[j]], j
        out.append(draft[j])
    return out + [target_argmax[num_draft]], num_draft


def test_greedy_matches_reference():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        b, k = 5, 4
        target_argmax = torch.randint(0, 3, (b, k + 1), generator=g)
        draft = torch.where(
            torch.rand(b, k, generator=g) < 0.7, target_argmax[:, :k], torch.randint(0, 3, (b, k), generator=g)
        )
        num_draft = torch.randint(0, k + 1, (b,), generator=g)
        res = verify_greedy(draft, target_argmax, num_draft)
        for r in range(b):
            toks, n = reference_greedy(draft[r].tolist(), target_argmax[r].tolist(), int(num_draft[r]))
            assert int(res.num_accepted[r]) == n
            assert res.tokens[r, : n + 1].tolist() == toks


def test_speculative_with_one_hot_distributions_equals_greedy():
    g = torch.Generator().manual_seed(1)
    b, k, v = 64, 5, 7
    target_logits = torch.randn(b, k + 1, v, generator=g)
    target_argmax = target_logits.argmax(-1)
    draft = torch.where(
        torch.rand(b, k, generator=g) < 0.6, target_argmax[:, :k], torch.randint(0, v, (b, k), generator=g)
    )
    one_hot = lambda ids: torch.nn.functional.one_hot(ids, v).float()  # noqa: E731
    num_draft = torch.randint(0, k + 1, (b,), generator=g)
    uniforms = torch.rand(b, k + 1, generator=g)
    fast = verify_greedy(draft, target_argmax, num_draft)
    for draft_probs in (one_hot(draft), None):
        slow = verify_speculative(draft, draft_probs, one_hot(target_argmax), num_draft, uniforms)
        assert torch.equal(slow.num_accepted, fast.num_accepted)
        for r in range(b):
            n = int(fast.num_accepted[r])
            assert torch.equal(slow.tokens[r, : n + 1], fast.tokens[r, : n + 1])


def _chain(n: int, k: int, v: int, seed: int, point_mass: bool):
    """n independent verifications of a k-token chain with fixed per-position distributions."""
    g = torch.Generator().manual_seed(seed)
    target_probs = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)
    draft_probs = torch.softmax(torch.randn(k, v, generator=g) * 1.5, -1)
    if point_mass:  # a deterministic drafter always proposes the same (plausible) tokens
        draft_tokens = target_probs[:k].argmax(-1).repeat(n, 1)
        dp = None
    else:
        draft_tokens = torch.stack(
            [sample(draft_probs[j].repeat(n, 1), torch.rand(n, generator=g)) for j in range(k)], 1
        )
        dp = draft_probs.repeat(n, 1, 1)
    uniforms = torch.rand(n, k + 1, generator=g)
    num_draft = torch.full((n,), k)
    return target_probs, draft_probs, draft_tokens, dp, uniforms, num_draft


def _p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    if counts[probs == 0].sum() > 0:
        return 0.0  # a token outside the support: certainly wrong
    support = probs > 0
    expected = probs[support].double()
    expected = expected / expected.sum() * counts.sum()
    return float(chisquare(counts[support], expected).pvalue)


def wrong_rule_no_residual(draft_tokens, draft_probs, target_probs, num_draft, uniforms):
    """Negative control: at a rejection, sample from the target instead of the residual."""
    res = verify_speculative(draft_tokens, draft_probs, target_probs, num_draft, uniforms)
    rows = torch.arange(len(num_draft))
    n = res.num_accepted
    res.tokens[rows, n] = sample(target_probs[rows, n], uniforms[:, -1])
    return res


@pytest.mark.parametrize("point_mass", [False, True])
def test_emitted_tokens_follow_target_law(point_mass):
    n, k, v = 40_000, 3, 8
    target_probs, _, draft_tokens, dp, uniforms, num_draft = _chain(n, k, v, seed=3, point_mass=point_mass)
    res = verify_speculative(draft_tokens, dp, target_probs.repeat(n, 1, 1), num_draft, uniforms)
    assert _p_value(res.tokens[:, 0], target_probs[0]) > ALPHA
    has_second = res.num_accepted >= 1  # position 1 exists; given that, it must follow target_probs[1]
    assert int(has_second.sum()) > 5_000
    assert _p_value(res.tokens[has_second, 1], target_probs[1]) > ALPHA


@pytest.mark.parametrize("point_mass", [False, True])
def test_negative_controls_fail_the_same_test(point_mass):
    n, k, v = 40_000, 3, 8
    target_probs, draft_probs, draft_tokens, dp, uniforms, num_draft = _chain(n, k, v, seed=3, point_mass=point_mass)
    res = wrong_rule_no_residual(draft_tokens, dp, target_probs.repeat(n, 1, 1), num_draft, uniforms)
    assert _p_value(res.tokens[:, 0], target_probs[0]) < ALPHA
    if not point_mass:  # plain draft samples are not target samples either
        assert _p_value(draft_tokens[:, 0], target_probs[0]) < ALPHA


def test_ragged_draft_lengths_and_zero_drafts():
    n, k, v = 30_000, 4, 6
    target_probs, _, draft_tokens, dp, uniforms, _ = _chain(n, k, v, seed=5, point_mass=False)
    num_draft = torch.randint(0, k + 1, (n,), generator=torch.Generator().manual_seed(9))
    res = verify_speculative(draft_tokens, dp, target_probs.repeat(n, 1, 1), num_draft, uniforms)
    assert bool((res.num_accepted <= num_draft).all())
    assert _p_value(res.tokens[:, 0], target_probs[0]) > ALPHA
    zero = num_draft == 0  # nothing drafted: the single emitted token is a plain target sample
    assert bool((res.num_accepted[zero] == 0).all())
    assert _p_value(res.tokens[zero, 0], target_probs[0]) > ALPHA
