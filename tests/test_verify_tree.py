"""Tree verifier tests: greedy against a slow reference, width-1 trees equal to the chain verifier, and
the exact sampling law for each sibling rule with a negative control that must fail.

Statistical tests: Pearson chi-square at ALPHA = 1e-4 each on the first emitted token and on the
joint of the first two, so a correct verifier fails any one test with probability <= 1e-4
(asymptotically; rare cells are pooled to expected counts >= 5). N = 100 000 trials of a 2-level
tree on a 6-token vocabulary. Each negative control (the rule that does not match how the siblings
were drawn) must be rejected by the same test: that shows the test has power.
"""

from __future__ import annotations

import pytest
import torch
from specdecode.sampling import sample
from specdecode.tree import chain_parents
from specdecode.verify import verify_greedy, verify_speculative
from specdecode.verify.tree import DETERMINISTIC, IID, WITHOUT_REPLACEMENT, verify_tree, verify_tree_greedy
from test_engine import chi_square_p

ALPHA = 1e-4
V = 6
N = 100_000
WIDTH = (3, 2)  # children of the root, children of each first-level node


# -- greedy ------------------------------------------------------------------------------------------


def test_greedy_tree_follows_the_argmax_chain():
    #   root -> n0 (5), n1 (2); n0 -> n2 (1), n3 (4); n1 -> n4 (3)
    parents = torch.tensor([[-1, -1, 0, 0, 1]])
    tokens = torch.tensor([[5, 2, 1, 4, 3]])
    argmax = torch.tensor([[2, 0, 3, 0, 0, 0]])  # after root: 2 (n1); after n1 (query 2): 3 (n4); after n4: 0
    res = verify_tree_greedy(tokens, parents, torch.tensor([5]), argmax)
    assert res.num_accepted.tolist() == [2] and res.tokens[0].tolist() == [2, 3, 0]
    assert res.path[0].tolist() == [0, 2, 5]


def test_width_one_trees_equal_the_chain_verifier_for_the_same_draws():
    g = torch.Generator().manual_seed(0)
    b, k = 256, 4
    for _ in range(5):
        target_probs = torch.softmax(2 * torch.randn(b, k + 1, V, generator=g), -1)
        draft_probs = torch.softmax(2 * torch.randn(b, k, V, generator=g), -1)
        drafts = torch.multinomial(draft_probs.view(-1, V), 1, generator=g).view(b, k)
        num = torch.randint(0, k + 1, (b,), generator=g)
        u = torch.rand(b, k + 1, generator=g)
        cases = [(draft_probs, IID), (draft_probs, WITHOUT_REPLACEMENT), (None, DETERMINISTIC)]
        for probs, rule in cases:
            chain = verify_speculative(drafts, probs, target_probs, num, u)
            tree = verify_tree(drafts, chain_parents(b, k), num, probs, target_probs, u, rule)
            assert torch.equal(chain.num_accepted, tree.num_accepted)
            for r in range(b):
                n = int(chain.num_accepted[r])
                assert chain.tokens[r, : n + 1].tolist() == tree.tokens[r, : n + 1].tolist()
        argmax = target_probs.argmax(-1)
        assert torch.equal(
            verify_greedy(drafts, argmax, num).num_accepted,
            verify_tree_greedy(drafts, chain_parents(b, k), num, argmax).num_accepted,
        )


# -- the batched walk against a slow, obviously-correct reference ------------------------------------


def reference_walk(tokens, parents, n, draft_probs, target_probs, u, rule):
    """One row, the module docstring's walk in plain Python: (emitted tokens, accepted path)."""
    kids: dict[int, list[int]] = {}
    for i in range(n):
        kids.setdefault(parents[i] + 1, []).append(i + 1)
    node, path, out = 0, [0], []
    while True:
        fresh = target_probs[node]
        p = p_norm = fresh
        q, accepted = None, None
        for c in kids.get(node, []):
            x = tokens[c - 1]
            if rule == DETERMINISTIC:
                if u[c - 1] < p_norm[x]:
                    accepted = c
                    break
                p = p_norm.clone()
                p[x] = 0.0
            else:
                if q is None or rule == IID:
                    q = draft_probs[c - 1]
                if u[c - 1] * q[x] < p_norm[x]:
                    accepted = c
                    break
                p = (p_norm - q).clamp(min=0)
                if rule == WITHOUT_REPLACEMENT:
                    q = q.clone()
                    q[x] = 0.0
                    q = q / q.sum() if q.sum() > 0 else q
            if p.sum() <= 0:
                p = fresh
            p_norm = p / p.sum()
        if accepted is None:
            return out + [int(sample(p[None], u[-1:])[0])], path
        out.append(tokens[accepted - 1])
        node = accepted
        path.append(node)


@pytest.mark.parametrize("rule", [IID, WITHOUT_REPLACEMENT, DETERMINISTIC])
def test_batched_walk_equals_the_reference(rule):
    g = torch.Generator().manual_seed(3)
    b, k = 200, 7
    for _ in range(3):
        parents = torch.stack(
            [torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(k)]) for _ in range(b)]
        )
        num = torch.randint(0, k + 1, (b,), generator=g)
        target_probs = torch.softmax(2 * torch.randn(b, k + 1, V, generator=g), -1)
        draft_probs = torch.softmax(2 * torch.randn(b, k, V, generator=g), -1)
        tokens = torch.randint(0, V, (b, k), generator=g)
        u = torch.rand(b, k + 1, generator=g)
        res = verify_tree(tokens, parents, num, draft_probs, target_probs, u, rule)
        for r in range(b):
            out, path = reference_walk(
                tokens[r].tolist(), parents[r].tolist(), int(num[r]), draft_probs[r], target_probs[r], u[r], rule
            )
            n = int(res.num_accepted[r])
            assert (res.tokens[r, : n + 1].tolist(), res.path[r, : n + 1].tolist()) == (out, path)


# -- the sampled law, per rule -------------------------------------------------------------------------


def laws(seed: int):
    """Target and draft laws of a 2-level toy: root, after each first token, after each pair."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    p1 = torch.softmax(1.5 * torch.randn(V, V, generator=g), -1)  # [x1, V]
    p2 = torch.softmax(torch.randn(V, V, V, generator=g), -1)  # [x1, x2, V] (never tested: the third token)
    q0 = torch.softmax(3.0 * torch.randn(V, generator=g), -1)  # sharp drafts: sibling laws differ a lot
    q1 = torch.softmax(3.0 * torch.randn(V, V, generator=g), -1)
    return p0, p1, p2, q0, q1


def draw_children(q: torch.Tensor, m: int, how: str, g: torch.Generator) -> torch.Tensor:  # q [N, V] -> [N, m]
    if how == DETERMINISTIC:
        return q.topk(m, dim=-1).indices
    if how == IID:
        return torch.multinomial(q, m, replacement=True, generator=g)
    return torch.multinomial(q, m, replacement=False, generator=g)  # sequential draws without replacement


def run_trials(drawn: str, rule: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """N trials: siblings drawn the ``drawn`` way, verified with ``rule``. Returns the counts of the
    first emitted token [V] and of the first two [V, V], and the exact laws."""
    p0, p1, p2, q0, q1 = laws(seed)
    g = torch.Generator().manual_seed(seed + 1)
    m0, m1 = WIDTH
    k = m0 + m0 * m1
    level1 = draw_children(q0.expand(N, V), m0, drawn, g)  # [N, m0]
    level2 = draw_children(q1[level1.flatten()], m1, drawn, g).view(N, m0, m1)  # [N, m0, m1]
    tokens = torch.cat([level1, level2.flatten(1)], dim=1)  # nodes 0..m0-1, then each one's children
    parents = torch.tensor([-1] * m0 + [i for i in range(m0) for _ in range(m1)]).expand(N, -1)
    draft_probs = torch.cat([q0.expand(N, m0, V), q1[level1].repeat_interleave(m1, dim=1)], dim=1)  # [N, k, V]
    target = torch.cat(
        [p0.expand(N, 1, V), p1[level1], p2[level1.repeat_interleave(m1, dim=1), level2.flatten(1)]], dim=1
    )  # [N, 1+k, V]
    uniforms = torch.rand(N, k + 1, generator=g)
    res = verify_tree(tokens, parents, torch.full((N,), k), draft_probs, target, uniforms, rule)
    first = res.tokens[:, 0]
    # one token emitted: the next step would start afresh at the target's law after it
    second = torch.where(res.num_accepted >= 1, res.tokens[:, 1], sample(p1[first], torch.rand(N, generator=g)))
    c1 = torch.bincount(first, minlength=V).float()
    c2 = torch.bincount(first * V + second, minlength=V * V).float().view(V, V)
    return c1, c2, p0, p0[:, None] * p1


@pytest.mark.parametrize("how", [IID, WITHOUT_REPLACEMENT, DETERMINISTIC])
def test_each_rule_follows_the_target_law(how):
    c1, c2, law1, law2 = run_trials(how, how)
    assert chi_square_p(c1, law1, N) > ALPHA
    assert chi_square_p(c2, law2, N) > ALPHA


@pytest.mark.parametrize(
    "drawn,wrong_rule",
    [
        (WITHOUT_REPLACEMENT, IID),  # rule (a)'s residual on siblings drawn without replacement
        (IID, WITHOUT_REPLACEMENT),  # rule (b)'s removal on independent siblings
        (DETERMINISTIC, WITHOUT_REPLACEMENT),  # top-k siblings treated as draws from the draft's law
    ],
)
def test_negative_controls_the_wrong_rule_is_detected(drawn, wrong_rule):
    c1, c2, law1, law2 = run_trials(drawn, wrong_rule)
    assert min(chi_square_p(c1, law1, N), chi_square_p(c2, law2, N)) < ALPHA
