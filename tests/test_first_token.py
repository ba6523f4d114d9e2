"""The first token of a request comes from the target alone; the drafter sees the prompt after it.
Server-side queue / prefill / first-token times reach the response's usage, /metrics and `load`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdecode.config import EngineSettings
from specdecode.drafters.base import DrafterBase
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import Engine
from specdecode.load.client import _read_extras
from specdecode.load.records import LevelRun, RequestRecord
from specdecode.load.stats import summarize
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams
from test_server_harness import KEY, engine, one_torch_thread, serve  # noqa: F401
from tiny import make_model, make_tokenizer

V = 32
TOK = make_tokenizer(V)


class LoggingDrafter(DrafterBase):
    """n-gram proposals; logs every call the engine makes, in order."""

    name = "logging"

    def __init__(self, log: list) -> None:
        self.inner, self.log = NgramDrafter(max_ngram=2), log

    def start(self, slots, prompts):
        self.log.append(("start", tuple(slots)))

    def propose(self, seqs, num_tokens):
        self.log.append(("propose", tuple(s.slot for s, k in zip(seqs, num_tokens) if k)))
        return self.inner.propose(seqs, num_tokens)

    def release(self, slot):
        self.log.append(("release", slot))


def test_first_token_comes_from_the_target_before_any_drafter_work():
    log: list = []
    target = HFRunner(make_model(V, seed=2))
    eng = Engine(
        target,
        TOK,
        LoggingDrafter(log),
        3,
        EngineSettings(max_batch_size=2, max_context=96, first_token_from_target=True),
    )
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    a = eng.add([1, 2, 3, 1, 2, 3, 1, 2], params)
    first = eng.step()
    assert [len(ev.new_token_ids) for ev in first] == [1] and first[0].drafted == 0
    assert log == []  # a's first token: no drafter call at all

    b = eng.add([5, 6, 5, 6, 5, 6], params)  # admitted while a decodes
    second = {ev.seq.request_id: ev for ev in eng.step()}
    assert log[0] == ("start", (a.slot,))  # a's drafter prefill, in the step after its first token
    assert all(b.slot not in entry[1] for entry in log if entry[0] == "start")
    assert second[b.request_id].drafted == 0 and len(second[b.request_id].new_token_ids) == 1
    assert log[1] == ("propose", (a.slot,))  # a speculates in the same step, b does not

    log.clear()
    third = {ev.seq.request_id: ev for ev in eng.step()}
    assert log[:2] == [("start", (b.slot,)), ("propose", (a.slot, b.slot))] and len(third) == 2

    while eng.running:
        eng.step()
    ref = Engine(HFRunner(make_model(V, seed=2)), TOK, None, 0, EngineSettings(max_batch_size=1, max_context=96))
    for seq in (a, b):
        assert seq.output_ids == ref.generate([seq.prompt_ids], params)[0].token_ids


def test_a_request_that_ends_at_its_first_token_never_reaches_the_drafter():
    log: list = []
    eng = Engine(
        HFRunner(make_model(V, seed=2)),
        TOK,
        LoggingDrafter(log),
        3,
        EngineSettings(max_batch_size=2, max_context=96, first_token_from_target=True),
    )
    out = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1))
    assert len(out[0].token_ids) == 1 and log == []


def test_by_default_the_drafter_prefills_at_admission():
    log: list = []
    eng = Engine(
        HFRunner(make_model(V, seed=2)), TOK, LoggingDrafter(log), 3, EngineSettings(max_batch_size=2, max_context=96)
    )
    eng.add([1, 2, 3, 1, 2], SamplingParams(max_new_tokens=8))
    assert log == [("start", (0,))]


def test_server_reports_queue_prefill_and_first_token_times():
    with serve(engine(k=3)) as s, s.http() as c:
        body = c.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 6}).json()
        usage = body["usage"]
        assert usage["completion_tokens"] == 6
        assert 0 <= usage["queue_time_s"] <= usage["time_to_first_token_s"]
        assert 0 < usage["prefill_time_s"] <= usage["time_to_first_token_s"]
        events = []
        with c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            events = [line for line in r.iter_lines() if '"usage"' in line]
        assert events and "time_to_first_token_s" in events[-1]
        m = s.wait_idle()
        assert m["specdecode_prefill_time_seconds_count"] == 2


def test_load_reads_and_summarizes_the_servers_times():
    run = LevelRun("A", 1, "concurrency")
    for i, (q, p, t) in enumerate([(0.0, 0.1, 0.3), (0.2, 0.1, 0.5)]):
        record = RequestRecord(i, f"p{i}", "completion", 8, 0.0, latency_s=1.0, ttft_s=t + 0.01, output_tokens=8)
        _read_extras(
            {
                "usage": {
                    "prompt_tokens": 3,
                    "completion_tokens": 8,
                    "queue_time_s": q,
                    "prefill_time_s": p,
                    "time_to_first_token_s": t,
                }
            },
            record,
        )
        assert record.server_timing == {"queue_time_s": q, "prefill_time_s": p, "time_to_first_token_s": t}
        run.records.append(record)
    run.wall_s = 2.0
    summary = summarize(run)
    assert summary.server_ttft["p50"] == pytest.approx(0.4)
    assert summary.server_queue["mean"] == pytest.approx(0.1) and summary.server_prefill["p99"] == pytest.approx(0.1)


def _second_and_third_token_counts(engine, sp, n, batch=250):
    from test_engine import VS

    counts = torch.zeros(VS, VS)
    for start in range(0, n, batch):
        params = [
            SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed=start + i, max_new_tokens=3, ignore_eos=True)
            for i in range(batch)
        ]
        for out in engine.generate([[1, 2, 3]] * batch, params):
            counts[out.token_ids[1], out.token_ids[2]] += 1
    return counts


def _marginal_law(target, sp):
    """P(t2, t3) = sum over t1 of P(t1) P(t2, t3 | t1), from the target alone."""
    from test_engine import VS, exact_two_token_law

    first = exact_two_token_law(target, [1, 2, 3], sp).sum(1)  # P(t1)
    return sum(first[a] * exact_two_token_law(target, [1, 2, 3, a], sp) for a in range(VS))


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "negative-control"])
def test_tokens_after_a_target_first_token_follow_the_target_law(wrong):
    """Chi-square GOF (bound ALPHA = 1e-4) of tokens 2 and 3 with first_token_from_target: token 1
    from the target alone, then the drafter's first chain (1 token: accepted + bonus, or rejected +
    residual). The negative control samples from the target instead of the residual: it must fail."""
    from specdecode.verify import Verifier
    from test_verify import wrong_rule_no_residual as wrong_rule
    from test_engine import ALPHA, VS, chi_square_p
    from tiny import make_engine, perturbed_copy

    target = make_model(VS, seed=5, scale=0.5)
    engine = make_engine(
        target,
        make_tokenizer(VS),
        perturbed_copy(target, noise=0.6, seed=3),
        k=3,
        num_slots=250,
        max_len=8,
        verifier=Verifier(speculative=wrong_rule) if wrong else None,
        first_token_from_target=True,
    )
    sp = SamplingParams(1.0)
    counts = _second_and_third_token_counts(engine, sp, 4000)
    p = chi_square_p(counts, _marginal_law(target, sp), 4000)
    assert (p < ALPHA) if wrong else (p > ALPHA)


def test_a_request_that_opted_out_of_speculation_never_reaches_the_drafter():
    log: list = []
    eng = Engine(
        HFRunner(make_model(V, seed=2)),
        TOK,
        LoggingDrafter(log),
        3,
        EngineSettings(max_batch_size=2, max_context=96, first_token_from_target=True),
    )
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    quiet = eng.add([1, 2, 3, 1, 2], replace(params, speculation=False), request_id="quiet")
    loud = eng.add([4, 5, 4, 5], params, request_id="loud")
    while eng.running:
        eng.step()
    # loud sat in slot 1 when its drafter started (both run 10 tokens, so quiet still held slot 0)
    assert [entry for entry in log if entry[0] == "start"] == [("start", (1,))]
    proposed = [entry[1] for entry in log if entry[0] == "propose"]
    assert proposed and all(slots == (1,) for slots in proposed)  # only loud was ever asked to draft
    assert quiet.stats.drafted == 0 and len(quiet.output_ids) == 10 and loud.stats.drafted > 0


def test_an_opted_out_request_keeps_no_target_features_for_a_feature_drafter():
    class FeatureLogger(LoggingDrafter):
        feature_layers = (-1,)

        def observe(self, slots, features):
            self.log.append(("observe", tuple(slots)))

    log: list = []
    eng = Engine(
        HFRunner(make_model(V, seed=2)),
        TOK,
        FeatureLogger(log),
        3,
        EngineSettings(max_batch_size=2, max_context=96, first_token_from_target=True),
    )
    quiet = eng.add(
        [1, 2, 3, 1, 2], SamplingParams(max_new_tokens=12, ignore_eos=True, speculation=False), request_id="quiet"
    )
    for _ in range(4):
        eng.step()
    assert quiet.draft.early_features == [] and not quiet.draft.started and log == []
