"""`specdecode check` with the prefix cache on: every speculative admission restores its prompt from the
engine's cache (specdecode.check.cache_hits), the law and greedy parts still pass, a run whose cache never
answers is an ERROR, and a wrong entry (another prompt's KV under this prompt's tokens) makes the check FAIL."""

from __future__ import annotations

import pytest
import torch

import specdecode.check.cache_hits as cache_hits
from specdecode.check import CheckConfig, run_check
from specdecode.check.report import ERROR, FAIL, PASS
from specdecode.verify import Verifier, verify_greedy
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy

V = 32
TOK = make_tokenizer(V)
# test_check's prompts (under one block of the index) and a longer one: a law context cut from it restores most
# of itself from an entry longer than it
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [10, 11], [20, 21, 22, 23], [(5 * i + 2) % V for i in range(20)]]
CFG = CheckConfig(num_draft_tokens=3, law_contexts=2, law_samples=1500, greedy_tokens=12, greedy_batch=3)
LLAMACPP = pytest.param("llamacpp", marks=pytest.mark.llamacpp)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, seed=5, scale=0.5)
    return target, perturbed_copy(target, noise=0.3, seed=3)


def _backend(backend):
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp", reason="needs the llama.cpp backend (scripts/install-llamacpp.sh)")


def factory_for(pair, backend=None, cache_mb=1, drafted=None, after=None):
    """Engines on the pair with a prefix cache of ``cache_mb``; ``drafted`` (a list) collects the draft
    lengths the engines' greedy verifications saw; ``after(engine)`` changes each speculative engine."""
    target, draft = pair

    def counting(draft_tokens, target_argmax, num_draft):
        drafted.append(int(num_draft.sum()))
        return verify_greedy(draft_tokens, target_argmax, num_draft)

    verifier = Verifier(greedy=counting) if drafted is not None else None

    def factory(k: int, batch: int):
        engine = make_engine(
            target,
            TOK,
            draft if k else None,
            k,
            num_slots=batch,
            max_len=64,
            backend=backend,
            verifier=verifier,
            prefix_cache_mb=cache_mb,
        )
        if k and after is not None:
            after(engine)
        return engine

    return factory


def _parts(*parts: int) -> CheckConfig:
    return CheckConfig(**{**CFG.__dict__, "parts": parts})


@pytest.mark.parametrize("backend", [None, LLAMACPP])
def test_law_greedy_and_seeds_pass_with_every_prompt_restored_from_the_cache(pair, backend) -> None:
    _backend(backend)
    drafted: list[int] = []
    report = run_check(factory_for(pair, backend, drafted=drafted), PROMPTS, _parts(1, 3, 5))
    for number in (1, 3, 5):
        assert report.part(number).status == PASS, report.part(number).summary
        hits = report.part(number).details["prefix_cache"]
        assert set(hits) == {"target", "draft"}  # both models restored from their own caches
        for role in ("target", "draft"):
            assert hits[role]["hits"] > 0 and hits[role]["hit_tokens"] > 0, (number, hits)
        assert "restored from the prefix cache" in report.part(number).summary
    # every admission of part 3 was answered from the cache (the two-token prompt's by its one token)
    greedy = report.part(3).details["prefix_cache"]["target"]
    assert greedy["hits"] == greedy["lookups"]
    law = [r["prefix_cache"] for r in report.part(1).details["records"]]
    assert law and all(r["same_logits"] and r["restored"] > 0 for r in law)
    assert max(r["restored"] for r in law) > cache_hits.HOLD + 1
    assert sum(drafted) > 0  # speculation ran on the restored prompts


def test_without_the_cache_the_check_keeps_its_own_prefill_reuse(pair) -> None:
    from specdecode.check.prefix import reuse_prefills

    store: dict = {}
    plain = factory_for(pair, cache_mb=0)

    def factory(k: int, batch: int):
        engine = plain(k, batch)
        reuse_prefills(engine, store)  # (as the command's factory does)
        return engine

    report = run_check(factory, PROMPTS, _parts(3))
    assert report.part(3).status == PASS and "prefix_cache" not in report.part(3).details
    assert "restored from the prefix cache" not in report.part(3).summary
    assert {tokens for _, tokens in store} >= {tuple(p[:-1]) for p in PROMPTS}  # each prompt prefilled once, kept


def test_a_cache_that_never_answers_is_an_error_not_a_pass(pair, monkeypatch) -> None:
    """The cache is on but nothing forces a hit (the check's prompts are under one block, each admitted
    once per engine): the part must not pass on a cache it never exercised."""
    monkeypatch.setattr(cache_hits, "force_hits", lambda engine, prompts: None)
    report = run_check(factory_for(pair), PROMPTS, _parts(3))
    assert report.part(3).status == ERROR, report.part(3).summary
    assert "restored nothing" in report.part(3).summary and not report.passed


def poison(engine) -> None:
    """Negative control: after the check seeded the target's cache, each entry's KV is replaced by that of
    another prompt of the same length (stale or wrong-prefix entries, under the right tokens)."""
    cache_hits.force_hits(engine, PROMPTS)  # (run_check's own call then finds it done)
    cache = engine.prefix_cache
    for entry in cache.index.entries.values():
        wrong = [(t * 7 + 3) % V for t in entry.tokens]
        cache.runner.prefill([0], [wrong])
        entry.value = cache.runner.export_kv(0, len(wrong))


@pytest.mark.parametrize("backend", [None, LLAMACPP])
def test_negative_control_a_wrong_entry_fails_the_check(pair, backend) -> None:
    _backend(backend)
    report = run_check(factory_for(pair, backend, after=poison), PROMPTS, _parts(1, 3))
    assert report.part(3).details["prefix_cache"]["target"]["hits"] > 0  # (the wrong entries were restored)
    assert report.part(3).status == FAIL, report.part(3).summary
    assert "real mismatches" in report.part(3).summary
    assert report.part(1).status == FAIL, report.part(1).summary
    assert "restored from the prefix cache give other target logits" in report.part(1).summary
    assert not report.passed


def test_tree_drafts_pass_with_the_cache_and_a_wrong_entry_fails(pair) -> None:
    from specdecode.drafters.draft_model import DraftModelDrafter
    from tiny import runner_for

    target, draft = pair

    def factory(after=None):
        def make(k: int, batch: int):
            drafter = DraftModelDrafter(runner_for(draft), tree_topk=3, tree_nodes=8) if k else None
            engine = make_engine(
                target, TOK, None, k, batch, 64, drafter, max_tree_nodes=8 if k else 0, prefix_cache_mb=1
            )
            if k and after is not None:
                after(engine)
            return engine

        return make

    report = run_check(factory(), PROMPTS, _parts(1, 3))
    assert report.part(1).name == "tree verifier law"
    assert report.part(1).status == PASS and report.part(3).status == PASS, [p.summary for p in report.parts]
    assert all(report.part(n).details["prefix_cache"]["target"]["hits"] > 0 for n in (1, 3))
    assert sum(r["num_draft"] for r in report.part(1).details["records"]) > 0
    wrong = run_check(factory(poison), PROMPTS, _parts(1, 3))
    assert wrong.part(1).status == FAIL and wrong.part(3).status == FAIL


def test_the_command_takes_the_cache_size_and_reports_the_hits(capsys, tmp_path) -> None:
    """`specdecode check --prefix-cache-mb` end to end (the toy backend): each part's engines get the cache,
    the evidence says how many admissions restored how many tokens."""
    import json

    from specdecode.cli import main

    argv = ["check", "--backend", "toy", "--target", "toy:2", "--draft", "toy:2:0.3", "-k", "3", "--num-prompts", "2"]
    argv += ["--parts", "1,3", "--law-contexts", "2", "--law-samples", "2000", "--greedy-tokens", "12"]
    argv += ["--prefix-cache-mb", "1", "--no-progress", "--json", str(tmp_path / "c.json")]
    code = main(argv)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "c.json").read_text())
    assert code == 0, out
    assert report["meta"]["prefix_cache_mb"] == 1
    for part in report["parts"]:
        if part["part"] in (1, 3):
            hits = part["details"]["prefix_cache"]
            assert set(hits) == {"target", "draft"}, part["summary"]
            assert all(h["hits"] > 0 and h["hit_tokens"] > 0 for h in hits.values()), part["summary"]
            assert "restored from the prefix cache" in part["summary"]
