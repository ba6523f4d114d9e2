"""Structured outputs wired to requests (issue 40): SamplingParams.grammar through the engine, every drafter,
the server's response_format / regex / grammar, generate's flags. Greedy equality with constrained
target-only decoding, the constrained law (chi-square, with a negative control that must fail), outputs
that match their grammar, 400s naming the field. Tiny models and tokenizers built in code: no downloads."""

from __future__ import annotations

import json
import random
import string
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
import regex
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdecode.check.processors import DraftSees, stale_process
from specdecode.check.stats import goodness_of_fit
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.grammar import GrammarError, GrammarSpec
from specdecode.sampling import SamplingError, SamplingParams
from specdecode.verify import Verifier
from tiny import ALPHABET, make_engine, make_model, make_tokenizer, perturbed_copy, runner_for

V = 32
TOK = make_tokenizer(V)
PROMPTS = [[1, 2, 3, 1, 2], [5, 6, 7], [9, 9, 4, 2, 9, 4]]
REGEX = "(ab|c[d-f]+)+g[0-3]?"  # long outputs (repeats an n-gram drafter can find), ends only after "g"
LARK = 'start: item+ "g"\nitem: "ab" | "c" /[d-f]+/\n'
GBNF = 'root ::= ("ab" | "c" [d-f]+)+ "g"\n'
SPECS = {"regex": GrammarSpec.regex(REGEX), "lark": GrammarSpec.grammar(LARK), "gbnf": GrammarSpec.grammar(GBNF)}


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


def matches(pattern: str, text: str, complete: bool) -> bool:
    """A complete output matches ``pattern`` whole; a cut one (length) is a prefix of a match."""
    return bool(regex.fullmatch(pattern, text) if complete else regex.fullmatch(pattern, text, partial=True))


def drafter_of(kind: str, draft):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "tree":
        return DraftModelDrafter(runner_for(draft), tree_topk=2, tree_nodes=6)
    return DraftModelDrafter(runner_for(draft))


# -- parameters ------------------------------------------------------------------------------------------
def test_params_take_a_spec_and_refuse_ignore_eos_with_it():
    spec = SPECS["regex"]
    assert SamplingParams(grammar=spec).grammar == spec
    with pytest.raises(SamplingError, match="ignore_eos cannot be combined with a grammar"):
        SamplingParams(grammar=spec, ignore_eos=True)
    with pytest.raises(SamplingError, match="GrammarSpec"):
        SamplingParams(grammar=REGEX)


def test_a_bad_spec_is_refused_at_validation_with_the_engines_message(pair):
    engine = make_engine(pair[0], TOK)
    with pytest.raises(GrammarError, match="invalid regex"):
        engine.validate([1, 2], SamplingParams(grammar=GrammarSpec.regex("(ab")))
    with pytest.raises(GrammarError, match="invalid grammar"):
        engine.validate([1, 2], SamplingParams(grammar=GrammarSpec.grammar("start: undefined_rule")))


def test_a_complete_grammar_stops_the_request_without_an_end_token(pair):
    """Once nothing but an end token can follow, the request ends ("stop") at once; where the grammar is
    complete but may go on, the model chooses (an end token is allowed there, nowhere else)."""
    engine = make_engine(pair[0], TOK)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, grammar=GrammarSpec.regex("abc")))
    assert all((o.text, o.finish_reason, o.token_ids) == ("abc", "stop", [0, 1, 2]) for o in out)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, grammar=GrammarSpec.regex("[a-c]{8}")))
    assert all((o.finish_reason, len(o.text)) == ("length", 6) for o in out)  # cut: the length limit


# -- greedy equality under speculation ---------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["model", "tree", "ngram"])
@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_constrained_speculation_equals_constrained_target_only(pair, drafter, name):
    """Batched (3 requests, 4 slots), k = 3: token for token what target-only decoding under the same grammar
    emits; tokens were drafted and accepted; every output matches the grammar (and differs from the
    unconstrained output: the grammar did something)."""
    target, draft = pair
    params = SamplingParams(max_new_tokens=20, grammar=SPECS[name])
    ref = make_engine(target, TOK).generate(PROMPTS, params)
    out = make_engine(target, TOK, drafter=drafter_of(drafter, draft), k=3).generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert [o.finish_reason for o in out] == [r.finish_reason for r in ref]
    assert sum(o.stats.drafted for o in out) > 0 and sum(o.stats.accepted for o in out) > 0
    for o in out:
        assert matches(REGEX, o.text, o.finish_reason == "stop"), o.text
    plain = make_engine(target, TOK).generate(PROMPTS, SamplingParams(max_new_tokens=20))
    assert [p.token_ids for p in plain] != [r.token_ids for r in ref]


@pytest.mark.parametrize("drafter", ["model", "tree"])
def test_seeded_coupled_samples_under_a_grammar_equal_target_only(pair, drafter):
    """The coupled sampler makes a seeded sample a function of (seed, target, prompt) under the grammar too."""
    target, draft = pair
    params = [
        SamplingParams(0.9, seed=11 + i, max_new_tokens=20, sampler="coupled", grammar=SPECS["regex"])
        for i in range(len(PROMPTS))
    ]
    ref = make_engine(target, TOK, sampler="coupled").generate(PROMPTS, params)
    out = make_engine(target, TOK, drafter=drafter_of(drafter, draft), k=3, sampler="coupled").generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert sum(o.stats.accepted for o in out) > 0
    assert all(matches(REGEX, o.text, o.finish_reason == "stop") for o in out)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("topk,nodes", [(1, 0), (3, 8)], ids=["chain", "tree"])
def test_greedy_under_a_grammar_with_medusa_and_eagle_equals_target_only(kind, topk, nodes):
    """The heads drafters mask their laws through the same processors: still token for token target-only."""
    from test_eagle import eagle_engine, tiny_eagle
    from test_medusa import medusa_engine, tiny_heads

    target = make_model(V, seed=3, hidden=32)
    params = SamplingParams(max_new_tokens=20, grammar=SPECS["regex"])
    ref = make_engine(target, TOK).generate(PROMPTS, params)
    engine = (
        medusa_engine(target, tiny_heads(target), k=3, topk=topk, nodes=nodes)
        if kind == "medusa"
        else eagle_engine(target, tiny_eagle(target), k=3, topk=topk, nodes=nodes)
    )
    out = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert sum(o.stats.drafted for o in out) > 0 and sum(o.stats.accepted for o in out) > 0
    assert all(matches(REGEX, o.text, o.finish_reason == "stop") for o in out)


# -- the law -----------------------------------------------------------------------------------------------
VS = 12
LAW_REGEX = "a[ab]*"  # position 0 allows only "a"; every later one "a", "b" or the end
LAW_TOKENS = 4


def exact_law(target, prompt: list[int], eos: int) -> dict[tuple[int, ...], float]:
    """Every output of at most LAW_TOKENS tokens and its probability under target-only sampling at T = 1 with
    the grammar's mask, computed from the model's logits one history at a time (not by the engine)."""

    def allowed(history: tuple[int, ...]) -> list[int]:
        text = "".join(ALPHABET[t] for t in history)
        out = [t for t in range(VS - 1) if regex.fullmatch(LAW_REGEX, text + ALPHABET[t], partial=True)]
        return out + ([eos] if regex.fullmatch(LAW_REGEX, text) else [])

    law: dict[tuple[int, ...], float] = {}

    def walk(history: tuple[int, ...], p: float) -> None:
        if len(history) == LAW_TOKENS or (history and history[-1] == eos):
            law[history] = p
            return
        with torch.no_grad():
            logits = target(torch.tensor([prompt + list(history)])).logits[0, -1].double()
        ok = allowed(history)
        probs = torch.softmax(logits[ok], 0)
        for t, q in zip(ok, probs.tolist()):
            walk(history + (t,), p * q)

    walk((), 1.0)
    return law


def sample_outputs(engine, prompt: list[int], params: SamplingParams, n: int) -> tuple[list[tuple[int, ...]], int, int]:
    outs, drafted, accepted = [], 0, 0
    for lo in range(0, n, engine.max_batch_size):
        ps = [replace(params, seed=1000 + lo + i) for i in range(min(engine.max_batch_size, n - lo))]
        for o in engine.generate([prompt] * len(ps), ps):
            outs.append(tuple(o.token_ids))
            drafted, accepted = drafted + o.stats.drafted, accepted + o.stats.accepted
    return outs, drafted, accepted


def test_the_constrained_law_under_speculation_and_its_negative_control():
    """Chi-square of n = 1000 sampled outputs (T = 1, at most 4 tokens, a regex grammar) against the exactly
    computed constrained law, each at level 1e-3 / 3 (a correct engine fails this test with probability
    <= 1e-3): the draft-model engine passes, and so does one whose drafter ignores the grammar (masking only the
    target is exact, just slower); the control whose target is masked at every drafted position with the
    grammar state of the last committed token (not the drafted prefix) must fail. Every sample matches."""
    target = make_model(VS, seed=5, scale=0.5)
    draft = perturbed_copy(target, noise=0.4, seed=3)
    tok = make_tokenizer(VS)
    eos, prompt = VS - 1, [1, 2, 3]
    law = exact_law(target, prompt, eos)
    cells = sorted(law)
    probs = np.array([law[c] for c in cells])
    assert abs(probs.sum() - 1) < 1e-9
    params = SamplingParams(1.0, max_new_tokens=LAW_TOKENS, grammar=GrammarSpec.regex(LAW_REGEX))

    def drafter():
        return DraftModelDrafter(runner_for(draft))

    engines = {
        "engine": make_engine(target, tok, drafter=drafter(), k=3, num_slots=8, max_len=32),
        "draft ignores the grammar": make_engine(
            target, tok, drafter=DraftSees(drafter(), {"grammar": None}, VS), k=3, num_slots=8, max_len=32
        ),
        "control: stale grammar state": make_engine(
            target, tok, drafter=drafter(), k=3, num_slots=8, max_len=32, verifier=Verifier(process=stale_process)
        ),
    }
    level = 1e-3 / len(engines)
    results = {}
    for name, engine in engines.items():
        outs, drafted, accepted = sample_outputs(engine, prompt, params, 1000)
        assert drafted > 0 and accepted > 0, name
        texts = ["".join(ALPHABET[t] for t in o if t != eos) for o in outs]
        assert all(matches(LAW_REGEX, s, o[-1] == eos) for s, o in zip(texts, outs)), name
        index = {c: i for i, c in enumerate(cells)}
        assert all(o in index for o in outs), name
        results[name] = goodness_of_fit(np.array([index[o] for o in outs]), probs, level)
    assert not results["engine"].rejected, results["engine"]
    assert not results["draft ignores the grammar"].rejected, results["draft ignores the grammar"]
    assert results["control: stale grammar state"].rejected, results["control: stale grammar state"]


# -- JSON on a byte-level BPE ----------------------------------------------------------------------------
def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ["name", "ok", "n", "c", "red", "green", "true", "false", "null", "tags"]
    docs = []
    for _ in range(300):
        obj = {
            rng.choice(words): rng.choice([rng.randint(0, 99), rng.choice(words), rng.random() < 0.5, None])
            for _ in range(rng.randint(1, 4))
        }
        docs.append(json.dumps(obj, indent=rng.choice([None, 2]), separators=rng.choice([None, (",", ":")])))
    return docs + [string.printable]


def json_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE trained on JSON (385 tokens, <eos> = 0) plus a second end token
    <|end|> = 385 (the model's EOS: two end ids, as Qwen has), with a one-line chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=385,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast


SCHEMA = {  # compact JSON and bounded values: a tiny random model completes it within ~30 tokens
    "x-guidance": {"whitespace_flexible": False},
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "c": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "c"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def json_pair():
    tok = json_tokenizer()
    assert len(tok) == 386 and tok.convert_tokens_to_ids("<|end|>") == 385
    target = make_model(392, seed=2)  # wider than the vocabulary, as Qwen's lm_head (a reload adds a token too)
    target.config.eos_token_id = target.generation_config.eos_token_id = 385  # <|end|>: a second end id
    return tok, target, perturbed_copy(target, noise=0.1)


def test_json_schema_speculation_equals_target_only_and_validates(json_pair):
    tok, target, draft = json_pair
    prompts = [tok(p).input_ids for p in ('{"a": 1}', "name: red", "ok")]
    params = SamplingParams(max_new_tokens=60, grammar=GrammarSpec.json_schema(SCHEMA))
    engine = make_engine(target, tok, draft, k=3)
    assert {0, 385} <= engine.eos_token_ids  # the tokenizer's and the model's: both end the JSON
    ref = make_engine(target, tok).generate(prompts, params)
    out = engine.generate(prompts, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert sum(o.stats.accepted for o in out) > 0
    schema = {k: v for k, v in SCHEMA.items() if k != "x-guidance"}
    for o in out:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_a_thousand_sampled_json_requests_all_validate(json_pair, drafter):
    """1,000 sampled requests (T = 1, top-p 1: the widest law) under the JSON schema with speculation on, 16 at a
    time: every output ends by itself (the grammar completes, never the token cap), parses and validates; tokens
    were drafted and accepted."""
    tok, target, draft = json_pair
    engine = (
        make_engine(target, tok, draft, k=3, num_slots=16, max_len=128)
        if drafter == "model"
        else make_engine(target, tok, drafter=NgramDrafter(), k=3, num_slots=16, max_len=128)
    )
    params = SamplingParams(1.0, max_new_tokens=96, grammar=GrammarSpec.json_schema(SCHEMA))
    prompt = tok('{"ok":true,"n":5,"c":"red"} {"ok":false,"n":12,"c":"green"} ').input_ids  # n-gram finds these
    invalid, drafted, accepted = 0, 0, 0
    for lo in range(0, 1000, 16):
        batch = [replace(params, seed=5000 + lo + i) for i in range(min(16, 1000 - lo))]
        for o in engine.generate([prompt] * len(batch), batch):
            drafted, accepted = drafted + o.stats.drafted, accepted + o.stats.accepted
            try:
                assert o.finish_reason == "stop"
                jsonschema.validate(json.loads(o.text), PLAIN_SCHEMA)
            except (AssertionError, ValueError, jsonschema.ValidationError):
                invalid += 1
    assert invalid == 0
    assert drafted > 0 and accepted > 0


# -- the server --------------------------------------------------------------------------------------------
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
PLAIN_SCHEMA = {k: v for k, v in SCHEMA.items() if k != "x-guidance"}


@pytest.fixture(scope="module")
def json_server(json_pair):
    from test_server_harness import serve
    from tiny import serving

    tok, target, draft = json_pair
    with serve(make_engine(target, tok, draft, k=3, num_slots=4, max_len=256, **serving())) as s:
        yield s


def test_server_json_schema_through_the_openai_client(json_server, json_pair):
    """Chat and completions, streaming and not, batched (4 at once): parseable JSON valid against the schema,
    equal to the constrained target-only output, with speculation on."""
    from concurrent.futures import ThreadPoolExecutor

    tok, target, _ = json_pair
    client = json_server.openai()
    questions = ["give me json", "red or green?", "n = 7", "ok"]

    drafted = []

    def chat(q: str, stream: bool) -> str:
        kw = dict(
            model="tiny",
            messages=[{"role": "user", "content": q}],
            temperature=0,
            max_tokens=60,
            response_format=RESPONSE_FORMAT,
        )
        if not stream:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            drafted.append(r.model_extra["speculation"]["drafted"])
            return r.choices[0].message.content
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert chunks[-1].choices[0].finish_reason == "stop"
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(chat, questions * 2, [False] * 4 + [True] * 4))
    assert texts[:4] == texts[4:]  # streaming = not
    assert sum(drafted) > 0
    reference = make_engine(target, tok)
    for q, text in zip(questions, texts):
        jsonschema.validate(json.loads(text), PLAIN_SCHEMA)
        prompt = tok(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        want = reference.generate([prompt], SamplingParams(max_new_tokens=60, grammar=GrammarSpec.json_schema(SCHEMA)))
        assert text == want[0].text
    r = client.completions.create(
        model="tiny", prompt='{"n": 1}', max_tokens=60, temperature=0, extra_body={"response_format": RESPONSE_FORMAT}
    )
    jsonschema.validate(json.loads(r.choices[0].text), PLAIN_SCHEMA)
    r = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=30,
        temperature=0.8,
        seed=3,
        extra_body={"regex": "(yes|no)(, (yes|no)){0,3}"},
    )
    assert regex.fullmatch("(yes|no)(, (yes|no)){0,3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    assert json_server.scheduler.engine.drafter is not None
    json_server.wait_idle()


BAD = [  # (extra fields, param)
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "minLength": 5, "maxLength": 2}},
            }
        },
        "response_format",
    ),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"regex": "(ab"}, "regex"),
    ({"regex": 5}, "regex"),
    ({"grammar": "start: missing_rule"}, "grammar"),
    ({"regex": "a+", "grammar": 'start: "a"'}, "grammar"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
    ({"regex": "a+", "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_server_refuses_bad_structured_requests_with_400_naming_the_field(json_server, path):
    body = {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    with json_server.http() as c:
        for extra, param in BAD:
            r = c.post(path, json=body | {"max_tokens": 4} | extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        r = c.post(path, json=body | {"max_tokens": 4, "response_format": {"type": "text"}, "regex": "[a-z]+"})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text" if path == "/v1/completions" else "message"]
        text = text if isinstance(text, str) else text["content"]
        assert regex.fullmatch("[a-z]+", text, partial=True), text
    message = BAD[0]
    with json_server.http() as c:
        r = c.post(path, json=body | {"max_tokens": 4} | message[0])
        assert "minLength" in r.json()["error"]["message"]  # llguidance's own words


# -- generate ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def json_model_dirs(tmp_path_factory, json_pair):
    tok, target, draft = json_pair
    root = tmp_path_factory.mktemp("json-models")
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "schema.json").write_text(json.dumps(SCHEMA))
    (root / "bad.json").write_text('{"type": "string", "minLength": 5, "maxLength": 2}')
    (root / "yes.lark").write_text('start: ("yes" | "no") ("," ("yes" | "no"))*\n')
    return root


def test_generate_structured_flags(json_model_dirs, capsys):
    from specdecode.cli import main

    root = json_model_dirs
    common = [
        "generate",
        "--target",
        str(root / "target"),
        "--prompt",
        '{"n": 3',
        "--max-new-tokens",
        "60",
        "--dtype",
        "float32",
        "--json",
    ]
    assert main(common + ["--json-schema", str(root / "schema.json")]) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(common + ["--json-schema", str(root / "schema.json"), "--draft", str(root / "draft"), "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == base["token_ids"] and spec["stats"]["drafted"] > 0
    jsonschema.validate(json.loads(spec["text"]), PLAIN_SCHEMA)
    assert main(common + ["--grammar", str(root / "yes.lark")]) == 0
    assert regex.fullmatch("(yes|no)(,(yes|no))*", json.loads(capsys.readouterr().out)["text"], partial=True)
    assert main(common + ["--regex", "[0-9]{3}"]) == 0
    assert regex.fullmatch("[0-9]{3}", json.loads(capsys.readouterr().out)["text"])
    for extra, message in (
        (["--json-schema", str(root / "bad.json")], "minLength"),
        (["--json-schema", str(root / "missing.json")], "cannot read"),
        (["--regex", "(ab"], "invalid regex"),
        (["--grammar", str(root / "schema.json")], "invalid grammar"),
        (["--regex", "a+", "--ignore-eos"], "ignore_eos"),
    ):
        assert main(common + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):  # argparse: at most one of them
        main(common + ["--regex", "a", "--json-object"])


# -- the load generator ------------------------------------------------------------------------------------
def test_load_sends_each_prompts_response_format(json_server):
    from specdecode.bench.prompts import Prompt, load_structured_workload
    from specdecode.load.client import Target, request_body
    from specdecode.load.runner import LoadConfig, run_sweep
    from test_server_harness import KEY

    shipped = load_structured_workload("json_extract", n=1)[0]
    assert shipped.response_format["type"] == "json_schema"
    _, body = request_body(Target("A", "http://x"), shipped, 64)
    assert body["response_format"] == shipped.response_format
    _, body = request_body(Target("A", "http://x", response_format=False), shipped, 64)
    assert "response_format" not in body
    prompts = [
        Prompt(
            id=f"j{i}",
            category="json",
            text=None,
            messages=[{"role": "user", "content": q}],
            kind="chat",
            max_new_tokens=60,
            response_format=RESPONSE_FORMAT,
        )
        for i, q in enumerate(["a", "bb", "n=3"])
    ]
    config = LoadConfig(
        targets=[
            Target("json", json_server.url, extra_body={"temperature": 0}),
            Target("free", json_server.url, extra_body={"temperature": 0, "ignore_eos": True}, response_format=False),
        ],
        prompts=prompts,
        levels=[2],
        num_requests=3,
        output_len=(60, 60),
        duration_s=600,
        time_limit_s=3600,
        api_key=KEY,
    )
    result = run_sweep(config)
    json_server.wait_idle()
    constrained, free = result.levels
    assert all(r.error is None for run in result.levels for r in run.records)
    assert all(r.output_tokens < 60 for r in constrained.records)  # the JSON ends itself
    assert all(r.output_tokens == 60 for r in free.records)  # sent without it (ignore_eos would be a 400 with it)


# -- bench -------------------------------------------------------------------------------------------------
def test_bench_applies_each_prompts_grammar_and_reports_valid_json(json_model_dirs, tmp_path, capsys):
    """Engine configs enforce the prompt's response_format (outputs valid, speculation equal to target-only);
    the transformers baseline is not compared with them; --no-grammar runs the same prompts unconstrained; the
    report says how many outputs parsed and validated; a resume with the other setting is refused."""
    import argparse

    from specdecode.bench import cli

    root = json_model_dirs
    rows = [
        {"id": f"j{i}", "category": "json", "prompt": p, "max_new_tokens": 40, "response_format": RESPONSE_FORMAT}
        for i, p in enumerate(['{"n": 3', "ok: "])
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def bench(out, *extra):
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        return cli.main(
            parser.parse_args(
                [
                    "--target",
                    str(root / "target"),
                    "--draft",
                    str(root / "draft"),
                    "--dtype",
                    "float32",
                    "--prompts",
                    str(root / "prompts.jsonl"),
                    "--draft-lengths",
                    "3",
                    "--baselines",
                    "hf",
                    "--no-progress",
                    "--warmup-tokens",
                    "2",
                    "--threads",
                    "1",
                    "--out",
                    str(out),
                    *extra,
                ]
            )
        )

    def runs(out):
        return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]

    on, off = tmp_path / "on", tmp_path / "off"
    assert bench(on) == 0
    recs = runs(on)
    engine_runs = [r for r in recs if r["type"] == "run" and r["config"] != "hf"]
    assert len(engine_runs) == 4 and all(r["grammar"] and r["json_valid"] for r in engine_runs)
    assert all(r["finish_reason"] == "stop" for r in engine_runs)
    assert sum(r["stats"]["drafted"] for r in engine_runs) > 0
    checks = [r for r in recs if r["type"] == "check"]
    assert [c["config"] for c in checks] == ["spec-k3"] * 2 and all(c["match"] for c in checks)
    hf = [r for r in recs if r["type"] == "run" and r["config"] == "hf"]
    assert len(hf) == 2 and not any(r["grammar"] for r in hf)
    report = (on / "report.md").read_text()
    assert "## Structured outputs" in report and "| greedy | spec-k3 | on | 2 | 2 (100%) | 2 (100%) | " in report
    assert all(r["mask_rows"] >= r["new_tokens"] and r["mask_s"] > 0 for r in engine_runs)  # target + draft rows
    line = next(x for x in report.splitlines() if x.startswith("| greedy | spec-k3 | on |"))
    assert line.count("|") == 10 and line.rstrip(" |").endswith("%")  # mask ms / token, ms / row, share of wall
    assert bench(off, "--no-grammar") == 0
    free = [r for r in runs(off) if r["type"] == "run" and r["config"] != "hf"]
    assert len(free) == 4 and not any(r["grammar"] for r in free) and "json_valid" in free[0]
    assert not any("mask_s" in r for r in free)
    assert [r["token_ids"] for r in free] != [r["token_ids"] for r in engine_runs]
    capsys.readouterr()
    assert bench(on, "--no-grammar") == 2
    assert "grammar" in capsys.readouterr().err
