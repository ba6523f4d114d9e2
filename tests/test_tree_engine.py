"""Trees through the whole engine on tiny models: greedy equality with target-only decoding, the
sampled law (chi-square at ALPHA = 1e-4 per setting, with a negative control), and the draft
model's K/V after its tree branch is compacted equal to a fresh prefill of the same tokens."""

from __future__ import annotations

import pytest
import torch

from specdecode.config import EngineSettings
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import Engine
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams
from specdecode.verify import Verifier, verify_tree
from specdecode.verify.tree import IID
from test_engine import ALPHA, VS, chi_square_p, exact_two_token_law, sample_pairs
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy
from specdecode.models.backends.toy import ToyRunner

V = 32
TOK = make_tokenizer(V)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3, 3, 3, 3, 3], [20, 21, 22, 23, 20, 21, 22, 5, 6]]


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, seed=0)
    return target, perturbed_copy(target, noise=0.15)


def tree_engine(target, draft, k, topk, nodes, slots=3, max_len=64, verifier=None):
    drafter = DraftModelDrafter(HFRunner(draft), tree_topk=topk, tree_nodes=nodes)
    return Engine(
        HFRunner(target),
        TOK if target.config.vocab_size == V else make_tokenizer(VS),
        drafter,
        k,
        EngineSettings(max_batch_size=slots, max_context=max_len, max_tree_nodes=nodes),
        verifier=verifier,
    )


@pytest.mark.parametrize("k,topk,nodes", [(3, 2, 6), (4, 3, 12), (5, 2, 16), (2, 4, 4)])
def test_greedy_draft_model_trees_equal_target_only(pair, k, topk, nodes):
    target, draft = pair
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reference = make_engine(target, TOK, num_slots=2).generate(PROMPTS, params)
    outs = tree_engine(target, draft, k, topk, nodes).generate(PROMPTS, params)  # 3 slots, 5 prompts: ragged
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert sum(o.stats.accepted for o in outs) > 0
    assert all(o.stats.nodes >= o.stats.drafted for o in outs)


@pytest.mark.parametrize("topk,nodes", [(2, 8), (4, 16)])
def test_greedy_ngram_trees_equal_target_only(pair, topk, nodes):
    target, _ = pair
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reference = make_engine(target, TOK, num_slots=2).generate(PROMPTS, params)
    engine = Engine(
        HFRunner(target),
        TOK,
        NgramDrafter(tree_topk=topk, tree_nodes=nodes),
        4,
        EngineSettings(max_batch_size=2, max_context=64, max_tree_nodes=nodes),
    )
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert sum(o.stats.nodes for o in outs) > sum(o.stats.drafted for o in outs)  # some steps were real trees


def test_trees_on_the_toy_runner_equal_target_only():
    target = ToyRunner(V, seed=0)
    drafter = DraftModelDrafter(ToyRunner(V, seed=1), tree_topk=3, tree_nodes=10)
    engine = Engine(target, TOK, drafter, 4, EngineSettings(max_batch_size=2, max_context=64, max_tree_nodes=10))
    outs = engine.generate([[1, 2, 3], [4, 5, 6, 7], [9]], SamplingParams(max_new_tokens=15, ignore_eos=True))
    reference = Engine(ToyRunner(V, seed=0), TOK, None, 0, EngineSettings(max_batch_size=1, max_context=64)).generate(
        [[1, 2, 3], [4, 5, 6, 7], [9]], SamplingParams(max_new_tokens=15, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]


def test_draft_kv_after_compaction_equals_a_fresh_prefill(pair):
    """The drafter's cache is invisible in greedy outputs (it only changes speed): check it directly."""
    target, draft = pair
    engine = tree_engine(target, draft, 4, 2, 8, slots=2)
    drafter = engine.drafter
    fresh = HFRunner(draft, 1, 128)
    engine.add_batch([(p, SamplingParams(max_new_tokens=30, ignore_eos=True), None) for p in PROMPTS[:2]])
    compacted = 0
    for _ in range(6):
        engine.step()
        for seq in engine.running:
            drafter._adopt_tree(seq)  # what the next propose does first
            cached = drafter._cached[seq.slot]
            compacted += len(cached) > drafter._floor[seq.slot]
            fresh.prefill([0], [cached])
            for (k1, v1), (k2, v2) in zip(
                drafter.runner.export_kv(seq.slot, len(cached)), fresh.export_kv(0, len(cached))
            ):
                torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-4)
    assert compacted > 0  # some accepted branches were adopted rather than fed again


# -- the sampled law through the engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pair():
    target = make_model(VS, seed=5, scale=0.5)
    return target, perturbed_copy(target, noise=0.6, seed=3)


def sample_first_two(engine, prompt, sp, n, batch):
    """max_new_tokens = 3: the first step drafts a tree of depth 2, so both levels feed the first two tokens."""
    return sample_pairs(engine, prompt, sp, n, batch, max_new_tokens=3)


SETTINGS = [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)]


@pytest.mark.parametrize("sp", SETTINGS, ids=["T1", "T0.7-p0.9"])
def test_sampled_draft_model_trees_follow_the_target_law(small_pair, sp):
    """Siblings drawn without replacement (rule b), 3 per node, 6 nodes, depth 2; 4000 samples."""
    target, draft = small_pair
    engine = tree_engine(target, draft, 3, 3, 6, slots=250, max_len=8)
    counts = sample_first_two(engine, [1, 2, 3], sp, 4000, 250)
    assert chi_square_p(counts, exact_two_token_law(target, [1, 2, 3], sp), 4000) > ALPHA


def test_sampled_ngram_trees_follow_the_target_law(small_pair):
    """Deterministic siblings (rule c): the prompt repeats so lookup finds several continuations."""
    target, _ = small_pair
    sp = SamplingParams(1.0)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]
    engine = Engine(
        HFRunner(target),
        make_tokenizer(VS),
        NgramDrafter(max_ngram=2, tree_topk=3, tree_nodes=6),
        2,
        EngineSettings(max_batch_size=250, max_context=16, max_tree_nodes=6),
    )
    counts = sample_first_two(engine, prompt, sp, 4000, 250)
    assert chi_square_p(counts, exact_two_token_law(target, prompt, sp), 4000) > ALPHA


def test_negative_control_the_iid_rule_on_siblings_drawn_without_replacement_is_detected(small_pair):
    target, draft = small_pair
    sp = SamplingParams(1.0)

    def iid_rule(tokens, parents, num, draft_probs, target_probs, uniforms, rule):
        return verify_tree(tokens, parents, num, draft_probs, target_probs, uniforms, IID)

    engine = tree_engine(target, draft, 3, 3, 6, slots=250, max_len=8, verifier=Verifier(tree=iid_rule))
    counts = sample_first_two(engine, [1, 2, 3], sp, 4000, 250)
    assert chi_square_p(counts, exact_two_token_law(target, [1, 2, 3], sp), 4000) < ALPHA
