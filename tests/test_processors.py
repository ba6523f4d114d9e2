"""Logit bias, penalties and min-p (issue 40, part A) under exact speculation: the processors against a
slow reference, greedy equality with target-only decoding for every drafter kind, the law (check part 7,
with its negative controls), the server's 400s and generate's flags. Tiny models only, no downloads."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specdecode.check.common import EnginePool, NullProgress
from specdecode.check.processors import NEUTRAL, DraftSees, check_processors, reference_logits
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import RequestError
from specdecode.processors import build_processors, chain_prefixes, tree_prefixes
from specdecode.sampling import SamplingError, SamplingParams, params_tensors, parse_setting, warp, warp_tensors
from specdecode.verify import Verifier
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy, runner_for

V = 32
TOK = make_tokenizer(V)
PROMPTS = [[1, 2, 3, 1, 2], [5, 6, 7], [9, 9, 4, 2, 9, 4]]
FEATURES = {  # one setting per processor (and all together)
    "bias": dict(logit_bias={3: 4.0, 25: -100.0, 11: 2.5}),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=2.0),
    "repetition": dict(repetition_penalty=1.8),
    "negative penalties": dict(presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.7),
    "all": dict(logit_bias={3: 4.0, 25: -100.0}, presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair():
    target = make_model(V, seed=0)
    return target, perturbed_copy(target, noise=0.1)


# -- the processors against the slow reference -----------------------------------------------------------
@pytest.mark.parametrize("name", list(FEATURES))
def test_each_position_equals_the_slow_reference_of_its_full_history(name):
    """Chains and trees: position p's processed logits equal the reference recomputed from prompt + generated +
    the drafted prefix of that position; ``apply`` leaves the state as it was, ``commit`` advances it."""
    rng = random.Random(0)
    params = SamplingParams(1.0, **FEATURES[name])
    prompt = [rng.randrange(V) for _ in range(6)]
    procs = build_processors(params, prompt, V)
    generated: list[int] = []
    for _ in range(4):
        drafts = [rng.randrange(V) for _ in range(4)]
        parents = [-1, 0, 0, 2]  # a tree over the same tokens
        logits = torch.randn(5, V) * 3
        for prefixes in (chain_prefixes(drafts, 5), tree_prefixes(drafts, parents, 4, 5)):
            got = logits
            for proc in procs:
                got = proc.apply(got, prefixes)
            for p, prefix in enumerate(prefixes):
                want = reference_logits(params, prompt, generated + list(prefix), logits[p])
                torch.testing.assert_close(got[p], want, rtol=1e-5, atol=1e-5)
        emitted = drafts[: rng.randrange(1, 5)]
        for proc in procs:
            proc.commit(emitted)
        generated += emitted


def test_tree_prefixes_follow_the_ancestors():
    assert tree_prefixes([7, 8, 9, 10], [-1, 0, -1, 1], 4, 6) == [(), (7,), (7, 8), (9,), (7, 8, 10), ()]
    assert chain_prefixes([4, 5], 3) == [(), (4,), (4, 5)]


def test_neutral_parameters_build_nothing_and_plain_requests_never_reach_processing(pair):
    """The default path costs nothing: no processor, and the engine never calls the processing hook."""
    assert build_processors(SamplingParams(0.7, top_p=0.9, min_p=0.1), [1, 2], V) == ()
    assert not SamplingParams(1.0, repetition_penalty=1.0, presence_penalty=0.0).processed

    def boom(*args):
        raise AssertionError("plain requests must not be processed")

    target, draft = pair
    out = make_engine(target, TOK, draft, k=3, verifier=Verifier(process=boom)).generate(
        PROMPTS, SamplingParams(max_new_tokens=10)
    )
    assert all(len(o.token_ids) == 10 or o.finish_reason == "stop" for o in out)


# -- parameters -----------------------------------------------------------------------------------------
def test_sampling_params_validate_and_normalise():
    p = SamplingParams(1.0, logit_bias={5: 1, 2: -100})
    assert p.logit_bias == ((2, -100.0), (5, 1.0)) and hash(p) == hash(
        SamplingParams(1.0, logit_bias=((2, -100), (5, 1)))
    )
    for bad in (
        dict(min_p=1.5),
        dict(min_p=-0.1),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0),
        dict(repetition_penalty=float("nan")),
        dict(logit_bias={1: 101}),
        dict(logit_bias={-1: 1}),
        dict(logit_bias={"1": 1}),
        dict(logit_bias=((1, 1), (1, 2))),
        dict(logit_bias={1: True}),
    ):
        with pytest.raises(SamplingError):
            SamplingParams(1.0, **bad)


def test_min_p_warp_keeps_tokens_at_least_min_p_times_the_most_likely_and_is_row_wise():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 2
    params = [
        SamplingParams(t, top_k=k, min_p=m)
        for t, k, m in [(1.0, 0, 0.1), (0.7, 0, 0.3), (1.3, 10, 0.05), (1.0, 0, 0.0), (2.0, 0, 1.0), (0.0, 0, 0.5)]
    ]
    got = warp(logits, *warp_tensors(params))
    for row, (sp, x) in enumerate(zip(params, logits)):
        if sp.greedy:
            assert got[row].argmax() == x.argmax() and got[row].max() == 1
            continue
        base = warp(x[None], *params_tensors([SamplingParams(sp.temperature, top_k=sp.top_k)]))[0]
        keep = base >= sp.min_p * base.max() * (1 - 1e-6)
        torch.testing.assert_close(got[row], torch.where(keep, base, 0) / base[keep].sum())
        torch.testing.assert_close(got[row], warp(x[None], *warp_tensors([sp]))[0])  # alone = batched
    with pytest.raises(SamplingError):
        params_tensors([SamplingParams(1.0, min_p=0.1)])  # never dropped silently
    assert len(warp_tensors([SamplingParams(1.0)])) == 3  # plain laws: warp called as before
    s = parse_setting("t0.7-p0.95-minp0.05")
    assert (s.temperature, s.top_p, s.min_p, s.name) == (0.7, 0.95, 0.05, "t0.7-p0.95-minp0.05")
    assert parse_setting("t=1,minp=0.2").params().min_p == 0.2


def test_a_bias_outside_the_vocabulary_is_refused_at_admission(pair):
    target, _ = pair
    with pytest.raises(RequestError, match="logit_bias token id 32") as exc:
        make_engine(target, TOK).validate([1, 2], SamplingParams(logit_bias={32: 1.0}))
    assert exc.value.param == "logit_bias"


# -- greedy equality with speculation on ----------------------------------------------------------------
def _greedy(pair, drafter_kind: str, features: dict, sampler: str = "rejection", temperature: float = 0.0):
    target, draft = pair
    params = [
        SamplingParams(temperature, seed=7 + i, max_new_tokens=24, ignore_eos=True, sampler=sampler, **features)
        for i in range(len(PROMPTS))
    ]
    ref = make_engine(target, TOK, sampler=sampler).generate(PROMPTS, params)
    if drafter_kind == "ngram":
        drafter = NgramDrafter()
    elif drafter_kind == "tree":
        drafter = DraftModelDrafter(runner_for(draft), tree_topk=2, tree_nodes=6)
    else:
        drafter = DraftModelDrafter(runner_for(draft))
    out = make_engine(target, TOK, drafter=drafter, k=4, sampler=sampler).generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert sum(o.stats.accepted for o in out) > 0  # speculation was exercised
    return ref


@pytest.mark.parametrize("drafter", ["model", "tree", "ngram"])
@pytest.mark.parametrize("name", ["bias", "frequency", "repetition", "all"])
def test_greedy_with_processors_equals_target_only(pair, drafter, name):
    ref = _greedy(pair, drafter, FEATURES[name])
    if name == "bias":
        assert all(25 not in r.token_ids for r in ref)  # the ban holds
    plain = make_engine(pair[0], TOK).generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in ref] != [p.token_ids for p in plain]  # the feature changed the output


@pytest.mark.parametrize("drafter", ["model", "tree"])
def test_coupled_sampling_with_processors_and_min_p_equals_target_only(pair, drafter):
    """The coupled sampler makes a seeded sample a function of (seed, target, prompt): equal token for token."""
    _greedy(pair, drafter, FEATURES["all"] | {"min_p": 0.05}, sampler="coupled", temperature=0.8)


# -- the law (check part 7) -------------------------------------------------------------------------------
VS = 12


def test_check_part_7_passes_and_its_negative_controls_fail():
    """Chi-square against the exactly computed processed law, Bonferroni at alpha = 1e-3 over the part (a
    correct engine fails with probability <= 1e-3). The engine and the engine whose draft is unprocessed pass;
    the control with the target unprocessed fails for every setting, and the stale-penalty-state control for
    the penalised one; tokens were drafted and accepted."""
    target = make_model(VS, seed=5, scale=0.5)
    draft = perturbed_copy(target, noise=0.6, seed=3)
    tok = make_tokenizer(VS)
    pool = EnginePool(lambda k, b: make_engine(target, tok, draft if k else None, k=k, num_slots=b, max_len=32), 1)
    result = check_processors(pool, [[1, 2, 3]], 1e-3, NullProgress(), samples=1000)
    assert result.status == "PASS", result.summary
    records = {rec["setting"]: rec for rec in result.details["records"]}
    assert set(records) == {"logit bias", "min-p", "penalised", "grammar"}
    for rec in records.values():
        runs = rec["runs"]
        assert not runs["engine"]["rejected"] and not runs["draft unprocessed"]["rejected"]
        assert runs["engine"]["accepted"] > 100 and runs["draft unprocessed"]["accepted"] > 0
        assert runs["control: target unprocessed"]["rejected"], rec["setting"]
    assert records["penalised"]["runs"]["control: stale penalty state"]["rejected"]
    grammar = records["grammar"]
    assert grammar["runs"]["control: stale grammar state"]["rejected"]
    assert grammar["regex"].startswith("(") and grammar["regex"].endswith(")[ -;=?-~]*")
    assert len(grammar["runs"]["engine"]["tests"]) == 4  # the first token, and the second after each of three


def test_the_grammar_reference_mask_is_regex_matching_of_token_texts():
    """The reference check part 7 holds llguidance's masks against: each token's text keeps the output a prefix of
    a match; end ids only on a whole match; added tokens never; SentencePiece pieces read with their spaces."""
    from specdecode.check.processors import TokenTexts, _piece_text, grammar_pattern, reference_mask

    tok = make_tokenizer(VS)
    texts = TokenTexts(tok, VS + 2)  # logits wider than the vocabulary, as Qwen's
    assert texts.texts[:3] == ["a", "b", "c"] and texts.texts[VS - 1 :] == [None, None, None]  # <eos>, past it
    end = [VS - 1]
    before = reference_mask("(ab|c)[ -;=?-~]*", texts, "", end)
    assert before.nonzero().flatten().tolist() == [0, 2]  # a (a prefix of ab) and c; no end yet
    after_a = reference_mask("(ab|c)[ -;=?-~]*", texts, "a", end)
    assert after_a.nonzero().flatten().tolist() == [1]
    after_c = reference_mask("(ab|c)[ -;=?-~]*", texts, "c", end)
    assert after_c[: VS - 1].all() and after_c[VS - 1] and not after_c[VS:].any()
    logits = torch.arange(VS + 2, dtype=torch.float32).flip(0)  # a most likely, then b, c, d
    assert grammar_pattern(logits, texts) == "(b|c|d)[ -;=?-~]*"  # the most likely token is left out
    assert _piece_text("\u2581def") == " def" and _piece_text("<0x41>") == "A" and _piece_text("<0xC3>") is None


# -- server and generate ----------------------------------------------------------------------------------
def test_server_accepts_the_fields_and_answers_400_for_bad_values():
    from test_server_harness import engine, serve

    good = {
        "prompt": "abc",
        "max_tokens": 6,
        "temperature": 0,
        "logit_bias": {"3": 5, "7": -100},
        "presence_penalty": 0.5,
        "frequency_penalty": 1,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
    }
    bad = [
        ({"logit_bias": {"40": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
    ]
    with serve(engine()) as s, s.http() as c:
        for body, param in bad:
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3} | body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = c.post("/v1/completions", json=good)
        assert r.status_code == 200, r.text
        chat = c.post(
            "/v1/chat/completions",
            json={k: v for k, v in good.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "ab"}]},
        )
        assert chat.status_code == 200, chat.text
        s.wait_idle()


def test_the_openai_client_sends_the_fields_unchanged_and_speculation_equals_target_only():
    """The official client's own parameters (logit_bias, presence/frequency penalties; repetition_penalty and
    min_p through extra_body), completions and chat, streamed or not: greedy text equal to target-only under the
    same processors, with tokens drafted; the bias visibly changes the output."""
    from test_server_harness import MODEL, engine, reference, serve, tokenizer

    tok = tokenizer()
    prompt = "abcab"
    fields = dict(logit_bias={"3": 5, "7": -100}, presence_penalty=0.5, frequency_penalty=1.0)
    extra = {"repetition_penalty": 1.2, "min_p": 0.1}
    params = dict(
        max_new_tokens=12,
        logit_bias=((3, 5.0), (7, -100.0)),
        presence_penalty=0.5,
        frequency_penalty=1.0,
        repetition_penalty=1.2,
        min_p=0.1,
    )
    with serve(engine()) as s:
        client = s.openai()
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra, **fields
        )
        text, finish, _ = reference(tok(prompt).input_ids, **params)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (text, finish)
        assert r.model_extra["speculation"]["drafted"] > 0
        assert text != reference(tok(prompt).input_ids, max_new_tokens=12)[0]  # the fields changed the output
        streamed = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=extra, **fields
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text
        messages = [{"role": "user", "content": "ab"}]
        chat = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=extra, **fields
        )
        chat_ids = tok(
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        ).input_ids
        assert chat.choices[0].message.content == reference(chat_ids, **params)[0]
        s.wait_idle()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = make_model(V, seed=0, arch="llama")
    dirs = {}
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.1))):
        model.save_pretrained(root / name)
        TOK.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def test_generate_flags(model_dirs, capsys):
    from specdecode.cli import main

    common = [
        "generate",
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
        "--logit-bias",
        "3=4",
        "--logit-bias",
        "25=-100",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "0.5",
        "--repetition-penalty",
        "1.3",
        "--min-p",
        "0.1",
    ]
    assert main(common) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(common + ["--draft", model_dirs["draft"], "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == base["token_ids"] and 25 not in base["token_ids"] and spec["stats"]["drafted"] > 0
    for extra, message in (
        (["--logit-bias", "99=1"], "outside the vocabulary"),
        (["--logit-bias", "3"], "ID=BIAS"),
        (["--presence-penalty", "3"], "presence_penalty"),
        (["--min-p", "2"], "min_p"),
    ):
        assert main(common + extra) == 2
        assert message in capsys.readouterr().err


# -- the drafters process their laws like the target's --------------------------------------------------
@pytest.mark.parametrize("tree", [False, True])
def test_a_draft_identical_to_the_target_is_always_accepted_under_processors(pair, tree):
    """The drafter applies the request's processors at each drafted position with the drafted prefix so far:
    a draft equal to the target then proposes exactly the target's (processed) greedy tokens. (Without the
    processors, or with the state of the last committed token, frequency penalties of 2 would reject some.)"""
    target, _ = pair
    same = perturbed_copy(target, 0.0)

    def drafter():  # (a tree of 16 nodes keeps the whole top-1 path of depth 4: nothing pruned)
        return DraftModelDrafter(runner_for(same), tree_topk=2 if tree else 1, tree_nodes=16 if tree else 0)

    params = SamplingParams(
        max_new_tokens=30,
        ignore_eos=True,
        frequency_penalty=2.0,
        presence_penalty=1.0,
        repetition_penalty=1.5,
        logit_bias={3: 3.0},
    )
    out = make_engine(target, TOK, drafter=drafter(), k=4).generate(PROMPTS, params)
    assert sum(o.stats.drafted for o in out) > 30
    assert all(o.stats.accepted == o.stats.drafted for o in out)
    # control: the same draft without the request's processors is rejected somewhere, and stays exact
    blind = DraftSees(drafter(), NEUTRAL, V)
    control = make_engine(target, TOK, drafter=blind, k=4).generate(PROMPTS, params)
    assert sum(o.stats.accepted for o in control) < sum(o.stats.drafted for o in control)
    assert [o.token_ids for o in control] == [o.token_ids for o in out]


@pytest.mark.parametrize("topk", [1, 3])
def test_medusa_heads_propose_after_the_processors_and_stay_exact(topk):
    from test_medusa import medusa_engine, tiny_heads

    target = make_model(V, seed=3, hidden=32)
    heads = tiny_heads(target)
    x = int(heads.id_map[5])
    engine = medusa_engine(target, heads, k=3, topk=topk, nodes=8 if topk > 1 else 0)
    proposals = []
    original = engine.drafter.propose

    def spy(seqs, ks):
        p = original(seqs, ks)
        proposals.append(p.tokens[:, : int(p.num_tokens.max())].tolist() if p.num_tokens.numel() else [])
        return p

    engine.drafter.propose = spy
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logit_bias={x: 100.0})
    out = engine.generate([PROMPTS[0]], params)[0]
    assert out.token_ids == [x] * 12  # the target follows the bias ...
    assert proposals and all(t == x for p in proposals for row in p for t in row[:1])  # ... and so do the heads
    assert out.stats.accepted > 0
    plain = [SamplingParams(max_new_tokens=16, ignore_eos=True, **FEATURES["all"])] * 2
    ref = make_engine(target, TOK).generate(PROMPTS[:2], plain)
    spec = medusa_engine(target, heads, k=3, topk=topk, nodes=8 if topk > 1 else 0).generate(PROMPTS[:2], plain)
    assert [o.token_ids for o in spec] == [r.token_ids for r in ref]
