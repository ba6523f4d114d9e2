"""Bounded whitespace in JSON modes (issue 59, finding 6): by default a JSON output may hold, at each place
JSON allows whitespace, one space or one or two newlines and at most 20 spaces or tabs (llama.cpp's rule), so a
weak model cannot spend its token budget on whitespace; ``flexible`` keeps llguidance's unbounded runs,
``compact`` none. Tokenizer built in code (a byte-level BPE trained on indented JSON, with tokens for runs of
spaces, tabs and newlines as real BPE vocabularies have): no downloads."""

from __future__ import annotations

import json
import random
import string

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdecode.grammar import GrammarCompiler, GrammarError, GrammarSpec
from specdecode.sampling import SamplingParams
from tiny import make_engine, make_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ["name", "ok", "n", "id", "value", "items", "true", "false", "null", "red", "data", "type"]
    docs = []
    for _ in range(600):
        obj = {
            rng.choice(words): rng.choice(
                [rng.randint(0, 999), rng.choice(words), rng.random() < 0.5, None, {rng.choice(words): [1, 2]}]
            )
            for _ in range(rng.randint(1, 5))
        }
        docs.append(json.dumps(obj, indent=rng.choice([None, 1, 2, 4, 8, "\t", "\t\t", "    "])))
    return docs + [string.printable, " " * 32, "\t" * 16, "\n" * 8]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """A byte-level BPE of 1,024 tokens (<eos> = 0) trained on JSON indented every which way."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def _allows(compiler: GrammarCompiler, spec: GrammarSpec, tok, text: str) -> bool:
    matcher = compiler.compile(spec)
    ids = tok(text).input_ids
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_the_whitespace_modes(tok):
    compiler = GrammarCompiler(tok)
    bounded, flexible, compact = (GrammarSpec.json_schema(SCHEMA, ws) for ws in ("bounded", "flexible", "compact"))
    assert GrammarSpec.json_schema(SCHEMA) == bounded and GrammarSpec.json_object().whitespace == "bounded"
    tidy = json.dumps({"name": "a", "ok": True, "n": 1}, indent=2)
    deep = '{"name": "a",\n' + " " * 20 + '"ok": true, "n": 1}'
    for text, want in [
        ('{"name":"a","ok":true,"n":1}', (True, True, True)),
        (tidy, (True, True, False)),
        (deep, (True, True, False)),
        ('{"name": "a",\n' + " " * 21 + '"ok": true, "n": 1}', (False, True, False)),
        ('{"name": "a",\n\n\n"ok": true, "n": 1}', (False, True, False)),
        ('{"name": "a",  "ok": true, "n": 1}', (False, True, False)),
    ]:
        got = tuple(_allows(compiler, spec, tok, text) for spec in (bounded, flexible, compact))
        assert got == want, (text, got)
    own = GrammarSpec.json_schema(SCHEMA | {"x-guidance": {"whitespace_flexible": False}})  # the schema's own wins
    assert not _allows(compiler, own, tok, tidy) and _allows(compiler, own, tok, '{"name":"a","ok":true,"n":1}')
    with pytest.raises(GrammarError, match="whitespace"):
        GrammarSpec.json_schema(SCHEMA, "loose")
    with pytest.raises(GrammarError, match="JSON outputs only"):
        GrammarSpec("regex", "a+", "bounded")


def test_whitespace_a_greedy_adversary_prefers_cannot_run_on(tok):
    """A walk that takes a whitespace token whenever the grammar allows one: under ``bounded`` it still
    reaches the end of the object (the whitespace at each place is finite), under ``flexible`` it never
    leaves the first place. Deterministic: no model."""
    compiler = GrammarCompiler(tok)
    blank = {t for t in range(len(tok)) if t != tok.eos_token_id and tok.decode([t]) and not tok.decode([t]).strip()}
    fill = tok('{"name":"a","ok":true,"n":1}').input_ids

    def walk(ws: str) -> int:
        """Tokens committed before the output is complete (400: never)."""
        proc = compiler.processor(GrammarSpec.json_schema(SCHEMA, ws))
        pending = list(fill)
        for step in range(400):
            if proc.finished:
                return step
            row = proc.apply(torch.zeros(1, len(tok)), [()])[0]
            allowed = set(torch.isfinite(row).nonzero().flatten().tolist()) - set(proc.end_ids)
            spaces = sorted(allowed & blank, key=lambda t: (-len(tok.decode([t])), t))
            while pending and pending[0] not in allowed and not spaces:
                pending.pop(0)  # a token of the filler the grammar no longer wants (whitespace took its place)
            token = spaces[0] if spaces else pending.pop(0) if pending else min(allowed)
            proc.commit([token])
        return 400

    assert walk("bounded") < 400
    assert walk("flexible") == 400


def test_thirty_sampled_json_requests_finish_within_64_tokens(tok):
    """Issue 59's check: a random-weight tiny model (seed 0) samples (T = 1) 30 requests under the schema
    with at most 64 tokens each. Bounded whitespace (the default): all 30 are valid JSON that validate
    and end by themselves. Control: the same requests with flexible whitespace mostly run out of tokens
    in whitespace."""
    target = make_model(len(tok), seed=0)
    engine = make_engine(target, tok, num_slots=10, max_len=128)
    prompt = tok("name, ok and n as JSON: ").input_ids
    valid = {}
    for ws in ("bounded", "flexible"):
        params = [
            SamplingParams(1.0, max_new_tokens=64, seed=100 + i, grammar=GrammarSpec.json_schema(SCHEMA, ws))
            for i in range(30)
        ]
        valid[ws] = 0
        for out in engine.generate([prompt] * 30, params):
            try:
                jsonschema.validate(json.loads(out.text), SCHEMA)
                valid[ws] += out.finish_reason == "stop"
            except (ValueError, jsonschema.ValidationError):
                pass
    assert valid["bounded"] == 30, valid
    assert valid["flexible"] <= 15, valid
