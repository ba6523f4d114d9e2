"""Grammar masks for structured outputs (specdecode.grammar): masks equal slow references, drafted
prefixes equal per-prefix recomputation, state is restored, outputs parse and validate. Tokenizers are
built in code (a byte-level BPE trained on JSON, GPT-2 style; the tests' one-character WordLevel): no
downloads."""

from __future__ import annotations

import json
import random
import string

import pytest
import regex
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdecode.errors import UserError
from specdecode.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarProcessor,
    GrammarSpec,
    apply_bitmask_,
    bitmask_to_bool,
    compiler_for,
)
from tiny import make_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "role": {"enum": ["dev", "ops", "pm"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "home"],
    "additionalProperties": False,
}


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ["name", "age", "role", "tags", "home", "zip", "dev", "ops", "true", "false", "null", "score"]
    docs = []
    for _ in range(300):
        obj = {
            rng.choice(words): rng.choice([rng.randint(0, 999), rng.choice(words), [rng.choice(words)], None])
            for _ in range(rng.randint(1, 4))
        }
        docs.append(json.dumps(obj, indent=rng.choice([None, 2])))
    return docs + [string.printable]


@pytest.fixture(scope="module")
def bpe():
    """A GPT-2-style byte-level BPE (every byte a token, merges learned from JSON), 384 tokens + <eos>."""
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
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def compiler(bpe):
    return GrammarCompiler(bpe)


def allowed_ids(processor, prefix=(), width=None) -> set[int]:
    width = width or processor.vocab_size
    row = processor.apply(torch.zeros(1, width), [tuple(prefix)])[0]
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def reference_allowed(processor, prefix=()) -> set[int]:
    """Slow: for each token, does the grammar accept the prefix plus it? (end tokens: is it complete?)"""
    m = processor.matcher.deep_copy()
    assert m.try_consume_tokens(list(prefix)) == len(prefix)
    out = {t for t in processor.end_ids if m.is_accepting()}
    for t in range(processor.vocab_size):
        if t not in processor.end_ids and m.deep_copy().try_consume_tokens([t]) == 1:
            out.add(t)
    return out


def random_walk(processor, rng, max_steps=300, eos_weight=0.3, weight=None) -> tuple[list[int], bool]:
    """Commit random allowed tokens until an end token or max_steps: (the tokens before the end, ended)."""
    ids = []
    for _ in range(max_steps):
        allowed = sorted(allowed_ids(processor))
        assert allowed, "a live state allows some token"
        ends = [t for t in allowed if t in processor.end_ids]
        if ends and rng.random() < eos_weight:
            processor.commit([ends[0]])
            assert processor.finished
            return ids, True
        rest = [t for t in allowed if t not in processor.end_ids] or ends
        t = rng.choices(rest, weights=[weight(t) for t in rest] if weight else None)[0]
        processor.commit([t])
        if t in processor.end_ids:
            return ids, True
        ids.append(t)
    return ids, False


# --- specs and errors ---------------------------------------------------------------------------------


def test_response_format_shapes():
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    assert GrammarSpec.from_response_format({"type": "json_object"}) == GrammarSpec.json_object()
    spec = GrammarSpec.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    )
    assert spec == GrammarSpec.json_schema(SCHEMA) == GrammarSpec.json_schema(json.dumps(SCHEMA))
    assert hash(spec) == hash(GrammarSpec.json_schema(dict(SCHEMA)))
    reordered = {"properties": SCHEMA["properties"], "type": "object"}
    assert GrammarSpec.json_schema(reordered) != GrammarSpec.json_schema(
        {"type": "object", "properties": SCHEMA["properties"]}
    )
    for bad, words in [
        ([], "must be an object"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}, "name"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be an object"),
    ]:
        with pytest.raises(GrammarError, match=words):
            GrammarSpec.from_response_format(bad)
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.json_schema("{nope")
    with pytest.raises(GrammarError, match="non-empty"):
        GrammarSpec.regex("")


@pytest.mark.parametrize(
    "spec, words",
    [
        (GrammarSpec.json_schema({"type": "nope"}), "Invalid type: nope"),
        (GrammarSpec.json_schema({"properties": {"a": {"$ref": "#/defs/x"}}}), "/defs/x"),
        (GrammarSpec.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "Unsatisfiable"),
        (GrammarSpec.regex("a(b"), "unclosed group"),
        (GrammarSpec.grammar("start: foo"), "unknown name"),
        (GrammarSpec.grammar("root ::= \"a"), "grammar"),
    ],
)
def test_invalid_specs_raise_with_the_engines_message(compiler, spec, words):
    with pytest.raises(GrammarError, match=words) as err:
        compiler.compile(spec)
    assert isinstance(err.value, UserError) and isinstance(err.value, ValueError)
    assert spec.kind in str(err.value)


def test_compiler_cache_is_a_bounded_lru(bpe):
    compiler = GrammarCompiler(bpe, cache_size=2)
    specs = [GrammarSpec.regex(f"a{{{n}}}") for n in range(1, 4)]
    first = compiler.compile(specs[0])
    root = compiler._cache[specs[0]]
    assert compiler.compile(specs[0]) is not first and compiler._cache[specs[0]] is root  # a copy of one root
    compiler.compile(specs[1])
    compiler.compile(specs[0])  # most recent now
    compiler.compile(specs[2])
    assert list(compiler._cache) == [specs[0], specs[2]]
    assert compiler_for(bpe) is compiler_for(bpe)


# --- masks against references ---------------------------------------------------------------------------


def test_bitmask_to_bool_and_apply_in_place():
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen)
    width = 5 * 32 + 7  # wider than the mask: the extra ids are disallowed
    ref = torch.tensor(
        [[(int(bits[r, t // 32]) >> (t % 32)) & 1 == 1 if t < 160 else False for t in range(width)] for r in range(3)]
    )
    assert torch.equal(bitmask_to_bool(bits, width), ref)
    assert torch.equal(bitmask_to_bool(bits, 100), ref[:, :100])
    logits = torch.randn(3, width, generator=gen)
    expected = torch.where(ref, logits, float("-inf"))
    assert apply_bitmask_(logits, bits) is logits and torch.equal(logits, expected)


REGEX = r"[a-c]{2,4}(-[0-9]+)?x"


def test_regex_masks_equal_an_independent_regex_reference(compiler, bpe):
    """Token t is allowed after text s iff s + t can still be completed to a full match (the ``regex``
    module's partial matching, no llguidance inside), and the end token iff s is a full match."""
    rng = random.Random(1)
    eos = bpe.eos_token_id
    for _ in range(12):
        proc = compiler.processor(GrammarSpec.regex(REGEX))
        ids, _ = random_walk(proc, rng, eos_weight=0.0, max_steps=rng.randint(0, 6))
        proc = compiler.processor(GrammarSpec.regex(REGEX))
        text = bpe.decode(ids)
        expected = {eos} if regex.fullmatch(REGEX, text) else set()
        for t in range(len(bpe)):
            piece = bpe.decode([t])
            if t != eos and "\ufffd" not in piece and regex.fullmatch(REGEX, text + piece, partial=True):
                expected.add(t)
        assert allowed_ids(proc, ids) == expected, text


def test_regex_on_a_tokenizer_llguidance_cannot_read():
    """The one-character WordLevel tokenizer (Fuse decoder) goes through each token's decoded text."""
    tok = make_tokenizer(40)
    proc = GrammarCompiler(tok).processor(GrammarSpec.regex(r"ab+c"))
    a, b, c = (tok.convert_tokens_to_ids(x) for x in "abc")
    assert allowed_ids(proc) == {a}
    assert allowed_ids(proc, [a]) == {b}
    assert allowed_ids(proc, [a, b]) == {b, c}
    assert allowed_ids(proc, [a, b, c]) == {tok.eos_token_id}


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema(SCHEMA, "flexible"),
        GrammarSpec.json_object(),
        GrammarSpec.grammar('start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'),
        GrammarSpec.grammar('root ::= "(" [0-9]+ ("," [0-9]+)* ")"'),
    ],
)
def test_masks_equal_the_slow_reference_along_walks(compiler, spec):
    rng = random.Random(2)
    for _ in range(3):
        walker = compiler.processor(spec)
        ids, _ = random_walk(walker, rng, max_steps=25, eos_weight=0.0)
        proc = compiler.processor(spec)
        for n in range(0, len(ids) + 1, 4):
            assert allowed_ids(proc, ids[:n]) == reference_allowed(proc, ids[:n])


# --- drafted prefixes, rollback, commit -----------------------------------------------------------------


def test_the_processor_has_the_logits_processor_protocols_shape():
    """specdecode.processors.LogitsProcessor: apply(logits, prefixes) -> Tensor; commit(tokens)."""
    import inspect

    assert list(inspect.signature(GrammarProcessor.apply).parameters) == ["self", "logits", "prefixes"]
    assert list(inspect.signature(GrammarProcessor.commit).parameters) == ["self", "tokens"]


def test_nested_and_tree_prefixes_equal_per_prefix_recomputation(compiler, bpe):
    spec = GrammarSpec.json_schema(SCHEMA)
    rng = random.Random(3)
    ids, _ = random_walk(compiler.processor(spec), rng, max_steps=40, eos_weight=0.0)
    assert len(ids) >= 12
    proc = compiler.processor(spec)
    proc.commit(ids[:5])
    gen = torch.Generator().manual_seed(0)
    chain = [tuple(ids[5 : 5 + j]) for j in range(8)]
    alt = [tuple(ids[5:7]) + (t,) for t in range(0, len(bpe), 37)]  # siblings: many are dead
    prefixes = chain + alt
    order = list(range(len(prefixes)))
    rng.shuffle(order)
    prefixes = [prefixes[i] for i in order]
    logits = torch.randn(len(prefixes), len(bpe) + 13, generator=gen)
    together = proc.apply(logits, prefixes)
    for p, prefix in enumerate(prefixes):
        alone = proc.apply(logits[p : p + 1], [prefix])[0]
        assert torch.equal(together[p], alone), prefix
    assert not torch.equal(together, logits)


def test_apply_leaves_the_state_and_the_input_unchanged(compiler, bpe):
    proc = compiler.processor(GrammarSpec.json_schema(SCHEMA))
    ids = bpe.encode('{"name": "ab", "age": 3', add_special_tokens=False)
    proc.commit(ids[:4])
    logits = torch.randn(6, len(bpe))
    before, saved = proc.apply(logits, [()]), logits.clone()
    proc.apply(logits, [tuple(ids[4 : 4 + j]) for j in range(6)])
    proc.apply(logits[:2], [tuple(ids[4:]), (bpe.eos_token_id, 5)])
    assert torch.equal(proc.apply(logits, [()]), before) and torch.equal(logits, saved)


def test_commit_advances_like_the_prefix(compiler, bpe):
    proc = compiler.processor(GrammarSpec.json_schema(SCHEMA))
    ids = bpe.encode('{"name": "ab", "age": 3', add_special_tokens=False)
    logits = torch.randn(1, len(bpe))
    expected = proc.apply(logits, [tuple(ids)])
    proc.commit(ids[:3])
    proc.commit(ids[3:])
    assert torch.equal(proc.apply(logits, [()]), expected)
    bad = bpe.convert_tokens_to_ids("x")
    with pytest.raises(RuntimeError, match="not allowed"):
        proc.commit([bad])
    assert torch.equal(proc.apply(logits, [()]), expected)  # unchanged by the refused commit


def test_a_forbidden_drafted_token_leaves_the_positions_after_it_unmasked(compiler, bpe):
    """The target's masked law gives the forbidden token probability 0, so verification rejects it and
    never uses the positions after it; their rows stay raw (finite: no NaN in a softmax)."""
    proc = compiler.processor(GrammarSpec.json_schema(SCHEMA))
    ok = bpe.encode('{"name', add_special_tokens=False)
    bad = bpe.convert_tokens_to_ids("7")
    beyond = len(bpe) + 3  # an id of the logits' padding, which the tokenizer does not have
    prefixes = [(), tuple(ok), tuple(ok) + (bad,), tuple(ok) + (bad, bad), (bpe.eos_token_id,), (beyond,)]
    logits = torch.randn(len(prefixes), len(bpe) + 9)
    before = proc.apply(logits[:2], prefixes[:2])
    out = proc.apply(logits, prefixes)
    assert out[1, bad] == float("-inf") and out[0, beyond] == float("-inf")  # impossible where drafted
    for p in (2, 3, 4, 5):
        assert torch.equal(out[p], logits[p])
    assert torch.isfinite(out[0]).sum() < len(bpe) // 2 and torch.isfinite(out[1]).any()
    assert torch.equal(proc.apply(logits[:2], prefixes[:2]), before) and not proc.error
    with pytest.raises(RuntimeError, match="not allowed"):
        proc.commit([beyond])
    assert torch.equal(proc.apply(logits[:2], [torch.tensor(t) for t in prefixes[:2]]), before)


def test_end_tokens_only_where_complete_and_alone_after(compiler, bpe):
    eos, stop = bpe.eos_token_id, bpe.convert_tokens_to_ids("~")
    assert eos == 0  # with stop ids 1 and 2, three end bits share one byte of the bitmask
    proc = compiler.processor(GrammarSpec.regex(r"ab|abab"), stop_token_ids=[stop, 1, 2])
    a, b = bpe.convert_tokens_to_ids("a"), bpe.convert_tokens_to_ids("b")
    assert allowed_ids(proc) == {a} and proc.accepting is False
    assert allowed_ids(proc, [a, b]) == {a, eos, stop, 1, 2}
    assert allowed_ids(proc, [a, b, a, b]) == {eos, stop, 1, 2}
    proc.commit([a, b, a, b])
    assert proc.accepting and proc.finished and not proc.ended
    proc.commit([stop, a])  # an end token ends the output; what follows it is not the output's
    assert proc.ended and proc.finished


def test_logits_wider_than_the_vocabulary(compiler, bpe):
    proc = compiler.processor(GrammarSpec.json_object())
    width = len(bpe) + 40
    out = proc.apply(torch.zeros(2, width), [(), tuple(bpe.encode("{", add_special_tokens=False))])
    assert out.shape == (2, width) and torch.isinf(out[:, len(bpe) :]).all()
    assert allowed_ids(proc, (), width) == allowed_ids(proc)


# --- random walks: outputs parse and validate -----------------------------------------------------------


def _closing_weight(bpe):
    """Favour tokens that close strings, objects and arrays so that walks end."""
    weights = [8.0 if any(c in bpe.decode([t]) for c in '"}]0123456789') else 1.0 for t in range(len(bpe))]
    return weights.__getitem__


def test_json_object_walks_always_parse(compiler, bpe):
    rng, parsed = random.Random(4), 0
    for _ in range(60):
        ids, ended = random_walk(compiler.processor(GrammarSpec.json_object()), rng, weight=_closing_weight(bpe))
        if ended:
            assert isinstance(json.loads(bpe.decode(ids)), dict)
            parsed += 1
    assert parsed >= 30


def _check_by_hand(obj):
    assert set(obj) <= set(SCHEMA["properties"]) and {"name", "age", "role", "home"} <= set(obj)
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 150
    assert obj["role"] in ("dev", "ops", "pm")
    assert "score" not in obj or type(obj["score"]) in (int, float)
    assert "tags" not in obj or (len(obj["tags"]) <= 3 and all(isinstance(t, str) and len(t) <= 6 for t in obj["tags"]))
    assert set(obj["home"]) == {"zip"} and regex.fullmatch(r"[0-9]{3}", obj["home"]["zip"])


def test_schema_walks_always_validate(compiler, bpe):
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    rng, valid = random.Random(5), 0
    for _ in range(40):
        ids, ended = random_walk(compiler.processor(GrammarSpec.json_schema(SCHEMA)), rng, weight=_closing_weight(bpe))
        if ended:
            obj = json.loads(bpe.decode(ids))
            _check_by_hand(obj)
            if jsonschema is not None:
                jsonschema.validate(obj, SCHEMA)
            valid += 1
    assert valid >= 20


def test_a_state_no_token_can_extend_allows_the_end_tokens():
    """The one-character vocabulary has no '!': after 'ab' nothing is allowed, so the output ends."""
    tok = make_tokenizer(40)
    proc = GrammarCompiler(tok).processor(GrammarSpec.regex(r"ab!"))
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    assert allowed_ids(proc, [a]) == {b}
    assert allowed_ids(proc, [a, b]) == {tok.eos_token_id}
