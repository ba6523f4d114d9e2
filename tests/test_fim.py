"""Fill-in-the-middle end to end (specdecode.fim): the model's own FIM tokens and prompt layout, the
error for a model without them, greedy outputs under speculation equal to target-only decoding
(chain, tree, n-gram, auto), the end tokens and the editor stop rules as exact cuts, the server
through the real openai SDK, and `generate --suffix`."""

from __future__ import annotations

import functools
import json
import string

import openai
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdecode.cli import main
from specdecode.fim import FimUnsupported, cursor_indent, fim_prompt, fim_tokens, stop_fields
from specdecode.sampling import SamplingParams
from specdecode.text import DedentStop, IncrementalText
from test_server_harness import engine as plain_engine
from test_server_harness import one_torch_thread, serve  # noqa: F401 (a fixture)
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy, serving

CHARS = string.ascii_lowercase + " \n\t():,+="  # one token each
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|endoftext|>"]
EOS = "<eos>"
V = len(CHARS) + len(FIM) + 1  # the last id is <eos>, as in tests/tiny.py
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(a, b))"


def make_fim_tokenizer(pad_id: int | None = None) -> PreTrainedTokenizerFast:
    """One character per token, then Qwen2.5-Coder's FIM tokens as special tokens, then <eos>.
    ``pad_id``: put <|fim_pad|> (a FIM end token) at this id instead, and the token there in its place."""
    tokens = list(CHARS) + FIM + [EOS]
    if pad_id is not None:
        pad = tokens.index("<|fim_pad|>")
        tokens[pad], tokens[pad_id] = tokens[pad_id], tokens[pad]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FIM + [EOS]])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, additional_special_tokens=FIM)


@functools.cache
def pair():
    target = make_model(V, seed=36, arch="llama")  # greedy middle: "+fom\nthnm\nthnm..."
    return target, perturbed_copy(target, noise=0.1)


def reference(tokenizer, prompt_ids: list[int], **params):
    """The request run alone, target-only."""
    return make_engine(pair()[0], tokenizer, num_slots=1).generate([prompt_ids], SamplingParams(**params))[0]


# -- tokens, prompt, error ------------------------------------------------------------------------
def test_the_prompt_is_prefix_suffix_middle_in_the_models_own_tokens():
    tok = make_fim_tokenizer()
    fim = fim_tokens(tok)
    ids = tok.convert_tokens_to_ids
    assert (fim.prefix, fim.suffix, fim.middle) == tuple(ids(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]))
    assert set(fim.end) >= {*ids(["<|fim_pad|>", "<|endoftext|>"]), tok.eos_token_id} and fim.lead == ()

    def text(s):
        return tok(s, add_special_tokens=False).input_ids

    assert fim_prompt(tok, PREFIX, SUFFIX) == [fim.prefix, *text(PREFIX), fim.suffix, *text(SUFFIX), fim.middle]
    assert fim_prompt(tok, "", "") == [fim.prefix, fim.suffix, fim.middle]
    assert fim_prompt(tok, PREFIX, SUFFIX, fim) == fim_prompt(tok, PREFIX, SUFFIX)


def test_other_conventions_are_found_by_their_spelling():
    for markers, name in (
        (["<fim_prefix>", "<fim_suffix>", "<fim_middle>"], "StarCoder"),
        (["▁<PRE>", "▁<SUF>", "▁<MID>"], "CodeLlama"),
        (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], "DeepSeek-Coder"),
    ):
        vocab = {c: i for i, c in enumerate("abc")} | {m: 3 + i for i, m in enumerate(markers)} | {"<eos>": 6}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
        fim = fim_tokens(fast)
        assert name in fim.convention and (fim.prefix, fim.suffix, fim.middle) == (3, 4, 5) and 6 in fim.end


def test_a_model_without_fim_tokens_is_a_clear_user_error():
    with pytest.raises(FimUnsupported, match=r"no fill-in-the-middle tokens.*<\|fim_prefix\|>.*<fim_prefix>.*<PRE>"):
        fim_tokens(make_tokenizer(32))


# -- stops ----------------------------------------------------------------------------------------
def _text(tokenizer, generated: str, **kw) -> tuple[str, bool, str]:
    """Feed ``generated`` token by token: (the text, whether it stopped, what streaming handed out)."""
    it = IncrementalText(tokenizer, **kw)
    streamed = ""
    for i in tokenizer(generated, add_special_tokens=False).input_ids:
        if it.add(i):
            break
        streamed += it.delta()
    streamed += it.delta(final=True)
    return it.text, it.stopped, streamed


@pytest.mark.parametrize(
    "generated, kept, stopped",
    [
        ("return a + b\n\nprint(add(a, b))", "return a + b", True),  # a blank line, then a dedent: cut before both
        ("return a + b\nprint(a)", "return a + b", True),
        ("x = a\n    y = b\n    return x + y\ndef f", "x = a\n    y = b\n    return x + y", True),
        ("if a:\n        b\n\n    c\n  d", "if a:\n        b\n\n    c", True),  # inner blank lines are kept
        ("x\n\t\ty\nz", "x\n\t\ty", True),  # a tab is 8 columns
        ("\n\nz", "", True),  # the first line (the rest of the cursor's line) is kept, even empty
        ("x\n    y\n\n   ", "x\n    y\n\n   ", False),  # undecided at the end: nothing cut
    ],
)
def test_block_rule_cuts_before_the_first_dedented_line(generated, kept, stopped):
    tok = make_fim_tokenizer()
    assert cursor_indent(PREFIX) == 4 and cursor_indent("a\n\t") == 8 and cursor_indent("x = f(") == 0
    text, did_stop, streamed = _text(tok, generated, stop_dedent=cursor_indent(PREFIX))
    assert (text, did_stop) == (kept, stopped)
    assert streamed == text  # a stream never hands out text the rule later cuts


def test_block_rule_at_column_0_never_cuts_and_line_rule_is_a_newline_stop():
    tok = make_fim_tokenizer()
    assert _text(tok, "a\nb\n\nc", stop_dedent=0)[:2] == ("a\nb\n\nc", False)
    fim = fim_tokens(tok)
    line = stop_fields(fim, "line", PREFIX)
    assert line == {"stop_token_ids": fim.end, "stop": ("\n",), "stop_dedent": None}
    assert _text(tok, "return a + b\n  x", stop=line["stop"])[:2] == ("return a + b", True)
    assert stop_fields(fim, "block", PREFIX)["stop_dedent"] == 4 and stop_fields(fim, "none", PREFIX)["stop"] == ()
    with pytest.raises(ValueError, match="fim_stop"):
        stop_fields(fim, "word", PREFIX)


def test_dedent_matcher_feeds_in_pieces_like_all_at_once():
    whole = "ab\n    c\n\n  \n d e"
    one = DedentStop(4).feed(whole, 0)
    m, offset, found = DedentStop(4), 0, None
    for piece in ("ab\n ", "   c\n", "\n  ", "\n", " d e"):
        found, m.states = m.feed(piece, offset)
        offset += len(piece)
        if found is not None:
            break
    assert found == one[0] == whole.index("\n", 3)


# -- exactness under speculation ------------------------------------------------------------------
def test_a_fim_end_token_inside_an_accepted_block_ends_the_request_exactly():
    """The target's raw greedy middle (no end tokens); then <|fim_pad|> is moved to the id of a token
    in it, so that token is a FIM end token: the speculative output must stop right there."""
    target, _ = pair()
    base = make_fim_tokenizer()
    prompt = fim_prompt(base, PREFIX, SUFFIX)
    raw = reference(base, prompt, max_new_tokens=24, ignore_eos=True).token_ids
    firsts = {t: j for j, t in reversed(list(enumerate(raw)))}
    candidates = [
        (j, t) for t, j in sorted(firsts.items(), key=lambda kv: kv[1]) if j >= 1 and t not in prompt and t != V - 1
    ][:4]
    assert candidates, raw
    inside = 0
    for j, t in candidates:
        tok = make_fim_tokenizer(pad_id=t)
        fim = fim_tokens(tok)
        assert t in fim.end and fim_prompt(tok, PREFIX, SUFFIX) == prompt
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, **stop_fields(fim, "none", PREFIX))
        eng = make_engine(target, tok, perturbed_copy(target, noise=0.0), k=4, num_slots=1)  # accepts everything
        events = list(eng.stream([prompt], params))
        seq = events[-1].seq
        assert seq.finish_reason == "stop" and seq.output_ids == raw[: j + 1]
        assert seq.text.finish() == tok.decode(raw[:j], skip_special_tokens=True)
        assert seq.stats.emitted == j + 1 == sum(len(ev.new_token_ids) for ev in events)
        assert seq.stats.drafted > 0
        last = events[-1]
        inside += last.accepted + 1 > len(last.new_token_ids)  # tokens of the accepted block were cut
    assert inside, "no end token fell inside an accepted block"


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fim-models")
    target, draft = pair()
    dirs = {}
    for name, model, tok in (
        ("target", target, make_fim_tokenizer()),
        ("draft", draft, make_fim_tokenizer()),
        ("plain", make_model(32, seed=0, arch="llama"), make_tokenizer(32)),
    ):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


FIM_ARGS = [
    "--prompt",
    "def f(a, b):\n    x = a + b\n    y = a + b\n    ",
    "--suffix",
    "\n\nprint(f(a, b))",
    "--max-new-tokens",
    "24",
    "--dtype",
    "float32",
    "--json",
]


@pytest.mark.parametrize(
    "drafting",
    [
        ["-k", "3"],
        ["-k", "3", "--tree-topk", "2", "--tree-nodes", "6"],
        ["--draft", "ngram", "-k", "3"],
        ["--draft", "ngram", "--draft-policy", "auto", "--max-draft-tokens", "3"],
    ],
    ids=["chain", "tree", "ngram", "auto"],
)
def test_generate_suffix_greedy_equals_target_only(model_dirs, capsys, tmp_path, monkeypatch, drafting):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # auto's cost calibration
    code, base, err = _run(capsys, "--target", model_dirs["target"], *FIM_ARGS)
    assert code == 0, err
    draft = [] if "ngram" in drafting and "auto" not in drafting else ["--draft", model_dirs["draft"]]
    code, spec, err = _run(capsys, "--target", model_dirs["target"], *draft, *drafting, *FIM_ARGS)
    assert code == 0, err
    base, spec = json.loads(base), json.loads(spec)
    assert spec["token_ids"] == base["token_ids"] and spec["text"] == base["text"]
    assert spec["finish_reason"] == base["finish_reason"]
    assert spec["stats"]["drafted"] > 0 and base["stats"]["drafted"] == 0


def test_generate_suffix_matches_the_engine_and_the_fim_stop_rules(model_dirs, capsys):
    tok = make_fim_tokenizer()
    prompt = fim_prompt(tok, PREFIX, SUFFIX)
    for rule in ("none", "line", "block"):
        want = reference(tok, prompt, max_new_tokens=24, **stop_fields(fim_tokens(tok), rule, PREFIX))
        code, out, err = _run(
            capsys,
            "--target",
            model_dirs["target"],
            "--draft",
            model_dirs["draft"],
            "-k",
            "3",
            "--prompt",
            PREFIX,
            "--suffix",
            SUFFIX,
            "--fim-stop",
            rule,
            "--max-new-tokens",
            "24",
            "--dtype",
            "float32",
            "--json",
        )
        assert code == 0, err
        got = json.loads(out)
        assert (got["token_ids"], got["text"], got["finish_reason"]) == (want.token_ids, want.text, want.finish_reason)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "a", "--suffix", "b", "--chat"], "--chat"),
        (["--prompt-ids", "1,2", "--suffix", "b"], "--prompt-ids"),
        (["--prompt", "a", "--fim-stop", "line"], "--suffix"),
    ],
)
def test_generate_fim_flag_errors_are_one_line(model_dirs, capsys, argv, message):
    code, _, err = _run(capsys, "--target", model_dirs["target"], *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_generate_suffix_on_a_model_without_fim_tokens_is_a_user_error(model_dirs, capsys):
    code, _, err = _run(capsys, "--target", model_dirs["plain"], "--prompt", "ab", "--suffix", "cd")
    last = err.strip().splitlines()[-1]  # after the model's loading lines
    assert code == 2 and "Traceback" not in err, err
    assert last.startswith("specdecode generate: this model has no fill-in-the-middle tokens")
    assert "<|fim_prefix|>" in last


# -- the server -----------------------------------------------------------------------------------
def test_server_suffix_through_the_openai_sdk_equals_target_only():
    target, draft = pair()
    tok = make_fim_tokenizer()
    fim = fim_tokens(tok)
    eng = make_engine(target, tok, draft, k=3, num_slots=4, **serving())
    with serve(eng) as s, s.openai() as client:
        # no fim_stop sent: the block rule, what an editor expects (the model would write on past the hole)
        for suffix, rule in ((SUFFIX, "none"), ("", "none"), (SUFFIX, "block"), (SUFFIX, "line"), (SUFFIX, None)):
            extra = {} if rule is None else {"extra_body": {"fim_stop": rule}}
            rule = rule or "block"
            got = client.completions.create(
                model="tiny", prompt=PREFIX, suffix=suffix, max_tokens=20, temperature=0, **extra
            )
            want = reference(tok, fim_prompt(tok, PREFIX, suffix), max_new_tokens=20, **stop_fields(fim, rule, PREFIX))
            assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, want.finish_reason), rule
            assert got.usage.prompt_tokens == len(fim_prompt(tok, PREFIX, suffix))
            assert got.usage.completion_tokens == len(want.token_ids)
            chunks = client.completions.create(
                model="tiny", prompt=PREFIX, suffix=suffix, max_tokens=20, temperature=0, stream=True, **extra
            )
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text  # nothing cut was streamed
        with s.http() as http:
            r = http.post("/v1/completions", json={"prompt": [1, 2], "suffix": "x", "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            r = http.post("/v1/completions", json={"prompt": "ab", "fim_stop": "line", "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "fim_stop"
            r = http.post("/v1/completions", json={"prompt": "ab", "suffix": "c", "fim_stop": "word", "max_tokens": 2})
            assert r.status_code == 400 and "fim_stop" in r.json()["error"]["message"]


def test_server_suffix_on_a_model_without_fim_tokens_is_400():
    with serve(plain_engine(k=0)) as s, s.openai() as client:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="ab", suffix="cd", max_tokens=4, temperature=0)
        body = err.value.body
        assert "no fill-in-the-middle tokens" in body["message"] and "<|fim_prefix|>" in body["message"]
        assert body["code"] == "fim_unsupported" and body["param"] == "suffix"
        plain = client.completions.create(model="tiny", prompt="ab", max_tokens=4, temperature=0)  # no suffix: fine
        assert plain.choices[0].finish_reason in ("stop", "length")
