"""Workloads that repeat themselves as real traffic does: *sessions* of requests sharing most of a prompt.

- ``editor_replay``: someone typing in a real file (a ``fim`` row's window of a shipped source file:
  its prefix, the reference completion and its suffix). The cursor starts where the reference goes and
  the reference is typed a few characters (sometimes the rest of a line) at a time; every keystroke
  group sends a fill-in-the-middle request, prefix = the text before the cursor, suffix = the text after
  it. Then the cursor jumps to other lines of the file and retypes them. Successive requests share
  almost all of their text; which share of their *tokens* a prefix cache can reuse depends on the
  model's FIM order (:func:`reusable_prefix`): in prefix-suffix-middle order a keystroke changes the
  prompt right after the prefix, so the whole suffix is read again.
- ``chat_turns``: Spec-Bench's multi-turn (MT-Bench) questions; turn 2 carries turn 1's question and the
  endpoint's own answer to it in its history, as a chat client re-sends the conversation.

A session's requests go in order, each after the previous one ended (``load`` and ``bench`` keep them
whole). An assistant message whose content is ``None`` is a slot for the session's earlier answers,
filled in order by :func:`with_history` when the request is sent.
"""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import groupby

from specdecode.bench.prompts import (
    CODE_SPLITS,
    CODE_WORKLOADS_DIR,
    Prompt,
    PromptSetError,
    load_spec_bench,
    read_jsonl,
)

SESSION_WORKLOADS = ("editor_replay", "chat_turns")
KEYSTROKES = (1, 1, 2, 3, 4, 6, 8)  # characters typed between two requests (a line's rest, sometimes)
MAX_TYPING_REQUESTS = 12  # per typed stretch: a long reference is typed in larger groups
JUMPS = 2  # cursor jumps per session, each retyping one line


def editor_replay(split: str | None = None, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """One session per ``fim`` row of ``split`` (``n`` rows sampled by ``seed``), its requests in order."""
    if split is not None and split not in CODE_SPLITS:
        raise PromptSetError(f"bad split {split!r}: use editor_replay, editor_replay:dev or editor_replay:test")
    if n is not None and n <= 0:
        raise PromptSetError(f"number of sessions must be positive, got {n}")
    file = CODE_WORKLOADS_DIR / "fim.jsonl"
    rows = [row for _, row in read_jsonl(file) if split is None or row.get("split") == split]
    rows.sort(key=lambda row: str(row["id"]))
    if n is not None and n < len(rows):
        rows = [rows[i] for i in sorted(random.Random(f"{seed}:editor_replay").sample(range(len(rows)), n))]
    if not rows:
        raise PromptSetError(f"{file} holds no fim rows for split {split!r}")
    return [prompt for row in rows for prompt in _replay(row, seed)]


def _replay(row: dict, seed: int) -> list[Prompt]:
    rng = random.Random(f"{seed}:{row['id']}")
    prefix, reference, suffix = row["prefix"], row["reference"], row["suffix"]
    session = f"editor/{row['id']}"
    requests: list[tuple[str, str]] = [(prefix + reference[:i], suffix) for i in _typing(reference, rng)]
    window = prefix + reference + suffix
    starts = [i for i, line in _lines(window) if line.strip()]
    for _ in range(JUMPS):  # the cursor goes elsewhere in the file and a line is typed again
        start = rng.choice(starts)
        line = window[start:].split("\n", 1)[0]
        before, after = window[:start], window[start + len(line) :]
        requests += [(before + line[:i], after) for i in _typing(line, rng)]

    def prompt(turn: int, text: str, after: str) -> Prompt:
        return Prompt(
            id=f"{session}/{turn}",
            category="editor_replay",
            text=text,
            messages=None,
            kind="completion",
            max_new_tokens=row.get("max_new_tokens"),
            suffix=after,
            fim_stop=row.get("fim_stop"),
            session=session,
            turn=turn,
        )

    return [prompt(turn, text, after) for turn, (text, after) in enumerate(requests)]


def _typing(text: str, rng: random.Random) -> list[int]:
    """How much of ``text`` is typed at each request: 0 (the cursor just arrived), then growing by a few
    characters or the rest of a line, to all of it; at most :data:`MAX_TYPING_REQUESTS` + 1 requests."""
    least = -(-len(text) // MAX_TYPING_REQUESTS)  # a long stretch goes in larger groups
    typed, marks = 0, [0]
    while typed < len(text):
        line_end = text.find("\n", typed)
        step = max(least, rng.choice(KEYSTROKES))
        if line_end >= 0 and rng.random() < 0.25:  # an editor's completion accepted: the line's rest at once
            step = max(step, line_end + 1 - typed)
        typed = min(len(text), typed + step)
        marks.append(typed)
    return marks


def _lines(text: str) -> list[tuple[int, str]]:
    out, start = [], 0
    for line in text.split("\n"):
        out.append((start, line))
        start += len(line) + 1
    return out


def chat_turns(n: int | None = None, seed: int = 0, path=None) -> list[Prompt]:
    """Spec-Bench's two-turn questions as sessions: turn 1 the first question, turn 2 the conversation so
    far (the question, a slot for the endpoint's own answer, the second question). ``n`` sessions."""
    from specdecode.bench.prompts import _spec_bench_path

    file = _spec_bench_path(path)
    firsts = {p.id: p for p in load_spec_bench(path, ["mt_bench"], None, seed)}
    turns = {f"spec-bench/{row.get('question_id', lineno)}": row.get("turns") for lineno, row in read_jsonl(file)}
    sessions = [(pid, turns[pid]) for pid in firsts if isinstance(turns.get(pid), list) and len(turns[pid]) >= 2]
    if n is not None:
        if n <= 0:
            raise PromptSetError(f"number of sessions must be positive, got {n}")
        if n < len(sessions):
            chosen = sorted(random.Random(f"{seed}:chat_turns").sample(range(len(sessions)), n))
            sessions = [sessions[i] for i in chosen]
    if not sessions:
        raise PromptSetError(f"Spec-Bench ({file}) holds no multi-turn questions")
    prompts = []
    for pid, questions in sessions:
        messages: list[dict] = []
        for turn, question in enumerate(questions):
            messages = [*messages, {"role": "user", "content": question}]
            prompts.append(
                Prompt(
                    id=f"{pid}/{turn}",
                    category="chat_turns",
                    text=None,
                    messages=messages,
                    kind="chat",
                    session=pid,
                    turn=turn,
                )
            )
            messages = [*messages, {"role": "assistant", "content": None}]
    return prompts


def with_history(prompt: Prompt, answers: list[str]) -> Prompt:
    """``prompt`` with its answer slots filled, in order, from ``answers`` (the session's earlier answers)."""
    slots = [i for i, m in enumerate(prompt.messages or []) if m.get("role") == "assistant" and m["content"] is None]
    if not slots:
        return prompt
    if len(answers) < len(slots):
        raise ValueError(f"{prompt.id} needs {len(slots)} earlier answer(s) of its session, got {len(answers)}")
    messages = [dict(m) for m in prompt.messages or []]
    for slot, answer in zip(slots, answers[-len(slots) :]):
        messages[slot]["content"] = answer
    return replace(prompt, messages=messages)


def needs_history(prompt: Prompt) -> bool:
    """Whether ``prompt`` holds slots for earlier answers (it cannot be sent before they are known)."""
    return any(m.get("role") == "assistant" and m.get("content") is None for m in prompt.messages or [])


def sessions(prompts: list[Prompt]) -> list[list[Prompt]]:
    """``prompts`` as units that go in order: a session's requests (by turn), or one request alone."""
    units: list[list[Prompt]] = []
    for key, group in groupby(prompts, key=lambda p: p.session):
        items = list(group)
        units.extend([sorted(items, key=lambda p: p.turn)] if key is not None else [[p] for p in items])
    return units


def reusable_prefix(previous: list[int], current: list[int]) -> int:
    """Tokens of ``current`` a prefix cache holding ``previous`` can reuse: their common prefix."""
    n = 0
    for a, b in zip(previous, current):
        if a != b:
            break
        n += 1
    return n


def load_session_workload(spec: str, n: int | None = None, seed: int = 0, path=None) -> list[Prompt]:
    """``editor_replay[:dev|:test]`` or ``chat_turns`` (``n``: sessions)."""
    name, sep, split = spec.partition(":")
    if name == "editor_replay":
        return editor_replay(split if sep else None, n, seed)
    if name == "chat_turns":
        if sep:
            raise PromptSetError("chat_turns has no splits (Spec-Bench's MT-Bench questions)")
        return chat_turns(n, seed, path)
    raise PromptSetError(f"unknown session workload {spec!r}: {', '.join(SESSION_WORKLOADS)}")
