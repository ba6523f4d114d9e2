"""Prompt sets: Spec-Bench parsing and sampling, HumanEval, user JSONL, and error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.bench import prompts as P
from specdecode.bench.prompts import Prompt, PromptSetError


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _spec_bench_rows() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    qid = 0
    for category in ["writing", "coding", "translation", "qa", "summarization", "math_reasoning", "rag"]:
        for _ in range(5):
            qid += 1
            rows.append({"question_id": qid, "category": category, "turns": [f"first {qid}", f"second {qid}"]})
    return rows


@pytest.fixture
def spec_bench(tmp_path: Path) -> Path:
    return _write_jsonl(tmp_path / "question.jsonl", _spec_bench_rows())


def test_spec_bench_maps_categories_and_uses_first_turn(spec_bench: Path) -> None:
    prompts = P.load_spec_bench(spec_bench)
    assert [p.category for p in prompts].count("mt_bench") == 10  # writing + coding
    assert {p.category for p in prompts} == set(P.SPEC_BENCH_CATEGORIES)
    first = next(p for p in prompts if p.id == "spec-bench/1")
    assert first.kind == "chat" and first.text is None
    assert first.messages == [{"role": "user", "content": "first 1"}]


def test_spec_bench_sampling_is_seeded_and_independent_of_file_order(spec_bench: Path, tmp_path: Path) -> None:
    shuffled = _write_jsonl(tmp_path / "shuffled.jsonl", _spec_bench_rows()[::-1])
    a = P.load_spec_bench(spec_bench, n_per_category=2, seed=3)
    b = P.load_spec_bench(shuffled, n_per_category=2, seed=3)
    assert [p.id for p in a] == [p.id for p in b]
    assert len(a) == 12
    only_qa = P.load_spec_bench(spec_bench, categories=["qa"], n_per_category=2, seed=3)
    assert [p.id for p in only_qa] == [p.id for p in a if p.category == "qa"]
    seeds = {tuple(p.id for p in P.load_spec_bench(spec_bench, n_per_category=2, seed=s)) for s in range(6)}
    assert len(seeds) > 1


def test_spec_bench_env_var_and_missing_file(spec_bench: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(P.SPEC_BENCH_ENV, str(spec_bench))
    assert len(P.load_prompt_set("spec-bench", n=1)) == 6
    monkeypatch.setenv(P.SPEC_BENCH_ENV, str(tmp_path / "nope.jsonl"))
    with pytest.raises(PromptSetError, match=r"nope\.jsonl.*SPECDECODE_SPEC_BENCH"):
        P.load_spec_bench()


def test_spec_bench_errors(spec_bench: Path, tmp_path: Path) -> None:
    with pytest.raises(PromptSetError, match=r"unknown category \['poetry'\].*mt_bench"):
        P.load_spec_bench(spec_bench, categories=["poetry"])
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question_id": 1, "category": "limericks", "turns": ["x"]}])
    with pytest.raises(PromptSetError, match=r"bad\.jsonl:1: unknown Spec-Bench category"):
        P.load_spec_bench(bad)
    with pytest.raises(PromptSetError, match="must be positive"):
        P.load_spec_bench(spec_bench, n_per_category=0)


def test_real_spec_bench_file() -> None:
    assert P.DEFAULT_SPEC_BENCH_PATH == P.PACKAGED_SPEC_BENCH_PATH  # shipped: works out of the box
    assert (P.PACKAGED_SPEC_BENCH_PATH.parent / "NOTICE").is_file()
    prompts = P.load_spec_bench(P.DEFAULT_SPEC_BENCH_PATH)
    counts = {c: sum(p.category == c for p in prompts) for c in P.SPEC_BENCH_CATEGORIES}
    assert counts == {c: 80 for c in P.SPEC_BENCH_CATEGORIES}
    assert len(P.load_spec_bench(P.DEFAULT_SPEC_BENCH_PATH, n_per_category=4)) == 24


def test_humaneval() -> None:
    prompts = P.load_humaneval()
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and prompts[10].id == "HumanEval/10"
    assert all(p.kind == "completion" and p.text and p.messages is None for p in prompts)
    sample = P.load_prompt_set("humaneval", n=5, seed=1)
    assert len(sample) == 5 and sample == P.load_humaneval(5, seed=1)
    with pytest.raises(PromptSetError, match="no categories"):
        P.load_prompt_set("humaneval", categories=["qa"])


def test_jsonl_prompts(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"prompt": "def f():"},
            {"messages": [{"role": "user", "content": "hi"}], "id": "greet", "category": "chat", "max_new_tokens": 7},
        ],
    )
    completion, chat = P.load_jsonl(path)
    assert completion == Prompt("mine/1", "custom", "def f():", None, "completion")
    assert chat.kind == "chat" and chat.id == "greet" and chat.max_new_tokens == 7
    assert [p.id for p in P.load_prompt_set(str(path), categories=["chat"])] == ["greet"]
    with pytest.raises(PromptSetError, match=r"unknown category \['qa'\].*'chat', 'custom'"):
        P.load_prompt_set(str(path), categories=["qa"])


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"bad\.jsonl:2: invalid JSON"),
        ("[1, 2]", r"bad\.jsonl:2: expected a JSON object"),
        ('{"text": "x"}', r"bad\.jsonl:2: needs exactly one of 'prompt' or 'messages'"),
        ('{"prompt": "a", "messages": []}', r"bad\.jsonl:2: needs exactly one"),
        ('{"messages": [{"role": "user"}]}', r"bad\.jsonl:2: messages\[0\] must be"),
        ('{"prompt": "a", "max_new_tokens": -1}', r"bad\.jsonl:2: 'max_new_tokens' must be"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(PromptSetError, match=message):
        P.load_jsonl(path)


def test_missing_empty_and_unknown_sets(tmp_path: Path) -> None:
    with pytest.raises(PromptSetError, match="prompt file not found"):
        P.load_prompt_set(str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(PromptSetError, match="holds no prompts"):
        P.load_jsonl(empty)
    with pytest.raises(PromptSetError, match="unknown prompt set 'mmlu'"):
        P.load_prompt_set("mmlu")
    assert issubclass(PromptSetError, ValueError)
