"""Session workloads (editor replay, chat turns) and the load runner's sessions against a fake server."""

from __future__ import annotations

import json
import random
from itertools import pairwise
from pathlib import Path

import pytest
from fake_openai import Behaviour, FakeServer

from specdecode.bench.prompts import Prompt, PromptSetError, load_prompt_set
from specdecode.bench.sessions import needs_history, sessions, with_history
from specdecode.load.client import Target
from specdecode.load.report import write_outputs
from specdecode.load.runner import LoadConfig, plan_requests, plan_units, run_sweep, session_rounds
from specdecode.load.stats import Slo, summarize


def test_editor_replay_types_the_reference_then_jumps() -> None:
    prompts = load_prompt_set("editor_replay:dev", n=3, seed=1)
    units = sessions(prompts)
    assert len(units) == 3 and sum(map(len, units)) == len(prompts)
    lines = Path("specdecode/data/code_workloads/fim.jsonl").read_text().splitlines()
    rows = {r["id"]: r for r in map(json.loads, lines)}
    for unit in units:
        row = rows[unit[0].session.removeprefix("editor/")]
        assert row["split"] == "dev"
        assert [p.turn for p in unit] == list(range(len(unit)))
        assert len({p.id for p in unit}) == len(unit)
        typing = [p for p in unit if p.suffix == row["suffix"]]
        # the cursor arrives (nothing typed), the reference is typed in growing steps, all of it at the end
        assert typing[0].text == row["prefix"] and typing[-1].text == row["prefix"] + row["reference"]
        assert all(b.text.startswith(a.text) and len(b.text) > len(a.text) for a, b in pairwise(typing))
        assert len(typing) <= 13
        window = row["prefix"] + row["reference"] + row["suffix"]
        jumps = unit[len(typing) :]
        assert jumps, "the cursor jumps elsewhere after the reference"
        for p in jumps:  # a line retyped: the text before and after the cursor is the file's
            assert p.is_fim and window.startswith(p.text.rsplit("\n", 1)[0])
            assert window.endswith(p.suffix)
        assert all(p.fim_stop == row.get("fim_stop") and p.max_new_tokens == row.get("max_new_tokens") for p in unit)
    assert load_prompt_set("editor_replay:dev", n=3, seed=1) == prompts  # deterministic
    assert {p.session for p in load_prompt_set("editor_replay:test", n=2)}.isdisjoint({p.session for p in prompts})


def test_chat_turns_carry_the_earlier_answer() -> None:
    prompts = load_prompt_set("chat_turns", n=2, seed=3)
    assert [p.turn for p in prompts] == [0, 1, 0, 1]
    first, second = prompts[0], prompts[1]
    assert first.session == second.session and not needs_history(first) and needs_history(second)
    assert second.messages[0] == first.messages[0] and second.messages[1] == {"role": "assistant", "content": None}
    filled = with_history(second, ["the answer"])
    assert filled.messages[1]["content"] == "the answer" and not needs_history(filled)
    with pytest.raises(ValueError, match="earlier answer"):
        with_history(second, [])
    with pytest.raises(ValueError, match="needs a session"):
        Prompt("x", "c", None, [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}], "chat")
    with pytest.raises(PromptSetError, match="no splits"):
        load_prompt_set("chat_turns:dev")
    with pytest.raises(PromptSetError, match="bad split"):
        load_prompt_set("editor_replay:train")


def _chat(session: str | None, turn: int, slot: bool = False) -> Prompt:
    messages = [{"role": "user", "content": "q"}]
    if slot:
        messages += [{"role": "assistant", "content": None}, {"role": "user", "content": "q2"}]
    return Prompt(f"{session}/{turn}", "c", None, messages, "chat", session=session, turn=turn)


def _config(url: str, prompts: list[Prompt], **kw: object) -> LoadConfig:
    defaults: dict[str, object] = {"levels": [2], "num_requests": 6, "duration_s": 600, "output_len": (4, 4)}
    return LoadConfig(targets=[Target("A", url)], prompts=prompts, **{**defaults, **kw})  # type: ignore[arg-type]


def test_plain_prompts_plan_as_before() -> None:
    prompts = [Prompt(f"p/{i}", "c", f"text {i}", None, "completion") for i in range(5)]
    config = _config("http://x", prompts, num_requests=12)
    rng = random.Random(config.seed)  # the plan before sessions existed: shuffle, cycle
    order = list(prompts)
    rng.shuffle(order)
    assert [p for p, _ in plan_requests(config)] == [order[i % 5] for i in range(12)]
    assert plan_units(plan_requests(config)) == [range(i, i + 1) for i in range(12)]


def test_sessions_stay_whole_in_the_plan_and_its_slices() -> None:
    prompts = [_chat("a", 0), _chat("a", 1, True), _chat("b", 0), _chat("b", 1, True), _chat(None, 0)]
    config = _config("http://x", prompts, num_requests=10, rounds=3)
    plan = plan_requests(config)
    units = plan_units(plan)
    for unit in units:
        turns = [plan[i][0] for i in unit]
        assert len({p.session for p in turns}) == 1 and [p.turn for p in turns] == list(range(len(turns)))
    assert sum(len(u) for u in units) == 10
    slices = session_rounds(plan, 3)
    assert [i for s in slices for i in s] == list(range(10))
    starts = {u.start for u in units}
    assert all(s.start in starts for s in slices)


def test_a_session_goes_in_order_with_its_answers_and_cache_counts() -> None:
    prompts = [_chat("a", 0), _chat("a", 1, True), _chat("b", 0), _chat("b", 1, True)]
    behaviour = Behaviour(first_token_s=0.01, token_interval_s=0.001, cached_tokens=2)
    with FakeServer(behaviour) as server:
        result = run_sweep(_config(server.url, prompts, num_requests=4))
    run = result.levels[0]
    assert len(run.records) == 4 and all(r.ok for r in run.records)
    plan = plan_requests(_config(server.url, prompts, num_requests=4))
    by_index = {r.index: r for r in run.records}
    for unit in plan_units(plan):
        first, second = (by_index[i] for i in unit)
        assert second.start_s >= first.start_s + first.latency_s - 1e-6  # sent after the first ended
        assert first.text == "tok " * 4 and second.text is None  # the last turn's text is not kept
    seconds = [b for b in behaviour.bodies if len(b["messages"]) == 3]
    assert len(seconds) == 2 and all(b["messages"][1] == {"role": "assistant", "content": "tok " * 4} for b in seconds)
    assert summarize(run).cached_share == pytest.approx(2 / 3)


def test_a_failed_turn_ends_its_session(tmp_path) -> None:
    broken = Prompt("a/0", "c", None, [{"role": "user", "content": "status:500"}], "chat", session="a", turn=0)
    prompts = [broken, _chat("a", 1, True)]
    with FakeServer(Behaviour(first_token_s=0, token_interval_s=0)) as server:
        config = _config(server.url, prompts, num_requests=2, levels=[1])
        result = run_sweep(config)
    run = result.levels[0]
    assert run.issued == 1 and [r.error for r in run.records] == ["http_500"]
    write_outputs(result, config, Slo(), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert rows and all("text" not in row and "cached_tokens" in row for row in rows)


def test_bench_refuses_later_chat_turns() -> None:
    from specdecode.bench.runner import BenchInputError, tokenize_prompts

    with pytest.raises(BenchInputError, match="specdecode load"):
        tokenize_prompts(load_prompt_set("chat_turns", n=1)[1:], None, 8, 100_000)
