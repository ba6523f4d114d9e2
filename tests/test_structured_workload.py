"""The structured-output workload shipped in specdecode/data/structured (json_extract, issue 40): its
fields, sizes and splits; every schema compiles in the grammar engine and admits its reference answer (and
rejects a wrong one); each record is what scripts/cut_structured.py computes from its stored excerpt;
loading it by name, through bench's --prompts and tokenizer. Offline: the tokenizer is built in code."""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdecode.bench import cli
from specdecode.bench.prompts import STRUCTURED_DIR, PromptSetError, load_jsonl, load_prompt_set
from specdecode.bench.runner import tokenize_prompts
from specdecode.grammar import GrammarCompiler, GrammarSpec

REPO = Path(__file__).resolve().parents[1]
SPLITS = ("dev", "test")
SDISTS = Path.home() / ".cache" / "specdecode" / "sdists"


def _script():
    spec = importlib.util.spec_from_file_location("cut_structured", REPO / "scripts" / "cut_structured.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


C = _script()


def rows() -> list[dict]:
    return [json.loads(line) for line in (STRUCTURED_DIR / "json_extract.jsonl").read_text("utf-8").splitlines()]


def sources() -> dict[str, dict]:
    return {s["package"]: s for s in json.loads((STRUCTURED_DIR / "sources.json").read_text("utf-8"))["sources"]}


@pytest.fixture(scope="module")
def bpe():
    """A GPT-2-style byte-level BPE (every byte a token) with merges learned from the answers, and a chat
    template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([json.dumps(r["reference"]) for r in rows()], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    hf.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    return hf


# -- the shipped files -----------------------------------------------------------------------------
def test_the_shipped_files_are_small_and_name_every_source_with_its_license():
    files = {f.name: f for f in STRUCTURED_DIR.iterdir()}
    assert {"json_extract.jsonl", "sources.json", "NOTICE", "README.md"} <= set(files)
    assert sum(f.stat().st_size for f in files.values()) < 500_000
    notice = files["NOTICE"].read_text("utf-8")
    for package, version in {(r["source"]["package"], r["source"]["version"]) for r in rows()}:
        meta = sources()[package]
        assert meta["version"] == version and len(meta["sha256"]) == 64 and meta["used"]
        assert any(x in meta["license"] for x in ("MIT", "BSD", "Apache"))
        assert f"{package} {version}" in notice and meta["sha256"] in notice
    pinned = {s.name: s for s in C.SOURCES}
    assert {p: (m["version"], m["sha256"]) for p, m in sources().items()} == {
        p: (s.version, s.sha256) for p, s in pinned.items()
    }


def test_rows_have_their_fields_and_each_split_every_shape():
    data = rows()
    assert [r["id"] for r in data] == [f"json_extract/{i}" for i in range(len(data))]
    for r in data:
        assert r["category"] == "json_extract" and r["split"] in SPLITS and r["shape"] in C.SHAPES
        system, user = r["messages"]
        assert (system["role"], user["role"]) == ("system", "user")
        assert r["input"] in user["content"]  # the excerpt, verbatim
        assert json.dumps(C.SCHEMAS[r["shape"]]) in user["content"]  # the schema is in the prompt too
        fmt = r["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == r["shape"]
        assert fmt["json_schema"]["strict"] == C.openai_strict(fmt["json_schema"]["schema"])
        assert {"package", "version", "file"} <= set(r["source"])
        assert type(r["max_new_tokens"]) is int and r["max_new_tokens"] >= 64
        # room for the answer pretty-printed, at ~3 characters a token
        assert r["max_new_tokens"] * 3 >= len(json.dumps(r["reference"], indent=1)) * 0.9
    for split in SPLITS:
        half = [r for r in data if r["split"] == split]
        assert len(half) == 20
        assert {s: sum(r["shape"] == s for r in half) for s in C.SHAPES} == {s: C.PER_SHAPE for s in C.SHAPES}
    assert {r["response_format"]["json_schema"]["strict"] for r in data} == {True, False}  # tool_config: optional


def test_dev_and_test_share_no_package_and_no_prompt():
    data = rows()
    by_split = {s: [r for r in data if r["split"] == s] for s in SPLITS}
    packages = {s: {r["source"]["package"] for r in by_split[s]} for s in SPLITS}
    assert not packages["dev"] & packages["test"]
    texts = {s: {json.dumps(r["messages"]) for r in by_split[s]} for s in SPLITS}
    assert not texts["dev"] & texts["test"] and len(texts["dev"]) == len(texts["test"]) == 20
    # the split of a package is a function of its name alone
    assert all(C.split_packages([p.name for p in C.SOURCES])[r["source"]["package"]] == r["split"] for r in data)


# -- schemas and reference answers ----------------------------------------------------------------------
def test_every_schema_compiles_and_every_reference_validates_and_parses_under_its_grammar(bpe):
    compiler = GrammarCompiler(bpe)
    for r in rows():
        schema = r["response_format"]["json_schema"]["schema"]
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(r["reference"], schema)
        spec = GrammarSpec.from_response_format(r["response_format"])
        for style in ({"separators": (",", ":")}, {}, {"indent": 2}):  # compact, OpenAI's, pretty
            matcher = compiler.compile(spec)
            ids = bpe(json.dumps(r["reference"], ensure_ascii=False, **style), add_special_tokens=False).input_ids
            assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting(), (r["id"], style)


def _wrong(reference: dict) -> dict:
    """The reference with one more property at the top (every schema forbids additional properties)."""
    return {**copy.deepcopy(reference), "note": "x"}


def test_a_wrong_answer_fails_the_schema_and_the_grammar(bpe):
    """Negative control: the checks above are not vacuous."""
    compiler = GrammarCompiler(bpe)
    for shape in C.SHAPES:
        r = next(r for r in rows() if r["shape"] == shape)
        schema = r["response_format"]["json_schema"]["schema"]
        bad = _wrong(r["reference"])
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        ids = bpe(json.dumps(bad), add_special_tokens=False).input_ids
        matcher = compiler.compile(GrammarSpec.from_response_format(r["response_format"]))
        assert matcher.try_consume_tokens(ids) < len(ids), shape


# -- the script --------------------------------------------------------------------------------------
def test_each_record_is_what_the_script_computes_from_its_stored_excerpt():
    for r in rows():
        src = r["source"]
        excerpt = C.Excerpt(r["shape"], src["package"], src["version"], src["file"], r["input"])
        assert C.record(excerpt) == {k: v for k, v in r.items() if k not in ("id", "category", "split")}, r["id"]


def test_the_cut_is_deterministic_and_seeded():
    pool = [
        C.Excerpt(r["shape"], r["source"]["package"], r["source"]["version"], r["source"]["file"], r["input"])
        for r in rows()
    ]
    pool += [
        C.Excerpt("changelog", "flask", "3.0.3", "CHANGES.rst", r["input"])
        for r in rows()
        if r["shape"] == "changelog" and r["source"]["package"] != "flask"
    ][:1]
    first = C.cut(pool, C.SEED)
    assert C.cut(list(reversed(pool)), C.SEED) == first  # the input order does not matter
    assert C.cut(pool, C.SEED) == first
    assert [r["split"] for r in first] == ["dev"] * 20 + ["test"] * 20


def test_parsers_on_small_inputs():
    header = (
        "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\nSummary: A demo\nLicense: Apache 2.0\n"
        "Classifier: Development Status :: 4 - Beta\nClassifier: License :: OSI Approved :: MIT License\n"
        "Classifier: Typing :: Typed\nClassifier: Programming Language :: Python :: 3 :: Only\n"
        "Classifier: Programming Language :: Python :: 3.12\n"
        "Classifier: Programming Language :: Python :: Implementation :: PyPy\n"
        "Requires-Dist: foo (>=1.0)\nRequires-Dist: bar[x]<2,>=1; python_version < '3.11'\n"
        "Provides-Extra: test\nRequires-Dist: baz; extra == 'test'\n"
        "Requires-Dist: qux>=2; (os_name == 'nt') and extra == 'test'\n"
    )
    assert C.package_card(header) == {
        "name": "demo",
        "version": "1.0",
        "summary": "A demo",
        "license": "Apache 2.0",
        "requires_python": None,
        "development_status": "Beta",
        "typed": True,
        "requirement_count": 4,
        "extras": ["test"],
    }
    assert C.dependencies(header) == {
        "runtime": [
            {"name": "foo", "specifier": ">=1.0", "marker": None},
            {"name": "bar", "specifier": "<2,>=1", "marker": "python_version < '3.11'"},
        ],
        "extras": [{"extra": "test", "packages": ["baz", "qux"]}],
    }
    assert C.classifiers(header)["python"] == {"versions": ["3.12"], "implementations": ["PyPy"], "only_python_3": True}
    section = (
        "Version 1.2\n-----------\n\nReleased 2024-01-02\n\n-   Fix ``a``. :issue:`12`\n"
        "-   Add b, see #7 and\n    :pr:`9`, again #7.\n"
    )
    assert C.changelog(section) == {
        "version": "1.2",
        "released": "2024-01-02",
        "changes": [
            {"category": None, "text": "Fix ``a``. :issue:`12`", "references": [12]},
            {"category": None, "text": "Add b, see #7 and :pr:`9`, again #7.", "references": [7, 9]},
        ],
    }
    assert C.changelog(section + "    -   nested\n") is None
    assert C.changelog("Release 7.3.7 (released Apr 19, 2024)\n====\n\nBugs fixed\n----------\n\n* a\n* b\n") == {
        "version": "7.3.7",
        "released": "2024-04-19",
        "changes": [{"category": "Bugs fixed", "text": t, "references": []} for t in "ab"],
    }
    toml = (
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\nxfail_strict = true\nother = 1\n\n'
        '[tool.mypy]\nstrict = true\nfiles = "src"\n'
    )
    assert C.toml_tables(toml + "\n[tool.ruff]\nx = 1\n", ("tool.pytest.ini_options", "tool.mypy")) == toml
    assert C.tool_config(toml) == {
        "pytest": {"testpaths": ["tests"], "xfail_strict": True},
        "mypy": {"files": "src", "strict": True},
    }


@pytest.mark.skipif(
    not all((SDISTS / s.filename).is_file() for s in C.SOURCES),
    reason="the pinned sdists are not in ~/.cache/specdecode/sdists (run scripts/cut_structured.py)",
)
def test_recutting_from_the_pinned_sdists_gives_the_shipped_files_byte_for_byte(tmp_path):
    pool, texts = [], {}
    for s in C.SOURCES:
        data = C.fetch(s, SDISTS)
        assert hashlib.sha256(data).hexdigest() == s.sha256
        files = C.read_members(
            data, ["PKG-INFO", "pyproject.toml", *([s.changelog] if s.changelog else []), *s.notices]
        )
        pool += C.excerpts(s, files)
        texts[s.name] = "\n".join(f"--- {n} ---\n{files[n].strip()}\n" for n in s.notices)
    C.write(tmp_path, C.cut(pool, C.SEED), C.SEED, texts)
    for name in ("json_extract.jsonl", "sources.json", "NOTICE"):
        assert (tmp_path / name).read_bytes() == (STRUCTURED_DIR / name).read_bytes(), name


# -- prompt sets and bench -------------------------------------------------------------------------
def test_load_prompt_set_by_name_and_split():
    everything, dev, test = (load_prompt_set(s) for s in ("json_extract", "json_extract:dev", "json_extract:test"))
    assert len(dev) == len(test) == 20 and len(everything) == 40
    assert {p.id for p in dev} | {p.id for p in test} == {p.id for p in everything}
    assert not {p.id for p in dev} & {p.id for p in test}
    by_id = {r["id"]: r for r in rows()}
    for p in everything:
        r = by_id[p.id]
        assert (p.kind, p.category, p.text, p.messages, p.max_new_tokens, p.response_format) == (
            "chat",
            "json_extract",
            None,
            r["messages"],
            r["max_new_tokens"],
            r["response_format"],
        )
    two = load_prompt_set("json_extract:dev", n=2, seed=3)
    assert len(two) == 2 and two == load_prompt_set("json_extract:dev", n=2, seed=3)
    assert {p.id for p in two} <= {p.id for p in dev}
    assert all(p.response_format is None for p in load_prompt_set("code_edit:dev", n=2))


@pytest.mark.parametrize(
    "spec, kw, message",
    [
        ("json_extract:train", {}, "json_extract:dev or json_extract:test"),
        ("json_extract", {"categories": ["x"]}, "no categories"),
        ("json_extract:dev", {"n": 0}, "positive"),
        ("json", {}, "json_extract"),
    ],
)
def test_bad_specs_are_clear_errors(spec, kw, message):
    with pytest.raises(PromptSetError, match=message):
        load_prompt_set(spec, **kw)


def test_bench_takes_the_set_on_its_command_line(bpe):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert "json_extract" in parser.format_help()
    args = parser.parse_args(["--prompts", "json_extract:dev", "-n", "2", "--seed", "1"])
    prompts = cli._load_prompts(args)
    assert [p.id for p in prompts] == [p.id for p in load_prompt_set("json_extract:dev", n=2, seed=1)]
    bench_prompts, skipped = tokenize_prompts(prompts, bpe, 16, 100_000)
    assert not skipped
    assert [b.max_new_tokens for b in bench_prompts] == [p.max_new_tokens for p in prompts]
    assert all(b.kind == "chat" and b.ids for b in bench_prompts)


def test_a_user_jsonl_carries_a_response_format(tmp_path):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "response_format": fmt}) + "\n")
    (p,) = load_jsonl(file)
    assert p.response_format == fmt
    for bad in ("json", {"json_schema": {}}):
        file.write_text(json.dumps({"prompt": "x", "response_format": bad}) + "\n")
        with pytest.raises(PromptSetError, match="response_format"):
            load_jsonl(file)
