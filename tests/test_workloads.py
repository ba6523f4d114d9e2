"""The code workloads shipped in specdecode/data/code_workloads (fim, code_edit): their fields, sizes and
splits; loading them by name; FIM prompts through the bench runner (the model's FIM format and stop
rules) and through the load generator (OpenAI's ``suffix``), against a fake server and ours."""

from __future__ import annotations

import ast
import json

import pytest
from fake_openai import Behaviour, FakeServer

from specdecode.bench import runner as R
from specdecode.bench.prompts import CODE_WORKLOADS_DIR, Prompt, PromptSetError, load_jsonl, load_prompt_set
from specdecode.fim import fim_prompt, fim_tokens, stop_fields
from specdecode.load.client import Target, request_body
from specdecode.load.runner import LoadConfig, run_sweep
from specdecode.sampling import SamplingSetting
from test_fim import PREFIX, SUFFIX, make_fim_tokenizer, pair
from test_server_harness import KEY, one_torch_thread, serve  # noqa: F401 (a fixture)
from tiny import make_engine, make_tokenizer, serving

SPLITS = ("dev", "test")


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (CODE_WORKLOADS_DIR / f"{name}.jsonl").read_text("utf-8").splitlines()]


def sources() -> dict[str, dict]:
    meta = json.loads((CODE_WORKLOADS_DIR / "sources.json").read_text("utf-8"))
    return {s["package"]: s for s in meta["sources"]}


# -- the shipped files -----------------------------------------------------------------------------
def test_the_shipped_files_are_small_and_name_every_source_with_its_license():
    files = list(CODE_WORKLOADS_DIR.iterdir())
    assert {"fim.jsonl", "code_edit.jsonl", "sources.json", "NOTICE", "README.md"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) < 600_000
    notice = (CODE_WORKLOADS_DIR / "NOTICE").read_text("utf-8")
    used = {(r["source"]["package"], r["source"]["version"]) for name in ("fim", "code_edit") for r in rows(name)}
    for package, version in used:
        meta = sources()[package]
        assert meta["version"] == version and len(meta["sha256"]) == 64
        assert any(x in meta["license"] for x in ("MIT", "BSD", "Apache"))
        assert f"{package} {version}" in notice and meta["sha256"] in notice


def test_fim_rows_have_their_fields_sizes_and_cursor_kinds():
    fim = rows("fim")
    assert [r["id"] for r in fim] == [f"fim/{i}" for i in range(len(fim))]
    for r in fim:
        assert r["category"] == "fim" and r["split"] in SPLITS
        assert {"package", "version", "file", "line"} <= set(r["source"])
        assert 1000 <= len(r["prefix"]) <= 8000 and 1000 <= len(r["suffix"]) <= 8000, r["id"]
        assert len(r["prefix"]) + len(r["suffix"]) <= 10000
        assert 1 <= r["reference"].count("\n") + 1 <= 3 and r["reference"].strip()
        assert r["suffix"].startswith("\n") and r["suffix"].endswith("\n")  # whole lines around the middle
        assert r["fim_stop"] == ("line" if r["cursor"] == "mid_line" else "block")
        assert r["max_new_tokens"] in (32, 64)
        if r["cursor"] == "mid_line":
            assert r["prefix"].rpartition("\n")[2].strip() and "\n" not in r["reference"]
        else:  # the cursor after the line's indentation
            assert not r["prefix"].rpartition("\n")[2].strip()
    for split in SPLITS:
        half = [r for r in fim if r["split"] == split]
        assert len(half) >= 16
        assert {r["cursor"] for r in half} == {"line_start", "mid_line", "block"}
        assert {"python", "c", "rust", "javascript"} <= {r["language"] for r in half}


def test_code_edit_rows_are_real_functions_with_one_change():
    edits = rows("code_edit")
    assert [r["id"] for r in edits] == [f"code_edit/{i}" for i in range(len(edits))]
    for r in edits:
        assert r["category"] == "code_edit" and r["split"] in SPLITS and r["language"] == "python"
        (message,) = r["messages"]
        assert message["role"] == "user" and r["instruction"] in message["content"]
        code = message["content"].split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        assert 20 <= code.count("\n") + 1 <= 80
        (fn,) = ast.parse(code).body
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == r["source"]["function"]
        assert r["max_new_tokens"] > 0
        if r["change"].startswith("rename_"):  # the exact answer: the input with one name changed
            ast.parse(r["reference"])
            assert r["reference"] != code and r["reference"].count("\n") == code.count("\n")
        else:
            assert r["reference"] is None
    for split in SPLITS:
        half = [r for r in edits if r["split"] == split]
        assert len(half) >= 16 and len({r["change"] for r in half}) >= 4


@pytest.mark.parametrize("name", ["fim", "code_edit"])
def test_dev_and_test_share_no_prompt_and_no_source_file(name):
    by_split = {s: [r for r in rows(name) if r["split"] == s] for s in SPLITS}
    files = {s: {(r["source"]["package"], r["source"]["file"]) for r in by_split[s]} for s in SPLITS}
    assert not files["dev"] & files["test"]
    texts = {s: {r.get("prefix", "") + json.dumps(r.get("messages")) for r in by_split[s]} for s in SPLITS}
    assert not texts["dev"] & texts["test"]


# -- prompt sets -----------------------------------------------------------------------------------
def test_load_prompt_set_by_name_and_split():
    fim, dev, test = (load_prompt_set(s) for s in ("fim", "fim:dev", "fim:test"))
    assert {p.id for p in dev} | {p.id for p in test} == {p.id for p in fim} and not {p.id for p in dev} & {
        p.id for p in test
    }
    assert len(dev) >= 16 and len(test) >= 16
    first = rows("fim")[0]
    p = next(p for p in fim if p.id == first["id"])
    assert (p.kind, p.text, p.suffix, p.fim_stop, p.max_new_tokens, p.category) == (
        "completion",
        first["prefix"],
        first["suffix"],
        first["fim_stop"],
        first["max_new_tokens"],
        "fim",
    )
    assert p.is_fim and p.messages is None
    edits, edev, etest = (load_prompt_set(s) for s in ("code_edit", "code_edit:dev", "code_edit:test"))
    assert len(edev) >= 16 and len(etest) >= 16 and len(edits) == len(edev) + len(etest)
    assert all(p.kind == "chat" and not p.is_fim and p.category == "code_edit" for p in edits)
    two = load_prompt_set("fim:dev", n=2, seed=3)
    assert (
        len(two) == 2 and two == load_prompt_set("fim:dev", n=2, seed=3) and {p.id for p in two} <= {p.id for p in dev}
    )


@pytest.mark.parametrize(
    "spec, kw, message",
    [
        ("fim:train", {}, "fim:dev or fim:test"),
        ("code_edit:", {}, "code_edit:dev"),
        ("fim", {"categories": ["python"]}, "no categories"),
        ("fim:dev", {"n": 0}, "positive"),
    ],
)
def test_bad_code_workload_specs_are_clear_errors(spec, kw, message):
    with pytest.raises(PromptSetError, match=message):
        load_prompt_set(spec, **kw)


def test_user_jsonl_takes_a_suffix(tmp_path):
    file = tmp_path / "p.jsonl"
    file.write_text(
        json.dumps({"id": "a", "prompt": "def f(", "suffix": ")\n", "fim_stop": "line"})
        + "\n"
        + json.dumps({"id": "b", "prompt": "x = "})
        + "\n"
    )
    a, b = load_jsonl(file)
    assert (a.text, a.suffix, a.fim_stop, a.is_fim) == ("def f(", ")\n", "line", True)
    assert (b.suffix, b.fim_stop, b.is_fim) == (None, None, False)
    for bad, message in (
        ({"messages": [{"role": "user", "content": "x"}], "suffix": "y"}, "'suffix'"),
        ({"prompt": "x", "suffix": 3}, "'suffix'"),
        ({"prompt": "x", "fim_stop": "line"}, "'fim_stop'"),
        ({"prompt": "x", "suffix": "y", "fim_stop": "word"}, "'fim_stop'"),
    ):
        file.write_text(json.dumps(bad) + "\n")
        with pytest.raises(PromptSetError, match=message):
            load_jsonl(file)
    with pytest.raises(ValueError, match="suffix"):
        Prompt("c", "x", None, [{"role": "user", "content": "x"}], "chat", suffix="y")


# -- the bench runner ------------------------------------------------------------------------------
def fim_prompt_of(pid: str, prefix: str = PREFIX, suffix: str = SUFFIX, rule: str | None = None, new: int = 12):
    return Prompt(pid, "fim", prefix, None, "completion", max_new_tokens=new, suffix=suffix, fim_stop=rule)


def test_tokenize_prompts_builds_the_models_fim_prompt_and_stop_fields():
    tok = make_fim_tokenizer()
    fim = fim_tokens(tok)
    plain = Prompt("plain", "c", "abc", None, "completion")
    prompts = [fim_prompt_of("line", rule="line"), fim_prompt_of("default"), plain]
    (line, default, raw), skipped = R.tokenize_prompts(prompts, tok, 8, 4096)
    assert not skipped
    assert line.ids == default.ids == fim_prompt(tok, PREFIX, SUFFIX)
    assert line.stops == stop_fields(fim, "line", PREFIX) and line.fim_stop == "line"
    assert default.stops == stop_fields(fim, R.DEFAULT_FIM_STOP, PREFIX) and default.fim_stop == "block"
    assert raw.ids == tok("abc", add_special_tokens=False).input_ids and raw.stops == {} and raw.fim_stop is None
    # every shipped FIM prompt becomes prefix marker ... suffix marker ... middle marker
    shipped, _ = R.tokenize_prompts(load_prompt_set("fim:dev"), tok, 64, 100_000)
    assert all(p.ids[0] == fim.prefix and p.ids[-1] == fim.middle and fim.suffix in p.ids for p in shipped)
    assert all(p.stops["stop_token_ids"] == fim.end for p in shipped)


def test_a_fim_prompt_on_a_model_without_fim_tokens_is_a_bench_input_error():
    with pytest.raises(R.BenchInputError, match="fill-in-the-middle"):
        R.tokenize_prompts([fim_prompt_of("p")], make_tokenizer(32), 8, 4096)


def test_bench_runs_fim_prompts_with_their_stop_rules_and_greedy_outputs_agree(tmp_path):
    target, draft = pair()
    tok = make_fim_tokenizer()
    fim = fim_tokens(tok)
    engines = {0: make_engine(target, tok, num_slots=1), 3: make_engine(target, tok, draft, k=3, num_slots=1)}
    backend = R.Backend(
        engine_for=lambda c: engines[c.k],
        hf_for=None,
        target_logits=None,
        eos_token_ids=[tok.eos_token_id],
        logit_eps=1e-6,
    )
    rules = ("none", "line", "block")
    prompts, _ = R.tokenize_prompts([fim_prompt_of(f"fim/{rule}", rule=rule, new=24) for rule in rules], tok, 8, 4096)
    store = R.RecordStore(tmp_path / "records.jsonl")
    R.BenchRunner(
        backend, prompts, R.make_configs([3], []), [SamplingSetting(0.0)], 1, store, warmup_tokens=2, progress=False
    ).run()
    runs = {(r["prompt_id"], r["config"]): r for r in store.records if r["type"] == "run"}
    for rule in ("none", "line", "block"):
        want = make_engine(target, tok, num_slots=1).generate(
            [fim_prompt(tok, PREFIX, SUFFIX)],
            SamplingSetting(0.0).params(max_new_tokens=24, ignore_eos=True, **stop_fields(fim, rule, PREFIX)),
        )[0]
        for config in (R.TARGET, "spec-k3"):
            run = runs[(f"fim/{rule}", config)]
            assert run["token_ids"] == want.token_ids and run["finish_reason"] == want.finish_reason
            assert run["prompt_tokens"] == len(fim_prompt(tok, PREFIX, SUFFIX)) and run["fim_stop"] == rule
    assert all(c["match"] for c in store.records if c["type"] == "check")
    # the rules cut: the line rule ends sooner than none
    assert len(runs[("fim/line", R.TARGET)]["token_ids"]) < len(runs[("fim/none", R.TARGET)]["token_ids"])


# -- the load generator ----------------------------------------------------------------------------
def test_request_body_sends_the_suffix_and_the_editor_rule():
    line = fim_prompt_of("a", rule="line")
    block = fim_prompt_of("b", rule="block")
    path, body = request_body(Target("A", "http://x"), line, 16)
    assert path == "/v1/completions" and (body["prompt"], body["suffix"], body["stop"]) == (PREFIX, SUFFIX, ["\n"])
    assert "fim_stop" not in body
    _, body = request_body(Target("A", "http://x"), block, 16)
    assert body["suffix"] == SUFFIX and "stop" not in body and "fim_stop" not in body  # no portable block rule
    ours = Target("A", "http://x", fim_stop=True)
    for prompt in (line, block):
        _, body = request_body(ours, prompt, 16)
        assert body["fim_stop"] == prompt.fim_stop and "stop" not in body
    _, body = request_body(Target("A", "http://x", extra_body={"stop": ["\n\n"]}), line, 16)
    assert body["stop"] == ["\n\n"]  # the user's own fields win
    _, body = request_body(Target("A", "http://x"), Prompt("c", "c", "abc", None, "completion"), 16)
    assert "suffix" not in body and "stop" not in body


def test_load_sends_the_suffix_to_an_openai_endpoint():
    prompts = load_prompt_set("fim:dev", n=3)
    behaviour = Behaviour(first_token_s=0.0, token_interval_s=0.0)
    with FakeServer(behaviour) as server:
        result = run_sweep(
            LoadConfig(
                targets=[Target("A", server.url)],
                prompts=prompts,
                levels=[1],
                num_requests=3,
                duration_s=600,
                output_len=None,
                request_timeout_s=120,
            )
        )
    assert all(r.ok for run in result.levels for r in run.records)
    sent = {b["prompt"]: b for b in behaviour.bodies}
    assert len(sent) == 3
    for p in prompts:
        body = sent[p.text]
        assert body["suffix"] == p.suffix and body["max_tokens"] == p.max_new_tokens
        assert body.get("stop") == (["\n"] if p.fim_stop == "line" else None)


def test_load_fim_prompts_against_our_server():
    target, draft = pair()
    tok = make_fim_tokenizer()
    prompts = [fim_prompt_of("p/0", rule="line"), fim_prompt_of("p/1", "x = a + b\n", "\nprint(x)\n", "block")]
    eng = make_engine(target, tok, draft, k=3, num_slots=2, **serving())
    with serve(eng) as served:
        targets = [
            Target(label, served.url, extra_body={"temperature": 0}, fim_stop=label == "fim_stop")
            for label in ("stop", "fim_stop")
        ]
        result = run_sweep(
            LoadConfig(
                targets=targets,
                prompts=prompts,
                levels=[2],
                num_requests=4,
                duration_s=600,
                output_len=(12, 12),
                request_timeout_s=120,
                api_key=KEY,
            )
        )
        served.wait_idle()
    records = [r for run in result.levels for r in run.records]
    assert len(records) == 8 and all(r.ok for r in records), [r.error_detail for r in records]
    by_id = {p.id: len(fim_prompt(tok, p.text, p.suffix)) for p in prompts}
    assert all(r.prompt_tokens == by_id[r.prompt_id] for r in records)  # the server formatted prefix + suffix


def test_an_hf_run_past_the_editor_rule_checks_up_to_the_cut():
    runner = R.BenchRunner(None, [], [], [], 1, None)
    fim = R.BenchPrompt("p", "fim", "completion", [1, 2], 8, {}, "block")
    plain = R.BenchPrompt("q", "c", "completion", [1, 2], 8)
    ran_on = runner.compare(fim, "greedy", "hf", 0, [5, 6], [5, 6, 7, 8])
    assert ran_on["match"] and ran_on["past_fim_stop"]
    assert not runner.compare(plain, "greedy", "hf", 0, [5, 6], [5, 6, 7, 8])["match"]  # no rule: an early stop
    assert not runner.compare(fim, "greedy", "hf", 0, [5, 6, 7], [5, 6])["match"]  # the cut is the target's only
