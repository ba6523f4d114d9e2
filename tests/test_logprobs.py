"""Logprobs (specdecode.logprobs) through the engine on tiny models: speculation (draft model and n-gram,
chains and trees, batches) reports the same values as target-only decoding, and both equal a slow
teacher-forced reference of the stated law; a request that asks for none computes none.

Tolerance: ``ATOL`` = 1e-4 absolute (float32 logits of the same positions computed in forwards of
different widths differ by rounding only: up to ~1e-5 measured here once divided by T = 0.5)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specdecode.config import EngineSettings
import specdecode.engine as engine_module
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import Engine
from specdecode.logprobs import (
    LOGPROBS_MAX,
    REPORTED_FLOOR,
    TokenLogprob,
    TokenSpeller,
    law_logprobs,
    text_offsets,
    token_logprobs,
)
from specdecode.models.hf import HFRunner
from specdecode.processors import build_processors
from specdecode.sampling import SamplingError, SamplingParams
from test_cli_generate import model_dirs  # noqa: F401 (fixture: tiny models saved to directories)
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy

V = 32
TOK = make_tokenizer(V)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3, 3, 3, 3, 3], [20, 21, 22, 23, 20, 21, 22, 5, 6]]
ATOL = 1e-4


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, seed=0)
    return target, perturbed_copy(target, noise=0.15)


def greedy(max_new: int = 20, top: int = 3, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True, logprobs=top, **kw)


def reference_logprobs(model, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """The law's [N, V] log-probabilities of each output position, the slow way: the target on the whole
    sequence at once (teacher forcing), each position's logits through fresh processors that have
    committed the output before it, then :func:`law_logprobs`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()  # [N, V]
    rows = []
    for i in range(len(output)):
        row = logits[i : i + 1]
        procs = build_processors(params, prompt, V)
        for proc in procs:
            proc.commit(output[:i])
        for proc in procs:
            row = proc.apply(row, [()])
        rows.append(law_logprobs(row, params.temperature)[0])
    return torch.stack(rows)


def assert_logprobs_match(outs, refs) -> None:
    """Same tokens, chosen values and top entries (ids and values) within ATOL."""
    for o, r in zip(outs, refs):
        assert o.token_ids == r.token_ids
        assert [e.token_id for e in o.logprobs] == o.token_ids
        assert torch.allclose(
            torch.tensor([e.logprob for e in o.logprobs]),
            torch.tensor([e.logprob for e in r.logprobs]),
            atol=ATOL,
            rtol=0,
        )
        for e, f in zip(o.logprobs, r.logprobs):
            assert [i for i, _ in e.top] == [i for i, _ in f.top]
            assert torch.allclose(
                torch.tensor([v for _, v in e.top]), torch.tensor([v for _, v in f.top]), atol=ATOL, rtol=0
            )


def assert_equals_reference(model, prompts, outs, params_list) -> None:
    for prompt, out, params in zip(prompts, outs, params_list):
        ref = reference_logprobs(model, prompt, out.token_ids, params)  # [N, V]
        got = torch.tensor([e.logprob for e in out.logprobs])
        want = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(got, want, atol=ATOL, rtol=0)
        for e, row in zip(out.logprobs, ref):
            values, ids = row.topk(params.logprobs)
            assert [i for i, _ in e.top] == ids.tolist()
            assert torch.allclose(torch.tensor([v for _, v in e.top]), values, atol=ATOL, rtol=0)


def spec_engines(target, draft):
    """Speculative engines over the same target, batch 3 (ragged over 5 prompts): chains and trees."""
    return {
        "draft-k3": make_engine(target, TOK, draft, k=3, num_slots=3),
        "draft-k5": make_engine(target, TOK, draft, k=5, num_slots=3),
        "ngram-k4": Engine(HFRunner(target), TOK, NgramDrafter(), 4, EngineSettings(max_batch_size=3, max_context=64)),
        "draft-tree": Engine(
            HFRunner(target),
            TOK,
            DraftModelDrafter(HFRunner(draft), tree_topk=2, tree_nodes=8),
            4,
            EngineSettings(max_batch_size=3, max_context=64, max_tree_nodes=8),
        ),
        "ngram-tree": Engine(
            HFRunner(target),
            TOK,
            NgramDrafter(tree_topk=2, tree_nodes=8),
            4,
            EngineSettings(max_batch_size=3, max_context=64, max_tree_nodes=8),
        ),
    }


@pytest.mark.parametrize("name", ["draft-k3", "draft-k5", "ngram-k4", "draft-tree", "ngram-tree"])
def test_greedy_speculation_reports_target_only_logprobs_and_the_reference(pair, name):
    target, draft = pair
    params = [greedy(20, top) for top in (3, 0, 5, 1, 20)]
    base = make_engine(target, TOK, num_slots=2).generate(PROMPTS, params)
    spec = spec_engines(target, draft)[name].generate(PROMPTS, params)
    assert sum(o.stats.drafted for o in spec) > 0 and sum(o.stats.accepted for o in spec) > 0
    assert_logprobs_match(spec, base)
    assert_equals_reference(target, PROMPTS, spec, params)
    assert all(len(e.top) == p.logprobs for o, p in zip(spec, params) for e in o.logprobs)


def test_served_engine_first_token_from_target_and_chunked_prefill(pair):
    """The server's engine: first token from the target's own step, prompts prefilled a chunk at a time."""
    target, draft = pair
    params = greedy(16, 2)
    base = make_engine(target, TOK, num_slots=1).generate(PROMPTS, params)
    served = make_engine(
        target, TOK, draft, k=3, num_slots=3, first_token_from_target=True, max_num_batched_tokens=4
    ).generate(PROMPTS, params)
    assert sum(o.stats.accepted for o in served) > 0
    assert_logprobs_match(served, base)


def test_the_law_is_after_processors_and_temperature_before_truncation(pair):
    """Sampled requests with a logit bias, penalties, temperature and truncation (top-k, top-p, min-p):
    the values are the processed logits' log-softmax at the temperature, whatever the truncation, and
    the coupled sampler reproduces target-only decoding's tokens and values under speculation."""
    target, draft = pair
    laws = [
        dict(temperature=0.7, top_k=5, logit_bias={3: 2.0, 7: -1.5}, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=1.3, top_p=0.8, repetition_penalty=1.2),
        dict(temperature=0.5, min_p=0.1),
    ]
    params = [
        SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=4, seed=i, sampler="coupled", **laws[i % len(laws)])
        for i in range(len(PROMPTS))
    ]
    base = make_engine(target, TOK, num_slots=2).generate(PROMPTS, params)
    spec = make_engine(target, TOK, draft, k=3, num_slots=3).generate(PROMPTS, params)
    assert sum(o.stats.accepted for o in spec) > 0
    assert_logprobs_match(spec, base)
    assert_equals_reference(target, PROMPTS, spec, params)
    rejection = [replace(p, sampler="rejection") for p in params]
    sampled = make_engine(target, TOK, draft, k=3, num_slots=3).generate(PROMPTS, rejection)
    assert_equals_reference(target, PROMPTS, sampled, rejection)  # a different sample, the same law


def test_greedy_with_a_logit_bias_is_the_processed_law_at_temperature_one(pair):
    target, draft = pair
    params = [greedy(12, 2, logit_bias={5: 3.0}, frequency_penalty=1.0)] * 3
    spec = make_engine(target, TOK, draft, k=3, num_slots=3).generate(PROMPTS[:3], params)
    assert_equals_reference(target, PROMPTS[:3], spec, params)
    # the greedy token is the law's argmax, so its value is the largest top entry
    assert all(e.top[0] == (e.token_id, e.logprob) for o in spec for e in o.logprobs)


def test_nothing_is_computed_for_requests_that_ask_for_none(pair, monkeypatch):
    target, draft = pair
    calls = []
    monkeypatch.setattr(engine_module, "token_logprobs", lambda *a: calls.append(a) or token_logprobs(*a))
    plain = make_engine(target, TOK, draft, k=3, num_slots=3).generate(PROMPTS, greedy(8, None))
    assert calls == [] and all(o.logprobs is None for o in plain)
    mixed = [greedy(8, None), greedy(8, 1), greedy(8, None)]
    outs = make_engine(target, TOK, draft, k=3, num_slots=3).generate(PROMPTS[:3], mixed)
    assert [o.logprobs is None for o in outs] == [True, False, True]
    assert calls and all(len(c[0]) <= 4 for c in calls)  # one row's accepted positions per call
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain[:3]]


def test_stop_cuts_the_logprobs_with_the_tokens(pair):
    """A sequence cut inside an accepted block (max_new_tokens, a stop token) has one entry per token."""
    target, draft = pair
    outs = make_engine(target, TOK, draft, k=5, num_slots=3).generate(PROMPTS, [greedy(m, 1) for m in (1, 3, 7, 2, 9)])
    assert [len(o.logprobs) for o in outs] == [len(o.token_ids) for o in outs] == [1, 3, 7, 2, 9]


@pytest.mark.parametrize("bad", [-1, LOGPROBS_MAX + 1, True, 1.0, "2"])
def test_params_refuse_bad_counts(bad):
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_token_logprobs_lists_only_finite_top_entries():
    logits = torch.tensor([[0.0, -float("inf"), 1.0, -float("inf")]])
    (entry,) = token_logprobs(logits, [2], 0.0, 4)
    assert [i for i, _ in entry.top] == [2, 0]
    assert entry.logprob == pytest.approx(-torch.log1p(torch.exp(torch.tensor(-1.0))).item())


# -- spelling tokens for responses -----------------------------------------------------------------
def test_speller_on_the_tiny_vocabulary_and_text_offsets():
    speller = TokenSpeller(TOK)
    eos = speller.spell(V - 1)
    assert (eos.token, eos.bytes, eos.text_bytes) == ("<eos>", b"<eos>", b"")  # the text skips it
    entries = [speller.report(TokenLogprob(i, -0.5, ((i, -0.5),))) for i in (0, 1, V - 1, 2)]
    first, decoder = text_offsets(entries[:2])
    rest, _ = text_offsets(entries[2:], decoder)  # a stream's next chunk continues the count
    assert first + rest == [0, 1, 2, 2]
    assert speller.report(TokenLogprob(0, -float("inf"))).logprob == REPORTED_FLOOR


def byte_level_tokenizer():
    """A byte-level BPE vocabulary (as GPT-2's, Qwen's), trained in code on a few multilingual lines: some
    of its tokens are parts of a UTF-8 character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["héllo wörld 你好 世界 def f():\n\treturn 1", "naïve café ∮ 🙂 hello world"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def test_speller_gives_a_byte_level_vocabulary_its_exact_bytes():
    tok = byte_level_tokenizer()
    speller = TokenSpeller(tok)
    text = "héllo wörld 你好 🙂 ∮ def f():\n\treturn 1"
    ids = tok(text).input_ids + [tok.eos_token_id]
    assert b"".join(speller.spell(i).text_bytes for i in ids).decode() == tok.decode(ids, skip_special_tokens=True)
    # a token that is part of a UTF-8 character: its bytes, and vLLM's "bytes:" text
    partial = next(i for i in range(len(tok)) if speller.spell(i).token.startswith("bytes:"))
    s = speller.spell(partial)
    assert s.token == "bytes:" + "".join(f"\\x{b:02x}" for b in s.bytes)
    with pytest.raises(UnicodeDecodeError):
        s.bytes.decode("utf-8")
    offsets, _ = text_offsets([speller.report(TokenLogprob(i, 0.0)) for i in ids])
    assert offsets[0] == 0 and offsets[-1] == len(text)


def test_under_a_grammar_masked_tokens_are_never_listed(pair):
    """A grammar's mask is a processor: a forbidden token's value is -inf, so the top entries hold only
    tokens the grammar allows there; speculation reports target-only's values."""
    from specdecode.grammar import GrammarSpec
    from tiny import ALPHABET

    target, draft = pair
    params = SamplingParams(max_new_tokens=12, logprobs=6, grammar=GrammarSpec.regex("(ab|c[d-f]+)+g"))
    base = make_engine(target, TOK, num_slots=2).generate(PROMPTS[:3], params)
    spec = make_engine(target, TOK, draft, k=3, num_slots=3).generate(PROMPTS[:3], params)
    assert sum(o.stats.accepted for o in spec) > 0
    assert_logprobs_match(spec, base)
    first = {ALPHABET.index(c) for c in "ac"}
    assert all({i for i, _ in o.logprobs[0].top} == first for o in spec)  # 6 asked, 2 allowed
    assert all(v > -float("inf") for o in spec for e in o.logprobs for _, v in e.top)


def test_generate_prints_logprobs_in_its_json_output(model_dirs, capsys):  # noqa: F811 (the fixture imported above)
    from test_cli_generate import run

    common = [
        "--target",
        model_dirs["target"],
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--json",
        "--logprobs",
        "2",
    ]
    code, base, _ = run(capsys, *common)
    assert code == 0
    code, spec, _ = run(capsys, *common, "--draft", model_dirs["draft"], "-k", "3")
    assert code == 0
    base, spec = json.loads(base), json.loads(spec)
    assert spec["stats"]["drafted"] > 0 and spec["token_ids"] == base["token_ids"]
    assert [e["token_id"] for e in spec["logprobs"]] == spec["token_ids"]
    assert "".join(e["token"] for e in spec["logprobs"] if e["token"] != "<eos>") == spec["text"]  # (ignore_eos)
    for e, f in zip(spec["logprobs"], base["logprobs"]):
        assert e["logprob"] == pytest.approx(f["logprob"], abs=ATOL) and len(e["top"]) == 2
        assert [t["token_id"] for t in e["top"]] == [t["token_id"] for t in f["top"]]
    assert run(capsys, *[a for a in common if a != "--json"])[0] == 2  # printed with --json only
    assert run(capsys, *common[:-1], "21")[0] == 2
