"""The step reads top to bottom: the policy's plan only decides (it runs no model forward), and the drafter
side does the catch-up reads the plan names, then proposes; the drafter's lifecycle is the drafter side's
(:class:`specdecode.drafters.session.DraftSession`). Counts and orderings only, never a clock."""

from __future__ import annotations

import pytest
import torch

from specdecode.config import EngineSettings
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.multi import MultiDrafter, Parts
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import Engine
from specdecode.models.hf import HFRunner
from specdecode.policy import Plan, Read
from specdecode.sampling import SamplingParams
from specdecode.selector import AutoPolicy, SelectorSettings
from test_selector import TOK, USELESS, V, CountingRunner, Req, flat_cost, teach
from tiny import make_model, perturbed_copy


def _late_model(target, catch_up_tokens=8):
    """A draft model (its runner counting forwards) and n-gram lookup that never helps, chosen among by a
    selector that reads a late start's backlog ``catch_up_tokens`` a step beside other sequences."""
    runner = CountingRunner(HFRunner(perturbed_copy(target, 0.1)))
    cost = flat_cost(verify_per_token=0.001, drafts={"model": 0.02, "ngram": 0.001})
    parts = Parts({"model": DraftModelDrafter(runner), "ngram": NgramDrafter()})
    policy = AutoPolicy(
        list(parts),
        cost,
        parts,
        max_k=4,
        catch_up_tokens=catch_up_tokens,
        settings=SelectorSettings(explore_every=2),
        history={"ngram": USELESS},
    )
    return runner, parts, policy, MultiDrafter(parts, policy.route, cost.record)


def test_a_plan_that_names_catch_up_reads_runs_no_forward_and_the_drafter_side_reads_them():
    target = make_model(V, seed=0)
    runner, parts, policy, multi = _late_model(target)
    multi.reserve(2, 80)
    gen = torch.Generator().manual_seed(5)
    seqs = [Req(slot=i, token_ids=torch.randint(1, V, (40,), generator=gen).tolist()) for i in range(2)]
    for s in seqs:
        s.params = SamplingParams(max_new_tokens=200)
        teach(policy, s, "model", [4, 4, 4, 4])
    multi.start([s.slot for s in seqs], [s.token_ids[:30] for s in seqs])  # (lazy: remembered, not read)
    assert runner.calls == [] and parts.lag(seqs[0], "model") == 39

    plan = policy.plan(seqs, 2)
    assert isinstance(plan, Plan) and runner.calls == []  # deciding ran no model
    assert plan.reads and all(isinstance(r, Read) and r.part == "model" and r.budget == 8 for r in plan.reads)
    assert [s for r in plan.reads for s in r.seqs] == seqs  # both are 39 tokens behind: both read first
    assert plan.lengths == [0, 0]  # meanwhile neither drafts with it (n-gram lookup never helps)

    multi.read_ahead(plan.reads)  # what the engine has the drafter side do
    assert runner.calls  # the catch-up ran: 8 tokens in all, the first sequence's (oldest first)
    assert parts.lag(seqs[0], "model") <= 39 - 8 < parts.lag(seqs[1], "model")  # (the second waits its turn)


def test_through_the_engine_plans_run_no_forward_and_the_catch_up_still_happens():
    """Two 30-token prompts, the draft model chosen late and read in pieces: every plan runs no forward of
    the draft model, reads happen between plan and proposal, and the greedy outputs equal target-only."""
    target = make_model(V, seed=0)
    runner, parts, policy, multi = _late_model(target)
    plan, forwards_in_plans, plans = policy.plan, [], []

    def counted_plan(seqs, batch_size):
        before = len(runner.calls)
        out = plan(seqs, batch_size)
        forwards_in_plans.append(len(runner.calls) - before)
        plans.append(out)
        return out

    policy.plan = counted_plan
    engine = Engine(HFRunner(target), TOK, multi, policy, EngineSettings(max_batch_size=2, max_context=80))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, V, (30,), generator=gen).tolist() for _ in range(2)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reference = Engine(HFRunner(target), TOK, None, 0, EngineSettings(max_batch_size=2, max_context=80)).generate(
        prompts, params
    )
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert plans and set(forwards_in_plans) == {0}  # no plan ran a forward ...
    assert any(p.reads for p in plans) and runner.calls  # ... yet the catch-up reads it named were done
    assert sum(n for o in outs for label, n in o.stats.choices.items() if label.startswith("model:")) > 0


def test_a_request_that_does_not_speculate_is_never_planned_nor_drafted():
    """``SamplingParams.speculation = False`` travels with the request: no side table, nothing to clear."""
    target = make_model(V, seed=0)
    runner, parts, policy, multi = _late_model(target)
    planned = []
    plan = policy.plan
    policy.plan = lambda seqs, b: planned.extend(s.request_id for s in seqs) or plan(seqs, b)
    engine = Engine(HFRunner(target), TOK, multi, policy, EngineSettings(max_batch_size=2, max_context=80))
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    quiet = engine.add([1, 2, 3, 4], SamplingParams(max_new_tokens=12, ignore_eos=True, speculation=False), "quiet")
    loud = engine.add([5, 6, 7, 8], greedy, "loud")
    while engine.running:
        engine.step()
    assert "quiet" not in planned and "loud" in planned
    assert quiet.stats.drafted == 0 and not quiet.draft.started and len(quiet.output_ids) == 12
    assert loud.draft.started


def test_each_registry_entry_declares_the_capabilities_its_drafter_has():
    """``DrafterKind.capabilities`` is what the drafter class adds to the protocol (``capabilities``), so the
    declaration cannot drift from the code; a new kind must be listed here."""
    from specdecode.drafters import KINDS
    from specdecode.drafters.base import CAPABILITIES, capabilities
    from specdecode.drafters.cross_vocab import CrossVocabDrafter
    from specdecode.drafters.eagle import EagleDrafter
    from specdecode.drafters.medusa import MedusaDrafter
    from specdecode.drafters.suffix import SuffixDrafter

    classes = {
        "model": DraftModelDrafter,
        "xvocab": CrossVocabDrafter,
        "xvocab-tli": CrossVocabDrafter,
        "ngram": NgramDrafter,
        "suffix": SuffixDrafter,
        "medusa": MedusaDrafter,
        "eagle": EagleDrafter,
    }
    assert set(classes) == set(KINDS)
    for kind, cls in classes.items():
        assert KINDS[kind].capabilities <= set(CAPABILITIES), kind
        assert capabilities(cls.__new__(cls)) == KINDS[kind].capabilities, kind
    assert {k for k, e in KINDS.items() if e.cross_vocabulary} == {"xvocab", "xvocab-tli"}
    assert {k for k, e in KINDS.items() if e.files} == {"model", "xvocab", "xvocab-tli", "medusa", "eagle"}


def test_the_scheduler_takes_an_engine_built_for_serving_and_writes_nothing_onto_it():
    from specdecode.server.metrics import ServerMetrics
    from specdecode.server.scheduler import Scheduler
    from test_server_harness import engine as serving_engine

    for missing in ("first_token_from_target", "isolate_drafter_faults"):
        with pytest.raises(ValueError, match="built for serving"):
            Scheduler(serving_engine(**{missing: False}), ServerMetrics())
    eng = serving_engine()
    before = {name: id(value) for name, value in vars(eng).items()}
    scheduler = Scheduler(eng, ServerMetrics(), speculation=False)
    assert {name: id(value) for name, value in vars(eng).items()} == before  # nothing written onto it
    assert not scheduler.speculation_enabled and eng.drafter is not None  # --no-speculation is the scheduler's
    assert (scheduler.tokenizer, scheduler.max_context) == (eng.tokenizer, eng.max_context)


def test_a_request_is_validated_once_and_its_speculation_travels_with_it():
    """Through the HTTP app: one ``Engine.validate`` per request whatever its ``n`` (the app asks the scheduler,
    which checks once and queues the choices; the engine admits them unchecked), a bad one refused with a 400;
    ``"speculation": false`` reaches the engine as each choice's ``SamplingParams.speculation``."""
    from test_server_harness import KEY, MODEL, serve
    from test_server_harness import engine as serving_engine

    eng = serving_engine()
    checked, admitted = [], []
    validate, admit = eng.validate, eng.admit
    eng.validate = lambda prompt_ids, params: checked.append(params) or validate(prompt_ids, params)
    eng.admit = lambda requests, checked=False: admitted.extend(p for _, p, _ in requests) or admit(requests, checked)
    with serve(eng) as s, s.http(KEY) as c:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 7}
        assert c.post("/v1/completions", json=body).status_code == 200
        assert len(checked) == 1 and len(admitted) == 3
        r = c.post("/v1/completions", json=body | {"n": 2, "speculation": False})
        assert r.status_code == 200 and r.json()["speculation"]["drafted"] == 0
        assert len(checked) == 2 and [p.speculation for p in admitted[3:]] == [False, False]
        too_long = c.post("/v1/completions", json=body | {"n": 1, "max_tokens": 10_000})
        assert too_long.status_code == 400 and len(checked) == 3 and len(admitted) == 5
