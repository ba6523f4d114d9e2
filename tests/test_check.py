"""`specdecode check` on tiny models: a correct engine passes every part, and each injected fault
makes the part that should catch it FAIL (the check is itself tested for power)."""

from __future__ import annotations

import pytest
import torch

import specdecode.engine as engine_mod
from specdecode.check import CheckConfig, run_check
from specdecode.check.report import FAIL, PASS, WEAK
from specdecode.config import EngineSettings
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import Engine
from specdecode.models.hf import HFRunner
from specdecode.sampling import sample
from specdecode.verify import Verifier, verify_greedy, verify_speculative
from tiny import make_model, make_tokenizer, perturbed_copy

V = 32
TOK = make_tokenizer(V)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [10, 11], [20, 21, 22, 23]]
# small budgets: every run is deterministic (seeded), so these tests cannot flake
CFG = CheckConfig(
    num_draft_tokens=3,
    law_contexts=2,
    law_samples=1500,
    e2e_samples=250,
    e2e_batch=50,
    greedy_tokens=12,
    greedy_batch=3,
    stop_tokens=12,
    seed_tokens=6,
    seed_batch=3,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a loaded 2-core machine are 10-100x slower with two OpenMP threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, seed=5, scale=0.5)
    return target, perturbed_copy(target, noise=0.3, seed=3)


def factory_for(pair, engine_cls=Engine, draft=None, speculative=None):
    """Engines on the pair; ``speculative`` replaces the verifier's sampled rule (a fault to inject)."""
    target, default_draft = pair
    draft = default_draft if draft is None else draft
    verifier = Verifier(speculative=speculative) if speculative is not None else None

    def factory(k: int, batch: int) -> Engine:
        max_len = 64
        drafter = DraftModelDrafter(HFRunner(draft)) if k else None
        settings = EngineSettings(max_batch_size=batch, max_context=max_len)
        return engine_cls(HFRunner(target), TOK, drafter, k, settings, verifier=verifier)

    return factory


def statuses(report) -> dict[int, str]:
    return {p.part: p.status for p in report.parts}


# -- faults ----------------------------------------------------------------------------------------


def verify_ignoring_temperature(draft_tokens, draft_probs, target_probs, num_draft, uniforms):
    """Accepts while the draft equals the target argmax (the greedy rule) whatever the temperature;
    the token after the accepted prefix is drawn from the target, so target-only decoding stays right."""
    res = verify_greedy(draft_tokens, target_probs.argmax(-1), num_draft)
    rows = torch.arange(len(num_draft))
    res.tokens[rows, res.num_accepted] = sample(target_probs[rows, res.num_accepted], uniforms[:, -1])
    return res


def verify_skipping_residual(draft_tokens, draft_probs, target_probs, num_draft, uniforms):
    """After a rejection, samples from the target instead of the residual."""
    res = verify_speculative(draft_tokens, draft_probs, target_probs, num_draft, uniforms)
    rows = torch.arange(len(num_draft))
    res.tokens[rows, res.num_accepted] = sample(target_probs[rows, res.num_accepted], uniforms[:, -1])
    return res


class PastEosEngine(Engine):
    """Keeps the token that follows an EOS inside the same accepted block."""

    def _append(self, seq, tokens):
        new = super()._append(seq, tokens)
        if seq.finish_reason == "stop" and new and new[-1] in self.eos_token_ids and len(new) < len(tokens):
            extra = tokens[len(new)]
            seq.token_ids.append(extra)
            new.append(extra)
        return new


class SlotSeededEngine(Engine):
    """Seeds each request's generator with seed + its batch slot."""

    def add_batch(self, requests):
        seqs = super().add_batch(requests)
        for seq in seqs:
            if seq.params.seed is not None:
                seq.generator.manual_seed(seq.params.seed + seq.slot)
        return seqs


# -- tests -----------------------------------------------------------------------------------------


def test_correct_engine_passes_every_part(pair):
    report = run_check(factory_for(pair), PROMPTS, CFG)
    assert statuses(report) == {1: PASS, 2: PASS, 3: PASS, 4: PASS, 5: PASS}, [p.summary for p in report.parts]
    assert report.passed
    law = report.part(1).details
    # the negative controls were detected: the part had power
    assert all(law["control_detected_contexts"].values())
    cuts = report.part(4).details["cases"]
    assert {(c["mode"], c["case"]) for c in cuts if c.get("inside_block")} >= {("greedy", "eos"), ("greedy", "stop")}


def test_fault_acceptance_ignoring_temperature_fails_parts_1_and_2(pair):
    report = run_check(factory_for(pair, speculative=verify_ignoring_temperature), PROMPTS, CFG)
    assert report.part(1).status == FAIL
    assert report.part(2).status == FAIL
    assert not report.passed


def test_fault_skipping_the_residual_fails_part_1(pair):
    report = run_check(factory_for(pair, speculative=verify_skipping_residual), PROMPTS, CFG)
    assert report.part(1).status == FAIL
    assert "law tests rejected" in report.part(1).summary
    assert report.part(3).status == PASS  # greedy decoding does not go through the faulty path


def test_fault_warp_ignoring_temperature_fails_part_1(pair, monkeypatch):
    """The engine verifies against the untempered target: part 1 compares with the reference warp."""
    real_warp = engine_mod.warp
    monkeypatch.setattr(engine_mod, "warp", lambda logits, t, k, p: real_warp(logits, torch.where(t > 0, 1.0, t), k, p))
    report = run_check(factory_for(pair), PROMPTS, CheckConfig(**{**CFG.__dict__, "parts": (1,)}))
    assert report.part(1).status == FAIL
    failed = [t for r in report.part(1).details["records"] for t in r.get("positions", []) if t["rejected"]]
    assert failed and all(
        r["setting"] != "T=1"
        for r in report.part(1).details["records"]
        if any(t["rejected"] for t in r.get("positions", []))
    )


def test_fault_token_past_eos_fails_part_4(pair):
    report = run_check(factory_for(pair, PastEosEngine), PROMPTS, CFG)
    assert report.part(4).status == FAIL
    bad = [c for c in report.part(4).details["cases"] if c["ok"] is False]
    assert bad and all(c["case"] == "eos" for c in bad)
    assert len(bad[0]["tokens"]) == len(bad[0]["expected_tokens"]) + 1


def test_fault_seed_depending_on_batch_position_fails_part_5(pair):
    report = run_check(factory_for(pair, SlotSeededEngine), PROMPTS, CFG)
    assert report.part(5).status == FAIL
    faults = [c for c in report.part(5).details["comparisons"] if c.get("verdict") == "seed fault"]
    assert any(c["comparison"].startswith("copy") for c in faults)
    assert report.part(1).status == PASS and report.part(3).status == PASS


def test_draft_identical_to_target_reports_no_power(pair):
    """When draft samples are indistinguishable from the target, part 1 must not claim PASS."""
    target, _ = pair
    report = run_check(
        factory_for(pair, draft=perturbed_copy(target, noise=0.0)),
        PROMPTS,
        CheckConfig(**{**CFG.__dict__, "parts": (1,), "law_samples": 500}),
    )
    assert report.part(1).status == WEAK
    assert not report.passed


def test_engine_that_crashes_is_an_error_of_the_part(pair):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    report = run_check(factory_for(pair, speculative=broken), PROMPTS, CheckConfig(**{**CFG.__dict__, "parts": (1, 3)}))
    assert report.part(1).status == "ERROR" and "boom" in report.part(1).summary
    assert report.part(3).status == PASS and report.part(2).status == "SKIP"
    assert not report.passed


# -- trees -------------------------------------------------------------------------------------------


def tree_factory_for(pair, tree_verifier=None, topk=3, nodes=8):
    """Engines whose draft model proposes dynamic trees; ``tree_verifier`` replaces the tree rule."""
    target, draft = pair
    verifier = Verifier(tree=tree_verifier) if tree_verifier is not None else None

    def factory(k: int, batch: int) -> Engine:
        drafter = DraftModelDrafter(HFRunner(draft), tree_topk=topk, tree_nodes=nodes) if k else None
        return Engine(
            HFRunner(target),
            TOK,
            drafter,
            k,
            EngineSettings(max_batch_size=batch, max_context=64, max_tree_nodes=nodes if k else 0),
            verifier=verifier,
        )

    return factory


def test_correct_tree_engine_passes_every_part(pair):
    report = run_check(tree_factory_for(pair), PROMPTS, CFG)
    assert statuses(report) == {1: PASS, 2: PASS, 3: PASS, 4: PASS, 5: PASS}, [p.summary for p in report.parts]
    assert report.part(1).name == "tree verifier law"
    assert all(report.part(1).details["control_detected_contexts"].values())


def test_fault_iid_rule_on_siblings_drawn_without_replacement_fails_part_1(pair):
    from specdecode.verify import verify_tree
    from specdecode.verify.tree import IID

    def iid(tokens, parents, num, draft_probs, target_probs, uniforms, rule):
        return verify_tree(tokens, parents, num, draft_probs, target_probs, uniforms, IID)

    report = run_check(
        tree_factory_for(pair, iid), PROMPTS, CheckConfig(**{**CFG.__dict__, "parts": (1,), "law_samples": 6000})
    )
    assert report.part(1).status == FAIL
