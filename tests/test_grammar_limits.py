"""Grammars no request can turn against the server (issue 59, findings 1-5), on the grammar module:
bounds checked before any native code compiles a spec, the sandbox child that absorbs a native crash and
enforces the time and memory budgets, pathological regexes refused, a cache bounded in bytes that never
keeps a failure, no lexer state shared between requests, and unsatisfiable or never-ending grammars that
are a 400 at validation or end the output — never an exception. Tokenizers and models built in code."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.grammar import GrammarCompiler, GrammarError, GrammarSpec
from specdecode.grammar_bounds import GrammarLimits, rule_depth, rule_graph, schema_depth
from specdecode.sampling import SamplingParams
from test_structured import json_tokenizer
from tiny import make_engine, make_model, make_tokenizer, perturbed_copy


@pytest.fixture(scope="module")
def bpe():
    return json_tokenizer()


@pytest.fixture(scope="module")
def compiler(bpe):
    return GrammarCompiler(bpe)


@pytest.fixture(scope="module")
def sandboxed(bpe):
    """A compiler whose new specs go through the sandbox child (the server's time budget: CPU seconds, so
    a busy machine does not change its verdicts); specs naming FAULT:crash (memory) make the child
    segfault (allocate past its budget). The time budget's own tests: tests/test_grammar_sandbox.py."""
    compiler = GrammarCompiler(bpe, limits=GrammarLimits(memory_budget_bytes=512 << 20))
    compiler.start_sandbox(fault_marker="FAULT")
    yield compiler
    compiler.close()


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$defs": defs | {f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def any_of_chain(n: int) -> dict:
    defs = {
        f"d{i}": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}]}
        for i in range(n)
    }
    return {"$defs": defs | {f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def properties_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$defs": defs | {f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} | [a-z]\n" for i in range(n)) + f'r{n} ::= "a"\n'


POISON_REGEXES = ["(x{2000}){500}", "a{1000000}", "((x{100}){100}){100}"]


# --- finding 1: bounds before compiling; the sandbox --------------------------------------------------------


@pytest.mark.parametrize(
    "spec, bound",
    [
        (GrammarSpec.json_schema(ref_chain(2500)), "max_schema_depth"),  # each of these segfaulted the process
        (GrammarSpec.json_schema(any_of_chain(1000)), "max_schema_depth"),
        (GrammarSpec.json_schema(properties_chain(1000)), "max_schema_depth"),
        (GrammarSpec.grammar(lark_chain(4000)), "max_rule_depth"),
        (GrammarSpec.grammar(gbnf_chain(4000)), "max_rule_depth"),
        (GrammarSpec.grammar("start: %json " + json.dumps(ref_chain(500))), "max_schema_depth"),
        (GrammarSpec.regex("a" * (200 << 10)), "max_grammar_bytes"),
    ],
)
def test_long_chains_and_big_specs_are_refused_before_compiling(compiler, spec, bound):
    with pytest.raises(GrammarError, match=bound):
        compiler.validate(spec)
    assert spec not in compiler._cache


def test_the_depths_cut_recursion_and_count_chains():
    assert schema_depth({"$ref": "#"}) == 1
    assert schema_depth(True) == schema_depth(False) == 0  # found by the fuzz run: a TypeError (a 500)
    assert schema_depth({"type": "object", "properties": {"next": {"$ref": "#"}}}) == 3  # recursion: cut
    assert schema_depth(ref_chain(10)) == 13
    expr = 'start: expr\nexpr: term | expr "+" term // a comment: x y z\nterm: NUM | "(" expr ")"\nNUM: /[0-9]+/\n'
    graph, start = rule_graph(expr)
    assert start == "start" and graph["expr"] == {"expr", "term"} and rule_depth(graph, start) == 4
    graph, start = rule_graph('root ::= item+ "g" # [x y]\nitem ::= "ab" | "c" [d-f]+\n')
    assert start == "root" and graph == {"root": {"item"}, "item": set()}
    assert rule_depth(*rule_graph(lark_chain(50))) == 52


def test_a_native_crash_in_the_sandbox_costs_the_child_only(sandboxed):
    before = sandboxed.sandbox.restarts
    with pytest.raises(GrammarError, match="crashed"):
        sandboxed.validate(GrammarSpec.regex("FAULT:crash"))
    sandboxed.validate(GrammarSpec.regex("[0-9]+ after a crash"))  # a fresh child
    assert sandboxed.sandbox.restarts == before + 1
    assert GrammarSpec.regex("FAULT:crash") not in sandboxed._cache


def test_a_real_native_crash_without_the_bounds_costs_the_child_only(bpe):
    """The bounds off: a 2,500-link $ref chain overflows llguidance's native stack (1.9.1). In the sandbox
    that is a 400-worthy GrammarError, and this process goes on."""
    limits = GrammarLimits(max_schema_depth=10**9, max_rule_depth=10**9, time_budget_s=30.0)
    compiler = GrammarCompiler(bpe, limits=limits)
    compiler.start_sandbox()
    try:
        with pytest.raises(GrammarError, match="crashed"):
            compiler.validate(GrammarSpec.json_schema(ref_chain(2500)))
        compiler.validate(GrammarSpec.json_schema(ref_chain(20)))
    finally:
        compiler.close()


def test_the_memory_budget(sandboxed):
    with pytest.raises(GrammarError, match="grammar_memory_budget_bytes"):
        sandboxed.validate(GrammarSpec.regex("FAULT:memory"))
    sandboxed.validate(GrammarSpec.regex("[a-z]+ after the budgets"))


# --- findings 2 and 3: pathological regexes; the cache --------------------------------------------------


@pytest.mark.parametrize("pattern", POISON_REGEXES)
def test_pathological_regexes_are_refused_naming_the_bound(compiler, sandboxed, pattern):
    for c in (compiler, sandboxed):
        with pytest.raises(GrammarError, match="max_matcher_bytes"):
            c.validate(GrammarSpec.regex(pattern))
        assert GrammarSpec.regex(pattern) not in c._cache


def test_the_cache_is_bounded_in_entries_and_bytes(bpe):
    limits = GrammarLimits(cache_entries=4, cache_bytes=3 << 20, ready_per_spec=4)
    compiler = GrammarCompiler(bpe, limits=limits)
    specs = [GrammarSpec.regex(f"[a-z]{{{n}}}[0-9]+") for n in range(1, 12)]
    for spec in specs:
        compiler.prepare(spec, 4)
        assert len(compiler._cache) <= 4 and compiler.cache_bytes <= 3 << 20
    assert specs[-1] in compiler._cache and specs[0] not in compiler._cache  # LRU
    matcher = compiler.compile(specs[-1])
    assert matcher is not compiler.compile(specs[-1])  # each request its own
    with pytest.raises(GrammarError):
        compiler.validate(GrammarSpec.regex("(ab"))
    assert GrammarSpec.regex("(ab") not in compiler._cache


# --- finding 4: nothing shared between requests ----------------------------------------------------------


def test_a_request_that_exhausts_the_lexer_leaves_the_next_one_of_the_same_spec_unharmed(compiler, bpe):
    """Request A takes the branch whose lexer blows up; B, same spec, then takes the other branch to the
    end. (With matchers copied from one cached root, B's lexer shared A's and failed: "too many
    expressions constructed".)"""
    spec = GrammarSpec.regex("x[0-9]{3}|a(b{1000}){1000}")
    a, x = bpe.convert_tokens_to_ids("a"), bpe.convert_tokens_to_ids("x")
    first = compiler.processor(spec)
    first.apply(torch.zeros(2, len(bpe)), [(), (a,)])  # the lexer state after "a"
    for _ in range(3):
        first.apply(torch.zeros(1, len(bpe)), [(a,)])
    second = compiler.processor(spec)
    assert second.matcher is not first.matcher
    digits = bpe("x123").input_ids
    assert digits[0] == x
    second.commit(digits)
    assert not second.error and second.finished and not second.incomplete


# --- finding 5: unsatisfiable and never-ending grammars ------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.regex("[a&&b]"),
        GrammarSpec.regex(r"a[^\x00-\x{10FFFF}]"),
        GrammarSpec.json_schema({"$ref": "#"}),
        GrammarSpec.json_schema(
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        ),
    ],
)
def test_unsatisfiable_specs_are_refused_at_validation(compiler, sandboxed, spec):
    for c in (compiler, sandboxed):
        with pytest.raises(GrammarError, match=spec.kind):
            c.validate(spec)


def test_a_boolean_schema_is_served(compiler):
    compiler.validate(GrammarSpec.json_schema(True))
    with pytest.raises(GrammarError, match="false"):
        compiler.validate(GrammarSpec.json_schema(False))


def test_json_on_a_vocabulary_that_cannot_spell_a_brace_is_refused():
    compiler = GrammarCompiler(make_tokenizer(32))  # letters only
    with pytest.raises(GrammarError, match="vocabulary can begin"):
        compiler.validate(GrammarSpec.json_object())
    compiler.validate(GrammarSpec.regex("[a-z]*"))  # complete when empty: fine


@pytest.mark.parametrize("draft", [False, True])
def test_grammars_that_never_end_or_want_an_end_token_mid_output_end_it(draft):
    """``start: "a" start`` has no finite output (llguidance errors on its first token); ``"a" <eos> "b"``
    wants the end token in the middle. Each output ends ("stop"), flagged incomplete, never an exception;
    bystanders in the same batch are unaffected."""
    tok = make_tokenizer(32)
    target = make_model(32, seed=3)
    engine = make_engine(target, tok, perturbed_copy(target, 0.1) if draft else None, k=3 if draft else 0)
    ref = make_engine(target, tok)
    prompt = [1, 2, 3]
    bystander = SamplingParams(max_new_tokens=12, grammar=GrammarSpec.regex("[a-e]+f"))
    dead = [
        SamplingParams(max_new_tokens=12, grammar=GrammarSpec.grammar('start: "a" start')),
        SamplingParams(max_new_tokens=12, grammar=GrammarSpec.grammar(f'start: "a" <[{tok.eos_token_id}]> "b"')),
        SamplingParams(1.0, seed=4, max_new_tokens=12, grammar=GrammarSpec.grammar('start: "ab" start')),
    ]
    outs = engine.generate([prompt] * 4, [bystander] + dead)
    assert outs[0].token_ids == ref.generate([prompt], bystander)[0].token_ids
    for out in outs[1:]:
        assert out.finish_reason == "stop" and out.text.startswith("a") and len(out.text) <= 2, out
