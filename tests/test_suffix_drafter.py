"""The suffix drafter (``--draft suffix``, SuffixDecoding): the index's longest match and counts
against a brute-force reference, the confidence and length rules, rollback, the cross-request
history (used after a release, bounded FIFO, off when asked), trees; through the engine on tiny
models: greedy equality with target-only decoding (chains, trees, ``--draft-policy auto`` beside a
draft model and n-gram lookup), and the sampled law of two tokens (chi-square at ALPHA = 1e-4 per
setting, with a negative control)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import pytest
import torch

from specdecode.config import DraftSettings, EngineSettings
from specdecode.costmodel import CostModel
from specdecode.drafters import DraftSpecError, check_draft, parse_draft
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SEP, History, SuffixDrafter, SuffixIndex, children, grow_tree, walk
from specdecode.engine import Engine
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams
from specdecode.selector import SelectorSettings, auto_drafting
from specdecode.verify import Verifier, verify_speculative
from test_engine import ALPHA, VS, chi_square_p, exact_two_token_law, sample_pairs
from tiny import make_engine, make_model, make_tokenizer

V = 32
TOK = make_tokenizer(V)


@dataclass(eq=False)
class Seq:
    slot: int = 0
    token_ids: list = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator = field(default_factory=torch.Generator)


def proposed(drafter, seq, k):
    p = drafter.propose([seq], [k])
    return p.tokens[0, : int(p.num_tokens[0])].tolist()


def brute_match(text, ctx, depth, base=0):
    """The reference: the longest suffix of ``ctx`` (<= depth) that ends at a live position of ``text``
    followed by a token, and every such position."""
    for length in range(min(depth, len(ctx)), 0, -1):
        ends = [
            p
            for p in range(len(text) - 1)
            if p - length + 1 >= base and text[p + 1] != SEP and text[p - length + 1 : p + 1] == ctx[-length:]
        ]
        if ends:
            return length, ends
    return 0, []


# -- the index -------------------------------------------------------------------------------------------------
#       0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17
TEXT = [1, 2, 3, 7, 5, 1, 2, 3, 8, 6, 1, 2, 3, 8, 4, 1, 2, 3]


def test_the_longest_match_and_its_most_frequent_continuation():
    index = SuffixIndex(8)
    index.extend(TEXT)
    assert index.match(TEXT) == (3, [2, 7, 12])  # "1 2 3" (never the current end itself)
    assert children(TEXT, [2, 7, 12]) == [(8, [8, 13]), (7, [3])]  # counts 2 and 1, most frequent first
    draft = walk(TEXT, [2, 7, 12], 3, 0.1)
    # 8 (2 of 3), then 6 and 4 once each: the latest (4) at 2/3 * 1/2, then "1" on the one occurrence left
    assert draft.tokens == [8, 4, 1]
    assert draft.confidence == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert draft.parents == [-1, 0, 1]


def test_the_confidence_threshold_ends_the_chain():
    assert walk(TEXT, [2, 7, 12], 8, 0.5).tokens == [8]  # the second token's path confidence is 1/3
    assert walk(TEXT, [2, 7, 12], 8, 0.7).tokens == []
    assert walk(TEXT, [2, 7, 12], 8, 0.0).tokens == [8, 4, 1, 2, 3]  # to the end of the text


def test_depth_caps_the_match_and_the_match_caps_the_draft():
    drafter = SuffixDrafter(depth=2)
    assert drafter.history.index.levels == (1, 2)
    seq = Seq(0, list(TEXT))
    drafter.start([0], [TEXT])
    assert proposed(drafter, seq, 8) == [8, 4]  # "2 3" matched: at most 2 tokens (factor 1)
    assert proposed(SuffixDrafter(depth=1), seq, 8) == [8]  # "3": one
    assert proposed(SuffixDrafter(depth=8), seq, 8) == [8, 4, 1]
    assert proposed(SuffixDrafter(depth=8, factor=2.0), seq, 8) == [8, 4, 1, 2, 3]
    assert proposed(SuffixDrafter(depth=8), seq, 2) == [8, 4]  # and k caps it


def test_a_shorter_match_drafts_when_the_longest_can_offer_less():
    """In a run the longest match ends just before the end (one token after it); "x x" offers k."""
    drafter = SuffixDrafter(depth=64)
    seq = Seq(0, [1] + [25] * 10)
    drafter.start([0], [seq.token_ids])
    assert _fresh(seq.token_ids, 64).match(seq.token_ids) == (9, [9])
    assert proposed(drafter, seq, 4) == [25] * 4


@pytest.mark.parametrize("depth", [1, 3, 5, 8, 64])
def test_match_equals_brute_force(depth):
    rng = random.Random(depth)
    for _ in range(150):
        vocab = rng.randint(2, 6)
        text = [rng.randrange(vocab) for _ in range(rng.randint(1, 90))]
        index = SuffixIndex(depth)
        index.extend(text)
        assert index.match(text) == brute_match(text, text, depth)
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]  # another sequence's suffix
        assert index.match(ctx) == brute_match(text, ctx, depth)


def test_rollback_leaves_the_index_a_fresh_one_would_have():
    rng = random.Random(0)
    index = SuffixIndex(8)
    text = []
    for _ in range(60):
        if text and rng.random() < 0.3:
            keep = rng.randrange(len(text))
            index.truncate(keep)
            del text[keep:]
        new = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        index.extend(new)
        text += new
        fresh = SuffixIndex(8)
        fresh.extend(text)
        assert index.tokens == fresh.tokens and index.maps == fresh.maps


def test_the_drafter_follows_its_sequence_through_growth_rollback_and_moves():
    drafter = SuffixDrafter(depth=8, history=0)
    seq = Seq(0, [1, 2, 3, 4, 1, 2])
    drafter.start([0], [list(seq.token_ids)])
    assert proposed(drafter, seq, 4) == [3, 4]
    seq.token_ids += [3, 4, 1]
    assert proposed(drafter, seq, 4) == [2, 3, 4, 1]  # "1 2 3 4 1" matched, its continuation runs to the end
    seq.token_ids[:] = [1, 2, 9, 1, 2, 9, 1]  # changed behind its back: it rolls back to the common prefix
    assert proposed(drafter, seq, 4) == [2, 9, 1]
    assert drafter._slots[0].index.maps == _fresh(seq.token_ids, 8).maps
    drafter.move(0, 3)
    seq.slot = 3
    seq.token_ids += [2]
    assert proposed(drafter, seq, 4) == [9, 1, 2]
    assert set(drafter._slots) == {3}
    drafter.release(3)
    assert drafter._slots == {}
    drafter.release(5)  # a slot it never held


def _fresh(tokens, depth):
    index = SuffixIndex(depth)
    index.extend(tokens)
    return index


# -- the cross-request history ------------------------------------------------------------------------------------
def test_a_released_output_drafts_for_later_requests_and_not_when_off():
    for budget in (1000, 0):
        drafter = SuffixDrafter(depth=8, history=budget)
        first = Seq(0, [30, 31])
        drafter.start([0], [[30, 31]])
        first.token_ids += [10, 11]
        proposed(drafter, first, 4)
        first.token_ids += [12, 13, 14, 15]  # accepted at the last step: read at release through the sequence
        drafter.release(0)
        assert drafter.history.outputs() == ([[10, 11, 12, 13, 14, 15]] if budget else [])  # the output only
        later = Seq(0, [20, 21, 22, 10, 11])  # its prompt has never seen what followed "10 11"
        drafter.start([0], [later.token_ids])
        assert proposed(drafter, later, 8) == ([12, 13] if budget else [])  # matched 2: at most 2 tokens
        later.token_ids += [12, 13, 14]
        assert proposed(drafter, later, 8) == ([15] if budget else [])  # never past the end of that output


def test_the_longer_draft_wins_between_the_sequence_and_the_history():
    drafter = SuffixDrafter(depth=8)
    drafter.history.add([5, 6, 7, 8, 9, 1, 2])
    seq = Seq(0, [6, 7, 1, 5, 6, 7])
    drafter.start([0], [seq.token_ids])
    assert proposed(drafter, seq, 4) == [8, 9, 1]  # history: "5 6 7" (3 tokens) beats its own "6 7" -> 1 (2)
    seq2 = Seq(1, [3, 4, 5, 6, 0, 3, 4, 5, 6])
    drafter.start([1], [seq2.token_ids])
    assert proposed(drafter, seq2, 4) == [0, 3, 4, 5]  # its own "3 4 5 6" beats the history's "5 6"


def test_calibrating_the_cost_model_leaves_next_to_nothing_in_the_history(target):
    """Calibration drives the drafter on synthetic sequences grown past their max_new_tokens; those
    are not outputs to learn from (at most the last short ones, after a restart, remain)."""
    from specdecode import costmodel

    drafter = SuffixDrafter()
    runner = HFRunner(target, 4, 96)
    costmodel.calibrate(runner, {"suffix": drafter}, 4, 5, 4, 96, reps=2, prompt_len=24)
    assert drafter.history.live <= 4 * (4 + 1)

    class Unguarded(SuffixDrafter):  # the control: it records every output, however long
        def _state(self, seq):
            state = super()._state(seq)
            state.max_new = None
            return state

    unguarded = Unguarded()
    costmodel.calibrate(runner, {"suffix": unguarded}, 4, 5, 4, 96, reps=2, prompt_len=24)
    assert unguarded.history.live > 100  # calibration does grow long sequences


def test_the_history_is_bounded_and_evicts_whole_requests_first_in_first_out():
    history = History(depth=4, budget=10)
    for out in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        history.add(out)
    assert history.outputs() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert history.index.match([0, 1, 2]) == (0, [])  # the evicted request is never matched
    assert history.index.match([7]) != (0, [])
    history.add(list(range(20, 40)))  # longer than the budget: its last 10 tokens, alone
    assert history.outputs() == [list(range(30, 40))]
    rng = random.Random(1)
    for _ in range(200):  # compaction keeps the text within ~2 budgets and the matches right
        history.add([rng.randrange(5) for _ in range(rng.randint(1, 4))])
        assert history.live <= 10 and len(history.index) <= 2 * (10 + len(history.requests)) + 5
        ctx = [rng.randrange(5) for _ in range(3)]
        assert history.index.match(ctx) == brute_match(history.index.tokens, ctx, 4, history.index.base)


# -- trees -----------------------------------------------------------------------------------------------------
def test_trees_take_the_most_frequent_children_best_first():
    text = [9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 9, 1, 2, 5, 9, 1, 2]
    index = _fresh(text, 8)
    length, ends = index.match(text)
    assert length == 3 and ends == [2, 6, 10, 14]  # "9 1 2": followed by 3 (twice), 4, 5

    def roots(tree):
        return [(t, c) for t, p, c in zip(tree.tokens, tree.parents, tree.confidence) if p == -1]

    tree = grow_tree(text, ends, 3, 16, 3, 0.1)
    assert roots(tree) == [(3, 0.5), (5, 0.25), (4, 0.25)]  # most frequent first, then the latest
    assert tree.tokens[:3] == [3, 9, 1]  # best first: the 0.5 branch before the 0.25 siblings
    assert all(p < i for i, p in enumerate(tree.parents))  # parents before children
    depth = [0] * len(tree.tokens)
    for i, p in enumerate(tree.parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    assert max(depth) == 3 and len(tree.tokens) == 9  # three branches of depth 3
    assert [t for t, _ in roots(grow_tree(text, ends, 3, 16, 2, 0.1))] == [3, 5]  # at most topk children
    assert len(grow_tree(text, ends, 3, 4, 3, 0.1).tokens) == 4  # at most max_nodes
    assert grow_tree(text, ends, 3, 16, 3, 0.3).tokens == [3, 9, 1]  # siblings under 0.3 are cut
    drafter = SuffixDrafter(depth=8, tree_topk=3, tree_nodes=5)
    p = drafter.propose([Seq(0, text)], [3])
    assert p.rule == "deterministic" and p.probs is None and drafter.max_tree_nodes == 5
    assert p.tokens[0].tolist() == [3, 9, 1, 5, 4] and p.parents[0].tolist() == [-1, 0, 1, -1, -1]


# -- the spec --------------------------------------------------------------------------------------------------
def test_the_spec_parses_and_refuses_bad_options():
    from specdecode.drafters import DraftContext, build_drafter

    assert parse_draft("suffix").kind == "suffix" and not parse_draft("suffix").loads_model
    check_draft("suffix:depth=16,history=0,prob=0.2,factor=0.5")
    for bad in ("suffix:depth=0", "suffix:deep=3", "suffix:prob=2", "suffix:history=-1", "suffix:depth=x"):
        with pytest.raises(DraftSpecError):
            check_draft(bad)

    d = build_drafter(
        "suffix:depth=16,history=0,prob=0.2", DraftContext(None, DraftSettings(tree_topk=2, tree_nodes=7))
    )
    assert (d.depth, d.history.budget, d.min_prob, d.tree_topk, d.max_tree_nodes, d.free) == (16, 0, 0.2, 2, 7, True)


# -- through the engine ----------------------------------------------------------------------------------------
PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2],
    [4, 5, 6, 7, 8, 9, 10],
    [11],
    [20, 21, 22, 5, 6, 20, 21, 22, 5],
    [3, 3, 3, 3, 3],
]


def greedy(n=30):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return make_model(V, seed=0)


@pytest.fixture(scope="module")
def reference(target):
    return [o.token_ids for o in make_engine(target, TOK, num_slots=2).generate(PROMPTS, greedy())]


def test_greedy_chains_equal_target_only_and_speculate(target, reference):
    engine = Engine(
        HFRunner(target), TOK, SuffixDrafter(), 4, EngineSettings(max_batch_size=2, max_context=80)
    )  # ragged: moves
    outs = engine.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats.drafted for o in outs) > 0 and sum(o.stats.accepted for o in outs) > 0
    assert len(engine.drafter.history.requests) == len(PROMPTS)


def test_the_history_drafts_a_repeated_request_and_only_with_history(target):
    prompt = [7, 9, 11, 13, 2]
    accepted = {}
    for budget in (65536, 0):
        engine = Engine(
            HFRunner(target), TOK, SuffixDrafter(history=budget), 4, EngineSettings(max_batch_size=1, max_context=80)
        )
        first, again = (engine.generate([prompt], greedy(40))[0] for _ in range(2))
        assert again.token_ids == first.token_ids
        accepted[budget] = (first.stats.accepted, again.stats.accepted)
    assert accepted[0][1] == accepted[0][0]  # without history the second run drafts what the first did
    assert accepted[65536][1] > accepted[65536][0]  # with it, the first run's output is drafted


@pytest.mark.parametrize("topk,nodes", [(2, 6), (3, 12)])
def test_greedy_trees_equal_target_only(target, reference, topk, nodes):
    engine = Engine(
        HFRunner(target),
        TOK,
        SuffixDrafter(tree_topk=topk, tree_nodes=nodes, min_prob=0.05),
        4,
        EngineSettings(max_batch_size=2, max_context=80, max_tree_nodes=nodes),
    )
    outs = engine.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats.accepted for o in outs) > 0
    assert sum(o.stats.nodes for o in outs) > sum(o.stats.drafted for o in outs)  # some steps were real trees


def flat_cost(names, per_token):
    """Verify costs 1 + 0.001 per extra token (and row); each part ``per_token[name]`` per drafted token."""
    batches, widths = (1, 2, 4), (1, 2, 3, 5, 9)
    verify = {b: {w: 1 + 0.01 * b + 0.001 * b * (w - 1) for w in widths} for b in batches}
    draft = {n: {r: {k: per_token[n] * k for k in (1, 2, 4, 8)} for r in batches} for n in names}
    return CostModel(verify, draft)


def test_auto_beside_a_draft_model_and_ngram_equals_target_only(target, reference):
    from tiny import perturbed_copy

    parts = {
        "model": DraftModelDrafter(HFRunner(perturbed_copy(target, 0.2))),
        "ngram": NgramDrafter(),
        "suffix": SuffixDrafter(),
    }
    multi, policy = auto_drafting(
        parts,
        flat_cost(parts, {"model": 0.02, "ngram": 0.001, "suffix": 0.001}),
        max_k=6,
        catch_up_tokens=4,
        settings=SelectorSettings(explore_every=3),
    )
    engine = Engine(HFRunner(target), TOK, multi, policy, EngineSettings(max_batch_size=2, max_context=80))
    outs = engine.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == reference
    chosen = {label.split(":")[0] for o in outs for label in o.stats.choices}
    assert "suffix" in chosen  # it drafted for some steps
    assert policy.history["suffix"].requested > 0


def test_generate_with_suffix_beside_ngram_under_auto_keeps_the_greedy_output(capsys):
    from specdecode.cli import main

    common = [
        "generate",
        "--backend",
        "toy",
        "--target",
        "toy:1",
        "--prompt",
        "abcabcabcab",
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--json",
    ]
    assert main(common) == 0
    base = json.loads(capsys.readouterr().out)
    assert main([*common, "--draft", "suffix", "--draft", "ngram", "--draft-policy", "auto"]) == 0
    out = capsys.readouterr()
    spec = json.loads(out.out)
    assert spec["token_ids"] == base["token_ids"], out.err
    assert main([*common, "--draft", "suffix:depth=16", "-k", "3"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["token_ids"] == base["token_ids"] and fixed["stats"]["drafted"] > 0


# -- the sampled law -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    return make_model(VS, seed=5, scale=0.5)


LAW_PROMPT = [5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2]  # "1 2" -> 3 or 4: chains 4 7 (the latest), trees 3 .. and 4 ..


class Counting(SuffixDrafter):
    """Counts the tokens it drafts and the proposals that were real trees (several roots)."""

    drafted, trees = 0, 0

    def propose(self, seqs, num_tokens):
        p = super().propose(seqs, num_tokens)
        self.drafted += int(p.num_tokens.sum())
        if p.parents is not None:
            self.trees += int(
                ((p.parents == -1) & (torch.arange(p.tokens.shape[1]) < p.num_tokens[:, None])).sum(1).gt(1).sum()
            )
        return p


def law_engine(model, drafter, verifier=None, nodes=0):
    return Engine(
        HFRunner(model),
        make_tokenizer(VS),
        drafter,
        2,
        EngineSettings(max_batch_size=250, max_context=16, max_tree_nodes=nodes),
        verifier=verifier,
    )


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)], ids=["T1", "T0.7-p0.9"])
def test_sampled_chains_follow_the_target_law(small, sp):
    """4000 samples of the first two tokens (max_new_tokens=3: the first step drafts 2); the history
    fills with earlier samples' outputs as the batches go, so both indexes propose."""
    drafter = Counting()
    counts = sample_pairs(law_engine(small, drafter), LAW_PROMPT, sp, 4000, 250, max_new_tokens=3)
    assert chi_square_p(counts, exact_two_token_law(small, LAW_PROMPT, sp), 4000) > ALPHA
    assert drafter.drafted >= 2 * 4000 and len(drafter.history.requests) > 0


def test_sampled_trees_follow_the_target_law(small):
    """Deterministic siblings (rule c): the first step of every sample verifies a tree with two roots."""
    sp = SamplingParams(1.0)
    drafter = Counting(tree_topk=3, tree_nodes=6)
    counts = sample_pairs(law_engine(small, drafter, nodes=6), LAW_PROMPT, sp, 4000, 250, max_new_tokens=3)
    assert chi_square_p(counts, exact_two_token_law(small, LAW_PROMPT, sp), 4000) > ALPHA
    assert drafter.trees >= 4000


def test_negative_control_a_wrong_residual_is_detected(small):
    """Sampling the target law instead of the residual after a rejected point mass is biased; the same
    test on the suffix drafter's proposals must reject it (the test has power here)."""
    from specdecode.sampling import sample

    def wrong(draft_tokens, draft_probs, target_probs, num_draft, uniforms):
        res = verify_speculative(draft_tokens, draft_probs, target_probs, num_draft, uniforms)
        rows = torch.arange(len(num_draft))
        res.tokens[rows, res.num_accepted] = sample(target_probs[rows, res.num_accepted], uniforms[:, -1])
        return res

    sp = SamplingParams(1.0)
    engine = law_engine(small, SuffixDrafter(), verifier=Verifier(speculative=wrong))
    counts = sample_pairs(engine, LAW_PROMPT, sp, 4000, 250, max_new_tokens=3)
    assert chi_square_p(counts, exact_two_token_law(small, LAW_PROMPT, sp), 4000) < ALPHA
